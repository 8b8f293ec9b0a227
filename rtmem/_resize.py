"""In-place resizing for :class:`~rtmem.allocator.BestFitAllocator`: ``resize``
and ``fits_in_place``. A live block grows across the free blocks after it
(each ready, or pending on the resizing stream: NOTE [ Stream-ordered frees ]
in _stream_order.py) or shrinks, keeping its offset; otherwise it moves (a new
allocation, then a free). A mixin of the allocator, whose lock guards all of it.
"""

from __future__ import annotations

from ._blocks import _PENDING, _READY, Block, _request, align_up


class _InPlaceResize:
    """Mixin of :class:`~rtmem.allocator.BestFitAllocator` (its ``allocate``,
    ``deallocate``, index methods and counters)."""

    def resize(self, block: Block, nbytes: int, stream=None) -> Block:
        """Resize a live block to ``nbytes`` bytes; return the (possibly new) block.

        Shrinking, and growing into the free blocks after it, happen in place
        (the same Block is returned, its offset and bytes kept) when each block
        it grows across is ready or pending on ``stream`` (freed there in stream
        order or behind an event: stream order lets ``stream`` reuse it at once;
        the part of the last one not taken stays ready, or pending as it was);
        otherwise a new block is allocated and the old one freed at once
        (``result is not block``). The old bytes are then free memory: another
        thread or stream may be handed them before the caller reads them, so a
        caller that needs the data in a shared allocator allocates, copies and
        frees itself, in that order. A free block *before* ``block`` is never
        grown into: that moves the start, and the core has no access to the
        bytes to move them (nor to the views users hold at the old offset).
        Raises :class:`~rtmem.errors.OutOfMemoryError` with ``block`` still live.
        """
        nbytes = _request(nbytes, "resize to")
        size = align_up(max(nbytes, 1), self.alignment)
        with self._lock:
            self._check_owned_live(block)
            if self._fits_in_place(block, size, stream):
                while block.size < size:
                    # _fits_in_place vouched for each next block up to ``size``
                    nxt = block.next
                    if nxt.state == _PENDING:
                        if block.size + nxt.size > size:
                            # The rest keeps its stream and event (gated for others)
                            self._split_free(nxt, size - block.size)
                        self._remove_pending(nxt)
                    else:
                        self._remove_ready(nxt)
                    self._allocated += nxt.size
                    self._absorb(block, nxt)
                if block.size > size:
                    rest = Block(block.slab, block.offset + size, block.size - size,
                                 self, block, block.next)
                    if block.next is not None:
                        block.next.prev = rest
                    block.next = rest
                    self._allocated -= rest.size
                    block.size = size
                    self._make_ready(rest)
                self._requested += nbytes - block.requested
                block.requested = nbytes
                if self._allocated > self._peak:
                    self._peak_raiser = None    # a resize is never withdrawn
                    self._peak = self._allocated
                return block
        new = self.allocate(nbytes, stream)
        self.deallocate(block, stream=stream)
        return new

    @staticmethod
    def _fits_in_place(block: Block, size: int, stream) -> bool:
        """True if ``block`` and the free blocks after it, each ready or pending
        on ``stream``, hold ``size`` bytes (a shrink always does)."""
        total, nxt = block.size, block.next
        while total < size and nxt is not None and (
                nxt.state == _READY or nxt.state == _PENDING and stream is not None
                and nxt.stream == stream):
            total += nxt.size
            nxt = nxt.next
        return total >= size

    def fits_in_place(self, block: Block, nbytes: int, stream=None) -> bool:
        """True if :meth:`resize` of live ``block`` to ``nbytes`` bytes on
        ``stream`` would keep it in place now (a shrink, or growth across the
        free blocks after it, each ready or pending on ``stream``)."""
        # Checked as resize checks it: int() took True, 2.5 and "7", and told a
        # negative size it fits (resize refuses all of these).
        size = align_up(max(_request(nbytes, "resize to"), 1), self.alignment)
        with self._lock:
            self._check_owned_live(block)
            return self._fits_in_place(block, size, stream)
