"""profile_sequential's byte counts in cases the executor tests do not reach."""

import gc

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from _torch_models import SoftmaxRecorded  # noqa: E402

from rtmem.torch import profile_sequential  # noqa: E402


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
