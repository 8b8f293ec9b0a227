"""Where an exception from the user's code was raised (the ``rtmem: raised in
...`` note and the attribute ``rtmem profile`` reads): the cases beyond
test_torch_executor.py's and test_cli_profile.py's."""
import sys

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from rtmem.planners import Schedule  # noqa: E402
from rtmem.torch import ScheduleExecutor, profile_sequential  # noqa: E402
from rtmem.torch._stages import RAISED_IN, raised_in  # noqa: E402

mse = nn.functional.mse_loss


class _Boom(ValueError):
    pass


def _raise(exc):
    def hook(grad):
        raise exc
    return hook


def _notes(e):
    return [n for n in getattr(e, "__notes__", []) if n.startswith("rtmem: raised in")]


def _expect_notes(e, phrase):
    assert getattr(e, RAISED_IN, None) == phrase
    if sys.version_info >= (3, 11):      # notes exist from 3.11 on
        assert _notes(e) == ([] if phrase is None else [f"rtmem: raised in {phrase}"])


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).double()


def test_the_innermost_mark_is_kept_and_noted_once():
    exc = _Boom("inner")
    with pytest.raises(_Boom) as raised:
        with raised_in("the outer call"):
            with raised_in("the inner call"):
                raise exc
    assert raised.value is exc
    _expect_notes(exc, "the inner call")


def test_a_keyboard_interrupt_in_a_profiled_stage_is_not_marked():
    # Ctrl-C is not the user's code failing: it goes on unmarked
    model = _model()
    interrupt = KeyboardInterrupt()

    def hook(module, args, output):
        raise interrupt
    model[1].register_forward_hook(hook)
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    with pytest.raises(KeyboardInterrupt) as raised:
        profile_sequential(model, x, y, mse, repeats=1)
    assert raised.value is interrupt
    _expect_notes(interrupt, None)


def test_the_profiler_marks_an_error_in_the_backward_of_the_loss():
    exc = _Boom("in the loss's backward")

    def loss_fn(out, target):
        loss = mse(out, target)
        loss.register_hook(_raise(exc))
        return loss
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    with pytest.raises(_Boom) as raised:
        profile_sequential(_model(), x, y, loss_fn, repeats=1)
    assert raised.value is exc
    _expect_notes(exc, "the backward of the loss")


def test_the_executor_marks_an_error_in_the_backward_of_the_graph_that_made_the_batch():
    # the batch has autograd history of the caller's: B 0 backpropagates into
    # it, and an error there is the caller's code failing
    exc = _Boom("in the caller's graph")
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    w.register_hook(_raise(exc))
    x = torch.randn(3, 4, dtype=torch.float64) * w
    y = torch.randn(3, 2, dtype=torch.float64)
    ex = ScheduleExecutor(_model(), Schedule.from_text("F_all 0, F_all 1, L, B 1, B 0"), mse)
    with pytest.raises(_Boom) as raised:
        ex.step(x, y)
    assert raised.value is exc
    _expect_notes(exc, "the backward of the graph that made the batch, operation 4 of the "
                       "schedule (B 0)")
