"""CPUAdam / NumpyAdam on many small tensors (a GPT-2-like list of biases and
norms beside a few matrices): the per-tensor work a step repeats is done once
where it cannot differ, results stay those of one adam_update per tensor, and
every check still fires when what it checks changes between two steps."""

from __future__ import annotations

import numpy as np
import pytest

import rtmem.optim as optim
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
