"""DHA kernels on a real GPU with real mapped host memory (``pytest -m gpu``).

Checks, per MemFerry notes §9.1 B6: every layer kernel gives the same result
(bitwise, except the embedding backward whose summation order follows atomics)
whether its weight lives in HBM or in mapped host memory, and matches a float64
numpy reference; gradients written straight into mapped memory (GO-MemFerry)
are right and visible to the CPU after a synchronize; launches work on numba and
CuPy streams. No timing is asserted. Skipped without a GPU (see conftest.py).
"""

import numpy as np
import pytest

from rtmem.errors import KernelArgumentError

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda():
    from numba import cuda
    return cuda


def _rand(rng, *shape):
    return (rng.standard_normal(shape) + 0.25).astype(np.float32)


def _mapped(cuda, a):
    m = cuda.mapped_array(a.shape, dtype=a.dtype)
    m[...] = a
    return m


def test_probes_on_a_large_mapped_buffer(cuda):
    from rtmem.kernels import dha
    rng = np.random.default_rng(1)
    data = rng.integers(0, 2**63, size=(64 << 20) // 8, dtype=np.int64).view(np.uint64)
    m = _mapped(cuda, data)
    for width in (4, 8):
        words = data.view(np.uint32 if width == 4 else np.uint64).astype(np.uint64)
        assert dha.xor_checksum(dha.dha_read(m, width=width)) == int(
            np.bitwise_xor.reduce(words))
    mask = int(rng.integers(1, 2**62))
    dha.dha_rmw(m, mask)
    cuda.synchronize()
    np.testing.assert_array_equal(m, data ^ np.uint64(mask))
    dha.dha_write(m, 0x0123456789ABCDEF)
    cuda.synchronize()
    assert np.all(m == 0x0123456789ABCDEF)


def test_checksum_of_a_read_on_a_nonblocking_stream_waits_for_it(cuda):
    # The partials are bound to the launch stream: the checksum must not copy
    # them back on the legacy stream while the kernel still runs. A 1 GiB mapped
    # read takes tens of milliseconds, long enough to show a missing wait.
    cp = pytest.importorskip("cupy")
    from rtmem.kernels import dha
    rng = np.random.default_rng(11)
    data = rng.integers(0, 2**63, size=(1 << 30) // 8, dtype=np.int64).view(np.uint64)
    m = _mapped(cuda, data)
    expect = int(np.bitwise_xor.reduce(data))
    for stream in (cp.cuda.Stream(non_blocking=True), cuda.stream()):
        assert dha.xor_checksum(dha.dha_read(m, stream=stream)) == expect


def test_embedding_mapped_equals_device_and_reference(cuda):
    from rtmem.kernels import dha
    rng = np.random.default_rng(2)
    V, H, T = 5000, 768, 1024
    w = _rand(rng, V, H)
    ids = rng.integers(0, V, T).astype(np.int64)
    ids[:64] = 7                                         # a hot row
    d_ids = cuda.to_device(ids)
    outs = []
    for weight in (cuda.to_device(w), _mapped(cuda, w)):
        out = cuda.device_array((T, H), np.float32)
        dha.embedding_forward(weight, d_ids, out)
        outs.append(out.copy_to_host())
    np.testing.assert_array_equal(outs[0], w[ids])
    np.testing.assert_array_equal(outs[1], outs[0])
    dy = _rand(rng, T, H)
    ref = np.zeros((V, H))
    np.add.at(ref, ids, dy.astype(np.float64))
    g0 = _rand(rng, V, H)
    for accumulate in (False, True):
        gw = _mapped(cuda, g0)
        dha.embedding_backward(cuda.to_device(dy), d_ids, gw, accumulate=accumulate)
        cuda.synchronize()
        np.testing.assert_allclose(gw, ref + (g0 if accumulate else 0), rtol=1e-5, atol=1e-4)


def test_embedding_bad_ids_raise(cuda):
    from rtmem.kernels import dha
    w = _mapped(cuda, np.ones((10, 32), np.float32))
    with pytest.raises(KernelArgumentError, match="outside"):
        dha.embedding_forward(w, cuda.to_device(np.array([0, 10], np.int32)),
                              cuda.device_array((2, 32), np.float32))


# Shared-memory staging on (768), off (8192), and at the edge (6144: 2*H*4 = 48 KiB of
# gamma/beta, which with the kernel's static reduction array would exceed the 48 KiB a
# launch may use, so it must not be staged).
@pytest.mark.parametrize("H", [768, 6144, 8192])
def test_layernorm_mapped_equals_device_and_reference(cuda, H):
    from rtmem.kernels import dha
    rng = np.random.default_rng(3)
    T = 300
    x = _rand(rng, T, H) * 2 + 1
    gamma, beta, dy = _rand(rng, H), _rand(rng, H), _rand(rng, T, H)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    mu = x64.mean(1, keepdims=True)
    rstd = 1 / np.sqrt(x64.var(1, keepdims=True) + 1e-5)
    xhat = (x64 - mu) * rstd
    g = dy64 * gamma
    dx = rstd * (g - g.mean(1, keepdims=True) - xhat * (g * xhat).mean(1, keepdims=True))
    d_x, d_dy = cuda.to_device(x), cuda.to_device(dy)
    results = []
    for place in (cuda.to_device, lambda a: _mapped(cuda, a)):
        out = cuda.device_array((T, H), np.float32)
        mean, rs = cuda.device_array(T, np.float32), cuda.device_array(T, np.float32)
        gam = place(gamma)
        dha.layernorm_forward(d_x, gam, place(beta), out, mean, rs)
        gx = cuda.device_array((T, H), np.float32)
        gg, gb = _mapped(cuda, np.zeros(H, np.float32)), _mapped(cuda, np.zeros(H, np.float32))
        dha.layernorm_backward(d_dy, d_x, mean, rs, gam, gx, gg, gb)
        cuda.synchronize()
        results.append((out.copy_to_host(), gx.copy_to_host(), np.array(gg), np.array(gb)))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    out, gx, gg, gb = results[0]
    np.testing.assert_allclose(out, xhat * gamma + beta, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gx, dx, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(gg, (dy64 * xhat).sum(0), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(gb, dy64.sum(0), rtol=1e-4, atol=1e-3)


def test_linear_mapped_equals_device_and_reference(cuda):
    from rtmem.kernels import dha
    rng = np.random.default_rng(4)
    T, K, N = 515, 768, 1000                           # not multiples of the tile
    x, w, b, dy = _rand(rng, T, K), _rand(rng, N, K), _rand(rng, N), _rand(rng, T, N)
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    d_x, d_dy = cuda.to_device(x), cuda.to_device(dy)
    results = []
    for place in (cuda.to_device, lambda a: _mapped(cuda, a)):
        weight = place(w)
        out = cuda.device_array((T, N), np.float32)
        dha.linear_forward(d_x, weight, place(b), out)
        gx = cuda.device_array((T, K), np.float32)
        g0w, g0b = _rand(rng, N, K), _rand(rng, N)
        gw, gb = _mapped(cuda, g0w), _mapped(cuda, g0b)    # GO: gradients into host memory
        dha.linear_backward(d_dy, d_x, weight, gx, gw, gb, accumulate=True)
        cuda.synchronize()
        results.append((out.copy_to_host(), gx.copy_to_host(), np.array(gw) - g0w,
                        np.array(gb) - g0b))
    for a, c in zip(results[0][:2], results[1][:2]):
        np.testing.assert_array_equal(a, c)
    out, gx, dw, db = results[0]
    tol = dict(rtol=1e-3, atol=1e-2)                   # float32 sums of 515-1000 terms
    np.testing.assert_allclose(out, x64 @ w64.T + b, **tol)
    np.testing.assert_allclose(gx, dy64 @ w64, **tol)
    np.testing.assert_allclose(dw, dy64.T @ x64, **tol)
    np.testing.assert_allclose(db, dy64.sum(0), **tol)


def test_gemm_tile_heights_agree_bitwise_on_mapped_weights(cuda):
    # Every tile height sums k in the same order, so the compiled kernels (FMA
    # contraction included) must give the same bits; each matches the reference.
    from rtmem.kernels import dha
    rng = np.random.default_rng(6)
    T, K, N = 700, 300, 200                       # ragged for every tile height
    x, w = _rand(rng, T, K), _rand(rng, N, K)
    d_x, m_w = cuda.to_device(x), _mapped(cuda, w)
    got = {}
    for r in dha.GEMM_ROW_TILES:
        out = cuda.device_array((T, N), np.float32)
        dha._gemm(d_x, m_w, out, None, False, True, False, 0, row_tiles=r)
        got[r] = out.copy_to_host()
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(got[1], ref, rtol=1e-3, atol=1e-2)
    for r in dha.GEMM_ROW_TILES[1:]:
        np.testing.assert_array_equal(got[r], got[1])


def test_launch_on_numba_and_cupy_streams(cuda):
    from rtmem.kernels import dha
    rng = np.random.default_rng(5)
    T, K, N = 64, 96, 80
    x, w = _rand(rng, T, K), _rand(rng, N, K)
    ref = x.astype(np.float64) @ w.T
    s = cuda.stream()
    out = cuda.device_array((T, N), np.float32, stream=s)
    dha.linear_forward(cuda.to_device(x, stream=s), _mapped(cuda, w), None, out, stream=s)
    s.synchronize()
    np.testing.assert_allclose(out.copy_to_host(), ref, rtol=1e-4, atol=1e-3)
    cp = pytest.importorskip("cupy")
    cs = cp.cuda.Stream(non_blocking=True)
    with cs:
        cx, cout = cp.asarray(x), cp.empty((T, N), dtype=cp.float32)
    dha.linear_forward(cx, _mapped(cuda, w), None, cout, stream=cs)
    cs.synchronize()
    np.testing.assert_allclose(cp.asnumpy(cout), ref, rtol=1e-4, atol=1e-3)
    torch = pytest.importorskip("torch")
    ts = torch.cuda.Stream()                       # wrapped through .cuda_stream
    cout[:] = 0
    cp.cuda.Device().synchronize()                 # torch's stream is non-blocking
    dha.linear_forward(cx, _mapped(cuda, w), None, cout, stream=ts)
    ts.synchronize()
    np.testing.assert_allclose(cp.asnumpy(cout), ref, rtol=1e-4, atol=1e-3)
