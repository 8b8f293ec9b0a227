"""The checks for a tensor with autograd history handed between stages outside
their outputs (rtmem/torch/_stages.py check_cross_stage, the profiler's and
the executor's callers): what each must refuse and what each must let
through, beyond the cases of test_torch_profiler.py and
test_torch_executor_semantics.py."""
import math
import types

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from _torch_models import BiasFirst, BiasReader, bias_model  # noqa: E402

from rtmem.planners import Chain, Platform, Schedule, simulate  # noqa: E402
from rtmem.torch import ExecutionError, ScheduleExecutor, profile_sequential  # noqa: E402

mse = nn.functional.mse_loss

# stage 0 recomputed under no_grad before each reader, its F_all last; and a
# schedule running every stage's F_all in order
_ROTOR_3 = "F_ck 0, F_none 1, F_all 2, L, B 2, F_ck 0, F_all 1, B 1, F_all 0, B 0"
_IN_ORDER_3 = "F_all 0, F_all 1, F_all 2, L, B 2, B 1, B 0"


def _sched(text: str, n: int) -> Schedule:
    s = Schedule.from_text(text)
    simulate(Chain.homogeneous(n), s, Platform(math.inf))   # a valid schedule
    return s


def _batch():
    return torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)


class _Lin(nn.Module):
    """A float64 linear stage that hands nothing over."""

    def __init__(self, d=6):
        super().__init__()
        self.lin = nn.Linear(d, d, dtype=torch.float64)

    def forward(self, h):
        return self.lin(h)


def _late_bias_model():
    """Stage 1 makes the bias, stage 2 reads it: the maker is not stage 0."""
    ctx = types.SimpleNamespace()
    return [_Lin(), BiasFirst(ctx, 6), BiasReader(ctx, 6)]


def test_the_profiler_names_the_stage_that_made_the_tensor_and_the_stages_to_merge():
    # the maker is the latest stage whose forward began before the node was
    # made, not the first one: stage 0 made nothing here
    x, y = _batch()
    with pytest.raises(ExecutionError, match=r"stage 2 \(BiasReader\) reads a tensor with "
                       r"autograd history that the forward of stage 1 \(BiasFirst\) made"
                       r"(.|\n)*pack it into the tensor stage 1 returns(.|\n)*merge stages "
                       r"1 to 2 into one stage"):
        profile_sequential(_late_bias_model(), x, y, mse, repeats=1)


def test_the_executor_names_the_stage_that_made_the_tensor_and_the_stages_to_merge():
    x, y = _batch()
    ex = ScheduleExecutor(bias_model(True, types.SimpleNamespace),
                          _sched(_IN_ORDER_3, 3), mse)
    # stage 1's F_all is the first to read it (stage 2 never gets to run)
    with pytest.raises(ExecutionError, match=r"stage 1 \(BiasReader\) reads a tensor "
                       r"(.|\n)*forward of stage 0 \(BiasFirst\) made(.|\n)*merge stages "
                       r"0 to 1 into one stage"):
        ex.step(x, y)


class _PreScaled(nn.Module):
    """Reads ``scale``, a tensor with autograd history made from a parameter
    before any forward (once, at construction): a node older than the
    profile's or the step's first forward, which no stage made. Its graph
    saves nothing, so plain torch backpropagates through it at every step."""

    def __init__(self, d=6):
        super().__init__()
        self.lin = nn.Linear(d, d, dtype=torch.float64)
        self.base = nn.Parameter(torch.randn(d, dtype=torch.float64))
        self.scale = self.base + 1.0

    def forward(self, h):
        return torch.tanh(self.lin(h)) * self.scale


def test_a_tensor_with_history_made_before_the_forwards_is_no_stage_s():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(_Lin(), _PreScaled(), _Lin())
    model, ref = make(), make()     # not deepcopy: it refuses a tensor with history
    x, y = _batch()
    mse(ref(x), y).backward()
    chain = profile_sequential(model, x, y, mse, repeats=1)
    assert len(chain) == 3
    ex = ScheduleExecutor(model, _sched(_ROTOR_3, 3), mse)
    ex.step(x, y)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


class _Tied(nn.Module):
    """A float32 linear stage reading ``lin``'s weight (another stage's, tied)."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, h):
        return nn.functional.gelu(self.lin(h))


def _tied_model():
    torch.manual_seed(0)
    first = nn.Linear(16, 16)
    return nn.Sequential(_Tied(first), nn.Linear(16, 16), _Tied(first))


@pytest.mark.parametrize("text", [_IN_ORDER_3, _ROTOR_3])
def test_autocast_s_cached_cast_of_a_tied_weight_is_model_state_not_handed_over(text):
    # Stage 0's forward casts the tied weight for the autocast region; stage 2
    # reads that cached cast (made by stage 0's forward, with history to the
    # weight): model state, as plain torch under autocast trains it
    ref, model = _tied_model(), _tied_model()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = mse(ref(x).float(), y)
        ref_loss.backward()
        loss = ScheduleExecutor(model, _sched(text, 3),
                                lambda out, t: mse(out.float(), t)).step(x, y)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        # the tied weight's two parts are summed in float32 here, in bfloat16
        # by plain torch (its cast's backward gets their sum): bfloat16's
        # rounding (2**-8 relative) apart
        scale = q.grad.abs().max().item()
        torch.testing.assert_close(p.grad, q.grad, rtol=2 ** -7, atol=2 ** -7 * scale,
                                   msg=name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert len(profile_sequential(_tied_model(), x, y,
                                      lambda out, t: mse(out.float(), t), repeats=1)) == 3


def test_under_autocast_a_handed_over_tensor_is_refused_all_the_same():
    # only autocast's casts of leaves pass: the bias (an expand of a
    # parameter, whose node also leads straight to a leaf) is refused
    x, y = _batch()
    ex = ScheduleExecutor(bias_model(True, types.SimpleNamespace), _sched(_IN_ORDER_3, 3),
                          mse)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ExecutionError, match=r"forward of stage 0 \(BiasFirst\) made "
                           r"\(ExpandBackward0\)"):
            ex.step(x, y)
        with pytest.raises(ExecutionError, match=r"forward of stage 0 \(BiasFirst\) made "
                           r"\(ExpandBackward0\)"):
            profile_sequential(bias_model(True), x, y, mse, repeats=1)


def test_a_schedule_set_after_a_step_is_checked_again():
    # The check runs at each stage's first F_all under a schedule, and what an
    # F_all can see depends on the forwards before it: under _ROTOR_3 the
    # readers get the bias of stage 0's no_grad F_ck, without history, which
    # no check can see (the README's limit for a holder that is no module);
    # under _IN_ORDER_3 they read the F_all's, and the new schedule is refused
    x, y = _batch()
    ex = ScheduleExecutor(bias_model(True, types.SimpleNamespace), _sched(_ROTOR_3, 3), mse)
    ex.step(x, y)
    ex.schedule = _sched(_IN_ORDER_3, 3)
    with pytest.raises(ExecutionError, match=r"stage 1 \(BiasReader\) reads a tensor with "
                       r"autograd history"):
        ex.step(x, y)
