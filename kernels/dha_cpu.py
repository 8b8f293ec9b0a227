"""CPU twins of the DHA kernels (:mod:`rtmem.kernels.dha`), for the host backend.

Same functions, same arguments, same results (to float32 rounding, for inputs whose
float32 statistics are finite; see the LayerNorm note below): on the host
backend the "device view" of a mapped buffer is the host view itself, so the
runtime swaps this module in for :mod:`rtmem.kernels.dha` and nothing else
changes. Arrays are numpy arrays or anything with ``__array_interface__``
(rtmem host Buffers). The ``stream`` argument is accepted and ignored: every
call runs to completion on the calling thread (numba's thread pool for the
parallel loops), so results are visible on return.

Differences from the GPU kernels, all documented in their functions: LayerNorm
statistics and the column sums (bias, gamma, beta gradients) accumulate in float64
(more accurate, not bitwise equal to the GPU's float32; where a row's deviations
from its mean exceed about 1.8e19, their float32 squares overflow on the GPU, which
then writes ``rstd = 0`` and ``out = beta``, while the twin's float64 statistics
stay finite and correct),
the embedding backward is deterministic, and bad token ids always raise before
any output is written (the GPU wrappers do so with ``check=True``, their default,
at the cost of a wait; with ``check=False`` they stay asynchronous and zero those
rows).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from rtmem.errors import KernelArgumentError

from ._launch import (as_host, check_array, check_blocks, check_disjoint, check_embedding,
                      check_eps, check_flag, check_layernorm_backward,
                      check_layernorm_forward, check_linear, check_word_alignment, check_words,
                      word_dtype, word_value)
from ._parallel import parallel_kernel

__all__ = ["dha_read", "dha_write", "dha_rmw", "xor_checksum",
           "embedding_forward", "embedding_backward",
           "layernorm_forward", "layernorm_backward",
           "linear_forward", "linear_backward"]

_CHUNK = 1 << 16     # words per partial checksum of dha_read
_COLS = 64           # columns per parallel work item of the column reductions


# =================================================================== jitted
# The streaming probes and the GEMMs are numpy (memory-bound ufuncs, BLAS);
# numba compiles only the loops numpy cannot express without temporaries.

@parallel_kernel
def _gather(weight, ids, out):
    for t in prange(ids.shape[0]):
        out[t, :] = weight[ids[t], :]


@parallel_kernel
def _scatter_add(grad_out, ids, grad_weight, accumulate):
    # Parallel over column blocks, tokens in order inside: race-free and
    # deterministic without atomics.
    T, H = grad_out.shape
    if not accumulate:
        grad_weight[:, :] = 0
    nblocks = (H + _COLS - 1) // _COLS
    for b in prange(nblocks):
        lo = b * _COLS
        hi = min(H, lo + _COLS)
        for t in range(T):
            v = ids[t]
            for h in range(lo, hi):
                grad_weight[v, h] += grad_out[t, h]


@parallel_kernel
def _layernorm_fwd(x, gamma, beta, out, mean, rstd, eps):
    T, H = x.shape
    for r in prange(T):
        s = 0.0
        for h in range(H):
            s += x[r, h]
        mu = s / H
        s = 0.0
        for h in range(H):
            d = x[r, h] - mu
            s += d * d
        rs = 1.0 / np.sqrt(s / H + eps)
        for h in range(H):
            out[r, h] = (x[r, h] - mu) * rs * gamma[h] + beta[h]
        mean[r] = mu
        rstd[r] = rs


@parallel_kernel
def _layernorm_dx(grad_out, x, mean, rstd, gamma, grad_x):
    T, H = x.shape
    for r in prange(T):
        mu = np.float64(mean[r])
        rs = np.float64(rstd[r])
        s1 = 0.0
        s2 = 0.0
        for h in range(H):
            g = np.float64(grad_out[r, h]) * gamma[h]
            s1 += g
            s2 += g * (x[r, h] - mu) * rs
        m1 = s1 / H
        m2 = s2 / H
        for h in range(H):
            g = np.float64(grad_out[r, h]) * gamma[h]
            grad_x[r, h] = rs * (g - m1 - (x[r, h] - mu) * rs * m2)


@parallel_kernel
def _column_sums(grad_out, x, mean, rstd, with_xhat, out0, out1, accumulate):
    # out0[h] (=|+=) sum_t grad_out[t, h]; with_xhat: out1[h] (=|+=) sum_t grad_out*xhat.
    T, H = grad_out.shape
    nblocks = (H + _COLS - 1) // _COLS
    for b in prange(nblocks):
        lo = b * _COLS
        hi = min(H, lo + _COLS)
        s0 = np.zeros(hi - lo)
        s1 = np.zeros(hi - lo)
        for r in range(T):
            for h in range(lo, hi):
                g = np.float64(grad_out[r, h])
                s0[h - lo] += g
                if with_xhat:
                    s1[h - lo] += g * (x[r, h] - mean[r]) * rstd[r]
        for h in range(lo, hi):
            if accumulate:
                out0[h] += s0[h - lo]
                if with_xhat:
                    out1[h] += s1[h - lo]
            else:
                out0[h] = s0[h - lo]
                if with_xhat:
                    out1[h] = s1[h - lo]


def _matmul_into(a, b, c, accumulate):
    # Plain numpy on purpose: the product is one multithreaded BLAS SGEMM either
    # way, and a jitted wrapper would only add a compile per operand layout.
    if accumulate:
        c += a @ b
    else:
        np.matmul(a, b, out=c)


# ================================================================= wrappers

def _words(buf, width: int, name: str, writable: bool):
    a = as_host(buf, name, writable=writable)
    if a.dtype.hasobject:
        raise KernelArgumentError(f"{name} holds Python objects ({a.dtype}), not bytes; "
                                  "pass a numeric array", argument=name)
    if not a.flags.c_contiguous:
        raise KernelArgumentError(f"{name} must be C-contiguous to be streamed as words",
                                  argument=name)
    wdt = word_dtype(width)
    check_words(a.nbytes, width, name)
    check_word_alignment(a, width, name)
    return a.reshape(-1).view(np.uint8).view(wdt)


def dha_read(src, *, width: int = 8, blocks: int | None = None, stream=None,
             out=None) -> np.ndarray:
    """Read every ``width``-byte word of ``src``; returns uint64 partial XOR
    checksums (one per 64 Ki-word chunk; ``blocks`` and ``out`` are accepted for
    signature compatibility and ignored). Fold them with :func:`xor_checksum`."""
    check_blocks(blocks)
    words = _words(src, width, "src", writable=False)
    n = words.shape[0]
    full = n // _CHUNK
    parts = [np.bitwise_xor.reduce(words[:full * _CHUNK].reshape(full, _CHUNK), axis=1)]
    if n % _CHUNK:
        parts.append(np.bitwise_xor.reduce(words[full * _CHUNK:], keepdims=True))
    return np.concatenate(parts).astype(np.uint64)


def xor_checksum(partials) -> int:
    """XOR of the partial checksums returned by :func:`dha_read`."""
    return int(np.bitwise_xor.reduce(np.asarray(partials, dtype=np.uint64)))


def dha_write(dst, value: int, *, width: int = 8, blocks: int | None = None,
              stream=None) -> None:
    """Fill ``dst`` with the ``width``-byte word ``value`` (``dst.nbytes`` written)."""
    check_blocks(blocks)
    words = _words(dst, width, "dst", writable=True)
    words[...] = word_value(value, width)


def dha_rmw(buf, mask: int, *, width: int = 8, blocks: int | None = None,
            stream=None) -> None:
    """XOR every ``width``-byte word of ``buf`` with ``mask`` in place."""
    check_blocks(blocks)
    words = _words(buf, width, "buf", writable=True)
    np.bitwise_xor(words, word_value(mask, width), out=words)


def _check_id_range(ids, n_rows: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
        bad = int(np.count_nonzero((ids < 0) | (ids >= n_rows)))
        raise KernelArgumentError(
            f"{bad} token id(s) outside [0, {n_rows}) (min {int(ids.min())}, max "
            f"{int(ids.max())}); nothing was written. Clamp or remap the ids",
            argument="ids")


def embedding_forward(weight, ids, out, *, stream=None, check: bool = True) -> None:
    """``out[t, :] = weight[ids[t], :]``; ``weight`` [V, H] float32, ``ids`` [T]
    int32/int64, ``out`` [T, H] float32. Out-of-range ids always raise
    :class:`~rtmem.errors.KernelArgumentError` before anything is written
    (``check``, True or False, is accepted for signature compatibility)."""
    weight, ids = as_host(weight, "weight"), as_host(ids, "ids")
    out = as_host(out, "out", writable=True)
    V, _, _ = check_embedding(weight, ids, out, "weight", "out")
    check_disjoint({"out": out}, {"weight": weight, "ids": ids})
    check_flag(check, "check")      # as the GPU wrapper does: a call fails on both or neither
    _check_id_range(ids, V)
    _gather(weight, ids, out)


def embedding_backward(grad_out, ids, grad_weight, *, accumulate: bool = False,
                       stream=None, check: bool = True) -> None:
    """``grad_weight[v] (=|+=) sum_{t: ids[t]=v} grad_out[t]`` (float32, float32
    sums in token order). ``accumulate=False`` overwrites every row (zeros for
    unused rows); ``accumulate=True`` adds. Bad ids raise before any write."""
    grad_out, ids = as_host(grad_out, "grad_out"), as_host(ids, "ids")
    grad_weight = as_host(grad_weight, "grad_weight", writable=True)
    V, _, _ = check_embedding(grad_weight, ids, grad_out, "grad_weight", "grad_out")
    check_disjoint({"grad_weight": grad_weight}, {"grad_out": grad_out, "ids": ids})
    accumulate = check_flag(accumulate, "accumulate")
    check_flag(check, "check")      # as the GPU wrapper does: a call fails on both or neither
    _check_id_range(ids, V)
    _scatter_add(grad_out, ids, grad_weight, accumulate)


def layernorm_forward(x, gamma, beta, out, mean, rstd, *, eps: float = 1e-5,
                      stream=None) -> None:
    """``out = (x - mean) * rstd * gamma + beta`` over the last axis (float64
    statistics). ``x``, ``out`` [T, H]; ``gamma``, ``beta`` [H]; ``mean``, ``rstd``
    [T] outputs, ``rstd = 1/sqrt(var + eps)``; all float32; ``eps`` > 0."""
    x, gamma, beta = as_host(x, "x"), as_host(gamma, "gamma"), as_host(beta, "beta")
    out, mean, rstd = (as_host(out, "out", True), as_host(mean, "mean", True),
                       as_host(rstd, "rstd", True))
    T, H = check_layernorm_forward(x, gamma, beta, out, mean, rstd)
    eps = check_eps(eps)
    check_disjoint({"out": out, "mean": mean, "rstd": rstd},
                   {"x": x, "gamma": gamma, "beta": beta})
    _layernorm_fwd(x, gamma, beta, out, mean, rstd, eps)


def layernorm_backward(grad_out, x, mean, rstd, gamma, grad_x, grad_gamma, grad_beta, *,
                       accumulate: bool = False, stream=None) -> None:
    """Backward of :func:`layernorm_forward` (formulas in
    :func:`rtmem.kernels.dha.layernorm_backward`); ``grad_x`` may be None;
    ``accumulate=True`` adds into ``grad_gamma``/``grad_beta``."""
    grad_out, x = as_host(grad_out, "grad_out"), as_host(x, "x")
    mean, rstd, gamma = as_host(mean, "mean"), as_host(rstd, "rstd"), as_host(gamma, "gamma")
    grad_gamma = as_host(grad_gamma, "grad_gamma", writable=True)
    grad_beta = as_host(grad_beta, "grad_beta", writable=True)
    T, H = check_layernorm_backward(grad_out, x, mean, rstd, gamma, grad_gamma, grad_beta)
    accumulate = check_flag(accumulate, "accumulate")
    if grad_x is not None:
        grad_x = as_host(grad_x, "grad_x", writable=True)
        check_array(grad_x, "grad_x", ndim=2, shape=(T, H))
    check_disjoint({"grad_x": grad_x, "grad_gamma": grad_gamma, "grad_beta": grad_beta},
                   {"grad_out": grad_out, "x": x, "mean": mean, "rstd": rstd,
                    "gamma": gamma})
    if grad_x is not None:
        _layernorm_dx(grad_out, x, mean, rstd, gamma, grad_x)
    _column_sums(grad_out, x, mean, rstd, True, grad_beta, grad_gamma, accumulate)


def linear_forward(x, weight, bias, out, *, stream=None) -> None:
    """``out = x @ weight.T + bias``; ``x`` [T, K], ``weight`` [N, K], ``bias`` [N]
    or None, ``out`` [T, N], all float32 (BLAS SGEMM)."""
    x, weight = as_host(x, "x"), as_host(weight, "weight")
    out = as_host(out, "out", writable=True)
    T, K, N = check_linear(x, weight, out, "out")
    if bias is not None:
        bias = as_host(bias, "bias")
        check_array(bias, "bias", ndim=1, shape=(N,))
    check_disjoint({"out": out}, {"x": x, "weight": weight, "bias": bias})
    _matmul_into(x, weight.T, out, False)
    if bias is not None:
        out += bias


def linear_backward(grad_out, x, weight, grad_x, grad_weight, grad_bias, *,
                    accumulate: bool = False, stream=None) -> None:
    """Backward of :func:`linear_forward`: ``grad_x = grad_out @ weight``,
    ``grad_weight (=|+=) grad_out.T @ x``, ``grad_bias (=|+=) grad_out.sum(0)``;
    ``grad_x``/``grad_bias`` may be None; shapes as in
    :func:`rtmem.kernels.dha.linear_backward`, all float32."""
    grad_out, x, weight = as_host(grad_out, "grad_out"), as_host(x, "x"), as_host(weight, "weight")
    grad_weight = as_host(grad_weight, "grad_weight", writable=True)
    T, K, N = check_linear(x, weight, grad_out, "grad_out")
    check_array(grad_weight, "grad_weight", ndim=2, shape=(N, K))
    accumulate = check_flag(accumulate, "accumulate")
    # every check before the first write: a refused call changes nothing
    if grad_x is not None:
        grad_x = as_host(grad_x, "grad_x", writable=True)
        check_array(grad_x, "grad_x", ndim=2, shape=(T, K))
    if grad_bias is not None:
        grad_bias = as_host(grad_bias, "grad_bias", writable=True)
        check_array(grad_bias, "grad_bias", ndim=1, shape=(N,))
    check_disjoint({"grad_x": grad_x, "grad_weight": grad_weight, "grad_bias": grad_bias},
                   {"grad_out": grad_out, "x": x, "weight": weight})
    if grad_x is not None:
        _matmul_into(grad_out, weight, grad_x, False)
    _matmul_into(grad_out.T, x, grad_weight, accumulate)
    if grad_bias is not None:
        # x, mean, rstd and out1 are unused without xhat: any arrays of the right rank.
        _column_sums(grad_out, grad_out, grad_bias, grad_bias, False, grad_bias, grad_bias,
                     bool(accumulate))
