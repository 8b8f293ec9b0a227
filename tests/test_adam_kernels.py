"""Fused CPU Adam kernels (rtmem.kernels.adam) and the 16-bit float conversions."""

from __future__ import annotations

import itertools
import os
import zlib

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _adam_reference import adam_step64
import rtmem.kernels as K
from rtmem.errors import OptimizerError
from rtmem.kernels import BLOCK_ELEMENTS, adam_update, decode_half, encode_half, grads_finite

# Several parallel blocks plus a ragged tail, so block edges are exercised.
N = 3 * BLOCK_ELEMENTS + 123


# --------------------------------------------------------------------------- helpers

def _bf16_to_f64(bits):
    # Independent of the kernel: a bfloat16 is the top half of a float32.
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _grads(rng, fmt, n=N, scale=0.5):
    """(array handed to the kernel, grad_format, exact float64 values)."""
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    if fmt == "float32":
        return x, None, x.astype(np.float64)
    if fmt == "float16":
        h = x.astype(np.float16)
        return h, None, h.astype(np.float64)
    bits = encode_half(x, "bfloat16")
    return bits, "bfloat16", _bf16_to_f64(bits)


def _state(rng, n=N, amsgrad=False):
    """Fresh, non-zero float32 state: params, exp_avg, exp_avg_sq[, max_exp_avg_sq]."""
    p = rng.standard_normal(n).astype(np.float32)
    m = (rng.standard_normal(n) * 0.1).astype(np.float32)
    v = rng.uniform(1e-3, 1e-1, n).astype(np.float32)
    vmax = (v * rng.uniform(1.0, 1.5, n)).astype(np.float32) if amsgrad else None
    return p, m, v, vmax


_ref_step = adam_step64    # the oracle


def _rel_err(x, ref):
    """Max error relative to |ref| + rms(ref): float32 round-off, robust near 0."""
    ref = np.asarray(ref, dtype=np.float64)
    scale = np.sqrt(np.mean(ref * ref))
    return float(np.max(np.abs(x.astype(np.float64) - ref) / (np.abs(ref) + scale)))


def _snapshot(*arrays):
    return [None if a is None else a.copy() for a in arrays]


def _assert_bit_identical(before, after):
    for b, a in zip(before, after):
        if b is None:
            assert a is None
        else:
            assert b.tobytes() == a.tobytes()


# --------------------------------------------------------------------------- 16-bit formats

# soft=True forces the integer conversions where the F16C instructions are used,
# so both implementations are checked on every x86 machine.
@pytest.mark.parametrize("soft", [False, True])
def test_decode_float16_exhaustive(soft):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = decode_half(bits, "float16", _soft=soft)
    ref = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])


def test_decode_bfloat16_exhaustive():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = decode_half(bits, "bfloat16")
    assert np.array_equal(got.view(np.uint32), bits.astype(np.uint32) << 16)


def _edge_floats(rng):
    random_bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    wide = rng.standard_normal(200_000) * np.exp(rng.uniform(-30, 13, 200_000))
    # Exact midpoints between neighbouring fp16 values: the ties-to-even cases,
    # including subnormals and the 65504 -> inf overflow boundary (65520).
    h = np.arange(0, 0x7C00, dtype=np.uint16)
    lo = h.view(np.float16).astype(np.float64)
    hi = (h + 1).view(np.float16).astype(np.float64)
    ties = (lo + hi) / 2
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520,
                        6e-8, 2.98e-8, -2.98e-8, 3.4e38], dtype=np.float64)
    return np.concatenate([random_bits.view(np.float32), wide.astype(np.float32),
                           ties.astype(np.float32), -ties.astype(np.float32),
                           special.astype(np.float32)])


@pytest.mark.parametrize("soft", [False, True])
def test_encode_float16_matches_numpy_rounding(soft):
    x = _edge_floats(np.random.default_rng(0))
    got = encode_half(x, "float16", _soft=soft)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(np.isnan(got.view(np.float16)), nan)
    assert np.array_equal(got[~nan], ref[~nan])


def test_encode_bfloat16_matches_torch_rounding():
    torch = pytest.importorskip("torch")
    x = _edge_floats(np.random.default_rng(1))
    # bfloat16 ties: float32 values whose low 16 bits are exactly 0x8000.
    ties = (np.random.default_rng(2).integers(0, 1 << 16, 5000).astype(np.uint32) << 16
            | 0x8000).view(np.float32)
    x = np.concatenate([x, ties[np.isfinite(ties)]])
    got = encode_half(x, "bfloat16")
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(np.isnan(decode_half(got, "bfloat16")), nan)
    assert np.array_equal(got[~nan], ref[~nan])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=50))
def test_encode_float16_rounds_like_numpy_for_any_float(xs):
    a = np.array(xs, dtype=np.float32)
    with np.errstate(over="ignore"):
        ref = a.astype(np.float16).view(np.uint16)
    assert np.array_equal(encode_half(a, "float16"), ref)
    assert np.array_equal(encode_half(a, "float16", _soft=True), ref)


# --------------------------------------------------------------------------- correctness

# every (grad format, decoupled, amsgrad, out format)
CASES = list(itertools.product(("float32", "float16", "bfloat16"), (False, True),
                               (False, True), (None, "float32", "float16", "bfloat16")))


