"""The numba.cuda kernels behind :mod:`rtmem.kernels.dha`, except the GEMM: the
bandwidth probes' kernels (read, write, read-modify-write, delay) and the
embedding, LayerNorm and column-sum kernels of the layers.

Device code only, split from dha.py, which keeps the launchers (checks, grids,
streams) and the public API. dha.py imports each kernel by name and launches it
from its own namespace, so tests that stub or compile the kernels find them there.
The GEMM stays in dha.py: its kernels are built per tile height by a factory next
to the launcher that picks the height.
"""

import math

import numba
from numba import cuda

from ._launch import THREADS, import_numba_cuda_arrays

import_numba_cuda_arrays()     # before the first compile (numpy >= 2.5)

_PARTIAL_ROWS = 64                   # rows per block of the column-sum kernels

# NOTE [ No min() / max() in device code ]
# numba >= 0.66 implements the builtins min and max as *args overloads, which
# numba.cuda cannot compile ("Signature mismatch: 2 argument types given, but
# function takes 1 arguments": numba issue #10753, still open with numba 0.68.1
# and numba-cuda 0.30.4). The kernels here compare explicitly instead;
# tests/test_dha_ptx.py checks that no kernel calls them.


@cuda.jit
def _read_kernel(words, partials):
    # XOR, not a sum: the checksum is exact and order-free, and needs no overflow.
    sm = cuda.shared.array(THREADS, numba.uint64)
    tid = cuda.threadIdx.x
    stride = cuda.gridDim.x * cuda.blockDim.x
    n = words.shape[0]
    i = cuda.blockIdx.x * cuda.blockDim.x + tid
    acc = numba.uint64(0)
    # 4 independent loads before their use: more requests in flight per thread,
    # which is what hides PCIe latency.
    while i + 3 * stride < n:
        a0 = words[i]
        a1 = words[i + stride]
        a2 = words[i + 2 * stride]
        a3 = words[i + 3 * stride]
        acc ^= numba.uint64(a0) ^ numba.uint64(a1) ^ numba.uint64(a2) ^ numba.uint64(a3)
        i += 4 * stride
    while i < n:
        acc ^= numba.uint64(words[i])
        i += stride
    sm[tid] = acc
    cuda.syncthreads()
    half = cuda.blockDim.x // 2
    while half > 0:
        if tid < half:
            sm[tid] ^= sm[tid + half]
        cuda.syncthreads()
        half //= 2
    if tid == 0:
        partials[cuda.blockIdx.x] = sm[0]


@cuda.jit
def _write_kernel(words, value):
    stride = cuda.gridDim.x * cuda.blockDim.x
    for i in range(cuda.grid(1), words.shape[0], stride):
        words[i] = value


@cuda.jit
def _rmw_kernel(words, mask):
    stride = cuda.gridDim.x * cuda.blockDim.x
    for i in range(cuda.grid(1), words.shape[0], stride):
        words[i] ^= mask


@cuda.jit
def _delay_kernel(loops):
    # one thread naps ~1 us per loop; the stream is busy, the SMs nearly idle
    for _ in range(loops):
        cuda.nanosleep(1000)


@cuda.jit(device=True)
def _block_sum(sm, value):
    """Sum of ``value`` over the block (blockDim.x a power of two <= THREADS)."""
    tid = cuda.threadIdx.x
    cuda.syncthreads()              # sm may still be read by a previous reduction
    sm[tid] = value
    cuda.syncthreads()
    half = cuda.blockDim.x // 2
    while half > 0:
        if tid < half:
            sm[tid] += sm[tid + half]
        cuda.syncthreads()
        half //= 2
    return sm[0]


@cuda.jit
def _embedding_fwd_kernel(weight, ids, out):
    V, H = weight.shape
    for t in range(cuda.blockIdx.x, ids.shape[0], cuda.gridDim.x):
        v = ids[t]
        if v < 0 or v >= V:
            # Never dereference a wild row of a mapped pointer: zero the output
            # row (with check=True the wrapper counted the ids and raised first).
            for h in range(cuda.threadIdx.x, H, cuda.blockDim.x):
                out[t, h] = 0
        else:
            for h in range(cuda.threadIdx.x, H, cuda.blockDim.x):
                out[t, h] = weight[v, h]


@cuda.jit
def _count_bad_ids_kernel(ids, n_rows, bad):
    for t in range(cuda.grid(1), ids.shape[0], cuda.gridDim.x * cuda.blockDim.x):
        v = ids[t]
        if v < 0 or v >= n_rows:
            cuda.atomic.add(bad, 0, 1)


@cuda.jit
def _fill_int32_kernel(a, value):
    for i in range(cuda.grid(1), a.shape[0], cuda.gridDim.x * cuda.blockDim.x):
        a[i] = value


@cuda.jit
def _embedding_link_kernel(ids, n_rows, head, nxt, bad):
    # Per vocabulary row, a linked list of the tokens that use it, built in HBM
    # scratch (V + T int32): the gradient kernel then writes each row of the
    # host-resident gradient once, with no atomics on host memory.
    for t in range(cuda.grid(1), ids.shape[0], cuda.gridDim.x * cuda.blockDim.x):
        v = ids[t]
        if v < 0 or v >= n_rows:
            cuda.atomic.add(bad, 0, 1)
            nxt[t] = -1
        else:
            nxt[t] = cuda.atomic.exch(head, v, numba.int32(t))


@cuda.jit
def _embedding_grad_kernel(grad_out, head, nxt, grad_weight, accumulate):
    V, H = grad_weight.shape
    for v in range(cuda.blockIdx.x, V, cuda.gridDim.x):
        first = head[v]
        if accumulate and first < 0:
            continue                 # untouched row: no PCIe traffic at all
        for h in range(cuda.threadIdx.x, H, cuda.blockDim.x):
            acc = numba.float32(0.0)
            t = first
            while t >= 0:
                acc += grad_out[t, h]
                t = nxt[t]
            if accumulate:
                grad_weight[v, h] += acc
            else:
                grad_weight[v, h] = acc


