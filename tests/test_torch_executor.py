"""The executor: gradients equal plain autograd for every kind of schedule, and the
executor's measured activation memory equals the simulator's prediction."""

import copy
import math
import os
import signal
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
nn = torch.nn

import rtmem  # noqa: E402
from rtmem.planners import (Chain, Platform, Schedule, min_feasible_memory,  # noqa: E402
                            plan_floating, plan_remat, plan_revolve, plan_sequential,
                            sequential_schedule, simulate, store_all_schedule)
from rtmem.planners.testing import valid_schedules, wandering_schedules  # noqa: E402
from rtmem.torch import (ExecutionError, ScheduleExecutor, gpt2_model,  # noqa: E402
                         profile_sequential, resnet_model)
from rtmem.torch._stages import RAISED_IN  # noqa: E402

MODELS = {
    "gpt2-dropout": lambda: gpt2_model(layers=3, hidden=32, heads=4, seq=16, vocab=64,
                                       dropout=0.1),
    "resnet-bn": lambda: resnet_model(blocks=(1, 1), width=4, image=16),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def setup(request):
    torch.manual_seed(0)
    model, loss_fn, make = MODELS[request.param]()
    x, y = make(3, torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    torch.manual_seed(7)
    loss = loss_fn(ref(x), y)
    loss.backward()
    chain = profile_sequential(model, x, y, loss_fn, repeats=1)
    return model, loss_fn, x, y, ref, loss.detach(), chain


def _run(setup, schedule, **kw):
    model, loss_fn, x, y, _, _, _ = setup
    m = copy.deepcopy(model)
    ex = ScheduleExecutor(m, schedule, loss_fn, **kw)
    torch.manual_seed(7)
    loss = ex.step(x, y)
    return m, ex, loss


def _assert_same_training(setup, m, ex, loss):
    _, _, _, _, ref, ref_loss, _ = setup
    assert torch.equal(loss, ref_loss)
    host = ex.host_grads()
    for p, q in zip(m.parameters(), ref.parameters()):
        g = p.grad if p.grad is not None else 0
        g = g + host[p] if p in host else g
        torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-6)
    for b, c in zip(m.buffers(), ref.buffers()):   # batch-norm statistics updated once
        assert torch.equal(b, c)


@pytest.mark.parametrize("segments", [1, 2, 3, None])
def test_remat_gradients_equal_plain_autograd(setup, segments):
    n = setup[-1].n
    sched = store_all_schedule(n) if segments is None else sequential_schedule(n, segments)
    _assert_same_training(setup, *_run(setup, sched))


def test_a_replaced_schedule_is_checked_and_compiled_at_the_next_step(setup):
    # The executor decodes its schedule once (operations, recomputed stages, moves):
    # a schedule assigned after a step must be run, not the one decoded before
    model, loss_fn, x, y, _, _, chain = setup
    n = chain.n
    m = copy.deepcopy(model)
    pristine = copy.deepcopy(m.state_dict())
    ex = ScheduleExecutor(m, store_all_schedule(n), loss_fn)
    ex.step(x, y)
    m.load_state_dict(pristine)     # buffers as the reference found them
    m.zero_grad(set_to_none=True)
    ex.schedule = store_all_schedule(n + 1)      # planned for another chain
    with pytest.raises(ExecutionError, match="another chain"):
        ex.step(x, y)
    assert all(p.grad is None for p in m.parameters())
    new = sequential_schedule(n, 2)              # recomputes: replays dropout's RNG
    ex.schedule = new
    torch.manual_seed(7)
    loss = ex.step(x, y)
    assert len(ex.resident_bytes) == len(new)    # one figure per operation run
    _assert_same_training(setup, m, ex, loss)


def test_only_recomputed_stages_snapshot_the_rng_state(setup, monkeypatch):
    # A stage run once per step needs no RNG replay: its first forward takes no
    # state copy (a cost per stage and step of store-all plans)
    model, loss_fn, x, y, _, _, chain = setup
    taken = []
    real = torch.get_rng_state
    monkeypatch.setattr(torch, "get_rng_state", lambda: taken.append(1) or real())
    for schedule, snapshots in ((store_all_schedule(chain.n), False),
                                (sequential_schedule(chain.n, 2), True)):
        taken.clear()
        m = copy.deepcopy(model)
        ScheduleExecutor(m, schedule, loss_fn).step(x, y)
        assert bool(taken) == snapshots


def _moves_schedule(n):
    text = ["F_all 0", "offload abar1", "F_all 1", "delete abar1", "w_delete 0"]
    text += [f"F_all {i}" for i in range(2, n)] + ["L"]
    text += [f"B {i}" for i in reversed(range(2, n))]
    text += ["prefetch abar1", "B 1", "g_offload 1", "w_prefetch 0", "B 0", "g_offload 0"]
    return Schedule.from_text(", ".join(text))


def test_offload_weights_and_gradients(setup):
    m, ex, loss = _run(setup, _moves_schedule(setup[-1].n))
    _assert_same_training(setup, m, ex, loss)
    assert set(ex.host_grads()) == set(m[0].parameters()) | set(m[1].parameters())


def test_host_gradients_accumulate_over_steps_until_zeroed(setup):
    # g_offload adds each step's gradient to the host accumulator (as .grad
    # accumulates over loss.backward() calls) until zero_host_grads()
    model, loss_fn, x, y, ref = setup[:5]
    m = copy.deepcopy(model)
    ex = ScheduleExecutor(m, _moves_schedule(len(m)), loss_fn)
    moved = list(m[0].parameters()) + list(m[1].parameters())
    for steps in (3, 1):
        for _ in range(steps):
            torch.manual_seed(7)
            ex.step(x, y)
        host = ex.host_grads()
        for p, q in zip(m.parameters(), ref.parameters()):
            if p in host:
                torch.testing.assert_close(host[p], steps * q.grad, rtol=1e-5, atol=1e-6)
        assert set(host) == set(moved)
        m.zero_grad(set_to_none=True)
        ex.zero_host_grads()
        assert ex.host_grads() == {}


def _weight_moves_schedule(n, *tail):
    """Store-all with stage 0's weights deleted and stage 1's offloaded after
    their forwards, each prefetched before its backward; ``tail``: ops after B 0."""
    text = ["F_all 0", "w_delete 0", "F_all 1", "w_offload 1"]
    text += [f"F_all {i}" for i in range(2, n)] + ["L"]
    text += [f"B {i}" for i in reversed(range(2, n))]
    text += ["w_prefetch 1", "B 1", "w_prefetch 0", "B 0", *tail]
    return Schedule.from_text(", ".join(text))


def test_weight_moves_over_many_steps_with_an_optimizer(setup):
    # Weights dropped by w_delete / w_offload come back by w_prefetch as new
    # tensors (as on a GPU); the host copy of one step must not outlive the
    # optimizer update after it, and weights a schedule leaves on the host are
    # put back at the end of the step.
    model, loss_fn, x, y = setup[:4]
    mine, ref = copy.deepcopy(model), copy.deepcopy(model)
    ex = ScheduleExecutor(mine, _weight_moves_schedule(len(model), "w_delete 1"), loss_fn)
    opt_mine = torch.optim.SGD(mine.parameters(), lr=0.5)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        torch.manual_seed(7)
        loss = ex.step(x, y)
        torch.manual_seed(7)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for p, q in zip(mine.parameters(), ref.parameters()):
            assert p.shape == q.shape                    # every weight is back
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        opt_mine.step()
        opt_ref.step()
        opt_mine.zero_grad(set_to_none=True)
        opt_ref.zero_grad(set_to_none=True)
    for p, q in zip(mine.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_a_state_dict_taken_mid_step_holds_the_moved_weights(setup):
    # A checkpoint saved while the schedule has weights off the device (from the
    # loss_fn here; a SIGTERM handler alike) held the 0-element placeholders:
    # torch.save wrote it, and only the load failed ("size mismatch")
    model, loss_fn, x, y = setup[:4]
    m = copy.deepcopy(model)
    wrapper = torch.nn.ModuleDict({"net": m})     # a prefix before the stage's names
    saved = []

    def saving_loss(out, target):
        saved.append({k: v.clone() for k, v in wrapper.state_dict().items()})
        return loss_fn(out, target)

    ex = ScheduleExecutor(m, _weight_moves_schedule(len(m)), saving_loss)
    expected = {k: v.clone() for k, v in wrapper.state_dict().items()}
    moved = {f"net.{i}.{k}" for i in (0, 1) for k, _ in m[i].named_parameters()}
    assert moved and moved <= set(expected)
    torch.manual_seed(7)
    ex.step(x, y)
    assert set(saved[0]) == set(expected)
    for key, _ in wrapper.named_parameters():   # buffers: batch norm's moved on
        assert torch.equal(saved[0][key], expected[key]), key
    restored = copy.deepcopy(model)
    restored.load_state_dict({k[len("net."):]: v for k, v in saved[0].items()})
    # the hooks are gone with the step: a state_dict after it is the model's own
    after = wrapper.state_dict(keep_vars=True)
    for key in moved:
        assert after[key] is dict(wrapper.named_parameters())[key]


def test_cpu_adam_on_host_grads_also_steps_the_stages_not_offloaded(setup):
    # _moves_schedule g_offloads stages 0 and 1 only: the others keep p.grad.
    # CPUAdam.step(grads=ex.host_grads()) skipped them (a dict named only the
    # moved parameters), so most of the model never trained.
    from rtmem.optim import CPUAdam
    model, loss_fn, x, y = setup[:4]
    mine, ref = copy.deepcopy(model), copy.deepcopy(model)
    ex = ScheduleExecutor(mine, _moves_schedule(len(mine)), loss_fn)
    opt = CPUAdam(mine.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=False)
    for _ in range(3):
        torch.manual_seed(7)
        ex.step(x, y)
        torch.manual_seed(7)
        loss_fn(ref(x), y).backward()
        opt.step(grads=ex.host_grads())
        ref_opt.step()
        ex.zero_host_grads()
        opt.zero_grad()
        ref_opt.zero_grad()
    # a skipped parameter is ~3 lr off; Adam's normalisation turns rounding noise
    # in gradients that are zero in exact arithmetic (attention's key bias) into
    # moves of up to ~2e-4
    for p, q in zip(mine.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-3)


def test_an_error_mid_step_leaves_the_model_whole(setup):
    model, loss_fn, x, y = setup[:4]
    n = len(model)
    text = ["F_all 0", "w_delete 0"] + [f"F_all {i}" for i in range(1, n)] + ["L"]
    text += [f"B {i}" for i in reversed(range(1, n))] + ["w_prefetch 0", "B 0"]
    m = copy.deepcopy(model)
    before = [p.detach().clone() for p in m.parameters()]

    def bad_loss(out, target):
        raise RuntimeError("loss failed")
    ex = ScheduleExecutor(m, Schedule.from_text(", ".join(text)), bad_loss)
    with pytest.raises(RuntimeError, match="loss failed"):
        ex.step(x, y)
    for p, b in zip(m.parameters(), before):     # stage 0's weights came back
        assert torch.equal(p, b)
    # and it trains on (the failed forward did update batch-norm statistics, as
    # a failing loss after model(x) does in plain PyTorch)
    ex.loss_fn = loss_fn
    torch.manual_seed(7)
    assert torch.equal(ex.step(x, y), setup[5])
    for p, q in zip(m.parameters(), setup[4].parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


class _Boom(ValueError):
    """A user's own exception type, which must reach the caller unchanged."""


class _Flaky(nn.Module):
    """A stage that raises ``exc`` in its ``fail_at``-th forward call (1: the first
    forward, 2: the recomputation) or, with ``fail_at="backward"``, in its backward
    (a hook on its output)."""

    def __init__(self, width, exc=None, fail_at=None):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.exc, self.fail_at, self.calls = exc, fail_at, 0

    def forward(self, x):
        self.calls += 1
        if self.exc is not None and self.fail_at == self.calls:
            raise self.exc
        y = torch.tanh(self.lin(x))
        if self.exc is not None and self.fail_at == "backward" and y.requires_grad:
            exc = self.exc

            def fail(grad):
                raise exc
            y.register_hook(fail)
        return y


# the recomputed schedule of a 4-stage model, stage 0's weights on the host
# between its two forwards and the gradients of stages 0 and 1 sent there
_FAILING_SCHEDULE = ("F_ck 0, w_delete 0, F_none 1, F_all 2, F_all 3, L, B 3, B 2, "
                     "w_prefetch 0, F_all 0, F_all 1, offload abar2, delete abar2, "
                     "prefetch abar2, B 1, g_offload 1, B 0, g_offload 0")


@pytest.mark.parametrize("where", ["forward", "recomputation", "backward", "loss",
                                   "loss backward", "out of memory", "interrupt"])
def test_an_error_in_a_stage_or_the_loss_says_where_and_the_executor_trains_on(where,
                                                                                fresh_seed):
    # The executor said nothing of where an exception came from: a shape error or
    # an OOM in stage 12's recomputation showed torch's message and frames only.
    # It now marks it as the profiler does (the `rtmem: raised in ...` note), keeps
    # its type (the caller's `except ValueError` / `except torch.OutOfMemoryError`
    # still catch it) and says when gradients of the half-run backward remain.
    torch.manual_seed(fresh_seed)
    dtype = torch.float64
    model = nn.Sequential(nn.Linear(6, 8), _Flaky(8), nn.BatchNorm1d(8),
                          nn.Linear(8, 3)).to(dtype)
    x, t = torch.randn(5, 6, dtype=dtype), torch.randn(5, 3, dtype=dtype)

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()
    exc = {"out of memory": torch.OutOfMemoryError("CUDA out of memory (simulated)"),
           "interrupt": KeyboardInterrupt()}.get(where, _Boom(f"boom in the {where}"))
    flaky = model[1]
    bad_loss = loss_fn
    if where in ("forward", "recomputation", "backward", "out of memory"):
        flaky.exc = exc
        flaky.fail_at = {"forward": 1, "backward": "backward"}.get(where, 2)
    elif where == "loss":
        def bad_loss(out, target):
            raise exc
    elif where == "loss backward":
        def bad_loss(out, target):
            loss = loss_fn(out, target)
            loss.register_hook(lambda grad: (_ for _ in ()).throw(exc))
            return loss
    else:   # Ctrl-C landing in the recomputation of stage 1, from a forward hook
        calls = []

        def interrupt(module, args, output):
            calls.append(1)
            if len(calls) == 2:
                raise exc
        hook = flaky.register_forward_hook(interrupt)
    host = rtmem.HostArena("1MiB")
    ex = ScheduleExecutor(model, Schedule.from_text(_FAILING_SCHEDULE), bad_loss,
                          host_arena=host)
    weights = copy.deepcopy(model.state_dict())
    with pytest.raises(type(exc)) as raised:
        ex.step(x, t)
    e = raised.value
    assert e is exc                                   # not wrapped, not replaced
    notes = getattr(e, "__notes__", [])
    phrase = {"forward": "the forward of stage 1 (_Flaky), operation 2 of the schedule "
                         "(F_none 1)",
              "recomputation": "the recomputed forward of stage 1 (_Flaky), operation 10 "
                               "of the schedule (F_all 1)",
              "out of memory": "the recomputed forward of stage 1 (_Flaky), operation 10 "
                               "of the schedule (F_all 1)",
              "backward": "the backward of stage 1 (_Flaky), operation 14 of the schedule "
                          "(B 1)",
              "loss": "the loss function, operation 5 of the schedule (L)",
              "loss backward": "the backward of the loss, operation 5 of the schedule (L)",
              "interrupt": None}[where]   # not the user's code failing: not marked
    assert getattr(e, RAISED_IN, None) == phrase
    assert [n for n in notes if "raised in" in n] == ([] if phrase is None else
                                                     [f"rtmem: raised in {phrase}"])
    # the backward had begun (B 3, B 2 ran): its gradients stay, as after a failed
    # loss.backward() (or torch.utils.checkpoint's failed recomputation), and the
    # exception says so; before it, no gradient was written and nothing says one was
    began = where in ("recomputation", "out of memory", "backward", "interrupt")
    assert any("gradients it had accumulated stay" in n for n in notes) == began
    assert (model[3].weight.grad is not None) == began
    assert model[0].weight.grad is None and not ex.host_grads()
    # nothing of the step is left: stored tensors, delta, ledgers, host buffers,
    # hooks, and stage 0's weights are back on the device
    assert not ex._plain and not ex._bar and ex._delta is None and not ex._first
    assert ex._ledger.total == 0 and ex._holding.total == 0
    assert host.stats().allocator.live_blocks == 0
    if where == "interrupt":
        hook.remove()
    assert not ex._w_hooks
    for m in model.modules():
        assert not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                    or m._state_dict_hooks)
    for name, value in model.state_dict().items():
        if "running" not in name and "num_batches" not in name:   # updated as in torch
            assert torch.equal(value, weights[name]), name
    # and it trains on: the next step gives what plain autograd and a fresh
    # executor give on the same weights and statistics
    flaky.exc, ex.loss_fn = None, loss_fn
    model.zero_grad(set_to_none=True)
    ref, fresh = copy.deepcopy(model), copy.deepcopy(model)
    fresh_ex = ScheduleExecutor(fresh, Schedule.from_text(_FAILING_SCHEDULE), loss_fn,
                                host_arena=rtmem.HostArena("1MiB"))
    loss = ex.step(x, t)
    ref_loss = loss_fn(ref(x), t)
    ref_loss.backward()
    assert torch.equal(loss, fresh_ex.step(x, t))
    torch.testing.assert_close(loss, ref_loss.detach())
    mine, theirs = ex.host_grads(), fresh_ex.host_grads()
    for p, q, r in zip(model.parameters(), fresh.parameters(), ref.parameters()):
        g = mine[p] if p in mine else p.grad
        assert torch.equal(g, theirs[q] if q in theirs else q.grad)
        torch.testing.assert_close(g, r.grad)
    for b, c in zip(model.buffers(), ref.buffers()):
        torch.testing.assert_close(b, c)


def test_an_interrupt_in_the_step_clean_up_is_held_until_the_weights_are_back(setup):
    # Ctrl-C landing while the step's clean-up puts back the weights the schedule
    # left on the host: they stayed 0-element placeholders (a checkpoint saved in
    # the caller's `except KeyboardInterrupt` lost them) and the host buffers of
    # the offloads were never freed
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("KeyboardInterrupt comes from SIGINT only in the main thread")
    model, loss_fn, x, y = setup[:4]
    n = len(model)
    text = ["F_all 0", "offload abar1", "w_delete 0"] + [f"F_all {i}" for i in range(1, n)]
    text += ["L"] + [f"B {i}" for i in reversed(range(1, n))]
    text += ["w_prefetch 0", "B 0", "w_delete 0"]          # stage 0's weights end on the host
    m = copy.deepcopy(model)
    before = [p.detach().clone() for p in m.parameters()]
    host = rtmem.HostArena("1MiB")
    ex = ScheduleExecutor(m, Schedule.from_text(", ".join(text)), loss_fn, host_arena=host)
    restore = ex._restore_weights

    def interrupted():
        signal.raise_signal(signal.SIGINT)
        restore()
    ex._restore_weights = interrupted
    with pytest.raises(KeyboardInterrupt):
        ex.step(x, y)
    for p, b in zip(m.parameters(), before):
        assert torch.equal(p, b)
    assert host.stats().allocator.live_blocks == 0
    del ex._restore_weights
    m.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    assert torch.equal(ex.step(x, y), setup[5])


def test_track_memory_off_trains_the_same_and_counts_nothing(setup):
    sched = _moves_schedule(setup[-1].n)
    m, ex, loss = _run(setup, sched, track_memory=False)
    _assert_same_training(setup, m, ex, loss)
    assert ex.peak_bytes is None and ex.resident_bytes == []
    # switched on between steps, it counts exactly what a tracking executor counts
    # (the weight moves of the previous step must not leave stale parameter keys)
    _, tracked, _ = _run(setup, sched)
    ex.track_memory = True
    m.zero_grad(set_to_none=True)
    ex.zero_host_grads()
    torch.manual_seed(7)
    ex.step(*setup[2:4])
    assert ex.resident_bytes == tracked.resident_bytes and len(ex.resident_bytes) == len(sched)
    assert ex.peak_bytes == tracked.peak_bytes == max(tracked.resident_bytes)


@pytest.mark.parametrize("track", [True, False])
def test_delta_is_in_the_byte_count_only_when_tracking_memory(track):
    # Without track_memory nothing reads the byte count's total, and delta's
    # storages are protected by the holding ledger: counting delta there too was
    # two ledger updates per B for nothing. Checked inside B 1, where the
    # executor holds delta_2 while the stage's backward runs.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    ex = ScheduleExecutor(model, store_all_schedule(3), nn.functional.mse_loss,
                          track_memory=track)
    seen = []

    def during_backward(module, grad_input, grad_output):
        ptr = ex._delta.untyped_storage().data_ptr()
        seen.append((ex._ledger.holds(ptr), ex._holding.holds(ptr)))
    model[1].register_full_backward_hook(during_backward)
    ex.step(torch.randn(3, 4), torch.randn(3, 4))
    assert seen == [(track, True)]


#: Examples per random-schedule test (RTMEM_EXAMPLES raises it for a bug hunt).
_RANDOM_SCHEDULES = settings(
    max_examples=int(os.environ.get("RTMEM_EXAMPLES", 25)), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@_RANDOM_SCHEDULES
@given(data=st.data())
def test_random_valid_schedules(setup, data):
    chain = setup[-1]
    sched = data.draw(valid_schedules(chain))
    m, ex, loss = _run(setup, sched)
    _assert_same_training(setup, m, ex, loss)
    _check_measured_against(sched, chain, ex)


@_RANDOM_SCHEDULES
@given(data=st.data())
def test_wandering_schedules(setup, data):
    # Any operation the simulator allows, in any order (recomputing over a
    # resident tensor, discarding a0, recomputing an abar never consumed...):
    # the executor trains as plain autograd and holds what the simulator
    # counts, or refuses the one kind of schedule it cannot run, up front.
    chain = setup[-1]
    sched = data.draw(wandering_schedules(chain))
    try:
        ScheduleExecutor(copy.deepcopy(setup[0]), sched, setup[1])
    except ExecutionError as exc:
        assert "consumed its graph" in str(exc), exc
        return
    m, ex, loss = _run(setup, sched)
    _assert_same_training(setup, m, ex, loss)
    _check_measured_against(sched, chain, ex)


def _acts_only(chain):
    return Chain(u_f=chain.u_f, u_b=chain.u_b, x=chain.x, xbar=chain.xbar, x0=chain.x0)


def _check_measured_against(sched, chain, ex):
    """Activation bytes measured between operations equal the simulator's on the
    activations-only chain (from B 0 on the simulator also holds delta_0, which
    the executor computes only for a batch that requires grad); returns that simulation."""
    sim = simulate(_acts_only(chain), sched, Platform(math.inf))
    last_b = max(j for j, (op, s, _) in enumerate(sched) if op == op.B)
    assert ex.resident_bytes[:last_b] == sim.timeline["mem_after"][:last_b].tolist()
    assert ex.peak_bytes <= sim.peak
    return sim


@pytest.mark.parametrize("planner", [plan_remat, plan_floating, plan_revolve, plan_sequential])
@pytest.mark.parametrize("where", [0.0, 0.5])
def test_planner_output_trains_within_its_budget(setup, planner, where):
    # A planner's plan, at the least feasible budget and halfway to store-all:
    # the executor reproduces plain autograd, and what it holds (plus the
    # weights, resident throughout) stays within the plan's simulated peak,
    # itself within the budget.
    chain = setup[-1]
    lo = min_feasible_memory(chain)
    hi = simulate(chain, store_all_schedule(chain.n), Platform(math.inf)).peak
    budget = lo + int(where * (hi - lo))
    plan = planner(chain, budget)
    m, ex, loss = _run(setup, plan)
    _assert_same_training(setup, m, ex, loss)
    _check_measured_against(plan.schedule, chain, ex)
    assert ex.peak_bytes + sum(chain.w) <= plan.peak <= budget


def test_bad_plans_are_refused(setup):
    model, loss_fn = setup[0], setup[1]
    n = len(model)
    with pytest.raises(ExecutionError, match=f"{n} stages"):
        ScheduleExecutor(model, store_all_schedule(n + 1), loss_fn)
    with pytest.raises(ExecutionError, match="planned for another chain"):
        ScheduleExecutor(model, store_all_schedule(n - 1), loss_fn)
    with pytest.raises(ExecutionError, match="nn.Sequential of stages or a list"):
        ScheduleExecutor({"a": model}, store_all_schedule(n), loss_fn)
    with pytest.raises(ExecutionError, match="nn.Sequential of stages or a list"):
        ScheduleExecutor([*model, "relu"], store_all_schedule(n + 1), loss_fn)
    with pytest.raises(ExecutionError, match="Schedule or a Plan"):
        ScheduleExecutor(model, "F_all 0", loss_fn)


def test_many_steps_leave_nothing_behind(setup, monkeypatch):
    import gc

    import rtmem
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    model, loss_fn, x, y = setup[:4]
    n = len(model)
    sched = Schedule.from_text(", ".join(
        ["offload a0", "F_all 0", "offload abar1", "F_all 1", "delete abar1"]
        + [f"F_all {i}" for i in range(2, n)] + ["L"]
        + [f"B {i}" for i in reversed(range(2, n))] + ["prefetch abar1", "B 1", "B 0"]))
    arena = rtmem.HostArena(1 << 22)
    ex = ScheduleExecutor(copy.deepcopy(model), sched, loss_fn, host_arena=arena)
    steps = 20     # a leak of one buffer a step shows in the counts from step 2
    # with the cycle collector off: each step's host copies must come back when
    # their last reference goes, not at some later collection
    gc.disable()
    try:
        for _ in range(steps):
            ex.step(x, y)
            assert not ex._plain and not ex._bar and ex._delta is None
            assert arena.stats().allocated_bytes == 0      # host copies returned each step
            arena._check_invariants()
    finally:
        gc.enable()
    assert len(ex.resident_bytes) == len(sched)
    stats = arena.stats()     # the offloads really went through the arena
    assert stats.alloc_count >= 2 * steps and stats.alloc_count == stats.free_count
    assert stats.peak_bytes > 0


def test_profile_matches_storage_accounting(setup):
    chain = setup[-1]
    assert (chain.xbar >= chain.x).all() and (chain.x > 0).all()
    assert chain.w.sum() == sum(p.numel() * p.element_size() for p in setup[0].parameters())
    assert chain.x0 == setup[2].numel() * setup[2].element_size()


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(layers=-1), "layers"), (dict(hidden=0), "hidden"), (dict(heads=3), "multiple"),
    (dict(seq=0), "seq"), (dict(vocab=0), "vocab"), (dict(layers=2.5), "layers"),
    (dict(dropout=1.0), "dropout"),
    # a string failed in a comparison with a bare TypeError
    (dict(dropout="0.1"), r"dropout must be a number in \[0, 1\), got '0.1'"),
    (dict(dropout=True), "dropout must be a number"),
])
def test_gpt2_model_refuses_bad_sizes(kwargs, fragment):
    from rtmem.torch import gpt2_model
    with pytest.raises(ValueError, match=fragment):
        gpt2_model(**{"hidden": 64, "heads": 4, **kwargs})


