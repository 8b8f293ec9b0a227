"""profile_sequential's byte counts in cases the executor tests do not reach."""

import gc

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from _torch_models import SoftmaxRecorded, bias_model  # noqa: E402

from rtmem.planners import plan_sequential  # noqa: E402
from rtmem.torch import ExecutionError, ScheduleExecutor, profile_sequential  # noqa: E402


class _WeightView(nn.Module):
    """A stage whose output is a view of its weight (model state, not an
    activation): what autograd saves of it is all weight."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return self.w.expand(x.shape[0], 4, 3)


def test_an_output_viewing_a_weight_still_counts_in_xbar():
    # xbar holds the output (a chain needs xbar >= x), though its storage is
    # the weight's, which the accounting leaves out of activations
    model = nn.Sequential(_WeightView(), nn.Flatten(), nn.Linear(12, 1))
    x, y = torch.randn(2, 5), torch.randn(2, 1)
    chain = profile_sequential(model, x, y, nn.functional.mse_loss, repeats=1)
    assert chain.x[0] == chain.xbar[0] == 4 * 3 * 4     # the weight's 12 floats


def test_progress_is_reported_after_each_stage_and_the_loss():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x, y = torch.randn(2, 3), torch.randn(2, 1)
    calls = []
    chain = profile_sequential(model, x, y, nn.functional.mse_loss, repeats=2,
                               progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)] and chain.n == 3
    from rtmem.torch import ExecutionError
    with pytest.raises(ExecutionError, match="progress must be a function progress"
                                             r"\(done, total\) or None, got int"):
        profile_sequential(model, x, y, nn.functional.mse_loss, progress=1)


class _RecordsAutocast(torch.autograd.Function):
    """The identity, whose backward records whether autocast is on for the cpu."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _RecordsAutocast.seen.append(torch.is_autocast_enabled("cpu"))
        return g


class _Recording(nn.Module):
    def forward(self, x):
        return _RecordsAutocast.apply(x)


def test_backward_is_timed_outside_autocast_as_the_executor_runs_it(monkeypatch):
    monkeypatch.setattr(_RecordsAutocast, "seen", [])
    model = nn.Sequential(nn.Linear(3, 4), _Recording(), nn.Linear(4, 1))
    x, y = torch.randn(2, 3), torch.randn(2, 1)

    def loss_fn(out, target):
        return nn.functional.mse_loss(_RecordsAutocast.apply(out).float(), target)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        profile_sequential(model, x, y, loss_fn, repeats=2)
        assert torch.is_autocast_enabled("cpu")
    # stage 1's two timed backwards and the loss's two
    assert _RecordsAutocast.seen == [False] * 4


def test_profiling_frees_the_graphs_of_its_repeated_forwards():
    # The pack hook returned each saved tensor as it was: softmax saves its own
    # output, whose grad_fn holds the saved tensor back, a cycle through
    # autograd's C++ the collector cannot break. Each of the repeats - 1 forwards
    # not backpropagated kept its graph and activations for good (96 tensors,
    # 464 KB a call on a 2-block GPT-2 of hidden 32), on a GPU in the memory
    # the plan then budgets for training
    torch.manual_seed(0)
    model = nn.Sequential(*(SoftmaxRecorded() for _ in range(2)))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    profile_sequential(model, x, y, nn.functional.mse_loss, repeats=3)
    gc.collect()
    outputs = [r for stage in model for r in stage.outputs]
    assert len(outputs) >= 6
    alive = sum(r() is not None for r in outputs)
    assert alive == 0, f"{alive} of {len(outputs)} stage outputs outlived the profile"


def test_a_tensor_with_history_handed_between_stages_outside_the_outputs_is_refused():
    # It profiled, and a plan recomputing stage 0 (under no_grad, where the
    # bias has no history) gave pos a wrong gradient, silently; one reading the
    # bias of stage 0's F_all raised torch's "backward through the graph a
    # second time" at B 0
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(ExecutionError, match=r"stage 1 \(BiasReader\) reads a tensor with "
                       r"autograd history that the forward of stage 0 \(BiasFirst\) made"
                       r"(.|\n)*pack it into the tensor stage 0 returns"):
        profile_sequential(bias_model(True), x, y, nn.functional.mse_loss, repeats=1)


def test_a_mask_without_history_shared_by_the_stages_trains_as_plain_torch():
    # what the refusal above must let through: a mask stage 0 derives from its
    # input, read by every block, under a schedule recomputing stage 0
    model = bias_model(False)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    h = x
    for stage in model:
        h = stage(h)
    nn.functional.mse_loss(h, y).backward()
    # pos is unused here: its gradient stays None in both
    expected = [p.grad for stage in model for p in stage.parameters()]
    for stage in model:
        stage.zero_grad(set_to_none=True)
    chain = profile_sequential(model, x, y, nn.functional.mse_loss, repeats=1)
    plan = plan_sequential(chain, float("inf"), 2)
    assert "F_ck 0" in str(plan.schedule)             # stage 0 is recomputed
    ScheduleExecutor(model, plan, nn.functional.mse_loss).step(x, y)
    got = [p.grad for stage in model for p in stage.parameters()]
    assert [g is None for g in got] == [e is None for e in expected] == [True] + [False] * 6
    for g, e in zip(got[1:], expected[1:]):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
