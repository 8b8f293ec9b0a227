"""Direct-Host-Access (DHA) kernels: numba.cuda kernels that read and write host memory.

A kernel dereferences a pointer into pinned, device-mapped host memory exactly as
it would one into HBM; every access then crosses PCIe (MemFerry §2.1, reference
notes ``memferry.md`` §2). These kernels take any array exposing
``__cuda_array_interface__`` (numba device or mapped arrays, CuPy arrays, rtmem
Buffers), so the same launch runs with the weight in HBM (on-GPU mode) or in mapped
host memory (DHA mode), which is how ``bench/dha_layers.py`` compares the modes.

Two families:

* bandwidth probes (:func:`dha_read`, :func:`dha_write`, :func:`dha_rmw`):
  coalesced, grid-stride, 4 independent loads in flight per thread, on a 4- or
  8-byte word view of the buffer (benchmarks B2/B3 of §9.1);
* the paper's parameterized layers, forward and backward: embedding gather,
  LayerNorm, linear (tiled GEMM). Weights may live in host memory; activations are
  expected in HBM. Every backward can write the weight gradient straight into
  host memory (GO-MemFerry, §5), overwriting it or, with ``accumulate=True``,
  adding to it. Each gradient element is written exactly once per call (no
  atomics on host memory, which PCIe does not make atomic with respect to the CPU).

NOTE [ Asynchrony and visibility ]
    Wrappers enqueue on ``stream`` and return without waiting (except the id check
    of the embedding, see ``check``). Host memory written by a kernel is visible
    to the CPU only after the stream (or an event recorded after the launch) has
    completed; the CPU must not update a weight a kernel may still be reading.

NOTE [ Precision ]
    Layer kernels take float32 data and accumulate in float32, like cuBLAS SGEMM
    without TF32. Ids are int32 or int64. Results read from mapped memory are
    bitwise equal to the same launch on HBM copies (same code, same order), except
    the embedding backward, whose per-row summation order follows the atomic list
    build and may differ between runs.

NOTE [ PCIe traffic per call ] (bytes crossing the link when the weight is mapped)
    embedding fwd: T*H*4 (only gathered rows); bwd: V*H*4 written (dense) or
    rows_touched*H*4 read+written with accumulate.
    LayerNorm fwd/bwd: 2*H*4 per block (gamma/beta staged in shared memory);
    parameter grads 2*H*4 written.
    linear fwd: N*K*4*k (the GEMM re-reads each weight tile once per tile row of
    x, 32*r tokens tall: re-read factor k = ceil(T/(32*r)), with r in 1..8 chosen
    per shape by gemm_row_tiles; linear_weight_reads gives k); bwd grad_x:
    N*K*4*k likewise; grad_weight: N*K*4 written (twice that with accumulate).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import cuda

from rtmem.errors import KernelArgumentError

# By name: every launch below looks its kernel up in this module, which is where
# the bench tests stub the kernels and tests/_ptx_compile.py finds them.
from ._dha_kernels import (_PARTIAL_ROWS, _column_finish_kernel, _column_partials_kernel,
                           _count_bad_ids_kernel, _delay_kernel, _embedding_fwd_kernel,
                           _embedding_grad_kernel, _embedding_link_kernel, _fill_int32_kernel,
                           _layernorm_dx_kernel, _layernorm_fwd_kernel, _read_kernel,
                           _rmw_kernel, _write_kernel)
from ._launch import (THREADS, as_device, check_array, check_count, check_disjoint,
                      check_embedding, check_eps, check_flag, check_layernorm_backward,
                      check_layernorm_forward, check_linear, device_words, grid_size,
                      numba_stream, row_threads, scratch, simulator_active, sm_count,
                      stream_blocks, synchronize, word_value)

__all__ = ["dha_read", "dha_write", "dha_rmw", "xor_checksum", "gpu_delay",
           "embedding_forward", "embedding_backward",
           "layernorm_forward", "layernorm_backward",
           "linear_forward", "linear_backward", "GEMM_TILE", "GEMM_ROW_TILES",
           "gemm_row_tiles", "linear_weight_reads"]

#: Output tile width of the GEMM, and its height unit: a block of 32 x 8 threads
#: computes a (GEMM_TILE * r) x GEMM_TILE tile of the output, 4 * r outputs per
#: thread, for r in GEMM_ROW_TILES.
GEMM_TILE = 32
#: Tile heights (in GEMM_TILE rows) the GEMM is built for. A taller tile re-reads
#: the op(b) operand (the weight of a linear layer) fewer times: once per tile row,
#: ceil(M / (GEMM_TILE * r)) times in all (see :func:`gemm_row_tiles`).
GEMM_ROW_TILES = (1, 2, 4, 8)
_GEMM_ROWS = 8                       # blockDim.y of the GEMM
_PER_THREAD = GEMM_TILE // _GEMM_ROWS
# Row length of the GEMM's shared tiles (one float of padding: no bank conflicts on
# the transposed stores). A module constant because numba needs shared-array shapes
# to be compile-time constants: ``GEMM_TILE + 1`` written in the kernel is typed
# as a run-time int64 and fails to compile (the simulator does not type kernels).
_TILE_PAD = GEMM_TILE + 1
# Bytes of gamma/beta staged in (dynamic) shared memory. A launch may use at most
# 48 KiB of static + dynamic shared memory without opting in per kernel
# (cudaFuncAttributeMaxDynamicSharedMemorySize), and the LayerNorm kernels also
# hold a static THREADS-float reduction array; the simulator does not check this.
_MAX_SHARED_PARAMS = 48 * 1024 - THREADS * 4

# =================================================================== kernels


@cuda.jit(device=True)
def _element(src, row, col):
    # src[row, col], or 0 outside src (the ragged edge of a GEMM tile)
    if row < src.shape[0] and col < src.shape[1]:
        return src[row, col]
    return numba.float32(0.0)


def _make_gemm_kernel(row_tiles: int):
    """The GEMM kernel for output tiles of ``GEMM_TILE * row_tiles`` rows x
    ``GEMM_TILE`` columns (one numba specialization per height: shared and local
    array shapes must be compile-time constants, which closure variables are)."""
    tile_m = GEMM_TILE * row_tiles
    per_thread = _PER_THREAD * row_tiles

    def gemm(a, b, c, bias, trans_a, trans_b, accumulate, has_bias):
        # c[M, N] (=|+=) op(a) @ op(b) (+ bias[N]); op(a) is [M, K], op(b) is [K, N].
        # Tiles are loaded so that consecutive threadIdx.x read consecutive
        # addresses in either layout (coalesced PCIe requests when a or b is
        # mapped). Every c[m, n] sums k in ascending order whatever the tile
        # height, so all heights give bitwise-equal results.
        M, N = c.shape
        K = a.shape[0] if trans_a else a.shape[1]
        sa = cuda.shared.array((tile_m, _TILE_PAD), numba.float32)     # [m][k]
        sb = cuda.shared.array((GEMM_TILE, _TILE_PAD), numba.float32)  # [k][n]
        acc = cuda.local.array(per_thread, numba.float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tiles_m = (M + tile_m - 1) // tile_m
        tiles_n = (N + GEMM_TILE - 1) // GEMM_TILE
        for tm in range(cuda.blockIdx.y, tiles_m, cuda.gridDim.y):
            for tn in range(cuda.blockIdx.x, tiles_n, cuda.gridDim.x):
                m0 = tm * tile_m
                n0 = tn * GEMM_TILE
                for i in range(per_thread):
                    acc[i] = 0
                for k0 in range(0, K, GEMM_TILE):
                    for i in range(per_thread):
                        r = ty + i * _GEMM_ROWS
                        if trans_a:       # a stored [K, M]: r -> (k row, 32-column block of m)
                            kr = r % GEMM_TILE
                            mc = (r // GEMM_TILE) * GEMM_TILE + tx
                            sa[mc, kr] = _element(a, k0 + kr, m0 + mc)
                        else:             # a stored [M, K]
                            sa[r, tx] = _element(a, m0 + r, k0 + tx)
                    for i in range(_PER_THREAD):
                        r = ty + i * _GEMM_ROWS
                        if trans_b:       # b stored [N, K]
                            sb[tx, r] = _element(b, n0 + r, k0 + tx)
                        else:             # b stored [K, N]
                            sb[r, tx] = _element(b, k0 + r, n0 + tx)
                    cuda.syncthreads()
                    for kk in range(GEMM_TILE):
                        bv = sb[kk, tx]
                        for i in range(per_thread):
                            acc[i] += sa[ty + i * _GEMM_ROWS, kk] * bv
                    cuda.syncthreads()
                n = n0 + tx
                for i in range(per_thread):
                    m = m0 + ty + i * _GEMM_ROWS
                    if m < M and n < N:
                        v = acc[i]
                        if has_bias:
                            v += bias[n]
                        if accumulate:
                            c[m, n] += v
                        else:
                            c[m, n] = v

    gemm.__name__ = gemm.__qualname__ = f"_gemm_kernel_{row_tiles}"
    return cuda.jit(gemm)


#: The GEMM kernels by tile height (in GEMM_TILE rows). Compiled lazily, on a
#: height's first launch.
_GEMM_KERNELS = {r: _make_gemm_kernel(r) for r in GEMM_ROW_TILES}


# ================================================================= wrappers

def dha_read(src, *, width: int = 8, blocks: int | None = None, stream=0, out=None):
    """Stream every byte of ``src`` through the SMs (DHA read bandwidth probe).

    ``src``: any C-contiguous device or mapped array, read as ``width``-byte
    unsigned words (``width`` 4 or 8; its size in bytes must be a multiple).
    ``blocks``: grid size (default :func:`~rtmem.kernels._launch.stream_blocks`),
    ``THREADS`` threads each. Returns a device array of ``blocks`` uint64 partial
    XOR checksums; :func:`xor_checksum` folds them (the result keeps the compiler
    from dropping the loads). Bytes read: ``src.nbytes``. ``out``: an optional
    uint64 device array of at least ``blocks`` entries to reuse (a benchmark loop
    then allocates nothing); the partials are its first ``blocks`` entries.
    """
    words, n = device_words(src, width, "src")
    grid = grid_size(blocks, n)
    if out is None:
        out = cuda.device_array(grid, dtype=np.uint64)
    else:
        out = as_device(out, "out")
        check_array(out, "out", ndim=1, dtypes=(np.dtype(np.uint64),))
        if out.shape[0] < grid:
            raise KernelArgumentError(f"out holds {out.shape[0]} partials but the grid "
                                      f"has {grid} blocks; pass blocks= or a longer out",
                                      argument="out")
        # blocks store their partials while others may still be reading src
        check_disjoint({"out": out[:grid]}, {"src": words})
    launch = numba_stream(stream)
    _read_kernel[grid, THREADS, launch](words, out)
    # bound to the launch stream, so that reading the partials back
    # (xor_checksum) is ordered after this kernel, not after the legacy stream
    return out[:grid].bind(launch)


def xor_checksum(partials) -> int:
    """Fold the partial checksums of :func:`dha_read` (device or host) to one int:
    the XOR of every word read. Device partials are copied back on the stream
    they are bound to (:func:`dha_read` binds its launch stream), which is then
    synchronized: the result is that of the finished kernel."""
    if hasattr(partials, "copy_to_host"):
        stream = getattr(partials, "stream", 0)
        host = partials.copy_to_host(stream=stream)
        if stream:
            stream.synchronize()
    else:
        host = partials
    return int(np.bitwise_xor.reduce(np.asarray(host, dtype=np.uint64)))


def gpu_delay(seconds: float, *, stream=0) -> None:
    """Keep ``stream`` busy for roughly ``seconds`` (one single-thread kernel of
    ~1 us naps; ``__nanosleep`` only promises between 0 and twice each nap, so
    callers that need a minimum check it, as bench/pcie.py's Timer does).

    For timing with CUDA events: queue the delay, then the start event, the work
    and the end event. The GPU reaches the start event only after the host has
    queued everything, so the events bracket device time, not Python's launch
    overhead. A no-op under the CUDA simulator (no ``nanosleep``, no timings).
    """
    if not (isinstance(seconds, (int, float, np.number)) and 0 <= seconds < math.inf):
        raise KernelArgumentError(f"gpu_delay needs a finite number of seconds >= 0, "
                                  f"got {seconds!r}", argument="seconds")
    if simulator_active():
        return
    _delay_kernel[1, 1, numba_stream(stream)](max(1, int(seconds * 1e6)))


def dha_write(dst, value: int, *, width: int = 8, blocks: int | None = None, stream=0):
    """Fill ``dst`` with the ``width``-byte word ``value`` (DHA write bandwidth probe).

    Bytes written: ``dst.nbytes`` (``width`` 4 or 8 bytes per store, coalesced).
    """
    words, n = device_words(dst, width, "dst")
    value = word_value(value, width)
    _write_kernel[grid_size(blocks, n), THREADS, numba_stream(stream)](words, value)


def dha_rmw(buf, mask: int, *, width: int = 8, blocks: int | None = None, stream=0):
    """XOR every ``width``-byte word of ``buf`` with ``mask`` in place
    (read-modify-write probe: ``buf.nbytes`` bytes read, then written)."""
    words, n = device_words(buf, width, "buf")
    mask = word_value(mask, width)
    _rmw_kernel[grid_size(blocks, n), THREADS, numba_stream(stream)](words, mask)


def _zeroed_counter(s):
    # Zeroed by a kernel, not cuda.to_device: a copy from pageable memory would
    # synchronize and distort every timing of the layer.
    bad = scratch("bad-ids", 1, np.int32, s)
    _fill_int32_kernel[1, 32, s](bad, 0)
    return bad


def _raise_bad_ids(bad, stream, n_rows):
    # called before the kernel that writes the output is launched
    host = bad.copy_to_host(stream=stream)
    synchronize(stream)
    if int(host[0]):
        raise KernelArgumentError(
            f"{int(host[0])} token id(s) outside [0, {n_rows}); nothing was written. "
            "Clamp or remap the ids", argument="ids")


def embedding_forward(weight, ids, out, *, stream=0, check: bool = True) -> None:
    """Gather rows: ``out[t, :] = weight[ids[t], :]``.

    ``weight`` [V, H] float32 (HBM or mapped host: DHA reads only the T*H*4 bytes
    of the gathered rows), ``ids`` [T] int32/int64, ``out`` [T, H] float32.
    Out-of-range ids are never dereferenced. With ``check`` (default) the wrapper
    counts them first, waits for that count and raises
    :class:`~rtmem.errors.KernelArgumentError` before anything is written; with
    ``check=False`` it stays asynchronous and their rows are zeroed.
    """
    weight, ids, out = (as_device(weight, "weight"), as_device(ids, "ids"),
                        as_device(out, "out"))
    V, H, _ = check_embedding(weight, ids, out, "weight", "out")
    check_disjoint({"out": out}, {"weight": weight, "ids": ids})
    s = numba_stream(stream)
    if check_flag(check, "check") and ids.shape[0]:
        bad = _zeroed_counter(s)
        _count_bad_ids_kernel[stream_blocks(ids.shape[0]), THREADS, s](ids, V, bad)
        _raise_bad_ids(bad, s, V)
    grid = stream_blocks(ids.shape[0], threads=1, blocks_per_sm=16)
    _embedding_fwd_kernel[grid, row_threads(H), s](weight, ids, out)


def embedding_backward(grad_out, ids, grad_weight, *, accumulate: bool = False, stream=0,
                       check: bool = True) -> None:
    """Weight gradient of the gather: ``grad_weight[v] (=|+=) sum_{t: ids[t]=v} grad_out[t]``.

    ``grad_out`` [T, H] float32, ``ids`` [T] int32/int64 (T < 2**31),
    ``grad_weight`` [V, H] float32, in HBM or mapped host memory (GO-MemFerry).
    ``accumulate=False`` writes every row (the dense V*H*4-byte gradient, zeros
    for unused rows); ``accumulate=True`` adds into the rows the ids touch and
    leaves the others untouched. Uses (V + T)*4 bytes of HBM scratch. The
    embedding backward never reads the weight. ``check`` as in
    :func:`embedding_forward` (with ``check=False`` tokens with bad ids are
    skipped).
    """
    grad_out, ids, grad_weight = (as_device(grad_out, "grad_out"), as_device(ids, "ids"),
                                  as_device(grad_weight, "grad_weight"))
    V, H, T = check_embedding(grad_weight, ids, grad_out, "grad_weight", "grad_out")
    check_disjoint({"grad_weight": grad_weight}, {"grad_out": grad_out, "ids": ids})
    accumulate, check = check_flag(accumulate, "accumulate"), check_flag(check, "check")
    if T >= 2**31:
        raise KernelArgumentError(f"{T} tokens exceed the int32 token lists; split the "
                                  "batch", argument="ids")
    s = numba_stream(stream)
    head = scratch("emb-head", V, np.int32, s)
    nxt = scratch("emb-next", max(T, 1), np.int32, s)
    _fill_int32_kernel[stream_blocks(V), THREADS, s](head, -1)
    if T:
        # The link kernel counts bad ids either way; only a count that is read
        # needs zeroing first.
        bad = _zeroed_counter(s) if check else scratch("bad-ids", 1, np.int32, s)
        _embedding_link_kernel[stream_blocks(T), THREADS, s](ids, V, head, nxt, bad)
        if check:   # the link pass counted them; grad_weight is still untouched
            _raise_bad_ids(bad, s, V)
    grid = stream_blocks(V, threads=1, blocks_per_sm=16)
    _embedding_grad_kernel[grid, row_threads(H), s](grad_out, head, nxt, grad_weight,
                                                      accumulate)


def _staging(nfloats: int) -> tuple[bool, int]:
    nbytes = nfloats * 4
    return (True, nbytes) if nbytes <= _MAX_SHARED_PARAMS else (False, 0)


def layernorm_forward(x, gamma, beta, out, mean, rstd, *, eps: float = 1e-5,
                      stream=0) -> None:
    """``out = (x - mean) * rstd * gamma + beta`` over the last axis.

    ``x``, ``out`` [T, H] float32 (HBM); ``gamma``, ``beta`` [H] float32 (HBM or
    mapped host, staged once per block in shared memory when 2*H*4 <= 47 KiB);
    ``mean``, ``rstd`` [T] float32 outputs (saved for the backward;
    ``rstd = 1/sqrt(var + eps)``, biased variance). ``eps`` > 0.

    The statistics are float32, as torch's: a row whose deviations from its mean
    exceed about 1.8e19 (their squares overflow float32) gets ``var = inf``, so
    ``rstd = 0`` and ``out = beta``. The CPU twin (float64 statistics) stays finite.
    """
    x, gamma, beta, out, mean, rstd = (as_device(a, n) for a, n in (
        (x, "x"), (gamma, "gamma"), (beta, "beta"), (out, "out"), (mean, "mean"),
        (rstd, "rstd")))
    T, H = check_layernorm_forward(x, gamma, beta, out, mean, rstd)
    eps = np.float32(check_eps(eps))
    check_disjoint({"out": out, "mean": mean, "rstd": rstd},
                   {"x": x, "gamma": gamma, "beta": beta})
    staged, shared = _staging(2 * H)
    grid = stream_blocks(T, threads=1, blocks_per_sm=2)
    _layernorm_fwd_kernel[grid, row_threads(H), numba_stream(stream), shared](
        x, gamma, beta, out, mean, rstd, eps, staged)


def _column_sums(grad_out, saved, outs, accumulate, s):
    # saved = (x, mean, rstd) for LayerNorm's dgamma, None for a plain column sum.
    T, H = grad_out.shape
    chunks = max(1, math.ceil(T / _PARTIAL_ROWS))
    partials = scratch("col-partials", (2, chunks, H), np.float32, s)
    # Whether to sum grad_out * xhat too: from the caller, not from comparing
    # arrays (x may be the very array grad_out is, and still need dgamma).
    with_xhat = saved is not None
    if saved is None:
        unused = scratch("unused", 1, np.float32, s)
        saved = (grad_out, unused, unused)
    grid = (max(1, math.ceil(H / THREADS)), min(chunks, 65535))
    _column_partials_kernel[grid, THREADS, s](grad_out, *saved, partials, with_xhat)
    for which, out in outs:
        _column_finish_kernel[stream_blocks(H), THREADS, s](partials, which, out,
                                                             bool(accumulate))


def layernorm_backward(grad_out, x, mean, rstd, gamma, grad_x, grad_gamma, grad_beta, *,
                       accumulate: bool = False, stream=0) -> None:
    """Backward of :func:`layernorm_forward`.

    With ``xhat = (x - mean) * rstd`` and ``g = grad_out * gamma``:
    ``grad_x = rstd * (g - mean_h(g) - xhat * mean_h(g * xhat))``,
    ``grad_gamma = sum_t grad_out * xhat``, ``grad_beta = sum_t grad_out``.
    Shapes as in the forward (all float32); ``grad_gamma``/``grad_beta`` [H] may
    be mapped host memory: written once each (``accumulate=True`` adds instead).
    ``grad_x`` may be None to skip the input gradient. Scratch: 2*ceil(T/64)*H*4
    bytes of HBM.

    Accuracy: ``xhat`` is rebuilt from the saved float32 ``mean``, as torch's
    LayerNorm backward does, so it is off by up to half an ulp of the mean times
    ``rstd``: negligible unless a row's mean dwarfs its spread (rows of
    1e4 + noise of 1e-2: ``grad_gamma`` off by ~0.1, ``grad_x`` by ~0.2%
    relative). The forward centres without that rounding.
    """
    grad_out, x, mean, rstd, gamma, grad_gamma, grad_beta = (as_device(a, n) for a, n in (
        (grad_out, "grad_out"), (x, "x"), (mean, "mean"), (rstd, "rstd"),
        (gamma, "gamma"), (grad_gamma, "grad_gamma"), (grad_beta, "grad_beta")))
    T, H = check_layernorm_backward(grad_out, x, mean, rstd, gamma, grad_gamma, grad_beta)
    accumulate = check_flag(accumulate, "accumulate")
    s = numba_stream(stream)
    if grad_x is not None:
        grad_x = as_device(grad_x, "grad_x")
        check_array(grad_x, "grad_x", ndim=2, shape=(T, H))
    check_disjoint({"grad_x": grad_x, "grad_gamma": grad_gamma, "grad_beta": grad_beta},
                   {"grad_out": grad_out, "x": x, "mean": mean, "rstd": rstd,
                    "gamma": gamma})
    if grad_x is not None:
        staged, shared = _staging(H)
        grid = stream_blocks(T, threads=1, blocks_per_sm=2)
        _layernorm_dx_kernel[grid, row_threads(H), s, shared](
            grad_out, x, mean, rstd, gamma, grad_x, staged)
    _column_sums(grad_out, (x, mean, rstd), ((1, grad_gamma), (0, grad_beta)), accumulate, s)


def _ceil_div(n: int, d: int) -> int:
    return -(-n // d)


def _row_tiles(rows: int, cols: int) -> int:
    # gemm_row_tiles without the checks (the launch path; rows may be 0)
    col_tiles = _ceil_div(cols, GEMM_TILE)
    want = min(col_tiles * _ceil_div(rows, GEMM_TILE), sm_count())
    for r in GEMM_ROW_TILES[:0:-1]:
        if col_tiles * _ceil_div(rows, GEMM_TILE * r) >= want:
            return r
    return GEMM_ROW_TILES[0]    # gives ``want`` blocks or more by construction


def gemm_row_tiles(rows: int, cols: int) -> int:
    """Tile height (in ``GEMM_TILE`` rows, one of ``GEMM_ROW_TILES``) of the GEMM
    that writes a ``rows`` x ``cols`` output on the current device.

    The tallest tile that still gives every SM a block (or as many blocks as the
    shortest tile would, when that is fewer). A taller tile re-reads the weight
    fewer times, which is what a DHA linear pays for over PCIe; below one block per
    SM, the link would see fewer requests in flight and on-GPU GEMMs fewer busy SMs.
    The weight crosses PCIe ``ceil(rows / (GEMM_TILE * r))`` times (rows = tokens).
    """
    return _row_tiles(check_count(rows, "rows"), check_count(cols, "cols"))


def _weight_reads(rows: int, cols: int) -> int:
    return _ceil_div(rows, GEMM_TILE * _row_tiles(rows, cols))


def linear_weight_reads(tokens: int, in_features: int, out_features: int) -> dict:
    """How many times :func:`linear_forward` and :func:`linear_backward` read a
    linear layer's weight (the GEMM re-read factor k of memferry.md §3.2, by
    construction): ``{"forward": k_fp, "backward": k_bp}`` for ``tokens`` rows of
    input on the current device. The backward reads the weight only for
    ``grad_x``; with ``grad_x=None`` it reads it 0 times. Bytes over PCIe for a
    mapped float32 weight: ``k * in_features * out_features * 4``.
    """
    tokens = check_count(tokens, "tokens")
    in_features = check_count(in_features, "in_features")
    out_features = check_count(out_features, "out_features")
    return {"forward": _weight_reads(tokens, out_features),
            "backward": _weight_reads(tokens, in_features)}


def _gemm(a, b, c, bias, trans_a, trans_b, accumulate, s, row_tiles=None):
    M, N = c.shape
    r = _row_tiles(M, N) if row_tiles is None else row_tiles
    grid = (min(max(1, _ceil_div(N, GEMM_TILE)), 65535),
            min(max(1, _ceil_div(M, GEMM_TILE * r)), 65535))
    if simulator_active():
        grid = (min(grid[0], 2), 1)     # few blocks; exercises the grid-stride loops
    has_bias = bias is not None
    if not has_bias:
        bias = scratch("unused", 1, np.float32, s)
    _GEMM_KERNELS[r][grid, (GEMM_TILE, _GEMM_ROWS), s](a, b, c, bias, trans_a, trans_b,
                                                       bool(accumulate), has_bias)


def linear_forward(x, weight, bias, out, *, stream=0) -> None:
    """``out = x @ weight.T + bias`` (PyTorch ``nn.Linear`` layout).

    ``x`` [T, K] float32 (HBM), ``weight`` [N, K] float32 and ``bias`` [N]
    float32 or None (HBM or mapped host), ``out`` [T, N] float32. In DHA mode the
    weight crosses PCIe ``linear_weight_reads(T, K, N)["forward"]`` times, between
    ceil(T/256) and ceil(T/32) (see the module note).
    """
    x, weight, out = as_device(x, "x"), as_device(weight, "weight"), as_device(out, "out")
    T, K, N = check_linear(x, weight, out, "out")
    if bias is not None:
        bias = as_device(bias, "bias")
        check_array(bias, "bias", ndim=1, shape=(N,))
    check_disjoint({"out": out}, {"x": x, "weight": weight, "bias": bias})
    _gemm(x, weight, out, bias, False, True, False, numba_stream(stream))


def linear_backward(grad_out, x, weight, grad_x, grad_weight, grad_bias, *,
                    accumulate: bool = False, stream=0) -> None:
    """Backward of :func:`linear_forward`:
    ``grad_x = grad_out @ weight``, ``grad_weight (=|+=) grad_out.T @ x``,
    ``grad_bias (=|+=) grad_out.sum(0)``.

    ``grad_out`` [T, N], ``x`` [T, K], ``weight`` [N, K], ``grad_x`` [T, K] or
    None (skip), ``grad_weight`` [N, K], ``grad_bias`` [N] or None, all float32.
    ``weight``, ``grad_weight`` and ``grad_bias`` may be mapped host memory: each
    gradient element is written once (read and written once with
    ``accumulate=True``), so GO-MemFerry needs no HBM gradient buffer.
    """
    grad_out, x, weight, grad_weight = (as_device(a, n) for a, n in (
        (grad_out, "grad_out"), (x, "x"), (weight, "weight"), (grad_weight, "grad_weight")))
    T, K, N = check_linear(x, weight, grad_out, "grad_out")
    check_array(grad_weight, "grad_weight", ndim=2, shape=(N, K))
    accumulate = check_flag(accumulate, "accumulate")
    s = numba_stream(stream)
    # every check before the first launch: a refused call changes nothing
    if grad_x is not None:
        grad_x = as_device(grad_x, "grad_x")
        check_array(grad_x, "grad_x", ndim=2, shape=(T, K))
    if grad_bias is not None:
        grad_bias = as_device(grad_bias, "grad_bias")
        check_array(grad_bias, "grad_bias", ndim=1, shape=(N,))
    check_disjoint({"grad_x": grad_x, "grad_weight": grad_weight, "grad_bias": grad_bias},
                   {"grad_out": grad_out, "x": x, "weight": weight})
    if grad_x is not None:
        _gemm(grad_out, weight, grad_x, None, False, False, False, s)
    _gemm(grad_out, x, grad_weight, None, True, False, accumulate, s)
    if grad_bias is not None:
        _column_sums(grad_out, None, ((0, grad_bias),), accumulate, s)