@pytest.mark.parametrize("gfmt,decoupled,amsgrad,ofmt", CASES)
def test_matches_float64_reference_over_many_steps(gfmt, decoupled, amsgrad, ofmt,
                                                   fresh_seed):
    rng = np.random.default_rng([fresh_seed, zlib.crc32(repr((gfmt, decoupled, amsgrad,
                                                              ofmt)).encode())])
    p, m, v, vmax = _state(rng, amsgrad=amsgrad)
    rp, rm, rv = (a.astype(np.float64) for a in (p, m, v))
    rvmax = None if vmax is None else vmax.astype(np.float64)
    hyper = dict(lr=3e-3, beta1=0.85, beta2=0.99, eps=1e-7, weight_decay=0.05)
    out = {None: None, "float32": np.empty(N, np.float32), "float16": np.empty(N, np.float16),
           "bfloat16": np.empty(N, np.uint16)}[ofmt]
    for step in range(5, 35):   # resume mid-training: non-trivial bias correction
        g, grad_format, g64 = _grads(rng, gfmt)
        applied = adam_update(p, g, m, v, step=step, max_exp_avg_sq=vmax,
                              decoupled_weight_decay=decoupled, grad_format=grad_format,
                              out=out, out_format="bfloat16" if ofmt == "bfloat16" else None,
                              **hyper)
        assert applied
        rp, rm, rv, rvmax = _ref_step(rp, g64, rm, rv, rvmax, lr=hyper["lr"],
                                      beta1=hyper["beta1"], beta2=hyper["beta2"],
                                      eps=hyper["eps"], wd=hyper["weight_decay"],
                                      decoupled=decoupled, step=step)
    assert _rel_err(p, rp) < 1e-5
    assert _rel_err(m, rm) < 1e-5
    assert _rel_err(v, rv) < 1e-5
    if amsgrad:
        assert _rel_err(vmax, rvmax) < 1e-5
    if ofmt == "float32":
        assert np.array_equal(out, p)
    elif ofmt == "float16":
        assert np.array_equal(out.view(np.uint16), p.astype(np.float16).view(np.uint16))
    elif ofmt == "bfloat16":
        assert np.array_equal(out, encode_half(p, "bfloat16"))


def test_reference_agrees_with_torch_adamw_float64():
    # Pins the oracle above to torch's definition (AMSGrad, decoupled decay).
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    p = rng.standard_normal(1000)
    t = torch.tensor(p, requires_grad=True)
    opt = torch.optim.AdamW([t], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1,
                            amsgrad=True)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    vmax = np.zeros_like(p)
    for step in range(1, 11):
        g = rng.standard_normal(1000)
        t.grad = torch.from_numpy(g.copy())
        opt.step()
        p, m, v, vmax = _ref_step(p, g, m, v, vmax, lr=1e-2, beta1=0.8, beta2=0.95,
                                  eps=1e-6, wd=0.1, decoupled=True, step=step)
    np.testing.assert_allclose(t.detach().numpy(), p, rtol=1e-12, atol=1e-14)


def test_bias_correction_at_step_one_moves_each_param_by_lr():
    # From zero moments, step 1 gives m_hat = g and v_hat = g^2, so each parameter
    # moves by lr * g / (|g| + eps): lr against the sign of g.
    rng = np.random.default_rng(4)
    p = rng.standard_normal(N).astype(np.float32)
    p0 = p.copy()
    # |g| >= 0.1 >> eps, so the step is lr to float32 precision.
    g = (rng.choice([-1.0, 1.0], N) * rng.uniform(0.1, 2.0, N)).astype(np.float32)
    m = np.zeros(N, np.float32)
    v = np.zeros(N, np.float32)
    lr, eps = 1e-2, 1e-8
    assert adam_update(p, g, m, v, lr=lr, step=1, eps=eps)
    g64 = g.astype(np.float64)
    expected = p0 - lr * g64 / (np.abs(g64) + eps)
    assert _rel_err(p, expected) < 1e-6
    moved = p0.astype(np.float64) - p
    # Up to a few ulps of |p| <= ~4 of float32 rounding in p0 - p.
    np.testing.assert_allclose(moved, lr * np.sign(g), rtol=1e-6,
                               atol=4 * np.spacing(np.float32(4)))


@pytest.mark.parametrize("amsgrad", [False, True])
def test_eps_is_added_after_the_bias_correction_of_the_second_moment(amsgrad, fresh_seed):
    # torch's denominator is sqrt(v_hat) + eps = sqrt(v) / sqrt(1 - beta2**t) + eps.
    # Early steps divide sqrt(v) by ~0.05 and a large eps is comparable to the
    # result, so eps put before the correction, (sqrt(v) + eps) / sqrt(1 -
    # beta2**t), moves parameters ~20x less; with the usual 1e-8 the two agree.
    rng = np.random.default_rng([fresh_seed, 41, amsgrad])
    p, m, _, vmax = _state(rng, amsgrad=amsgrad)
    v = rng.uniform(1e-6, 1e-4, N).astype(np.float32)
    if amsgrad:
        vmax = (v * rng.uniform(1.0, 1.5, N)).astype(np.float32)
    rp, rm, rv = (a.astype(np.float64) for a in (p, m, v))
    rvmax = None if vmax is None else vmax.astype(np.float64)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-2, weight_decay=0.0)
    for step in (2, 3):
        g, _, g64 = _grads(rng, "float32", scale=1e-3)
        assert adam_update(p, g, m, v, step=step, max_exp_avg_sq=vmax, **hyper)
        rp, rm, rv, rvmax = _ref_step(rp, g64, rm, rv, rvmax, lr=hyper["lr"],
                                      beta1=hyper["beta1"], beta2=hyper["beta2"],
                                      eps=hyper["eps"], wd=0.0, decoupled=False, step=step)
    p0 = _state(np.random.default_rng([fresh_seed, 41, amsgrad]), amsgrad=amsgrad)[0]
    # the steps themselves, not the parameters (|p| ~ 1 would hide them)
    assert _rel_err(p.astype(np.float64) - p0, rp - p0) < 1e-4


def test_huge_gradients_keep_the_second_moment_finite(fresh_seed):
    # g*g overflows float32 from |g| ~ 1.8e19 while (1-beta2)*g*g (torch's
    # addcmul_ order) stays finite up to ~5.8e20: v = inf froze such parameters
    # for good (m / inf = 0 at every later step) where torch and the oracle move them.
    rng = np.random.default_rng(fresh_seed)
    n = 1000
    p, m, v, vmax = _state(rng, n=n, amsgrad=True)
    rp, rm, rv, rvmax = (a.astype(np.float64) for a in (p, m, v, vmax))
    for step in range(1, 4):
        g = (rng.choice([-1.0, 1.0], n) * rng.uniform(2e19, 2e20, n)).astype(np.float32)
        assert adam_update(p, g, m, v, max_exp_avg_sq=vmax, lr=1e-3, step=step)
        rp, rm, rv, rvmax = _ref_step(rp, g.astype(np.float64), rm, rv, rvmax, lr=1e-3,
                                      beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0,
                                      decoupled=False, step=step)
    assert np.isfinite(v).all() and np.isfinite(vmax).all()
    assert _rel_err(v, rv) < 1e-5
    assert _rel_err(p, rp) < 1e-5


