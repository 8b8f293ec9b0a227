"""The allocator core's value types: :class:`Block` (one range of a slab, the
handle the allocator hands out), :class:`AllocatorStats` (a snapshot of its
counters), and the packing of a block's address into the integer keys of the
free-block indexes (NOTE [ Allocator structure ] in allocator.py).

Separate from allocator.py, which holds the algorithm and re-exports these
names (import them from :mod:`rtmem.allocator`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from .units import format_bytes

__all__ = ["AllocatorStats", "Block", "align_up", "DEFAULT_ALIGNMENT"]

#: Default alignment of every block, bytes (CUDA's cudaMalloc guarantees 256).
DEFAULT_ALIGNMENT = 256

_OFFSET_BITS = 40          # offsets < 1 TiB per slab
_SLAB_BITS = 16            # < 65536 slabs
_SIZE_SHIFT = _OFFSET_BITS + _SLAB_BITS
_ADDR_MASK = (1 << _SIZE_SHIFT) - 1
_MAX_SLAB_BYTES = 1 << _OFFSET_BITS

_LIVE, _READY, _PENDING, _DEAD = 0, 1, 2, 3
_STATE_NAMES = {_LIVE: "live", _READY: "ready", _PENDING: "pending"}


def _byte_count(value, name: str) -> int:
    """An integer byte count as a Python int (numpy integers too). A bool, a float
    or a string is refused, not truncated: the core takes exact byte counts (the
    arenas parse "1MiB"-style sizes before they get here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer number of bytes, got {value!r} "
                        f"({type(value).__name__})")
    return int(value)


def _request(nbytes, what: str = "allocate") -> int:
    """A requested size: :func:`_byte_count`, and >= 0 (a ValueError naming
    ``what``, e.g. ``"resize to"``)."""
    nbytes = _byte_count(nbytes, "nbytes")
    if nbytes < 0:
        raise ValueError(f"cannot {what} a negative size ({nbytes} bytes)")
    return nbytes


