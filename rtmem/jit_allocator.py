"""A compiled allocator core: :class:`JitBestFitAllocator`.

The same best fit with splitting and coalescing as
:class:`~rtmem.allocator.BestFitAllocator` (same alignment rules, same choice of
block: smallest, then lowest address), with its blocks and index in one
``int64`` array that ``numba.njit`` functions update (_jit_core.py, NOTE [ Jit
allocator state ]). An allocation or a free is one compiled call plus a small
handle: about twice the pairs per second of the Python core
(``bench/allocator.py``).

What it leaves out, for that speed:

* frees behind an event (``event=``, or ``ordered=True``, which records an
  event on the stream at once) wait for that event before *any* stream reuses
  the bytes, the freeing stream included (BestFitAllocator lets that stream
  reuse them at once, and stamps ordered frees lazily);
* handles are :class:`JitBlock` objects, not :class:`~rtmem.allocator.Block`;
  :meth:`~JitBestFitAllocator.live_blocks` returns new handles to the live
  allocations (any of them frees it) without their stream.

NOTE [ Jit allocator threads ]
A numba function that is not ``nogil`` holds the GIL for its whole call, so
each compiled call is atomic with respect to other Python threads: the hot
paths (an allocation that fits, a plain free) take no lock. Everything that
spans several calls or touches Python-side state (growing the block table,
adding or dropping slabs, the pending frees, resize, stats) runs under
``self._lock`` (reentrant: a moving resize allocates). When the table grows,
the old array is marked stale and refuses every call (Rule 5 of NOTE [ Jit
allocator state ]), so a thread that loaded it just before the swap retries
under the lock, where the swap is complete.
"""

from __future__ import annotations

import threading
from collections import deque
from itertools import count

from ._blocks import (_LIVE, _MAX_SLAB_BYTES, _OFFSET_BITS, _PENDING, _READY, _SLAB_BITS,
                      DEFAULT_ALIGNMENT, AllocatorStats, _request, _slab_geometry, _trim_slabs,
                      align_up)
from ._stream_order import check_free_args
from .errors import DoubleFreeError, InvalidPointerError, OutOfMemoryError
from .units import format_bytes

__all__ = ["JitBestFitAllocator", "JitBlock"]

_core = None            # rtmem._jit_core, imported by the first allocator (numba)
_alloc = _free = None   # its two hot functions, as globals for the hot paths
_HDR = _W = _IDX_MASK = None    # _jit_core's layout, bound with it by _load
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1


def _load():
    global _core, _alloc, _free, _HDR, _W, _IDX_MASK
    if _core is None:
        from . import _jit_core
        _jit_core.warm_up()
        _HDR, _W, _IDX_MASK = _jit_core.HDR, _jit_core.W, _jit_core.IDX_MASK
        _alloc, _free = _entry(_jit_core.alloc), _entry(_jit_core.free)
        _core = _jit_core
    return _core


def _entry(dispatcher):
    """``dispatcher``'s machine code for ``(S, int)``, called without the
    dispatcher's type resolution: ~30% of a hot call on bench/allocator.py.
    Safe because the hot paths pass only the state array (always int64, 1-D,
    C-contiguous) and a checked Python int below 2**63. The dispatcher itself
    where numba offers no entry point (an internal of numba's compile results)."""
    from numba import types
    try:
        return dispatcher.overloads[types.Array(types.int64, 1, "C"), types.int64].entry_point
    except (AttributeError, KeyError):
        return dispatcher


class JitBlock:
    """Handle of one allocation of a :class:`JitBestFitAllocator`: the range
    ``[offset, offset + size)`` of slab ``slab``, bytes. ``requested`` is what
    the caller asked for, ``stream`` the stream it was allocated for. Treat it
    as opaque; it stays valid (and ``offset`` fixed) until freed."""

    __slots__ = ("owner", "ticket", "addr", "size", "requested", "stream", "__weakref__")

    @property
    def offset(self) -> int:
        """Start of the block in its slab, bytes."""
        return self.addr & _OFFSET_MASK

    @property
    def slab(self) -> int:
        """Id of the slab holding the block."""
        return self.addr >> _OFFSET_BITS

    @property
    def end(self) -> int:
        """First byte after the block, relative to its slab."""
        return self.offset + self.size

    @property
    def is_live(self) -> bool:
        """True while the block is allocated (this handle was not freed)."""
        return self.owner.owns(self)

    def __repr__(self) -> str:
        state = "live" if self.is_live else "freed"
        return (f"<JitBlock slab={self.slab} offset={self.offset} size={self.size} "
                f"requested={self.requested} {state}>")


