"""Exception types of rtmem.

Every error rtmem raises on purpose is one of these, so callers can catch them
precisely. Messages say what was wrong, give the numbers, and say what to do.

This module is a leaf: it imports nothing from rtmem, so the planners (which must
not depend on the runtime) can use it too.
"""

from __future__ import annotations

__all__ = [
    "RtmemError",
    "ChainError",
    "ScheduleError",
    "PlatformError",
    "InfeasibleError",
    "OutOfMemoryError",
    "UnitError",
]


class RtmemError(Exception):
    """Base class of every error raised by rtmem."""


class ChainError(RtmemError, ValueError):
    """A :class:`~rtmem.planners.Chain` was built from invalid data.

    ``field`` names the offending array (``"u_f"``, ``"x"``, ...) and ``index``
    the first bad stage, or ``None`` when the problem is not tied to one stage.
    """

    def __init__(self, message: str, *, field: str | None = None, index: int | None = None):
        super().__init__(message)
        self.field = field
        self.index = index

    def __reduce__(self):
        return (_rebuild_chain_error, (self.args[0], self.field, self.index))


def _rebuild_chain_error(message, field, index):
    return ChainError(message, field=field, index=index)


class ScheduleError(RtmemError, ValueError):
    """A schedule is malformed, or breaks an invariant when simulated.

    Attributes
    ----------
    op_index:
        Position of the first offending operation in the schedule (``None`` for
        problems found after the last operation, e.g. a missing backward step).
    reason:
        Short machine-readable code of the violated invariant, e.g.
        ``"missing-input"``, ``"memory-limit"``, ``"backward-order"``.
    over_bytes:
        For ``"memory-limit"``: by how many bytes the limit was exceeded.
    """

    def __init__(self, message: str, *, op_index: int | None = None,
                 reason: str | None = None, over_bytes: int | None = None):
        super().__init__(message)
        self.op_index = op_index
        self.reason = reason
        self.over_bytes = over_bytes

    def __reduce__(self):
        return (_rebuild_schedule_error,
                (self.args[0], self.op_index, self.reason, self.over_bytes))


def _rebuild_schedule_error(message, op_index, reason, over_bytes):
    return ScheduleError(message, op_index=op_index, reason=reason, over_bytes=over_bytes)


class PlatformError(RtmemError, ValueError):
    """A :class:`~rtmem.planners.Platform` was given an invalid memory size,
    bandwidth or channel model."""


class UnitError(RtmemError, ValueError):
    """A human-readable quantity (``"12GiB"``, ``"12 GB/s"``) could not be parsed."""


class InfeasibleError(RtmemError):
    """No schedule exists under the given memory budget.

    ``min_feasible`` is the smallest budget (bytes) at which the planner finds a
    schedule, when it can be computed (``None`` otherwise).
    """

    def __init__(self, message: str, *, budget: int | None = None,
                 min_feasible: int | None = None):
        super().__init__(message)
        self.budget = budget
        self.min_feasible = min_feasible

    def __reduce__(self):
        return (_rebuild_infeasible, (self.args[0], self.budget, self.min_feasible))


def _rebuild_infeasible(message, budget, min_feasible):
    return InfeasibleError(message, budget=budget, min_feasible=min_feasible)


class OutOfMemoryError(RtmemError, MemoryError):
    """An allocator could not satisfy a request.

    ``requested`` is the size asked for (bytes) and ``stats`` a snapshot of the
    allocator statistics at the time of the failure. The allocator state is
    unchanged after this error.
    """

    def __init__(self, message: str, *, requested: int | None = None, stats=None):
        super().__init__(message)
        self.requested = requested
        self.stats = stats

    def __reduce__(self):
        return (_rebuild_oom, (self.args[0], self.requested, self.stats))


def _rebuild_oom(message, requested, stats):
    return OutOfMemoryError(message, requested=requested, stats=stats)
