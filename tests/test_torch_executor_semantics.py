"""The executor on models that stress its storage handling (NOTE [ Executor ] in
rtmem/torch/executor.py): batch norm, stages that alias their input, frozen
stages, in-place ops, tied and placed weights, tuple outputs. Every schedule here
is accepted by the simulator; the executor must train exactly as plain PyTorch,
never free memory it does not own, or refuse up front with ExecutionError."""

import contextlib
import copy
import dataclasses
import gc
import math
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from _torch_models import Shared, SoftmaxRecorded, bias_model  # noqa: E402

from rtmem.errors import RtmemError  # noqa: E402
from rtmem.torch import _saved  # noqa: E402
from rtmem.planners import (Chain, Op, Platform, Schedule, plan_remat,  # noqa: E402
                            sequential_schedule, simulate, store_all_schedule)
from rtmem.torch import (ExecutionError, ScheduleExecutor, gpt2_model,  # noqa: E402
                         place_parameters, profile_sequential)

mse = nn.functional.mse_loss


def _sched(text: str, n: int) -> Schedule:
    s = Schedule.from_text(text)
    simulate(Chain.homogeneous(n), s, Platform(math.inf))   # a valid schedule
    return s


def _train(model, x, y, loss_fn, sched, seed=7):
    """One executor step on a copy of ``model`` and one plain step on another;
    returns (executor copy, executor, its loss, plain copy, plain loss)."""
    ref, m = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(seed)
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    ex = ScheduleExecutor(m, sched, loss_fn)
    torch.manual_seed(seed)
    loss = ex.step(x, y)
    return m, ex, loss, ref, ref_loss.detach()


def _assert_same(m, ex, loss, ref, ref_loss):
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    host = ex.host_grads()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        g = p.grad
        if p in host:
            g = host[p] if g is None else g + host[p]
        if q.grad is None:
            assert g is None, name
        else:
            torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    for b, c in zip(m.buffers(), ref.buffers()):
        assert torch.equal(b, c)


def _intact(t) -> bool:
    return t.untyped_storage().nbytes() >= t.numel() * t.element_size()


# ---------------------------------------------------------------- defect 1
def _bn_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Tanh(),
                          nn.Sequential(nn.Flatten(), nn.Linear(64, 1)))
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2)
    return model, torch.randn(3, 2, 4, 4), torch.randn(3, 1)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_moving_a_batchnorm_abar_keeps_its_running_statistics(mode):
    # autograd saves BatchNorm's running_mean/var (train and eval) in abar2;
    # deleting abar2 must not free them, even while stage 1 is recomputed
    # (train mode wrote into the freed storage: a segfault)
    model, x, y = _bn_model()
    getattr(model, mode)()
    sched = _sched("F_all 0, F_all 1, offload abar2, F_all 2, delete abar2, F_all 3, L, "
                   "B 3, F_ck 1, prefetch abar2, B 2, B 1, B 0", 4)
    m, ex, *rest = _train(model, x, y, mse, sched)
    _assert_same(m, ex, *rest)
    assert all(_intact(t) for t in (*m.parameters(), *m.buffers()))


def test_a_failed_step_after_a_delete_leaves_module_buffers_whole():
    model, x, y = _bn_model()
    model.eval()
    sched = _sched("F_all 0, F_all 1, F_all 2, offload abar2, delete abar2, F_all 3, L, "
                   "B 3, prefetch abar2, B 2, B 1, B 0", 4)
    before = [b.clone() for b in model.buffers()]

    def bad_loss(out, target):
        raise ValueError("bad target")
    with pytest.raises(ValueError, match="bad target"):
        ScheduleExecutor(model, sched, bad_loss).step(x, y)
    for b, c in zip(model.buffers(), before):
        assert _intact(b) and torch.equal(b, c)
    model(x)   # still usable


def test_a_recomputation_failing_after_batch_norm_leaves_one_update_of_its_statistics():
    # F_all 1 recomputes the batch-norm stage; it raises after batch norm ran
    # (here a forward hook, as a failing op later in the stage would). The
    # executor puts the statistics of the first forward back after every
    # recomputation: also when it raises, else the failed step leaves them
    # updated twice, which no plain training step does.
    model, x, y = _bn_model()
    sched = _sched("F_ck 0, F_ck 1, F_all 2, F_all 3, L, B 3, B 2, F_all 1, B 1, "
                   "F_all 0, B 0", 4)
    ref, m = copy.deepcopy(model), copy.deepcopy(model)
    ref(x)                                       # one forward: one update
    calls = []

    def fail_on_recomputation(module, args, out):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("recomputation failed")
    handle = m[1].register_forward_hook(fail_on_recomputation)
    ex = ScheduleExecutor(m, sched, mse)
    with pytest.raises(RuntimeError, match="recomputation failed"):
        ex.step(x, y)
    handle.remove()
    for b, c in zip(m.buffers(), ref.buffers()):
        assert torch.equal(b, c)
    # and the next step trains as plain PyTorch from there
    m.zero_grad(set_to_none=True)
    ref.load_state_dict(m.state_dict())
    torch.manual_seed(7)
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    torch.manual_seed(7)
    _assert_same(m, ex, ex.step(x, y), ref, ref_loss.detach())


@pytest.mark.parametrize("stage, text", [
    # a2 (Flatten of a1) deleted while a1 is kept for F_all 1
    (nn.Flatten(), ("F_ck 0, F_ck 1, offload a2, F_all 2, delete a2, F_all 3, F_all 4, L, "
                    "B 4, B 3, F_all 1, B 2, B 1, F_all 0, B 0")),
    # a1 deleted while a2 (the same tensor, nn.Identity) is read by F_all 2
    (nn.Identity(), ("F_ck 0, F_ck 1, offload a1, delete a1, F_all 2, F_all 3, F_all 4, L, "
                     "B 4, B 3, B 2, prefetch a1, F_all 1, B 1, F_all 0, B 0")),
])
def test_deleting_a_tensor_that_shares_its_storage_keeps_the_other_one(stage, text):
    torch.manual_seed(0)
    head = nn.Linear(32, 8) if isinstance(stage, nn.Flatten) else nn.Linear(8, 8)
    first = nn.Conv2d(2, 2, 3, padding=1) if isinstance(stage, nn.Flatten) else nn.Linear(8, 8)
    model = nn.Sequential(first, stage, head, nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(3, 2, 4, 4) if isinstance(stage, nn.Flatten) else torch.randn(3, 8)
    _assert_same(*_train(model, x, torch.randn(3, 1), mse, _sched(text, 5)))


def test_the_callers_batch_and_target_are_never_freed():
    # stage 0 returns the caller's batch itself: a1 *is* x
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), nn.Linear(8, 8), nn.Linear(8, 1))
    x, y = torch.randn(3, 8), torch.randn(3, 1)
    x0, y0 = x.clone(), y.clone()
    sched = _sched("F_ck 0, F_all 1, offload a1, delete a1, F_all 2, L, B 2, prefetch a1, "
                   "B 1, F_all 0, B 0", 3)

    def bad_loss(out, target):
        raise ValueError("loss failed")
    with pytest.raises(ValueError, match="loss failed"):
        ScheduleExecutor(copy.deepcopy(model), sched, bad_loss).step(x, y)
    assert _intact(x) and torch.equal(x, x0) and torch.equal(y, y0)
    _assert_same(*_train(model, x, y, mse, sched))
    assert torch.equal(x, x0)


def test_offloading_the_callers_batch_copies_nothing(arena):
    # the caller's batch is never freed (rule 4), so a0 on it needs no host copy:
    # one put in the host arena, and copied back over the batch by a prefetch,
    # was work and host memory for nothing
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    in_arena = []

    def loss_fn(out, target):
        in_arena.append(arena.stats().allocated_bytes)
        return mse(out, target)
    sched = _sched("F_all 0, offload a0, F_all 1, F_all 2, L, B 2, B 1, B 0", 3)
    ScheduleExecutor(model, sched, loss_fn, host_arena=arena).step(x, y)
    assert in_arena == [0]


class _HalfSquaredNorm(torch.autograd.Function):
    """0.5 * ||z||^2, whose gradient z * g is handed back as a *view* of z when
    g is 1: autograd's AccumulateGrad then keeps that view as the leaf's
    ``.grad`` (a fresh TensorImpl it may steal), so delta_n shares a_n's storage."""

    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return 0.5 * (z * z).sum()

    @staticmethod
    def backward(ctx, g):
        z, = ctx.saved_tensors
        return z.view_as(z) if g.item() == 1.0 else z * g


@pytest.mark.parametrize("text", [
    "F_ck 0, F_ck 1, L, F_all 1, B 1, F_all 0, B 0",               # L drops a2
    "F_ck 0, F_ck 1, offload a2, L, F_all 1, B 1, F_all 0, B 0"])  # L deletes a2
def test_consuming_a_tensor_that_delta_shares_keeps_delta(text):
    # L consumes the plain a2 while delta_2 is a view of it; B 1 then reads
    # delta_2, so its storage is protected like every storage another owner
    # needs (rule 4), counted in the holding ledger
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 4)))
    x = torch.randn(5, 6)

    def loss_fn(out, target):
        return _HalfSquaredNorm.apply(out)
    ref = copy.deepcopy(model)
    out = ref(x)
    grad = torch.autograd.grad(loss_fn(out, None), out)[0]
    assert grad.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    _assert_same(*_train(model, x, None, loss_fn, _sched(text, 2)))


# ---------------------------------------------------------------- defect 2
@pytest.mark.parametrize("segments", [None, 2])
def test_a_frozen_first_stage_on_token_inputs_trains(segments):
    torch.manual_seed(0)
    model, loss_fn, make = gpt2_model(layers=2, hidden=16, heads=2, seq=8, vocab=32)
    model[0].requires_grad_(False)     # frozen embeddings, as in fine-tuning
    x, y = make(2, torch.Generator().manual_seed(1))
    n = len(model)
    sched = store_all_schedule(n) if segments is None else sequential_schedule(n, segments)
    _assert_same(*_train(model, x, y, loss_fn, sched))
    chain = profile_sequential(model, x, y, loss_fn, repeats=1)
    assert chain.u_b[0] == 0 and (chain.u_b[1:] > 0).all()


# ---------------------------------------------------------------- defect 3
@pytest.mark.parametrize("fail", [False, True])
def test_profiling_leaves_existing_gradients_unchanged(fail):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    mse(model(x), y).backward()          # gradients already accumulated
    grads = [p.grad for p in model.parameters()]
    values = [g.clone() for g in grads]

    def loss_fn(out, target):
        loss = mse(out, target)
        if fail:   # after the stage backward passes have run
            raise ValueError("loss failed")
        return loss
    if fail:
        with pytest.raises(ValueError, match="loss failed"):
            profile_sequential(model, x, y, loss_fn, repeats=3)
    else:
        profile_sequential(model, x, y, loss_fn, repeats=3)
    for p, g, v in zip(model.parameters(), grads, values):
        assert p.grad is g and torch.equal(g, v)


@pytest.mark.parametrize("fail", [False, True])
def test_profiling_runs_no_gradient_hook_of_the_callers(fail):
    # the optimizer step in backward of PyTorch's tutorial (a post-accumulate-grad
    # hook per parameter), a tensor hook on a parameter, and one on a tensor
    # outside the model the loss uses: the profiler's backward passes ran them,
    # and stepped the weights (by 1.64 in the auditor's repro) and the optimizer
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    scale = nn.Parameter(torch.ones(1))     # outside the model, read by the loss
    params = [*model.parameters(), scale]
    opts = {p: torch.optim.Adam([p], lr=0.1) for p in params}
    calls = []

    def step_in_backward(p):
        calls.append("post")
        opts[p].step()
        opts[p].zero_grad()
    for p in params:
        p.register_post_accumulate_grad_hook(step_in_backward)
    model[0].weight.register_hook(lambda g: calls.append("tensor"))
    scale.register_hook(lambda g: calls.append("tensor"))
    x, y = torch.randn(4, 8), torch.randn(4, 1)

    def loss_fn(out, target):
        loss = mse(out * scale, target)
        if fail:   # after the stage backward passes have run
            raise ValueError("loss failed")
        return loss
    mse(model(x) * scale, y).backward()     # one plain step: optimizer state exists
    weights = [p.detach().clone() for p in params]
    states = [copy.deepcopy(opts[p].state_dict()) for p in params]
    calls.clear()
    if fail:
        with pytest.raises(ValueError, match="loss failed"):
            profile_sequential(model, x, y, loss_fn, repeats=3)
    else:
        profile_sequential(model, x, y, loss_fn, repeats=3)
    assert calls == []
    for p, w, state in zip(params, weights, states):
        assert torch.equal(p, w)
        assert repr(opts[p].state_dict()) == repr(state)
    # and the hooks are back
    mse(model(x) * scale, y).backward()
    assert calls.count("post") == len(params) and calls.count("tensor") == 2


def test_a_gradient_hook_removed_during_profiling_stays_removed():
    # the profiler held the hooks by emptying their dicts, so a handle removed
    # meanwhile (here from a stage's forward hook) found nothing to remove, and
    # the put-back registered both hooks again: they ran at the next backward
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    calls = []
    w = model[0].weight
    removed = [w.register_hook(lambda g: calls.append("tensor")),
               w.register_post_accumulate_grad_hook(lambda p: calls.append("post"))]
    model[2].weight.register_hook(lambda g: calls.append("kept"))

    def remove_hooks(module, args, out):
        for handle in removed:
            handle.remove()
    handle = model[1].register_forward_hook(remove_hooks)
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    profile_sequential(model, x, y, mse, repeats=2)
    handle.remove()
    assert calls == []
    mse(model(x), y).backward()
    assert calls == ["kept"]
    assert not w._backward_hooks and not w._post_accumulate_grad_hooks


def test_a_gradient_hook_registered_during_profiling_is_held_off_too():
    # the profiler held the hooks a leaf had when it first saw it: one a stage's
    # forward hook registered later (a gradient flush set up at the first
    # forward) ran in the next stage's backward passes on the profiler's
    # gradients, and would have taken them for the next step
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    calls, handles = [], []

    def register(module, args, out):
        if not handles:
            handles.append(model[2].weight.register_post_accumulate_grad_hook(
                lambda p: calls.append("flush")))
    handle = model[1].register_forward_hook(register)
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    profile_sequential(model, x, y, mse, repeats=2)
    handle.remove()
    assert calls == [] and len(handles) == 1
    mse(model(x), y).backward()             # and it is back afterwards
    assert calls == ["flush"]


# ---------------------------------------------------------------- defect 4
class _ScaleInPlace(nn.Module):
    def forward(self, x):
        return x.mul_(2).add_(1)     # parameter-free, in place: fine in plain torch


class _HalveThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(0.5)                  # the linear saves the modified input
        return self.lin(x)


def _in_place_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _ScaleInPlace(), _HalveThenLinear(), nn.Tanh(),
                          nn.Linear(8, 1))
    return model, torch.randn(4, 8), torch.randn(4, 1)


@pytest.mark.parametrize("segments", [None, 2])
def test_in_place_ops_on_stage_and_loss_inputs_train_like_plain_torch(segments):
    model, x, y = _in_place_model()

    def loss_fn(out, target):
        return out.sub_(target).pow(2).mean()   # in place on the loss input too
    sched = store_all_schedule(5) if segments is None else sequential_schedule(5, segments)
    _assert_same(*_train(model, x, y, loss_fn, sched))
    chain = profile_sequential(model, x, y, loss_fn, repeats=2)
    assert (chain.x > 0).all()
    assert chain.no_recompute.tolist() == [False, True, True, False, False]


def test_recomputing_from_an_input_modified_in_place_is_refused():
    # F_ck 1 modifies the stored a1 in place; F_all 1 would recompute from it
    model, x, y = _in_place_model()
    sched = _sched("F_all 0, F_ck 1, F_all 2, F_all 3, F_all 4, L, B 4, B 3, B 2, F_all 1, "
                   "B 1, B 0", 5)
    ex = ScheduleExecutor(model, sched, mse)
    with pytest.raises(ExecutionError, match=r"abar1 was modified in place.*F_all 1"):
        ex.step(x, y)


