"""OffloadedAdam against torch.optim.Adam, operation by operation: a hypothesis
state machine runs random sequences of backward passes (hooked or gradients set
by hand, loss-scaled or not), requires_grad toggles, steps (some interrupted in
the update or an upload, then retried as NOTE [ Interrupted step ] says),
zero_grad of both kinds, hyperparameter edits, and state dicts saved and loaded
back, or moved into a new OffloadedAdam (its own or torch's). Several param
groups in one flat order, some parameters empty, transposed or frozen at
construction, fp32/fp16/bf16, and chunks that cut runs and parameters anywhere.

The twin is torch.optim.Adam over fp32 copies (the master weights). Gradients
are small integers times a power of two, exact in every dtype however they are
summed, so both sides step with the very same gradients. After every operation
each parameter's step count, master weights, moments and device copy (its
master rounded) must agree with the twin's; a failure names the parameter and
what differs, and hypothesis prints the operations that led there.
"""

import contextlib
import copy

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from _machines import machine_settings

torch = pytest.importorskip("torch")

from rtmem.torch import OffloadedAdam  # noqa: E402

HYPER = st.fixed_dictionaries(dict(
    lr=st.sampled_from([0.0, 1e-3, 0.05]),
    betas=st.tuples(st.sampled_from([0.0, 0.5, 0.9]), st.sampled_from([0.3, 0.999])),
    eps=st.sampled_from([1e-8, 1e-3]), weight_decay=st.sampled_from([0.0, 0.1]),
    decoupled_weight_decay=st.booleans()))
USED = st.lists(st.booleans(), min_size=5, max_size=5)     # which parameters


class _Injected(Exception):
    """The failure injected into a step (a KeyboardInterrupt, a failed upload)."""


@contextlib.contextmanager
def _failing(off, where, call):
    """Make call number ``call`` of ``off``'s update kernel (``where="apply"``)
    or of its upload (``"upload"``, its chunk written) raise _Injected instead
    of running. Yields the element ranges of the calls made."""
    seen = []
    update = off._update

    def hit(a, b):
        seen.append((a, b))
        return len(seen) == call

    class Update:               # PreparedUpdate has slots: wrap it
        def apply(self, c, a, b):
            if hit(a, b):
                raise _Injected
            update.apply(c, a, b)

        def __getattr__(self, name):
            return getattr(update, name)

    def upload(h2d, a, b):
        if hit(a, b):
            raise _Injected
        type(off)._upload_on(off, h2d, a, b)
    if where == "apply":
        off._update = Update()
    else:
        off._upload_on = upload
    try:
        yield seen
    finally:
        off._update = update
        off.__dict__.pop("_upload_on", None)