@pytest.mark.parametrize("kwargs, fragment", [
    ({"blocks": ()}, "blocks must be a non-empty sequence"),
    ({"blocks": 3}, "blocks must be a non-empty sequence"),
    ({"blocks": "22"}, "blocks must be a non-empty sequence"),
    # a dict's keys were read as the counts: {1: 2} built one group of one block
    ({"blocks": {1: 2}}, r"blocks must be a non-empty sequence.*got \{1: 2\}"),
    ({"blocks": {2, 3}}, "blocks must be a non-empty sequence"),
    ({"blocks": (2, 0)}, r"blocks\[1\] must be an integer >= 1, got 0"),
    ({"blocks": (2, 1.5)}, r"blocks\[1\] must be an integer >= 1, got 1.5"),
    ({"width": 0}, "width must be an integer >= 1"),
    ({"image": None}, "image must be an integer >= 1, got None"),
    ({"classes": True}, "classes must be an integer >= 1, got True"),
    ({"bottleneck": "yes"}, "bottleneck must be True or False"),
])
def test_resnet_model_names_a_bad_argument(kwargs, fragment):
    # blocks=(2, 0) built a model whose widths skipped a group, width=0 failed
    # inside Conv2d, image=None inside torch.randn at the first batch
    with pytest.raises(ValueError, match=fragment):
        resnet_model(**kwargs)


