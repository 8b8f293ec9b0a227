"""Small shared checks that turn user input into validated numpy arrays.

Each check names the argument (and the first bad index) in its error, in the style
of Hypothesis' ``check_valid_*`` helpers, so Chain, Platform and the testing API
report bad input the same way.
"""

from __future__ import annotations

import json
import math

import numpy as np

from rtmem.errors import ChainError, RtmemError, ScheduleError
from rtmem.units import _is_array, _is_bool

#: Byte counts the planners take stay below this (int64-safe sums; the
#: Platform's stand-in for unlimited memory).
MAX_BYTES = 2**62


def _not_a_number(name: str, value, index: int | None, integral: bool, *,
                  document: bool = False) -> ChainError:
    """The ChainError for a bool or a string given as a time or a size; with
    ``document``, for a value of a chain document that is no JSON number (shown
    as the file has it: ``true``, ``"32KiB"``, ``null``)."""
    where = name if index is None else f"{name}[{index}]"
    unit = "bytes" if integral else "seconds"
    if document:
        shown = json.dumps(value) if value is None or isinstance(value, (bool, str)) \
            else repr(value)
        how = f"write it as a JSON number of {unit}, without quotes (e.g. 1024 or 0.5)"
    else:
        fix = ("convert text you read with float() first" if isinstance(value, (str, bytes))
               else "a bool is no time or size")
        shown = repr(bool(value)) if _is_bool(value) else repr(value)     # not np.True_
        how = f"pass a number of {unit} (an int or float, e.g. 1024 or 0.5): {fix}"
    return ChainError(f"{where} = {shown} is not a number; {how}", field=name, index=index)


def _check_numbers(name: str, values, integral: bool) -> None:
    """ChainError for bool or string elements of ``values``, which numpy and
    float() convert: ``Chain(x=[True, ...])`` was a 1-byte activation and
    ``u_f=["1.0", ...]`` a number, where a chain document refuses both. An
    ndarray (or tensor) is judged by its dtype alone, with no Python loop over a
    large profile's elements; only a sequence (or an object array) is walked."""
    dtype = getattr(values, "dtype", None)
    kind = getattr(dtype, "kind", None)
    if kind in ("b", "U", "S") or str(dtype) == "torch.bool":   # torch's dtype: no .kind
        flat = values.reshape(-1)
        first = flat[0].item() if flat.shape[0] else (True if kind != "U" else "")
        raise _not_a_number(name, first, 0 if getattr(values, "ndim", 0) else None, integral)
    if dtype is not None and kind != "O":
        return
    if isinstance(values, (str, bytes)):
        raise _not_a_number(name, values, None, integral)
    try:
        items = list(values)
    except TypeError:           # not a sequence: as_vector's conversion says so
        return
    # the element types first (a set of a few), then the index only when one is
    # bad or may be (a 0-d array or tensor of bools): a walk calling _is_bool on
    # each of a million floats took 3x the conversion itself
    types = set(map(type, items))
    if not any(issubclass(t, (bool, np.bool_, str, bytes))
               or (hasattr(t, "dtype") and not issubclass(t, np.generic)) for t in types):
        return
    for i, v in enumerate(items):
        if _is_bool(v) or isinstance(v, (str, bytes)):
            raise _not_a_number(name, v, i, integral)


def as_vector(name: str, values, n: int | None, *, integral: bool) -> np.ndarray:
    """Return ``values`` as a 1-D finite, non-negative float64 or int64 array.

    ``n`` is the required length (``None``: any length >= 1). Sizes
    (``integral=True``) are rounded up to whole bytes; times stay float64.
    Bools and strings, which numpy converts, are refused (ChainError naming
    ``name[index]``).
    """
    _check_numbers(name, values, integral)
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ChainError(f"{name} must be a sequence of numbers, got {values!r}",
                         field=name) from e
    if arr.ndim != 1:
        raise ChainError(f"{name} must be one-dimensional (one value per stage), "
                         f"got shape {arr.shape}", field=name)
    if n is not None and arr.shape[0] != n:
        raise ChainError(f"{name} has {arr.shape[0]} entries but the chain has {n} stages "
                         "(u_f fixes the number of stages); give one value per stage",
                         field=name)
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        i = int(bad[0])
        raise ChainError(f"{name}[{i}] = {arr[i]} is not finite; every value must be a "
                         "finite number", field=name, index=i)
    bad = np.flatnonzero(arr < 0)
    if bad.size:
        i = int(bad[0])
        raise ChainError(f"{name}[{i}] = {arr[i]} is negative; times (s) and sizes (bytes) "
                         "must be >= 0", field=name, index=i)
    if integral:
        # Integers stay exact: through float64, sizes above 2**53 bytes were
        # rounded, down as well as up (2**54 + 2 became 2**54, less than given).
        exact = np.asarray(values)
        exact = exact if exact.dtype.kind in "iu" else None
        big = (exact if exact is not None else arr) >= (MAX_BYTES if exact is not None
                                                        else float(MAX_BYTES))
        if big.any():
            i = int(np.flatnonzero(big)[0])
            raise ChainError(f"{name}[{i}] = {arr[i]:.3g} bytes is too large (limit 2**62)",
                             field=name, index=i)
        return exact.astype(np.int64) if exact is not None else np.ceil(arr).astype(np.int64)
    return arr.copy()