@pytest.mark.parametrize("beta1, beta2", [(0.9, 0.9995), (0.999, 0.999)])
def test_moments_decay_at_exactly_beta_over_many_steps(beta1, beta2, fresh_seed):
    # beta rounded to float32 next to an exact float32(1 - beta) made the moments
    # exponential averages whose weights do not sum to 1: beta2=0.9995 is
    # 0.99949998 in float32, so v settled 4.7e-5 (~390 float32 ulps) below the
    # float64 average, the same sign in every element (1.3% at beta2=0.999999).
    rng = np.random.default_rng(fresh_seed)
    n = 2048
    p, m, v = np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    rm, rv = np.zeros(n), np.zeros(n)
    for step in range(1, 8001):       # 4 time constants of the slower moment
        g = rng.standard_normal(n).astype(np.float32)
        assert adam_update(p, g, m, v, lr=0.0, step=step, beta1=beta1, beta2=beta2)
        g64 = g.astype(np.float64)
        rm = beta1 * rm + (1.0 - beta1) * g64
        rv = beta2 * rv + (1.0 - beta2) * g64 * g64
    # A multiplicative drift is the slope of kernel against oracle minus 1.
    # Per-step round-off is unbiased and averages out over n elements and the
    # ~1/(1-beta) steps each moment remembers (measured |slope - 1| < 3e-7);
    # 3e-6 (25 float32 ulps) stays 4x below the smallest drift of these cases
    # (1.3e-5 for 0.999).
    for name, x, ref in (("exp_avg", m, rm), ("exp_avg_sq", v, rv)):
        slope = float(np.dot(x, ref) / np.dot(ref, ref))
        assert abs(slope - 1.0) < 3e-6, (name, slope - 1.0)


def test_power_of_two_loss_scale_is_bit_exact():
    rng = np.random.default_rng(5)
    a = _state(rng, amsgrad=True)
    b = _snapshot(*a)
    g = (rng.standard_normal(N) * 1e-3).astype(np.float32)
    adam_update(a[0], g, a[1], a[2], max_exp_avg_sq=a[3], lr=1e-3, step=3)
    assert adam_update(b[0], g * np.float32(1024), b[1], b[2], max_exp_avg_sq=b[3],
                       lr=1e-3, step=3, grad_scale=1024)
    _assert_bit_identical(a, b)


def test_maximize_equals_descending_on_negated_gradient():
    rng = np.random.default_rng(6)
    a = _state(rng)[:3]
    b = _snapshot(*a)
    g = rng.standard_normal(N).astype(np.float32)
    adam_update(*a[:1], g, *a[1:], lr=1e-3, step=2, maximize=True)
    adam_update(*b[:1], -g, *b[1:], lr=1e-3, step=2)
    _assert_bit_identical(a, b)