def test_gpt2_model_names_a_bad_argument():
    with pytest.raises(ValueError, match="seq must be an integer >= 1, got None"):
        gpt2_model(seq=None)                      # was a TypeError from int(None)
    with pytest.raises(ValueError, match="layers must be an integer >= 0, got 2.5"):
        gpt2_model(layers=2.5)
    model, _, _ = gpt2_model(layers=np.int64(1), hidden=8, heads=2, seq=4, vocab=16)
    assert len(model) == 3


def test_tied_gpt2_model_has_the_weights_of_its_analytic_chain():
    # profiles.gpt2 counts the LM head as tied to the embedding; gpt2_model's head
    # had a (vocab, hidden) matrix of its own (163M parameters at GPT-2 small's
    # sizes, not 124M), and could not be built tied
    from rtmem.planners.profiles import gpt2
    sizes = dict(layers=2, hidden=16, heads=2, seq=8, vocab=40)
    torch.manual_seed(0)
    model, loss_fn, make = gpt2_model(**sizes, tie_weights=True)
    assert model[-1].out.weight is model[0].tok.weight
    # drawn as GPT-2's (std 0.02), not nn.Embedding's std 1: 640 draws
    assert 0.018 < model[0].tok.weight.std().item() < 0.022
    analytic = gpt2(**sizes, batch=3, weight_bytes=4)        # float32 parameters
    assert sum(p.numel() for p in model.parameters()) * 4 == analytic.w.sum()
    x, y = make(3, torch.Generator().manual_seed(1))
    chain = profile_sequential(model, x, y, loss_fn, repeats=1)
    assert chain.w.tolist() == analytic.w.tolist()         # stage by stage, too
    ref = copy.deepcopy(model)                              # still tied
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    ex = ScheduleExecutor(model, sequential_schedule(len(model), 2), loss_fn)
    torch.testing.assert_close(ex.step(x, y), ref_loss.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    # untied, as before: the head's own matrix on top of the analytic count
    torch.manual_seed(0)
    untied = gpt2_model(**sizes)[0]
    assert untied[-1].out.weight is not untied[0].tok.weight
    assert sum(p.numel() for p in untied.parameters()) * 4 == analytic.w.sum() + 40 * 16 * 4
    with pytest.raises(ValueError, match="tie_weights must be True or False, got 'yes'"):
        gpt2_model(**sizes, tie_weights="yes")


def test_model_blocks_name_a_bad_size():
    # GPTBlock(8, 0) raised ZeroDivisionError, GPTBlock(8, -2) a reshape error at
    # its first forward, and a sequence longer than seq torch's "index out of
    # range in self" from the position embedding
    from rtmem.torch.models import BasicBlock, Bottleneck, GPTBlock, GPTEmbedding, GPTHead
    for make, fragment in [
            (lambda: GPTBlock(8, 0), "heads must be an integer >= 1, got 0"),
            (lambda: GPTBlock(8, -2), "heads must be an integer >= 1, got -2"),
            (lambda: GPTBlock(6, 4), "hidden = 6 must be a multiple of heads = 4"),
            (lambda: GPTBlock(8.0, 2), "hidden must be an integer >= 1, got 8.0"),
            (lambda: GPTBlock(8, 2, dropout="0.1"), "dropout must be a number"),
            (lambda: GPTEmbedding(-1, 8, 4), "vocab must be an integer >= 1, got -1"),
            (lambda: GPTHead(0, 16), "hidden must be an integer >= 1, got 0"),
            (lambda: BasicBlock(3, 4, stride=0), "stride must be an integer >= 1, got 0"),
            (lambda: Bottleneck(3, -1), "width must be an integer >= 1, got -1")]:
        with pytest.raises(ValueError, match=fragment):
            make()
    model, loss_fn, make = gpt2_model(layers=1, hidden=8, heads=2, seq=4, vocab=16)
    assert model(torch.randint(16, (2, 4))).shape == (2, 4, 16)     # seq tokens, and fewer
    assert model(torch.randint(16, (2, 3))).shape == (2, 3, 16)
    with pytest.raises(ValueError, match="sequences of 6 tokens, more than seq = 4"):
        model(torch.randint(16, (2, 6)))
    with pytest.raises(ValueError, match=r"shape \(batch, seq\), got a tensor of shape \(6,\)"):
        model(torch.randint(16, (6,)))
    with pytest.raises(ValueError, match=r"\(batch, seq\), got a tensor of shape \(2, 2, 4\)"):
        model(torch.randint(16, (2, 2, 4)))


def _layer_norm(m, t):
    """nn.LayerNorm ``m`` applied to ``t`` by hand (biased variance)."""
    mean = t.mean(-1, keepdim=True)
    var = ((t - mean) ** 2).mean(-1, keepdim=True)
    return (t - mean) / torch.sqrt(var + m.eps) * m.weight + m.bias


def _gpt_block_reference(block, x):
    """GPTBlock's forward in float64 by hand, one query position at a time:
    pre-LayerNorm causal self-attention scaled by 1/sqrt(head size), then a
    GELU MLP, both added to their input."""
    ln = _layer_norm

    def lin(m, t):
        return t @ m.weight.T + m.bias
    b, s, h = x.shape
    n = h // block.heads
    q, k, v = lin(block.qkv, ln(block.ln1, x)).split(h, dim=2)
    y = torch.zeros_like(x)
    for i in range(b):
        for j in range(block.heads):
            cols = slice(j * n, (j + 1) * n)
            for t in range(s):          # query t sees keys 0..t only
                scores = torch.stack([q[i, t, cols] @ k[i, u, cols] for u in range(t + 1)])
                w = torch.exp(scores / math.sqrt(n) - (scores / math.sqrt(n)).max())
                w = w / w.sum()
                y[i, t, cols] = sum(w[u] * v[i, u, cols] for u in range(t + 1))
    x = x + lin(block.proj, y)
    u = lin(block.fc1, ln(block.ln2, x))
    return x + lin(block.fc2, 0.5 * u * (1 + torch.erf(u / math.sqrt(2))))


def test_gpt_stages_compute_gpt2_s_functions():
    # the executor tests compare a model with itself: these fix what it computes
    from rtmem.torch.models import GPTBlock, GPTEmbedding, GPTHead
    torch.manual_seed(0)
    block = GPTBlock(8, 2, dropout=0.3).double().eval()    # eval: no dropout
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(block(x), _gpt_block_reference(block, x))
    emb = GPTEmbedding(16, 8, 6, dropout=0.3).double().eval()
    idx = torch.tensor([[3, 0, 15, 3], [1, 2, 1, 9]])
    torch.testing.assert_close(emb(idx), emb.tok.weight[idx] + emb.pos.weight[:4])
    head = GPTHead(8, 16).double()
    torch.testing.assert_close(head(x), _layer_norm(head.ln, x) @ head.out.weight.T)


def test_gpt_stages_drop_out_in_training_only():
    from rtmem.torch.models import GPTBlock, GPTEmbedding
    torch.manual_seed(0)
    emb = GPTEmbedding(16, 8, 6, dropout=0.5).train()
    idx = torch.randint(16, (2, 6))
    full = (emb.tok.weight[idx] + emb.pos.weight[:6]).detach()
    out = emb(idx).detach()
    dropped = out == 0
    assert dropped.any() and (~dropped).any()
    torch.testing.assert_close(out[~dropped], 2 * full[~dropped])   # 1 / (1 - p)
    # the attention weights drop out too (the residual branches' dropout off)
    block = GPTBlock(8, 2, dropout=0.5)
    block.drop = torch.nn.Identity()
    x = torch.randn(2, 5, 8)
    want = block.eval()(x)
    assert not torch.allclose(block.train()(x), want)
    assert torch.equal(block.eval()(x), want)


def test_gpt2_model_batches_are_next_token_targets_over_the_whole_vocabulary():
    _, _, make = gpt2_model(layers=0, hidden=8, heads=2, seq=5, vocab=16)
    x, y = make(64, torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (64, 5) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])         # y is x shifted by one token
    assert set(torch.cat([x, y]).unique().tolist()) == set(range(16))


