"""CPUAdam / NumpyAdam on many small tensors (a GPT-2-like list of biases and
norms beside a few matrices): the per-tensor work a step repeats is done once
where it cannot differ, results stay those of one adam_update per tensor, and
every check still fires when what it checks changes between two steps."""

from __future__ import annotations

import numpy as np
import pytest

import rtmem.optim as optim
from rtmem.errors import OptimizerError
from rtmem.kernels import adam_update

# shapes of one GPT-2 block at hidden 8 (biases, norms, matrices), twice
_SHAPES = [(8,), (8,), (8, 24), (24,), (8, 8), (8,), (8,), (8,), (8, 32), (32,), (32, 8),
           (8,)] * 2


def _count_coefficients(monkeypatch):
    """Count the step's coefficient computations (the calls that pass a loss scale
    argument: _check_hyper's range check passes none)."""
    calls = []
    real = optim.adam_coefficients

    def counting(**kw):
        if "grad_scale" in kw:
            calls.append(kw["step"])
        return real(**kw)
    monkeypatch.setattr(optim, "adam_coefficients", counting)
    return calls


def _reference(params, grads_per_step, **kw):
    """float32 params after one adam_update per tensor per step (None: skipped)."""
    ps = [p.copy() for p in params]
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    steps = [0] * len(ps)
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            if g is not None:
                steps[i] += 1
                adam_update(ps[i], g, ms[i], vs[i], step=steps[i], **kw)
    return ps


def test_numpy_adam_coefficients_once_per_step_count(monkeypatch):
    rng = np.random.default_rng()
    params = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
    start = [p.copy() for p in params]
    opt = optim.NumpyAdam(params, lr=1e-2, weight_decay=0.1)
    calls = _count_coefficients(monkeypatch)
    history = []
    for step in range(3):
        grads = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
        if step == 0:       # half the tensors lag one step behind from now on
            grads[::2] = [None] * len(grads[::2])
        history.append(grads)
        calls.clear()
        opt.step(grads)
        # one vector per distinct step count, not one per tensor
        assert sorted(calls) == ([1] if step == 0 else [step, step + 1])
    ref = _reference(start, history, lr=1e-2, weight_decay=0.1)
    for p, r in zip(params, ref):
        assert p.tobytes() == r.tobytes()


def test_cpu_adam_coefficients_once_per_group_and_step_count(monkeypatch):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    start = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
    params = [torch.from_numpy(p.copy()) for p in start]
    half = len(params) // 2
    opt = optim.CPUAdam([{"params": params[:half]}, {"params": params[half:]}], lr=1e-2)
    calls = _count_coefficients(monkeypatch)
    history = []
    for step in range(3):
        grads = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
        if step == 0:
            grads[::2] = [None] * len(grads[::2])
        history.append(grads)
        calls.clear()
        opt.step(grads=[None if g is None else torch.from_numpy(g) for g in grads])
        assert sorted(calls) == ([1, 1] if step == 0 else [step, step, step + 1, step + 1])
    ref = _reference(start, history, lr=1e-2)
    for p, r in zip(params, ref):
        assert p.numpy().tobytes() == r.tobytes()


# What a test may change between two steps, and the error the second step must
# raise (each check of the first step runs again at every step: nothing about
# a tensor is taken as known because it held at the step before).
def _replace_param(opt, ps, torch):
    new = opt.param_groups[0]["params"][3] = torch.zeros(24, dtype=torch.float64)
    return {new: torch.ones(24)}


def _change_dtype(opt, ps, torch):
    ps[5].data = ps[5].data.double()


def _grad_wrong_shape(opt, ps, torch):
    return {ps[1]: torch.zeros(9)}       # p.grad cannot take another shape


def _grad_not_contiguous(opt, ps, torch):
    ps[2].grad = torch.zeros(24, 8).t()


def _resized_in_place(opt, ps, torch):
    ps[4].resize_(4, 4)
    ps[4].grad = torch.zeros(4, 4)


def _moment_replaced(opt, ps, torch):
    opt.state[ps[6]]["exp_avg_sq"] = torch.zeros(8, dtype=torch.float64)


def _views_overlap(opt, ps, torch):
    view = opt.param_groups[0]["params"][7] = ps[0].view(2, 4)[0]
    view.grad = torch.zeros(4)


_CPU_ADAM_CHANGES = [
    (_replace_param, r"param 3: param has dtype float64"),
    (_change_dtype, r"param 5: param has dtype float64"),
    (_grad_wrong_shape, r"param 1: grad has shape \(9,\) but param has shape \(8,\)"),
    (_grad_not_contiguous, r"param 2: grad is not contiguous"),
    (_resized_in_place, r"param 4: exp_avg has shape \(8, 8\) but param has shape \(4, 4\)"),
    (_moment_replaced, r"param 6: exp_avg_sq has dtype float64"),
    (_views_overlap, r"param 7 .*overlap in memory"),
]


@pytest.mark.parametrize("change, message", _CPU_ADAM_CHANGES,
                         ids=[c.__name__.strip("_") for c, _ in _CPU_ADAM_CHANGES])
