"""The allocator core: best-fit sub-allocation of offsets inside slabs.

The core knows nothing about memory: it hands out ``(slab, offset, size)`` triples
inside slabs obtained from an injected *slab source* (the arenas pass one that
calls the backend; tests pass none and get virtual slabs). Statistics beyond the
built-in counters, tracing, budgets and poisoning are adaptors
(:mod:`rtmem.adaptors`); the core has no optional branch.

NOTE [ Allocator structure ]
Layers, from small to large: a :class:`Block` is one contiguous range of a slab,
live or free; a *slab* is one upstream allocation (one ``cudaMalloc``, one numpy
slab); the :class:`BestFitAllocator` owns slabs and blocks.

Invariants (checked by ``_check_invariants()``, in _invariants.py; all guarded by
``self._lock``):

1. The blocks of a slab form an address-ordered doubly linked list (``prev``/
   ``next``) that tiles the slab exactly: each block starts where its ``prev``
   ends, the first at 0, the last ends at the slab size.
2. Every block size and offset is a multiple of ``alignment``; a live block's
   size is exactly ``align_up(max(requested, 1), alignment)``: best fit splits
   off the whole remainder, so there is no rounding beyond the alignment.
3. A free block is in exactly one index: ``_ready`` (reusable by any stream) or
   ``_pending[stream]`` (freed on ``stream`` behind an event that has not been
   seen complete; reusable by that stream only, since stream order already puts
   the new use after the old one). A pending block with no event yet is
   *unstamped* and listed in ``_unstamped[stream]``: see NOTE [ Stream-ordered
   frees ]. Live blocks are in no index (their number is
   ``_alloc_count - _free_count``); a block merged into a neighbour is dead. Dead
   blocks never handed out (``requested == -1``) wait in ``_spare`` for reuse by
   a split: no user holds them, so a merged block's double free is still caught.
4. Two adjacent *ready* blocks never coexist: they are merged on entry to
   ``_ready`` (coalescing), so freeing everything returns each slab to one block.
5. ``_allocated`` is the sum of live block sizes, ``_requested`` the sum of their
   requested bytes, ``_reserved`` the sum of slab sizes, ``_pending_bytes`` the
   sum of pending block sizes.
6. A Block object is handed out at most once: reusing the bytes of a block
   freed before gives them a fresh object (``_fresh``) and kills the old one,
   so a stale handle can never free or resize someone else's allocation.

Index keys are ints ``size << 56 | slab << 40 | offset`` kept sorted in plain
lists, so best fit is one ``bisect`` and ties go to the lowest address;
``_free_map`` maps ``addr`` to every free block. The hot paths inline.

Under memory pressure ``allocate`` waits for pending events (one at a time,
until the request fits) while holding the lock (numba's flush-and-retry): an
event must never depend on another allocation from the same allocator.

Frees behind a stream or an event: NOTE [ Stream-ordered frees ] in
_stream_order.py (a mixin of the allocator); the miss path (``_find_slow``:
stamp, poll, the stream's own runs, waits, growth, OutOfMemoryError) in
_miss.py, and ``resize``/``fits_in_place`` in _resize.py (two more).
"""

from __future__ import annotations

import threading
from bisect import bisect_left, insort

from ._blocks import (_ADDR_MASK, _DEAD, _LIVE, _MAX_SLAB_BYTES, _PENDING, _READY,
                      _SIZE_SHIFT, _SLAB_BITS, DEFAULT_ALIGNMENT, AllocatorStats, Block,
                      _request, _slab_geometry, _trim_slabs, align_up)
from ._invariants import _InvariantChecks
from ._miss import _MissPath
from ._resize import _InPlaceResize
from ._stream_order import _MAINTAIN_EVERY, _StreamOrderedFrees
from .errors import DoubleFreeError, InvalidPointerError

__all__ = ["AllocatorStats", "Block", "BestFitAllocator", "align_up", "DEFAULT_ALIGNMENT"]