def test_residual_blocks_downsample_and_end_in_a_relu():
    from rtmem.torch.models import BasicBlock, Bottleneck
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 8)
    for block, shape in ((BasicBlock(4, 4, stride=2), (2, 4, 4, 4)),
                         (BasicBlock(4, 8), (2, 8, 8, 8)),
                         (Bottleneck(4, 2, stride=2), (2, 8, 4, 4)),
                         (Bottleneck(8, 2), (2, 8, 8, 8))):
        out = block(x if block.body[0].in_channels == 4 else torch.randn(2, 8, 8, 8))
        assert out.shape == shape
        assert (out >= 0).all() and (out == 0).any()       # the final ReLU


def test_resnet_model_widths_double_and_later_groups_downsample():
    model, _, make = resnet_model(blocks=(1, 2, 1), width=4, image=16, classes=3)
    x, y = make(2, torch.Generator().manual_seed(0))
    shapes = []
    for stage in model:
        x = stage(x)
        shapes.append(tuple(x.shape[1:]))
    assert shapes == [(4, 16, 16), (4, 16, 16), (8, 8, 8), (8, 8, 8), (16, 4, 4), (3,)]
    assert y.shape == (2,)


def test_importing_and_stepping_load_no_torchdynamo():
    # the unpack hook's torch.compiler.disable ran at import and loaded
    # torch._dynamo: import rtmem.torch cost twice import torch, in every process
    from _subprocess import run_ok
    run_ok("""
        import sys, torch
        from torch import nn
        from rtmem.planners import Schedule
        from rtmem.torch import ScheduleExecutor
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        sched = Schedule.from_text(
            "F_ck 0, F_ck 1, F_all 2, L, B 2, F_all 1, B 1, F_all 0, B 0")
        ScheduleExecutor(model, sched, nn.functional.mse_loss).step(
            torch.randn(3, 4), torch.randn(3, 1))
        assert model[0].weight.grad is not None
        assert "torch._dynamo" not in sys.modules, "torch._dynamo was loaded"
        print("ok")
    """)