@pytest.mark.parametrize("gfmt", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", [0, N // 2, N - 1])
def test_nonfinite_gradient_skips_step_and_leaves_state_untouched(gfmt, bad, where):
    rng = np.random.default_rng(7)
    p, m, v, vmax = _state(rng, amsgrad=True)
    out = np.full(N, 7, np.uint16)
    g, grad_format, _ = _grads(rng, gfmt)
    if gfmt == "bfloat16":
        g[where] = encode_half(np.array([bad], np.float32), "bfloat16")[0]
    else:
        g[where] = bad
    before = _snapshot(p, m, v, vmax, out)
    assert not grads_finite(g, grad_scale=128.0, grad_format=grad_format)
    applied = adam_update(p, g, m, v, max_exp_avg_sq=vmax, lr=1e-3, step=2, grad_scale=128.0,
                          grad_format=grad_format, out=out, out_format="bfloat16")
    assert applied is False
    _assert_bit_identical(before, [p, m, v, vmax, out])


@pytest.mark.parametrize("gfmt", ["float32", "bfloat16"])
def test_small_arrays_take_the_serial_path_with_the_same_guarantees(gfmt):
    # <= BLOCK_ELEMENTS elements run without the thread pool; same contract.
    rng = np.random.default_rng(15)
    n = 1000
    p, m, v, _ = _state(rng, n=n)
    g, grad_format, g64 = _grads(rng, gfmt, n=n)
    before = _snapshot(p, m, v)
    bad = g.copy()
    bad[n - 1] = encode_half(np.array([np.nan], np.float32), "bfloat16")[0] \
        if gfmt == "bfloat16" else np.nan
    assert not adam_update(p, bad, m, v, lr=1e-3, step=3, grad_scale=4.0,
                           grad_format=grad_format)
    _assert_bit_identical(before, [p, m, v])
    assert adam_update(p, g, m, v, lr=1e-3, step=3, grad_format=grad_format)
    ref = _ref_step(*(a.astype(np.float64) for a in before[:1]), g64,
                    *(a.astype(np.float64) for a in before[1:]), None, lr=1e-3, beta1=0.9,
                    beta2=0.999, eps=1e-8, wd=0.0, decoupled=False, step=3)
    assert _rel_err(p, ref[0]) < 1e-6


def test_gradient_that_overflows_when_unscaled_skips_the_step():
    rng = np.random.default_rng(8)
    p, m, v, _ = _state(rng)
    g = rng.standard_normal(N).astype(np.float32)
    g[123] = 3e38   # finite, but 3e38 / 0.5 is inf in float32
    before = _snapshot(p, m, v)
    assert grads_finite(g)
    assert not adam_update(p, g, m, v, lr=1e-3, step=2, grad_scale=0.5)
    _assert_bit_identical(before, [p, m, v])


def test_finite_gradients_with_check_apply_the_step():
    rng = np.random.default_rng(9)
    p, m, v, _ = _state(rng)
    p0 = p.copy()
    g = rng.standard_normal(N).astype(np.float32)
    assert adam_update(p, g, m, v, lr=1e-3, step=2, check_finite=True)
    assert not np.array_equal(p, p0)


def test_chunked_updates_equal_one_whole_update():
    rng = np.random.default_rng(10)
    whole = _state(rng, amsgrad=True)
    parts = _snapshot(*whole)
    g = rng.standard_normal(N).astype(np.float32)
    out_w = np.empty(N, np.float16)
    out_p = np.empty(N, np.float16)
    kw = dict(lr=1e-3, step=4, weight_decay=0.01, decoupled_weight_decay=True)
    adam_update(whole[0], g, whole[1], whole[2], max_exp_avg_sq=whole[3], out=out_w, **kw)
    cuts = np.sort(rng.choice(np.arange(1, N), size=5, replace=False))
    edges = [0, *cuts.tolist(), N]
    for lo, hi in zip(edges[:-1], edges[1:]):
        adam_update(parts[0], g, parts[1], parts[2], max_exp_avg_sq=parts[3], out=out_p,
                    start=lo, stop=hi, **kw)
    _assert_bit_identical([*whole, out_w], [*parts, out_p])


def test_chunk_leaves_elements_outside_it_alone():
    rng = np.random.default_rng(11)
    p, m, v, _ = _state(rng)
    before = _snapshot(p, m, v)
    g = rng.standard_normal(N).astype(np.float32)
    adam_update(p, g, m, v, lr=1e-3, step=2, start=100, stop=200)
    for b, a in zip(before, (p, m, v)):
        assert np.array_equal(a[:100], b[:100]) and np.array_equal(a[200:], b[200:])
        assert not np.array_equal(a[100:200], b[100:200])


def test_finite_check_reads_exactly_the_range_it_is_given(fresh_seed):
    # A range of several parallel blocks whose last block is ragged, with a
    # non-finite gradient on each side just outside it: the finite pass must see
    # neither (a last block that ran a whole BLOCK_ELEMENTS past ``stop``, or a
    # check over the whole array instead of [start, stop), skipped a chunk's step
    # for another chunk's overflow), and the update must still match the oracle.
    rng = np.random.default_rng(fresh_seed)
    p, m, v, _ = _state(rng)
    g = rng.standard_normal(N).astype(np.float32)
    start, stop = 1 + int(rng.integers(100)), 2 * BLOCK_ELEMENTS + 77
    g[start - 1], g[stop] = np.nan, np.inf
    assert grads_finite(g, start=start, stop=stop)
    assert grads_finite(g, grad_scale=8.0, start=start, stop=stop, num_threads=1)
    assert not grads_finite(g, start=start - 1, stop=stop)
    assert not grads_finite(g, start=start, stop=stop + 1)
    before = _snapshot(p, m, v)
    assert adam_update(p, g, m, v, lr=1e-3, step=3, grad_scale=8.0, start=start, stop=stop)
    ref = _ref_step(*(a[start:stop].astype(np.float64) for a in before[:1]),
                    g[start:stop].astype(np.float64) / 8.0,
                    *(a[start:stop].astype(np.float64) for a in before[1:]), None, lr=1e-3,
                    beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0, decoupled=False, step=3)
    for got, want, old in zip((p, m, v), ref[:3], before):
        assert _rel_err(got[start:stop], want) < 1e-6
        assert np.array_equal(got[:start], old[:start])
        assert np.array_equal(got[stop:], old[stop:])


def _record_threads(monkeypatch, module="adam",
                    names=("_adam_kernel", "_nonfinite_kernel")):
    """Replace the parallel kernels ``names`` of ``rtmem.kernels.<module>`` by
    wrappers that note numba's thread count at each call (what the kernel's
    parallel loop runs on)."""
    import importlib
    adam = importlib.import_module(f"rtmem.kernels.{module}")
    seen = []
    for name in names:
        real = getattr(adam, name)

        def wrapper(*args, _real=real, _name=name):
            seen.append((_name, numba.get_num_threads()))
            return _real(*args)
        monkeypatch.setattr(adam, name, wrapper)
    return seen


def test_num_threads_is_what_the_parallel_kernels_run_on(monkeypatch):
    limit = numba.config.NUMBA_NUM_THREADS
    if limit < 2:
        pytest.skip("one numba thread: a thread count cannot be told from the default")
    seen = _record_threads(monkeypatch)
    rng = np.random.default_rng(13)
    p, m, v = _state(rng)[:3]
    g = rng.standard_normal(N).astype(np.float32)
    numba.set_num_threads(limit)
    adam_update(p, g, m, v, lr=1e-3, step=1, grad_scale=2.0, num_threads=1)
    assert grads_finite(g, num_threads=1)
    assert seen == [("_nonfinite_kernel", 1), ("_adam_kernel", 1), ("_nonfinite_kernel", 1)]
    assert numba.get_num_threads() == limit                 # restored
    seen.clear()
    adam_update(p, g, m, v, lr=1e-3, step=2)                # None: the count as it is
    assert seen == [("_adam_kernel", limit)]


def test_thread_count_does_not_change_results_and_is_restored():
    rng = np.random.default_rng(12)
    a = _state(rng)[:3]
    b = _snapshot(*a)
    g = rng.standard_normal(N).astype(np.float32)
    previous = numba.get_num_threads()
    adam_update(a[0], g, a[1], a[2], lr=1e-3, step=2, num_threads=1)
    assert numba.get_num_threads() == previous
    adam_update(b[0], g, b[1], b[2], lr=1e-3, step=2,
                num_threads=numba.config.NUMBA_NUM_THREADS)
    _assert_bit_identical(a, b)


def test_multidimensional_arrays_are_updated_as_flat_memory():
    rng = np.random.default_rng(13)
    p, m, v, _ = _state(rng, n=12 * 7)
    flat = _snapshot(p, m, v)
    g = rng.standard_normal(12 * 7).astype(np.float32)
    adam_update(p.reshape(12, 7), g.reshape(12, 7), m.reshape(12, 7), v.reshape(12, 7),
                lr=1e-3, step=2)
    adam_update(flat[0], g, flat[1], flat[2], lr=1e-3, step=2)
    _assert_bit_identical(flat, [p, m, v])


def test_update_loop_has_no_float64_arithmetic():
    # Compile the loop afresh (cached code cannot be inspected) for fp32 and bf16
    # gradients and check the optimised IR never touches double precision.
    from rtmem.kernels import adam as A
    loop = numba.njit(A._adam_loop.py_func, error_model="numpy")
    c = A.adam_coefficients(lr=1e-3, step=3, weight_decay=0.1)
    f = np.ones(64, np.float32)
    h = np.ones(64, np.uint16)
    loop(f.copy(), f.copy(), f.copy(), f.copy(), None, None, c)
    # bf16 gradients (uint16), fp16 copy out (int16): NOTE [ Formats are types ].
    loop(f.copy(), h.copy(), f.copy(), f.copy(), f.copy(), h.view(np.int16).copy(), c)
    assert len(loop.signatures) == 2
    for sig in loop.signatures:
        ir = loop.inspect_llvm(sig)
        assert "double" not in ir, f"float64 arithmetic in the Adam loop for {sig}"


# --------------------------------------------------------------------------- bad input

def _ok_arrays(n=64):
    rng = np.random.default_rng(14)
    return dict(param=rng.standard_normal(n).astype(np.float32),
                grad=rng.standard_normal(n).astype(np.float32),
                exp_avg=np.full(n, 0.1, np.float32), exp_avg_sq=np.full(n, 0.2, np.float32))


@pytest.mark.parametrize("change,argument,fragment", [
    (dict(grad=np.ones(63, np.float32)), "grad", "shape"),
    (dict(exp_avg=np.ones((8, 8), np.float32)), "exp_avg", "shape"),
    (dict(exp_avg_sq=np.ones(64, np.float64)), "exp_avg_sq", "float32"),
    (dict(param=np.ones(64, np.float16)), "param", "float32"),
    (dict(grad=np.ones(64, np.int32)), "grad", "dtype"),
    (dict(grad=np.ones(64, np.uint16)), "grad_format", "bfloat16"),
    (dict(grad=np.ones(128, np.float32)[::2]), "grad", "contiguous"),
    (dict(param=np.ones(128, np.float32)[::2]), "param", "contiguous"),
    (dict(exp_avg=[0.0] * 64), "exp_avg", "numpy"),
    (dict(lr=-1e-3), "lr", "lr=-0.001"),
    (dict(lr=float("nan")), "lr", "finite"),
    (dict(beta1=1.0), "beta1", "[0, 1)"),
    (dict(beta2=-0.1), "beta2", "[0, 1)"),
    (dict(eps=0.0), "eps", "(0, inf)"),
    (dict(eps=-1e-8), "eps", "eps"),
    (dict(weight_decay=-0.1), "weight_decay", "weight_decay"),
    (dict(step=0), "step", ">= 1"),
    (dict(step=1.5), "step", "int"),
    (dict(grad_scale=0.0), "grad_scale", "grad_scale"),
    (dict(start=10, stop=5), "stop", "start <= stop"),
    (dict(start=-1), "start", "0 <= start"),
    (dict(stop=65), "stop", "0 <= start"),
    (dict(num_threads=0), "num_threads", "NUMBA_NUM_THREADS"),
    (dict(out=np.ones(64, np.uint16)), "out_format", "bfloat16"),
    (dict(out=np.ones(64, np.float32), out_format="bfloat16"), "out_format", "float32"),
    (dict(grad_format="int8", grad=np.ones(64, np.uint16)), "grad_format", "16-bit"),
    # switches are bools: truthiness took maximize="no" as True (and ascended)
    (dict(maximize="no"), "maximize", "True or False"),
    (dict(decoupled_weight_decay="False", weight_decay=0.1), "decoupled_weight_decay",
     "True or False"),
    (dict(bias_correction="no", step=2), "bias_correction", "True or False"),
    (dict(check_finite="no"), "check_finite", "True or False"),
    (dict(maximize=1), "maximize", "True or False"),
])
def test_bad_input_raises_a_clear_optimizer_error(change, argument, fragment):
    kw = dict(_ok_arrays(), lr=1e-3, step=1)
    kw.update(change)
    param = kw["param"]
    before = param.copy()
    with pytest.raises(OptimizerError) as info:
        adam_update(kw.pop("param"), kw.pop("grad"), kw.pop("exp_avg"), kw.pop("exp_avg_sq"),
                    **kw)
    assert info.value.argument == argument
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)
    assert param.tobytes() == before.tobytes()   # validation happens before any write


