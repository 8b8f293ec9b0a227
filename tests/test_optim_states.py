"""CPUAdam / CPUAdamW against torch.optim.Adam / AdamW (foreach=False): a hypothesis
state machine steps float32 parameters with rtmem, their float64 twins with torch,
and after every operation checks that both agree on parameters, moments, steps,
hyperparameters and which state each parameter has. Operations: backward over random
subsets (accumulating), gradients set by hand (inf/NaN too, propagated as torch does)
or cleared, zero_grad both ways, requires_grad toggles, step() and step(grads=,
grad_scale=) with fp32/fp16/bf16 gradients, param_groups edits, add_param_group, and
state dicts moved between fresh rtmem and torch optimizers. An inf/NaN gradient under
the finite check must skip the step to the bit (no new state either) and count it; a
refused call must change nothing. Each once failed (a skipped step created state, a
refused one left max_exp_avg_sq, AMSGrad's maximum dropped a NaN). Half the runs keep
rtmem's moments in a HostArena (``state_arena=``), whose accounting must then match
the moments held exactly: nothing a refused call, a skip or a load made is left there.

Gradients, initial parameters, weight_decay and the quadratic loss factor are small
multiples of powers of two, so both sides see the very same gradients, even at a first
step, where the update is about lr * sign(gradient) and a rounding near 0 could flip it.
"""

import copy
import gc
import io

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from _machines import machine_settings

torch = pytest.importorskip("torch")

import rtmem  # noqa: E402
from rtmem import _deferred  # noqa: E402
from rtmem.errors import OptimizerError  # noqa: E402
from rtmem.optim import CPUAdam, CPUAdamW  # noqa: E402

# 0-d, empty and one-element tensors, and one past the kernel's 2**14-element block
# (its threaded path). The last two join through add_param_group.
SHAPES = [(3, 4), (5,), (), (2, 1, 3), (0,), (1,), (2, 8200), (4,), (2, 3)]
N_START = 7
HYPER = dict(lr=st.sampled_from([0.0, 1e-3, 1e-2, 0.1]) | st.floats(1e-4, 0.2),
             betas=st.tuples(st.sampled_from([0.0, 0.5, 0.9]),
                             st.sampled_from([0.6, 0.99, 0.999])),
             eps=st.sampled_from([1e-8, 1e-6, 1e-3, 0.1]),
             weight_decay=st.sampled_from([0.0, 2.0**-10, 2.0**-6, 0.5]),
             amsgrad=st.booleans(), maximize=st.booleans())
hypers = st.fixed_dictionaries(HYPER)
# The fresh optimizers that load a state dict start from values never drawn, so
# that one the load forgets shows.
FRESH = dict(lr=0.5, betas=(0.1, 0.2), eps=0.3, weight_decay=0.25)
seeds = st.integers(0, 2**31 - 1)


def dyadic(shape, gen, unit=0.25):
    """Integers in -16..16 times ``unit``: exact in fp32, fp16 and bf16, also summed."""
    return torch.randint(-16, 17, shape, generator=gen).float() * unit


def close(x, ref, what):
    """``x`` (float32) within rounding of the float64 ``ref`` and non-finite where it
    is, inf or NaN alike: torch's lerp makes an inf moment NaN when beta1 <= 0.5."""
    x, ref = x.detach().numpy().astype(np.float64), ref.detach().numpy()
    finite = np.isfinite(ref)
    assert (np.isfinite(x) == finite).all(), (what, "non-finite elements differ")
    x, ref = x[finite], ref[finite]
    bad = ~np.isclose(x, ref, rtol=2e-4, atol=2e-5 * (1 + np.abs(ref).max(initial=0.0)))
    assert not bad.any(), (what, x[bad][:5], ref[bad][:5])