def test_gradients_equal_plain_autograd_under_compiled_autograd():
    # Compiled autograd calls the saved-tensor unpack hooks from the backward
    # graph it compiles: traced by dynamo, their version checks read the traced
    # tensors' counters and refused every step once a weight had been updated
    # in place ("'3.weight' ... was modified in place afterwards")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                  for _ in range(3)], torch.nn.Linear(8, 2))
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    loss_fn = torch.nn.functional.cross_entropy
    ref = copy.deepcopy(model)
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    torch._dynamo.reset()
    try:
        ca = torch._dynamo.compiled_autograd   # _enable: torch >= 2.6, enable before
        with (getattr(ca, "_enable", None) or ca.enable)(torch.compile(backend="aot_eager")):
            for sched in (sequential_schedule(4, 2), _moves_schedule(4)):
                m = copy.deepcopy(model)
                with torch.no_grad():   # as an optimizer step does: versions move
                    for p in m.parameters():
                        p.mul_(1.0)
                ex = ScheduleExecutor(m, sched, loss_fn)
                assert torch.equal(ex.step(x, y), ref_loss.detach())
                host = ex.host_grads()      # g_offload moves some there
                for p, q in zip(m.parameters(), ref.parameters()):
                    g = host[p] if p in host else p.grad
                    torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("given", ["sequential", "list"])
