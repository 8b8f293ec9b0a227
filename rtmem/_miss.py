"""The allocator's miss path: what :meth:`~rtmem.allocator.BestFitAllocator.allocate`
does when no ready block, nor one pending on its stream, holds the request.
It stamps and polls, merges a run of the stream's own pending blocks with the
free bytes beside them, waits for other streams' events one at a time until
the request fits (keeping a :class:`_RunView` of the free runs as blocks
retire), then grows by a slab or raises
:class:`~rtmem.errors.OutOfMemoryError`. A mixin of the allocator, whose lock
guards all of it; the reasons are in NOTE [ Stream-ordered frees ]
(_stream_order.py), the structure in NOTE [ Allocator structure ]
(allocator.py).
"""

from __future__ import annotations

from bisect import bisect_right

from ._blocks import _ADDR_MASK, _MAX_SLAB_BYTES, _PENDING, _READY, _SLAB_BITS, Block
from .errors import OutOfMemoryError
from .units import format_bytes


class _MissPath:
    """Mixin of :class:`~rtmem.allocator.BestFitAllocator`: ``_find_slow`` and
    the waiting it does. Uses the allocator's indexes and slab methods and
    :class:`~rtmem._stream_order._StreamOrderedFrees`'s pending-block methods."""

    def _find_slow(self, size: int, nbytes: int, stream) -> Block:
        """After a miss among ready and same-stream pending blocks: stamp and
        poll, then merge a run of the stream's own pending and ready blocks, or
        wait for other streams' events until the request fits, then grow or
        raise OutOfMemoryError. Returns the block removed from its index."""
        self._stamp()
        self._poll_pending()
        # The stream's own pending runs first, then the other streams' events one
        # at a time, each until the request fits (NOTE [ Stream-ordered frees ]).
        block = self._wait_until_fit(size, stream)
        if block is not None:
            return block
        # At most what max_bytes leaves: a last, smaller slab (max_bytes need
        # not be initial + k * growth), when it still holds the request.
        grow = min(max(self.growth_bytes, size), self.max_bytes - self._reserved)
        # Out of slab ids is out of memory too (it raised a bare ValueError
        # from _add_slab, which callers that catch OutOfMemoryError missed).
        no_ids = grow >= size and not self._free_ids \
            and self._next_slab >= (1 << _SLAB_BITS)
        if grow >= size and size < _MAX_SLAB_BYTES and not no_ids:   # < 1 TiB slabs
            try:
                self._add_slab(grow)
            except OutOfMemoryError as exc:   # the backend has no memory left
                stats = self._stats_locked()
                raise OutOfMemoryError(
                    f"out of memory: cannot allocate {nbytes:,} bytes: growing by a "
                    f"{grow:,}-byte slab failed ({exc}); {stats.describe()}. Free "
                    f"buffers first or plan with a smaller memory budget.",
                    requested=nbytes, stats=stats) from exc
            block = self._best_fit(size, stream)
        if block is None:
            stats = self._stats_locked()
            raise OutOfMemoryError(
                f"out of memory: cannot allocate {nbytes:,} bytes "
                f"({format_bytes(size)} aligned to {self.alignment} B); "
                f"{stats.describe()}; growth limit max_bytes={self.max_bytes:,} B. "
                + ("No slab holds 1 TiB or more: split the allocation."
                   if size >= _MAX_SLAB_BYTES else
                   f"All {1 << _SLAB_BITS} slab ids are in use: free buffers and "
                   f"trim(), or grow by larger slabs (growth_bytes=)." if no_ids else
                   "Free buffers first, raise the arena size or max_bytes, or plan "
                   "with a smaller memory budget."), requested=nbytes, stats=stats)
        (self._remove_ready if block.state == _READY else self._remove_pending)(block)
        return block

    def _wait_until_fit(self, size: int, stream):
        """``size`` bytes (aligned) for ``stream`` after a miss's stamp and poll,
        removed from their index: a single free block, else a run of ``stream``'s
        own pending blocks with the free bytes beside them (:meth:`_take_own_run`),
        else the same after waiting for other streams' events one at a time, the
        oldest left on a stream first; None once no other stream has anything
        pending and still nothing fits (NOTE [ Stream-ordered frees ]).

        ``stream``'s own events are never waited for: stream order already lets
        it reuse those blocks, so their events would not make anything fit.
        """
        block = self._fit_now(size, stream)
        if block is not None:
            return block
        view = _RunView(self, size, stream)
        while True:
            fifo = view.choose()
            if fifo is None:
                return None
            event = fifo[0][0]
            event.synchronize()
            # Retired by hand, not by the poll's query: progress even from an
            # event that still reports busy after its wait.
            while fifo and fifo[0][0] is event:
                _, block = fifo.popleft()
                if block.state == _PENDING and block.event is event:
                    self._remove_pending(block)
                    view.retire(block)
                    self._make_ready(block)
            view.dirty.add(view.stream_of[id(fifo)])     # its head moved on
            self._drain(False, view.retire)
            if view.fits:
                # Only a retired block can make a run reach ``size`` (nothing else
                # changes under the lock), so the searches run only then.
                view.fits = False
                block = self._fit_now(size, stream)
                if block is not None:
                    return block

    def _fit_now(self, size: int, stream):
        """Best fit, else :meth:`_take_own_run`; the block removed from its index."""
        block = self._best_fit(size, stream)
        if block is None:
            return self._take_own_run(size, stream)
        (self._remove_ready if block.state == _READY else self._remove_pending)(block)
        return block

    def _take_own_run(self, size: int, stream):
        """``size`` bytes (aligned) made of free blocks next to one another, at
        least one of them pending on ``stream`` and each either ready or pending
        on ``stream``, merged into one block removed from its index; None if no
        such run holds ``size`` bytes (NOTE [ Stream-ordered frees ]).

        For a miss of best fit only: no single block holds ``size``. Stream order
        lets ``stream`` reuse its own pending blocks at once, so this avoids the
        waits of :meth:`_wait_until_fit`. Best fit among the runs; within the run the window covers
        as many pending bytes as it can (ready ones serve every stream), then
        leaves as few free pieces as it can. A block cut at the window's edge
        keeps its index, stream and event on the part outside it.
        """
        keys = self._pending.get(stream)
        if not keys:
            return None
        fmap, seen, best = self._free_map, set(), None
        for key in keys:
            block = fmap[key & _ADDR_MASK]
            if block.addr in seen:
                continue
            # Stretch to the run's ends over ready and same-stream pending blocks.
            while _usable(block.prev, stream):
                block = block.prev
            run, total = [], 0
            while _usable(block, stream):
                seen.add(block.addr)
                run.append(block)
                total += block.size
                block = block.next
            if total >= size and (best is None or total < best[0]):
                best = (total, run)
        if best is None:
            return None
        total, run = best
        start, end = run[0].offset, run[-1].end
        offsets, below = [], [0]      # pending bytes below each block's start
        for block in run:
            offsets.append(block.offset)
            below.append(below[-1] + (block.size if block.state == _PENDING else 0))

        def pending_below(at):
            i = bisect_right(offsets, at) - 1
            block = run[i]
            return below[i] + (min(at, block.end) - block.offset
                               if block.state == _PENDING else 0)

        # The best window starts or ends at a block boundary (or the run's end).
        choice = None
        for block in run:
            for x in (block.offset, block.end - size):
                x = max(start, min(x, end - size))
                pieces = (x > start) + (x + size < end)
                rank = (pending_below(x + size) - pending_below(x), -pieces, -x)
                if choice is None or rank > choice[0]:
                    choice = (rank, x)
        x = choice[1]
        i = bisect_right(offsets, x) - 1
        j = bisect_right(offsets, x + size - 1) - 1
        first, last = run[i], run[j]
        if first.offset < x:
            tail = self._split_free(first, x - first.offset)
            if last is first:
                last = tail
            first = tail
        if last.end > x + size:
            self._split_free(last, x + size - last.offset)
        taken, block = [], first
        while True:
            taken.append(block)
            if block is last:
                break
            block = block.next
        for block in taken:
            (self._remove_ready if block.state == _READY else self._remove_pending)(block)
        for block in taken[1:]:
            self._absorb(first, block)
        return first