class BestFitAllocator(_InPlaceResize, _MissPath, _StreamOrderedFrees, _InvariantChecks):
    """Best-fit offset allocator with splitting, coalescing and stream-ordered reuse.

    Parameters
    ----------
    initial_bytes:
        Size of the first slab, bytes (rounded up to ``alignment``; > 0).
    alignment:
        Alignment of every offset and size, bytes (power of two, default 256).
        Sizes are exact multiples of it: no power-of-two rounding.
    max_bytes:
        Cap on the total reserved bytes (all slabs), bytes. Default
        ``initial_bytes``: one slab, no growth.
    growth_bytes:
        Size of each extra slab, bytes (default ``initial_bytes``); a request
        larger than it gets a slab of exactly its aligned size.
    slab_source:
        Object with ``add_slab(nbytes) -> handle`` and ``release_slab(handle)``
        giving the backing memory; ``None`` for virtual slabs (offsets only).
    event_source:
        Callable ``stream -> event`` recording an event on ``stream`` (capturing
        the work enqueued so far) with ``query()`` and ``synchronize()``; needed
        for stream-ordered frees (``deallocate(..., ordered=True)``).

    Thread safety: one mutex (``self._lock``) guards every field; all public
    methods take it, so an allocator may be shared between threads.
    """

    def __init__(self, initial_bytes: int, *, alignment: int = DEFAULT_ALIGNMENT,
                 max_bytes: int | None = None, growth_bytes: int | None = None,
                 slab_source=None, event_source=None, _size_name: str = "initial_bytes"):
        # _size_name: what the caller calls initial_bytes, for the messages (an
        # arena's nbytes: its users were told to lower an argument it lacks)
        self.alignment, initial, self.max_bytes, self.growth_bytes = _slab_geometry(
            initial_bytes, alignment, max_bytes, growth_bytes, _size_name)
        self.slab_source = slab_source
        self.event_source = event_source
        self._lock = threading.Lock()
        self._slabs = {}            # slab id -> (handle, nbytes, first block)
        self._next_slab = 0
        self._free_ids = []         # ids of trimmed slabs, for reuse
        self._ready = []            # sorted keys of ready free blocks
        self._pending = {}          # stream -> sorted keys of pending free blocks
        self._fifo = {}             # stream -> deque of (event, block) in record order
        self._unstamped = {}        # stream -> blocks freed there with no event yet
        self._deferrals = 0         # deferred frees since the last _maintain
        self._maintain_every = _MAINTAIN_EVERY
        self._free_map = {}         # addr -> free block (ready or pending)
        self._spare = []            # dead blocks never handed out, for reuse
        self._reserved = self._allocated = self._requested = self._pending_bytes = 0
        self._peak = self._alloc_count = self._free_count = 0
        # (block, peak before it) for the allocation that last raised _peak, so
        # that _withdraw can take a refused block back out of peak_bytes too
        self._peak_raiser = None
        self._add_slab(initial)

    # ------------------------------------------------------------------ slabs
    def _add_slab(self, nbytes: int) -> None:
        if nbytes >= _MAX_SLAB_BYTES:
            raise ValueError(f"a slab of {nbytes:,} B is too large: slabs must be smaller "
                             f"than 1 TiB; use several smaller slabs (growth_bytes=)")
        if not self._free_ids and self._next_slab >= (1 << _SLAB_BITS):
            raise ValueError("more than 65536 slabs; use a larger growth_bytes")
        handle = self.slab_source.add_slab(nbytes) if self.slab_source is not None else None
        if self._free_ids:
            # Ids of trimmed slabs are reused (addresses pack 16 bits of slab id);
            # no index or live block names them any more.
            sid = self._free_ids.pop()
        else:
            sid = self._next_slab
            self._next_slab += 1
        block = Block(sid, 0, nbytes, self)
        self._slabs[sid] = (handle, nbytes, block)
        self._reserved += nbytes
        self._free_map[block.addr] = block
        insort(self._ready, block._key())

    def slab_handle(self, slab: int):
        """The slab source's handle of slab ``slab`` (``None`` for virtual slabs)."""
        return self._slabs[slab][0]

    def trim(self) -> int:
        """Release every slab except the first that is entirely free.

        Waits for every pending free first (``flush``: giving a slab back, e.g.
        with cudaFree, synchronizes anyway). Returns the bytes released. Used to
        give memory back after a peak.
        """
        with self._lock:
            self._flush_pending()
            self._spare.clear()
            return _trim_slabs(self, self._drop_if_free)

    def _drop_if_free(self, first: Block, nbytes: int) -> bool:
        if first.state != _READY or first.size != nbytes:
            return False
        self._remove_ready(first)
        return True

    # ---------------------------------------------------------------- indexes
    def _remove_ready(self, block: Block) -> None:
        del self._ready[bisect_left(self._ready, block._key())]
        del self._free_map[block.addr]

    def _make_ready(self, block: Block) -> None:
        """Insert a free block (in no index) into ``_ready``, merging ready
        neighbours (Rule 4). :meth:`deallocate` inlines this for a live block."""
        block.state, block.stream, block.event = _READY, None, None
        prev, nxt = block.prev, block.next
        if prev is not None and prev.state == _READY:
            self._remove_ready(prev)
            self._absorb(prev, block)
            block = prev
        if nxt is not None and nxt.state == _READY:
            self._remove_ready(nxt)
            self._absorb(block, nxt)
        self._free_map[block.addr] = block
        insort(self._ready, block._key())

    def _absorb(self, block: Block, nxt: Block) -> None:
        """Merge ``nxt`` (free, in no index) into its predecessor ``block``.

        A ready ``nxt`` never handed out becomes a spare; a pending one may still
        be named by a FIFO entry, so it is left to the garbage collector."""
        block.size += nxt.size
        after = block.next = nxt.next
        if after is not None:
            after.prev = block
        if nxt.requested < 0 and nxt.state == _READY:
            self._spare.append(nxt)
        nxt.state = _DEAD

    def _best_fit(self, size: int, stream):
        """Smallest free block of >= ``size`` bytes usable on ``stream``, or None."""
        probe = size << _SIZE_SHIFT
        best = None
        for keys in (self._ready, self._pending.get(stream, ())):
            i = bisect_left(keys, probe)
            if i < len(keys) and (best is None or keys[i] < best):
                best = keys[i]
        return None if best is None else self._free_map[best & _ADDR_MASK]

    # ------------------------------------------------------------- public API
    def allocate(self, nbytes: int, stream=None) -> Block:
        """Allocate ``nbytes`` bytes (>= 0) for use on ``stream``; return a Block.

        The block's size is ``nbytes`` rounded up to ``alignment``. On a miss the
        allocator waits for other streams' event-gated or stream-ordered frees,
        one event at a time until the request fits (never for ``stream``'s own,
        which it reuses at once), then grows by a slab when ``max_bytes`` allows,
        and otherwise raises
        :class:`~rtmem.errors.OutOfMemoryError` (with ``requested`` and ``stats``)
        leaving every allocation untouched.
        """
        if nbytes.__class__ is not int or nbytes < 0:
            nbytes = _request(nbytes)
        a = self.alignment
        size = (nbytes + a - 1) & -a if nbytes else a
        # acquire/release in try/finally: measurably cheaper than ``with`` here.
        lock = self._lock
        lock.acquire()
        try:
            if self._deferrals >= self._maintain_every:
                self._maintain()
            elif self._fifo and self._retirable():
                # Retire frees whose event completed before choosing: left pending,
                # such a block merges with no ready neighbour, so best fit carves
                # the ready space instead and an entirely free arena fragments
                # (torch's caching allocators also process events on every malloc).
                # One query per stream with stamped frees; unstamped ones wait for
                # their stamp (NOTE [ Stream-ordered frees ]).
                self._poll_pending()
            keys = self._ready
            probe = size << _SIZE_SHIFT
            i = bisect_left(keys, probe)
            # Best fit among the ready blocks and this stream's pending ones, which
            # it may reuse at once (stream order); i = -1 once a block is taken
            # from elsewhere than slot i of _ready.
            pend = self._pending.get(stream) if self._pending_bytes else None
            if pend:
                j = bisect_left(pend, probe)
                if j < len(pend) and (i == len(keys) or pend[j] < keys[i]):
                    key = pend.pop(j)
                    block = self._free_map.pop(key & _ADDR_MASK)
                    bsize = key >> _SIZE_SHIFT
                    self._pending_bytes -= bsize
                    event, block.event = block.event, None
                    i = -1
            if i >= 0:
                if i < len(keys):
                    key = keys[i]
                    block = self._free_map.pop(key & _ADDR_MASK)
                    bsize = key >> _SIZE_SHIFT
                else:
                    block = self._find_slow(size, nbytes, stream)
                    bsize = block.size
                    event, block.event = block.event, None
                    i = -1
            if block.requested >= 0:
                # Handed out before: a stale handle to it must stay dead, so the new
                # allocation gets a fresh Block in its place (Rule 6).
                block = self._fresh(block)
            if bsize > size:
                # Split off the remainder (a spare block if any) into the block's index
                # (a pending tail keeps the event); a ready key may reuse slot i.
                after, prev = block.next, block.prev
                spare = self._spare
                ready = block.state == _READY
                if ready and prev is not None and prev.state == _PENDING \
                        and (after is None or after.state != _PENDING):
                    # Hand out the tail: the free head stays beside the pending block
                    # and merges with it once that retires, where carving the head
                    # walled it in (NOTE [ Stream-ordered frees ]).
                    rest = block
                    block = spare.pop() if spare else Block.__new__(Block)
                    block.owner, block.slab, block.event = self, rest.slab, None
                    block.offset = rest.offset + bsize - size
                    block.addr = rest.addr + bsize - size
                    block.prev, block.next = rest, after
                    if after is not None:
                        after.prev = block
                    rest.next = block
                    rest.size = bsize - size
                    block.size = size
                else:
                    if spare:
                        rest = spare.pop()
                        rest.slab, rest.offset = block.slab, block.offset + size
                        rest.size, rest.addr = bsize - size, block.addr + size
                        rest.prev, rest.next = block, after
                        rest.state, rest.stream = _READY, None
                    else:
                        rest = Block(block.slab, block.offset + size, bsize - size, self,
                                     block, after)
                    if after is not None:
                        after.prev = rest
                    block.next = rest
                    block.size = size
                key = ((bsize - size) << _SIZE_SHIFT) | rest.addr
                self._free_map[rest.addr] = rest
                if i >= 0:
                    if i and keys[i - 1] > key:
                        del keys[i]
                        insort(keys, key, 0, i)
                    else:
                        keys[i] = key
                elif ready:
                    insort(keys, key)
                else:
                    self._defer(rest, block.stream, event)
            elif i >= 0:
                del keys[i]
            block.state, block.stream, block.requested = _LIVE, stream, nbytes
            self._alloc_count += 1
            self._requested += nbytes
            allocated = self._allocated + size
            self._allocated = allocated
            if allocated > self._peak:
                self._peak_raiser = (block, self._peak)
                self._peak = allocated
            return block
        finally:
            lock.release()

    def _fresh(self, block: Block) -> Block:
        """Replace ``block`` (free, in no index, handed out before) in its slab's
        list by a new Block object covering the same bytes; the old object dies,
        so a stale handle's free raises instead of freeing the new owner."""
        spare = self._spare
        new = spare.pop() if spare else Block.__new__(Block)
        new.slab, new.offset, new.size, new.addr = block.slab, block.offset, \
            block.size, block.addr
        new.owner, new.state, new.requested = self, block.state, -1
        new.stream, new.event = block.stream, None
        prev, nxt = new.prev, new.next = block.prev, block.next
        if prev is not None:
            prev.next = new
        else:
            handle, nbytes, _ = self._slabs[block.slab]
            self._slabs[block.slab] = (handle, nbytes, new)
        if nxt is not None:
            nxt.prev = new
        block.state = _DEAD
        return new

    def _check_owned_live(self, block) -> None:
        if type(block) is not Block or block.owner is not self:
            raise InvalidPointerError(
                f"{block!r} was not allocated by this allocator (foreign pointer); "
                f"free it with the allocator or arena that allocated it")
        if block.state != _LIVE:
            raise DoubleFreeError(
                f"{block!r} is not allocated (double free or use of a freed block); "
                f"each allocation must be freed exactly once")

    def deallocate(self, block: Block, *, stream=None, event=None,
                   ordered: bool = False) -> None:
        """Free ``block``.

        With ``event`` None the block is reusable at once by any stream (the
        caller guarantees no pending use). With an event, recorded on ``stream``
        after the block's last use, the block is reusable at once on ``stream``
        and on other streams once the event has completed. With ``ordered=True``
        (and no event) the free is stream-ordered like ``cudaFreeAsync``: the
        last use is enqueued on ``stream``, which may reuse the block at once;
        other streams wait for an event the allocator records later with its
        ``event_source`` (NOTE [ Stream-ordered frees ]). Double frees raise
        :class:`~rtmem.errors.DoubleFreeError`, blocks of another allocator
        :class:`~rtmem.errors.InvalidPointerError`; the state is then unchanged.
        """
        if ordered or event is not None:
            self._check_free_args(stream, event, ordered)
        lock = self._lock
        lock.acquire()
        try:
            if type(block) is not Block or block.owner is not self \
                    or block.state != _LIVE:
                self._check_owned_live(block)
            # A stream the indexes do not know may be a new short-lived one, after
            # others now dead: retire what completed first, so that their pending
            # frees stop holding them (NOTE [ Stream-ordered frees ]). Before the
            # counters change: a stamp or a query may raise (a closed stream's
            # event source), and the block is then still live, the state unchanged.
            if ordered:
                if stream not in self._pending:
                    self._maintain()
            elif event is not None:
                waiting = not event.query()
                if waiting and stream not in self._pending:
                    self._poll_pending()
            size = block.size
            self._allocated -= size
            self._requested -= block.requested
            self._free_count += 1
            if ordered:
                self._free_ordered(block, stream)
                self._deferrals += 1
                return
            if event is not None and waiting:
                self._defer(block, stream, event)
                self._deferrals += 1
                return
            # _make_ready inlined for a live block (in no index, no event): the call
            # cost ~3% of a pair on bench/allocator.py; keep the two in step.
            keys, prev, nxt = self._ready, block.prev, block.next
            block.stream = None     # ready blocks name no stream (nor keep it alive)
            if prev is not None and prev.state == _READY:
                psize = prev.size
                del keys[bisect_left(keys, (psize << _SIZE_SHIFT) | prev.addr)]
                prev.next = nxt
                if nxt is not None:
                    nxt.prev = prev
                block.state = _DEAD
                block = prev
                size += psize
            else:
                block.state = _READY
                self._free_map[block.addr] = block
            if nxt is not None and nxt.state == _READY:
                nsize = nxt.size
                del keys[bisect_left(keys, (nsize << _SIZE_SHIFT) | nxt.addr)]
                del self._free_map[nxt.addr]
                after = block.next = nxt.next
                if after is not None:
                    after.prev = block
                nxt.state = _DEAD
                if nxt.requested < 0:
                    self._spare.append(nxt)
                size += nsize
            block.size = size
            insort(keys, (size << _SIZE_SHIFT) | block.addr)
        finally:
            lock.release()

    def owns(self, block) -> bool:
        """True if ``block`` is a live block of this allocator."""
        return type(block) is Block and block.owner is self and block.state == _LIVE

    def check_free(self, block, *, stream=None, event=None, ordered: bool = False) -> None:
        """Raise what :meth:`deallocate` would raise for these arguments, changing
        nothing (adaptors that act on a block before freeing it check first, so
        a refused free leaves them unchanged too)."""
        if ordered or event is not None:
            self._check_free_args(stream, event, ordered)
        if not self.owns(block):
            with self._lock:
                self._check_owned_live(block)

    def flush(self) -> None:
        """Wait for every event-gated or stream-ordered free (recording the
        pending stamps first) and make the blocks reusable by all streams."""
        with self._lock:
            self._flush_pending()

    def stats(self) -> AllocatorStats:
        """A frozen snapshot of the counters (see :class:`AllocatorStats`)."""
        with self._lock:
            self._poll_pending()
            return self._stats_locked()

    def _stats_locked(self) -> AllocatorStats:
        largest = max((keys[-1] >> _SIZE_SHIFT for keys in
                       (self._ready, *self._pending.values()) if keys), default=0)
        free = self._reserved - self._allocated
        return AllocatorStats(
            allocated_bytes=self._allocated, requested_bytes=self._requested,
            reserved_bytes=self._reserved, peak_bytes=self._peak, free_bytes=free,
            pending_bytes=self._pending_bytes, largest_free_bytes=largest,
            fragmentation=(1.0 - largest / free) if free else 0.0,
            alloc_count=self._alloc_count, free_count=self._free_count,
            live_blocks=self._alloc_count - self._free_count, slabs=len(self._slabs))

    def reset_peak(self) -> None:
        """Set ``peak_bytes`` to the current ``allocated_bytes``."""
        with self._lock:
            self._peak = self._allocated
            self._peak_raiser = None

    def _withdraw(self, block: Block) -> None:
        """Take back ``block``, which :meth:`allocate` has just handed out and
        nobody used, as if the allocation had never happened: the block is
        freed, and ``alloc_count``, ``free_count`` and ``peak_bytes`` are as
        before it. For an adaptor that refuses a block after the fact
        (:class:`~rtmem.adaptors.PoisonAdaptor` on a lost poison): a plain
        :meth:`deallocate` counted the refused request as one allocation and
        one free, and its bytes in the peak.

        The peak is restored when this block's allocation was the last to raise
        it (else a later allocation set it, and it stands); exact when no other
        allocation ran in between, as under the adaptor's lock."""
        with self._lock:
            self._check_owned_live(block)
            raiser = self._peak_raiser
        self.deallocate(block)
        with self._lock:
            self._alloc_count -= 1
            self._free_count -= 1
            if raiser is not None and raiser[0] is block and self._peak_raiser is raiser:
                # Block objects are handed out once (Rule 6): identity is the allocation
                self._peak = max(raiser[1], self._allocated)
                self._peak_raiser = None

    def _walk(self):
        for _, _, block in self._slabs.values():
            while block is not None:
                yield block
                block = block.next

    def live_blocks(self) -> list[Block]:
        """The live blocks, in address order (a new list)."""
        with self._lock:
            return [b for b in self._walk() if b.state == _LIVE]
