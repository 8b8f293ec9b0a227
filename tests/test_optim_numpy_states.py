"""NumpyAdam / NumpyAdamW under random sequences of good and refused calls (a
hypothesis state machine): steps (some parameters without a gradient, loss
scaled, an inf gradient under the finite check), steps refused for bad
gradients, copies or scales, state dicts saved and loaded back, and loads
refused for corrupt dicts (the good entries of such a dict changed too, so a
partial load would show). After each refused call the optimizer is byte for
byte what it was (parameters, state, hyperparameters, skip counters); each
applied step matches a float64 Adam on the state before it; a moment arena,
when used, keeps its invariants."""

import copy

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import rtmem
from _adam_reference import adam_step64
from _machines import machine_settings
from rtmem.errors import OptimizerError
from rtmem.optim import NumpyAdam, NumpyAdamW

SHAPES = [(5, 3), (7,), (0,), (4,)]
REFUSED = (OptimizerError, ValueError, TypeError)


def snapshot(opt):
    """Everything a call may change, as bytes and plain values."""
    return ([p.tobytes() for p in opt.params],
            [{k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in state.items()}
             for state in opt.state],
            dict(opt.hyper), opt.skipped_steps, opt.last_step_skipped)


def adam64(p, g, state, hyper, decoupled, grad_scale):
    """One Adam(W) step in float64 from parameter ``p`` and ``state``:
    the new parameter and first moment."""
    (b1, b2), lr, wd = hyper["betas"], hyper["lr"], hyper["weight_decay"]
    p, m, _, _ = adam_step64(p.astype(np.float64), g.astype(np.float64) / (grad_scale or 1.0),
                             state["exp_avg"], state["exp_avg_sq"],
                             state.get("max_exp_avg_sq"), lr=lr, beta1=b1, beta2=b2,
                             eps=hyper["eps"], wd=wd, decoupled=decoupled,
                             step=state["step"] + 1)
    return p, m