def test_profiling_marks_stages_that_modify_their_input_in_place_no_recompute():
    # a plan recomputing stage 1 or 2 is refused at step (above): the profile
    # tells the planners, silently (it used to warn, and leave it to the user)
    model, x, y = _in_place_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chain = profile_sequential(model, x, y, mse, repeats=2)
        assert chain.no_recompute.tolist() == [False, True, True, False, False]
        torch.manual_seed(1)
        plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        assert chain.recomputable is False
        assert profile_sequential(plain, x, y, mse, repeats=1).recomputable


class _ShiftInPlace(nn.Module):
    """Adds a learnable shift to its input in place, then a linear layer."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.shift = nn.Parameter(torch.randn(d))

    def forward(self, x):
        x.add_(self.shift)
        return self.lin(x)


def test_a_plan_for_a_profiled_in_place_stage_trains_like_plain_torch_at_a_tight_budget():
    # profile_sequential marks stage 3 no_recompute and plan_remat runs it once:
    # before, its plan at this budget recomputed stage 3 from the a3 its first
    # forward had changed, and the step was refused
    torch.manual_seed(0)
    d = 16      # activations (256 x 16 doubles) well above the weights: recomputation pays
    model = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d), _ShiftInPlace(d),
                          nn.Tanh(), nn.Linear(d, d), nn.Tanh(), nn.Linear(d, 1)).double()
    x = torch.randn(256, d, dtype=torch.float64)
    y = torch.randn(256, 1, dtype=torch.float64)
    chain = profile_sequential(model, x, y, mse, repeats=1)
    assert chain.no_recompute.tolist() == [i == 3 for i in range(8)]
    # unit times: the plans depend on the sizes only, not on the CPU's timings
    chain = dataclasses.replace(chain, u_f=[1.0] * 8, u_b=[1.0] * 8, u_loss=1.0)
    # one byte below store-all: a stage must be recomputed, and the cheapest
    # choice without the flag is to keep a3 and run stage 3 twice on it
    budget = simulate(chain, store_all_schedule(8), Platform(math.inf)).peak - 1
    plan = plan_remat(chain, budget)
    forwards = [s for op, s, _ in plan.schedule if op in (Op.F_CK, Op.F_NONE, Op.F_ALL)]
    assert forwards.count(3) == 1 and len(forwards) > 8   # others are recomputed
    # the same chain without the flag: its plan recomputes stage 3, and the step
    # is refused (the executor's guard of NOTE [ Executor ] rule 7)
    free = dataclasses.replace(chain, no_recompute=None)
    unflagged = plan_remat(free, budget)
    assert [s for op, s, _ in unflagged.schedule
            if op in (Op.F_CK, Op.F_NONE, Op.F_ALL)].count(3) > 1
    with pytest.raises(ExecutionError, match="modified in place"):
        ScheduleExecutor(copy.deepcopy(model), unflagged, mse).step(x, y)
    m, ex, loss, ref, ref_loss = _train(model, x, y, mse, plan)
    _assert_same(m, ex, loss, ref, ref_loss)
    assert ex.peak_bytes <= plan.peak


def test_modifying_a_saved_tensor_in_place_is_refused_as_in_autograd():
    # tanh saves its output a1, which stage 1 then modifies in place: plain
    # autograd refuses the backward, the executor must not compute a wrong one
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), _ScaleInPlace(),
                          nn.Linear(8, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with pytest.raises(RuntimeError, match="inplace"):
        mse(copy.deepcopy(model)(x), y).backward()
    with pytest.raises(ExecutionError, match="modified in place"):
        ScheduleExecutor(model, store_all_schedule(3), mse).step(x, y)


@pytest.mark.parametrize("first", ["abar1", "abar2"])
def test_a_prefetch_restores_the_newest_copy_of_a_storage_two_tensors_share(first):
    # a1 (abar1's output) is the storage stage 1 halves in place and its linear
    # saves (abar2). abar1 is offloaded before the change, abar2 after; deleting
    # both frees the storage. Prefetching abar1 first restored its older copy,
    # which the prefetch of abar2, finding the storage back, kept: a wrong weight
    # gradient and no error. Either order must restore what plain torch holds.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _HalveThenLinear(), nn.Linear(8, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    second = {"abar1": "abar2", "abar2": "abar1"}[first]
    sched = _sched("F_all 0, offload abar1, F_all 1, delete abar1, F_all 2, L, B 2, "
                   f"offload abar2, delete abar2, prefetch {first}, prefetch {second}, "
                   "B 1, B 0", 3)
    _assert_same(*_train(model, x, y, mse, sched))


def test_an_in_place_dropout_s_abar_counts_the_storage_it_shares_with_its_input():
    # nn.Dropout(inplace=True) returns its input's storage and saves its mask.
    # The profiler used to leave that storage out of xbar as "the input's",
    # but once abar1 (which owns it as a1) is deleted, abar2 still keeps it on
    # the device: the executor held 80 bytes more than the simulator counted
    # from the delete until the prefetch, so a plan could exceed its budget.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.Dropout(0.5, inplace=True), nn.Linear(5, 40),
                          nn.Linear(40, 40), nn.Linear(40, 1))
    x, y = torch.randn(4, 5), torch.randn(4, 1)
    loss_fn = nn.functional.mse_loss
    chain = profile_sequential(model, x, y, loss_fn, repeats=1)
    assert chain.no_recompute.tolist() == [False, True, False, False, False]
    # output (shared with a1) and the mask, 80 bytes each
    assert chain.x[1] == 80 and chain.xbar[1] == 160
    sched = Schedule.from_text(
        "F_all 0, F_all 1, offload abar1, delete abar1, F_all 2, F_all 3, F_all 4, L, "
        "B 4, B 3, B 2, prefetch abar1, B 1, B 0")
    acts = Chain(u_f=chain.u_f, u_b=chain.u_b, x=chain.x, xbar=chain.xbar, x0=chain.x0)
    sim = simulate(acts, sched, Platform(math.inf)).timeline["mem_after"].tolist()
    ex = ScheduleExecutor(model, sched, loss_fn)
    ex.step(x, y)
    assert all(m <= s for m, s in zip(ex.resident_bytes, sim)), (ex.resident_bytes, sim)
    # after the delete, a1's storage stays for abar2 and both sides count it once
    assert ex.resident_bytes[3] == sim[3]


class _RecordNeeds(torch.autograd.Function):
    """Identity that records, at backward, whether its input needed a gradient."""

    calls: list = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _RecordNeeds.calls.append(ctx.needs_input_grad[0])
        return grad


class _Recorder(nn.Module):
    def forward(self, x):
        return _RecordNeeds.apply(x)


def _input_grad_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(_Recorder(), nn.Linear(8, 8)), nn.Tanh(),
                         nn.Linear(8, 1))


def test_no_input_gradient_is_computed_for_a_batch_that_needs_none():
    # Plain autograd records nothing for a batch that does not require grad and
    # computes no gradient for it; the executor ran stage 0 on a leaf requiring
    # grad and computed delta_0 at B 0 (a full backward-data pass of the first
    # layer, e.g. the stem convolution on the images), which nothing reads.
    model, y = _input_grad_model(), torch.randn(4, 1)
    x = torch.randn(4, 8)
    for sched in (store_all_schedule(3), _sched(
            "F_ck 0, F_all 1, F_all 2, L, B 2, B 1, F_all 0, B 0", 3)):
        _RecordNeeds.calls.clear()
        _assert_same(*_train(model, x, y, mse, sched))
        assert _RecordNeeds.calls == []


def test_a_parameter_free_first_stage_whose_output_is_modified_in_place_trains():
    # tanh saves its output only when its input requires grad; the executor
    # made the batch require grad, so relu_ on a1 then looked like the
    # in-place change of a saved tensor that autograd refuses (NOTE rule 7),
    # for a model plain PyTorch trains.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Tanh(), nn.ReLU(inplace=True), nn.Linear(8, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    _assert_same(*_train(model, x, y, mse, store_all_schedule(3)))
    chain = profile_sequential(model, x, y, mse, repeats=1)
    assert chain.no_recompute.tolist() == [False, True, False]
    assert chain.u_b[0] == 0 and chain.xbar[0] == chain.x[0]   # nothing to backward


@pytest.mark.parametrize("text", [
    None,                                                        # store all
    # a private copy of a0, freed and brought back
    "offload a0, F_all 0, delete a0, F_all 1, F_all 2, L, B 2, B 1, prefetch a0, B 0",
    "F_ck 0, F_all 1, F_all 2, L, B 2, B 1, F_all 0, B 0",       # stage 0 recomputed
])
@pytest.mark.parametrize("leaf", [True, False])
def test_a_batch_that_requires_grad_gets_its_gradient_as_from_loss_backward(text, leaf):
    # loss.backward() gives a batch that requires grad its gradient (.grad of a
    # leaf, or on through the caller's graph that made it); the executor
    # computed delta_0 and dropped it.
    model, y = _input_grad_model(), torch.randn(4, 1)
    sched = store_all_schedule(3) if text is None else _sched(text, 3)
    torch.manual_seed(1)
    z = torch.randn(4, 8)
    outer = nn.Linear(8, 8)                    # the caller's own layer before the model

    def batch(outer):
        return z.clone().requires_grad_() if leaf else outer(z)
    ref, m, outer_ref = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(outer)
    x_ref, x = batch(outer_ref), batch(outer)
    _RecordNeeds.calls.clear()
    ref_loss = mse(ref(x_ref), y)
    ref_loss.backward()
    loss = ScheduleExecutor(m, sched, mse).step(x, y)
    assert _RecordNeeds.calls == [True, True]
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip([*m.parameters(), *outer.parameters()],
                    [*ref.parameters(), *outer_ref.parameters()]):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    if leaf:
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


class _MaybeInPlace(nn.Module):
    """Doubles its input, in place while ``in_place``."""

    in_place = True

    def forward(self, x):
        return x.mul_(2) if self.in_place else x * 2


@pytest.mark.parametrize("text", [
    None,                                                          # store all
    "F_ck 0, F_all 1, F_all 2, L, B 2, B 1, F_all 0, B 0",         # stage 0 recomputed
    "F_all 0, offload abar1, F_all 1, delete abar1, F_all 2, L, B 2, prefetch abar1, B 1, "
    "B 0",                                                         # offload
    "offload a0, F_all 0, delete a0, F_all 1, w_delete 1, F_all 2, L, B 2, w_prefetch 1, "
    "B 1, g_offload 1, prefetch a0, B 0",                          # combined
])
@pytest.mark.parametrize("view", [False, True])
def test_an_in_place_first_stage_on_a_leaf_batch_that_requires_grad_is_refused(text, view,
                                                                               arena):
    # plain torch refuses x.mul_(2) on a leaf that requires grad (or a view of
    # one) and leaves it unchanged; the executor handed stage 0 an alias of the
    # caller's batch, which it doubled, silently (or raised at a recomputation,
    # after writing gradients)
    torch.manual_seed(0)
    model = nn.Sequential(_MaybeInPlace(), nn.Linear(8, 8), nn.Linear(8, 1))
    sched = store_all_schedule(3) if text is None else _sched(text, 3)
    z, y = torch.randn(6, 8, requires_grad=True), torch.randn(4, 1)
    x = z[:4] if view else z.detach()[:4].clone().requires_grad_()
    leaf, before = z if view else x, x.detach().clone()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        mse(model(x), y)                                   # as plain torch does
    m = copy.deepcopy(model)
    ex = ScheduleExecutor(m, sched, mse, host_arena=arena)
    if text is not None and text.startswith("F_ck 0"):
        # stage 0 first runs under the executor's no_grad, where a change autograd
        # would refuse cannot be told from an allowed one: it goes on the private
        # copy, and the recomputation finds a0 changed (rule 7), late but loud
        with pytest.raises(ExecutionError, match="a0 was modified in place"):
            ex.step(x, y)
        assert torch.equal(x.detach(), before) and leaf.grad is None
        return
    with pytest.raises(ExecutionError, match=r"stage 0 \(_MaybeInPlace\) modifies its input "
                                             r"in place.*leaf.*out-of-place"):
        ex.step(x, y)
    assert torch.equal(x.detach(), before) and leaf.grad is None
    assert all(p.grad is None for p in m.parameters()) and not ex.host_grads()
    assert arena.stats().allocated_bytes == 0
    assert not ex._plain and not ex._bar and ex._delta is None
    # once the stage works out of place, the same executor trains as plain torch
    m[0].in_place = model[0].in_place = False
    ref_loss = mse(model(x), y)
    ref_loss.backward()
    want, leaf.grad = leaf.grad, None
    _assert_same(m, ex, ex.step(x, y), model, ref_loss.detach())
    torch.testing.assert_close(leaf.grad, want)


class _CentreNoGrad(nn.Module):
    """Subtracts the mean from its input in place, under no_grad (torch allows
    that on a leaf that requires grad: autograd records nothing)."""

    def forward(self, x):
        with torch.no_grad():
            x.sub_(x.mean())
        return x * 1.5


@pytest.mark.parametrize("text", [None, "F_all 0, offload abar1, F_all 1, delete abar1, "
                                        "F_all 2, L, B 2, prefetch abar1, B 1, B 0"])
def test_an_in_place_change_under_no_grad_on_a_leaf_batch_trains_as_plain_torch(text, arena):
    # The refusal of in-place first stages on a leaf batch (above) took this one,
    # which plain torch allows, for one it refuses
    torch.manual_seed(0)
    model = nn.Sequential(_CentreNoGrad(), nn.Linear(8, 8), nn.Linear(8, 1))
    sched = store_all_schedule(3) if text is None else _sched(text, 3)
    x, y = torch.randn(4, 8).add_(3.0).requires_grad_(), torch.randn(4, 1)
    x_ref = x.detach().clone().requires_grad_()
    m = copy.deepcopy(model)
    ref_loss = mse(model(x_ref), y)
    ref_loss.backward()
    ex = ScheduleExecutor(m, sched, mse, host_arena=arena)
    _assert_same(m, ex, ex.step(x, y), model, ref_loss.detach())
    torch.testing.assert_close(x.grad, x_ref.grad)


def _profiled_run(model, x, y, text):
    """Profile ``model``, simulate schedule ``text`` on its activation chain and
    train one step with it, checked against plain torch: (chain, sim, executor)."""
    chain = profile_sequential(model, x, y, mse, repeats=1)
    acts = Chain(u_f=chain.u_f, u_b=chain.u_b, x=chain.x, xbar=chain.xbar, x0=chain.x0)
    sched = Schedule.from_text(text)
    sim = simulate(acts, sched, Platform(math.inf))
    m, ex, *rest = _train(model, x, y, mse, sched)
    _assert_same(m, ex, *rest)
    return chain, sim, ex


def _assert_counted_as_simulated(ex, sim):
    """The executor's resident bytes after each operation are the simulator's,
    up to the last one (B 0 holds delta_0, which the executor needs not)."""
    last_b = len(ex.resident_bytes) - 1
    assert ex.resident_bytes[:last_b] == sim.timeline["mem_after"][:last_b].tolist()


# ---------------------------------------------------------------- defect 5
def test_discarding_a_checkpoint_frees_it_as_the_simulator_does():
    # a1 is discarded after F_all 1 read it (abar2's graph still holds its leaf
    # input), then recomputed for B 1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.Linear(256, 16),
                          nn.Sequential(nn.Linear(16, 64), nn.Tanh()), nn.Linear(64, 1))
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    _, sim, ex = _profiled_run(model, x, y, "F_ck 0, F_all 1, delete a1, F_all 2, F_all 3, "
                               "L, B 3, B 2, F_ck 0, B 1, F_all 0, B 0")
    _assert_counted_as_simulated(ex, sim)
    assert ex.peak_bytes <= sim.peak


@pytest.mark.parametrize("text, fails", [
    # the loss raises: no B runs, every abar is dropped with its graph
    ("F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0", True),
    # abar2 discarded and recomputed
    ("F_ck 0, F_all 1, delete abar2, F_all 1, F_all 2, L, B 2, B 1, F_all 0, B 0", False),
    # abar3 recomputed after B 2 and never consumed
    ("F_all 0, F_all 1, F_all 2, L, B 2, F_all 2, B 1, B 0", False)])
def test_graphs_dropped_without_their_backward_are_freed(text, fails):
    # The saved-tensor hooks held each saved tensor as it was, whose grad_fn
    # leads back to the nodes holding the hooks: a cycle through autograd's C++
    # the collector cannot break. Only a B broke it, so every graph dropped
    # without one (a failed step, a discarded or never-consumed abar) stayed
    # alive for good, with its activations: 21 tensors a step on a GPT-2 block
    torch.manual_seed(0)
    model = nn.Sequential(*(SoftmaxRecorded() for _ in range(3)))
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    def loss_fn(out, target):
        if fails:
            raise RuntimeError("the loss failed")
        return mse(out, target)

    ex = ScheduleExecutor(model, _sched(text, 3), loss_fn)
    for _ in range(2):
        with contextlib.suppress(RuntimeError):
            ex.step(x, y)
    gc.collect()
    outputs = [r for stage in model for r in stage.outputs]
    assert len(outputs) >= 6
    alive = sum(r() is not None for r in outputs)
    assert alive == 0, f"{alive} of {len(outputs)} stage outputs outlived their step"
    # the executor's bookkeeping is as after any step: the next one trains
    if not fails:
        m, ex2, loss, ref, ref_loss = _train(model, x, y, mse, _sched(text, 3))
        _assert_same(m, ex2, loss, ref, ref_loss)


@pytest.mark.parametrize("text", [
    # abar1 recomputed while resident: the first is kept, as the simulator keeps
    # it (a second one left the first's output held by abar2's leaf input)
    "F_all 0, F_all 1, F_all 0, F_all 2, L, B 2, B 1, B 0",
    # F_none 0 consumes a0, which the caller's batch cannot be: a private copy
    "offload a0, F_none 0, F_all 1, F_all 2, L, B 2, B 1, prefetch a0, F_all 0, B 0",
    # abar3 recomputed after B 2 and never consumed holds abar2's output as its
    # leaf input; B 1 consumes abar2, so the simulator frees it whole
    "F_all 0, F_all 1, F_all 2, L, B 2, F_all 2, B 1, B 0",
    # F_none 1 keeps the a2 of F_ck 1 and still consumes a1
    "F_ck 0, F_ck 1, F_none 1, F_all 2, L, B 2, F_ck 0, F_all 1, B 1, F_all 0, B 0",
    # B 1 consumes the plain a1 while abar1 is deleted (not resident): the
    # simulator frees a1 there (Table 2.1 keeps a_k only for a resident abar_k)
    "F_ck 0, F_all 0, offload abar1, delete abar1, F_all 1, F_all 2, L, B 2, B 1, "
    "prefetch abar1, B 0",
    # delete a0 frees a0: the step runs on a private copy of the caller's batch
    "F_ck 0, offload a0, delete a0, F_all 1, F_all 2, L, B 2, B 1, prefetch a0, F_all 0, "
    "B 0",
    # abar2 recomputed while its offloaded copy is deleted: the new one replaces
    # the old in the ledgers, which must stop counting the old one's storages
    "F_ck 0, F_all 1, offload abar2, delete abar2, F_all 1, F_all 2, L, B 2, B 1, F_all 0, "
    "B 0"])
def test_redundant_and_deleted_copies_hold_what_the_simulator_counts(text):
    # shapes no planner emits (the first four found by wandering_schedules)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 64), nn.Tanh()),
                          nn.Sequential(nn.Linear(64, 64), nn.Tanh()), nn.Linear(64, 1))
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    x0 = x.clone()
    _, sim, ex = _profiled_run(model, x, y, text)
    _assert_counted_as_simulated(ex, sim)
    assert torch.equal(x, x0) and _intact(x)


class _LayoutByGradMode(nn.Module):
    """tanh(x), laid out column-major under no_grad and row-major under grad:
    the plain a_{i+1} of F_ck and the abar_{i+1} of F_all hold the same values
    in storages laid out differently."""

    def forward(self, x):
        y = torch.tanh(x)
        return y if torch.is_grad_enabled() else y.t().contiguous().t()


_LATER_PLAIN = "F_ck 0, F_all 1, F_all 2, F_ck 1, L, B 2, B 1, F_all 0, B 0"


@pytest.mark.parametrize("stage, text", [
    # F_all 2 reads abar2 and its Linear saves a view of it; B 2 re-derives that
    # view from the plain a2 that F_ck 1 made later, laid out differently: a
    # column-major copy (the old strides read wrong values), a view of a (1, 4)
    # parameter (out of bounds)
    (_LayoutByGradMode, _LATER_PLAIN), (lambda: _ExpandBias(), _LATER_PLAIN),
    # F_all 2 reads the plain a2 (the expanded parameter: stride 0), F_none 2
    # consumes it, B 2 re-derives from abar2
    (lambda: _ExpandBias(),
     "F_ck 0, F_ck 1, F_all 1, F_all 2, F_none 2, L, B 2, B 1, F_all 0, B 0")])
def test_a_saved_input_view_is_rederived_from_a_copy_laid_out_differently(stage, text):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), stage(), nn.Linear(4, 2))
    x, y = torch.randn(5, 6), torch.randn(5, 2)
    _assert_same(*_train(model, x, y, mse, _sched(text, 3)))


# ---------------------------------------------------------------- defect 6
def _tied_model():
    torch.manual_seed(0)
    emb, head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
    head.weight = emb.weight                  # tied, as in GPT-2
    model = nn.Sequential(emb, nn.Sequential(nn.Linear(8, 8), nn.Tanh()), head)
    x, y = torch.randint(16, (2, 5)), torch.randint(16, (2, 5))

    def loss_fn(out, target):
        return nn.functional.cross_entropy(out.reshape(-1, 16), target.reshape(-1))
    return model, x, y, loss_fn


def test_weight_moves_of_tied_parameters_are_refused_up_front():
    model, x, y, loss_fn = _tied_model()
    sched = _sched("F_all 0, w_delete 0, F_all 1, F_all 2, L, B 2, B 1, w_prefetch 0, B 0", 3)
    with pytest.raises(ExecutionError, match=r"'0\.weight'.*shared by stages 0, 2"):
        ScheduleExecutor(model, sched, loss_fn)
    # gradient moves of every stage using it are fine: the host accumulator adds up
    sched = _sched("F_all 0, F_all 1, F_all 2, L, B 2, g_offload 2, B 1, B 0, g_offload 0", 3)
    m, ex, loss, ref, ref_loss = _train(model, x, y, loss_fn, sched)
    _assert_same(m, ex, loss, ref, ref_loss)
    assert m[0].weight.grad is None and m[0].weight in ex.host_grads()
    # of some of them only, it would be split between host_grads() and .grad (an
    # optimizer given host_grads() dropped the .grad part)
    sched = _sched("F_all 0, F_all 1, F_all 2, L, B 2, g_offload 2, B 1, B 0", 3)
    with pytest.raises(ExecutionError, match=r"'0\.weight'.*g_offloads its gradient at "
                                             r"stage\(s\) 2 but not 0"):
        ScheduleExecutor(model, sched, loss_fn)


# ---------------------------------------------------------------- defect 7
@pytest.mark.parametrize("text, what", [
    ("F_all 0, w_delete 0, F_all 1, F_all 2, L, B 2, B 1, w_prefetch 0, B 0", "weight"),
    ("F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0, g_offload 0", "gradient"),
])
def test_moves_of_placed_parameters_are_refused(arena, text, what):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    sched = _sched(text, 3)
    placement = place_parameters(model, arena)
    with pytest.raises(ExecutionError, match=f"'0.weight'.*its {what} in an arena"):
        ScheduleExecutor(model, sched, mse)
    placement.release()
    ex = ScheduleExecutor(model, sched, mse)     # fine once released...
    placement = place_parameters(model, arena)   # ...and checked again at every step
    with pytest.raises(ExecutionError, match="in an arena"):
        ex.step(x, y)
    w = model[0].weight
    assert w.untyped_storage().data_ptr() == placement.weights[w].numpy().ctypes.data
    placement.release()


def test_placed_parameters_without_moves_train_in_their_arena(arena):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    ref = copy.deepcopy(model)
    placement = place_parameters(model, arena)
    ScheduleExecutor(model, sequential_schedule(3, 2), mse).step(x, y)
    mse(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.untyped_storage().data_ptr() == placement.grads[p].numpy().ctypes.data
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    placement.release()


def test_g_offload_of_parameters_placed_without_their_gradients_trains(arena):
    # place_parameters(grads=False) leaves .grad ordinary torch memory, which
    # g_offload may move: only a gradient in the arena is refused
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    ref = copy.deepcopy(model)
    placement = place_parameters(model, arena, grads=False)
    sched = _sched("F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0, g_offload 0", 3)
    ex = ScheduleExecutor(model, sched, mse)
    ex.step(x, y)
    mse(ref(x), y).backward()
    w = model[0].weight
    assert w.grad is None
    torch.testing.assert_close(ex.host_grads()[w], ref[0].weight.grad, rtol=1e-5, atol=1e-6)
    assert w.untyped_storage().data_ptr() == placement.weights[w].numpy().ctypes.data
    placement.release()


# ---------------------------------------------------------------- defect 8
class _Split(nn.Module):
    def forward(self, x):
        return x[:, :4], x[:, 4:]


class _Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, xs):
        return self.lin(xs[0] * xs[1])


def test_stages_with_tuple_outputs_are_refused():
    model = nn.Sequential(nn.Linear(8, 8), _Split(), _Join())
    x, y = torch.randn(3, 8), torch.randn(3, 1)
    with pytest.raises(ExecutionError, match=r"stage 1 \(_Split\) returned a tuple.*single "
                                             r"tensor"):
        ScheduleExecutor(model, store_all_schedule(3), mse).step(x, y)
    with pytest.raises(ExecutionError, match="single tensor"):
        profile_sequential(model, x, y, mse, repeats=1)
    assert issubclass(ExecutionError, RtmemError)


# ------------------------------------------------- profiler accounting (audit)
def test_a_stage_changing_its_input_before_saving_it_keeps_it_in_xbar():
    # nn.ReLU(inplace=True) first: autograd saves the changed input, which the
    # executor cannot re-derive from a1 and keeps with abar2. The profile left
    # that storage out of xbar, so an offload plan held more than simulated.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 256),
                          nn.Sequential(nn.ReLU(inplace=True), nn.Linear(256, 8)),
                          nn.Linear(8, 512), nn.Linear(512, 8))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    chain, sim, ex = _profiled_run(model, x, y, "F_all 0, F_all 1, offload abar1, "
                                   "delete abar1, F_all 2, F_ck 3, L, F_all 3, B 3, B 2, "
                                   "prefetch abar1, B 1, B 0")
    assert chain.no_recompute.tolist() == [False, True, False, False]
    assert chain.xbar[1] == chain.x[0] + chain.x[1]      # a1's storage + a2
    assert all(e <= s for e, s in zip(ex.resident_bytes, sim.timeline["mem_after"]))
    assert ex.peak_bytes <= sim.peak


def test_a_module_repeated_in_the_sequential_is_one_stage_per_position():
    # children() skips repeats: the profile had 4 stages for a model of 5, and
    # the executor raised IndexError on a plan for 5.
    torch.manual_seed(0)
    act = nn.Tanh()
    model = nn.Sequential(nn.Linear(8, 8), act, nn.Linear(8, 8), act, nn.Linear(8, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    chain = profile_sequential(model, x, y, mse, repeats=1)
    assert chain.n == len(model) == 5
    _assert_same(*_train(model, x, y, mse, sequential_schedule(5, 2)))


def test_tied_weights_are_counted_once():
    model, x, y, loss_fn = _tied_model()
    chain = profile_sequential(model, x, y, loss_fn, repeats=1)
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    assert chain.w.sum() == sum(unique.values())
    assert chain.w[2] == 0                                # the head's weight is stage 0's


@pytest.mark.parametrize("repeats", [2.0, True, "2", 0])
def test_profile_repeats_must_be_a_positive_integer(repeats):
    model = nn.Sequential(nn.Linear(4, 4))
    # ExecutionError, as the profiler's other refusals (it was a bare RtmemError)
    with pytest.raises(ExecutionError, match="repeats must be an integer"):
        profile_sequential(model, torch.randn(2, 4), torch.randn(2, 4), mse,
                           repeats=repeats)


# ------------------------------------------------ torch bridge / executor audit
_W_MOVES = "F_all 0, F_all 1, w_offload 1, F_all 2, L, B 2, w_prefetch 1, B 1, B 0"


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_weight_moves_keep_a_parameter_s_strides(layout):
    # The host copy was contiguous, so a saved view of a channels-last or
    # transposed weight was re-derived with the old strides over the new
    # layout: wrong gradients for the earlier stages, no error.
    torch.manual_seed(0)
    if layout == "channels_last":
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1),
                              nn.Sequential(nn.Flatten(), nn.Linear(100, 1)))
        model = model.to(memory_format=torch.channels_last)
        x = torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last)
    else:
        model = nn.Sequential(nn.Linear(5, 6), nn.Linear(6, 5), nn.Linear(5, 1))
        model[1].weight = nn.Parameter(torch.randn(6, 5).t())      # stride (1, 5)
        x = torch.randn(3, 5)
    stride = model[1].weight.stride()
    m, ex, loss, ref, ref_loss = _train(model, x, torch.randn(x.shape[0], 1), mse,
                                        _sched(_W_MOVES, 3))
    _assert_same(m, ex, loss, ref, ref_loss)
    assert m[1].weight.stride() == stride


def test_weight_moves_of_a_view_into_a_larger_storage_are_refused_up_front():
    # a parameter at an offset in a flat buffer failed inside autograd's backward
    # ("setStorage: ... out of bounds"), after the first gradients were written
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Linear(6, 5), nn.Linear(5, 1))
    flat = torch.randn(36)
    model[1].weight = nn.Parameter(flat[6:36].view(5, 6))
    with pytest.raises(ExecutionError, match=r"'1\.weight'.*view into a larger storage"):
        ScheduleExecutor(model, _sched(_W_MOVES, 3), mse)


class _Scale(nn.Module):
    """y = x * scale, then scale *= 10 (an update after use, as a codebook)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        y = x * self.scale
        with torch.no_grad():
            self.scale.mul_(10)
        return y