def is_int(value) -> bool:
    """An int or numpy integer, not a bool: a count, or a byte size taken exactly
    (through float, sizes above 2**53 round, up as well as down)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_scalar(name: str, value, *, integral: bool):
    """Validate one finite non-negative number (bytes rounded up when ``integral``)."""
    if _is_array(value):
        # float() takes torch.tensor([3]) (numpy 2 refuses np.array([3])): refuse
        # both, as rtmem.units does; one value passed as an array is a mistake
        raise ChainError(f"{name} must be one number, got an array of shape "
                         f"{tuple(value.shape)}: {value!r}; pass a scalar (x.item())",
                         field=name)
    if _is_bool(value) or isinstance(value, (str, bytes)):    # float() converts them
        raise _not_a_number(name, value, None, integral)
    try:
        v = float(value)
    except (TypeError, ValueError) as e:
        raise ChainError(f"{name} must be a number, got {value!r}", field=name) from e
    if not math.isfinite(v) or v < 0:
        raise ChainError(f"{name} = {value!r} must be finite and >= 0", field=name)
    exact = integral and is_int(value)     # exact above 2**53, as in as_vector
    if integral and (int(value) if exact else v) >= MAX_BYTES:
        raise ChainError(f"{name} = {value!r} bytes is too large (limit 2**62)", field=name)
    return (int(value) if exact else int(math.ceil(v))) if integral else v


def check_time_bound(n: int, sum_f: float, sum_b: float, u_loss: float, *, what: str,
                     formula: str, values: str) -> None:
    """Raise :class:`~rtmem.errors.ChainError` unless ``(n + 1) * sum_f + sum_b +
    u_loss`` (seconds, or the caller's time unit) is finite.

    Times are summed in float64 by the simulator and the DPs: finite but huge times
    overflow to inf there (an "inf" makespan, a JSON Infinity, or an instance the
    DPs report as infeasible). This bounds the makespan of any schedule they
    build on ``n`` forward steps whose times add up to ``sum_f`` once: no step
    runs forward more than n + 1 times (Revolve with 3 slots: n (n + 1) / 2
    forwards in all). ``what`` names the times ("the chain's times"), ``formula``
    spells the bound in the caller's notation and ``values`` gives its terms; the
    error's ``field`` is ``"u_f"`` when the forward part alone overflows, else
    ``"u_b"``."""
    with np.errstate(over="ignore"):     # overflow is what is checked here
        forward = (n + 1) * sum_f
        bound = forward + sum_b + u_loss
    if not math.isfinite(bound):
        raise ChainError(f"{what} are too large: {formula}, the longest makespan a planner "
                         f"may compute, overflows a float64 ({values}); express times in "
                         "larger units", field="u_f" if not math.isfinite(forward) else "u_b")


def type_label(obj, expected: type) -> str:
    """``obj``'s type name for a "got ..." message; when it is named like
    ``expected`` but is another class, says where it comes from: the usual cause
    is the source tree's ``planners/`` imported as a top-level package (running
    from a checkout), a second copy of ``rtmem.planners`` whose classes are not
    rtmem's."""
    cls = type(obj)
    if cls.__name__ != expected.__name__ or cls is expected:
        return cls.__name__
    return (f"{cls.__module__}.{cls.__qualname__}, a different class from "
            f"{expected.__module__}.{expected.__qualname__} (a second import of the "
            f"planners, e.g. `import planners` from a source checkout; import them "
            f"from rtmem.planners)")


