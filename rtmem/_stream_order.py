"""Stream-ordered reuse of freed blocks, the half of
:class:`~rtmem.allocator.BestFitAllocator` that deals with frees a stream or an
event still guards: the pending indexes, lazy event stamps, and polling or
waiting until such blocks become reusable by every stream. A mixin of the
allocator, whose lock guards all of it; allocator.py keeps best fit, splitting,
coalescing and the fast paths of ``allocate``/``deallocate``, which index and
take pending blocks inline.

NOTE [ Stream-ordered frees ]
``deallocate(block, stream=s, ordered=True)`` is ``cudaFreeAsync``: the block's
last use is enqueued on ``s``. Later work on ``s`` runs after it, so ``s`` may
reuse the block at once, with no event; another stream may reuse it only once
an event recorded on ``s`` *after* the free has completed. Recording an event
per free costs a CUDA call or two per free, about what the whole free costs
otherwise, so the event is recorded lazily: one event from ``event_source(s)``
*stamps* every unstamped block of ``s`` at once (a later event on the same
stream covers every earlier free). Stamps happen when an allocation finds no
fit among the ready and its own stream's pending blocks (before polling), on
``flush``/``trim``, and every ``_MAINTAIN_EVERY`` deferred frees, which also
poll, so that completed blocks return to ``_ready`` and the FIFOs stay short.
An allocation also polls (without stamping) while stamped or event-gated frees
are pending: a block left pending after its event completed merges with no
ready neighbour, and best fit would fragment the ready space around it.
Unstamped frees have no event to poll, so a split of a ready block whose
left neighbour is pending (and right one is not) hands out the block's tail:
the free head stays beside the pending block and merges with it once it
retires, where carving the head walled it in for good. A stream query per
such split (``cudaStreamQuery``, to retire an idle stream's frees at once) was
tried instead and dropped: a driver call on the hot path, and it still
fragmented an arena whose free blocks were all pending.
Instead, the cuda backend's ``synchronize()`` retires its DeviceArenas'
unstamped frees: each allocator core stamps them before the device wait
(``stamp()``: one event per stream that has some) and polls after it
(``poll()``), so after "free everything, synchronize" the arena is one free
block again, at no cost to allocate or free. What stays lazy: frees before a
synchronize rtmem does not see (``torch.cuda.synchronize()``, CuPy's, a
stream's own ``synchronize()``, ``rtmem.transfers.synchronize()``, which waits
for the copy streams only) wait for their stamp as above, and only the tail
carving keeps them from being walled in.
A request no single block holds may still fit in a stream's own pending
blocks together with the free bytes beside them: a run of adjacent blocks,
each ready or pending on that stream. After the miss's stamp and poll, and
before any wait, ``_take_own_run`` merges the smallest such run that
holds it (best fit by run), carving a window that covers as many pending
bytes as it can (ready bytes serve every stream) and leaves as few free
pieces as it can; a block cut at the window's edge keeps its stream and event
on the part outside. The flush waited for every pending event there: a host
stall the size of the stream's queued work, where CUDA's stream-ordered
allocator reuses the stream's own frees at once. The hot paths are unchanged;
the scan, linear in the stream's pending blocks, runs only on this miss.
If no run holds the request either, ``_wait_until_fit`` waits for other
streams' events one at a time: a FIFO head whose blocks, once ready, would lie
in a usable run big enough, else the head of the stream indexed first, each
wait followed by a poll. Best fit and the run search run again only once a
retired block makes a run big enough: a ``_RunView`` keeps the runs by address
and which heads would fit, and updates both as blocks retire (only retirements
change anything under the lock), where rescanning every head and run after
each wait was quadratic in the events waited for (1000 streams: ~0.9 s). The
poll's query per stream with a pending head stays: it is how a wait notices
events that completed meanwhile. The loop used to flush, waiting for every
pending event of every stream (a host stall as long as the slowest stream's
queued work) when one event sufficed. The stream's own
events are never waited for (they make nothing fit that stream order does not
already allow), so a request nothing holds grows a slab at once and leaves the
stream's own frees pending. ``flush()`` and ``trim()`` still wait for all.
``resize(block, n, stream)`` grows in place across the free blocks after it,
each ready or pending on ``stream`` (the same stream-order argument; an
ordered free leaves its ready neighbours apart, so a pending block followed by
a ready one is common); the part of the last one it does not take keeps its
stream and event. It never grows backwards into a free predecessor: that
moves the block's start, and the core cannot move bytes (it has no access to
them) nor the views users hold at the old offset; a move is ``resize``'s
allocate-and-free path, after which the caller copies.

An ordered free merges the block with neighbours pending on the same stream
(their events are superseded by the next stamp, which is later on that
stream); it does not absorb ready neighbours, which would hide them from other
streams until the stamp completes. Torch's caching allocator and CuPy's pool
keep free blocks per stream in the same way; they never move a block to another
stream, rtmem does once the stamp has completed.

The indexes are keyed by the stream object, and a stream may be short-lived (one
per batch; a host stream owns a worker thread), so a stream is forgotten as soon
as a poll finds nothing pending on it any more, and a deferred free on a stream
the indexes do not know yet polls first, retiring what completed on the streams
before (each dead stream stayed referenced until every pending free of the
allocator was retired at once, which a program that keeps freeing on new
streams never reaches). An ordered free there also stamps first: the frees of
the stream in use before (a per-batch current stream) have no event otherwise
until the next maintenance round. An event-gated free does not: that is a copy
stream's free beside the compute stream's, whose lazy stamp it must not force.
Ready blocks name no stream.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque

from ._blocks import _ADDR_MASK, _PENDING, _READY, Block

#: Deferred frees between two stamp-and-poll rounds (NOTE [ Stream-ordered frees ]).
_MAINTAIN_EVERY = 256


class _StreamOrderedFrees:
    """Mixin of :class:`~rtmem.allocator.BestFitAllocator`, which provides the
    indexes (``_pending``, ``_fifo``, ``_unstamped``, ``_free_map``,
    ``_pending_bytes``, ``_deferrals``), ``event_source``, and
    ``_make_ready``/``_absorb``/``_remove_ready``, which move blocks to and
    from the ready index."""

    def stamp(self) -> None:
        """Record the lazy event behind every stream-ordered free made so far
        (one per stream that has some). The cuda backend's ``synchronize()``
        calls it before waiting for the device and :meth:`poll` after it, so
        that those frees become reusable by every stream and merge with their
        free neighbours (NOTE [ Stream-ordered frees ])."""
        with self._lock:
            self._stamp()

    def poll(self) -> None:
        """Make every pending free whose event has completed reusable by every
        stream (merged with its ready neighbours); never waits."""
        with self._lock:
            self._poll_pending()

    def _remove_pending(self, block: Block) -> None:
        keys = self._pending[block.stream]
        del keys[bisect_left(keys, block._key())]
        del self._free_map[block.addr]
        self._pending_bytes -= block.size

    def _stamp(self) -> None:
        """Give every unstamped pending block an event: one per stream, recorded
        now (NOTE [ Stream-ordered frees ])."""
        for stream, blocks in self._unstamped.items():
            event = fifo = None
            for block in blocks:
                # Skip entries reused, merged, stamped or re-freed elsewhere since.
                if block.state != _PENDING or block.event is not None \
                        or block.stream != stream:
                    continue
                if event is None:
                    event = self.event_source(stream)
                    fifo = self._fifo.setdefault(stream, deque())
                block.event = event
                fifo.append((event, block))
        self._unstamped.clear()

    def _maintain(self) -> None:
        """Stamp and poll: bounds the FIFOs and returns completed blocks to
        ``_ready`` in a steady state that never misses."""
        self._deferrals = 0
        self._stamp()
        self._poll_pending()

    def _poll_pending(self) -> None:
        """Move pending blocks whose event completed into ``_ready``."""
        self._drain(wait=False)

    def _retirable(self) -> bool:
        """True when a poll would retire something: some FIFO's head is stale or
        its event completed. Costs one query per stream with stamped frees, which
        keeps ``allocate``'s poll cheap while the GPU is behind."""
        for fifo in self._fifo.values():
            if fifo:
                event, block = fifo[0]
                if block.state != _PENDING or block.event is not event or event.query():
                    return True
        return False

    def _flush_pending(self) -> None:
        """Wait for every pending event and make all pending blocks ready."""
        self._stamp()
        self._drain(wait=True)

    def _drain(self, wait: bool, on_ready=None) -> None:
        """Move pending blocks into ``_ready`` as their events complete, waiting
        for each event when ``wait`` (then every block gets there);
        ``on_ready(block)``, if given, sees each block just before it is made
        ready (still pending, out of its index).

        Events on one stream complete in order, so without waiting only each
        FIFO's head is queried (once per event: a stamp is shared by many
        entries); entries for blocks reused or merged since are skipped.
        """
        for fifo in self._fifo.values():
            done = None
            while fifo:
                event, block = fifo[0]
                if block.state == _PENDING and block.event is event:
                    if event is not done:
                        if wait:
                            event.synchronize()
                        elif not event.query():
                            break
                        done = event
                    self._remove_pending(block)
                    if on_ready is not None:
                        on_ready(block)
                    self._make_ready(block)
                fifo.popleft()
        if not self._pending_bytes:
            self._fifo.clear()      # only stale entries can remain
            self._pending.clear()
            self._unstamped.clear()
        else:
            self._forget_idle_streams()

    def _forget_idle_streams(self) -> None:
        """Drop the index entries of streams with no pending block left (NOTE
        [ Stream-ordered frees ]): their FIFO and unstamped entries are stale."""
        pending = self._pending
        for stream in [s for s, keys in pending.items() if not keys]:
            del pending[stream]
            self._fifo.pop(stream, None)
            self._unstamped.pop(stream, None)

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
            while block.prev is not None and (block.prev.state == _READY or (
                    block.prev.state == _PENDING and block.prev.stream == stream)):
                block = block.prev
            run, total = [], 0
            while block is not None and (block.state == _READY or (
                    block.state == _PENDING and block.stream == stream)):
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

    def _split_free(self, block: Block, head_bytes: int) -> Block:
        """Cut free ``block`` (in an index) after ``head_bytes`` bytes; the new
        tail joins the same index with the same stream and event (a pending
        tail is gated as its head was). Returns the tail."""
        keys = self._ready if block.state == _READY else self._pending[block.stream]
        del keys[bisect_left(keys, block._key())]
        tail = Block(block.slab, block.offset + head_bytes, block.size - head_bytes,
                     self, block, block.next)
        if block.next is not None:
            block.next.prev = tail
        block.next = tail
        block.size = head_bytes
        insort(keys, block._key())
        if block.state == _READY:
            self._free_map[tail.addr] = tail
            insort(keys, tail._key())
        else:
            self._pending_bytes -= tail.size       # _defer counts it again
            self._defer(tail, block.stream, block.event)
        return tail

    def _check_free_args(self, stream, event, ordered) -> None:
        if ordered:
            if self.event_source is None:
                raise ValueError("this allocator has no event_source, so it cannot order "
                                 "a free on a stream; construct it with event_source=, "
                                 "or free with event=")
            if stream is None or event is not None:
                raise ValueError("an ordered free needs a stream and no event; pass "
                                 "stream=, or drop ordered= and free with event=")
        elif event is not None and stream is None:
            # Stream None is also the key of allocations that name no stream, which
            # would reuse the block before the event (the CPU is ordered with none).
            raise ValueError("an event-gated free needs the stream the event was "
                             "recorded on; pass stream=")

    def _free_ordered(self, block: Block, stream) -> None:
        """Index a live block freed in stream order on ``stream`` as unstamped
        pending, merged with neighbours pending on the same stream."""
        prev, nxt = block.prev, block.next
        if prev is not None and prev.state == _PENDING and prev.stream == stream:
            self._remove_pending(prev)
            self._absorb(prev, block)
            block = prev
        if nxt is not None and nxt.state == _PENDING and nxt.stream == stream:
            self._remove_pending(nxt)
            self._absorb(block, nxt)
        self._defer(block, stream, None)

    def _defer(self, block: Block, stream, event) -> None:
        """Index a free block (in no index) as pending on ``stream`` behind
        ``event``, or unstamped when ``event`` is None."""
        block.state, block.stream, block.event = _PENDING, stream, event
        self._free_map[block.addr] = block
        insort(self._pending.setdefault(stream, []), block._key())
        self._pending_bytes += block.size
        if event is None:
            self._unstamped.setdefault(stream, []).append(block)
        else:
            self._fifo.setdefault(stream, deque()).append((event, block))


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
                 "_fits", "_order", "_next", "stream_of")

    def __init__(self, alloc, size: int, stream):
        self.alloc, self.size, self.stream = alloc, size, stream
        self.starts, self.ends = {}, {}
        self.fits = False           # a retirement made a run of >= size bytes
        self._fits = {}             # other stream -> its head would make it fit
        # The other streams' FIFOs in index order: the order in which a head
        # that fits is chosen, and the fallback when none does. No FIFO is
        # added while the lock is held; a FIFO dropped from the index is empty.
        self._order = [(s, f) for s, f in alloc._fifo.items() if s != stream]
        self.stream_of = {id(f): s for s, f in self._order}
        self.dirty = {s for s, _ in self._order}
        self._next = 0              # _order before it holds only empty FIFOs

    def _usable(self, block) -> bool:
        return block is not None and (block.state == _READY or block.state == _PENDING
                                      and block.stream == self.stream)

    def _left(self, block):
        """``(start, blocker)`` of the run ending where ``block`` (not usable)
        starts: ``(block.addr, block.prev)`` when there is none."""
        key = block.addr
        hit = self.ends.get(key)
        if hit is None:
            x = block.prev
            if not self._usable(x):
                return key, x
            while self._usable(x.prev):
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
            if not self._usable(x):
                return key, x
            while self._usable(x.next):
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
            rank = {id(s): i for i, (s, _) in enumerate(order)} if len(fits) > 1 else None
            s = next(iter(fits)) if rank is None else min(fits, key=lambda s: rank[id(s)])
            return fifos[s]
        while self._next < len(order):
            s, fifo = order[self._next]
            if fifo and fifos.get(s) is fifo:
                return fifo
            self._next += 1
        return None