def test_a_saved_buffer_modified_in_place_is_refused_as_in_autograd():
    # the executor re-derived the saved buffer from the module at B and used the
    # updated value: a 10x gradient where plain autograd raises
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Scale(), nn.Linear(4, 1))
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        mse(copy.deepcopy(model)(x), y).backward()
    ex = ScheduleExecutor(model, store_all_schedule(3), mse)
    with pytest.raises(ExecutionError, match="'1.scale'.*modified in place"):
        ex.step(x, y)


def test_a_plain_activation_consumed_after_its_offload_can_be_prefetched():
    # The simulator keeps host copies past consumption; the executor refused the
    # prefetch halfway through the step, after writing some gradients.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 1))
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    text = ("F_ck 0, offload a1, F_none 1, F_all 2, F_all 3, L, B 3, B 2, prefetch a1, "
            "F_all 1, B 1, F_all 0, B 0")
    _assert_same(*_train(model, x, y, mse, _sched(text, 4)))


def test_a_move_of_a_graph_backward_consumed_is_refused_up_front():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    text = "F_all 0, F_all 1, offload abar2, F_all 2, L, B 2, B 1, prefetch abar2, B 0"
    sched = Schedule.from_text(text)
    try:
        simulate(Chain.homogeneous(3), sched, Platform(math.inf))
    except RtmemError:
        pytest.skip("the simulator refuses this schedule itself")
    with pytest.raises(ExecutionError, match=r"operation 7 .*prefetch abar2.*B 1"):
        ScheduleExecutor(model, sched, mse)