def align_up(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment`` (both in bytes)."""
    return -(-int(nbytes) // alignment) * alignment


def _slab_geometry(initial_bytes, alignment, max_bytes, growth_bytes, size_name: str):
    """Validated ``(alignment, initial, max_bytes, growth_bytes)`` of an
    allocator, all bytes, sizes rounded up to ``alignment`` (both allocator
    cores take the same arguments). ``size_name`` is what the caller calls
    ``initial_bytes``, for the messages (an arena's ``nbytes``: its users were
    told to lower an argument it lacks)."""
    alignment = _byte_count(alignment, "alignment")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= 1 byte, got {alignment}")
    initial_bytes = _byte_count(initial_bytes, size_name)
    if initial_bytes <= 0:
        raise ValueError(f"{size_name} must be > 0 bytes, got {initial_bytes}; "
                         f"pass the slab size in bytes (e.g. 1 << 30)")
    initial = align_up(initial_bytes, alignment)
    if initial >= _MAX_SLAB_BYTES:
        # Checked before growth_bytes, which defaults to it: the message named
        # growth_bytes to users who never passed it.
        raise ValueError(f"{size_name}={initial_bytes:,} B: a slab must be smaller "
                         f"than 1 TiB; give a smaller {size_name} and let it grow "
                         f"by slabs (max_bytes=, growth_bytes=)")
    for name, value in (("max_bytes", max_bytes), ("growth_bytes", growth_bytes)):
        # align_up(-1) is 0: a negative size was taken as 0 (growth_bytes=-1
        # silently meant exactly-sized slabs), or named as below initial_bytes.
        if value is not None and _byte_count(value, name) < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value}")
    max_bytes = initial if max_bytes is None else \
        align_up(_byte_count(max_bytes, "max_bytes"), alignment)
    if max_bytes < initial:
        raise ValueError(f"max_bytes ({max_bytes} B) is below {size_name} "
                         f"({initial} B); raise max_bytes or lower {size_name}")
    growth_bytes = initial if growth_bytes is None else \
        align_up(_byte_count(growth_bytes, "growth_bytes"), alignment)
    if growth_bytes >= _MAX_SLAB_BYTES:
        raise ValueError(f"growth_bytes={growth_bytes:,} B: slabs must be smaller "
                         f"than 1 TiB; grow by smaller slabs")
    return alignment, initial, max_bytes, growth_bytes


def _trim_slabs(allocator, drop) -> int:
    """Release every slab but the first that ``drop(first, nbytes)`` finds
    entirely free (and takes out of the allocator's index); return the bytes
    released. Both cores keep their slabs alike: ``_slabs`` (id -> (handle,
    nbytes, first block)), ``_free_ids`` (ids for reuse), ``_reserved`` and
    ``slab_source``."""
    released = 0
    for sid in list(allocator._slabs):
        handle, nbytes, first = allocator._slabs[sid]
        if sid and drop(first, nbytes):
            del allocator._slabs[sid]
            allocator._free_ids.append(sid)
            allocator._reserved -= nbytes
            released += nbytes
            if allocator.slab_source is not None:
                allocator.slab_source.release_slab(handle)
    return released


class Block:
    """A contiguous range ``[offset, offset + size)`` of slab ``slab``, bytes.

    ``requested`` is what the caller asked for (<= ``size``), -1 while the block
    has never been handed out; ``stream`` is the stream a live block was
    allocated for or a pending block freed on (None once ready, so that a free
    block keeps no stream alive); ``event`` (pending blocks only) is the event
    after which any stream may reuse it; ``addr`` packs (slab, offset) and never
    changes while the block exists (a block's offset is fixed for its life).
    Users treat a block as an opaque handle; its fields are guarded by the owning
    allocator's lock.
    """

    __slots__ = ("slab", "offset", "size", "requested", "state", "prev", "next",
                 "stream", "event", "owner", "addr", "__weakref__")

    def __init__(self, slab, offset, size, owner, prev=None, next=None):
        self.slab = slab
        self.offset = offset
        self.size = size
        self.owner = owner
        self.addr = (slab << _OFFSET_BITS) | offset
        self.prev = prev
        self.next = next
        self.requested = -1
        self.state = _READY
        self.stream = self.event = None

    @property
    def end(self) -> int:
        """First byte after the block, relative to its slab."""
        return self.offset + self.size

    @property
    def is_live(self) -> bool:
        """True while the block is allocated."""
        return self.state == _LIVE

    def _key(self) -> int:
        return (self.size << _SIZE_SHIFT) | self.addr

    def __repr__(self) -> str:
        return (f"<Block slab={self.slab} offset={self.offset} size={self.size} "
                f"requested={self.requested} {_STATE_NAMES.get(self.state, 'dead')}>")


@dataclass(frozen=True)
class AllocatorStats:
    """A snapshot of an allocator, all sizes in bytes.

    ``allocated_bytes`` counts aligned block sizes, ``requested_bytes`` what
    callers asked for (the difference is alignment overhead). ``free_bytes`` =
    ``reserved_bytes - allocated_bytes`` and includes ``pending_bytes`` (freed but
    waiting for an event before other streams may reuse them; stream-ordered
    frees count here until their stamp completes, NOTE [ Stream-ordered frees ]).
    A free is stamped lazily: at the allocator's next stamp-and-poll round
    (every 256 deferred frees), at an allocation that finds no free block, or
    at the allocator's ``flush()`` / the arena's ``trim()``; the cuda backend's
    ``synchronize()`` stamps and then retires every such free made before it.
    Until then ``pending_bytes`` stays high even after the device finished the
    work (e.g. after ``torch.cuda.synchronize()``), although the memory is
    reusable by its own stream.
    ``fragmentation`` = 1 - largest free block / free bytes, in [0, 1] (0 when
    nothing is free). ``peak_bytes`` is the highest ``allocated_bytes`` seen.
    """

    allocated_bytes: int
    requested_bytes: int
    reserved_bytes: int
    peak_bytes: int
    free_bytes: int
    pending_bytes: int
    largest_free_bytes: int
    fragmentation: float
    alloc_count: int
    free_count: int
    live_blocks: int
    slabs: int

    def describe(self) -> str:
        """One line for error messages and logs."""
        return (f"{format_bytes(self.allocated_bytes)} allocated "
                f"({format_bytes(self.requested_bytes)} requested) of "
                f"{format_bytes(self.reserved_bytes)} reserved in {self.slabs} slab(s); "
                f"{format_bytes(self.free_bytes)} free, largest free block "
                f"{format_bytes(self.largest_free_bytes)} "
                f"(fragmentation {self.fragmentation:.2f}), "
                f"{format_bytes(self.pending_bytes)} waiting on events")