def same(a, b):
    """``a`` and ``b`` equal to the bit (NaNs too) through dicts, lists and tensors."""
    if torch.is_tensor(a):
        return (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b or (a != a and b != b)


class Machine(RuleBasedStateMachine):

    @initialize(data=st.data(), seed=seeds, adamw=st.booleans(), defaults=hypers,
                assign=st.lists(st.integers(0, 2), min_size=N_START, max_size=N_START),
                arena=st.booleans())
    def build(self, data, seed, adamw, defaults, assign, arena):
        # One torch thread: on a busy 2-core box torch's OpenMP pool and numba's spin
        # against each other, and copying or comparing 16k elements takes milliseconds.
        self.torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        gen = torch.Generator().manual_seed(seed)
        self.ours = [dyadic(s, gen, 0.125).requires_grad_() for s in SHAPES]
        self.ref = [p.detach().double().requires_grad_() for p in self.ours]
        self.index = {id(p): i for i, p in enumerate(self.ours)}
        self.adamw, self.skips = adamw, 0     # skips: what skipped_steps must say
        self.arena = rtmem.HostArena("1MiB") if arena else None
        self.groups = [g for g in ([i for i in range(N_START) if assign[i] == k]
                                   for k in range(3)) if g]
        overrides = []
        for _ in self.groups:           # some hyperparameters per group, the rest default
            h = data.draw(hypers)
            overrides.append({k: h[k] for k in data.draw(st.sets(st.sampled_from(sorted(h))))})
            if not adamw:
                overrides[-1]["decoupled_weight_decay"] = data.draw(st.booleans())
        self.opt, self.ropt = (self._make(side, overrides, defaults) for side in (False, True))

    def teardown(self):
        torch.set_num_threads(getattr(self, "torch_threads", torch.get_num_threads()))

    def _make(self, torch_side, overrides, defaults):
        params = self.ref if torch_side else self.ours
        pg = [dict(params=[params[i] for i in g], **h) for g, h in zip(self.groups, overrides)]
        if torch_side:
            cls = torch.optim.AdamW if self.adamw else torch.optim.Adam
            return cls(pg, **defaults, foreach=False)
        return (CPUAdamW if self.adamw else CPUAdam)(pg, **defaults,
                                                     state_arena=self.arena)

    def _frozen(self):
        """What a refused or skipped call must leave bit-identical (the skip
        counters, which a skip moves, apart from the state dict's)."""
        sd = copy.deepcopy(self.opt.state_dict())
        assert (sd.pop("skipped_steps"), sd.pop("last_step_skipped")) == \
            (self.opt.skipped_steps, self.opt.last_step_skipped)
        return (sd, [p.detach().clone() for p in self.ours],
                [None if p.grad is None else p.grad.clone() for p in self.ours],
                self.opt.skipped_steps, self.opt.last_step_skipped)

    def _refused(self, call, *args):
        before = self._frozen()
        with pytest.raises((OptimizerError, ValueError)):   # ValueError: torch's own checks
            call(*args)
        assert same(before, self._frozen()), f"a refused {call.__name__} changed something"

    @rule(subset=st.sets(st.integers(0, len(SHAPES) - 1), min_size=1), seed=seeds,
          quad=st.sampled_from([0.0, 2.0**-4]))
    def backward(self, subset, seed, quad):
        # The quadratic term makes the gradient depend on the parameters.
        live = [i for i in sorted(subset) if self.ours[i].requires_grad]
        gen = torch.Generator().manual_seed(seed)
        coeffs = [dyadic(SHAPES[i], gen) for i in live]
        for side in (self.ours, self.ref) if live else ():
            sum((a.to(side[i].dtype) * side[i] + quad * side[i] ** 2).sum()
                for a, i in zip(coeffs, live)).backward()

    @rule(i=st.integers(0, len(SHAPES) - 1), seed=seeds,
          kind=st.sampled_from(["dyadic", "big", "zeros", "none", "inf", "-inf", "nan"]))
    def set_grad(self, i, seed, kind):
        g = dyadic(SHAPES[i], torch.Generator().manual_seed(seed),
                   {"big": 2.0**10, "zeros": 0.0}.get(kind, 0.25))
        if kind in ("inf", "-inf", "nan") and g.numel():
            g.view(-1)[seed % g.numel()] = float(kind)
        self.ours[i].grad, self.ref[i].grad = (None, None) if kind == "none" else (g, g.double())

    @rule(set_to_none=st.booleans())
    def zero_grad(self, set_to_none):
        self.opt.zero_grad(set_to_none=set_to_none)
        self.ropt.zero_grad(set_to_none=set_to_none)

    @rule(i=st.integers(0, len(SHAPES) - 1))
    def toggle_requires_grad(self, i):
        for side in (self.ours, self.ref):
            side[i].requires_grad_(not side[i].requires_grad)

    @rule()
    def step(self):
        self.opt.step()
        self.ropt.step()
        assert self.opt.last_step_skipped is False

    @rule(data=st.data(), seed=seeds, as_dict=st.booleans(), check=st.booleans(),
          dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
          scale=st.sampled_from([None, 1.0, 2.0**8, 2.0**-3]),
          poison=st.sampled_from([None, float("inf"), -float("inf"), float("nan")]))
    def step_with_grads(self, data, seed, as_dict, check, dtype, scale, poison):
        params = [p for g in self.opt.param_groups for p in g["params"]]
        gen = torch.Generator().manual_seed(seed)
        keep = data.draw(st.lists(st.booleans(), min_size=len(params), max_size=len(params)))
        grads = [dyadic(p.shape, gen) if k else None for p, k in zip(params, keep)]
        check = check or scale is not None          # a loss scale turns the check on
        live = [k for k, g in enumerate(grads) if g is not None and g.numel()]
        if poison is not None and check and live:     # indices: failures print short
            g = grads[data.draw(st.sampled_from(live))]
            g.view(-1)[seed % g.numel()] = poison
        else:
            poison = None
        # Powers of two: the kernel's unscaled gradients are exactly ``grads``.
        sent = [None if g is None else (g * (scale or 1.0)).to(dtype) for g in grads]
        if as_dict:         # a dict may give a param None, or leave it out: its p.grad
            sent = {p: g for p, g in zip(params, sent) if g is not None or data.draw(st.booleans())}
            given = {id(p) for p in sent}
            for k, p in enumerate(params):
                if id(p) not in given:      # the loss scale is divided out of it too
                    grads[k] = None if p.grad is None else p.grad.double() / (scale or 1.0)
        skip = check and any(g is not None and not torch.isfinite(g).all() for g in grads)
        before = self._frozen()
        self.opt.step(grads=sent, grad_scale=scale, check_finite=check)
        after = self._frozen()
        assert same(before[2], after[2]), "step(grads=...) touched p.grad"
        assert self.opt.last_step_skipped is skip
        if skip:
            self.skips += 1
            assert same(before[:3], after[:3]), "a skipped step changed something"
            return
        twins = [self.ref[self.index[id(p)]] for p in params]
        saved = [q.grad for q in twins]
        for q, g in zip(twins, grads):
            q.grad = None if g is None else g.double()
        self.ropt.step()
        for q, g in zip(twins, saved):
            q.grad = g

    @rule(data=st.data(), bad=st.sampled_from([
        ("lr", -1e-3), ("lr", float("nan")), ("lr", float("inf")), ("eps", 0.0),
        ("eps", 1e-50), ("betas", (1.0, 0.9)), ("betas", (0.9, 1.0)), ("betas", (0.9,)),
        ("weight_decay", -0.1)]))
    def refused_step(self, data, bad):
        group = self.opt.param_groups[data.draw(st.integers(0, len(self.opt.param_groups) - 1))]
        key, old = bad[0], group[bad[0]]
        group[key] = bad[1]         # in the state dicts compared before and after too
        try:
            self._refused(self.opt.step)
        finally:
            group[key] = old

    @rule(data=st.data(), key=st.sampled_from([*HYPER, "lr_tensor", "decoupled_weight_decay"]))
    def set_hyper(self, data, key):
        gi = data.draw(st.integers(0, len(self.opt.param_groups) - 1))
        og, rg = self.opt.param_groups[gi], self.ropt.param_groups[gi]
        if key == "lr_tensor":
            key, val = "lr", torch.tensor(data.draw(HYPER["lr"]))
        elif key == "decoupled_weight_decay":
            val = self.adamw or not og[key]         # the W classes always decouple
        else:
            val = data.draw(HYPER[key])
        if key == "amsgrad" and val and any(q in self.ropt.state and "max_exp_avg_sq" not in
                                            self.ropt.state[q] for q in rg["params"]):
            return      # torch raises KeyError for a state without max_exp_avg_sq
        og[key] = val
        rg[key] = val.clone() if torch.is_tensor(val) else val

    @rule(data=st.data(), h=hypers)
    def add_group(self, data, h):
        free = [i for i in range(N_START, len(SHAPES)) if all(i not in g for g in self.groups)]
        if free:
            i = data.draw(st.sampled_from(free))
            # Every hyperparameter explicit: a loaded optimizer has other defaults (FRESH).
            h["decoupled_weight_decay"] = self.adamw or data.draw(st.booleans())
            self.opt.add_param_group(dict(params=[self.ours[i]], **h))
            self.ropt.add_param_group(dict(params=[self.ref[i]], **h))
            self.groups.append([i])

    @rule(kind=st.sampled_from(["transposed", "float64", "bad_lr", "duplicate", "coupled"]))
    def refused_group(self, kind):
        p = torch.zeros(3, requires_grad=True)
        self._refused(self.opt.add_param_group, {
            "transposed": dict(params=[torch.zeros(4, 3).t().requires_grad_()]),
            "float64": dict(params=[p.detach().double().requires_grad_()]),
            "bad_lr": dict(params=[p], lr=-1.0),
            "duplicate": dict(params=[self.opt.param_groups[0]["params"][0]]),
            # CPUAdamW cannot couple; CPUAdam takes only a bool
            "coupled": dict(params=[p], decoupled_weight_decay=not self.adamw and "yes")}[kind])

    @rule(src_torch=st.booleans(), dst_torch=st.booleans())
    def roundtrip(self, src_torch, dst_torch):
        # Through torch.save and a weights_only load: rtmem's dict must pass it, and the
        # loaded dict is a copy (torch keeps a dict's step tensors, which the other steps).
        buf = io.BytesIO()
        torch.save((self.ropt if src_torch else self.opt).state_dict(), buf)
        buf.seek(0)
        fresh = self._make(dst_torch, [{} for _ in self.groups], FRESH)
        fresh.load_state_dict(torch.load(buf, weights_only=True))
        if dst_torch:
            self.ropt = fresh
        else:
            # rtmem's dict carries the skip counters; torch's has none: 0, False
            want = (self.skips, self.opt.last_step_skipped) if not src_torch else (0, False)
            assert (fresh.skipped_steps, fresh.last_step_skipped) == want
            self.opt, self.skips = fresh, want[0]

    @rule(data=st.data(), kind=st.sampled_from(["shape", "step", "lr", "sgd"]))
    def refused_load(self, data, kind):
        sd = copy.deepcopy(self.opt.state_dict())
        if kind == "sgd":               # not an Adam dict: no betas, no eps
            sd = torch.optim.SGD([dict(params=g["params"]) for g in self.opt.param_groups],
                                 lr=0.1).state_dict()
        elif kind == "lr":
            sd["param_groups"][-1]["lr"] = -3.0
        elif sd["state"]:               # a moment of another shape, a step that is no count
            s = sd["state"][data.draw(st.sampled_from(sorted(sd["state"])))]
            if kind == "shape":
                s["exp_avg"] = torch.zeros(7, 7, 7)
            else:
                s["step"] = torch.tensor(data.draw(st.sampled_from([-2.0, 2.5, float("nan")])))
        else:
            return
        self._refused(self.opt.load_state_dict, sd)

    @invariant()
    def agree_with_torch(self):
        assert self.opt.skipped_steps == self.skips
        assert len(self.opt.param_groups) == len(self.ropt.param_groups)
        for og, rg in zip(self.opt.param_groups, self.ropt.param_groups):
            assert len(og["params"]) == len(rg["params"])
            for k in (*HYPER, "decoupled_weight_decay"):
                a, b = (float(og[k]), float(rg[k])) if k == "lr" else (og[k], rg[k])
                assert a == b or (k == "betas" and tuple(a) == tuple(b)), (k, a, b)
        for i, (p, q) in enumerate(zip(self.ours, self.ref)):
            assert p.dtype == torch.float32 and p.is_contiguous()
            close(p, q, f"param {i}")
            ours, ref = self.opt.state.get(p, {}), self.ropt.state.get(q, {})
            assert ours.keys() == ref.keys(), (i, ours.keys(), ref.keys())
            for k, v in ours.items():
                assert v.dtype == torch.float32 and v.is_contiguous(), (i, k, v.dtype)
                if k == "step":
                    assert v.dim() == 0 and float(v) == float(ref[k]), (i, v, ref[k])
                else:
                    close(v, ref[k], f"param {i} {k}")

    @invariant()
    def arena_holds_exactly_the_moments(self):
        if getattr(self, "arena", None) is None:
            return
        moments = [v for s in self.opt.state.values() for k, v in s.items() if k != "step"]
        slab = self.arena.slabs[0].host_array
        lo = slab.__array_interface__["data"][0]
        for v in (v for v in moments if v.numel()):      # an empty one has no address
            start = v.data_ptr()
            assert lo <= start and start + 4 * v.numel() <= lo + slab.nbytes
        count = self.arena.stats().count_by_kind["optimizer-state"]
        if count != len(moments):       # an optimizer replaced by a load, not yet collected
            gc.collect()
            _deferred.flush()
            count = self.arena.stats().count_by_kind["optimizer-state"]
        assert count == len(moments), (count, len(moments))


Machine.TestCase.settings = machine_settings(25, 25)
TestCPUAdamStates = pytest.mark.usefixtures("host_backend")(Machine.TestCase)