@pytest.mark.parametrize("text", [
    # B 2 consumed abar3's graph, but F_all 2 made it again: it may move
    "F_all 0, F_all 1, F_all 2, L, B 2, F_all 2, offload abar3, delete abar3, B 1, B 0",
    # a plain a2 has no graph: its host copy outlives B 1
    "F_ck 0, F_ck 1, offload a2, F_all 2, L, B 2, F_all 1, B 1, prefetch a2, F_all 0, B 0"])
def test_moves_of_a_remade_graph_or_of_a_plain_tensor_after_its_b_train(text):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    _assert_same(*_train(model, x, y, mse, _sched(text, 3)))


def test_offloaded_gradients_are_added_up_as_their_copies_end():
    # With gradient accumulation and no host_grads() call, every micro-batch's
    # copies stayed pending: one full host copy of the gradients per step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    ref = copy.deepcopy(model)
    sched = _sched("F_all 0, F_all 1, F_all 2, L, B 2, g_offload 2, B 1, B 0, g_offload 0", 3)
    ex = ScheduleExecutor(model, sched, mse)
    for _ in range(4):
        x, y = torch.randn(3, 4), torch.randn(3, 1)
        ex.step(x, y)
        mse(ref(x), y).backward()
        assert len(ex._g_pending) <= len(list(model.parameters()))
    host = ex.host_grads()
    for p, q in zip(model.parameters(), ref.parameters()):
        g = host[p] if p in host else p.grad
        torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, fragment", [
    (lambda out, y: mse(out, y).item(), "must return a scalar tensor.*float"),
    (lambda out, y: (out - y) ** 2, r"scalar tensor.*shape \(3, 1\)"),
])
def test_a_loss_that_is_not_a_scalar_tensor_is_named(bad, fragment):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    ex = ScheduleExecutor(model, store_all_schedule(2), bad)
    with pytest.raises(ExecutionError, match=fragment):
        ex.step(torch.randn(3, 4), torch.randn(3, 1))


class _ArgMax(nn.Module):
    def forward(self, x):
        return x.argmax(-1)


@pytest.mark.parametrize("bad, fragment, last", [
    (lambda out, y: mse(out, y).item(), "must return a scalar tensor.*float", None),
    (nn.MSELoss(reduction="none"), r"scalar tensor.*shape \(3, 1\)", None),
    (lambda out, y: mse(out, y).reshape(1), r"scalar tensor.*shape \(1,\)", None),
    (lambda out, y: mse(out, y).detach(), "loss that does not require grad", None),
    (lambda out, y: out.float().mean(), "the last stage \\(_ArgMax\\)", _ArgMax()),
])
def test_the_profiler_refuses_the_losses_the_executor_refuses(bad, fragment, last):
    # The profiler let torch's errors out of the loss' backward ("grad can be
    # implicitly created only for scalar outputs", 'float' object has no attribute
    # 'backward'), and measured a loss of shape (1,) that the executor then refused
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), last or nn.Linear(4, 1))
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    grads = [torch.full_like(p, 3.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    stats = model[1].running_mean.clone()
    rng = torch.get_rng_state()
    with pytest.raises(ExecutionError, match=fragment) as profiled:
        profile_sequential(model, x, y, bad, repeats=2)
    # the caller's gradients, statistics and RNG state, as before
    for p, g in zip(model.parameters(), grads):
        assert p.grad is g and torch.equal(g, torch.full_like(p, 3.0))
    assert torch.equal(model[1].running_mean, stats)
    assert torch.equal(torch.get_rng_state(), rng)
    for p in model.parameters():
        p.grad = None
    with pytest.raises(ExecutionError) as executed:
        ScheduleExecutor(model, store_all_schedule(3), bad).step(x, y)
    assert str(profiled.value) == str(executed.value)


def test_executor_arguments_are_named():
    for empty in (nn.Sequential(), []):
        with pytest.raises(ExecutionError, match="no stages"):
            ScheduleExecutor(empty, store_all_schedule(1), mse)
    for flag in ("preserve_rng_state", "track_memory"):
        with pytest.raises(ExecutionError, match=f"{flag} must be True or False, got 'no'"):
            ScheduleExecutor(nn.Sequential(nn.Linear(3, 1)), store_all_schedule(1), mse,
                             **{flag: "no"})
    ex = ScheduleExecutor(nn.Sequential(nn.Linear(3, 1)), store_all_schedule(1), mse)
    with pytest.raises(ExecutionError, match="inputs must be a torch.Tensor.*list"):
        ex.step([[1.0, 2.0, 3.0]], torch.zeros(1, 1))


@pytest.mark.parametrize("container", [list, nn.ModuleList])
def test_a_list_of_blocks_is_a_chain_of_stages(container):
    # "an nn.Sequential (or a list of blocks)": profiled, planned and run as the
    # same stages, sharing the blocks' parameters; a ModuleList (how models hold
    # their blocks) was refused
    torch.manual_seed(0)
    blocks = container([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)]
                       + [nn.Linear(4, 1)])
    x, y = torch.randn(5, 4), torch.randn(5, 1)
    chain = profile_sequential(blocks, x, y, mse, repeats=1)
    assert chain.n == 4
    ref = copy.deepcopy(nn.Sequential(*blocks))
    ex = ScheduleExecutor(blocks if container is nn.ModuleList else tuple(blocks),
                          sequential_schedule(4, 2), mse)
    torch.testing.assert_close(ex.step(x, y), mse(ref(x), y).detach())
    mse(ref(x), y).backward()
    for block, twin in zip(blocks, ref):
        for p, q in zip(block.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


def test_profiler_refuses_what_it_cannot_run_before_running_it():
    model = nn.Sequential(nn.Linear(3, 1))
    before = model[0].weight.detach().clone()
    for args, fragment in ((([1, 2], torch.zeros(2, 1), mse), "inputs must be a torch.Tensor"),
                           ((torch.zeros(2, 3), torch.zeros(2, 1), None), "loss_fn must be"),
                           ((torch.zeros(2, 3), torch.zeros(2, 1), mse), None)):
        if fragment is None:
            with pytest.raises(ExecutionError, match="list of modules, got dict"):
                profile_sequential({"m": model}, *args)
            continue
        with pytest.raises(ExecutionError, match=fragment):
            profile_sequential(model, *args)
        assert model[0].weight.grad is None and torch.equal(model[0].weight, before)


def test_placed_frozen_parameters_get_no_gradient(arena):
    # a zero .grad made torch's optimizers apply weight decay to frozen weights
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    placement = place_parameters(model, arena)
    assert model[0].weight.grad is None and model[1].weight.grad is not None
    before = model[0].weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    mse(model(torch.randn(3, 4)), torch.randn(3, 1)).backward()
    opt.step()
    assert torch.equal(model[0].weight, before)
    placement.release()


# ------------------------------------------------------- running byte count
class _ExpandBias(nn.Module):
    """Returns a view of its own parameter: an activation that is model state."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(1, 4))

    def forward(self, x):
        return self.b.expand(x.shape[0], 4) * 1.0 if x.requires_grad else self.b.expand(
            x.shape[0], 4)


@pytest.mark.parametrize("text", [
    "F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0",
    "F_ck 0, F_ck 1, F_all 2, L, B 2, F_all 1, B 1, F_all 0, B 0",
    "F_all 0, F_all 1, w_offload 1, F_all 2, L, B 2, w_prefetch 1, B 1, B 0",
    "F_ck 0, F_ck 1, w_offload 1, F_all 2, L, B 2, w_prefetch 1, F_all 1, B 1, F_all 0, B 0",
    "F_all 0, offload abar1, F_all 1, delete abar1, F_all 2, L, B 2, prefetch abar1, B 1, B 0"])
def test_resident_bytes_are_counted_as_a_full_recount_does(text):
    # The executor counts bytes as tensors come and go (a ledger), not by walking
    # every stored tensor after each operation (O(ops x stored) per step). A stage
    # whose output is a view of its parameter makes the parameters' exclusion
    # and its change under weight moves count.
    from rtmem.torch import _bookkeeping as ex_module
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _ExpandBias(), nn.Linear(4, 2))
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    sched = _sched(text, 3)
    m, ex, loss, ref, ref_loss = _train(model, x, y, mse, sched)
    _assert_same(m, ex, loss, ref, ref_loss)
    recounts = []
    ex.track_memory = True
    original = ex._account

    def account():
        original()
        recounts.append(ex._recount())
    ex._account = account
    ex.step(x, y)
    assert ex.resident_bytes == recounts and len(recounts) == len(sched)
    assert max(recounts) == ex.peak_bytes > 0
    assert ex_module._CHECK_ACCOUNTING      # the suite checks every executor step too


def test_a_schedule_from_a_second_import_of_the_planners_is_explained(monkeypatch):
    # From a checkout, `import planners` gives a second copy of rtmem.planners;
    # its Schedule was refused as "must be a Schedule or a Plan, got Schedule"
    import pathlib
    import sys
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1]))
    before = set(sys.modules)
    try:
        import planners as second
        other = second.Schedule.from_text("F_all 0, L, B 0")
        assert type(other) is not Schedule
        with pytest.raises(ExecutionError, match=r"got planners\.schedule\.Schedule, a "
                           r"different class from rtmem\.planners\.schedule\.Schedule .*"
                           r"import them from rtmem\.planners"):
            ScheduleExecutor(nn.Sequential(nn.Linear(2, 2)), other, mse)
        with pytest.raises(TypeError, match="second import of the planners"):
            simulate(second.Chain.homogeneous(1), Schedule.from_text("F_all 0, L, B 0"),
                     Platform(math.inf))
    finally:
        for name in set(sys.modules) - before:
            del sys.modules[name]


# ------------------------------------------------------ buffers reassigned in forward
class _Reassigning(nn.Module):
    """Updates its buffers by reassignment, not in place: a running mean and a
    count, and a scale it copies and then multiplies by (saved by autograd)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * y.detach().mean(0)
            self.count = self.count + 1
            self.scale = self.scale.clone()
        return y * self.scale


def _reassigning_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Reassigning(), nn.Linear(4, 1))
    return model, torch.randn(8, 4), torch.randn(8, 1)


@pytest.mark.parametrize("text", [
    # recomputed: the buffers of one forward, as in plain training
    "F_ck 0, F_ck 1, F_all 2, L, B 2, F_all 1, B 1, F_all 0, B 0",
    # abar2 saves the new scale buffer: a delete must not free the module's
    # buffer (it is model state, not an activation), nor count it
    "F_all 0, F_all 1, offload abar2, F_all 2, delete abar2, L, prefetch abar2, B 2, "
    "B 1, B 0",
    "F_ck 0, F_all 1, F_all 2, delete abar2, L, F_all 1, B 2, B 1, F_all 0, B 0",
])
def test_a_stage_reassigning_its_buffers_trains_as_plain_torch(text):
    model, x, y = _reassigning_model()
    m, ex, *rest = _train(model, x, y, mse, _sched(text, 3))
    _assert_same(m, ex, *rest)
    assert m[1].count.item() == 1 and m[1].scale.untyped_storage().nbytes() == 16
    # and twice more from there (the executor follows the buffers it now holds);
    # the loss runs after the delete: the module's buffer must still be whole
    ref, scale_bytes = rest[1], []

    def loss_fn(out, target):
        scale_bytes.append(m[1].scale.untyped_storage().nbytes())
        return mse(out, target)
    ex.loss_fn = loss_fn
    for seed in (1, 2):
        m.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = ex.step(x, y)
        ref_loss = mse(ref(x), y)
        ref_loss.backward()
        _assert_same(m, ex, loss, ref, ref_loss.detach())
    assert scale_bytes == [16, 16]


class _ReadsWhatItUpdates(nn.Module):
    """A stage whose output depends on buffers its forward then updates: a gain
    changed in place (as spectral norm's power-iteration vectors are) and a
    step count reassigned."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("gain", torch.rand(4) + 0.5)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        y = self.lin(x) * (self.gain + self.steps)
        with torch.no_grad():
            self.gain.mul_(1.5)
        self.steps = self.steps + 1
        return torch.tanh(y)


def _spectral_norm_model():
    torch.manual_seed(0)
    # the power iteration updates weight_u and weight_v in place at every
    # training forward, and the normalised weight depends on them
    return nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 4)), nn.Tanh(),
                         nn.Linear(4, 1)).double()


@pytest.mark.parametrize("model_fn", ["updating", "spectral_norm"])
@pytest.mark.parametrize("text", [
    "F_ck 0, F_ck 1, F_all 2, L, B 2, F_all 1, B 1, F_all 0, B 0",
    # stage 0 runs three times, from a0 kept by F_ck 0
    "F_ck 0, F_none 1, F_all 2, L, B 2, F_ck 0, F_all 1, B 1, F_all 0, B 0",
    "F_all 0, F_all 1, delete abar1, F_all 2, L, B 2, F_all 0, B 1, B 0",
])
def test_a_recomputation_reads_the_buffers_the_first_forward_read(model_fn, text):
    # A recomputation started from the buffers as the first forward left them:
    # the stage computed another output, and its gradients differed from plain
    # PyTorch's (twice the lin gradient of _ReadsWhatItUpdates; 3e-2 off for
    # spectral norm), silently (NOTE [ Executor ] rule 6)
    if model_fn == "updating":
        torch.manual_seed(0)
        model = nn.Sequential(_ReadsWhatItUpdates(), _ReadsWhatItUpdates(),
                              nn.Linear(4, 1)).double()
    else:
        model = _spectral_norm_model()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    m, ex, *rest = _train(model, x, y, mse, _sched(text, 3))
    _assert_same(m, ex, *rest)
    ref = rest[1]
    for seed in (1, 2):   # from the buffers the step left, as plain training goes on
        torch.manual_seed(seed)
        loss = ex.step(x, y)
        ref_loss = mse(ref(x), y)
        ref_loss.backward()
        _assert_same(m, ex, loss, ref, ref_loss.detach())


class _UpdatesAnOddShapedBuffer(nn.Module):
    """A stage updating a buffer of a shape nothing else in the test has."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("odd", torch.rand(3, 17) + 0.5)

    def forward(self, x):
        y = self.lin(x) * self.odd.mean()
        with torch.no_grad():
            self.odd.mul_(1.5)
        return torch.tanh(y)


def test_the_first_forwards_buffer_copies_are_freed_with_the_step():
    # The copies a recomputed stage's first forward keeps (rule 6) were held until
    # the next step began, through the caller's optimizer.step(): memory no plan
    # counts, kept longer than the step that needs it
    import gc
    torch.manual_seed(0)
    model = nn.Sequential(_UpdatesAnOddShapedBuffer(), _UpdatesAnOddShapedBuffer(),
                          nn.Linear(4, 1)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    m, ex, *rest = _train(model, x, y, mse, _sched(
        "F_ck 0, F_ck 1, F_all 2, L, B 2, F_all 1, B 1, F_all 0, B 0", 3))
    _assert_same(m, ex, *rest)
    gc.collect()
    mine = {id(b) for net in (model, m, rest[1]) for b in net.buffers()}
    # type(), not isinstance: that reads __class__ of lazy module proxies, which warn
    copies = [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor)
              and t.shape == (3, 17) and id(t) not in mine]
    assert copies == [], f"{len(copies)} buffer copies outlived the step"


class _EmaAndConstant(nn.Module):
    """A stage with an EMA buffer its forward updates (kept for the step) and a
    constant buffer it only reads (copied, then forgotten), of given sizes."""

    def __init__(self, ema: int, const: int):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.rand(ema) + 0.5)
        self.register_buffer("const", torch.rand(const))

    def forward(self, x):
        y = torch.tanh(self.lin(x) * self.ema.mean() + self.const.sum())
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * y.mean())
        return y


