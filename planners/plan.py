"""The value every planner returns: a schedule plus what it costs.

A :class:`Plan` is data, not behaviour: executors replay ``plan.schedule``, tables
and plots read ``makespan``/``peak``. Planners fill ``makespan`` and ``peak`` from
the simulator (:func:`rtmem.planners.simulate`) run on the returned schedule, so
the numbers are those of the oracle, not a planner's own estimate; a planner's
prediction, when it has one, goes into ``info`` (e.g. ``info["dp_makespan"]``).
"""

from __future__ import annotations

import json
import math
import numbers
import warnings
from dataclasses import dataclass, field

from rtmem.errors import ScheduleError

from ._documents import JsonFile, check_document, is_json_number, parse_document
from ._validation import MAX_BYTES, is_int
from .schedule import Schedule

__all__ = ["ChainMismatchWarning", "Plan", "as_budget"]

_FORMAT = "rtmem.plan"
_VERSION = 1
_REQUIRED = ("schedule", "makespan", "peak", "budget", "algorithm")


#: The ``Plan.info`` key of the digest of the chain a plan was made for
#: (:meth:`Chain.digest <rtmem.planners.Chain.digest>`, 64 hex digits).
CHAIN_DIGEST_KEY = "chain_sha256"


class ChainMismatchWarning(RuntimeWarning):
    """Warned by :meth:`Plan.check_chain` for a chain other than the one the plan
    was made for (a ``RuntimeWarning``: turn it into an error with
    ``warnings.simplefilter("error", ChainMismatchWarning)``)."""


def planned_info(chain, info: dict) -> dict:
    """``info`` plus what every planner's :class:`Plan` carries about its chain:
    ``"chain_sha256"`` (:meth:`Chain.digest <rtmem.planners.Chain.digest>`), so
    that :meth:`Plan.check_chain` tells another chain, and ``"input_bytes"``
    (``chain.x0``, bytes) when the chain gives its input's size, so that the
    executor can tell a batch larger than the one the sizes were profiled for."""
    info = dict(info)
    info.setdefault(CHAIN_DIGEST_KEY, chain.digest())
    if chain.x0 > 0:
        info.setdefault("input_bytes", int(chain.x0))
    return info