def check_chain(chain, what: str) -> None:
    """``chain`` must be a :class:`~rtmem.planners.Chain` (``what``: the caller)."""
    from .chain import Chain
    if not isinstance(chain, Chain):
        raise TypeError(f"{what} plans a Chain (rtmem.planners.Chain, builtin(), "
                        f"from_spec() or profile_sequential()), got "
                        f"{type_label(chain, Chain)}")


def check_int(name: str, value, *, low: int = 0, high: int | None = None, error=None,
              hint: str = "", **fields) -> int:
    """An integer argument as a Python int: an ``int`` or numpy integer in
    ``low..high`` (``high=None``: no upper bound). A bool, a float (even 2.0), a
    string or a sequence is refused, never truncated or iterated: every count of
    the planners (stages, slots, segments, branch lengths, flags) goes through
    here, so they accept the same values. ``error`` is the exception type
    (default :class:`~rtmem.errors.RtmemError`; ``fields`` go to it, e.g.
    ``field=`` for :class:`~rtmem.errors.ChainError`); ``hint`` ends the message."""
    error = error or RtmemError
    if not is_int(value) or value < low or (high is not None and value > high):
        want = f"in {low}..{high}" if high is not None else f">= {low}"
        raise error(f"{name} must be an integer {want}, got {value!r}"
                    + (f"; {hint}" if hint else ""), **fields)
    return int(value)


def check_flags(what: str, **flags) -> None:
    """Each of ``flags`` is a bool (or numpy bool): a string such as "no" or a
    count would otherwise switch an option on. None is left to the caller."""
    for name, value in flags.items():
        if value is not None and not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{what}: {name} must be True or False, got {value!r}")


def check_count(name: str, value) -> int:
    """A count argument (slots, segments, slot_bytes): an integer >= 1."""
    return check_int(name, value, low=1)


def simulation_args(chain, schedule, platform):
    """The checked arguments of a simulator (the jitted one and the reference):
    TypeError for a non-Chain, non-Platform or a schedule that is neither a
    Schedule nor its text, ScheduleError for an op out of range. Returns the
    schedule (parsed from text)."""
    from .chain import Chain
    from .platform import Platform
    from .schedule import Schedule
    if not isinstance(chain, Chain):
        raise TypeError(f"chain must be a Chain, got {type_label(chain, Chain)}")
    if isinstance(schedule, str):
        schedule = Schedule.from_text(schedule)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule or its text, got "
                        f"{type_label(schedule, Schedule)}")
    if not isinstance(platform, Platform):
        raise TypeError(f"platform must be a Platform, got {type_label(platform, Platform)}")
    check_ranges(chain, schedule)
    return schedule


def check_ranges(chain, schedule) -> None:
    """Raise ScheduleError for the first op whose stage or activation index is
    out of range for ``chain`` (shared by the simulator and the lifetimes)."""
    from .schedule import ACTIVATION_OPS
    n = chain.n
    # every index within the stages' range (the common case) is within both
    # limits: the np.isin below was ~12% of plan_sequential's time, one
    # simulation per segment count
    if schedule.stage.size == 0 or int(schedule.stage.max()) <= n - 1:
        return
    is_act = np.isin(schedule.op, [int(o) for o in ACTIVATION_OPS])
    # the loss passes too: Schedule stores its stage as 0 and a chain has n >= 1
    limit = np.where(is_act, n, n - 1)
    bad = schedule.stage > limit
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        what = f"activation index {int(schedule.stage[k])} (valid: 0..{n})" if is_act[k] \
            else f"stage {int(schedule.stage[k])} (valid: 0..{n - 1})"
        raise ScheduleError(f"op {k} ({schedule.op_text(k)}): {what} is out of range for "
                            f"a chain of {n} stages", op_index=k, reason="stage-range")


def refuse_no_recompute(chain, what: str, why: str) -> None:
    """Raise :class:`~rtmem.errors.ChainError` (``field="no_recompute"``,
    ``index`` the first flagged stage) when ``chain`` marks stages
    ``no_recompute`` and the planner ``what`` cannot honour that (``why``): the
    chain, not the budget, is what this planner cannot take."""
    if not chain.recomputable:
        stages = np.flatnonzero(chain.no_recompute).tolist()
        raise ChainError(f"{what}: the chain marks stages {stages} no_recompute (they modify "
                         f"their input in place), which {what} cannot honour ({why}); plan "
                         f"it with plan_remat, which runs those stages once",
                         field="no_recompute", index=stages[0])