def test_the_buffer_copies_outside_the_plan_are_reported_in_bytes():
    # The copies rule 6 makes for recomputed stages are memory no plan and not
    # peak_bytes count; the docs told users to leave room for them without a
    # figure. buffer_copy_bytes is the most held at once: with both stages
    # recomputed after their first forwards, both EMAs kept plus one stage's
    # buffers copied again (the docs' bound sum(C) + max(B), reached here)
    rng = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    sizes = [[int(v) for v in torch.randint(1, 200, (2,), generator=rng)] for _ in range(2)]
    model = nn.Sequential(*(_EmaAndConstant(e, c) for e, c in sizes), nn.Linear(4, 1)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    text = "F_ck 0, F_ck 1, F_all 2, L, B 2, F_all 1, B 1, F_all 0, B 0"
    m, ex, *rest = _train(model, x, y, mse, _sched(text, 3))
    _assert_same(m, ex, *rest)
    kept = [8 * e for e, _ in sizes]                  # float64 EMAs, bytes
    whole = [8 * (e + c) for e, c in sizes]
    assert ex.buffer_copy_bytes == sum(kept) + max(whole), sizes
    plain = ScheduleExecutor(copy.deepcopy(model), store_all_schedule(3), mse)
    plain.step(x, y)
    assert plain.buffer_copy_bytes == 0               # nothing recomputed, nothing copied
    off = ScheduleExecutor(copy.deepcopy(model), _sched(text, 3), mse, track_memory=False)
    off.step(x, y)
    assert off.buffer_copy_bytes is None


class _UpdatesThroughData(nn.Module):
    """A stage whose output reads a buffer its forward then changes through
    ``.data``, which moves no version counter: an EMA written as
    ``self.buf.data.mul_(...)``, or ``self.buf.data = new``."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 4)
        self.register_buffer("gain", torch.rand(4) + 0.5)

    def forward(self, x):
        y = self.lin(x) * self.gain
        if self.how == "assign":
            self.gain.data = self.gain * 1.5
        else:
            self.gain.data.mul_(1.5)
        return torch.tanh(y)


@pytest.mark.parametrize("how", ["assign", "in place"])
@pytest.mark.parametrize("text", [
    "F_ck 0, F_ck 1, F_all 2, L, B 2, F_all 1, B 1, F_all 0, B 0",
    "F_all 0, F_all 1, delete abar1, F_all 2, L, B 2, F_all 0, B 1, B 0",
])
def test_a_recomputation_reads_buffers_the_first_forward_changed_through_data(how, text):
    # .data moves no version counter: the first forward's change went unseen, the
    # recomputation read the updated gain, and the gradients were 0.27 off plain
    # PyTorch's, silently. Later steps keep the slot without comparing values
    torch.manual_seed(0)
    model = nn.Sequential(_UpdatesThroughData(how), _UpdatesThroughData(how),
                          nn.Linear(4, 1)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    m, ex, *rest = _train(model, x, y, mse, _sched(text, 3))
    _assert_same(m, ex, *rest)
    ref = rest[1]
    for seed in (1, 2):
        x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
        torch.manual_seed(seed)
        loss = ex.step(x, y)
        ref_loss = mse(ref(x), y)
        ref_loss.backward()
        _assert_same(m, ex, loss, ref, ref_loss.detach())


def test_profiling_leaves_reassigned_buffers_and_outside_gradients_as_they_were():
    model, x, y = _reassigning_model()
    head = nn.Linear(1, 1)                  # a parameter the loss closes over
    loss_module = nn.BatchNorm1d(1)         # a loss that is a module with buffers

    def loss_fn(out, target):
        return mse(head(loss_module(out)), target)
    loss_fn(model(x), y).backward()         # gradients already accumulated
    held = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    values = {k: v.clone() for k, v in held.items()}
    grad = head.weight.grad
    grad_value = grad.clone()
    stats = loss_module.running_mean.clone()

    class Loss(nn.Module):                  # the module form of the same loss
        def __init__(self):
            super().__init__()
            self.bn = loss_module

        def forward(self, out, target):
            return loss_fn(out, target)
    for fn in (loss_fn, Loss()):
        profile_sequential(model, x, y, fn, repeats=2)
        for k, v in model.state_dict(keep_vars=True).items():
            assert v is held[k] and torch.equal(v, values[k]), k
        assert head.weight.grad is grad and torch.equal(grad, grad_value)
    # the closure form cannot reach the loss module's statistics; the module form does
    assert not torch.equal(loss_module.running_mean, stats)
    loss_module.running_mean.copy_(stats)
    profile_sequential(model, x, y, Loss(), repeats=2)
    assert torch.equal(loss_module.running_mean, stats)


# --------------------------------------------------------------- frozen prefix
def _frozen_prefix_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(_Recorder(), nn.Linear(8, 8)), nn.Tanh(),
                          nn.Sequential(_Recorder(), nn.Linear(8, 8)), nn.ReLU(inplace=True),
                          nn.Linear(8, 1))
    for stage in model[:3]:
        stage.requires_grad_(False)   # fine-tuning the last layers only
    return model


@pytest.mark.parametrize("text", [
    None,                                                        # store all
    "F_ck 0, F_ck 1, F_all 2, F_all 3, F_all 4, L, B 4, B 3, B 2, F_all 1, B 1, "
    "F_all 0, B 0",
    "F_all 0, F_all 1, offload abar2, F_all 2, delete abar2, F_all 3, F_all 4, L, B 4, "
    "B 3, prefetch abar2, B 2, B 1, B 0",
])
def test_a_frozen_prefix_gets_no_input_gradients_as_in_plain_autograd(text):
    # Plain autograd records nothing for the stages before the first trainable
    # parameter and runs no backward through them; the executor made each
    # stage's input (but the batch's) a leaf requiring grad, so B 2, B 1 and B 0
    # ran backward-data passes whose gradients nothing reads (and the profiler
    # timed them into u_b).
    model, y = _frozen_prefix_model(), torch.randn(4, 1)
    x = torch.randn(4, 8)
    sched = store_all_schedule(5) if text is None else _sched(text, 5)
    _RecordNeeds.calls.clear()
    _assert_same(*_train(model, x, y, mse, sched))
    assert _RecordNeeds.calls == []
    chain = profile_sequential(model, x, y, mse, repeats=1)
    assert chain.no_recompute.tolist() == [False, False, False, True, False]
    assert (chain.u_b[:4] == 0).all() and chain.u_b[4] > 0   # ReLU: on a frozen a3
    assert _RecordNeeds.calls == []
    # unfrozen between steps: the next step computes the input gradients again
    m, ex, *_ = _train(model, x, y, mse, sched)
    m[0].requires_grad_(True)
    ref = copy.deepcopy(m)
    m.zero_grad(set_to_none=True)
    ex.step(x, y)
    mse(ref(x), y).backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert _RecordNeeds.calls == [True, True]   # stage 2's Recorder, in both runs


class _Prompt(nn.Module):
    """A frozen linear layer and a learnable offset that is no nn.Parameter (prompt
    or bias tuning)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8).requires_grad_(False)
        self.offset = torch.zeros(8, requires_grad=True)

    def forward(self, x):
        return self.lin(x) + self.offset


@pytest.mark.parametrize("head_frozen", [False, True])
@pytest.mark.parametrize("text", [
    None,                                                        # store all
    "F_ck 0, F_none 1, F_all 2, L, B 2, F_ck 0, F_all 1, B 1, F_all 0, B 0",
])
def test_a_tensor_attribute_that_requires_grad_trains_as_in_plain_autograd(text, head_frozen):
    # The stage before the first trainable parameter counted as a frozen prefix:
    # stage 1 got its input detached and offset no gradient; with every parameter
    # frozen the step was refused ("no parameter of the model requires grad")
    torch.manual_seed(0)
    model = nn.Sequential(_Prompt(), nn.Tanh(), nn.Linear(8, 1).requires_grad_(not head_frozen))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    sched = store_all_schedule(3) if text is None else _sched(text, 3)
    ref, m = copy.deepcopy(model), copy.deepcopy(model)
    mse(ref(x), y).backward()
    ex = ScheduleExecutor(m, sched, mse)
    ex.step(x, y)
    torch.testing.assert_close(m[0].offset.grad, ref[0].offset.grad, rtol=0, atol=0)
    _assert_same(m, ex, mse(m(x), y).detach(), ref, mse(ref(x), y).detach())
    # frozen between steps, then unfrozen: decided at every step
    m[0].offset.grad = None
    m[0].offset.requires_grad_(False)
    if head_frozen:
        with pytest.raises(ExecutionError, match="nothing in this step needs a gradient"):
            ex.step(x, y)
    else:
        ex.step(x, y)
        assert m[0].offset.grad is None
    m[0].offset.requires_grad_(True)
    ex.step(x, y)
    torch.testing.assert_close(m[0].offset.grad, ref[0].offset.grad, rtol=0, atol=0)
    chain = profile_sequential(m, x, y, mse, repeats=1)
    assert (chain.u_b > 0).all()


def test_a_tensor_that_requires_grad_out_of_the_executors_sight_is_refused():
    # read from a closure: the executor cannot know that stage 0 trains, and
    # handed stage 1 a detached input; now the step is refused, not trained wrong
    offset = torch.zeros(8, requires_grad=True)

    class Closure(nn.Module):
        def forward(self, x):
            return x + offset
    torch.manual_seed(0)
    model = nn.Sequential(Closure(), nn.Linear(8, 8), nn.Linear(8, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    for text in (None, "F_ck 0, F_all 1, F_all 2, L, B 2, B 1, F_all 0, B 0"):
        sched = store_all_schedule(3) if text is None else _sched(text, 3)
        with pytest.raises(ExecutionError, match="stage 0 .*cannot see it"):
            ScheduleExecutor(model, sched, mse).step(x, y)
        assert offset.grad is None
    with pytest.raises(ExecutionError, match="stage 0 .*cannot see it"):
        profile_sequential(model, x, y, mse, repeats=1)
    mse(model(x), y).backward()
    expected, offset.grad = offset.grad, None
    model.zero_grad(set_to_none=True)
    model[0].offset = offset   # also an attribute: seen, and trained
    ScheduleExecutor(model, store_all_schedule(3), mse).step(x, y)
    torch.testing.assert_close(offset.grad, expected, rtol=0, atol=0)


class _PinnFeatures(nn.Module):
    # parameter-free, differentiates with respect to its own input
    def forward(self, x):
        x = x if x.requires_grad else x.requires_grad_(True)
        u = torch.sin(3 * x) * x
        du, = torch.autograd.grad(u.sum(), x, create_graph=True)
        return torch.cat([u, du], -1)


def _input_require_grads_embedding():
    # Hugging Face's enable_input_require_grads(): a hook on the frozen embedding
    # makes its output a leaf that requires grad
    emb = nn.Embedding(16, 8).requires_grad_(False)
    emb.register_forward_hook(lambda m, inp, out: out.requires_grad_(True))
    return emb


@pytest.mark.parametrize("case", ["input_require_grads", "own_input_graph"])
def test_a_frozen_prefix_output_that_requires_grad_but_loses_nothing_trains(case):
    # The check for a tensor that requires grad read from out of the executor's
    # sight refused every frozen-prefix output that requires grad, also these,
    # where no leaf other than the stage's input lies behind it (both trained
    # before the check came)
    torch.manual_seed(0)
    if case == "input_require_grads":
        model = nn.Sequential(_input_require_grads_embedding(),
                              nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1))
        x, y = torch.randint(16, (4, 5)), torch.randn(4, 5, 1)
    else:
        model = nn.Sequential(_PinnFeatures(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        x, y = torch.randn(16, 2), torch.randn(16, 1)
    n = len(model)
    ref = copy.deepcopy(model)
    mse(ref(x.clone()), y).backward()
    # (autograd.grad cannot run in F_ck 0's no_grad forward: store-all alone there)
    recompute = ("F_ck 0, " + ", ".join(f"F_all {i}" for i in range(1, n)) + ", L, "
                 + ", ".join(f"B {i}" for i in range(n - 1, 0, -1)) + ", F_all 0, B 0")
    for text in (None, recompute) if case == "input_require_grads" else (None,):
        m = copy.deepcopy(model)
        sched = store_all_schedule(n) if text is None else _sched(text, n)
        ScheduleExecutor(m, sched, mse).step(x.clone(), y)
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    profile_sequential(model, x.clone(), y, mse, repeats=1)


def test_a_buffer_that_requires_grad_trains_as_in_plain_autograd():
    # counted with the parameters and tensor attributes: a stage holding one was
    # a frozen prefix, and its output requiring grad was refused as if read from
    # a global
    class Shift(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8).requires_grad_(False)
            self.register_buffer("shift", torch.randn(8, requires_grad=True))

        def forward(self, x):
            return self.lin(x) + self.shift
    torch.manual_seed(0)
    model = nn.Sequential(Shift(), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    ref = copy.deepcopy(model)
    mse(ref(x), y).backward()
    for text in (None, "F_ck 0, F_all 1, F_all 2, L, B 2, B 1, F_all 0, B 0"):
        m = copy.deepcopy(model)
        sched = store_all_schedule(3) if text is None else _sched(text, 3)
        ScheduleExecutor(m, sched, mse).step(x, y)
        torch.testing.assert_close(m[0].shift.grad, ref[0].shift.grad, rtol=0, atol=0)
    chain = profile_sequential(model, x, y, mse, repeats=1)
    assert (chain.u_b > 0).all()


def _channels_last_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1),
                          nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.BatchNorm2d(4)),
                          nn.Sequential(nn.Flatten(), nn.Linear(4 * 6 * 6, 1)))
    return model.to(memory_format=torch.channels_last)


@pytest.mark.parametrize("text", [
    None,                                                        # store all
    "F_ck 0, F_all 1, F_all 2, L, B 2, B 1, F_all 0, B 0",
])
def test_the_previous_stage_gets_its_gradient_in_the_layout_plain_autograd_gives(text):
    # delta_2 was the leaf's .grad, which AccumulateGrad lays out like the leaf
    # (channels_last), where plain autograd hands batch norm's backward the
    # contiguous gradient of Flatten: stages 1 and 0 computed on another layout,
    # their gradients a few ulp apart (bf16: 1.5e-2)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    y = torch.randn(2, 1)
    sched = store_all_schedule(3) if text is None else _sched(text, 3)
    m, ex, loss, ref, ref_loss = _train(_channels_last_model(), x, y, mse, sched)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


class _CatParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(8, 100))

    def forward(self, x):
        return torch.cat([x, self.p], 1)


def test_a_gradient_that_views_a_larger_one_is_held_in_its_own_bytes():
    # delta_1 is a view of cat's (8, 200) gradient: held as it is (the layout
    # fix above), it kept all of that storage alive, twice the x_1 bytes the
    # plan counts for it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 100), _CatParameter(), nn.Linear(200, 1))
    x, y = torch.randn(8, 10), torch.randn(8, 1)
    m, ex, loss, ref, ref_loss = _train(model, x, y, mse, store_all_schedule(3))
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    assert ex.schedule.op_text(5) == "B 1"
    assert ex.resident_bytes[5] == ex.resident_bytes[0] + 8 * 100 * 4   # abar1, delta_1


class _Transpose(nn.Module):
    def forward(self, x):
        return x.t()


def test_a_compacted_gradient_keeps_the_dimension_order_plain_autograd_gives():
    # a_1 is transposed (column-major); cat's gradient of it is a row-major view.
    # Compacted in the leaf's (column-major) order, stage 0's backward ran on
    # another layout than in plain autograd: its bias gradient 1.5e-8 apart
    torch.manual_seed(0)
    d, b = 96, 77
    cat = _CatParameter()
    cat.p = nn.Parameter(torch.randn(b, 33))
    model = nn.Sequential(nn.Sequential(nn.Linear(d, b), _Transpose()), cat, nn.Linear(d + 33, 1))
    x, y = torch.randn(d, d), torch.randn(b, 1)
    m, ex, loss, ref, ref_loss = _train(model, x, y, mse, store_all_schedule(3))
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def _autocast_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Sequential(nn.Linear(32, 32), nn.GELU()),
                         nn.Linear(32, 4))


@pytest.mark.parametrize("text", [
    # abar2 holds linear's saved bf16 cast of stage 1's weight: its delete freed
    # autocast's cached copy, which the recomputation F_ck 1 then read as 0 bytes
    "F_ck 0, F_all 1, offload abar2, delete abar2, F_ck 1, F_all 2, L, B 2, "
    "prefetch abar2, B 1, F_all 0, B 0",
    "F_ck 0, F_none 1, F_all 2, L, B 2, F_ck 0, F_all 1, B 1, F_all 0, B 0",
    "F_all 0, F_all 1, offload abar1, delete abar1, F_all 2, L, B 2, prefetch abar1, "
    "B 1, B 0"])
