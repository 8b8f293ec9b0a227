"""Stream-ordered reuse of freed blocks, the half of
:class:`~rtmem.allocator.BestFitAllocator` that deals with frees a stream or an
event still guards: the pending indexes, lazy event stamps, and polling or
waiting until such blocks become reusable by every stream. A mixin of the
allocator, whose lock guards all of it; allocator.py keeps best fit, splitting,
coalescing and the fast paths of ``allocate``/``deallocate``, which index and
take pending blocks inline, and _miss.py the miss path (``_take_own_run``,
``_wait_until_fit`` and its ``_RunView``), whose reasons this NOTE gives.

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

from bisect import bisect_left, insort
from collections import deque

from ._blocks import _PENDING, _READY, Block

#: Deferred frees between two stamp-and-poll rounds (NOTE [ Stream-ordered frees ]).
_MAINTAIN_EVERY = 256


def check_free_args(event_source, stream, event, ordered) -> None:
    """Refuse the free arguments no allocator core accepts (both cores share
    the rules): an ordered free needs an event source, a stream and no event;
    an event-gated free needs the stream its event was recorded on."""
    if ordered:
        if event_source is None:
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
        check_free_args(self.event_source, stream, event, ordered)

    def _free_ordered(self, block: Block, stream) -> None:
        """Index a live block freed in stream order on ``stream`` as unstamped
        pending, merged with neighbours pending on the same stream."""
        # ``is`` before ``==``: a CudaStream's ``__eq__`` is a Python call, and the
        # backends hand out one wrapper per stream, so identity usually decides
        prev, nxt = block.prev, block.next
        if prev is not None and prev.state == _PENDING \
                and (prev.stream is stream or prev.stream == stream):
            self._remove_pending(prev)
            self._absorb(prev, block)
            block = prev
        if nxt is not None and nxt.state == _PENDING \
                and (nxt.stream is stream or nxt.stream == stream):
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