def test_read_only_and_aliased_arrays_are_rejected():
    kw = _ok_arrays()
    ro = kw["exp_avg"].copy()
    ro.setflags(write=False)
    with pytest.raises(OptimizerError, match="read-only"):
        adam_update(kw["param"], kw["grad"], ro, kw["exp_avg_sq"], lr=1e-3, step=1)
    with pytest.raises(OptimizerError, match="overlap"):
        adam_update(kw["param"], kw["grad"], kw["param"], kw["exp_avg_sq"], lr=1e-3, step=1)


def test_neighbouring_arrays_that_overlap_are_refused():
    # Neighbours in the argument list too: a check that compared only arrays two
    # or more places apart let exp_avg alias exp_avg_sq (a silently wrong update).
    names = ("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "out")
    rng = np.random.default_rng(16)
    for first, second in zip(names[:-1], names[1:]):
        arrays = {name: rng.uniform(0.5, 1.5, 64).astype(np.float32) for name in names}
        arrays[second] = arrays[first][:]           # a view of the same memory
        before = {k: a.copy() for k, a in arrays.items()}
        with pytest.raises(OptimizerError, match="overlap") as info:
            adam_update(arrays["param"], arrays["grad"], arrays["exp_avg"],
                        arrays["exp_avg_sq"], max_exp_avg_sq=arrays["max_exp_avg_sq"],
                        out=arrays["out"], lr=1e-3, step=1)
        assert info.value.argument == second
        for k, a in arrays.items():
            assert a.tobytes() == before[k].tobytes(), (first, second, k)


def test_an_empty_range_is_a_step_that_changes_nothing(fresh_seed):
    # start == stop is a valid range (a chunked caller's empty last chunk, a
    # zero-size parameter): applied, nothing written, nothing to check.
    rng = np.random.default_rng(fresh_seed)
    p, m, v, vmax = _state(rng, n=1000, amsgrad=True)
    g = rng.standard_normal(1000).astype(np.float32)
    g[500] = np.nan
    before = _snapshot(p, m, v, vmax)
    for k in (0, 500, 1000):
        assert grads_finite(g, start=k, stop=k)
        assert adam_update(p, g, m, v, max_exp_avg_sq=vmax, lr=1e-3, step=2, grad_scale=2.0,
                           start=k, stop=k)
    _assert_bit_identical(before, [p, m, v, vmax])
    empty = np.empty(0, np.float32)
    assert adam_update(empty, empty.copy(), empty.copy(), empty.copy(), lr=1e-3, step=1)


def test_a_float16_array_with_a_bfloat16_format_is_refused():
    # The array's dtype says fp16; a contradicting format is refused rather than
    # one of the two silently ignored, as a bfloat16 array with grad_format=
    # 'float16' is (test_ml_dtypes_bfloat16_arrays_are_the_bits_they_hold).
    rng = np.random.default_rng(17)
    kw = _ok_arrays()
    p0 = kw["param"].copy()
    h = rng.standard_normal(64).astype(np.float16)
    with pytest.raises(OptimizerError, match="float16 array but grad_format") as info:
        adam_update(kw["param"], h, kw["exp_avg"], kw["exp_avg_sq"], lr=1e-3, step=1,
                    grad_format="bfloat16")
    assert info.value.argument == "grad_format"
    out = np.empty(64, np.float16)
    with pytest.raises(OptimizerError, match="float16 array but out_format") as info:
        adam_update(kw["param"], kw["grad"], kw["exp_avg"], kw["exp_avg_sq"], lr=1e-3,
                    step=1, out=out, out_format="bf16")
    assert info.value.argument == "out_format"
    assert kw["param"].tobytes() == p0.tobytes()
    with pytest.raises(OptimizerError, match="float16 array but grad_format"):
        grads_finite(h, grad_format="bfloat16")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16])