@pytest.mark.parametrize("change", ["append", "pop", "replace"])
def test_a_stage_changed_after_construction_is_refused(change, given):
    # the executor listed the stages when built: it skipped an appended stage
    # (loss 0.72 where model(x) gave 0.47) and ran a replaced stage's old module
    nn = torch.nn
    torch.manual_seed(0)
    model = [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)]
    if given == "sequential":
        model = nn.Sequential(*model)
    ex = ScheduleExecutor(model, store_all_schedule(3), nn.functional.mse_loss)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    if change == "append":
        model.append(nn.Linear(1, 1))
    elif change == "pop":
        del model[-1]
    else:
        model[1] = nn.ReLU()
    with pytest.raises(ExecutionError, match="stages changed after this executor was built"):
        ex.step(x, y)
    assert all(p.grad is None for m in model for p in m.parameters())


def test_a_batch_larger_than_the_planned_one_warns_once():
    # A plan holds for the batch it was profiled with; 4x that batch ran at 4x the
    # activation peak with nothing said
    import warnings
    from rtmem.planners import Plan
    torch.manual_seed(0)
    model, loss_fn, make_batch = gpt2_model(layers=2, hidden=16, heads=2, seq=8, vocab=32)
    x, y = make_batch(2)
    chain = profile_sequential(model, x, y, loss_fn, repeats=1)
    plan = plan_remat(chain, math.inf)
    assert plan.info["input_bytes"] == x.numel() * x.element_size() == chain.x0
    assert Plan.from_json(plan.to_json()).info["input_bytes"] == chain.x0
    ex = ScheduleExecutor(model, plan, loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ex.step(x, y)                                   # the planned batch: silent
        ex.step(*make_batch(1))                         # a smaller one too
    big = make_batch(4)
    with pytest.warns(RuntimeWarning, match="larger than the 128-byte input the plan"):
        ex.step(*big)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ex.step(*big)                                   # said once per executor
        # a bare Schedule carries no batch size: nothing to check
        ScheduleExecutor(model, plan.schedule, loss_fn).step(*big)


@pytest.mark.parametrize("frozen", [False, True])
def test_eval_mode_attention_recomputes_as_plain_training_bit_for_bit(frozen):
    # In eval mode torch's attention modules (nn.MultiheadAttention,
    # nn.TransformerEncoderLayer) take a fused "fast path" when autograd is off,
    # which rounds differently from the path a training forward takes: F_ck and
    # F_none, run under no_grad, gave a_{i+1} (and so every gradient) a few ulp
    # away from plain training, and from the stage's own F_all recomputation. A
    # frozen stage whose input needs no gradient takes the fast path in plain
    # training too, and must keep it.
    torch.manual_seed(int.from_bytes(os.urandom(2), "little"))
    model = nn.Sequential(*[nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1,
                                                       batch_first=True)
                            for _ in range(3)]).eval()
    if frozen:
        model[0].requires_grad_(False)
    x, y = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    ref, m = copy.deepcopy(model), copy.deepcopy(model)
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    sched = Schedule.from_text("F_ck 0, F_none 1, F_all 2, L, B 2, F_ck 0, F_all 1, B 1, "
                               "F_all 0, B 0")
    loss = ScheduleExecutor(m, sched, nn.functional.mse_loss).step(x, y)
    assert torch.equal(loss, ref_loss.detach())
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
    assert torch.backends.mha.get_fastpath_enabled()   # the caller's setting is back


def test_a_recomputed_stage_on_a_device_whose_generator_is_not_replayed_is_refused():
    # The executor replays the CPU's generator and the batch's CUDA device's. A
    # recomputed stage whose weights live on another device (here "meta", standing
    # in for mps/xpu, or a GPU under a CPU batch) drew new dropout masks there:
    # refused before any stage runs, naming the stage and the device.
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4))
    model[0].to("meta")
    sched = Schedule.from_text("F_ck 0, F_none 1, F_all 2, L, B 2, F_ck 0, F_all 1, B 1, "
                               "F_all 0, B 0")
    ex = ScheduleExecutor(model, sched, nn.functional.mse_loss)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    state = torch.get_rng_state()
    with pytest.raises(ExecutionError, match=r"stage 0 \(Linear\).*runs on meta.*"
                                             r"preserve_rng_state=False"):
        ex.step(x, y)
    assert torch.equal(torch.get_rng_state(), state)   # nothing ran
    assert all(p.grad is None for p in model.parameters())