_new_handle = JitBlock.__new__


class JitBestFitAllocator:
    """Best-fit offset allocator compiled with numba; the interface of
    :class:`~rtmem.allocator.BestFitAllocator` (same parameters, errors and
    statistics), with the differences listed in :mod:`rtmem.jit_allocator`.

    Parameters
    ----------
    initial_bytes, alignment, max_bytes, growth_bytes, slab_source, event_source:
        As for :class:`~rtmem.allocator.BestFitAllocator` (bytes).
    capacity:
        Initial room of the block table, in blocks (it doubles when full).

    Thread safety: NOTE [ Jit allocator threads ]. The first allocator of a
    process compiles the core, or loads it from numba's cache (seconds once).
    """

    def __init__(self, initial_bytes: int, *, alignment: int = DEFAULT_ALIGNMENT,
                 max_bytes: int | None = None, growth_bytes: int | None = None,
                 slab_source=None, event_source=None, capacity: int = 1024,
                 _size_name: str = "initial_bytes"):
        self.alignment, initial, self.max_bytes, self.growth_bytes = _slab_geometry(
            initial_bytes, alignment, max_bytes, growth_bytes, _size_name)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1 (blocks), got {capacity!r}")
        core = _load()
        self.slab_source = slab_source
        self.event_source = event_source
        self._lock = threading.RLock()
        self._S = core.new_state(capacity, self.alignment)
        self._mv = memoryview(self._S)
        self._slabs = {}        # slab id -> (handle, nbytes, index of its first block)
        self._next_slab = 0
        self._free_ids = []     # ids of dropped slabs, for reuse
        self._reserved = 0
        self._fifo = {}         # stream -> deque of (sequence, event, block index)
        self._seq = count()     # order of deferred frees, to wait for the oldest
        self._deferred = 0      # deferred frees since the last poll
        self._add_slab(initial)

    # ------------------------------------------------------------- the table
    def _call(self, fn, *args):
        """``fn(S, *args)`` under the lock, growing the block table when full."""
        while True:
            r = fn(self._S, *args)
            if r != _core.NO_ROOM:
                return r
            self._grow_table()

    def _grow_table(self) -> None:
        S = _core.grow(self._S, 2 * int(self._S[_core.BCAP]))
        self._S, self._mv = S, memoryview(S)

    def _add_slab(self, nbytes: int) -> None:
        if not self._free_ids and self._next_slab >= (1 << _SLAB_BITS):
            raise ValueError("more than 65536 slabs; use a larger growth_bytes")
        if not _core.has_room(self._S):
            self._grow_table()      # before the slab source, which may be slow
        handle = self.slab_source.add_slab(nbytes) if self.slab_source is not None else None
        sid = self._free_ids[-1] if self._free_ids else self._next_slab
        try:
            # grows the table again if a lock-free allocation took the slot
            first = self._call(_core.add_slab, sid, nbytes)
        except BaseException:       # no memory for the table: give the slab back
            if handle is not None:
                self.slab_source.release_slab(handle)
            raise
        if self._free_ids:
            self._free_ids.pop()
        else:
            self._next_slab += 1
        self._slabs[sid] = (handle, nbytes, first)
        self._reserved += nbytes

    def slab_handle(self, slab: int):
        """The slab source's handle of slab ``slab`` (``None`` for virtual slabs)."""
        return self._slabs[slab][0]

    def trim(self) -> int:
        """Release every slab except the first that is entirely free, after
        waiting for every deferred free (:meth:`flush`). Returns the bytes
        released."""
        with self._lock:
            self._flush_locked()
            return _trim_slabs(self, lambda first, nbytes: _core.drop_slab(self._S, first,
                                                                           nbytes))

    # ------------------------------------------------------------ public API
    def allocate(self, nbytes: int, stream=None) -> JitBlock:
        """Allocate ``nbytes`` bytes (>= 0) for use on ``stream``; return a
        :class:`JitBlock` of ``nbytes`` rounded up to ``alignment``. On a miss
        it retires the deferred frees whose event completed, then waits for the
        others oldest first until the request fits, then grows by a slab when
        ``max_bytes`` allows, else raises
        :class:`~rtmem.errors.OutOfMemoryError` (with ``requested`` and
        ``stats``) leaving every allocation untouched."""
        if nbytes.__class__ is not int or nbytes < 0 or nbytes >= _MAX_SLAB_BYTES:
            nbytes = _request(nbytes)
            t = self._allocate_slow(nbytes)
        elif self._fifo:        # deferred frees to retire first
            t = self._allocate_slow(nbytes)
        else:
            t = _alloc(self._S, nbytes)
            if t < 0:
                t = self._allocate_slow(nbytes)
        block = _new_handle(JitBlock)
        block.owner = self
        block.ticket = t
        # The block's table row: the same in an array that grew since (copied)
        base = _HDR + (t & _IDX_MASK) * _W
        mv = self._mv
        block.addr = mv[base]
        block.size = mv[base + 1]
        block.requested = nbytes
        block.stream = stream
        return block

    def _allocate_slow(self, nbytes: int) -> int:
        with self._lock:
            if self._fifo:
                self._poll()
            size = align_up(max(nbytes, 1), self.alignment)
            while size < _MAX_SLAB_BYTES:
                t = self._call(_alloc, nbytes)
                if t >= 0:
                    return t
                if not self._wait_oldest():
                    break
            return self._grow(nbytes, size)

    def _grow(self, nbytes: int, size: int) -> int:
        """Allocate in a new slab holding ``size`` bytes; return the ticket.
        OutOfMemoryError when max_bytes, the slab ids or the slab source refuse
        (state unchanged)."""
        # At most what max_bytes leaves: a last, smaller slab when it holds size
        grow = min(max(self.growth_bytes, size), self.max_bytes - self._reserved)
        no_ids = not self._free_ids and self._next_slab >= (1 << _SLAB_BITS)
        why = ("No slab holds 1 TiB or more: split the allocation."
               if size >= _MAX_SLAB_BYTES else
               f"All {1 << _SLAB_BITS} slab ids are in use: free buffers and trim(), "
               f"or grow by larger slabs (growth_bytes=)." if no_ids else
               "Free buffers first, raise the arena size or max_bytes, or plan with a "
               "smaller memory budget.")
        if grow >= size and size < _MAX_SLAB_BYTES and not no_ids:
            try:
                self._add_slab(grow)
            except OutOfMemoryError as exc:     # the slab source has no memory left
                stats = self._stats_locked()
                raise OutOfMemoryError(
                    f"out of memory: cannot allocate {nbytes:,} bytes: growing by a "
                    f"{grow:,}-byte slab failed ({exc}); {stats.describe()}. {why}",
                    requested=nbytes, stats=stats) from exc
            t = self._call(_alloc, nbytes)
            assert t >= 0, "a new slab of the request's size did not hold it"
            return t
        stats = self._stats_locked()
        raise OutOfMemoryError(
            f"out of memory: cannot allocate {nbytes:,} bytes ({format_bytes(size)} "
            f"aligned to {self.alignment} B); {stats.describe()}; growth limit "
            f"max_bytes={self.max_bytes:,} B. {why}", requested=nbytes, stats=stats)

    def _handle_index(self, block) -> int:
        """The table index of live ``block`` of this allocator, or raise."""
        if block.__class__ is not JitBlock or block.owner is not self:
            raise InvalidPointerError(
                f"{block!r} was not allocated by this allocator (foreign pointer); "
                f"free it with the allocator or arena that allocated it")
        idx = _core.live_index(self._S, block.ticket)
        if idx < 0:
            raise DoubleFreeError(
                f"{block!r} is not allocated (double free or use of a freed block); "
                f"each allocation must be freed exactly once")
        return idx

    def deallocate(self, block: JitBlock, *, stream=None, event=None,
                   ordered: bool = False) -> None:
        """Free ``block``. With ``event`` (recorded on ``stream`` after the
        block's last use) or ``ordered=True`` (an event is recorded on
        ``stream`` now, with ``event_source``), the bytes are reused, by any
        stream, once that event completed. Double frees raise
        :class:`~rtmem.errors.DoubleFreeError`, blocks of another allocator
        :class:`~rtmem.errors.InvalidPointerError`; the state is then
        unchanged."""
        if ordered or event is not None or block.__class__ is not JitBlock \
                or block.owner is not self or _free(self._S, block.ticket):
            self._deallocate_slow(block, stream, event, ordered)

    def _deallocate_slow(self, block, stream, event, ordered) -> None:
        check_free_args(self.event_source, stream, event, ordered)
        with self._lock:
            self._handle_index(block)
            if ordered:
                event = self.event_source(stream)
            if event is None or event.query():
                _free(self._S, block.ticket)
                return
            r = _core.defer(self._S, block.ticket)
            assert r == 0, f"defer of a checked live block returned {r}"
            fifo = self._fifo.get(stream)
            if fifo is None:
                fifo = self._fifo[stream] = deque()
            fifo.append((next(self._seq), event, block.ticket & _IDX_MASK))
            self._deferred += 1
            if self._deferred >= 256:
                self._poll()    # bound the pending bytes of a stream nobody allocates on

    def _poll(self) -> None:
        """Retire every deferred free whose event completed (per stream, in
        record order: a stream completes its events in order)."""
        self._deferred = 0
        for stream in list(self._fifo):
            fifo = self._fifo[stream]
            while fifo and fifo[0][1].query():
                _core.retire(self._S, fifo.popleft()[2])
            if not fifo:
                del self._fifo[stream]

    def _wait_oldest(self) -> bool:
        """Wait for the oldest deferred free's event and retire it; False when
        nothing is deferred."""
        if not self._fifo:
            return False
        stream = min(self._fifo, key=lambda s: self._fifo[s][0][0])
        fifo = self._fifo[stream]
        _, event, idx = fifo[0]
        event.synchronize()
        fifo.popleft()
        _core.retire(self._S, idx)
        if not fifo:
            del self._fifo[stream]
        return True

    def flush(self) -> None:
        """Wait for every deferred free and make its bytes reusable."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        while self._wait_oldest():
            pass

    def owns(self, block) -> bool:
        """True if ``block`` is a live block of this allocator."""
        return block.__class__ is JitBlock and block.owner is self and \
            _core.live_index(self._S, block.ticket) >= 0

    def check_free(self, block, *, stream=None, event=None, ordered: bool = False) -> None:
        """Raise what :meth:`deallocate` would raise for these arguments,
        changing nothing."""
        check_free_args(self.event_source, stream, event, ordered)
        with self._lock:
            self._handle_index(block)

    def resize(self, block: JitBlock, nbytes: int, stream=None) -> JitBlock:
        """Resize live ``block`` to ``nbytes`` bytes; return the (possibly new)
        block. Shrinking, and growing into a ready block right after it, keep
        the block (the same handle, its offset and bytes); otherwise a new block
        is allocated and the old one freed at once (``result is not block``:
        the caller copies the data, see BestFitAllocator.resize). Raises
        :class:`~rtmem.errors.OutOfMemoryError` with ``block`` still live."""
        nbytes = _request(nbytes, "resize to")
        with self._lock:
            self._handle_index(block)
            if nbytes < _MAX_SLAB_BYTES and \
                    self._call(_core.resize, block.ticket, nbytes) == 0:
                block.size = self._mv[_HDR + (block.ticket & _IDX_MASK) * _W + 1]
                block.requested = nbytes
                return block
            new = self.allocate(nbytes, stream)
            _free(self._S, block.ticket)
            return new

    def fits_in_place(self, block: JitBlock, nbytes: int, stream=None) -> bool:
        """Whether :meth:`resize` to ``nbytes`` would keep ``block`` in place."""
        nbytes = _request(nbytes, "resize to")
        with self._lock:
            idx = self._handle_index(block)
            size = align_up(max(nbytes, 1), self.alignment)
            return size < _MAX_SLAB_BYTES and bool(_core.fits_in_place(self._S, idx, size))

    def stats(self) -> AllocatorStats:
        """A snapshot of the counters (see :class:`~rtmem.allocator.AllocatorStats`);
        retires the deferred frees whose event completed first."""
        with self._lock:
            if self._fifo:
                self._poll()
            return self._stats_locked()

    def _stats_locked(self) -> AllocatorStats:
        c = _core
        S = _core.snapshot(self._S).tolist()
        largest = S[_HDR]
        # pending blocks change only under the lock, which is held
        mv = self._mv
        for fifo in self._fifo.values():
            for _, _, idx in fifo:
                largest = max(largest, mv[_HDR + idx * _W + 1])
        allocated = S[c.ALLOCATED]
        free = self._reserved - allocated
        n_alloc, n_free = S[c.NALLOC], S[c.NFREE]
        return AllocatorStats(
            allocated_bytes=allocated, requested_bytes=S[c.REQUESTED],
            reserved_bytes=self._reserved, peak_bytes=S[c.PEAK], free_bytes=free,
            pending_bytes=S[c.PENDING], largest_free_bytes=largest,
            fragmentation=(1.0 - largest / free) if free else 0.0,
            alloc_count=n_alloc, free_count=n_free, live_blocks=n_alloc - n_free,
            slabs=len(self._slabs))

    def reset_peak(self) -> None:
        """Set ``peak_bytes`` to the current ``allocated_bytes``."""
        with self._lock:
            self._call(_core.reset_peak)

    @staticmethod
    def _rows(S, first: int):
        """``(index, row)`` of a slab's blocks in address order from its first
        block's index, ``row`` a block's fields (from a snapshot ``S``)."""
        idx = first
        while idx >= 0:
            row = S[_HDR + idx * _W:_HDR + (idx + 1) * _W].tolist()
            yield idx, row
            idx = row[_core.F_NEXT]

    def live_blocks(self) -> list[JitBlock]:
        """New handles to the live blocks, in address order (``stream`` None)."""
        with self._lock:
            out, S = [], self._S.copy()
            for _, _, first in self._slabs.values():
                for idx, row in self._rows(S, first):
                    if row[_core.F_STATE] != _LIVE:
                        continue
                    block = _new_handle(JitBlock)
                    block.owner, block.ticket = self, row[_core.F_GEN] << 32 | idx
                    block.addr, block.size = row[_core.F_ADDR], row[_core.F_SIZE]
                    block.requested, block.stream = row[_core.F_REQ], None
                    out.append(block)
            return out

    def _check_invariants(self) -> None:
        """Assert the rules of NOTE [ Jit allocator state ] on a snapshot;
        raise AssertionError. For tests (linear in the blocks)."""
        c = _core
        with self._lock:
            S = self._S.copy()
            a = self.alignment
            assert not S[c.STALE], "the current table is marked stale"
            seen, ready, pending = set(), [], set()
            allocated = requested = pending_bytes = n_live = reserved = 0
            for sid, (_, nbytes, first) in self._slabs.items():
                reserved += nbytes
                prev, end, prev_state = -1, 0, None
                for idx, row in self._rows(S, first):
                    assert idx not in seen, f"block {idx} linked twice"
                    seen.add(idx)
                    addr, size, state = row[c.F_ADDR], row[c.F_SIZE], row[c.F_STATE]
                    assert row[c.F_PREV] == prev, f"block {idx}: prev link broken"
                    assert addr == (sid << _OFFSET_BITS | end), \
                        f"block {idx} at {addr:#x}, expected slab {sid} offset {end}"
                    assert size > 0 and size % a == 0 and addr % a == 0, \
                        f"block {idx} misaligned or empty"
                    assert state in (_LIVE, _READY, _PENDING), f"dead block {idx} linked"
                    assert not (state == prev_state == _READY), \
                        f"two adjacent ready blocks at {idx}"
                    if state == _LIVE:
                        n_live += 1
                        allocated += size
                        requested += row[c.F_REQ]
                        assert size == align_up(max(row[c.F_REQ], 1), a), \
                            f"live block {idx} of {size} B for {row[c.F_REQ]} B"
                    elif state == _READY:
                        ready.append(idx)
                    else:
                        pending.add(idx)
                        pending_bytes += size
                    prev, end, prev_state = idx, end + size, state
                assert end == nbytes, f"slab {sid} tiled to {end} of {nbytes} B"
            keys = S[S[c.KBASE]:S[c.KBASE] + S[c.NKEYS]].tolist()
            order = [(int(S[_HDR + i * _W + 1]), int(S[_HDR + i * _W])) for i in keys]
            assert order == sorted(order), "the key array is unsorted"
            assert sorted(keys) == sorted(ready), "the key array is not the ready blocks"
            listed = [idx for fifo in self._fifo.values() for _, _, idx in fifo]
            assert sorted(listed) == sorted(pending), "pending blocks and FIFOs differ"
            spare, idx = 0, int(S[c.SPARE])
            while idx >= 0:
                assert S[_HDR + idx * _W + c.F_STATE] == c.DEAD, f"spare {idx} not dead"
                spare += 1
                idx = int(S[_HDR + idx * _W + c.F_NEXT])
            assert spare + len(seen) == S[c.HIWATER], "a block slot is lost"
            assert (allocated, requested, pending_bytes) == \
                (S[c.ALLOCATED], S[c.REQUESTED], S[c.PENDING]), "counters drifted"
            assert n_live == S[c.NALLOC] - S[c.NFREE], "alloc/free counts drifted"
            assert reserved == self._reserved, "reserved bytes drifted"
            assert S[c.PEAK] >= allocated, "peak below allocated"