@dataclass(frozen=True, eq=False)
class Plan(JsonFile):
    """A schedule with its simulated cost.

    Attributes
    ----------
    schedule:
        The operations to execute (:class:`~rtmem.planners.Schedule`).
    makespan:
        Simulated makespan of ``schedule``, seconds (finite, >= 0).
    peak:
        Simulated peak device memory, bytes (weights, weight gradients and the
        chain input included, as the simulator counts them); a whole number in
        ``0 .. 2**62 - 1``, compared exactly when given as an int.
    budget:
        Memory budget the plan was made for, bytes (``math.inf``: unlimited).
    algorithm:
        Short name of the planner, e.g. ``"rotor"``, ``"sequential"``.
    info:
        Planner-specific extras (JSON-serializable, numbers finite: ``None``
        for an infinite DP prediction): DP prediction, slot size, number of
        segments, ... Every planner also records ``"chain_sha256"``, the
        digest of the chain it planned (:meth:`Chain.digest
        <rtmem.planners.Chain.digest>`; :meth:`check_chain` compares it), and
        ``"input_bytes"``, the chain input's bytes (``Chain.x0``, the profiled
        batch) when the chain gives it (> 0): the plan's memory holds for that
        batch, and :class:`~rtmem.torch.ScheduleExecutor` warns at a larger one.
        Plans saved before ``"chain_sha256"`` existed load without it.

    Non-finite numbers (a NaN or infinite makespan or peak, NaN anywhere,
    infinity in ``info``) raise :class:`~rtmem.errors.ScheduleError` naming the
    field; only ``budget`` may be ``math.inf`` (unlimited), written ``"inf"``.
    """

    schedule: Schedule
    makespan: float
    peak: int
    budget: float
    algorithm: str
    info: dict = field(default_factory=dict)

    _DOCUMENT = ("plan", ScheduleError)

    def __post_init__(self):
        if not isinstance(self.schedule, Schedule):
            raise TypeError(f"schedule must be a Schedule, got {type(self.schedule).__name__}")
        try:
            makespan, peak, budget = (float(v) for v in (self.makespan, self.peak,
                                                         self.budget))
            info = dict(self.info)
        except (TypeError, ValueError) as e:
            raise ScheduleError(f"plan: makespan, peak and budget must be numbers and info "
                                f"a dict ({e})", reason="parse") from None
        # an int peak is compared exactly: float(2**62 - 1) == 2**62, so a peak a few
        # hundred bytes under the limit was refused (and reported as "must be >= 0")
        exact_peak = int(self.peak) if is_int(self.peak) else peak
        # A finite makespan: no planner returns an infinite one (an infeasible
        # budget raises InfeasibleError, and Chain bounds the times so that the
        # simulator's sums cannot overflow), and to_json wrote it as Infinity,
        # which is not JSON.
        bad = _bounds_failed(makespan=(self.makespan, 0 <= makespan < math.inf, "s",
                                       "finite and >= 0"),
                             peak=(self.peak, 0 <= exact_peak, "bytes", ">= 0"),
                             budget=(self.budget, budget > 0, "bytes", "> 0"))  # NaN: False
        if not bad and not exact_peak < MAX_BYTES:
            bad = [f"peak {self.peak!r} bytes must be below 2**62 (the planners count "
                   f"bytes in int64)"]
        if not bad:
            bad = [f"info{path} {value!r} must be finite (write None for a value that "
                   f"does not exist, as the planners do)" for path, value in _nonfinite(info)]
        if bad:
            raise ScheduleError(f"plan: {'; '.join(bad)}; a Plan's numbers come from the "
                                "simulator: check the file, or the planner that built it",
                                reason="parse")
        if peak != math.floor(peak):
            raise ScheduleError(f"plan: peak {self.peak!r} must be a whole number of bytes",
                                reason="parse")
        object.__setattr__(self, "makespan", makespan)
        # integers stay exact: through float, peaks and budgets above 2**53 bytes
        # would be rounded and differ from the simulator's (int) peak
        object.__setattr__(self, "peak", _exact_int(self.peak, peak))
        object.__setattr__(self, "budget", budget if math.isinf(budget)
                           else _exact_int(self.budget, budget))
        object.__setattr__(self, "algorithm", str(self.algorithm))
        object.__setattr__(self, "info", info)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (self.schedule == other.schedule and self.makespan == other.makespan
                and self.peak == other.peak and self.budget == other.budget
                and self.algorithm == other.algorithm and self.info == other.info)

    __hash__ = None

    def overhead(self, reference_makespan: float) -> float:
        """Relative slowdown against ``reference_makespan`` (s): 0.25 means 25 %
        slower. Use the no-rematerialization makespan as the reference."""
        if reference_makespan <= 0:
            return 0.0 if self.makespan <= 0 else math.inf
        return self.makespan / reference_makespan - 1.0

    def check_chain(self, chain) -> bool | None:
        """Whether ``chain`` is the :class:`~rtmem.planners.Chain` this plan was
        made for: True when its :meth:`~rtmem.planners.Chain.digest` is the one
        in ``info["chain_sha256"]``, None when the plan records none (a file
        saved by an older rtmem, a Plan built by hand), and False otherwise,
        after a :class:`ChainMismatchWarning`. A warning, not an error: the
        schedule may still be valid for an edited or re-profiled chain (simulate
        it there to know), but ``makespan`` and ``peak`` were simulated on the
        other chain and do not hold for this one."""
        from .chain import Chain
        if not isinstance(chain, Chain):
            raise TypeError(f"chain must be a Chain, got {type(chain).__name__}")
        recorded = self.info.get(CHAIN_DIGEST_KEY)
        if not isinstance(recorded, str):
            return None
        digest = chain.digest()
        if digest == recorded:
            return True
        label = f"{chain.name!r} ({chain.n} stages)" if chain.name else f"({chain.n} stages)"
        warnings.warn(
            f"this {self.algorithm} plan was made for another chain (chain_sha256 "
            f"{recorded[:12]}..., the chain {label} has {digest[:12]}...): its makespan "
            f"{self.makespan:.6g} s and peak {self.peak:,} bytes were simulated on that "
            f"chain and do not hold for this one; simulate the plan on this chain "
            f"(rtmem simulate) or plan again", ChainMismatchWarning, stacklevel=2)
        return False

    def __repr__(self) -> str:
        return (f"Plan({self.algorithm}: makespan {self.makespan:.6g} s, peak {self.peak:,} B, "
                f"budget {self.budget:,} B, {len(self.schedule)} ops)")

    # ------------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        """Plain-Python form; the schedule is stored in its text form."""
        return {"format": _FORMAT, "version": _VERSION, "algorithm": self.algorithm,
                "makespan": self.makespan, "peak": self.peak,
                "budget": "inf" if math.isinf(self.budget) else self.budget,
                "schedule": str(self.schedule), "info": self.info}

    def to_json(self, indent: int | None = None) -> str:
        """Serialize to JSON; :meth:`from_json` reads it back exactly."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d) -> "Plan":
        """Inverse of :meth:`to_dict`. Each field must have the JSON type
        :meth:`to_dict` writes (``schedule`` and ``algorithm`` strings,
        ``makespan``, ``peak`` and ``budget`` numbers, ``budget`` also
        ``"inf"``, ``info`` an object); :class:`~rtmem.errors.ScheduleError`
        names a field that has not, and a key it does not know (a typo)."""
        check_document(d, kind="plan", fmt=_FORMAT, version=_VERSION, error=ScheduleError,
                       required=_REQUIRED, optional=("info",), reason="parse")
        # The constructor converts what it is given (str(), float()), so a list
        # schedule was parsed as its repr ("unknown operation \"['F_all\""), a null
        # algorithm became "None" and a string makespan or a true peak a number.
        for key, ok, form in _FIELDS:
            if key in d and not ok(d[key]):
                raise ScheduleError(f"plan document: {key} must be {form}, got {d[key]!r}",
                                    reason="parse")
        budget = math.inf if d["budget"] == "inf" else d["budget"]
        return cls(schedule=Schedule.from_text(d["schedule"]), makespan=d["makespan"],
                   peak=d["peak"], budget=budget, algorithm=d["algorithm"],
                   info=d.get("info", {}))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Parse a plan written by :meth:`to_json`."""
        return cls.from_dict(parse_document(text, kind="plan", fmt=_FORMAT, version=_VERSION,
                                            error=ScheduleError, required=_REQUIRED,
                                            optional=("info",), reason="parse"))