def test_cpu_adam_checks_fire_when_a_tensor_changes_between_steps(change, message):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=gen) for s in _SHAPES]
    opt = optim.CPUAdam(ps, lr=1e-2)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    grads = change(opt, ps, torch)
    held = [p.clone() for p in opt.param_groups[0]["params"]]
    with pytest.raises(OptimizerError, match=message):
        opt.step(grads=grads)
    # refused before any write
    for p, before in zip(opt.param_groups[0]["params"], held):
        assert torch.equal(p, before)


def test_cpu_adam_steps_from_moments_loaded_between_steps():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    start = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
    ps = [torch.from_numpy(p.copy()) for p in start]
    opt = optim.CPUAdam(ps, lr=1e-2)
    grads = [[rng.standard_normal(s, dtype=np.float32) for s in _SHAPES] for _ in range(2)]
    opt.step(grads=[torch.from_numpy(g) for g in grads[0]])
    saved = opt.state_dict()
    moments = [(rng.standard_normal(s, dtype=np.float32),
                rng.uniform(0, 1, s).astype(np.float32)) for s in _SHAPES]
    for i, (m, v) in enumerate(moments):
        saved["state"][i] = {"step": torch.tensor(5.0), "exp_avg": torch.from_numpy(m),
                             "exp_avg_sq": torch.from_numpy(v)}
    opt.load_state_dict(saved)
    before = [p.numpy().copy() for p in ps]
    opt.step(grads=[torch.from_numpy(g) for g in grads[1]])
    # the loaded moments and step count, not the ones the first step used
    for p, b, (m, v), g in zip(ps, before, moments, grads[1]):
        m, v = m.copy(), v.copy()
        adam_update(b, g, m, v, lr=1e-2, step=6)
        assert p.numpy().tobytes() == b.tobytes()


def _np_grad_wrong_shape(opt, grads):
    grads[1] = np.zeros(9, np.float32)


def _np_grad_not_contiguous(opt, grads):
    grads[2] = np.zeros((24, 8), np.float32).T


def _np_resized_in_place(opt, grads):
    opt.params[4].resize(16, refcheck=False)
    grads[4] = np.zeros(16, np.float32)


def _np_moment_replaced(opt, grads):
    opt.state[6]["exp_avg"] = np.zeros(8, np.float64)


def _np_param_replaced(opt, grads):
    opt.params[3] = np.zeros(24, np.float64)


_NUMPY_CHANGES = [
    (_np_grad_wrong_shape, r"param 1: grad has shape \(9,\) but param has shape \(8,\)"),
    (_np_grad_not_contiguous, r"param 2: grad is not C-contiguous"),
    (_np_resized_in_place, r"param 4: exp_avg has shape \(8, 8\) but param has shape \(16,\)"),
    (_np_moment_replaced, r"param 6: exp_avg has dtype float64"),
    (_np_param_replaced, r"param 3: param has dtype float64"),
]


@pytest.mark.parametrize("change, message", _NUMPY_CHANGES,
                         ids=[c.__name__.strip("_") for c, _ in _NUMPY_CHANGES])
def test_numpy_adam_checks_fire_when_an_array_changes_between_steps(change, message):
    rng = np.random.default_rng()
    params = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
    opt = optim.NumpyAdam(params, lr=1e-2)
    grads = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
    opt.step(grads)
    change(opt, grads)
    held = [p.copy() for p in opt.params]
    with pytest.raises(OptimizerError, match=message):
        opt.step(grads)
    for p, before in zip(opt.params, held):
        assert p.tobytes() == before.tobytes()


def test_data_address_tries_numba_once_per_untyped_dtype(monkeypatch):
    # numba does not remember a failed typing: every call on a byte-swapped array
    # compiled again (~270 us where the array interface takes ~3 us)
    from rtmem.kernels import adam
    monkeypatch.setattr(adam, "_INTERFACE_ONLY", set())
    a = np.zeros(5, ">f4")[1:]
    assert adam._data_address(a) == a.__array_interface__["data"][0]
    tried = []
    monkeypatch.setattr(adam, "_jit_address", lambda x: tried.append(x) or 0)
    assert adam._data_address(a) == a.__array_interface__["data"][0] and tried == []
    native = np.zeros(4, np.float32)
    assert adam._data_address(native) == 0 and len(tried) == 1   # typed dtypes still jit


def test_data_address_is_the_array_interfaces():
    # the overlap checks' addresses: offset views, 16-bit formats, N-D, and
    # dtypes numba cannot type (byte-swapped, ml_dtypes' bfloat16) alike
    from rtmem.kernels.adam import _data_address
    base = np.zeros(64, np.float32)
    arrays = [base[3:], base.reshape(8, 8)[1:, 2:], base.view(np.uint16)[5:],
              base.view(np.int16)[7:], base.view(np.float16)[1:], base.reshape(2, 4, 8).T,
              np.zeros(5, ">f4")[1:], np.zeros(3, [("a", np.float32), ("b", np.int8)])]
    try:
        import ml_dtypes
        arrays.append(base.view(ml_dtypes.bfloat16)[9:])
    except ImportError:
        pass
    for a in arrays:
        assert _data_address(a) == a.__array_interface__["data"][0], a.dtype