def test_a_read_only_copy_buffer_is_refused(dtype):
    kw = _ok_arrays()
    p0 = kw["param"].copy()
    out = np.zeros(64, dtype)
    out.setflags(write=False)
    with pytest.raises(OptimizerError, match="read-only") as info:
        adam_update(kw["param"], kw["grad"], kw["exp_avg"], kw["exp_avg_sq"], lr=1e-3,
                    step=1, out=out, out_format="bfloat16" if dtype == np.uint16 else None)
    assert info.value.argument == "out"
    assert kw["param"].tobytes() == p0.tobytes() and not out.any()


def test_kernels_all_lists_exactly_the_public_names():
    public = {n for n in dir(K) if not n.startswith("_")
              and not isinstance(getattr(K, n), type(K))}
    assert set(K.__all__) == public


@pytest.mark.parametrize("kwargs, argument", [
    (dict(eps=1e-46), "eps"),                       # 0 in float32: 0/0 on a zero grad
    (dict(lr=1e39), "lr"),                          # lr / bc1 overflows float32
    (dict(lr=1e30, beta1=1 - 1e-12), "lr"),
    (dict(grad_scale=1e-40), "grad_scale"),         # 1/grad_scale is inf in float32
    (dict(lr=1e30, weight_decay=1e10, decoupled_weight_decay=True), "lr"),
])
def test_hyperparameters_outside_float32_are_refused(kwargs, argument):
    rng = np.random.default_rng(9)
    p = rng.standard_normal(8).astype(np.float32)
    before = p.copy()
    with pytest.raises(OptimizerError, match="float32") as e:
        adam_update(p, np.zeros(8, np.float32), np.zeros(8, np.float32),
                    np.zeros(8, np.float32), **{"lr": 1e-3, "step": 1, **kwargs})
    assert e.value.argument == argument
    assert p.tobytes() == before.tobytes()


def test_huge_step_counts_bias_correction_as_converged():
    c = K.adam_coefficients(lr=1e-3, step=10**400)
    np.testing.assert_allclose(c, K.adam_coefficients(lr=1e-3, step=10**6))


def test_prepared_update_checks_what_it_is_given():
    from rtmem.kernels.adam import prepare_update
    p, g, m, v = (np.ones(4, np.float32) for _ in range(4))
    u = prepare_update(p, g, m, v)
    c = K.adam_coefficients(lr=1e-3, step=1)
    for call, fragment in ((lambda: u.apply(np.ones(2, np.float32)), "coefficients"),
                           (lambda: u.apply(c.astype(np.float64)), "coefficients"),
                           (lambda: u.apply(c, -3), "start"),
                           (lambda: u.apply(c, 0, 100), "inside"),
                           (lambda: u.grads_finite(np.ones(0, np.float32)), "coefficients")):
        with pytest.raises(OptimizerError, match=fragment):
            call()
    assert (p == 1).all() and (m == 1).all()


# --------------------------------------------------------------------------- audit fixes

def test_format_may_be_given_as_a_numpy_or_torch_dtype():
    x = np.array([1.5, -2.25, 65504.0], np.float32)
    fp16 = x.astype(np.float16).view(np.uint16)
    for fmt in ("float16", "fp16", "half", np.float16, np.dtype("float16")):
        assert np.array_equal(encode_half(x, fmt), fp16), fmt
        assert np.array_equal(decode_half(fp16, fmt), x), fmt
    bf16 = encode_half(x, "bfloat16")
    torch = pytest.importorskip("torch")
    assert np.array_equal(encode_half(x, torch.float16), fp16)
    assert np.array_equal(encode_half(x, torch.bfloat16), bf16)
    for fmt in (np.float32, np.dtype("uint16"), torch.int16, "int8", None):
        with pytest.raises(OptimizerError, match="not a 16-bit float format"):
            encode_half(x, fmt)


def test_decode_half_refuses_float16_input_in_another_format():
    # fp16 bits read as bfloat16 would be silently wrong (1.0 -> 0.0078125).
    torch = pytest.importorskip("torch")
    h = np.array([1.0, 2.0], np.float16)
    for fmt in ("bfloat16", torch.bfloat16):
        with pytest.raises(OptimizerError, match="float16 array") as info:
            decode_half(h, fmt)
        assert info.value.argument == "fmt"
    assert np.array_equal(decode_half(h, np.float16), [1.0, 2.0])
    assert np.array_equal(decode_half(h, "float16", _soft=True), [1.0, 2.0])


