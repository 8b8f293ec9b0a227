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
in a usable run big enough (``_head_frees``), else the head of the stream
indexed first,
each wait followed by a poll, best fit and the run search again. It used to
flush, waiting for every pending event of every stream (a host stall as long as
the slowest stream's queued work) when one event sufficed. The stream's own
events are never waited for (they make nothing fit that stream order does not
already allow), so a request nothing holds grows a slab at once and leaves the
stream's own frees pending. ``flush()`` and ``trim()`` still wait for all.
``resize(block, n, stream)`` grows in place into the next block when it is
ready or pending on ``stream`` (the same stream-order argument); the part it
does not take keeps its stream and event.

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

    def _drain(self, wait: bool) -> None:
        """Move pending blocks into ``_ready`` as their events complete, waiting
        for each event when ``wait`` (then every block gets there).

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
        while True:
            block = self._best_fit(size, stream)
            if block is not None:
                (self._remove_ready if block.state == _READY else
                 self._remove_pending)(block)
                return block
            block = self._take_own_run(size, stream)
            if block is not None:
                return block
            # After a poll each FIFO's head is live and not known complete. Wait
            # for a head whose blocks would then hold the request, else for the
            # head of the stream indexed first (dict order: not necessarily the
            # oldest event; streams keep no common clock). Each wait rescans the
            # heads: quadratic in the events waited for, on this miss path only.
            fifos = [f for s, f in self._fifo.items() if f and s != stream]
            if not fifos:
                return None
            fifo = next((f for f in fifos if self._head_frees(f, size, stream)), fifos[0])
            event = fifo[0][0]
            event.synchronize()
            # Retired by hand, not by the poll's query: progress even from an
            # event that still reports busy after its wait.
            while fifo and fifo[0][0] is event:
                _, block = fifo.popleft()
                if block.state == _PENDING and block.event is event:
                    self._remove_pending(block)
                    self._make_ready(block)
            self._poll_pending()

    def _head_frees(self, fifo, size: int, stream) -> bool:
        """True if the blocks behind the event at ``fifo``'s head, once ready,
        would lie in a run of free blocks usable on ``stream`` (ready, behind
        that event, or pending on ``stream``) of at least ``size`` bytes."""
        event, seen = fifo[0][0], set()

        def usable(b):
            return b is not None and (b.state == _READY or b.state == _PENDING and (
                b.event is event or b.stream == stream))

        for ev, block in fifo:
            if ev is not event:
                break       # a stamp's entries are appended together
            if block.state != _PENDING or block.event is not event or block.addr in seen:
                continue
            while usable(block.prev):
                block = block.prev
            total = 0
            while usable(block):
                seen.add(block.addr)
                total += block.size
                block = block.next
            if total >= size:
                return True
        return False

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