class _NumpyAdamMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**16), adamw=st.booleans(), amsgrad=st.booleans(),
                arena=st.booleans())
    def build(self, seed, adamw, amsgrad, arena):
        self.rng = np.random.default_rng(seed)
        self.arena = rtmem.HostArena("1MiB") if arena else None
        params = [self.rng.standard_normal(s).astype(np.float32) for s in SHAPES]
        cls = NumpyAdamW if adamw else NumpyAdam
        self.opt = cls(params, lr=1e-2, amsgrad=amsgrad, weight_decay=0.1,
                       state_arena=self.arena)
        self.saved = []

    def _grads(self, scale=1.0):
        return [self.rng.standard_normal(s).astype(np.float32) * np.float32(scale)
                for s in SHAPES]

    def _refused(self, call):
        before = snapshot(self.opt)
        with pytest.raises(REFUSED):
            call()
        assert snapshot(self.opt) == before

    @rule(scale=st.sampled_from([None, 1.0, 1024.0]), without=st.sets(st.integers(0, 3)),
          overflow=st.booleans())
    def step(self, scale, without, overflow):
        grads = self._grads(scale or 1.0)
        for i in without:
            grads[i] = None
        # an inf gradient only where the step checks (an unchecked one is the
        # caller's: it writes inf/NaN moments, as torch's Adam does)
        overflow = overflow and scale is not None and 0 not in without
        if overflow:
            grads[0].flat[0] = np.inf
        before = copy.deepcopy(list(zip(self.opt.params, self.opt.state)))
        skipped = self.opt.skipped_steps
        applied = self.opt.step(grads, grad_scale=scale)
        assert applied is not overflow and self.opt.last_step_skipped is overflow
        assert self.opt.skipped_steps == skipped + overflow
        for (p0, old), p, state, g in zip(before, self.opt.params, self.opt.state, grads):
            if g is None or overflow:
                assert p.tobytes() == p0.tobytes() and state["step"] == old["step"]
                continue
            want_p, want_m = adam64(p0, g, old, self.opt.hyper,
                                    self.opt.decoupled_weight_decay, scale)
            np.testing.assert_allclose(p, want_p, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(state["exp_avg"], want_m, rtol=1e-5, atol=1e-7)
            assert state["step"] == old["step"] + 1

    @rule(i=st.integers(0, 3), kind=st.sampled_from(
        ["shape", "dtype", "strided", "count", "param", "not an array", "read-only copy",
         "copy shape", "scale"]))
    def refused_step(self, i, kind):
        grads, copies, scale = self._grads(), None, None
        other = np.zeros((3, 3), np.float32)        # fits no parameter
        if kind == "shape":
            grads[i] = other
        elif kind == "dtype":
            grads[i] = grads[i].astype(np.int32) if grads[i].size else other
        elif kind == "strided":
            grads[i] = np.zeros((*SHAPES[i], 2), np.float32)[..., 0] if grads[i].size \
                else other
        elif kind == "count":
            grads = grads[:i]
        elif kind == "param":                       # the parameter as its own gradient
            grads[i] = self.opt.params[i] if self.opt.params[i].size else other
        elif kind == "not an array":
            grads[i] = "nope"
        elif kind == "read-only copy":
            c = np.zeros(SHAPES[i] if grads[i].size else (9,), np.float32)
            c.flags.writeable = False
            copies = [None] * len(SHAPES)
            copies[i] = c
        elif kind == "copy shape":
            copies = [None] * len(SHAPES)
            copies[i] = np.zeros((11,), np.float32)
        else:
            scale = [-1.0, 0.0, float("nan"), "x"][i]
        self._refused(lambda: self.opt.step(grads, copies=copies, grad_scale=scale))

    @rule()
    def save(self):
        self.saved.append(self.opt.state_dict())

    @rule(data=st.data())
    def load(self, data):
        if not self.saved:
            return
        saved = data.draw(st.sampled_from(self.saved))
        self.opt.load_state_dict(saved)
        now = self.opt.state_dict()
        assert now["hyper"] == saved["hyper"]
        for got, want in zip(now["state"], saved["state"]):
            assert set(got) == set(want)
            for key in got:
                np.testing.assert_array_equal(got[key], want[key])

    @rule(i=st.integers(0, 3), kind=st.sampled_from(
        ["negative", "shape", "step", "betas", "missing", "amsgrad", "lr", "skips",
         "count", "dtype"]))
    def refused_load(self, i, kind):
        sd = copy.deepcopy(self.opt.state_dict())
        for state in sd["state"]:       # changed everywhere: a partial load would show
            state["exp_avg"] = state["exp_avg"] + 1
            state["step"] += 5
        sd["hyper"]["eps"] = 0.5
        bad = sd["state"][i]
        if kind == "negative":
            if not bad["exp_avg_sq"].size:
                return
            bad["exp_avg_sq"].flat[-1] = -1.0
        elif kind == "shape":
            bad["exp_avg"] = np.zeros((13,), np.float32)
        elif kind == "step":
            bad["step"] = -1
        elif kind == "betas":
            sd["hyper"]["betas"] = (1.5, 0.9)
        elif kind == "missing":
            del bad["exp_avg"]
        elif kind == "amsgrad":
            sd["hyper"]["amsgrad"] = not sd["hyper"]["amsgrad"]
        elif kind == "lr":
            sd["hyper"]["lr"] = -1.0
        elif kind == "skips":
            sd["skipped_steps"] = -3
        elif kind == "count":
            sd["state"] = sd["state"][:i]
        else:
            bad["exp_avg"] = bad["exp_avg"].astype(np.complex64)
        self._refused(lambda: self.opt.load_state_dict(sd))

    @invariant()
    def arena_consistent(self):
        if getattr(self, "arena", None) is not None:
            self.arena._check_invariants()


_NumpyAdamMachine.TestCase.settings = machine_settings(examples=40, steps=20)
TestNumpyAdamStates = _NumpyAdamMachine.TestCase
