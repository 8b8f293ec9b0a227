"""Dynamic loss scaling for the optimizers that unscale inside their own step.

NOTE [ Loss scale ]
Float16 gradients underflow unless the loss is multiplied by a large scale S
before backward; the optimizer then divides S out, and a step whose gradients
overflowed (inf/NaN) must be skipped and S lowered. ``torch.amp.GradScaler``
does the dividing and the inf check as separate passes over ``p.grad``.
rtmem's optimizers (:class:`~rtmem.optim.NumpyAdam`,
:class:`~rtmem.optim.CPUAdam`, :class:`rtmem.torch.OffloadedAdam`) do both
inside the fused update: ``step(grad_scale=S)`` reads each gradient once to
check it, once to update, and records a skip in ``last_step_skipped``
(NOTE [ Skipped steps ] in :mod:`rtmem.optim`). :class:`LossScaler` keeps S for
them:

1. ``scale(loss)`` multiplies by S (a Python float: the tensor keeps its dtype).
2. ``step(opt, ...)`` calls ``opt.step(..., grad_scale=S, check_finite=True)``
   and notes whether the optimizer skipped.
3. ``update()`` moves S by GradScaler's rule: any skip since the last update
   multiplies it by ``backoff_factor`` and restarts the count; after
   ``growth_interval`` update()s in a row without one it is multiplied by
   ``growth_factor`` (if the product is finite). S is a float32, and each
   product is rounded to float32 as torch's ``_amp_update_scale_`` does, so the
   same skips give bit-identical scales (tested against torch).

The scaler itself needs neither torch nor numba: ``scale`` multiplies whatever
it is given (a tensor, a numpy array, a float, or lists/tuples of them), and
``state_dict`` has GradScaler's keys, so a checkpoint moves between the two.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .errors import LossScaleError, OptimizerError

__all__ = ["LossScaler"]

# The fused kernels multiply by float32(1/S) (rtmem.kernels.adam._unscale_factor),
# which overflows for a scale near 1/float32-max. Scales are kept normal float32
# values, whose reciprocals are finite. A scale this small only comes from ~130
# backoffs in a row: every gradient inf/NaN at every scale, i.e. a non-finite loss.
_MIN_SCALE = float(np.finfo(np.float32).tiny)       # 1.18e-38
_MAX_SCALE = float(np.finfo(np.float32).max)        # 3.40e+38

_GRAD_SCALE_KEYWORDS = ("grad_scale", "check_finite")
_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval",
               "_growth_tracker")


def _f32(x: float) -> float:
    """x rounded to float32, as a Python float (inf beyond float32's range, as
    torch's static_cast<float> gives)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _is_integer(x) -> bool:
    """An int or numpy integer, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _real(value, name: str) -> float:
    """float(value), refusing what float() takes but is no number here: text
    (init_scale="65536" from a config file passed, growth_interval="2000" did
    not) and a bool (init_scale=True was a scale of 1.0)."""
    if not isinstance(value, (str, bytes, bool, np.bool_)):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise OptimizerError(f"{name}={value!r} is not a real number; pass a number"
                         + (f", e.g. float({value!r})" if isinstance(value, str) else ""),
                         argument=name)


def _check_scale(value, name: str) -> float:
    """A loss scale the fused kernels accept: a normal float32 (so its float32
    reciprocal is finite). Returned rounded to float32."""
    x = _real(value, name)
    if not (math.isfinite(x) and _MIN_SCALE <= x <= _MAX_SCALE):
        raise OptimizerError(
            f"{name}={value!r} is out of range: a loss scale must be a normal float32, "
            f"in [{_MIN_SCALE:.3g}, {_MAX_SCALE:.3g}] "
            f"(GradScaler's default is 65536.0)", argument=name)
    return _f32(x)


def _check_hyper(growth_factor, backoff_factor, growth_interval) -> tuple:
    """The schedule's constants, checked as torch's GradScaler checks them (and
    more: finite, a positive integer interval)."""
    g, b = _real(growth_factor, "growth_factor"), _real(backoff_factor, "backoff_factor")
    if not (math.isfinite(g) and g > 1.0):
        raise OptimizerError(f"growth_factor={growth_factor!r} must be finite and > 1 "
                             f"(the scale grows after a run of good steps)",
                             argument="growth_factor")
    if not 0.0 < b < 1.0:
        raise OptimizerError(f"backoff_factor={backoff_factor!r} must be in (0, 1) "
                             f"(the scale shrinks after an overflow)",
                             argument="backoff_factor")
    if not _is_integer(growth_interval) or growth_interval < 1:
        raise OptimizerError(f"growth_interval={growth_interval!r} must be an integer >= 1 "
                             f"(update()s without a skip before the scale grows)",
                             argument="growth_interval")
    return g, b, int(growth_interval)


def _scaled(outputs, s: float):
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(_scaled(o, s) for o in outputs)
    if outputs is None or isinstance(outputs, (str, bytes, bool)):
        raise _not_scalable(outputs)
    try:
        return outputs * s
    except TypeError:
        # a dict of losses, a generator, a set: the bare "unsupported operand
        # type(s) for *" said nothing of what scale() takes
        raise _not_scalable(outputs) from None


def _not_scalable(outputs) -> OptimizerError:
    return OptimizerError(f"outputs must be a tensor, an array, a number, or a list/tuple "
                          f"of them; got {type(outputs).__name__}", argument="outputs")


class LossScaler:
    """Dynamic loss scale for rtmem's optimizers, with ``torch.amp.GradScaler``'s
    schedule and calls (NOTE [ Loss scale ])::

        scaler = rtmem.LossScaler()
        for x, y in data:
            loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            optimizer.clip_grad_norm_(1.0, grad_scale=scaler.get_scale())  # optional
            scaler.step(optimizer)     # skipped if a gradient is inf/NaN
            scaler.update()
            optimizer.zero_grad()

    It drives any optimizer whose ``step`` takes ``grad_scale=`` and
    ``check_finite=`` and records ``last_step_skipped``: :class:`rtmem.optim.NumpyAdam`,
    :class:`rtmem.optim.CPUAdam` and :class:`rtmem.torch.OffloadedAdam` (whose
    gradients leave ``p.grad`` during backward, so GradScaler cannot check them).
    For ``torch.optim`` optimizers use ``torch.amp.GradScaler``.

    There is no ``unscale_`` (an extra pass over every gradient, which the fused
    kernels exist to avoid; NumpyAdam's gradients are not even in ``p.grad``):
    clip the scaled gradients at the scaled norm instead. Multiplying every
    gradient by S multiplies their norm by S, so clipping them to
    ``max_norm * S`` clips exactly what GradScaler's ``unscale_`` followed by a
    clip to ``max_norm`` clips, and the step divides S out as usual:

    - OffloadedAdam: ``optimizer.clip_grad_norm_(max_norm,
      grad_scale=scaler.get_scale())`` (returns the unscaled norm; no extra pass).
    - CPUAdam (float32 ``p.grad``): ``torch.nn.utils.clip_grad_norm_(params,
      max_norm * scaler.get_scale())``; the norm it returns is S times the
      unscaled one (divide it by S to log it), and its 1e-6 guard against a
      zero norm is S times smaller, a difference far below float32 rounding.
      Do not mix in GradScaler's ``unscale_``: ``scaler.step`` divides by S
      again. (GradScaler alone, with its ``unscale_``, drives CPUAdam too.)
    - NumpyAdam: scale the arrays given to ``step(grads)`` by
      ``min(1, max_norm * S / norm)`` in the same way.

    An overflowed step stays skipped: its inf norm makes the clip multiply the
    gradients by 0, inf * 0 is NaN, and the step's check finds it.

    Parameters (dimensionless; as GradScaler's):
        init_scale: the first scale S (default 2**16), rounded to float32.
        growth_factor: > 1; S is multiplied by it after ``growth_interval``
            update()s in a row without a skipped step (default 2.0).
        backoff_factor: in (0, 1); S is multiplied by it at an update() after
            any skipped step (default 0.5).
        growth_interval: integer >= 1 (default 2000).
        enabled: False makes every call a pass-through (``scale`` returns its
            argument, ``step`` calls ``optimizer.step`` with no scale,
            ``get_scale`` is 1.0, ``state_dict`` is empty), so one loop serves
            fp32 and fp16 runs.

    Unlike GradScaler it keeps no record of :meth:`scale` calls: a ``step``
    after a backward of an unscaled loss divides those gradients by S (always
    scale the loss), and a step with no gradient at all counts as a good step
    (GradScaler raises "No inf checks were recorded"). ``step`` always calls
    ``optimizer.step``, which skips itself on an inf/NaN, so the optimizer's
    step hooks run on skipped steps too, and a closure is passed through.

    Errors: bad arguments raise :class:`~rtmem.errors.OptimizerError`; calls out
    of order (a second ``step`` of one optimizer before ``update``, ``update``
    with no ``step``) and a scale driven below the float32 range raise
    :class:`~rtmem.errors.LossScaleError`. Either way the scaler is unchanged.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True):
        if not isinstance(enabled, bool):
            raise OptimizerError(f"enabled must be True or False, got {enabled!r}",
                                 argument="enabled")
        self._enabled = enabled
        self._scale = _check_scale(init_scale, "init_scale")
        self._growth_factor, self._backoff_factor, self._growth_interval = _check_hyper(
            growth_factor, backoff_factor, growth_interval)
        self._growth_tracker = 0
        # id(optimizer) -> whether its step since the last update() was skipped.
        # (By id, as GradScaler's per-optimizer states: optimizers need not hash.)
        self._stepped: dict[int, bool] = {}

    # -------------------------------------------------------------- queries
    def is_enabled(self) -> bool:
        """Whether the scaler scales (``enabled`` at construction)."""
        return self._enabled

    def get_scale(self) -> float:
        """The current loss scale S (a float32 value as a Python float); 1.0 when
        disabled."""
        return self._scale if self._enabled else 1.0

    # -------------------------------------------------------------- the loop
    def scale(self, outputs):
        """``outputs * S``: a tensor (its dtype kept, autograd recorded), a numpy
        array, a number, or a list/tuple of them (same container type back).
        Disabled: ``outputs`` unchanged."""
        if not self._enabled:
            return outputs
        return _scaled(outputs, self._scale)

    def step(self, optimizer, *args, **kwargs):
        """``optimizer.step(*args, **kwargs, grad_scale=S, check_finite=True)``:
        the gradients carry S (from :meth:`scale`), are divided by it in the
        fused kernel and checked first; an inf/NaN skips the whole step (the
        optimizer's ``last_step_skipped``), and the next :meth:`update` lowers S.
        Returns what ``optimizer.step`` returns. If it raises, the scaler is
        unchanged and the step may be retried. Disabled: a plain
        ``optimizer.step(*args, **kwargs)``."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if not hasattr(optimizer, "last_step_skipped"):
            raise OptimizerError(
                f"LossScaler drives optimizers that unscale and check the gradients in "
                f"their own step (rtmem's NumpyAdam, CPUAdam, OffloadedAdam: "
                f"step(grad_scale=...), last_step_skipped); "
                f"{type(optimizer).__name__} is not one. Use torch.amp.GradScaler for "
                f"torch.optim optimizers.", argument="optimizer")
        given = [k for k in _GRAD_SCALE_KEYWORDS if k in kwargs]
        if given:
            raise OptimizerError(
                f"scaler.step() passes {' and '.join(given)} itself (grad_scale=S, "
                f"check_finite=True); drop {given[0]}=, or call optimizer.step(...) "
                f"directly to choose it", argument=given[0])
        if id(optimizer) in self._stepped:
            raise LossScaleError(
                f"scaler.step() was already called for this {type(optimizer).__name__} "
                f"since the last update(); call scaler.update() once per iteration, after "
                f"every optimizer's step (if that update() raised, it ended nothing: "
                f"update(new_scale=...) ends the iteration with a scale you choose)")
        result = optimizer.step(*args, grad_scale=self._scale, check_finite=True, **kwargs)
        self._stepped[id(optimizer)] = bool(optimizer.last_step_skipped)
        return result

    def update(self, new_scale=None) -> None:
        """End the iteration: set S to ``new_scale`` (a number or a one-element
        tensor/array) if given, else move it by the schedule (NOTE [ Loss scale ]):
        times ``backoff_factor`` if any optimizer skipped its step since the last
        update, times ``growth_factor`` after ``growth_interval`` update()s in a
        row without a skip. Needs a :meth:`step` since the last update unless
        ``new_scale`` is given. Disabled: does nothing."""
        if not self._enabled:
            return
        if new_scale is not None:
            scale = _new_scale(new_scale)
            tracker = self._growth_tracker
        elif not self._stepped:
            raise LossScaleError(
                "scaler.update() found no scaler.step() since the last update: step each "
                "optimizer through the scaler first (or pass new_scale= to set the scale)")
        elif any(self._stepped.values()):
            scale = _f32(self._scale * self._backoff_factor)
            if scale < _MIN_SCALE:
                raise LossScaleError(
                    f"the loss scale would fall to {scale:.3g}, below what the fused "
                    f"kernels can divide out ({_MIN_SCALE:.3g}): the steps keep finding "
                    f"inf/NaN gradients however small the scale, so the loss or the model "
                    f"is non-finite (check for a NaN loss); the scale stays {self._scale:g} "
                    f"and the iteration open: end it with update(new_scale=...)")
            tracker = 0
        else:
            scale, tracker = self._scale, self._growth_tracker + 1
            if tracker == self._growth_interval:
                grown = _f32(self._scale * self._growth_factor)
                if math.isfinite(grown):
                    scale = grown
                tracker = 0
        self._scale, self._growth_tracker = scale, tracker
        self._stepped.clear()

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """GradScaler's layout: ``scale`` (float), ``growth_factor``,
        ``backoff_factor`` (floats), ``growth_interval``, ``_growth_tracker``
        (ints); empty when disabled. Take it after :meth:`update`."""
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from :meth:`state_dict` (this class's or torch GradScaler's).
        Everything is checked before anything changes. Disabled: does nothing."""
        if not self._enabled:
            return
        if not isinstance(state_dict, dict) or not state_dict:
            raise OptimizerError(
                f"state_dict must be a non-empty dict from LossScaler.state_dict() or "
                f"GradScaler.state_dict(), got {state_dict!r} (an empty one comes from a "
                f"disabled scaler)", argument="state_dict")
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise OptimizerError(f"state_dict lacks {', '.join(missing)}; expected the keys "
                                 f"{', '.join(_STATE_KEYS)}", argument="state_dict")
        scale = _check_scale(state_dict["scale"], "scale")
        hyper = _check_hyper(state_dict["growth_factor"], state_dict["backoff_factor"],
                             state_dict["growth_interval"])
        tracker = state_dict["_growth_tracker"]
        if not _is_integer(tracker) or not 0 <= tracker < hyper[2]:
            raise OptimizerError(f"_growth_tracker={tracker!r} must be an integer in "
                                 f"[0, growth_interval={hyper[2]})",
                                 argument="_growth_tracker")
        self._scale = scale
        self._growth_factor, self._backoff_factor, self._growth_interval = hyper
        self._growth_tracker = int(tracker)

    def __repr__(self) -> str:
        if not self._enabled:
            return "LossScaler(enabled=False)"
        return (f"LossScaler(scale={self._scale:g}, growth_factor={self._growth_factor:g}, "
                f"backoff_factor={self._backoff_factor:g}, "
                f"growth_interval={self._growth_interval}, "
                f"growth_tracker={self._growth_tracker})")


def _new_scale(value) -> float:
    """update(new_scale=...): a number, or a one-element tensor/array (GradScaler
    takes a one-element tensor without grad)."""
    if getattr(value, "requires_grad", False):
        raise OptimizerError("new_scale must not require grad; pass new_scale.detach()",
                             argument="new_scale")
    size = getattr(value, "numel", None)
    n = size() if callable(size) else getattr(value, "size", 1)
    if n != 1:
        raise OptimizerError(f"new_scale must be a number or a one-element tensor/array, "
                             f"got {n} elements", argument="new_scale")
    if hasattr(value, "item"):
        value = value.item()
    return _check_scale(value, "new_scale")