@pytest.mark.parametrize("uncached", [False, True], ids=["as-torch", "uncached-no-grad"])
def test_autocast_casts_of_weights_are_model_state_not_activations(text, uncached,
                                                                   monkeypatch):
    # two micro-batches in one autocast region: autocast hands its cached cast of
    # each weight to every forward in the region, recomputations included.
    # uncached: the no_grad forwards run with the cache off, as on torch < 2.11
    # (where the F_ck/F_none schedules lost stages 0 and 1's gradients without it)
    if uncached:
        monkeypatch.setattr(_saved, "_NO_GRAD_CASTS_CACHED", True)
    sched = _sched(text, 3)
    ref, m = _autocast_model(), _autocast_model()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(4, (8,), generator=g))
               for _ in range(2)]
    loss_fn = nn.functional.cross_entropy
    ex = ScheduleExecutor(m, sched, loss_fn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for x, y in batches:
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
            loss = ex.step(x, y)
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=0)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


class _Attention(nn.Module):
    """Self-attention through scaled_dot_product_attention, whose backward
    autocast casts (on the cpu) when it runs inside the region."""

    def __init__(self, d: int):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return nn.functional.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("text", [
    "F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0",
    "F_ck 0, F_none 1, F_all 2, L, B 2, F_ck 0, F_all 1, B 1, F_all 0, B 0"])
def test_under_autocast_the_backward_runs_outside_it_as_torch_recommends(text):
    # torch's recipe: the forward and loss in the autocast region, loss.backward()
    # after it. step() is called in the region and ran its backward there, whose
    # gradients are those of a backward inside the region (up to 1.2e-4 apart here)
    torch.manual_seed(0)
    model = nn.Sequential(_Attention(16), nn.Sequential(nn.Linear(16, 16), nn.GELU()),
                          nn.Linear(16, 4))
    x, y = torch.randn(2, 8, 16), torch.randn(2, 8, 4)

    def loss_fn(out, target):
        return nn.functional.mse_loss(out.float(), target)

    outside, inside, m = (copy.deepcopy(model) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = loss_fn(outside(x), y)
    ref_loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fn(inside(x), y).backward()
    # the model tells the two apart
    assert any(not torch.equal(p.grad, q.grad)
               for p, q in zip(outside.parameters(), inside.parameters()))
    ex = ScheduleExecutor(m, _sched(text, 3), loss_fn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ex.step(x, y)
        # and the region goes on as it was
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=0)
    for (name, p), q in zip(m.named_parameters(), outside.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_autocast_is_back_on_after_a_backward_that_fails():
    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            assert not torch.is_autocast_enabled("cpu")     # outside the region
            raise RuntimeError("backward failed")

    class Stage(nn.Module):
        def forward(self, x):
            return Fails.apply(x)

    model = nn.Sequential(nn.Linear(4, 4), Stage(), nn.Linear(4, 1))
    ex = ScheduleExecutor(model, store_all_schedule(3), mse)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="backward failed"):
            ex.step(torch.randn(2, 4), torch.randn(2, 1))
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_the_profiler_leaves_autocast_casts_of_weights_out_of_xbar_as_the_executor_does():
    # the executor keeps autocast's cached bf16 casts of the weights as model
    # state, not in abar; the profiler counted them in xbar (stage 1's 2048-byte
    # cast of its 32x32 weight, stage 2's of its 4x32 one)
    model = _autocast_model()
    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    loss_fn = nn.functional.cross_entropy
    ex = ScheduleExecutor(model, _sched("F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0", 3),
                          loss_fn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chain = profile_sequential(model, x, y, loss_fn, repeats=2)
        ex.step(x, y)
    r = ex.resident_bytes
    assert [r[0] - chain.x0, r[1] - r[0], r[2] - r[1]] == list(chain.xbar)
    # autocast's cache off: the casts are activations of abar, for both
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        uncached = profile_sequential(model, x, y, loss_fn, repeats=2)
        ex.step(x, y)
    r = ex.resident_bytes
    assert [r[0] - chain.x0, r[1] - r[0], r[2] - r[1]] == list(uncached.xbar)
    assert (uncached.xbar[1:] > chain.xbar[1:]).all()


class _LeafMatmul(nn.Module):
    """``x @ w`` with ``w`` a learnable tensor attribute or a buffer that requires
    grad: a leaf autocast casts and caches as it does a parameter."""

    def __init__(self, kind):
        super().__init__()
        w = (torch.randn(32, 32) * 0.2).requires_grad_(True)
        if kind == "buffer":
            self.register_buffer("w", w)
        else:
            self.w = w

    def forward(self, x):
        return x @ self.w


@pytest.mark.parametrize("kind", ["attribute", "buffer"])
def test_autocast_casts_of_learnable_tensors_are_model_state_as_weights_are(kind):
    # Only the casts of parameters (and buffers, in the executor) counted as model
    # state: a tensor attribute's was an activation of abar2, whose delete freed
    # autocast's cached copy ("data is not allocated yet" at F_ck 1), and the
    # profiler put a buffer's in xbar where the executor did not
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), _LeafMatmul(kind), nn.Linear(32, 4))
    loss_fn = nn.functional.cross_entropy
    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    ref, m = model(), model()
    sched = _sched("F_ck 0, F_all 1, offload abar2, delete abar2, F_ck 1, F_all 2, L, B 2, "
                   "prefetch abar2, B 1, F_all 0, B 0", 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        loss = ScheduleExecutor(m, sched, loss_fn).step(x, y)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=0)
    torch.testing.assert_close(m[1].w.grad, ref[1].w.grad, rtol=0, atol=0)
    m = model()
    ex = ScheduleExecutor(m, _sched("F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0", 3), loss_fn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chain = profile_sequential(m, x, y, loss_fn, repeats=1)
        ex.step(x, y)
    r = ex.resident_bytes
    assert [r[0] - chain.x0, r[1] - r[0], r[2] - r[1]] == list(chain.xbar)


class _OwnAutocast(nn.Module):
    """A stage that enters bfloat16 autocast itself."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return nn.functional.gelu(self.lin(x)).float()


@pytest.mark.parametrize("outer", ["disabled", "none"])
def test_a_stage_s_own_autocast_casts_inside_a_disabled_region_are_model_state(outer):
    # The caller's torch.autocast(enabled=False) keeps autocast's cache until it
    # exits, so the stage's own bf16 cast of its weight is cached for the whole
    # step; the executor asked the caller's (disabled) autocast whether casts are
    # cached, took it for an activation of abar2, and its delete freed the
    # cache's copy: the recomputation F_ck 1 failed with "setStorage ... out of
    # bounds for storage of size 0". Without a caller's region the stage's exit
    # clears the cache: the cast is an activation, and the profiler agrees
    def region():
        return torch.autocast("cpu", enabled=False) if outer == "disabled" else \
            contextlib.nullcontext()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), _OwnAutocast(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    loss_fn = nn.functional.cross_entropy
    ref, m = copy.deepcopy(model), copy.deepcopy(model)
    sched = _sched("F_ck 0, F_all 1, offload abar2, delete abar2, F_ck 1, F_all 2, L, B 2, "
                   "prefetch abar2, B 1, F_all 0, B 0", 3)
    with region():
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        loss = ScheduleExecutor(m, sched, loss_fn).step(x, y)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=0)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    ex = ScheduleExecutor(model, _sched("F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0", 3),
                          loss_fn)
    with region():
        chain = profile_sequential(model, x, y, loss_fn, repeats=1)
        ex.step(x, y)
    r = ex.resident_bytes
    assert [r[0] - chain.x0, r[1] - r[0], r[2] - r[1]] == list(chain.xbar)
    # the 2048-byte bf16 cast of the 32x32 weight is in abar2 only without a region
    assert chain.xbar[1] == (4096 if outer == "none" else 2048)


class _HalfMul(nn.Module):
    """A cast the stage makes itself to another dtype than autocast's (float16
    under bfloat16 autocast): ``mul`` is on no autocast list and saves it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 32))

    def forward(self, x):
        return (x.to(torch.float16) * self.w.to(torch.float16)).float()


def test_a_cast_autocast_does_not_make_is_an_activation():
    # a float32 leaf's cast to float16 under bfloat16 autocast is never in
    # autocast's cache: the profiler left it out of xbar as if it were (with the
    # cache on; in with the cache off), and the executor kept it from moves
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), _HalfMul(), nn.Linear(32, 4))
    x, y = torch.randn(32, 32), torch.randint(4, (32,))
    loss_fn = nn.functional.cross_entropy
    xbars = []
    for cache in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            xbars.append(list(profile_sequential(model, x, y, loss_fn, repeats=1).xbar))
    # stage 1 the same either way (stage 2's cached bf16 weight is out with the cache)
    assert xbars[0][1] == xbars[1][1] >= 2 * 32 * 32 * 2   # x and w in float16, saved
    assert xbars[0][2] < xbars[1][2]


def test_the_autocast_workaround_is_on_wherever_torch_loses_the_gradient():
    w = torch.ones(1, 1, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            torch.mm(w, w)              # cached here by torch < 2.11, with no history
        lost = torch.mm(w, w).grad_fn is None
    assert _saved._NO_GRAD_CASTS_CACHED or not lost, torch.__version__


def test_the_autocast_cache_comes_back_after_a_failed_no_grad_forward(monkeypatch):
    monkeypatch.setattr(_saved, "_NO_GRAD_CASTS_CACHED", True)

    class Fails(nn.Module):
        def forward(self, x):
            assert not torch.is_autocast_cache_enabled()
            raise ValueError("stage failed")
    model = nn.Sequential(nn.Linear(4, 4), Fails(), nn.Linear(4, 2))
    ex = ScheduleExecutor(model, _sched("F_ck 0, F_none 1, F_all 2, L, B 2, F_all 0, "
                                        "F_all 1, B 1, B 0", 3), mse)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="stage failed"):
            ex.step(torch.randn(3, 4), torch.randn(3, 2))
        assert torch.is_autocast_cache_enabled()
    assert torch.is_autocast_cache_enabled()


class _GradientPenalty(nn.Module):
    """``tanh(lin(x))`` plus a penalty on its gradient with respect to its input,
    computed in the forward with ``torch.autograd.grad``; under its own
    ``torch.enable_grad()`` when ``own_grad_mode``."""

    def __init__(self, own_grad_mode):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.own_grad_mode = own_grad_mode

    def forward(self, x):
        with torch.enable_grad() if self.own_grad_mode else contextlib.nullcontext():
            if not x.requires_grad:
                x = x.detach().requires_grad_()
            y = torch.tanh(self.lin(x))
            g, = torch.autograd.grad(y.sum(), x, create_graph=True)
            return y + 0.1 * g.pow(2).mean()


@pytest.mark.parametrize("text", [
    "F_ck 0, F_ck 1, F_all 2, L, B 2, F_all 1, B 1, F_all 0, B 0",
    "F_ck 0, F_none 1, F_all 2, L, B 2, F_all 0, F_all 1, B 1, B 0"])
def test_a_stage_differentiating_in_its_forward_without_grad_is_refused_by_name(text):
    # F_ck / F_none run stages under no_grad, where torch.autograd.grad in a
    # stage's forward raised torch's "element 0 of tensors does not require grad
    # and does not have a grad_fn", naming neither the stage nor the cause. A
    # stage enabling grad itself trains as plain PyTorch does
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    sched = _sched(text, 3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _GradientPenalty(False), nn.Linear(16, 4))
    with pytest.raises(ExecutionError, match=r"stage 1 \(_GradientPenalty\) failed in "
                       r"operation 1 of the schedule \(F_(ck|none) 1\).*differentiates "
                       r"inside its forward.*torch.enable_grad"):
        ScheduleExecutor(model, sched, mse).step(x, y)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _GradientPenalty(True), nn.Linear(16, 4))
    m, ex, loss, ref, ref_loss = _train(model, x, y, mse, sched)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    # and the plain a2 it stores is plain: it kept the stage's graph (with every
    # tensor the graph saved, counted nowhere) until it was consumed
    histories = []
    m[2].register_forward_pre_hook(lambda mod, args: histories.append(ex._plain[2].out.grad_fn))
    ex.step(x, y)
    assert histories == [None]


def _same_items(d: dict, e: dict) -> bool:
    return d.keys() == e.keys() and all(d[k] is e[k] for k in d)


def _weight_norm_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)), nn.Tanh(),
                         nn.Linear(8, 1))


@pytest.mark.parametrize("text", [
    "F_ck 0, F_none 1, F_all 2, L, B 2, F_ck 0, F_all 1, B 1, F_all 0, B 0",
    "F_all 0, offload abar1, F_all 1, delete abar1, F_all 2, L, B 2, prefetch abar1, B 1, "
    "B 0",
    None,
])
def test_training_inside_parametrize_cached_gives_the_parametrization_its_gradient(text):
    # the no_grad forwards (F_ck 0) filled parametrize's cache with a weight
    # without autograd history, which the later F_all 0 reused: original0 and
    # original1 got no gradient
    from torch.nn.utils import parametrize
    sched = store_all_schedule(3) if text is None else _sched(text, 3)
    ref, m = _weight_norm_model(), _weight_norm_model()
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    ex = ScheduleExecutor(m, sched, mse)
    with parametrize.cached():
        ref_loss = mse(ref(x), y)
        ref_loss.backward()
        caller = parametrize._cache
        before = dict(caller)    # ref's weight, computed once
        loss = ex.step(x, y)
        assert parametrize._cache is caller and _same_items(caller, before)
        chain = profile_sequential(m, x, y, mse, repeats=2)
        assert parametrize._cache is caller and _same_items(caller, before)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=0)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    # each repeat computes the weight (its norm is saved: 8 floats), as each F_all
    # does; the second repeat reused the first's weight, and measured no norm
    assert chain.xbar[0] == chain.x[0] + 8 * 4
    assert (chain.xbar == profile_sequential(m, x, y, mse, repeats=2).xbar).all()


def test_the_callers_parametrize_cache_comes_back_after_a_failed_stage():
    from torch.nn.utils import parametrize

    class Fails(nn.Module):
        def forward(self, x):
            assert parametrize._cache == {}
            raise ValueError("stage failed")
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)), Fails(),
                          nn.Linear(4, 2))
    ex = ScheduleExecutor(model, store_all_schedule(3), mse)
    with parametrize.cached():
        caller = parametrize._cache
        with pytest.raises(ValueError, match="stage failed"):
            ex.step(torch.randn(3, 4), torch.randn(3, 2))
        assert parametrize._cache is caller and caller == {}
    assert parametrize._cache_enabled == 0


def test_a_step_with_gradients_disabled_is_refused():
    # F_all, L and B enable gradients themselves: under no_grad a "validation"
    # step added its gradients to the next optimizer step's
    model = _autocast_model()
    ex = ScheduleExecutor(model, store_all_schedule(3), nn.functional.cross_entropy)
    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    for off in (torch.no_grad, lambda: torch.set_grad_enabled(False)):
        with off(), pytest.raises(ExecutionError, match="gradients disabled"):
            ex.step(x, y)
        assert torch.is_grad_enabled()
    assert all(p.grad is None for p in model.parameters())
    ex.step(x, y)
    assert all(p.grad is not None for p in model.parameters())


def test_g_offload_of_a_sparse_gradient_is_refused_by_name():
    # _to_host read the storage of a sparse tensor (NotImplementedError)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16, sparse=True),
                          nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4))
    sched = _sched("F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0, g_offload 0", 3)
    ex = ScheduleExecutor(model, sched, mse)
    tok, tgt = torch.randint(50, (4, 6)), torch.randn(4, 6, 4)
    with pytest.raises(ExecutionError, match="g_offload 0: parameter '0.weight'.*sparse"):
        ex.step(tok, tgt)
    assert model[0].weight.grad.layout == torch.sparse_coo     # left where it was


