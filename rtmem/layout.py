"""Static layout: offsets assigned offline from buffer lifetimes.

When the plan is known before training, every buffer's lifetime is known too
(:func:`rtmem.planners.lifetimes.lifetimes`), so offsets can be chosen once,
with global knowledge, instead of online by the allocator.

NOTE [ Greedy-by-size packing ]
Buffers are placed by decreasing aligned size (ties: earlier allocation first).
Each goes into the smallest gap, among the buffers already placed whose
lifetimes intersect its own, that is large enough; with none, on top of them.
Lifetimes are inclusive op-index intervals; two buffers conflict iff
``alloc_i <= free_j and alloc_j <= free_i``. The result is verified by
:func:`verify_layout` (no two conflicting buffers share a byte), and reports
``reserved_bytes`` (the slab size needed) against ``peak_live_bytes`` (the lower
bound: the most bytes live at once).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .allocator import DEFAULT_ALIGNMENT, align_up
from .errors import LayoutError
from .units import is_whole

__all__ = ["Layout", "layout_for", "plan_layout", "verify_layout"]


@dataclass(frozen=True, eq=False)
class Layout:
    """Offsets (bytes) of buffers in one slab.

    ``offsets[i]`` and ``sizes[i]`` (aligned bytes) place buffer ``i``, live over
    op indices ``[alloc[i], free[i]]``. ``reserved_bytes``: highest end offset;
    ``peak_live_bytes``: most aligned bytes live at once (a lower bound on
    ``reserved_bytes``).
    """

    offsets: np.ndarray
    sizes: np.ndarray
    alloc: np.ndarray
    free: np.ndarray
    alignment: int
    reserved_bytes: int
    peak_live_bytes: int

    @property
    def overhead(self) -> float:
        """``reserved_bytes / peak_live_bytes`` (>= 1; 1.0 for an empty layout)."""
        return self.reserved_bytes / self.peak_live_bytes if self.peak_live_bytes else 1.0

    def verify(self) -> None:
        """Raise :class:`~rtmem.errors.LayoutError` if two live buffers overlap."""
        verify_layout(self.offsets, self.sizes, self.alloc, self.free)


def _peak_live(alloc, free, sizes) -> int:
    if not len(sizes):
        return 0
    # A sweep over the sorted events, not an array over the whole op-index span:
    # that one took 8 bytes per index, so lifetimes [0, 0] and [10**9, 10**9]
    # allocated 8 GB (and indices near 2**62 raised "array is too big").
    # Inclusive lifetimes: at one index the allocations come before the frees.
    where = np.concatenate([alloc, free])
    is_free = np.repeat([0, 1], len(sizes))
    delta = np.concatenate([sizes, -sizes])
    return int(np.cumsum(delta[np.lexsort((is_free, where))]).max())


# Not units.is_whole (a yes/no): this converts, rounds up with ceil, and names the failure.
def _whole(value, what: str, ceil: bool):
    """One Python-object ``value`` as an int: rounded up with ``ceil``, else
    refused unless whole (as :func:`_ints` treats floats)."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{what} must be integers, got {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    try:
        finite = math.isfinite(value)
        whole = (math.ceil(value) if ceil else int(value)) if finite else None
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{what} must be integers, got {value!r}") from None
    if not finite:
        # raised outside the try, as _ints says it for float arrays: inside, the
        # except turned it into "must be integers, got nan"
        raise ValueError(f"{what} must be finite numbers")
    if not ceil and whole != value:
        raise ValueError(f"{what} must be whole numbers, got {value!r}")
    return whole