def test_grads_finite_refuses_a_scale_whose_reciprocal_leaves_float32():
    import warnings
    z = np.zeros(8, np.float32)
    for scale in (1e-40, 1e46):          # 1/scale is inf, resp. 0, in float32
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # no numpy overflow warning either
            with pytest.raises(OptimizerError, match="float32") as info:
                grads_finite(z, grad_scale=scale)
        assert info.value.argument == "grad_scale"
        with pytest.raises(OptimizerError, match="float32"):    # the same check
            adam_update(np.ones(8, np.float32), z, np.zeros(8, np.float32),
                        np.zeros(8, np.float32), lr=1e-3, step=1, grad_scale=scale)
    # Scales near the float32 limits that are representable still work.
    assert grads_finite(z, grad_scale=1e-37) and grads_finite(z, grad_scale=1e38)
    assert not grads_finite(np.full(8, 10.0, np.float32), grad_scale=1e-37 / 8)  # 8e38


def test_the_smallest_refused_reciprocal_is_the_one_float32_rounds_to_zero():
    # 1/grad_scale = 2**-150 is half float32's smallest subnormal: the cast's
    # tie goes to even, 0, which zeroes every gradient; one float64 ulp more
    # rounds up to 2**-149 and is usable. The check's bound is exclusive there.
    assert np.float32(2.0 ** -150) == 0 and np.float32(2.0 ** -150 * (1 + 2 ** -52)) > 0
    rng = np.random.default_rng(18)
    g = rng.uniform(1.0, 2.0, 8).astype(np.float32)
    with pytest.raises(OptimizerError, match="float32") as info:
        grads_finite(g, grad_scale=2.0 ** 150)
    assert info.value.argument == "grad_scale"
    with pytest.raises(OptimizerError, match="float32"):
        K.adam_coefficients(lr=1e-3, step=1, grad_scale=2.0 ** 150)
    c = K.adam_coefficients(lr=1e-3, step=1, grad_scale=2.0 ** 150 * (1 - 2 ** -53))
    assert c[K.adam._GMUL] == np.float32(2.0 ** -149)
    assert grads_finite(g, grad_scale=2.0 ** 150 * (1 - 2 ** -53))


def test_fp16_copy_overflows_to_inf_as_documented():
    p = np.array([65519.0, 65520.0, 70000.0, -1e6], np.float32)
    zeros = [np.zeros(4, np.float32) for _ in range(3)]
    out = np.empty(4, np.float16)
    assert adam_update(p, zeros[0], zeros[1], zeros[2], lr=1e-3, step=1, out=out,
                       grad_scale=1024.0)
    assert np.isfinite(p).all()
    assert out[0] == 65504 and np.isinf(out[1:]).all() and out[3] < 0
    assert "65504" in adam_update.__doc__ and "inf" in adam_update.__doc__