class _ScaledLinear(nn.Module):
    """A linear layer times a constant table held as a plain tensor attribute
    (neither a parameter nor a buffer, as rotary or mask caches often are):
    ``mul`` saves the table for the backward."""

    def __init__(self, table):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.table = table

    def forward(self, x):
        return self.lin(x) * self.table


#: Deletes abar1 (stage 0's saved tensors) and fails before its prefetch.
_FAILS_AFTER_DELETE = ("F_ck 0, F_all 0, offload abar1, delete abar1, F_all 1, L, B 1, "
                       "prefetch abar1, B 0")


def _after_a_failed_step(model, x, y):
    """A copy of ``model`` after a step of _FAILS_AFTER_DELETE whose loss raised:
    what the step deleted stays deleted (its prefetch never ran)."""
    def bad_loss(out, target):
        raise ValueError("loss failed")
    m = copy.deepcopy(model)
    with pytest.raises(ValueError, match="loss failed"):
        ScheduleExecutor(m, _sched(_FAILS_AFTER_DELETE, 2), bad_loss).step(x, y)
    return m


def test_a_constant_tensor_attribute_a_stage_saves_is_never_freed():
    # abar1 holds the table stage 0 saved; deleting abar1 freed the table's
    # storage (resize_(0)) under the module: after a failed step it stayed
    # empty, and a stage reading it meanwhile read freed memory (a segfault)
    torch.manual_seed(0)
    table = torch.randn(8) + 2
    model = nn.Sequential(_ScaledLinear(table), nn.Linear(8, 1))
    x, y = torch.randn(3, 8), torch.randn(3, 1)
    sched = _sched(_FAILS_AFTER_DELETE, 2)
    before = model[0].table.clone()
    m = _after_a_failed_step(model, x, y)
    intact = _intact(m[0].table)   # no repr of a freed tensor: it reads freed memory
    assert intact, "the step freed the table under the module"
    assert torch.equal(m[0].table, before)
    m, ex, loss, ref, ref_loss = _train(model, x, y, mse, sched)
    _assert_same(m, ex, loss, ref, ref_loss)
    # model state, not an activation: counted as the same table held as a buffer
    buffered = copy.deepcopy(model)
    del buffered[0].table
    buffered[0].register_buffer("table", table.clone())
    ex2 = ScheduleExecutor(buffered, sched, mse)
    ex2.step(x, y)
    assert ex.peak_bytes == ex2.peak_bytes


class _LazyScaled(nn.Module):
    """As _ScaledLinear, with the table made by the first forward (a lazy cache)."""

    def __init__(self):
        super().__init__()
        self.lin, self.table = nn.Linear(8, 8), None

    def forward(self, x):
        if self.table is None:
            self.table = torch.arange(8.0) / 10 + 1
        return self.lin(x) * self.table


def test_a_constant_table_made_by_the_first_forward_is_model_state():
    torch.manual_seed(0)
    model = nn.Sequential(_LazyScaled(), nn.Linear(8, 8), _LazyScaled())
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    sched = _sched("F_all 0, offload abar1, F_all 1, delete abar1, F_all 2, L, B 2, "
                   "prefetch abar1, B 1, B 0", 3)
    m, ex, loss, ref, ref_loss = _train(model, x, y, mse, sched)
    _assert_same(m, ex, loss, ref, ref_loss)
    assert _intact(m[0].table) and _intact(m[2].table)
    eager = copy.deepcopy(model)        # the tables there before the executor is built
    for i in (0, 2):
        eager[i].table = torch.arange(8.0) / 10 + 1
    ex2 = ScheduleExecutor(eager, sched, mse)
    ex2.step(x, y)
    assert ex.peak_bytes == ex2.peak_bytes     # not counted as activation bytes


class _AddsTable(nn.Module):
    """As _LazyScaled, with no ``table`` attribute at all until the first forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if not hasattr(self, "table"):
            self.table = torch.arange(8.0) / 10 + 1
        return self.lin(x) * self.table


class _SwapsAttribute(_AddsTable):
    """Trades a scalar attribute for the table at the first forward: the module
    holds as many attributes after it as before."""

    def __init__(self):
        super().__init__()
        self.spare = 1.0

    def forward(self, x):
        if "spare" in self.__dict__:
            del self.spare
        return super().forward(x)


class _ListCached(_AddsTable):
    """The table appended, at the first forward, to a list the module holds."""

    def __init__(self):
        super().__init__()
        self.cache = []

    def forward(self, x):
        if not self.cache:
            self.cache.append(torch.arange(8.0) / 10 + 1)
        return self.lin(x) * self.cache[0]


@pytest.mark.parametrize("make", [_AddsTable, _SwapsAttribute, _ListCached],
                         ids=["added", "traded-for-a-scalar", "appended-to-a-list"])
def test_a_table_a_forward_adds_is_model_state_at_once(make):
    # After a forward, the attributes are walked again only where the modules'
    # attributes may have changed (a new or removed name, a value reassigned, a
    # list or dict that may have been changed in place). Each of these makes a
    # table mid-step that abar1 saves: deleting abar1 freed it under the module
    # when the walk was skipped, and the failed step left it freed
    torch.manual_seed(0)
    model = nn.Sequential(make(), nn.Linear(8, 1))
    x, y = torch.randn(3, 8), torch.randn(3, 1)
    m = _after_a_failed_step(model, x, y)
    # no repr of a freed tensor in the report: it reads freed memory
    intact = _intact(m[0].cache[0] if make is _ListCached else m[0].table)
    assert intact, "the step freed the table under its module"
    m, ex, loss, ref, ref_loss = _train(model, x, y, mse, _sched(_FAILS_AFTER_DELETE, 2))
    _assert_same(m, ex, loss, ref, ref_loss)


class _KeepsLast(nn.Module):
    """Caches its last hidden state as an attribute, which autograd saves."""

    def __init__(self):
        super().__init__()
        self.lin, self.last = nn.Linear(8, 8), None

    def forward(self, x):
        h = self.lin(x)
        self.last = h
        return h * h


class _DictCached(nn.Module):
    """As _LazyScaled, with the table in a dict keyed by width (a rotary cache
    keyed by sequence length, holding ``(cos, sin)``)."""

    def __init__(self):
        super().__init__()
        self.lin, self.cache = nn.Linear(8, 8), {}

    def forward(self, x):
        if x.shape[-1] not in self.cache:
            self.cache[x.shape[-1]] = (torch.arange(8.0) / 10 + 1, torch.ones(8))
        cos, sin = self.cache[x.shape[-1]]
        return self.lin(x) * cos + sin


@pytest.mark.parametrize("make, held", [
    # a tensor the recomputed forward (F_all 0 after F_ck 0) leaves in .last
    (_KeepsLast, lambda mod: [mod.last]),
    # a table in a dict of tuples (scanned only for list/tuple attributes before)
    (_DictCached, lambda mod: list(mod.cache[8])),
], ids=["set-by-recomputation", "in-a-dict"])
def test_tensors_a_module_keeps_in_attributes_survive_a_failed_step(make, held):
    # abar1 saved them; deleting it freed them under the module, and the failed
    # step (no prefetch) left them so: reading one read freed memory
    torch.manual_seed(0)
    model = nn.Sequential(make(), nn.Linear(8, 1))
    x, y = torch.randn(3, 8), torch.randn(3, 1)
    m = _after_a_failed_step(model, x, y)
    assert all(_intact(t) for t in held(m[0])), "the step freed them under the module"
    m, ex, loss, ref, ref_loss = _train(model, x, y, mse, _sched(_FAILS_AFTER_DELETE, 2))
    _assert_same(m, ex, loss, ref, ref_loss)


class _SparseGraph(nn.Module):
    """Message passing over a graph held as a sparse COO attribute; only its
    (dense) indices reach autograd."""

    def __init__(self, adj):
        super().__init__()
        self.lin, self.adj = nn.Linear(8, 8), adj.coalesce()

    def forward(self, x):
        src, dst = self.adj.indices()
        h = self.lin(x)
        return h.index_add(0, dst, h[src])


def test_a_sparse_tensor_attribute_is_profiled_and_trained():
    # the scan for constant tables asked a sparse attribute for its storage
    # (NotImplementedError: "Cannot access storage of SparseTensorImpl") in the
    # profiler and in every step, where such a model ran before
    torch.manual_seed(0)
    adj = (torch.rand(5, 5) > 0.5).float().to_sparse()
    model = nn.Sequential(_SparseGraph(adj), nn.Linear(8, 1))
    x, y = torch.randn(5, 8), torch.randn(5, 1)
    chain = profile_sequential(copy.deepcopy(model), x, y, mse, repeats=1)
    assert chain.n == 2
    sched = _sched(_FAILS_AFTER_DELETE, 2)
    m, ex, loss, ref, ref_loss = _train(model, x, y, mse, sched)
    _assert_same(m, ex, loss, ref, ref_loss)
    assert _intact(m[0].adj.indices())


def test_profiling_under_inference_mode_is_refused_by_name():
    # it raised torch's "Inference tensors do not track version counter" after
    # running the first stage; step() already refused inference mode by name
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x, y = torch.randn(3, 4), torch.randint(2, (3,))
    with torch.inference_mode(), pytest.raises(ExecutionError, match="inference_mode"):
        profile_sequential(model, x, y, nn.functional.cross_entropy, repeats=1)
    # outside it, an inference tensor as the batch is fine (the profiler copies it)
    with torch.inference_mode():
        xi = torch.randn(3, 4)
    chain = profile_sequential(model, xi, y, nn.functional.cross_entropy, repeats=1)
    assert chain.n == 3 and (chain.u_b >= 0).all()


class _ToSpectrum(nn.Module):
    """A linear layer, then an FFT: a complex activation (spectral / FNO models)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.fft.fft(self.lin(x))


class _SpectralMix(nn.Module):
    """A complex weight on a complex input; ``real`` says whether it goes back to
    real values (else the last stage's output, which the loss gets, is complex)."""

    def __init__(self, real=True):
        super().__init__()
        self.w, self.real = nn.Parameter(torch.randn(8, dtype=torch.cfloat)), real

    def forward(self, z):
        out = torch.fft.ifft(z * self.w)
        return out.real if self.real else out


def _spectral_loss(out, target):
    return (out.abs() - target).square().mean() if out.is_complex() else mse(out, target)


@pytest.mark.parametrize("text", [
    "F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0",
    # recomputes stage 0 and moves the complex abar1 through the host
    "F_ck 0, F_all 1, F_all 2, L, B 2, B 1, F_all 0, offload abar1, delete abar1, "
    "prefetch abar1, B 0",
])
@pytest.mark.parametrize("real", [True, False], ids=["real-output", "complex-output"])
def test_complex_activations_carry_the_gradient_to_earlier_stages(text, real):
    # a complex a1 was handed to stage 1 as it was (only floating inputs became
    # grad-requiring leaves), so stage 0 silently got no gradient; a complex
    # output went to the loss so too; the profiler failed on the stage
    # (backward with no gradient for a non-scalar output)
    torch.manual_seed(0)
    stages = [_ToSpectrum(), _SpectralMix(real)] + ([nn.Linear(8, 1)] if real else
                                                   [nn.Identity()])
    model = nn.Sequential(*stages)
    x, y = torch.randn(4, 8), torch.randn(4, 1) if real else torch.rand(4, 8)
    m, ex, loss, ref, ref_loss = _train(model, x, y, _spectral_loss, _sched(text, 3))
    assert m[0].lin.weight.grad is not None
    _assert_same(m, ex, loss, ref, ref_loss)
    chain = profile_sequential(copy.deepcopy(model), x, y, _spectral_loss, repeats=1)
    assert chain.n == 3 and chain.xbar[0] > 0