def _ints(values, what: str, *, ceil: bool = False) -> np.ndarray:
    """``values`` as int64 (fractions rounded up with ``ceil``), or a ValueError
    naming ``what``. numpy raised bare OverflowError / TypeError from deep
    inside for 2**64 or None, wrapped 2**63 and 1e30 to negative numbers, and
    truncated an op index of 0.5 to 0."""
    arr = np.asarray(values)
    # bools refused, as parse_bytes refuses them: a mask passed for sizes or
    # op indices is a mistake, not 0s and 1s
    if arr.dtype.kind not in "iufO":
        raise ValueError(f"{what} must be integers, got an array of {arr.dtype}")
    if arr.dtype.kind == "O":
        # Python objects (ints beyond int64, Fraction, Decimal): int() truncated
        # a Fraction(3, 2)-byte size to 1 and an op index of 1/2 to 0, where the
        # same float values round up or are refused
        arr = np.asarray([_whole(v, what, ceil) for v in arr.ravel()],
                         dtype=object).reshape(arr.shape)
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all():
            raise ValueError(f"{what} must be finite numbers")
        if ceil:
            arr = np.ceil(arr)
        elif (arr != np.floor(arr)).any():
            raise ValueError(f"{what} must be whole numbers, got {arr[arr != np.floor(arr)][0]}")
    # a uint64 or float cast wraps 2**63 and beyond silently (Python ints raise)
    too_big = arr.size and arr.dtype.kind in "uf" and \
        (arr.max() >= 2 ** 63 or arr.min() < -2 ** 63)
    try:
        if too_big:
            raise OverflowError
        return np.asarray(arr, np.int64)
    except (OverflowError, TypeError, ValueError):
        raise ValueError(f"{what} must be integers in [-2**63, 2**63), got "
                         f"{np.asarray(values).ravel()[:4].tolist()}") from None


def plan_layout(alloc, free, nbytes, *, alignment: int = DEFAULT_ALIGNMENT) -> Layout:
    """Assign offsets by NOTE [ Greedy-by-size packing ].

    ``alloc``/``free``: inclusive op-index intervals (ints, ``free >= alloc``);
    ``nbytes``: sizes in bytes (each rounded up to ``alignment``, bytes).
    """
    alloc = _ints(alloc, "alloc op indices")
    free = _ints(free, "free op indices")
    # Fractional sizes (e.g. from a Chain's scaled profile) round up, as the
    # docstring says: truncating gave a 256.5-byte buffer 256 bytes.
    nbytes = _ints(nbytes, "buffer sizes (bytes)", ceil=True)
    if not (alloc.shape == free.shape == nbytes.shape) or alloc.ndim != 1:
        raise ValueError(f"alloc, free and nbytes must be 1-D of one length, got "
                         f"shapes {alloc.shape}, {free.shape}, {nbytes.shape}")
    if (free < alloc).any():
        i = int(np.flatnonzero(free < alloc)[0])
        raise ValueError(f"buffer {i} is freed (op {free[i]}) before it is allocated "
                         f"(op {alloc[i]}); lifetimes are inclusive [alloc, free]")
    if (nbytes < 0).any():
        raise ValueError("buffer sizes must be >= 0 bytes")
    # is_whole: 256.0 passed the checks and then raised a bare TypeError at "&"
    if not is_whole(alignment) or alignment < 1 or int(alignment) & (int(alignment) - 1):
        raise ValueError(f"alignment must be a power of two >= 1 byte, got {alignment!r}")
    alignment = int(alignment)
    # Python ints: the sum of every aligned size bounds any offset + size, and
    # int64 arithmetic below must not wrap (2 x 2**62 gave a reserve of 2**62).
    aligned = [align_up(max(b, 1), alignment) for b in nbytes.tolist()]
    if sum(aligned) >= 1 << 63:
        # a bound for the int64 arithmetic, not the layout's peak (buffers never
        # live together could share bytes)
        raise ValueError("the buffers add up to 2**63 bytes or more, too large to lay "
                         "out in int64 offsets; give sizes in larger units")
    sizes = np.asarray(aligned, dtype=np.int64)
    order = np.lexsort((alloc, -sizes))
    offsets = np.full(len(sizes), -1, np.int64)
    placed = np.zeros(len(sizes), bool)
    for i in order:
        conflict = placed & (alloc <= free[i]) & (alloc[i] <= free)
        idx = np.flatnonzero(conflict)
        best, best_gap, top = -1, None, 0
        if idx.size:
            starts = offsets[idx]
            ends = starts + sizes[idx]
            srt = np.argsort(starts, kind="stable")
            size = sizes[i]
            for s, e in zip(starts[srt].tolist(), ends[srt].tolist()):
                gap = s - top
                if gap >= size and (best_gap is None or gap < best_gap):
                    best, best_gap = top, gap
                if e > top:
                    top = e
        offsets[i] = best if best >= 0 else top
        placed[i] = True
    reserved = int((offsets + sizes).max()) if len(sizes) else 0
    return Layout(offsets, sizes, alloc, free, int(alignment), reserved,
                  _peak_live(alloc, free, sizes))