# (field, its check, the form it must have) of a plan document
_FIELDS = (("schedule", lambda v: isinstance(v, str), "the text form (a string)"),
           ("algorithm", lambda v: isinstance(v, str),
            "a string (the planner's name, e.g. \"rotor\")"),
           ("makespan", is_json_number, "a number (seconds)"),
           ("peak", is_json_number, "a number (bytes)"),
           ("budget", lambda v: v == "inf" or is_json_number(v),
            "a number (bytes) or \"inf\" (unlimited)"),
           ("info", lambda v: isinstance(v, dict), "an object (the planner's extras)"))


def _exact_int(value, as_float: float) -> int:
    """``value`` as an int: exactly when it is an integer (``int(float(v))`` rounds
    above 2**53), else its float ``as_float`` rounded down."""
    if is_int(value):
        return int(value)
    return int(as_float)


def _nonfinite(value, path=""):
    """``(path, number)`` for each NaN or infinite float in ``value`` (nested
    dicts and lists), ``path`` as ``['key'][0]``: JSON has no such numbers
    (``json.dumps`` writes NaN and Infinity, which strict readers refuse)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _nonfinite(v, f"{path}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _nonfinite(v, f"{path}[{i}]")
    elif isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) \
            and not math.isfinite(value):
        yield path, value


def _bounds_failed(**checks) -> list[str]:
    """For each ``name=(given, ok, unit, bound)`` whose ``ok`` is false (NaN compares
    false, so a NaN fails every bound), the phrase "name given unit must be bound"."""
    return [f"{name} {given!r} {unit} must be {bound}"
            for name, (given, ok, unit, bound) in checks.items() if not ok]


def as_budget(memory) -> float:
    """Memory budget in bytes from an int, a string like ``"12GiB"``, ``"inf"`` or a
    :class:`~rtmem.planners.Platform`; ``math.inf`` means unlimited. Raises
    :class:`~rtmem.errors.PlatformError` for anything else."""
    from .platform import Platform
    if not isinstance(memory, Platform):
        memory = Platform(memory)
    return memory.memory if math.isinf(memory.memory) else int(memory.memory)
