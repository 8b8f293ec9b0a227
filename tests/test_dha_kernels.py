"""DHA kernels (rtmem.kernels.dha) under the CUDA simulator, and their CPU twins.

Every kernel is checked against a float64 numpy reference on fresh random inputs,
forward and backward (analytic gradients: dW = dy^T x, dx = dy W, ...), with the
weights and weight gradients in "mapped" memory (``cuda.mapped_array``) and in
device memory. Sizes are tiny: each simulated thread is a Python thread. The
same checks run on a real GPU in tests/test_dha_gpu.py (``pytest -m gpu``).
"""

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from rtmem.errors import KernelArgumentError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Sim:
    """Simulated GPU: activations in device memory, parameters in mapped or device memory."""
    name = "sim"

    def __init__(self, where):
        from numba import cuda
        from rtmem.kernels import dha
        self.cuda, self.k, self.where = cuda, dha, where

    def act(self, a):
        return self.cuda.to_device(np.ascontiguousarray(a))

    def empty(self, shape, dtype=np.float32):
        return self.cuda.device_array(shape, dtype=dtype)

    def param(self, a):
        if self.where == "device":
            return self.cuda.to_device(np.ascontiguousarray(a))
        m = self.cuda.mapped_array(a.shape, dtype=a.dtype)
        m[...] = a
        return m

    def host(self, d):
        return d.copy_to_host()


class _Cpu:
    """The host backend: every array is a numpy array."""
    name = "cpu"

    def __init__(self, where):
        from rtmem.kernels import dha_cpu
        self.k, self.where = dha_cpu, where

    def act(self, a):
        return np.array(a)

    def empty(self, shape, dtype=np.float32):
        return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else 7, dtype=dtype)

    param = act

    def host(self, d):
        return np.asarray(d)


@pytest.fixture(params=[("sim", "mapped"), ("sim", "device"), ("cpu", "host")],
                ids=lambda p: "-".join(p))
def be(request):
    kind, where = request.param
    return (_Sim if kind == "sim" else _Cpu)(where)


#: One simulated backend and the CPU twin, for the slower simulator tests that
#: the memory kind (mapped or device) does not change.
sim_and_cpu = pytest.mark.parametrize("be", [("sim", "mapped"), ("cpu", "host")],
                                      indirect=True, ids=lambda p: "-".join(p))


def _rand(rng, *shape, scale=1.0):
    # standard normal shifted away from zero: no all-zero input can hide a bug
    return (rng.standard_normal(shape) * scale + 0.25).astype(np.float32)


def test_the_cpu_twins_take_the_cuda_kernels_arguments():
    # DESIGN §2: the host backend's kernels are the CPU twins of the numba.cuda
    # ones, same signature, so one call site serves both backends (the tests
    # above call them through one fixture). Only stream's default differs: the
    # twins accept and ignore any stream, the cuda wrappers default to stream 0.
    import inspect

    from rtmem.kernels import dha, dha_cpu
    assert set(dha_cpu.__all__) <= set(dha.__all__)
    for name in dha_cpu.__all__:
        cuda_params = inspect.signature(getattr(dha, name)).parameters
        cpu_params = inspect.signature(getattr(dha_cpu, name)).parameters
        assert list(cpu_params) == list(cuda_params), name
        for p, q in zip(cpu_params.values(), cuda_params.values()):
            assert p.kind == q.kind, (name, p.name)
            assert p.name == "stream" or p.default == q.default, (name, p.name)
    # the twins take the cuda wrappers' default stream too
    words = np.arange(16, dtype=np.uint64)
    assert np.array_equal(dha_cpu.dha_read(words, stream=0), dha_cpu.dha_read(words))


# ----------------------------------------------------------------- probes

@pytest.mark.parametrize("width", [4, 8])
def test_read_probe_checksums_every_word(be, width, fresh_seed):
    rng = np.random.default_rng([fresh_seed, width])
    data = rng.integers(1, 2**31, size=(37, 24), dtype=np.int64).astype(np.float32)
    partials = be.k.dha_read(be.param(data), width=width, blocks=3 if be.name == "sim" else None)
    words = data.reshape(-1).view(np.uint32 if width == 4 else np.uint64)
    assert be.k.xor_checksum(partials) == int(np.bitwise_xor.reduce(words.astype(np.uint64)))
    if be.name == "sim":
        assert len(partials) == 3