class _AgainstTorch(RuleBasedStateMachine):

    @initialize(params=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 5), st.booleans(),
                                          st.booleans(), st.integers(0, 2)),
                                min_size=2, max_size=5),
                hypers=st.lists(HYPER, min_size=3, max_size=3),
                dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
                chunk=st.integers(1, 12), flush=st.booleans(),
                scale=st.sampled_from([None, 64.0]), seed=st.integers(0, 2**31))
    def build(self, params, hypers, dtype, chunk, flush, scale, seed):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype, self.flush, self.scale = dtype, flush, scale
        self.mine, self.ref, self.group = [], [], []
        for rows, cols, transposed, frozen, group in sorted(params, key=lambda e: e[4]):
            t = (torch.randn(cols, rows, generator=self.gen).t() if transposed
                 else torch.randn(rows, cols, generator=self.gen)).to(dtype)
            self.mine.append(torch.nn.Parameter(t.clone(), requires_grad=not frozen))
            self.ref.append(torch.nn.Parameter(t.float()))
            self.group.append(sorted({e[4] for e in params}).index(group))
        self.hypers = [hypers[g] for g in sorted({e[4] for e in params})]
        self.offsets = np.cumsum([0] + [p.numel() for p in self.mine])
        self.off = self._offloaded(chunk)
        self.ref_opt = torch.optim.Adam(self._groups(self.ref), foreach=False)
        self.step_count, self.saved = 0, None

    def _groups(self, params):
        return [dict(h, params=[p for p, g in zip(params, self.group) if g == gi])
                for gi, h in enumerate(self.hypers)]

    def _offloaded(self, chunk):
        return OffloadedAdam(self._groups(self.mine), chunk_elements=chunk,
                             flush_in_backward=self.flush)

    @rule(used=USED, by_hand=st.booleans())
    def backward(self, used, by_hand=False):
        """A backward pass through the parameters ``used`` (a flag each) that
        require grad, or gradients added to their p.grad by hand (frozen ones too)."""
        grads = {k: torch.randint(-4, 5, p.shape, generator=self.gen).float()
                 for k, (p, u) in enumerate(zip(self.mine, used))
                 if u and (by_hand or p.requires_grad)}
        scaled = {k: (g * (self.scale or 1.0)).to(self.dtype) for k, g in grads.items()}
        if by_hand:
            for k, g in scaled.items():
                p = self.mine[k]
                p.grad = g if p.grad is None else p.grad + g
        elif scaled:
            sum((self.mine[k] * g).sum() for k, g in scaled.items()).backward()
        for k, g in grads.items():
            q = self.ref[k]
            q.grad = g if q.grad is None else q.grad + g

    @rule(k=st.integers(0, 4))
    def toggle_requires_grad(self, k):
        p = self.mine[k % len(self.mine)]
        p.requires_grad_(not p.requires_grad)

    def _ref_step(self, ks, upto=None):
        """torch's step of the parameters ``ks`` alone; with ``upto``, their
        elements from flat index ``upto`` on keep their values and moments."""
        kept = [q.grad for q in self.ref]
        before = {k: self._ref_tensors(k) for k in ks}
        for k, q in enumerate(self.ref):
            q.grad = kept[k] if k in ks else None
        self.ref_opt.step()
        for q, g in zip(self.ref, kept):
            q.grad = g
        for k in ks if upto is not None else ():
            cut = max(0, upto - int(self.offsets[k]))
            with torch.no_grad():
                for now, old in zip(self._ref_tensors(k, live=True), before[k]):
                    flat = now.reshape(-1).clone()
                    flat[cut:] = old.reshape(-1)[cut:]
                    now.copy_(flat.view(now.shape))

    def _ref_tensors(self, k, live=False):
        """The twin's weights, exp_avg and exp_avg_sq of parameter k (zeros
        before its first step), copied unless ``live``."""
        q = self.ref[k]
        st = self.ref_opt.state.get(q) or {}
        ts = [q.detach()] + [st.get(key, torch.zeros_like(q)) for key in ("exp_avg",
                                                                         "exp_avg_sq")]
        return ts if live else [t.clone() for t in ts]

    @rule(used=USED,
          interrupt=st.none() | st.tuples(st.sampled_from(["apply", "upload"]),
                                          st.integers(1, 4)),
          to_none=st.booleans())
    def step(self, used, interrupt, to_none):
        """A backward pass through ``used``, a step (interrupted in its
        ``interrupt[1]``-th kernel call or upload, when it makes that many, and
        then retried), and zero_grad."""
        self.backward(used)
        ks = [k for k, q in enumerate(self.ref) if q.grad is not None]
        fired = None
        with _failing(self.off, *interrupt) if interrupt else contextlib.nullcontext() as seen:
            try:
                self.off.step(grad_scale=self.scale)
            except _Injected:
                fired = seen[interrupt[1] - 1]    # (the recovery uploads again)
        if fired is not None:
            # NOTE [ Interrupted step ]: elements before the failing chunk (through
            # it if it was written) are updated, and the parameters they start
            # count as stepped; the retry updates the others, once
            a, b = fired
            upto = a if interrupt[0] == "apply" else b
            reached = [k for k in ks if self.offsets[k] < upto]
            self._ref_step(reached, upto)
            ks = [k for k in ks if k not in reached]
            self.step_count += bool(reached)
            self.off.step(grad_scale=self.scale)
        self._ref_step(ks)
        self.step_count += bool(ks)
        for opt in (self.off, self.ref_opt):
            opt.zero_grad(set_to_none=to_none)

    @rule(to_none=st.booleans())
    def zero_grad(self, to_none):
        for opt in (self.off, self.ref_opt):
            opt.zero_grad(set_to_none=to_none)

    @rule(g=st.integers(0, 2), hyper=HYPER)
    def edit_group(self, g, hyper):
        for opt in (self.off, self.ref_opt):
            opt.param_groups[g % len(self.hypers)].update(hyper)

    @rule(load=st.booleans())
    def checkpoint(self, load):
        """Save both optimizers and the weights, or (``load``) put them back as
        they were at the last save (the gradients are kept, by both)."""
        if not load or self.saved is None:
            self.saved = (copy.deepcopy(self.off.state_dict()),
                          copy.deepcopy(self.ref_opt.state_dict()),
                          [p.detach().clone() for p in self.mine + self.ref], self.step_count)
            return
        sd, ref_sd, weights, self.step_count = self.saved
        with torch.no_grad():
            for p, w in zip(self.mine + self.ref, weights):
                p.copy_(w)
        self.off.load_state_dict(sd)
        self.ref_opt.load_state_dict(copy.deepcopy(ref_sd))

    @rule(chunk=st.integers(1, 12), from_torch=st.booleans())
    def reopen(self, chunk, from_torch):
        """Close this OffloadedAdam (its gradients go) and load its state dict,
        or the twin's (the master weights then read from the parameters), into
        a new one."""
        sd = copy.deepcopy((self.ref_opt if from_torch else self.off).state_dict())
        self.off.close()
        for p in self.mine:
            p.grad = None
        self.ref_opt.zero_grad(set_to_none=True)
        self.off = self._offloaded(chunk)
        self.off.load_state_dict(sd)
        if from_torch:
            with torch.no_grad():
                for p, q in zip(self.mine, self.ref):
                    q.copy_(p.float())
            self.step_count = max(int(st["step"]) for st in sd["state"].values()) \
                if sd["state"] else 0

    @invariant()
    def matches_torch(self):
        off = self.off
        assert off.step_count == self.step_count, \
            f"step_count is {off.step_count}, {self.step_count} steps updated something"
        for k, p in enumerate(self.mine):
            lo, hi = int(self.offsets[k]), int(self.offsets[k + 1])
            where = (f"parameter {k} (group {self.group[k]}, shape {tuple(p.shape)}, "
                     f"{self.dtype}, elements [{lo}, {hi}) of chunks of {off.chunk})")
            st = self.ref_opt.state.get(self.ref[k])
            step = int(st["step"]) if st else 0
            assert off.steps[k] == step, \
                f"{where}: OffloadedAdam stepped it {off.steps[k]} times, torch {step}"
            assert (p in off.state) == bool(step), f"{where}: state[p] is {off.state.get(p)}"
            ours = [torch.from_numpy(a[lo:hi].copy()).view(p.shape)
                    for a in (off.master, off.exp_avg, off.exp_avg_sq)]
            for name, x, ref in zip(("master weights", "exp_avg", "exp_avg_sq"), ours,
                                    self._ref_tensors(k, live=True)):
                # assert_close's own checks cost ~10x its comparison, and this runs
                # after every rule (a third of the test's time): the same tolerance
                # by allclose first, and assert_close, to say what differs, only
                # when that fails (same shape and dtype: allclose must not broadcast)
                if x.shape == ref.shape and x.dtype == ref.dtype and torch.allclose(
                        x, ref, rtol=1e-5, atol=1e-6):
                    continue
                torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-6, msg=lambda m: (
                    f"{where}: its {name} differ from torch.optim.Adam's: {m}"))
            assert torch.equal(p.detach(), ours[0].to(self.dtype)), \
                f"{where}: the device copy is not its master weights rounded to {self.dtype}"

    def teardown(self):
        self.off.close()


_AgainstTorch.TestCase.settings = machine_settings(120, 40)


@pytest.mark.usefixtures("host_backend")
@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout")
class TestOffloadedAdamAgainstTorch(_AgainstTorch.TestCase):
    pass
