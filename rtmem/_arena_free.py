"""Freeing an arena's buffers, ordered after the work that may still use them.

:class:`ArenaFree` is a mixin of :class:`rtmem.arena._Arena`: ``free(buf)``
releases each placement of a buffer behind its last transfer and the compute
work enqueued so far (NOTE [ Stream-ordered frees ] in _stream_order.py), and
takes its bytes off the per-kind accounting under ``_acct_lock`` (NOTE [ Arena
accounting ] in rtmem/arena.py). It reads the arena's ``backend``,
``allocator`` and ``_record_event``; the subclasses refine ``_free_after``, the
free half of an arena's reuse policy (``_default_stream`` is the other).
"""

from __future__ import annotations

from ._placement import Placement
from .buffer import Buffer
from .errors import DoubleFreeError, InvalidPointerError

__all__ = ["ArenaFree"]


def _retired(stream) -> bool:
    """True for a closed host stream, after waiting out the work queued on it
    before it closed: nothing can be enqueued on it any more, so a block it
    used is free for everyone now (freeing behind an event recorded there
    raised, and the block could never be freed)."""
    if getattr(stream, "closed", False):
        stream.join()
        return True
    return False


class ArenaFree:
    """Stream-ordered release of an arena's buffers (see the module docstring)."""

    def _free_after(self, block, stream) -> None:
        """Free ``block`` behind the work enqueued so far on ``stream``: behind
        an event recorded now (a DeviceArena usually defers it to a stamp)."""
        self.allocator.deallocate(block, stream=stream, event=self._record_event(stream))

    def _release(self, placement: Placement, kind: str) -> None:
        """Free one placement, ordered after its last transfer and compute use
        (on the compute stream: :meth:`_free_after`)."""
        block = placement.block
        size, requested = block.size, block.requested
        compute = self.backend.current_stream()
        # Streams whose queued work may still touch the block: the last
        # transfer's while it runs (rare: a free racing its own copy), and the
        # stream the block was allocated for when that is not the compute stream.
        # Such a block may come from that stream's pending frees, whose earlier
        # use it took over on the strength of stream order alone (NOTE
        # [ Stream-ordered frees ] in _stream_order.py); freeing it for everyone now
        # would let the CPU or another stream overwrite bytes a queued copy reads.
        last_copy, home = placement.event, block.stream
        copying = last_copy is not None and not last_copy.query() \
            and not _retired(placement.stream)
        # Equality, as a CUDA stream may have several wrappers; identity first, as
        # backends reuse one wrapper per stream and a CudaStream's ``!=`` is a
        # Python call on every free.
        elsewhere = home is not None and home is not compute and home != compute \
            and not _retired(home)
        stream = event = None
        if copying or elsewhere:
            # Free on the copy's stream (else the home one) behind an event
            # recorded now, after the home stream and the compute work enqueued
            # so far.
            stream = placement.stream if copying else home
            if copying and elsewhere and home != stream:
                stream.wait_event(self._record_event(home))
            stream.wait_event(self._record_event(compute))
            event = self._record_event(stream)
        lock = self._acct_lock      # acquire/release: cheaper than ``with`` here
        lock.acquire()
        try:
            if event is not None:
                self.allocator.deallocate(block, stream=stream, event=event)
            elif compute.synchronous:
                # Host compute has finished with the block: reusable by all at once.
                self.allocator.deallocate(block)
            else:
                self._free_after(block, compute)
            acct = self._acct[kind]
            acct[0] -= size
            acct[1] -= requested
            acct[2] -= 1
        finally:
            lock.release()

    def free(self, buf: Buffer) -> None:
        """Free ``buf``: all its placements (in whichever arenas), stream-ordered.

        Raises :class:`~rtmem.errors.DoubleFreeError` if already freed and
        :class:`~rtmem.errors.InvalidPointerError` if ``buf`` has no placement here.
        """
        if not isinstance(buf, Buffer):
            raise InvalidPointerError(f"{buf!r} is not an rtmem Buffer; free it with "
                                      f"the library that allocated it")
        with buf._lock:
            if buf._freed or buf._free_requested:
                raise DoubleFreeError(f"{buf!r} was already freed; free each buffer once")
            device, host = buf._device, buf._host
            if (device is None or device.arena is not self) and \
                    (host is None or host.arena is not self):
                raise InvalidPointerError(
                    f"{buf!r} does not live in {self!r} (foreign pointer); free it with "
                    f"buf.free() or the arena that allocated it")
            if buf._pins:   # NOTE [ Pinned views ] in buffer.py: release on last view
                buf._free_requested = True
                return
            if buf._pending is not None:
                buf._settle(report=False)    # a failed move is undone; free what remains
            # Detach each placement once its block is freed (Buffer._drop): if a
            # release raises, the buffer stays live with the placements it still
            # owns (never with a block the allocator may hand to someone else).
            if buf._device is not None:
                buf._drop("device")
            if buf._host is not None:
                buf._drop("host")
            buf._pending = None
            buf._freed = True