def test_write_and_rmw_probes(be, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    data = rng.integers(0, 2**62, size=301, dtype=np.int64).view(np.uint64)
    buf = be.param(data)
    mask = int(rng.integers(1, 2**62))
    be.k.dha_rmw(buf, mask)
    got = be.host(buf)
    np.testing.assert_array_equal(got, data ^ np.uint64(mask))
    value = int(rng.integers(1, 2**31))
    out = be.param(np.zeros(602, np.float32))
    be.k.dha_write(out, value, width=4)
    got = be.host(out)
    assert np.all(got.view(np.uint32) == value)


@pytest.mark.parametrize("width", [4, 8])
def test_cpu_read_probe_checksums_whole_chunks_and_the_tail(width, fresh_seed):
    # More than two 64 Ki-word chunks plus a ragged tail: one partial per chunk,
    # the tail's included (every other probe test reads less than one chunk).
    from rtmem.kernels import dha_cpu
    rng = np.random.default_rng([fresh_seed, width])
    chunk = dha_cpu._CHUNK
    n = 2 * chunk + 1 + int(rng.integers(chunk - 1))
    wdt = np.uint32 if width == 4 else np.uint64
    words = rng.integers(1, np.iinfo(wdt).max, n, dtype=wdt, endpoint=True)
    partials = dha_cpu.dha_read(words.view(np.uint8), width=width)
    assert len(partials) == 3
    for k, part in enumerate(partials):
        assert int(part) == int(np.bitwise_xor.reduce(words[k * chunk:(k + 1) * chunk]))
    assert dha_cpu.xor_checksum(partials) == int(np.bitwise_xor.reduce(words))


def test_probe_argument_errors(be):
    with pytest.raises(KernelArgumentError, match="width"):
        be.k.dha_read(be.param(np.ones(8, np.float32)), width=16)
    with pytest.raises(KernelArgumentError, match="multiple"):
        be.k.dha_read(be.param(np.ones(3, np.float32)), width=8)
    empty = be.param(np.zeros(0, np.uint64))       # no word to stream
    for probe in (lambda: be.k.dha_read(empty), lambda: be.k.dha_write(empty, 1),
                  lambda: be.k.dha_rmw(empty, 1)):
        with pytest.raises(KernelArgumentError, match="holds 0 bytes"):
            probe()


def test_read_probe_refuses_partials_that_overlap_src():
    # A block stored its partial into out while another block still had to read
    # that word of src: a silently wrong checksum.
    from numba import cuda
    from rtmem.kernels import dha
    data = np.arange(1, 1025, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    src = cuda.to_device(data)
    with pytest.raises(KernelArgumentError, match="overlap") as e:
        dha.dha_read(src, blocks=2, out=src[256:258])
    assert e.value.argument == "out"
    np.testing.assert_array_equal(src.copy_to_host(), data)
    # the partials are out's first `blocks` entries; the stale rest is not one of them
    spare = cuda.to_device(np.full(8, 0xDEADBEEF, np.uint64))
    partials = dha.dha_read(src, blocks=2, out=spare)
    assert partials.shape == (2,)
    assert dha.xor_checksum(partials) == int(np.bitwise_xor.reduce(data))


def test_device_views_name_what_is_wrong():
    from rtmem.kernels._launch import as_device, simulator_active

    class ForeignDeviceArray:     # e.g. a CuPy array while the simulator is on
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4",
                                    "data": (0x7000_0000, False), "version": 3}
    with pytest.raises(KernelArgumentError, match="host memory the GPU cannot"):
        as_device(np.ones(4, np.float32), "x")
    with pytest.raises(KernelArgumentError, match="must expose __cuda_array_interface__"):
        as_device([1.0, 2.0], "x")
    if simulator_active():
        with pytest.raises(KernelArgumentError, match="simulator is active"):
            as_device(ForeignDeviceArray(), "x")


# -------------------------------------------------------------- embedding

def test_embedding_forward_gathers_rows(be, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    V, H, T = 23, 40, 19
    w = _rand(rng, V, H)
    ids = rng.integers(0, V, T).astype(np.int64)
    ids[:3] = ids[3]                                         # repeated tokens
    out = be.empty((T, H))
    be.k.embedding_forward(be.param(w), be.act(ids), out)
    np.testing.assert_array_equal(be.host(out), w[ids])


@pytest.mark.parametrize("accumulate", [False, True])
def test_embedding_backward_scatter_adds(be, accumulate, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    V, H, T = 17, 36, 25
    ids = rng.integers(0, V - 4, T).astype(np.int32)        # rows V-4.. stay unused
    ids[:4] = 2
    dy = _rand(rng, T, H)
    g0 = _rand(rng, V, H)                                   # garbage or previous gradient
    gw = be.param(g0)
    be.k.embedding_backward(be.act(dy), be.act(ids), gw, accumulate=accumulate)
    ref = np.zeros((V, H))
    np.add.at(ref, ids, dy.astype(np.float64))
    if accumulate:
        ref += g0
    got = be.host(gw)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    if not accumulate:
        assert np.all(got[V - 4:] == 0)


def test_embedding_rejects_bad_ids_and_shapes(be):
    rng = np.random.default_rng(23)
    w = be.param(_rand(rng, 8, 32))
    with pytest.raises(KernelArgumentError, match=r"outside \[0, 8\)") as e:
        be.k.embedding_forward(w, be.act(np.array([1, 8, 2], np.int32)), be.empty((3, 32)))
    assert e.value.argument == "ids"
    with pytest.raises(KernelArgumentError, match="int32 or int64"):
        be.k.embedding_forward(w, be.act(np.array([1.0, 2.0])), be.empty((2, 32)))
    with pytest.raises(KernelArgumentError, match="axis 1 must be 32"):
        be.k.embedding_forward(w, be.act(np.array([1, 2])), be.empty((2, 31)))
    g0 = _rand(rng, 8, 32)
    gw = be.param(g0)
    with pytest.raises(KernelArgumentError, match="outside"):
        be.k.embedding_backward(be.act(_rand(rng, 2, 32)), be.act(np.array([-1, 3])), gw)
    if be.name == "cpu":                                    # refused before any write
        np.testing.assert_array_equal(gw, g0)


@sim_and_cpu
def test_unchecked_bad_ids_zero_their_rows_and_add_nothing(be, fresh_seed):
    # check=False (GPU): no wait for an id count; a token with an id outside
    # [0, V) gets a zero row in the forward and adds to no row in the backward.
    # The CPU twins raise either way.
    rng = np.random.default_rng(fresh_seed)
    V, H, T = 9, 20, 12
    w, dy = _rand(rng, V, H), _rand(rng, T, H)
    ids = rng.integers(0, V, T).astype(np.int64)
    bad = np.array([1, 4, 7, 11])
    ids[bad] = [-1, V, -(2 ** 40), V + 3]
    ids[0] = 0                                      # row 0 is used by a good token too
    good = np.setdiff1d(np.arange(T), bad)
    out, gw = be.empty((T, H)), be.param(_rand(rng, V, H))
    if be.name == "cpu":
        with pytest.raises(KernelArgumentError, match="outside"):
            be.k.embedding_forward(be.param(w), be.act(ids), out, check=False)
        return
    be.k.embedding_forward(be.param(w), be.act(ids), out, check=False)
    ref = np.zeros((T, H), np.float32)
    ref[good] = w[ids[good]]
    np.testing.assert_array_equal(be.host(out), ref)
    be.k.embedding_backward(be.act(dy), be.act(ids), gw, check=False)
    ref = np.zeros((V, H))
    np.add.at(ref, ids[good], dy[good].astype(np.float64))
    np.testing.assert_allclose(be.host(gw), ref, rtol=1e-5, atol=1e-5)


def test_cpu_scatter_add_over_several_column_blocks(fresh_seed):
    # H = 133: three 64-column work items of the CPU twin's scatter-add, the
    # last one ragged (every other embedding test has H < 64: one work item).
    from rtmem.kernels import dha_cpu
    rng = np.random.default_rng(fresh_seed)
    V, H, T = 11, 133, 30
    ids = rng.integers(0, V, T).astype(np.int64)
    dy, g0 = _rand(rng, T, H), _rand(rng, V, H)
    for accumulate in (False, True):
        gw = g0.copy()
        dha_cpu.embedding_backward(dy, ids, gw, accumulate=accumulate)
        ref = np.zeros((V, H)) + (g0 if accumulate else 0.0)
        np.add.at(ref, ids, dy.astype(np.float64))
        np.testing.assert_allclose(gw, ref, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------- LayerNorm

def _ln_reference(x, gamma, beta, dy, eps):
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    mu = x.mean(1, keepdims=True)
    rstd = 1.0 / np.sqrt(x.var(1, keepdims=True) + eps)
    xhat = (x - mu) * rstd
    y = xhat * gamma + beta
    g = dy * gamma
    dx = rstd * (g - g.mean(1, keepdims=True) - xhat * (g * xhat).mean(1, keepdims=True))
    return y, mu[:, 0], rstd[:, 0], dx, (dy * xhat).sum(0), dy.sum(0)


def _ln_forward(be, x, gamma, beta, eps):
    """layernorm_forward of host arrays on the backend: (x, gamma) as the backend
    holds them (the backward reads them), then out, mean and rstd."""
    T, H = x.shape
    out, mean, rs = be.empty((T, H)), be.empty(T), be.empty(T)
    x_d, gamma_d = be.act(x), be.param(gamma)
    be.k.layernorm_forward(x_d, gamma_d, be.param(beta), out, mean, rs, eps=eps)
    return x_d, gamma_d, out, mean, rs


def _ln_forward_checked(be, rng, x, eps, *, out_tol, mean_tol, rstd_rtol):
    """:func:`_ln_forward` of ``x`` with fresh gamma and beta, its out, mean and
    rstd checked against the float64 reference (``out_tol``, ``mean_tol``:
    (rtol, atol)). Returns the reference (y, mu, rstd, dx, dgamma, dbeta) for a
    fresh ``dy``, ``dy``, and x, gamma, mean, rstd as the backend holds them."""
    T, H = x.shape
    gamma, beta, dy = _rand(rng, H), _rand(rng, H), _rand(rng, T, H)
    ref = _ln_reference(x, gamma, beta, dy, eps)
    x_d, gamma_d, out, mean, rs = _ln_forward(be, x, gamma, beta, eps)
    np.testing.assert_allclose(be.host(out), ref[0], rtol=out_tol[0], atol=out_tol[1])
    np.testing.assert_allclose(be.host(mean), ref[1], rtol=mean_tol[0], atol=mean_tol[1])
    np.testing.assert_allclose(be.host(rs), ref[2], rtol=rstd_rtol)
    return ref, dy, x_d, gamma_d, mean, rs


@pytest.mark.parametrize("accumulate", [False, True])
def test_layernorm_forward_backward(be, accumulate, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    T, H, eps = 5, 24, 1e-5
    x = _rand(rng, T, H, scale=3.0) + 2.0                  # non-zero mean per row
    (_, _, _, dx, dgamma, dbeta), dy, dx_d, gamma_d, mean, rs = _ln_forward_checked(
        be, rng, x, eps, out_tol=(1e-4, 1e-5), mean_tol=(1e-5, 1e-6), rstd_rtol=1e-4)
    g0, b0 = _rand(rng, H), _rand(rng, H)
    gg, gb, gx = be.param(g0), be.param(b0), be.empty((T, H))
    be.k.layernorm_backward(be.act(dy), dx_d, mean, rs, gamma_d, gx, gg, gb,
                            accumulate=accumulate)
    np.testing.assert_allclose(be.host(gx), dx, rtol=1e-4, atol=1e-5)
    base = (g0, b0) if accumulate else (0.0, 0.0)
    np.testing.assert_allclose(be.host(gg),
                               dgamma + base[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(be.host(gb),
                               dbeta + base[1], rtol=1e-4, atol=1e-5)


def test_layernorm_of_constant_rows_is_beta(be, fresh_seed):
    # A constant row has variance 0: out = beta exactly, grad_x = rstd * (g - mean(g)).
    # The GPU kernel's float32 mean of such a row was an ulp off (a sum times an
    # inexact 1/H), which gave var = ulp^2 >> eps and normalized the row to +-1:
    # out = beta +- gamma, and a wrong grad_x.
    rng = np.random.default_rng(fresh_seed)
    T, H, eps = 12, 13, 1e-5
    x = np.repeat(rng.choice([-1.0, 1.0], (T, 1)) * rng.uniform(1e3, 1e6, (T, 1)), H,
                  axis=1).astype(np.float32)
    (_, _, _, dx, dgamma, dbeta), dy, x_d, gamma_d, mean, rs = _ln_forward_checked(
        be, rng, x, eps, out_tol=(1e-5, 1e-6), mean_tol=(1e-7, 0), rstd_rtol=1e-5)
    gg, gb, gx = be.param(np.zeros(H, np.float32)), be.param(np.zeros(H, np.float32)), \
        be.empty((T, H))
    be.k.layernorm_backward(be.act(dy), x_d, mean, rs, gamma_d, gx, gg, gb)
    np.testing.assert_allclose(be.host(gx), dx, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(be.host(gg), dgamma, atol=1e-5)
    np.testing.assert_allclose(be.host(gb), dbeta, rtol=1e-5, atol=1e-5)


def test_layernorm_forward_of_rows_with_a_large_mean(be, fresh_seed):
    # Rows of 1e4 + noise of 1e-2: the GPU kernel centred x with the corrected mean
    # mu + c rounded to float32 (half an ulp of 1e4 is 5e-4, 5% of the spread),
    # which shifted every output by up to ~0.2 where the CPU twin was exact.
    rng = np.random.default_rng(fresh_seed)
    T, H, eps = 4, 40, 1e-5
    x = (1e4 + rng.standard_normal((T, H)) * 1e-2).astype(np.float32)
    _ln_forward_checked(be, rng, x, eps, out_tol=(1e-4, 1e-4), mean_tol=(1e-7, 0),
                        rstd_rtol=1e-4)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the simulator
@sim_and_cpu
def test_layernorm_forward_beyond_float32_statistics_is_as_documented(be, fresh_seed):
    # The documented limit of the GPU kernel's float32 statistics (kernels/dha.py
    # layernorm_forward, kernels/dha_cpu.py's module docstring): deviations above
    # ~1.8e19 square past float32's range, so var = inf, rstd = 0 and out = beta on
    # the GPU, while the CPU twin's float64 statistics stay finite and correct.
    rng = np.random.default_rng(fresh_seed)
    T, H, eps = 3, 16, 1e-5
    x = (rng.standard_normal((T, H)) * 1e20).astype(np.float32)
    gamma, beta = _rand(rng, H), _rand(rng, H)
    _, _, out, mean, rs = _ln_forward(be, x, gamma, beta, eps)
    y, _, rstd, *_ = _ln_reference(x, gamma, beta, _rand(rng, T, H), eps)
    if be.name == "cpu":
        np.testing.assert_allclose(be.host(rs), rstd, rtol=1e-5)
        np.testing.assert_allclose(be.host(out), y, rtol=1e-4, atol=1e-4)
    else:
        np.testing.assert_array_equal(be.host(rs), np.zeros(T, np.float32))
        np.testing.assert_array_equal(be.host(out), np.broadcast_to(beta, (T, H)))


@sim_and_cpu
def test_column_sums_over_several_row_chunks_and_column_blocks(be, fresh_seed):
    # T = 70 rows: two 64-row chunks of partial sums on the GPU, the second one
    # ragged; H = 133 columns: three 64-column work items of the CPU twin, the
    # last one ragged. Every other test has T, H < 64 (one chunk, one work
    # item), where a chunk or block that dropped its last row or column, or a
    # finish that summed only the first chunk, gave the right answer.
    rng = np.random.default_rng(fresh_seed)
    T, H = 70, 133
    x, dy = _rand(rng, T, H, scale=2.0), _rand(rng, T, H)
    mean, rstd = _rand(rng, T), rng.uniform(0.5, 2.0, T).astype(np.float32)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    xhat = (x64 - mean[:, None]) * rstd[:, None]
    g0, b0 = _rand(rng, H), _rand(rng, H)
    gg, gb = be.param(g0), be.param(b0)
    be.k.layernorm_backward(be.act(dy), be.act(x), be.act(mean), be.act(rstd),
                            be.param(_rand(rng, H)), None, gg, gb, accumulate=True)
    np.testing.assert_allclose(be.host(gg), (dy64 * xhat).sum(0) + g0, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(be.host(gb), dy64.sum(0) + b0, rtol=1e-4, atol=1e-4)


def test_layernorm_with_gamma_and_beta_too_large_to_stage(monkeypatch, fresh_seed):
    # gamma/beta beyond the shared-memory budget are read from their own arrays
    # in every row; no other test has an H that large (the budget is 47 KiB), so
    # the budget is lowered to 0 here to take that path with a small H.
    from rtmem.kernels import dha
    monkeypatch.setattr(dha, "_MAX_SHARED_PARAMS", 0)
    assert dha._staging(1) == (False, 0)
    be = _Sim("mapped")
    rng = np.random.default_rng(fresh_seed)
    T, H, eps = 2, 20, 1e-5
    x = _rand(rng, T, H, scale=3.0) + 2.0
    (_, _, _, dx, dgamma, dbeta), dy, x_d, gamma_d, mean, rs = _ln_forward_checked(
        be, rng, x, eps, out_tol=(1e-4, 1e-5), mean_tol=(1e-5, 1e-6), rstd_rtol=1e-4)
    gg, gb, gx = be.param(_rand(rng, H)), be.param(_rand(rng, H)), be.empty((T, H))
    be.k.layernorm_backward(be.act(dy), x_d, mean, rs, gamma_d, gx, gg, gb)
    np.testing.assert_allclose(be.host(gx), dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(be.host(gg), dgamma, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(be.host(gb), dbeta, rtol=1e-4, atol=1e-5)


def test_layernorm_argument_errors(be):
    rng = np.random.default_rng(33)
    x, g = be.act(_rand(rng, 3, 8)), be.param(_rand(rng, 8))
    with pytest.raises(KernelArgumentError, match="eps"):
        be.k.layernorm_forward(x, g, g, be.empty((3, 8)), be.empty(3), be.empty(3), eps=0.0)
    with pytest.raises(KernelArgumentError, match="gamma") as e:
        be.k.layernorm_forward(x, be.param(_rand(rng, 7)), g, be.empty((3, 8)),
                               be.empty(3), be.empty(3))
    assert e.value.argument == "gamma"
    with pytest.raises(KernelArgumentError, match="float32"):
        be.k.layernorm_forward(be.act(np.ones((3, 8))), g, g, be.empty((3, 8)),
                               be.empty(3), be.empty(3))


# ----------------------------------------------------------------- linear

@pytest.mark.parametrize("accumulate", [False, True])
def test_linear_forward_backward(be, accumulate, fresh_seed):
    # 2 x 2 output tiles on the simulator's 2 x 1 grid: the grid-stride loops run.
    rng = np.random.default_rng(fresh_seed)
    T, K, N = 33, 20, 34
    x, w, b, dy = _rand(rng, T, K), _rand(rng, N, K), _rand(rng, N), _rand(rng, T, N)
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    w_d, x_d, out = be.param(w), be.act(x), be.empty((T, N))
    be.k.linear_forward(x_d, w_d, be.param(b), out)
    np.testing.assert_allclose(be.host(out), x64 @ w64.T + b, rtol=1e-4, atol=1e-4)
    gw0, gb0 = _rand(rng, N, K), _rand(rng, N)
    gw, gb, gx = be.param(gw0), be.param(gb0), be.empty((T, K))
    be.k.linear_backward(be.act(dy), x_d, w_d, gx, gw, gb, accumulate=accumulate)
    np.testing.assert_allclose(be.host(gx), dy64 @ w64, rtol=1e-4, atol=1e-4)
    base_w, base_b = (gw0, gb0) if accumulate else (0.0, 0.0)
    np.testing.assert_allclose(be.host(gw), dy64.T @ x64 + base_w, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(be.host(gb), dy64.sum(0) + base_b, rtol=1e-4, atol=1e-4)


def test_linear_without_bias_and_grad_x(be, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    T, K, N = 9, 12, 10
    x, w, dy = _rand(rng, T, K), _rand(rng, N, K), _rand(rng, T, N)
    out = be.empty((T, N))
    be.k.linear_forward(be.act(x), be.param(w), None, out)
    np.testing.assert_allclose(be.host(out), x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-4)
    gw = be.param(_rand(rng, N, K))
    be.k.linear_backward(be.act(dy), be.act(x), be.param(w), None, gw, None)
    got = be.host(gw)
    np.testing.assert_allclose(got, dy.astype(np.float64).T @ x, rtol=1e-4, atol=1e-4)


def test_linear_of_an_empty_batch(be):
    # T = 0 tokens: nothing to compute, grad_weight (=|+=) a sum of nothing
    rng = np.random.default_rng(49)
    K, N = 5, 7
    x, w, dy = be.act(np.zeros((0, K), np.float32)), be.param(_rand(rng, N, K)), \
        be.act(np.zeros((0, N), np.float32))
    be.k.linear_forward(x, w, None, be.empty((0, N)))
    g0 = _rand(rng, N, K)
    gw = be.param(g0)
    be.k.linear_backward(dy, x, w, be.empty((0, K)), gw, None, accumulate=True)
    np.testing.assert_array_equal(be.host(gw), g0)


def test_linear_argument_errors(be):
    rng = np.random.default_rng(44)
    x, w = be.act(_rand(rng, 4, 6)), be.param(_rand(rng, 5, 6))
    with pytest.raises(KernelArgumentError, match="axis 1 must be 6") as e:
        be.k.linear_forward(x, be.param(_rand(rng, 5, 7)), None, be.empty((4, 5)))
    assert e.value.argument == "weight"
    with pytest.raises(KernelArgumentError, match="out"):
        be.k.linear_forward(x, w, None, be.empty((4, 6)))
    with pytest.raises(KernelArgumentError, match="grad_weight"):
        be.k.linear_backward(be.act(_rand(rng, 4, 5)), x, w, None, be.empty((6, 5)), None)
    with pytest.raises(KernelArgumentError, match="C-contiguous"):
        be.k.linear_forward(x, w, None, be.empty((5, 4)).T)


# the three layouts the linear layer uses: forward, grad_x, grad_weight
@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (False, False), (True, False)])
def test_gemm_tile_heights_agree_bitwise(trans_a, trans_b, fresh_seed):
    # Every tile height sums k in the same order, so all give the same bits (a
    # plan profiled with one height and run with another computes the same
    # model). M = 70 cuts 32-, 64- and 128-row tiles raggedly and fits a 256-row
    # one; K = 40 leaves a ragged k tile; both layouts of a and b are staged.
    from numba import cuda
    from rtmem.kernels import dha
    rng = np.random.default_rng(fresh_seed)
    M, K, N = 70, 40, 34
    a = _rand(rng, *((K, M) if trans_a else (M, K)))
    b = _rand(rng, *((N, K) if trans_b else (K, N)))
    bias = _rand(rng, N)
    a64 = (a.T if trans_a else a).astype(np.float64)
    b64 = (b.T if trans_b else b).astype(np.float64)
    got = {}
    for r in dha.GEMM_ROW_TILES:
        c = cuda.to_device(np.full((M, N), np.nan, np.float32))
        dha._gemm(cuda.to_device(a), cuda.to_device(b), c, cuda.to_device(bias),
                  trans_a, trans_b, False, 0, row_tiles=r)
        got[r] = c.copy_to_host()
        np.testing.assert_allclose(got[r], a64 @ b64 + bias, rtol=1e-4, atol=1e-4)
    for r in dha.GEMM_ROW_TILES[1:]:
        np.testing.assert_array_equal(got[r], got[1])


def test_gemm_row_tiles_is_the_tallest_tile_that_fills_the_gpu(monkeypatch):
    from rtmem.kernels import dha

    def blocks(rows, cols, r):
        return -(-cols // 32) * -(-rows // (32 * r))

    monkeypatch.setattr(dha, "sm_count", lambda: 132)
    assert dha.gemm_row_tiles(4096, 768) == 8        # 24 x 16 = 384 blocks
    assert dha.gemm_row_tiles(1024, 768) == 4        # 24 x 8 = 192; 8 rows: 96 < 132
    assert dha.gemm_row_tiles(64, 768) == 1          # 48 blocks at most: keep them all
    monkeypatch.setattr(dha, "sm_count", lambda: 8)
    assert dha.gemm_row_tiles(2048, 32) == 8         # 8 tiles of 256 rows: one per SM
    monkeypatch.setattr(dha, "sm_count", lambda: 132)
    assert dha.linear_weight_reads(4096, 768, 3072) == {"forward": 16, "backward": 16}
    assert dha.linear_weight_reads(1024, 768, 3072) == {"forward": 4, "backward": 8}
    assert dha.linear_weight_reads(1, 768, 768) == {"forward": 1, "backward": 1}
    rng = np.random.default_rng(48)
    for sms in (1, 8, 132):
        monkeypatch.setattr(dha, "sm_count", lambda sms=sms: sms)
        for rows, cols in rng.integers(1, 20000, size=(200, 2)):
            r = dha.gemm_row_tiles(rows, cols)
            want = min(blocks(rows, cols, 1), sms)
            assert blocks(rows, cols, r) >= want
            taller = [t for t in dha.GEMM_ROW_TILES if t > r]
            assert all(blocks(rows, cols, t) < want for t in taller), (rows, cols, r)
            k = dha.linear_weight_reads(int(rows), 5, int(cols))["forward"]
            assert k == -(-rows // (32 * r))
    for bad in (0, -3, 2.0, True, "64"):
        with pytest.raises(KernelArgumentError, match="tokens must be an integer >= 1"):
            dha.linear_weight_reads(bad, 4, 4)
        with pytest.raises(KernelArgumentError, match="cols must be an integer >= 1"):
            dha.gemm_row_tiles(4, bad)


# ------------------------------------------- refused calls write nothing

def test_aliased_outputs_are_refused(be):
    # The kernels read their inputs while writing their outputs: an output that
    # shares memory with another argument would give silently wrong results.
    rng = np.random.default_rng(45)
    T, H = 3, 6
    go, x = be.act(_rand(rng, T, H)), be.act(_rand(rng, T, H))
    mean, rstd = be.act(_rand(rng, T)), be.act(_rand(rng, T))
    gamma = be.param(_rand(rng, H))
    gg, gb = be.param(_rand(rng, H)), be.param(_rand(rng, H))
    before = be.host(go).copy()
    cases = [
        ("grad_x", lambda: be.k.layernorm_backward(go, x, mean, rstd, gamma, go, gg, gb)),
        ("grad_gamma", lambda: be.k.layernorm_backward(go, x, mean, rstd, gamma, None, gg,
                                                       gg)),
        ("out", lambda: be.k.layernorm_forward(x, gamma, gamma, x, mean, rstd)),
        ("grad_x", lambda: be.k.linear_backward(go, x, be.param(_rand(rng, H, H)), go,
                                                be.param(_rand(rng, H, H)), None)),
        ("out", lambda: be.k.linear_forward(x, be.param(_rand(rng, H, H)), None, x)),
    ]
    w = be.param(_rand(rng, 3, H))           # a [V, H] table with V == T
    ids = be.act(np.array([2, 1, 0], dtype=np.int64))
    cases.append(("out", lambda: be.k.embedding_forward(w, ids, w)))
    for name, call in cases:
        with pytest.raises(KernelArgumentError, match="overlap") as e:
            call()
        assert e.value.argument == name
    np.testing.assert_array_equal(be.host(go), before)


def test_refused_calls_leave_outputs_untouched(be):
    rng = np.random.default_rng(46)
    T, K, N = 3, 4, 5
    gy, x, w = be.act(_rand(rng, T, N)), be.act(_rand(rng, T, K)), be.param(_rand(rng, N, K))
    gw0 = _rand(rng, N, K)
    gw, gx = be.param(gw0), be.empty((T, K))
    with pytest.raises(KernelArgumentError, match="grad_bias"):
        # a bad grad_bias is found before grad_weight is accumulated into
        be.k.linear_backward(gy, x, w, gx, gw, be.param(_rand(rng, N + 1)), accumulate=True)
    np.testing.assert_array_equal(be.host(gw), gw0)
    out0 = _rand(rng, T, N)
    out = be.act(out0)
    with pytest.raises(KernelArgumentError, match="bias"):
        be.k.linear_forward(x, w, be.param(_rand(rng, N + 1)), out)
    np.testing.assert_array_equal(be.host(out), out0)
    # out-of-range ids: nothing written, also with accumulate (a retry must not
    # add the valid rows twice)
    V, H = 7, 5
    gw0 = _rand(rng, V, H)
    gwe = be.param(gw0)
    bad_ids = be.act(np.array([0, -1, 2], dtype=np.int64))
    with pytest.raises(KernelArgumentError, match="nothing was written"):
        be.k.embedding_backward(be.act(_rand(rng, 3, H)), bad_ids, gwe, accumulate=True)
    np.testing.assert_array_equal(be.host(gwe), gw0)
    emb0 = _rand(rng, 3, H)
    emb = be.act(emb0)
    with pytest.raises(KernelArgumentError, match="nothing was written"):
        be.k.embedding_forward(be.param(gw0), bad_ids, emb)
    np.testing.assert_array_equal(be.host(emb), emb0)


def test_degenerate_layernorm_arguments_are_refused(be):
    rng = np.random.default_rng(47)
    T, H = 2, 4
    x, g = be.act(_rand(rng, T, H)), be.param(_rand(rng, H))
    mean, rstd, out = be.empty((T,)), be.empty((T,)), be.empty((T, H))
    for eps, fragment in ((1e-46, "smallest float32"), ("a", "must be a number"),
                          (0.0, "> 0")):
        with pytest.raises(KernelArgumentError, match=fragment):
            be.k.layernorm_forward(x, g, g, out, mean, rstd, eps=eps)
    empty = be.act(np.zeros((T, 0), np.float32))
    e1 = be.param(np.zeros(0, np.float32))
    with pytest.raises(KernelArgumentError, match="0 features"):
        be.k.layernorm_forward(empty, e1, e1, be.empty((T, 0)), mean, rstd)
    with pytest.raises(KernelArgumentError, match="True or False"):
        be.k.layernorm_backward(x, x, mean, rstd, g, None, be.param(_rand(rng, H)),
                                be.param(_rand(rng, H)), accumulate="no")


def test_flags_and_eps_are_checked_alike_on_both_backends(be):
    # The CPU twins ignored ``check`` (check="no" passed there, failed on the GPU),
    # and an eps beyond float32's range passed with an overflow warning (inf in
    # the GPU kernels, rstd = 0): both now raise before anything is written.
    import warnings
    rng = np.random.default_rng(48)
    T, H, V = 3, 5, 4
    ids = be.act(np.array([0, 3, 1], np.int32))
    out, gw = be.empty((T, H)), be.param(_rand(rng, V, H))
    gw0 = be.host(gw).copy()
    for call in (lambda: be.k.embedding_forward(be.param(_rand(rng, V, H)), ids, out,
                                                check="no"),
                 lambda: be.k.embedding_backward(be.act(_rand(rng, T, H)), ids, gw,
                                                 check=1)):
        with pytest.raises(KernelArgumentError, match="True or False") as info:
            call()
        assert info.value.argument == "check"
    np.testing.assert_array_equal(be.host(gw), gw0)
    x, g = be.act(_rand(rng, T, H)), be.param(_rand(rng, H))
    mean, rstd = be.empty((T,)), be.empty((T,))
    for eps in (1e39, 1e300):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(KernelArgumentError, match="3.4e38") as info:
                be.k.layernorm_forward(x, g, g, out, mean, rstd, eps=eps)
        assert info.value.argument == "eps"


# ------------------------------------------------- memory kinds, launch, errors

def test_gpu_kernels_refuse_host_arrays():
    from rtmem.kernels import dha
    with pytest.raises(KernelArgumentError, match="mapped_array") as e:
        dha.dha_read(np.ones(8, np.float32))
    assert e.value.argument == "src"
    with pytest.raises(KernelArgumentError, match="__cuda_array_interface__"):
        dha.dha_read([1.0, 2.0])


def test_cpu_twins_refuse_device_and_read_only_arrays():
    from rtmem.kernels import dha_cpu

    class DeviceOnly:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False),
                                    "version": 3}

    with pytest.raises(KernelArgumentError, match="device memory"):
        dha_cpu.dha_read(DeviceOnly())
    out = np.zeros(4, np.float32)
    out.flags.writeable = False
    with pytest.raises(KernelArgumentError, match="read-only"):
        dha_cpu.dha_write(out, 1, width=4)


def test_stream_blocks_is_capped_under_the_simulator():
    from rtmem.kernels import _launch
    assert _launch.simulator_active()
    assert _launch.stream_blocks(1) == 1
    assert _launch.stream_blocks(10**9) == _launch.SIM_MAX_BLOCKS
    assert _launch.stream_blocks(3 * _launch.THREADS, blocks_per_sm=1) == 3
    assert _launch.stream_blocks(2 * _launch.THREADS + 1) == 3     # one item over 2 blocks


def test_kernel_argument_error_pickles():
    e = pickle.loads(pickle.dumps(KernelArgumentError("bad", argument="ids")))
    assert isinstance(e, ValueError) and e.argument == "ids" and str(e) == "bad"


@pytest.mark.parametrize("script", ["pcie.py", "dha_layers.py"])
def test_benches_exit_cleanly_without_a_gpu(script, tmp_path):
    # The CPU suite has no GPU (the simulator does not count): a bench must say
    # so, exit 0 and write no result file.
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["RTMEM_BENCH_RESULTS"] = str(tmp_path)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--quick"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU" in r.stdout + r.stderr
    assert list(tmp_path.iterdir()) == []


def test_cli_bench_runs_pcie_and_dha(capsys, tmp_path, monkeypatch):
    import argparse
    from rtmem import cli_bench
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    parser = argparse.ArgumentParser(prog="rtmem")
    cli_bench.register(parser.add_subparsers(dest="command"))
    for name in ("pcie", "dha"):
        args = parser.parse_args(["bench", name, "--quick", "--repeats", "2"])
        assert args.quick and args.repeats == 2
        assert args.func(args) == 0            # the suite has no real GPU
        assert f"bench {name}: no CUDA GPU found" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    args = parser.parse_args(["bench"])
    assert args.func(args) == 2                # no benchmark named: usage


def test_cli_bench_hands_values_starting_with_a_dash_to_the_script(capsys, tmp_path,
                                                                   monkeypatch):
    # The values went over as separate tokens: the script's parser took
    # "-run1.png" for an option ("--plot: expected one argument", exit 2).
    import argparse
    from rtmem import cli_bench
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    parser = argparse.ArgumentParser(prog="rtmem")
    cli_bench.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "pcie", "--plot=-run1.png"])
    assert args.func(args) == 0                # accepted; no GPU here
    assert "bench pcie: no CUDA GPU found" in capsys.readouterr().err
    args = parser.parse_args(["bench", "dha", "--sweep=-64,256"])
    with pytest.raises(SystemExit) as exc:
        args.func(args)
    assert exc.value.code == 2
    assert "ascending, distinct and >= 1" in capsys.readouterr().err


def test_probe_arguments_must_be_integers(be):
    buf = be.param(np.arange(16, dtype=np.uint64))
    for kwargs, fragment in ((dict(value="x"), "integer"), (dict(value=1.7), "integer"),
                             (dict(value=1, blocks=2.7), "blocks"),
                             (dict(value=1, blocks=float("nan")), "blocks")):
        with pytest.raises(KernelArgumentError, match=fragment):
            be.k.dha_write(buf, **kwargs)
    np.testing.assert_array_equal(be.host(buf), np.arange(16, dtype=np.uint64))


def test_gpu_delay_refuses_non_finite_seconds():
    from rtmem.kernels import dha
    for bad in (float("nan"), float("inf"), -1.0, "1"):
        with pytest.raises(KernelArgumentError, match="seconds"):
            dha.gpu_delay(bad)
    for zero in (0, 0.0):            # no delay is a valid delay (a no-op here)
        assert dha.gpu_delay(zero) is None


def test_layernorm_backward_with_x_the_same_array_as_grad_out(be):
    # The GPU wrapper chose whether to sum grad_out * xhat by comparing arrays:
    # x passed as grad_out itself skipped dgamma, which then read stale scratch.
    rng = np.random.default_rng(77)
    T, H, eps = 4, 8, 1e-5
    a = _rand(rng, T, H, scale=2.0)
    gamma, beta = _rand(rng, H), _rand(rng, H)
    _, mu, rstd, dx, dgamma, dbeta = _ln_reference(a, gamma, beta, a, eps)
    mean, rs = be.act(mu.astype(np.float32)), be.act(rstd.astype(np.float32))
    gamma_d = be.param(gamma)
    # an earlier call of the same shape leaves its sums in the reused scratch
    be.k.layernorm_backward(be.act(_rand(rng, T, H)), be.act(_rand(rng, T, H)), mean, rs,
                            gamma_d, None, be.param(_rand(rng, H)), be.param(_rand(rng, H)))
    same = be.act(a)
    gg, gb = be.param(_rand(rng, H)), be.param(_rand(rng, H))
    be.k.layernorm_backward(same, same, mean, rs, gamma_d, None, gg, gb)
    np.testing.assert_allclose(be.host(gg), dgamma, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(be.host(gb), dbeta, rtol=1e-4, atol=1e-5)


def test_scratch_is_per_host_thread():
    # Each wrapper passes scratch between the kernels it enqueues: a call from
    # another thread enqueued in between on the same stream (or on the
    # per-thread default stream, one handle for many streams) must not share it.
    import threading

    from numba import cuda
    from rtmem.kernels import dha
    V, H, T = 6, 3, 8
    rng = np.random.default_rng(5)

    def job():
        ids = rng.integers(0, V, T).astype(np.int64)
        dy = _rand(rng, T, H)
        ref = np.zeros((V, H))
        np.add.at(ref, ids, dy.astype(np.float64))
        return cuda.to_device(ids), cuda.to_device(dy), ref
    (ids_a, dy_a, ref_a), (ids_b, dy_b, ref_b) = job(), job()
    results = {}
    real_link = dha._embedding_link_kernel

    class OtherThreadAfterLink:      # thread B's whole call lands after A's link kernel
        fired = False

        def __getitem__(self, config):
            def launch(*args):
                real_link[config](*args)
                if not OtherThreadAfterLink.fired:
                    OtherThreadAfterLink.fired = True

                    def b():
                        gw = cuda.to_device(np.zeros((V, H), np.float32))
                        dha.embedding_backward(dy_b, ids_b, gw)
                        results["b"] = gw.copy_to_host()
                    t = threading.Thread(target=b)
                    t.start()        # joined at once: the simulator runs one launch
                    t.join()         # at a time, so this is the interleaving, serialized
            return launch
    mp = pytest.MonkeyPatch()
    mp.setattr(dha, "_embedding_link_kernel", OtherThreadAfterLink())
    try:
        gw_a = cuda.to_device(np.zeros((V, H), np.float32))
        dha.embedding_backward(dy_a, ids_a, gw_a)
    finally:
        mp.undo()
    np.testing.assert_allclose(results["b"], ref_b, atol=1e-5)
    np.testing.assert_allclose(gw_a.copy_to_host(), ref_a, atol=1e-5)


def test_arrays_not_aligned_to_their_items_are_refused():
    # A float32 read at an odd address faults the GPU (and poisons the context);
    # arenas with alignment < 4 can produce such buffers.
    from rtmem.kernels import dha_cpu
    from rtmem.kernels._launch import check_array
    raw = np.zeros(4 * 16 + 1, dtype=np.uint8)
    x = np.frombuffer(raw.data, dtype=np.float32, count=16, offset=1).reshape(4, 4)
    gamma, beta = np.ones(4, np.float32), np.zeros(4, np.float32)
    out, mean, rstd = np.empty((4, 4), np.float32), np.empty(4, np.float32), \
        np.empty(4, np.float32)
    with pytest.raises(KernelArgumentError, match="not a multiple of its 4-byte items"):
        dha_cpu.layernorm_forward(x, gamma, beta, out, mean, rstd)
    # int64 ids 4 bytes past an 8-byte boundary: aligned for 4-byte items, not for theirs
    raw = np.zeros(8 * 5, dtype=np.uint8)
    offset = (4 - raw.ctypes.data) % 8
    ids = np.frombuffer(raw.data, dtype=np.int64, count=3, offset=offset)
    with pytest.raises(KernelArgumentError, match="not a multiple of its 8-byte items"):
        dha_cpu.embedding_forward(np.ones((2, 4), np.float32), ids, np.empty((3, 4), np.float32))

    class DeviceView:                 # a device array as numba would see it
        dtype, shape, flags = np.dtype(np.float32), (4,), {"C_CONTIGUOUS": True}
        __cuda_array_interface__ = {"data": (0x7f0000000002, False), "shape": (4,),
                                    "typestr": "<f4", "version": 3}
    with pytest.raises(KernelArgumentError, match="0x7f0000000002"):
        check_array(DeviceView(), "weight", ndim=1)


def test_stream_arguments():
    from rtmem.kernels._launch import numba_stream
    assert numba_stream(None) == 0 and numba_stream(0) == 0
    with pytest.raises(KernelArgumentError, match="not a stream"):
        numba_stream(True)


def test_two_overlapping_outputs_are_named_as_both_written():
    # "the kernel reads rstd while it writes mean": rstd is only written
    from rtmem.kernels._launch import check_disjoint
    buf = np.zeros(8, np.float32)
    with pytest.raises(KernelArgumentError, match="mean and rstd overlap in memory; the "
                       "kernel writes both"):
        check_disjoint({"out": np.zeros(4, np.float32), "mean": buf[:4], "rstd": buf[2:6]},
                       {"x": np.ones(4, np.float32)})
    with pytest.raises(KernelArgumentError, match="the kernel reads x while it writes out"):
        check_disjoint({"out": buf[:4]}, {"x": buf[2:6]})


def test_stream_blocks_on_a_gpu_is_the_work_capped_at_blocks_per_sm_on_every_sm(monkeypatch):
    # Off the simulator: ceil(n_items / threads) blocks, at most blocks_per_sm on
    # each SM (132 SMs, as on an H100/H200), and never fewer than one.
    from rtmem.kernels import _launch
    monkeypatch.setattr(_launch, "simulator_active", lambda: False)
    monkeypatch.setattr(_launch, "sm_count", lambda: 132)
    assert _launch.stream_blocks(10**9) == 1056                     # 132 * 8
    assert _launch.stream_blocks(10**9, blocks_per_sm=16) == 2112   # 132 * 16
    assert _launch.stream_blocks(257) == 2                          # 256 + 1 items
    assert _launch.stream_blocks(1000, threads=1, blocks_per_sm=16) == 1000
    assert _launch.stream_blocks(0) == 1


def test_row_threads_is_the_smallest_power_of_two_from_32_covering_the_row():
    # capped at THREADS (256): the row kernels' reduction arrays hold THREADS floats
    from rtmem.kernels._launch import row_threads
    for h, want in ((1, 32), (32, 32), (33, 64), (64, 64), (65, 128), (200, 256),
                    (256, 256), (257, 256), (10**6, 256)):
        assert row_threads(h) == want, h


def test_adjacent_and_empty_arrays_do_not_overlap():
    # Spans are half-open [start, end): arrays that only touch share no byte, and
    # an empty output writes nothing wherever it points.
    from rtmem.kernels._launch import check_disjoint
    buf = np.zeros(8, np.float32)
    check_disjoint({"out": buf[:4]}, {"x": buf[4:]})
    check_disjoint({"out": buf[4:]}, {"x": buf[:4]})
    check_disjoint({"out": buf[2:].reshape(2, 3)[:0]}, {"x": buf})   # [0, 3] at byte 8
    with pytest.raises(KernelArgumentError, match="reads x while it writes out"):
        check_disjoint({"out": buf[:4]}, {"x": buf[3:5]})     # one float in common


@sim_and_cpu
def test_numpy_bools_are_flags(be):
    # np.True_ (e.g. from a numpy comparison) is a flag like True
    rng = np.random.default_rng(50)
    V, H = 4, 3
    ids = be.act(np.array([1, 3, 1], np.int64))
    dy, g0 = _rand(rng, 3, H), _rand(rng, V, H)
    gw = be.param(g0)
    be.k.embedding_backward(be.act(dy), ids, gw, accumulate=np.True_, check=np.True_)
    ref = g0.astype(np.float64)
    ref[1] += dy[0].astype(np.float64) + dy[2]
    ref[3] += dy[1]
    np.testing.assert_allclose(be.host(gw), ref, rtol=1e-6, atol=1e-6)


def test_layernorm_forward_stages_gamma_and_beta_when_they_just_fit(monkeypatch, fresh_seed):
    # Staged when 2*H*4 bytes <= the shared-memory budget, the boundary included,
    # where the shared array holds exactly gamma and beta.
    from rtmem.kernels import dha
    T, H = 2, 20
    monkeypatch.setattr(dha, "_MAX_SHARED_PARAMS", 2 * H * 4)
    assert dha._staging(2 * H) == (True, 160)
    assert dha._staging(2 * H + 1) == (False, 0)
    rng = np.random.default_rng(fresh_seed)
    _ln_forward_checked(_Sim("device"), rng, _rand(rng, T, H, scale=2.0), 1e-5,
                        out_tol=(1e-4, 1e-5), mean_tol=(1e-5, 1e-6), rstd_rtol=1e-4)