class _OwnNoise(nn.Module):
    """A linear layer times noise drawn from a ``torch.Generator`` the module holds
    (a custom dropout or stochastic depth), as an attribute or, ``boxed``, in a
    dict attribute."""

    def __init__(self, gen, boxed=False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        if boxed:
            self.gens = {"noise": gen}
        else:
            self.gen = gen

    def forward(self, x):
        gen = self.gens["noise"] if hasattr(self, "gens") else self.gen
        return self.lin(x) * torch.rand(x.shape, generator=gen)


@pytest.mark.parametrize("segments", [2, 4])
def test_recomputing_a_stage_replays_the_draws_of_its_own_generator(segments):
    # only the default generators were replayed: a recomputation drew new noise
    # from the module's own generator (gradients of other noise than the loss
    # saw) and advanced it a second time. One generator serves stages 0 and 2,
    # so a replay must also put it back where the later stage left it
    gen = torch.Generator().manual_seed(123)
    torch.manual_seed(0)
    model = nn.Sequential(_OwnNoise(gen), nn.Tanh(), _OwnNoise(gen, boxed=True),
                          nn.Linear(8, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    ref, m = copy.deepcopy(model), copy.deepcopy(model)   # each copy shares one generator
    ex = ScheduleExecutor(m, sequential_schedule(4, segments), mse)
    for _ in range(2):   # the second step starts from where plain training left it
        ref_loss = mse(ref(x), y)
        ref_loss.backward()
        loss = ex.step(x, y)
        _assert_same(m, ex, loss, ref, ref_loss.detach())
        assert torch.equal(m[0].gen.get_state(), ref[0].gen.get_state())
    assert m[2].gens["noise"] is m[0].gen
    # profiling draws again for every repeat, and gives the generator back as it was
    before = m[0].gen.get_state()
    profile_sequential(m, x, y, mse, repeats=2)
    assert torch.equal(m[0].gen.get_state(), before)


def test_a_generator_assigned_after_the_executor_was_built_is_replayed():
    # generators are found at the start of each step (rule 6): the one the
    # module held at construction is not the one its recomputation draws from
    torch.manual_seed(0)
    model = nn.Sequential(_OwnNoise(torch.Generator().manual_seed(1)), nn.Tanh(),
                          nn.Linear(8, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    ref, m = copy.deepcopy(model), copy.deepcopy(model)
    ex = ScheduleExecutor(m, _sched("F_ck 0, F_all 1, F_all 2, L, B 2, B 1, F_all 0, B 0", 3),
                          mse)
    for module in (ref, m):
        module[0].gen = torch.Generator().manual_seed(2)
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    _assert_same(m, ex, ex.step(x, y), ref, ref_loss.detach())
    assert torch.equal(m[0].gen.get_state(), ref[0].gen.get_state())


def _clamping_hook(calls):
    """Per-parameter gradient clipping (an RL / GAN recipe): not linear, so the
    clamp of each stage's part differs from the clamp of their sum."""
    def hook(g):
        calls.append(g)
        return g.clamp(-0.05, 0.05)
    return hook


@pytest.mark.parametrize("kind", ["tensor", "post-accumulate"])
def test_gradient_hooks_on_tied_weights_are_refused(kind):
    # the executor ran the hook once per stage on that stage's part of the
    # gradient, where loss.backward() runs it once on the sum: a clamp per part
    # gave other gradients than plain training, silently
    model, x, y, loss_fn = _tied_model()
    w = model[0].weight
    calls = []

    def add_hook(p):
        if kind == "tensor":
            return p.register_hook(_clamping_hook(calls))
        return p.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad))
    what = "tensor hook" if kind == "tensor" else "post-accumulate-grad hook"
    message = rf"'0\.weight'.*shared by stages 0, 2.*1 {what}.*register_step_pre_hook"
    handle = add_hook(w)
    with pytest.raises(ExecutionError, match=message):
        ScheduleExecutor(model, store_all_schedule(3), loss_fn)
    handle.remove()
    ex = ScheduleExecutor(model, store_all_schedule(3), loss_fn)
    # one registered after the executor was built is refused before any work
    handle = add_hook(w)
    with pytest.raises(ExecutionError, match=message):
        ex.step(x, y)
    assert not calls and all(p.grad is None for p in model.parameters())
    # and the executor is usable again once it is gone
    handle.remove()
    _assert_same(*_train(model, x, y, loss_fn, store_all_schedule(3)))
    # a hook on a weight only one stage uses runs once per step, as in plain torch
    ref, m = copy.deepcopy(model), copy.deepcopy(model)   # (hooks are not copied)
    for net in (ref, m):
        net[1][0].weight.register_hook(_clamping_hook(calls))
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    ex = ScheduleExecutor(m, store_all_schedule(3), loss_fn)
    _assert_same(m, ex, ex.step(x, y), ref, ref_loss.detach())
    assert len(calls) == 2


@pytest.mark.parametrize("text", [
    "F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0",
    "F_ck 0, F_all 1, F_all 2, L, B 2, B 1, F_all 0, B 0",
])
def test_offloaded_adam_trains_tied_weights_under_the_executor(text, monkeypatch):
    # OffloadedAdam's gradient flush is a post-accumulate-grad hook: it adds up
    # the per-stage parts it is handed, so the refusal above must let it pass
    from rtmem.torch import OffloadedAdam
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    model, x, y, loss_fn = _tied_model()
    ref, m = copy.deepcopy(model), copy.deepcopy(model)
    opts = [OffloadedAdam(net.parameters(), lr=1e-2) for net in (ref, m)]
    ex = ScheduleExecutor(m, _sched(text, 3), loss_fn)
    g = torch.Generator().manual_seed(3)
    try:
        for _ in range(3):
            x, y = torch.randint(16, (2, 5), generator=g), torch.randint(16, (2, 5), generator=g)
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
            loss = ex.step(x, y)
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
            assert m[0].weight.grad is None     # flushed to the host in backward
            for opt in opts:
                opt.step()
                opt.zero_grad()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    finally:
        for opt in opts:
            opt.close()


class _Cut(nn.Module):
    """A linear layer whose output, as ``cut`` says, keeps its autograd history
    (None), is detached ("detach"), is computed under no_grad ("no_grad") or
    is an integer argmax ("argmax")."""

    def __init__(self):
        super().__init__()
        self.lin, self.cut = nn.Linear(8, 4), None

    def forward(self, x):
        if self.cut == "no_grad":
            with torch.no_grad():
                return self.lin(x)
        y = self.lin(x)
        return {None: y, "detach": y.detach(), "argmax": y.argmax(-1, keepdim=True)}[self.cut]


def _float_mse(out, target):
    return (out.float() - target).square().mean()


#: Moves abar1 through the host arena before B 2 finds that nothing trains.
_OFFLOADS_FIRST = ("F_ck 0, F_all 0, offload abar1, delete abar1, F_all 1, F_all 2, L, B 2, "
                   "B 1, prefetch abar1, B 0")


@pytest.mark.parametrize("case, message", [
    ("frozen", r"all frozen.*model\.requires_grad_\(True\)"),
    ("detach", r"cut it.*last stage \(_Cut\)"),
    ("argmax", r"cut it.*last stage \(_Cut\)"),
    ("loss", r"loss_fn\(output, target\) returned a loss that does not require grad"),
])
def test_a_step_where_nothing_needs_a_gradient_is_refused(case, message, arena):
    # plain loss.backward() raises there ("element 0 of tensors does not require
    # grad"); the executor returned a loss and trained nothing, silently
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), _Cut())
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    loss_fn = _float_mse
    if case == "frozen":
        model.requires_grad_(False)
    elif case == "loss":
        def loss_fn(out, target):
            return _float_mse(out, target).detach()
    else:
        model[2].cut = case
    with pytest.raises(RuntimeError, match="does not require grad"):
        loss_fn(copy.deepcopy(model)(x), y).backward()     # as plain torch does
    m = copy.deepcopy(model)
    ex = ScheduleExecutor(m, _sched(_OFFLOADS_FIRST, 3), loss_fn, host_arena=arena)
    with pytest.raises(ExecutionError, match=message):
        ex.step(x, y)
    assert all(p.grad is None for p in m.parameters())
    assert arena.stats().allocated_bytes == 0      # the offloaded abar1 went back
    assert not ex._plain and not ex._bar and ex._delta is None
    # once the cause is gone, the same executor trains as plain torch
    m.requires_grad_(True)
    m[2].cut = None
    ex.loss_fn = _float_mse
    ref = copy.deepcopy(m)
    ref_loss = _float_mse(ref(x), y)
    ref_loss.backward()
    _assert_same(m, ex, ex.step(x, y), ref, ref_loss.detach())


def test_a_cut_chain_of_frozen_stages_on_a_batch_that_requires_grad_names_the_cut():
    # the batch requires grad, so the cause is the cut, not "all frozen"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), _Cut())
    model.requires_grad_(False)
    model[2].cut = "detach"
    x, y = torch.randn(4, 8, requires_grad=True), torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="does not require grad"):
        _float_mse(model(x), y).backward()     # as plain torch does
    ex = ScheduleExecutor(model, _sched("F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0", 3),
                          _float_mse)
    with pytest.raises(ExecutionError, match=r"cut it.*last stage \(_Cut\)"):
        ex.step(x, y)
    assert x.grad is None


@pytest.mark.parametrize("text", [
    "F_all 0, F_all 1, offload abar2, F_all 2, delete abar2, F_all 3, L, B 3, "
    "prefetch abar2, B 2, B 1, B 0",                             # abar2 in the host arena
    "F_ck 0, F_ck 1, F_all 2, F_all 3, L, B 3, B 2, F_all 1, B 1, F_all 0, B 0",  # remat
])
@pytest.mark.parametrize("cut", ["detach", "no_grad"])
def test_a_middle_stage_cutting_the_chain_before_frozen_stages_is_refused(cut, text, arena):
    # stage 1 detaches its output and stages 2 and 3 are frozen: a_4 needs no
    # gradient and plain loss.backward() raises; the executor gave stages 2 and
    # 3 a leaf requiring grad, so abar_4 did, and the step trained nothing
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Cut(), nn.Linear(4, 4), nn.Linear(4, 4))
    model[2:].requires_grad_(False)
    model[1].cut = cut
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="does not require grad"):
        mse(copy.deepcopy(model)(x), y).backward()     # as plain torch does
    m = copy.deepcopy(model)
    ex = ScheduleExecutor(m, _sched(text, 4), mse, host_arena=arena)
    with pytest.raises(ExecutionError, match=r"stage 1 \(_Cut\) or one before it returns a "
                                             r"tensor without autograd history.*no stage "
                                             r"after it"):
        ex.step(x, y)
    assert all(p.grad is None for p in m.parameters())
    assert arena.stats().allocated_bytes == 0
    assert not ex._plain and not ex._bar and ex._delta is None
    # once the cause is gone, the same executor trains as plain torch
    m[1].cut = model[1].cut = None
    ref_loss = mse(model(x), y)
    ref_loss.backward()
    _assert_same(m, ex, ex.step(x, y), model, ref_loss.detach())


@pytest.mark.parametrize("trains", ["stage 3", "closure"])
def test_a_middle_stage_cutting_the_chain_trains_what_comes_after_it(trains):
    # plain loss.backward() trains what the loss still reaches after the cut (a
    # later stage's parameter, a tensor a frozen stage closes over): the B that
    # finds the cut must not refuse it
    torch.manual_seed(0)
    outside = torch.randn(4, requires_grad=True)

    class _Scale(nn.Module):
        def forward(self, x):
            return x * outside
    model = nn.Sequential(nn.Linear(8, 8), _Cut(), _Scale(), nn.Linear(4, 4),
                          nn.Linear(4, 4))
    model[1].cut = "detach"
    model[3:].requires_grad_(False)
    if trains == "stage 3":
        model[3].requires_grad_(True)
        outside.requires_grad_(False)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    sched = _sched("F_ck 0, F_ck 1, F_ck 2, F_all 3, F_all 4, L, B 4, B 3, F_all 2, B 2, "
                   "F_all 1, B 1, F_all 0, B 0", 5)
    if trains == "closure":
        mse(copy.deepcopy(model)(x), y).backward()
        want, outside.grad = outside.grad.clone(), None
    m, ex, *rest = _train(model, x, y, mse, sched)   # a plain step, then the executor's
    _assert_same(m, ex, *rest)
    assert all(p.grad is None for p in m[:2].parameters())
    if trains == "closure":                           # as much from each of the two
        torch.testing.assert_close(outside.grad, 2 * want)


class _TemperedMSE(nn.Module):
    """A loss with a parameter of its own (a learnable temperature)."""

    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.tensor(1.5))

    def forward(self, out, target):
        return mse(out * self.t, target)


@pytest.mark.parametrize("what", ["loss-parameter", "batch"])
def test_a_frozen_model_whose_loss_still_needs_a_gradient_trains(what):
    # plain loss.backward() runs when the loss trains something of its own or
    # the batch requires grad: the check for nothing to train must not refuse it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).requires_grad_(False)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    loss_fn = _TemperedMSE() if what == "loss-parameter" else nn.MSELoss()
    xs = [x.clone().requires_grad_(what == "batch") for _ in range(2)]
    ref_loss = loss_fn(model(xs[0]), y)
    ref_loss.backward()
    want = [t.grad.clone() for t in (*loss_fn.parameters(), xs[0]) if t.grad is not None]
    for t in loss_fn.parameters():
        t.grad = None
    ex = ScheduleExecutor(model, _sched(_OFFLOADS_FIRST, 3), loss_fn)
    torch.testing.assert_close(ex.step(xs[1], y), ref_loss.detach())
    got = [t.grad for t in (*loss_fn.parameters(), xs[1]) if t.grad is not None]
    assert len(got) == len(want) == 1
    torch.testing.assert_close(got[0], want[0])


class _ConjMix(nn.Module):
    """Saves lazy conjugate views of its complex input and of its complex weight
    (``mul`` keeps its operands as given, conj bit and all)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, dtype=torch.cfloat))

    def forward(self, z):
        return (z.conj() * self.w.conj() * z).real


@pytest.mark.parametrize("text", [
    "F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0",
    "F_ck 0, F_all 1, F_all 2, L, B 2, B 1, F_all 0, B 0",
    "F_all 0, F_ck 1, F_all 1, w_delete 1, offload abar2, delete abar2, F_all 2, L, "
    "B 2, w_prefetch 1, prefetch abar2, B 1, B 0",
])
def test_saved_conjugate_views_keep_their_conjugation(text):
    # a saved view of the stage's input or weight is re-derived at B i with
    # as_strided, which dropped the lazy conj bit of z.conj() / w.conj(): the
    # gradients of stage 1 and of everything before it came out conjugated
    torch.manual_seed(0)
    model = nn.Sequential(_ToSpectrum(), _ConjMix(), nn.Linear(8, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    _assert_same(*_train(model, x, y, mse, _sched(text, 3)))


class _ComplexLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.cfloat))

    def forward(self, z):
        return z @ self.w


class _Conj(nn.Module):
    def forward(self, z):
        return z.conj()


class _Abs(nn.Module):
    def forward(self, z):
        return z.abs()


@pytest.mark.parametrize("text", [
    "F_all 0, F_all 1, F_all 2, F_all 3, L, B 3, B 2, B 1, B 0",
    "F_all 0, F_ck 1, F_all 2, F_all 3, L, B 3, B 2, F_all 1, B 1, B 0"])
def test_a_stage_input_that_is_a_conjugate_view_gives_the_right_gradient(text):
    # a_2 is x.conj(), a lazy conjugate view; stage 2 saves it for its weight's
    # gradient, packed as the storage's plain values, and re-derived from a_2
    # with its conj bit, the bit was put back once more: 2.w's gradient was
    # conjugated (7.7 from plain torch's)
    torch.manual_seed(0)
    model = nn.Sequential(_ComplexLinear(), _Conj(), _ComplexLinear(), _Abs())
    x, y = torch.randn(4, 8, dtype=torch.cfloat), torch.randn(4, 8)
    _assert_same(*_train(model, x, y, mse, _sched(text, 4)))


class _ComplexViews(nn.Module):
    """Multiplies complex views (``view_as_complex``) of its float input and of
    its float weight: ``mul`` saves both, views of those storages with another
    dtype than the input's and the weight's."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 2))

    def forward(self, x):
        z = torch.view_as_complex(x.view(-1, 4, 2)) * torch.view_as_complex(self.w)
        return torch.view_as_real(z).reshape(-1, 8)


def test_saved_views_of_the_input_or_a_weight_with_another_dtype_give_the_right_gradient():
    # re-derived as views of a_1 or of the weight (as_strided keeps their float
    # dtype), the complex views came back as floats: 1.w and 0.weight got other
    # gradients. They are kept with abar2 instead
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), _ComplexViews(), nn.Linear(8, 1))
    x, y = torch.randn(5, 6), torch.randn(5, 1)
    _assert_same(*_train(model, x, y, mse,
                         _sched("F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0", 3)))


class _NegImag(nn.Module):
    """Saves ``z.conj().imag``, a lazy negative view of its complex input."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, z):
        return z.conj().imag * self.w


def test_saved_negative_views_keep_their_sign():
    # packed without the neg bit, which unpack puts back: without it 1.w's
    # gradient changed sign
    torch.manual_seed(0)
    model = nn.Sequential(_ToSpectrum(), _NegImag(), nn.Linear(8, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    _assert_same(*_train(model, x, y, mse,
                         _sched("F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0", 3)))


# A rotor-style remat schedule (stage 0 recomputed under no_grad before each
# reader, its F_all last) and one running stage 0's F_all first
_ROTOR_3 = "F_ck 0, F_none 1, F_all 2, L, B 2, F_ck 0, F_all 1, B 1, F_all 0, B 0"
_ZERO_FIRST_3 = "F_all 0, F_ck 1, F_all 2, L, B 2, F_all 1, B 1, B 0"


@pytest.mark.parametrize("holder, text, where", [
    # a submodule of every stage: stage 0's F_all sets it with history
    (Shared, _ROTOR_3, r"the forward of stage 0 \(BiasFirst\) sets ctx\.bias, a tensor "
                       r"with autograd history \(ExpandBackward0\), on a module that "
                       r"stage 1 \(BiasReader\) also holds"),
    (Shared, _ZERO_FIRST_3, r"the forward of stage 0 \(BiasFirst\) sets ctx\.bias"),
    # a plain object the module state does not show: seen in stage 2's graph
    (types.SimpleNamespace, _ZERO_FIRST_3,
     r"stage 2 \(BiasReader\) reads a tensor with autograd history that the forward of "
     r"stage 0 \(BiasFirst\) made \(ExpandBackward0\)"),
])
def test_the_executor_refuses_a_tensor_with_history_handed_between_stages(holder, text,
                                                                          where):
    # A schedule that did not come from profile_sequential (hand-written here)
    # trained such a model silently wrong: under _ROTOR_3 the readers got the
    # bias of F_ck 0 (no history) and pos no gradient at all; under
    # _ZERO_FIRST_3 pos got its gradient through the readers' graphs only
    # because an expand saves nothing (any saving op raised torch's "backward
    # through the graph a second time")
    model = bias_model(True, holder)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    ex = ScheduleExecutor(model, _sched(text, 3), mse)
    before = [p.detach().clone() for stage in model for p in stage.parameters()]
    for _ in range(2):   # refused at every step, not only at the first
        with pytest.raises(ExecutionError, match=where + r"(.|\n)*pack it into the tensor "
                           r"stage 0 returns"):
            ex.step(x, y)
    for stage in model:
        stage.zero_grad(set_to_none=True)
    after = [p for stage in model for p in stage.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, before))   # weights intact


@pytest.mark.parametrize("text", [_ROTOR_3, _ZERO_FIRST_3])
def test_a_mask_without_history_read_by_every_stage_trains_as_plain_torch(text):
    # what the refusal above lets through, under the same schedules: a mask
    # stage 0 derives from its input, float64, gradients as plain torch's at
    # two steps (the second unchecked)
    model = bias_model(False)
    ref = copy.deepcopy(model)
    ex = ScheduleExecutor(model, _sched(text, 3), mse)
    for _ in range(2):
        x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
        h = x
        for stage in ref:
            h = stage(h)
        ref_loss = mse(h, y)
        ref_loss.backward()
        loss = ex.step(x, y)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
        got = [p.grad for stage in model for p in stage.parameters()]
        expected = [p.grad for stage in ref for p in stage.parameters()]
        assert [g is None for g in got] == [e is None for e in expected]
        for g, e in zip(got, expected):
            if e is not None:
                torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
