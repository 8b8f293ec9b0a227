"""Schedules of the classical strategies, built directly (no planning).

These are the baselines every planner is compared with (thesis-remat.md §4):
``store_all`` is plain autograd (everything kept), ``sequential`` is PyTorch's
``checkpoint_sequential`` (Chen et al.'s periodic segments).
"""

from __future__ import annotations

from rtmem.errors import ChainError

from .schedule import Op, Schedule

__all__ = ["store_all_schedule", "sequential_schedule", "segment_bounds"]


def _check_n(n) -> int:
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ChainError(f"the number of stages must be an integer >= 1, got {n!r}")
    return int(n)


def store_all_schedule(n: int) -> Schedule:
    """``F_all 0 .. F_all n-1, L, B n-1 .. B 0``: no recomputation, maximal memory."""
    n = _check_n(n)
    ops = [(Op.F_ALL, i) for i in range(n)] + [(Op.LOSS, 0)]
    ops += [(Op.B, i) for i in reversed(range(n))]
    return Schedule.from_ops(ops)


def segment_bounds(n: int, segments: int) -> list[tuple[int, int]]:
    """Stage ranges ``[start, end)`` that ``torch.utils.checkpoint.checkpoint_sequential``
    uses: ``segments - 1`` segments of ``n // segments`` stages, the rest in the last."""
    n = _check_n(n)
    if isinstance(segments, bool) or int(segments) != segments or not 1 <= segments <= n:
        raise ChainError(f"segments must be an integer in 1..{n} for a chain of {n} "
                         f"stages, got {segments!r}")
    size = n // segments
    bounds = [(k * size, (k + 1) * size) for k in range(segments - 1)]
    bounds.append(((segments - 1) * size, n))
    return bounds


def sequential_schedule(n: int, segments: int) -> Schedule:
    """The ``checkpoint_sequential`` schedule with ``segments`` segments.

    Forward: each segment but the last keeps its input (``F_ck``) and runs the rest
    without saving (``F_none``); the last segment runs ``F_all``. Backward: the last
    segment's ``B``s, then for each earlier segment (in reverse) ``F_all`` over it
    from its kept input, then its ``B``s. Example (2.1) of the thesis.
    """
    bounds = segment_bounds(n, segments)
    ops = []
    for s, e in bounds[:-1]:
        ops.append((Op.F_CK, s))
        ops += [(Op.F_NONE, i) for i in range(s + 1, e)]
    s, e = bounds[-1]
    ops += [(Op.F_ALL, i) for i in range(s, e)]
    ops.append((Op.LOSS, 0))
    ops += [(Op.B, i) for i in reversed(range(s, e))]
    for s, e in reversed(bounds[:-1]):
        ops += [(Op.F_ALL, i) for i in range(s, e)]
        ops += [(Op.B, i) for i in reversed(range(s, e))]
    return Schedule.from_ops(ops)