def _usable(block, stream) -> bool:
    """Whether ``block`` (None: past a slab's end) is free for ``stream``: ready,
    or pending on ``stream`` (stream order lets it reuse those at once)."""
    return block is not None and (block.state == _READY or block.state == _PENDING
                                  and block.stream == stream)


class _RunView:
    """What a miss waiting for other streams' events (``_wait_until_fit``) knows
    of the free space, kept current as blocks retire instead of rescanned after
    each wait (which was quadratic in the events waited for).

    A *run* is a maximal range of adjacent free blocks usable on ``stream``
    (ready, or pending on ``stream``); runs only grow while the allocator's
    lock is held, and only by a pending block of another stream retiring
    (:meth:`retire`). Runs are found by walking the block list once, when first
    needed, then kept by address: ``ends[addr]`` is ``(start, left blocker)``
    for the run ending at ``addr``, ``starts[addr]`` ``(end, right blocker)``
    for the run starting there; a blocker is the block beyond the run (live,
    pending on another stream, or None at a slab's end). Addresses are
    ``Block.addr`` values, so a run's bytes are ``end - start``.

    ``_fits`` caches, per other stream, whether the blocks behind the head of
    its FIFO would lie in a run of ``size`` bytes once ready (the head's blocks
    bridging runs); it is recomputed only for streams in ``dirty``: one whose
    head moved on, or whose pending block borders a run that just grew.
    """

    __slots__ = ("alloc", "size", "stream", "starts", "ends", "dirty", "fits",
                 "_fits", "_order", "_rank", "_next", "stream_of")

    def __init__(self, alloc, size: int, stream):
        self.alloc, self.size, self.stream = alloc, size, stream
        self.starts, self.ends = {}, {}
        self.fits = False           # a retirement made a run of >= size bytes
        self._fits = {}             # other stream -> its head would make it fit
        # The other streams' FIFOs in index order: the order in which a head
        # that fits is chosen, and the fallback when none does. No FIFO is
        # added while the lock is held; a FIFO dropped from the index is empty.
        self._order = [(s, f) for s, f in alloc._fifo.items() if s != stream]
        self._rank = {id(s): i for i, (s, _) in enumerate(self._order)}
        self.stream_of = {id(f): s for s, f in self._order}
        self.dirty = {s for s, _ in self._order}
        self._next = 0              # _order before it holds only empty FIFOs

    def _left(self, block):
        """``(start, blocker)`` of the run ending where ``block`` (not usable)
        starts: ``(block.addr, block.prev)`` when there is none."""
        key = block.addr
        hit = self.ends.get(key)
        if hit is None:
            x = block.prev
            if not _usable(x, self.stream):
                return key, x
            while _usable(x.prev, self.stream):
                x = x.prev
            hit = self.ends[key] = (x.addr, x.prev)
            self.starts[x.addr] = (key, block)
        return hit

    def _right(self, block):
        """``(end, blocker)`` of the run starting where ``block`` (not usable)
        ends: ``(end of block, block.next)`` when there is none."""
        key = block.addr + block.size
        hit = self.starts.get(key)
        if hit is None:
            x = block.next
            if not _usable(x, self.stream):
                return key, x
            while _usable(x.next, self.stream):
                x = x.next
            hit = self.starts[key] = (x.addr + x.size, x.next)
            self.ends[hit[0]] = (key, block)
        return hit

    def retire(self, block) -> None:
        """Account for pending ``block`` about to be made ready (out of its
        index, state and stream not yet changed): it joins the runs beside it."""
        if block.stream == self.stream:
            return      # already usable on stream: no run changes
        start, left = self._left(block)
        end, right = self._right(block)
        lo, hi = block.addr, block.addr + block.size
        self.ends.pop(lo, None)
        self.starts.pop(start, None)
        self.starts.pop(hi, None)
        self.ends.pop(end, None)
        self.starts[start] = (end, right)
        self.ends[end] = (start, left)
        if end - start >= self.size:
            self.fits = True
        dirty = self.dirty
        dirty.add(block.stream)
        for x in (left, right):
            if x is not None and x.state == _PENDING:
                dirty.add(x.stream)

    def _head_fits(self, fifo) -> bool:
        """True if the blocks behind the event at ``fifo``'s head, once ready,
        would lie in a run of at least ``size`` bytes (runs joined by them)."""
        event, seen = fifo[0][0], set()

        def gated(b):       # a pending block behind the head's event
            return b is not None and b.state == _PENDING and b.event is event

        for ev, block in fifo:
            if ev is not event:
                break       # a stamp's entries are appended together
            if not gated(block) or block.addr in seen:
                continue
            total, x = 0, block
            while True:     # leftwards over runs and the event's blocks
                seen.add(x.addr)
                start, left = self._left(x)
                total += x.size + x.addr - start
                if not gated(left) or left.addr in seen:
                    break
                x = left
            x = block
            while True:
                end, right = self._right(x)
                total += end - x.addr - x.size
                if not gated(right) or right.addr in seen:
                    break
                x = right
                seen.add(x.addr)
                total += x.size
            if total >= self.size:
                return True
        return False

    def choose(self):
        """The FIFO whose head to wait for next, or None when no other stream
        has anything pending: the first, in index order, whose head would make
        the request fit, else the first non-empty one."""
        fifos, fits = self.alloc._fifo, self._fits
        for s in self.dirty:
            fifo = fifos.get(s)
            if fifo and self._head_fits(fifo):     # s is never ``stream``
                fits[s] = True
            else:
                fits.pop(s, None)
        self.dirty.clear()
        order = self._order
        if fits:
            rank = self._rank
            return fifos[min(fits, key=lambda s: rank[id(s)])]
        while self._next < len(order):
            s, fifo = order[self._next]
            if fifo and fifos.get(s) is fifo:
                return fifo
            self._next += 1
        return None
