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
    "BackendError",
    "CuPyMissingError",
    "DoubleFreeError",
    "InvalidPointerError",
    "UseAfterFreeError",
    "ResidencyError",
    "OptimizerError",
    "NonFiniteGradientError",
    "LossScaleError",
    "KernelArgumentError",
    "LayoutError",
    "TraceError",
]


class RtmemError(Exception):
    """Base class of every error raised by rtmem.

    Subclasses take the message positionally and their attributes as optional
    keywords, so the default exception pickling (``type(err)(*err.args)`` and
    then the instance ``__dict__``) restores them: errors survive being sent
    from a worker process or a copy thread's queue without a custom reducer.
    """


class ChainError(RtmemError, ValueError):
    """A :class:`~rtmem.planners.Chain` was built from invalid data.

    ``field`` names the offending array (``"u_f"``, ``"x"``, ...) and ``index``
    the first bad stage, or ``None`` when the problem is not tied to one stage.
    """

    def __init__(self, message: str, *, field: str | None = None, index: int | None = None):
        super().__init__(message)
        self.field = field
        self.index = index


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


class PlatformError(RtmemError, ValueError):
    """A :class:`~rtmem.planners.Platform` was given an invalid memory size,
    bandwidth or channel model."""


class UnitError(RtmemError, ValueError):
    """A human-readable quantity (``"12GiB"``, ``"12 GB/s"``) could not be parsed."""


class InfeasibleError(RtmemError):
    """No schedule exists under the given memory budget.

    ``budget`` is the budget asked for and ``min_feasible`` the smallest budget at
    which the planner finds a schedule, when it can be computed (``None``
    otherwise), both in the planner's memory unit: bytes for the chain planners
    (:func:`~rtmem.planners.plan_remat` and the baselines), slots for the
    multi-chain DP (:func:`~rtmem.planners.multichain_schedule`).
    """

    def __init__(self, message: str, *, budget: int | None = None,
                 min_feasible: int | None = None):
        super().__init__(message)
        self.budget = budget
        self.min_feasible = min_feasible


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


class BackendError(RtmemError, RuntimeError):
    """A memory backend (``cuda`` or ``host``) is unavailable or one of its
    operations failed (a copy on a host stream thread raised, CuPy is missing,
    ``RTMEM_BACKEND`` names an unknown backend)."""


class CuPyMissingError(BackendError, ModuleNotFoundError):
    """CuPy is not installed, so the cuda backend is unavailable. A
    :class:`BackendError` (``except BackendError`` falls back to the host
    backend) and a ``ModuleNotFoundError``, as every missing optional extra."""


class DoubleFreeError(RtmemError, ValueError):
    """A block or buffer was freed twice. The allocator state is unchanged."""


class InvalidPointerError(RtmemError, ValueError):
    """A block or buffer handed to ``free`` does not belong to this allocator or
    arena (a foreign pointer). The allocator state is unchanged."""


class UseAfterFreeError(RtmemError, RuntimeError):
    """A freed :class:`~rtmem.buffer.Buffer` was used, or (debug mode) freed memory
    was written after its free: the poison pattern was found overwritten.

    ``offset`` is the first corrupted byte (relative to the slab) when known.
    """

    def __init__(self, message: str, *, offset: int | None = None):
        super().__init__(message)
        self.offset = offset


class ResidencyError(RtmemError, RuntimeError):
    """An illegal residency move: prefetching data with no host copy, offloading
    data already offloaded or in flight, evicting the only copy, ...

    ``state`` is the residency the buffer was in and ``action`` the move refused.
    """

    def __init__(self, message: str, *, state: str | None = None,
                 action: str | None = None):
        super().__init__(message)
        self.state = state
        self.action = action


class OptimizerError(RtmemError, ValueError):
    """An optimizer or its fused update kernel (CPU Adam) was given invalid
    arrays or hyperparameters: mismatched shapes or dtypes, non-contiguous or
    read-only arrays, a negative learning rate, betas outside [0, 1), eps <= 0, ...

    ``argument`` names the offending argument (``"exp_avg"``, ``"lr"``, ...)
    when the problem is tied to one.
    """

    def __init__(self, message: str, *, argument: str | None = None):
        super().__init__(message)
        self.argument = argument


class NonFiniteGradientError(OptimizerError, RuntimeError):
    """The gradients' total norm is inf or NaN where a finite one was required
    (``clip_grad_norm_(..., error_if_nonfinite=True)``). Also a RuntimeError, the
    class ``torch.nn.utils.clip_grad_norm_`` raises for the same case, so code
    written against torch catches it unchanged."""


class LossScaleError(RtmemError, RuntimeError):
    """A :class:`~rtmem.LossScaler` was called out of order (a second ``step`` of
    one optimizer before ``update``, an ``update`` with no ``step``), or its
    scale would fall below what the fused kernels can divide out (every
    gradient inf/NaN at every scale: a non-finite loss). The scaler is unchanged.
    A RuntimeError, as ``torch.amp.GradScaler``'s misuse errors."""


class LayoutError(RtmemError, ValueError):
    """A static memory layout places two buffers that are live at the same time
    in overlapping bytes. ``pair`` holds the indices of the first such buffers."""

    def __init__(self, message: str, *, pair: tuple | None = None):
        super().__init__(message)
        self.pair = pair


class KernelArgumentError(RtmemError, ValueError):
    """A compute kernel of :mod:`rtmem.kernels` (DHA kernels, their CPU twins)
    was given arrays it cannot use: wrong dtype, shape, layout or memory kind
    (a numpy array where a device/mapped array is needed, or the reverse), or
    token ids outside the embedding table.

    ``argument`` names the offending argument (``"weight"``, ``"ids"``, ...)
    when the problem is tied to one.
    """

    def __init__(self, message: str, *, argument: str | None = None):
        super().__init__(message)
        self.argument = argument


class TraceError(RtmemError, ValueError):
    """An allocation trace (:func:`rtmem.adaptors.load_trace`) is malformed: a
    line that is not JSON, a record without ``op``/``id``, an unknown op.
    ``line`` is the 1-based line (or record) number when known."""

    def __init__(self, message: str, *, line: int | None = None):
        super().__init__(message)
        self.line = line
