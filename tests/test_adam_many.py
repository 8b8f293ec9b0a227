"""The many-tensor Adam kernel (NOTE [ Many tensors, one launch ] in
kernels/_adam_many.py): bit for bit the per-tensor path on mixed sizes, formats
and hyperparameters, within float32 round-off of the float64 oracle, one call
per kind of tensor per step, and a non-finite gradient anywhere skipping every
tensor."""

from __future__ import annotations

import numpy as np
import pytest

from _adam_reference import adam_step64
import rtmem.optim as optim
from rtmem.kernels import BLOCK_ELEMENTS, adam_coefficients, encode_half
from rtmem.kernels import _adam_many
from rtmem.kernels._adam_many import ManyUpdates, _work_items
from rtmem.kernels.adam import PreparedUpdate, prepare_update

# below, at and above one block, several blocks with a ragged tail, and tiny ones
_SIZES = (1, 3, 192, 577, 3072, BLOCK_ELEMENTS - 1, BLOCK_ELEMENTS, BLOCK_ELEMENTS + 1,
          2 * BLOCK_ELEMENTS + 77)


def _random_sizes(rng, n=24):
    return [int(s) for s in rng.choice(_SIZES, n)]


def _grad(rng, n, fmt):
    """(array for the kernel, grad_format, float64 values the kernel reads)."""
    x = (rng.standard_normal(n) * 0.5).astype(np.float32)
    if fmt == "float16":
        h = x.astype(np.float16)
        return h, None, h.astype(np.float64)
    if fmt == "bfloat16":
        bits = encode_half(x, "bfloat16")
        return bits, "bfloat16", (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x, None, x.astype(np.float64)


def _problem(rng, sizes):
    """Per tensor: (state arrays, grad, grad_format, copy, copy_format, float64 grad),
    with a random gradient format, copy format and AMSGrad switch each."""
    tensors = []
    for n in sizes:
        p = rng.standard_normal(n).astype(np.float32)
        m = (rng.standard_normal(n) * 0.1).astype(np.float32)
        v = rng.uniform(1e-3, 1e-1, n).astype(np.float32)
        vmax = (v * rng.uniform(1, 1.5, n)).astype(np.float32) if rng.random() < 0.3 else None
        g, g_fmt, g64 = _grad(rng, n, rng.choice(["float32", "float16", "bfloat16"]))
        out_fmt = rng.choice(["none", "float32", "float16", "bfloat16"])
        out = None if out_fmt == "none" else np.empty(
            n, {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[out_fmt])
        tensors.append(((p, m, v, vmax), g, g_fmt, out,
                        "bfloat16" if out_fmt == "bfloat16" else None, g64))
    return tensors


def _copies(tensors):
    return [(tuple(None if a is None else a.copy() for a in state), g, gf,
             None if out is None else out.copy(), of, g64)
            for state, g, gf, out, of, g64 in tensors]


def _updates(tensors):
    return [prepare_update(p, g, m, v, max_exp_avg_sq=vmax, grad_format=gf, out=out,
                           out_format=of)
            for (p, m, v, vmax), g, gf, out, of, _ in tensors]


@pytest.mark.parametrize("decoupled,maximize,grad_scale",
                         [(False, False, None), (True, True, 1024.0), (False, True, 0.5)])
def test_many_tensors_match_the_per_tensor_path_bit_for_bit(decoupled, maximize, grad_scale):
    rng = np.random.default_rng()
    tensors = _problem(rng, _random_sizes(rng))
    twin = _copies(tensors)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05,
                 decoupled_weight_decay=decoupled, grad_scale=grad_scale, maximize=maximize)
    # tensors at different step counts share one call: one coefficient row each
    coefs = [adam_coefficients(step=s, **hyper) for s in (1, 7)]
    chosen = [coefs[i] for i in rng.integers(0, 2, len(tensors))]
    for u, c in zip(_updates(twin), chosen):
        assert u._grads_finite(c, 0, u.size)
        u._apply(c, 0, u.size)
    batch = ManyUpdates(list(zip(_updates(tensors), chosen)))
    assert batch.count_nonfinite() == 0
    batch.apply()
    for (state, _, _, out, _, _), (state2, _, _, out2, _, _) in zip(tensors, twin):
        for a, b in zip((*state, out), (*state2, out2)):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.tobytes() == b.tobytes()


def test_many_tensors_match_the_float64_oracle():
    rng = np.random.default_rng()
    tensors = _problem(rng, _random_sizes(rng))
    start = _copies(tensors)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    steps = rng.integers(1, 20, len(tensors))
    batch = ManyUpdates([(u, adam_coefficients(step=int(s), decoupled_weight_decay=True,
                                               **hyper))
                         for u, s in zip(_updates(tensors), steps)])
    batch.apply()
    for (state, *_), ((p, m, v, vmax), _, _, _, _, g64), s in zip(tensors, start, steps):
        ref = adam_step64(p.astype(np.float64), g64, m.astype(np.float64),
                          v.astype(np.float64),
                          None if vmax is None else vmax.astype(np.float64),
                          lr=hyper["lr"], beta1=0.9, beta2=0.999, eps=1e-8, wd=0.01,
                          decoupled=True, step=int(s))
        for got, want in zip(state, ref):
            if got is not None:
                scale = np.sqrt(np.mean(want * want))
                assert np.max(np.abs(got - want) / (np.abs(want) + scale)) < 1e-5


def test_work_items_cover_every_element_once_in_blocks():
    rng = np.random.default_rng()
    sizes = np.array(_random_sizes(rng, 40), np.int64)
    block = 1000
    pieces, starts = _work_items(sizes, block)
    seen = [np.zeros(n, np.int64) for n in sizes]
    for k in range(starts.size - 1):
        item = pieces[starts[k]:starts[k + 1]]
        assert item.size and (item[:, 2] - item[:, 1]).sum() <= block
        for t, lo, hi in item:
            seen[t][lo:hi] += 1
            # a large tensor in blocks from its start, a small one whole
            assert (lo % block == 0) if sizes[t] > block else (lo, hi) == (0, sizes[t])
    assert all((s == 1).all() for s in seen)


def _count_calls(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counting(*args):
        calls.append(name)
        return real(*args)
    monkeypatch.setattr(module, name, counting)
    return calls


def test_cpu_adam_step_runs_one_kernel_call_per_kind(monkeypatch):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    sizes = _random_sizes(rng)
    params = [torch.from_numpy(rng.standard_normal(n, dtype=np.float32)) for n in sizes]
    opt = optim.CPUAdam(params, lr=1e-3)
    update_calls = _count_calls(monkeypatch, _adam_many, "_adam_many_kernel")
    check_calls = _count_calls(monkeypatch, _adam_many, "_nonfinite_many_kernel")
    per_tensor = _count_calls(monkeypatch, PreparedUpdate, "_apply")
    # fp32 and bf16 gradients: two kinds
    grads = [torch.randn(n, dtype=torch.float32 if i % 2 else torch.bfloat16)
             for i, n in enumerate(sizes)]
    opt.step(grads=grads, grad_scale=2.0)
    assert (len(update_calls), len(check_calls), per_tensor) == (2, 2, [])


def test_nan_in_one_small_tensor_skips_every_tensor():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    sizes = _random_sizes(rng) + [3]
    params = [torch.from_numpy(rng.standard_normal(n, dtype=np.float32)) for n in sizes]
    opt = optim.CPUAdam(params, lr=1e-3, amsgrad=True)
    opt.step(grads=[torch.randn(n) for n in sizes])
    before = [p.clone() for p in params]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    grads = [torch.randn(n, dtype=torch.float16) for n in sizes]
    grads[-1][1] = float("nan")
    copies = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
    opt.step(grads=grads, grad_scale=8.0, copies=copies)
    assert opt.last_step_skipped
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(v, saved[k]) for p, saved in zip(params, state)
               for k, v in opt.state[p].items())
    assert all(not c.any() for c in copies)
    assert all(opt.state[p]["step"].item() == 1 for p in params)


# What may happen to a step count between two steps: each must be counted on
# from its value (the batched count writes float32 counts in place, by address).
def _step_replaced(st, torch):
    st["step"] = torch.tensor(5.0)


def _step_float64(st, torch):
    st["step"] = torch.tensor(5.0, dtype=torch.float64)


def _step_data_replaced(st, torch):
    st["step"].data = torch.tensor(5.0)


def _step_set_to_other_memory(st, torch):
    st["step"].set_(torch.tensor([5.0]).view(()))


def _step_edited_in_place(st, torch):
    st["step"].fill_(5.0)


@pytest.mark.parametrize("change", [_step_replaced, _step_float64, _step_data_replaced,
                                    _step_set_to_other_memory, _step_edited_in_place])
def test_step_counts_advance_from_what_the_state_holds(change):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    sizes = _random_sizes(rng, 8)
    params = [torch.from_numpy(rng.standard_normal(n, dtype=np.float32)) for n in sizes]
    opt = optim.CPUAdam(params, lr=1e-3)
    for _ in range(2):
        opt.step(grads=[torch.randn(n) for n in sizes])
    k = int(rng.integers(len(params)))
    change(opt.state[params[k]], torch)
    before = opt.state[params[k]]["step"]
    version = before._version
    opt.step(grads=[torch.randn(n) for n in sizes])
    steps = [opt.state[p]["step"] for p in params]
    assert [s.item() for s in steps] == [6.0 if i == k else 3.0 for i in range(len(params))]
    assert steps[k].dtype == before.dtype
    assert all(s.dtype == torch.float32 for i, s in enumerate(steps) if i != k)
    assert before._version > version      # an in-place change autograd can see