@cuda.jit
def _layernorm_fwd_kernel(x, gamma, beta, out, mean, rstd, eps, staged):
    T, H = x.shape
    sm = cuda.shared.array(THREADS, numba.float32)
    params = cuda.shared.array(0, numba.float32)     # 2*H floats when staged
    tid = cuda.threadIdx.x
    if staged:
        # gamma/beta cross PCIe once per block instead of once per row.
        for h in range(tid, H, cuda.blockDim.x):
            params[h] = gamma[h]
            params[H + h] = beta[h]
        cuda.syncthreads()
    fh = numba.float32(H)
    for r in range(cuda.blockIdx.x, T, cuda.gridDim.x):
        s = numba.float32(0.0)
        for h in range(tid, H, cuda.blockDim.x):
            s += x[r, h]
        mu = _block_sum(sm, s) / fh
        # Two passes (mean, then centred squares): no cancellation for rows with
        # a large mean, unlike E[x^2] - E[x]^2. The second pass also sums the
        # residuals, whose mean c corrects mu for the rounding of the first sum
        # (the corrected two-pass algorithm; var = mean(d^2) - c^2): a constant
        # row (variance 0) of 1e6 got mu one ulp off, var = ulp^2 >> eps, and
        # was normalized to +-1 (out = beta +- gamma) instead of 0. Divisions by
        # H, not products with 1/H (inexact), so that c is exact there.
        s = numba.float32(0.0)
        s2 = numba.float32(0.0)
        for h in range(tid, H, cuda.blockDim.x):
            d = x[r, h] - mu
            s += d
            s2 += d * d
        c = _block_sum(sm, s) / fh
        var = _block_sum(sm, s2) / fh - c * c
        # rounding can make it negative; not max(): NOTE [ No min() / max() in device code ]
        if var < numba.float32(0.0):
            var = numba.float32(0.0)
        rs = numba.float32(1.0) / math.sqrt(var + eps)
        # Centre with (x - mu) - c, not x - (mu + c): mu + c rounded to float32
        # is up to half an ulp of the mean off (5e-4 at 1e4), which for a row of
        # 1e4 + noise of 1e-2 shifted every output by ~0.05 * gamma; x - mu is
        # exact there and c is small, so this keeps float32 accuracy relative to
        # the row's spread. The saved mean is still the rounded mu + c.
        for h in range(tid, H, cuda.blockDim.x):
            g = params[h] if staged else gamma[h]
            b = params[H + h] if staged else beta[h]
            out[r, h] = ((x[r, h] - mu) - c) * rs * g + b
        if tid == 0:
            mean[r] = mu + c
            rstd[r] = rs


@cuda.jit
def _layernorm_dx_kernel(grad_out, x, mean, rstd, gamma, grad_x, staged):
    T, H = x.shape
    sm = cuda.shared.array(THREADS, numba.float32)
    params = cuda.shared.array(0, numba.float32)     # H floats when staged
    tid = cuda.threadIdx.x
    if staged:
        for h in range(tid, H, cuda.blockDim.x):
            params[h] = gamma[h]
        cuda.syncthreads()
    inv_h = numba.float32(1.0) / numba.float32(H)
    for r in range(cuda.blockIdx.x, T, cuda.gridDim.x):
        mu = mean[r]
        rs = rstd[r]
        s1 = numba.float32(0.0)
        s2 = numba.float32(0.0)
        for h in range(tid, H, cuda.blockDim.x):
            g = grad_out[r, h] * (params[h] if staged else gamma[h])
            s1 += g
            s2 += g * (x[r, h] - mu) * rs
        m1 = _block_sum(sm, s1) * inv_h
        m2 = _block_sum(sm, s2) * inv_h
        for h in range(tid, H, cuda.blockDim.x):
            g = grad_out[r, h] * (params[h] if staged else gamma[h])
            grad_x[r, h] = rs * (g - m1 - (x[r, h] - mu) * rs * m2)


@cuda.jit
def _column_partials_kernel(grad_out, x, mean, rstd, partials, with_xhat):
    # partials[0, c, h] = sum over the rows of chunk c of grad_out[:, h], and when
    # with_xhat, partials[1, c, h] = sum of grad_out * xhat (LayerNorm's dgamma).
    # Threads run along h: coalesced reads, no atomics, deterministic order.
    T, H = grad_out.shape
    h = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if h >= H:
        return
    for c in range(cuda.blockIdx.y, partials.shape[1], cuda.gridDim.y):
        s0 = numba.float32(0.0)
        s1 = numba.float32(0.0)
        stop = (c + 1) * _PARTIAL_ROWS
        if stop > T:                    # not min(): NOTE [ No min() / max() in device code ]
            stop = T
        for r in range(c * _PARTIAL_ROWS, stop):
            g = grad_out[r, h]
            s0 += g
            if with_xhat:
                s1 += g * (x[r, h] - mean[r]) * rstd[r]
        partials[0, c, h] = s0
        if with_xhat:
            partials[1, c, h] = s1


@cuda.jit
def _column_finish_kernel(partials, which, out, accumulate):
    # One write (or read-add-write) per gradient element into (host) memory.
    for h in range(cuda.grid(1), out.shape[0], cuda.gridDim.x * cuda.blockDim.x):
        s = numba.float32(0.0)
        for c in range(partials.shape[1]):
            s += partials[which, c, h]
        if accumulate:
            out[h] += s
        else:
            out[h] = s