def verify_layout(offsets, sizes, alloc, free) -> None:
    """Raise :class:`~rtmem.errors.LayoutError` naming the first two buffers that
    are live at the same time (inclusive op intervals) and overlap in bytes."""
    offsets = _ints(offsets, "offsets")
    sizes = _ints(sizes, "sizes")
    alloc = _ints(alloc, "alloc op indices")
    free = _ints(free, "free op indices")
    # Broadcasting would check mismatched arrays, and a negative size hides an
    # overlap: refuse both rather than pass a layout that was never checked.
    if not (offsets.shape == sizes.shape == alloc.shape == free.shape) or offsets.ndim != 1:
        raise ValueError(f"offsets, sizes, alloc and free must be 1-D of one length, got "
                         f"shapes {offsets.shape}, {sizes.shape}, {alloc.shape}, "
                         f"{free.shape}")
    if (sizes < 0).any():
        raise ValueError(f"buffer {int(np.flatnonzero(sizes < 0)[0])} has a negative size")
    if (free < alloc).any():
        # such a buffer is live at no op, so its overlaps went unchecked
        i = int(np.flatnonzero(free < alloc)[0])
        raise ValueError(f"buffer {i} is freed (op {free[i]}) before it is allocated "
                         f"(op {alloc[i]}); lifetimes are inclusive [alloc, free]")
    if len(sizes) and int(offsets.max()) + int(sizes.max()) >= 1 << 63:
        raise ValueError("a buffer ends beyond 2**63 bytes")
    if (offsets < 0).any():
        raise LayoutError(f"buffer {int(np.flatnonzero(offsets < 0)[0])} has no offset")
    ends = offsets + sizes
    for i in range(len(offsets)):
        clash = (alloc[i + 1:] <= free[i]) & (alloc[i] <= free[i + 1:]) & \
                (offsets[i + 1:] < ends[i]) & (offsets[i] < ends[i + 1:])
        if clash.any():
            j = i + 1 + int(np.flatnonzero(clash)[0])
            raise LayoutError(
                f"buffers {i} (ops {alloc[i]}..{free[i]}, bytes {offsets[i]}.."
                f"{ends[i]}) and {j} (ops {alloc[j]}..{free[j]}, bytes {offsets[j]}.."
                f"{ends[j]}) are live together and overlap; re-run plan_layout",
                pair=(i, j))


def layout_for(chain, schedule, *, alignment: int = DEFAULT_ALIGNMENT) -> Layout:
    """Static layout of the buffers of ``schedule`` run on ``chain``
    (:func:`rtmem.planners.lifetimes.lifetimes` then :func:`plan_layout`).

    The schedule is validated first (:func:`~rtmem.planners.simulate` with no
    memory limit): lifetimes of an invalid schedule, e.g. one with two losses,
    would lay out buffers no execution has. Raises
    :class:`~rtmem.errors.ScheduleError`.
    """
    import math

    from .planners import Platform, simulate
    from .planners.lifetimes import lifetimes
    simulate(chain, schedule, Platform(math.inf))
    lt = lifetimes(chain, schedule)
    return plan_layout(lt.alloc, lt.free, lt.nbytes, alignment=alignment)