def test_num_threads_leaves_torchs_thread_count_alone(monkeypatch):
    # numba's OpenMP layer, when it starts inside numba.set_num_threads, resets
    # OpenMP's global thread count, which is torch's intra-op count: after the
    # first optimizer step bench/train.py's 1-thread rows ran torch on 2 threads.
    # Whether a process hits it depends on what started the layer first, so the
    # reset is played here by a set_num_threads that does what the layer did.
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    real = numba.set_num_threads

    def set_and_reset_torch(n):
        real(n)
        torch.set_num_threads(2)
    monkeypatch.setattr(numba, "set_num_threads", set_and_reset_torch)
    try:
        torch.set_num_threads(1)
        a = [np.random.default_rng(i).random(64, dtype=np.float32) for i in range(4)]
        adam_update(*a, lr=1e-3, step=1, num_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_ml_dtypes_bfloat16_arrays_are_the_bits_they_hold(fresh_seed):
    # ml_dtypes' bfloat16 (what JAX and others hand numpy users) is taken as the
    # uint16 bits with format "bfloat16": gradients, the parameter copy, the
    # finite check and NumpyAdam, bit for bit.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from rtmem.optim import NumpyAdamW
    rng = np.random.default_rng(fresh_seed)
    p, m, v, _ = _state(rng, amsgrad=False)
    g = rng.standard_normal(N).astype(np.float32).astype(ml_dtypes.bfloat16)
    bits = (p.copy(), m.copy(), v.copy())
    out, out_bits = np.empty(N, ml_dtypes.bfloat16), np.empty(N, np.uint16)
    adam_update(p, g, m, v, lr=1e-2, step=3, grad_scale=4.0, out=out)
    adam_update(*bits[:1], g.view(np.uint16), *bits[1:], lr=1e-2, step=3, grad_scale=4.0,
                grad_format="bfloat16", out=out_bits, out_format="bfloat16")
    for a, b in zip((p, m, v, out.view(np.uint16)), (*bits, out_bits)):
        assert np.array_equal(a, b)
    assert np.array_equal(out.astype(np.float32), decode_half(out_bits, "bfloat16"))
    g[N // 2] = np.nan
    assert grads_finite(g) is False and grads_finite(g, start=N // 2 + 1) is True
    opts = [NumpyAdamW([a.copy()], lr=1e-2) for a in (p, p)]
    copies = (np.empty(N, ml_dtypes.bfloat16), np.empty(N, np.uint16))
    assert not opts[0].step([g], grad_scale=2.0)     # the NaN: skipped, as with bits
    g[N // 2] = 1.0
    opts[0].step([g], copies=[copies[0]])
    opts[1].step([g.view(np.uint16)], grad_format="bfloat16", copies=[copies[1]],
                 copy_format="bfloat16")
    assert np.array_equal(opts[0].params[0], opts[1].params[0])
    assert np.array_equal(copies[0].view(np.uint16), copies[1])
    before = p.copy()
    with pytest.raises(OptimizerError, match="bfloat16 array but grad_format='float16'"):
        adam_update(p, g, m, v, lr=1e-2, step=4, grad_format="float16")   # contradiction
    assert np.array_equal(p, before)


# ------------------------------------------------------- threads under workqueue

_CONCURRENT_KERNELS = """
import threading
import numpy as np
from rtmem.kernels import adam_update, decode_half, encode_half, BLOCK_ELEMENTS
from rtmem.kernels import dha_cpu

n = 8 * BLOCK_ELEMENTS          # several work items: every call is a parallel region
errors = []

def run(k):
    rng = np.random.default_rng(k)
    p, g, m, v = (rng.standard_normal(n).astype(np.float32) for _ in range(4))
    v = np.abs(v)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    gamma, beta = np.ones(64, np.float32), np.zeros(64, np.float32)
    out, mean, rstd = np.empty_like(x), np.empty(256, np.float32), np.empty(256, np.float32)
    try:
        for step in range(1, 40):
            adam_update(p, g, m, v, lr=1e-3, step=step, grad_scale=2.0)
            decode_half(encode_half(p, "bf16"), "bf16")
            dha_cpu.layernorm_forward(x, gamma, beta, out, mean, rstd)
    except BaseException as e:          # noqa: BLE001 - reported below
        errors.append(e)

threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
import numba
print("layer", numba.threading_layer(), "errors", errors)
"""


def test_threads_may_call_the_kernels_at_once_under_workqueue():
    # NOTE [ One parallel region at a time under workqueue ]: numba's workqueue
    # layer aborts the process when two threads enter parallel regions at once;
    # rtmem's kernels take turns there instead.
    import subprocess
    import sys
    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue"}
    done = subprocess.run([sys.executable, "-c", _CONCURRENT_KERNELS], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "layer workqueue errors []" in done.stdout, done.stdout + done.stderr[-2000:]


def test_kernels_take_turns_only_where_the_layer_needs_it():
    from rtmem.kernels import _parallel
    rng = np.random.default_rng(31)
    p, m, v = _state(rng)[:3]
    adam_update(p, rng.standard_normal(N).astype(np.float32), m, v, lr=1e-3, step=1)
    assert _parallel._concurrent == (numba.threading_layer() != "workqueue")
    assert K.adam._adam_kernel.dispatcher.signatures      # the compiled kernel is reachable


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="no fork")
def test_a_child_forked_while_a_thread_holds_the_kernel_lock_gets_a_free_one():
    # NOTE [ One parallel region at a time under workqueue ]: the thread that
    # holds the lock at a fork() does not exist in the child, so an inherited,
    # locked copy would make the child's first kernel call wait forever there.
    import multiprocessing
    import threading
    import warnings
    from rtmem.kernels import _parallel
    held, release = threading.Event(), threading.Event()

    def holder():
        with _parallel._lock:
            held.set()
            release.wait(30)

    def child():
        os._exit(0 if _parallel._lock.acquire(timeout=5) else 1)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(30)
        with warnings.catch_warnings():     # "multi-threaded, use of fork()": the point
            warnings.simplefilter("ignore", DeprecationWarning)
            proc = multiprocessing.get_context("fork").Process(target=child)
            proc.start()
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        release.set()
        t.join()


_FORKED_AFTER_OPENMP = """
import os, sys
import numpy as np
import numba
from rtmem.kernels import BLOCK_ELEMENTS, adam_update
n = 3 * BLOCK_ELEMENTS + 123                     # several blocks: the parallel kernel
rng = np.random.default_rng(int(sys.argv[1]))
p = rng.standard_normal(n).astype(np.float32)
g = rng.standard_normal(n).astype(np.float32)
m = (rng.standard_normal(n) * 0.1).astype(np.float32)
v = rng.uniform(1e-3, 1e-1, n).astype(np.float32)
hyper = dict(lr=3e-3, beta1=0.85, beta2=0.99, eps=1e-7, weight_decay=0.05, step=7)
want = p.copy()
adam_update(want, g, m.copy(), v.copy(), **hyper)     # the parent starts the pool
from numba.np.ufunc import omppool
if numba.threading_layer() != "omp" or omppool.openmp_vendor != "GNU":
    print("skip: layer", numba.threading_layer(), omppool.openmp_vendor)
    sys.exit(0)
g64, m64, v64 = (a.astype(np.float64) for a in (g, m, v))
m64 = 0.85 * m64 + 0.15 * (g64 + 0.05 * p)
v64 = 0.99 * v64 + 0.01 * (g64 + 0.05 * p) ** 2
ref = p - 3e-3 / (1 - 0.85 ** 7) * m64 / (np.sqrt(v64) / np.sqrt(1 - 0.99 ** 7) + 1e-7)
pid = os.fork()
if pid == 0:
    got = p.copy()
    adam_update(got, g, m.copy(), v.copy(), **hyper)
    scale = np.sqrt(np.mean(ref * ref))
    err = float(np.max(np.abs(got - ref) / (np.abs(ref) + scale)))
    os._exit(0 if np.array_equal(got, want) and err < 1e-5 else 1)
print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_child_forked_after_gnu_openmp_started_runs_the_kernels(fresh_seed):
    # NOTE [ Kernels in a child forked after GNU OpenMP started ]: numba killed
    # such a child (a DataLoader worker) with SIGTERM at its first parallel
    # region; it now runs the serial twin, with the parallel kernel's bits.
    import subprocess
    import sys
    env = {**os.environ, "NUMBA_THREADING_LAYER": "omp"}
    done = subprocess.run([sys.executable, "-c", _FORKED_AFTER_OPENMP, str(fresh_seed)],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "No threading layer could be loaded" in done.stderr:
        pytest.skip("numba's omp threading layer is not available here")
    assert done.returncode == 0, done.stderr[-2000:]
    if done.stdout.startswith("skip"):
        pytest.skip(done.stdout.strip())
    assert done.stdout.strip() == "child 0", done.stdout + done.stderr[-2000:]


def test_f16c_is_used_only_when_numbas_cpu_settings_include_it(monkeypatch):
    # NUMBA_CPU_FEATURES is a comma-separated list of +feature/-feature: "-f16c"
    # turns F16C off (a portable cache for CPUs without it), and a named CPU other
    # than "host" (NUMBA_CPU_NAME=generic) may lack it whatever this host has;
    # compiling the F16C instructions there fails to link.
    from rtmem.kernels import _half
    monkeypatch.setattr(numba.config, "CPU_NAME", None)
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+avx,-f16c,+sse4.2")
    assert _half._target_has_f16c() is False
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+avx,+f16c")
    assert _half._target_has_f16c() is True
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "")
    monkeypatch.setattr(numba.config, "CPU_NAME", "generic")
    assert _half._target_has_f16c() is False
