"""Allocator adaptors: statistics, tracing, budgets, poisoning, trace replay.

Each adaptor wraps an *upstream* allocator (the core or another adaptor), keeps it
alive in ``.upstream`` and offers the same interface (``allocate``,
``deallocate``, ``resize``, ``stats``, ...); anything it does not override is
forwarded. Features are added by stacking, e.g.::

    alloc = LimitAdaptor(StatisticsAdaptor(BestFitAllocator(1 << 30)), 512 << 20)

The core never branches on a feature (RMM's style: adaptors, not flags).

A :class:`TracingAdaptor`'s trace is read back by :func:`load_trace` and run
against any allocator by :func:`replay` (defined in :mod:`rtmem._trace_replay`,
public here).
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from dataclasses import dataclass

from ._blocks import _request   # the core's check, before size arithmetic here
from ._trace_replay import ReplayResult, load_trace, replay
from .allocator import BestFitAllocator, align_up
from .errors import BackendError, OutOfMemoryError, UseAfterFreeError
from .units import format_bytes, parse_bytes

__all__ = ["AllocatorAdaptor", "LimitAdaptor", "PoisonAdaptor", "ReplayResult",
           "Statistics", "StatisticsAdaptor", "TracingAdaptor", "load_trace", "replay"]


def _check_free(upstream, block, stream=None, event=None, ordered=False) -> None:
    """Raise what ``upstream`` would raise when freeing ``block`` with these
    arguments (double free, foreign pointer, bad stream arguments); upstreams
    without ``check_free`` are not asked."""
    check = getattr(upstream, "check_free", None)
    if check is not None:
        check(block, stream=stream, event=event, ordered=ordered)


def _withdraw(upstream, block) -> None:
    """Give back ``block``, just handed out by ``upstream`` and refused by an
    adaptor before anyone used it, leaving the statistics as they were: freed
    plainly, the refused request counted one allocation, one free and its bytes
    in the peak. Only the core can undo its counters; over another adaptor the
    block is freed plainly."""
    if isinstance(upstream, BestFitAllocator):
        upstream._withdraw(block)
    else:
        upstream.deallocate(block)


class AllocatorAdaptor:
    """Base of all adaptors: forwards everything to ``upstream``."""

    def __init__(self, upstream):
        if not callable(getattr(upstream, "allocate", None)):
            raise TypeError(f"upstream must be an allocator (with allocate/deallocate), "
                            f"got {upstream!r}")
        self.upstream = upstream

    def __getattr__(self, name):
        # Called only for attributes not defined on the adaptor: forward them.
        if name == "upstream":
            raise AttributeError(name)
        return getattr(self.upstream, name)

    def allocate(self, nbytes: int, stream=None):
        """Allocate ``nbytes`` bytes through the upstream."""
        return self.upstream.allocate(nbytes, stream)

    def deallocate(self, block, *, stream=None, event=None, ordered=False) -> None:
        """Free ``block`` through the upstream (stream-ordered when ``event`` or
        ``ordered``; see :meth:`rtmem.allocator.BestFitAllocator.deallocate`)."""
        self.upstream.deallocate(block, stream=stream, event=event, ordered=ordered)

    def resize(self, block, nbytes: int, stream=None):
        """Resize ``block`` to ``nbytes`` bytes through the upstream."""
        return self.upstream.resize(block, nbytes, stream)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} upstream={self.upstream!r}>"


@dataclass(frozen=True)
class Statistics:
    """Counters of a :class:`StatisticsAdaptor`; bytes are requested bytes.

    ``current_*``: live now; ``peak_*``: highest seen (a moving resize holds
    both blocks for a moment); ``total_*``: ever allocated, a resize counting
    as one allocation of its new size.
    """

    current_bytes: int = 0
    peak_bytes: int = 0
    total_bytes: int = 0
    current_count: int = 0
    peak_count: int = 0
    total_count: int = 0


class StatisticsAdaptor(AllocatorAdaptor):
    """Counts requested bytes and allocations passing through it.

    NOTE: the counters (plain ints, snapshotted into a frozen :class:`Statistics`
    by :meth:`statistics`) and ``_sizes`` (block -> requested bytes) are guarded
    by ``_lock``.
    """

    def __init__(self, upstream):
        super().__init__(upstream)
        self._lock = threading.Lock()
        self._bytes = self._peak_bytes = self._total_bytes = 0
        self._count = self._peak_count = self._total_count = 0
        self._sizes = {}

    def _add(self, block, nbytes):
        self._sizes[block] = nbytes
        self._bytes += nbytes
        self._count += 1
        self._total_bytes += nbytes
        self._total_count += 1
        if self._bytes > self._peak_bytes:
            self._peak_bytes = self._bytes
        if self._count > self._peak_count:
            self._peak_count = self._count

    def _remove(self, block):
        self._bytes -= self._sizes.pop(block, 0)
        self._count -= 1

    def allocate(self, nbytes: int, stream=None):
        """Allocate and count ``nbytes`` bytes."""
        with self._lock:
            block = self.upstream.allocate(nbytes, stream)
            self._add(block, int(nbytes))
        return block

    def deallocate(self, block, *, stream=None, event=None, ordered=False) -> None:
        """Free and uncount ``block``."""
        # Under the lock with the upstream call, as allocate is, so a snapshot
        # never sees the free without its uncounting.
        with self._lock:
            self.upstream.deallocate(block, stream=stream, event=event, ordered=ordered)
            self._remove(block)

    def resize(self, block, nbytes: int, stream=None):
        """Resize, counting it as one allocation of the new size (in ``total_*``)."""
        with self._lock:
            new = self.upstream.resize(block, nbytes, stream)
            if new is block:
                self._remove(block)
                self._add(new, int(nbytes))
            else:
                # a moving resize holds both blocks for a moment (the core's
                # peak_bytes counts it): the peaks must see that moment too
                self._add(new, int(nbytes))
                self._remove(block)
        return new

    def statistics(self) -> Statistics:
        """The counters now (a frozen snapshot)."""
        with self._lock:
            return Statistics(self._bytes, self._peak_bytes, self._total_bytes,
                              self._count, self._peak_count, self._total_count)


class LimitAdaptor(AllocatorAdaptor):
    """Refuses allocations that would take its bytes above ``budget_bytes``.

    Counts aligned block sizes (what the upstream really hands out). A refused
    request raises :class:`~rtmem.errors.OutOfMemoryError` with the upstream
    stats, leaving everything unchanged. NOTE: ``_used``/``_sizes`` guarded by
    ``_lock``; a budget check and its allocation happen under it, so concurrent
    requests cannot overshoot together.
    """

    def __init__(self, upstream, budget_bytes: int):
        super().__init__(upstream)
        # bytes, or a string like "2GiB"; a fractional budget rounds down (what it
        # allows), as parse_bytes says: rounded up, 102.4 allowed 103 bytes
        self.budget_bytes = parse_bytes(budget_bytes, round_down=True)
        self._lock = threading.Lock()
        self._used = 0
        self._sizes = {}

    @property
    def used_bytes(self) -> int:
        """Aligned bytes currently allocated through this adaptor."""
        return self._used

    def _refuse(self, nbytes, size):
        raise OutOfMemoryError(
            f"budget exceeded: allocating {nbytes:,} bytes ({format_bytes(size)} "
            f"aligned) would bring usage to {self._used + size:,} bytes, above the "
            f"budget of {self.budget_bytes:,} bytes ({format_bytes(self.budget_bytes)}); "
            f"free buffers or raise budget_bytes", requested=nbytes,
            stats=self.upstream.stats())

    def allocate(self, nbytes: int, stream=None):
        """Allocate ``nbytes`` bytes if the budget allows."""
        # Checked first: int() made "x" a bare ValueError, and a negative or
        # bool request over the budget an OutOfMemoryError.
        nbytes = _request(nbytes)
        size = align_up(max(nbytes, 1), self.upstream.alignment)
        with self._lock:
            if self._used + size > self.budget_bytes:
                self._refuse(nbytes, size)
            block = self.upstream.allocate(nbytes, stream)
            self._used += block.size
            self._sizes[block] = block.size
        return block

    def deallocate(self, block, *, stream=None, event=None, ordered=False) -> None:
        """Free ``block`` and return its bytes to the budget."""
        # Under the lock, as allocate is: a budget check never sees the bytes
        # freed upstream but still counted here.
        with self._lock:
            self.upstream.deallocate(block, stream=stream, event=event, ordered=ordered)
            self._used -= self._sizes.pop(block, 0)

    def resize(self, block, nbytes: int, stream=None):
        """Resize within the budget. A resize that moves the block holds the old
        and the new block at once, so it must fit ``used + new size``; one that
        stays in place (upstream ``fits_in_place``) only the difference."""
        nbytes = _request(nbytes, "resize to")      # as in allocate
        size = align_up(max(nbytes, 1), self.upstream.alignment)
        with self._lock:
            old = self._sizes.get(block, 0)
            fits_in_place = getattr(self.upstream, "fits_in_place", None)
            # stream only when given: a user's allocator may define the older
            # fits_in_place(block, nbytes), which a third argument broke
            in_place = fits_in_place is not None and (
                fits_in_place(block, nbytes) if stream is None
                else fits_in_place(block, nbytes, stream))
            extra = size - old if in_place else size
            if self._used + extra > self.budget_bytes:
                self._refuse(nbytes, extra)
            new = self.upstream.resize(block, nbytes, stream)
            self._used += new.size - self._sizes.pop(block, 0)
            self._sizes[new] = new.size
        return new


@dataclass(frozen=True)
class _Span:
    """Bytes ``[offset, offset + size)`` of slab ``slab``: what the poison
    callbacks read of a block, for the parts of one a resize frees."""

    slab: int
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


class PoisonAdaptor(AllocatorAdaptor):
    """Debug aid: fills freed blocks with :attr:`POISON` and checks, on each
    allocation, that the poison is intact; a mismatch means something wrote to
    freed memory (a stale view of a freed buffer) and raises
    :class:`~rtmem.errors.UseAfterFreeError`.

    ``fill(block, value)`` and ``check(block, value) -> first bad byte or -1`` touch
    the memory (the arena provides them; they read ``slab``, ``offset`` and
    ``size``). Every free byte must be poisoned when the adaptor is installed
    (arenas poison new slabs in debug mode). A free gated by an event waits for
    the event first: slow, by design. Calls are serialized by a lock.
    """

    POISON = 0xDB

    def __init__(self, upstream, *, fill, check):
        super().__init__(upstream)
        self._fill = fill
        self._check = check
        self._lock = threading.RLock()
        # Blocks a moving resize freed: the caller copies their data to the new
        # block after resize returns, so they are poisoned at the next call.
        self._stale = []

    def _poison_stale(self) -> None:
        while self._stale:
            span, handle = self._stale.pop()
            try:
                current = self.upstream.slab_handle(span.slab)
            except KeyError:
                continue        # the slab was trimmed meanwhile: nothing to poison
            if current is handle:   # not a new slab that reuses the id
                self._fill(span, self.POISON)

    def trim(self) -> int:
        """Poison what a moving resize left, then release free slabs upstream."""
        with self._lock:
            self._poison_stale()
            return self.upstream.trim()

    def allocate(self, nbytes: int, stream=None):
        """Allocate, verifying that the block's free bytes were not written."""
        with self._lock:
            self._poison_stale()
            block = self.upstream.allocate(nbytes, stream)
            bad = self._check(block, self.POISON)
            if bad >= 0:
                # read before the free below: a freed block merges with its free
                # neighbours, and the message named the merged size ("the
                # 1048576-byte block" for a 4 KiB request)
                size, slab, offset = block.size, block.slab, block.offset
                self._fill(block, self.POISON)
                _withdraw(self.upstream, block)
                raise UseAfterFreeError(
                    f"freed memory was written after its free: byte {bad} of the "
                    f"{size}-byte block at slab {slab} offset {offset} "
                    f"lost its poison; a view of a freed buffer is still in use",
                    offset=offset + bad)
            return block

    def deallocate(self, block, *, stream=None, event=None, ordered=False) -> None:
        """Poison ``block`` (after its event, or its stream for an ordered free)
        and free it."""
        with self._lock:
            self._poison_stale()
            # Refuse a double free or a foreign block before poisoning: its bytes
            # may belong to a live buffer now.
            _check_free(self.upstream, block, stream, event, ordered)
            try:
                if event is not None:
                    event.synchronize()
                elif ordered and stream is not None:
                    stream.synchronize()
            except BackendError:
                # The work is over, failed: poisoning needs no more. The failure is
                # the work's to report, not this free's: without debug the same
                # free succeeds (the allocator only asks whether the work is over),
                # and raising here left the buffer allocated under debug alone
                pass
            self._fill(block, self.POISON)
            self.upstream.deallocate(block)

    def fits_in_place(self, block, nbytes: int, stream=None) -> bool:
        """Whether :meth:`resize` keeps ``block`` in place: only a shrink here
        (growth always moves), whatever the allocator below could do on any
        ``stream``."""
        # A checked size ("7" <= block.size was a bare TypeError); block.size is
        # aligned, so the block holds any request up to it.
        return _request(nbytes, "resize to") <= block.size

    def resize(self, block, nbytes: int, stream=None):
        """Shrink in place, poisoning the freed tail; grow by moving to a new,
        poison-checked block (never into a free neighbour, whose bytes would
        escape the check). A moved-from block is poisoned at the next call."""
        with self._lock:
            self._poison_stale()
            _check_free(self.upstream, block)
            if self.fits_in_place(block, nbytes):   # LimitAdaptor charges by the same test
                size = block.size
                block = self.upstream.resize(block, nbytes, stream)
                if block.size < size:
                    self._fill(_Span(block.slab, block.offset + block.size,
                                     size - block.size), self.POISON)
                return block
            new = self.allocate(nbytes, stream)     # checks the poison
            old = _Span(block.slab, block.offset, block.size)
            handle = self.upstream.slab_handle(block.slab)
            self.upstream.deallocate(block, stream=stream)
            self._stale.append((old, handle))
            return new


class TracingAdaptor(AllocatorAdaptor):
    """Records every allocation, free and resize as JSON lines.

    Each line is ``{"t": s, "op": "alloc"|"free"|"resize"|"oom", "id": n,
    "nbytes": bytes, "stream": k}`` (``t`` in seconds since the adaptor was made,
    streams numbered by first appearance, None -> null), less what an op does not
    have: a ``free`` has no ``nbytes`` (its id's block), an ``oom`` no ``id``
    (no block was made). :func:`load_trace` and
    :func:`replay` read it back. ``sink`` is a path or a text file object.
    NOTE: ``_ids``, ``_streams`` and writes are guarded by ``_lock``.
    """

    def __init__(self, upstream, sink):
        super().__init__(upstream)
        if sink is None:
            raise ValueError("TracingAdaptor needs a sink: pass a path (str or "
                             "os.PathLike) or a text file object")
        self._own = isinstance(sink, (str, os.PathLike))
        self._file = open(sink, "w", encoding="utf-8") if self._own else sink
        self._lock = threading.Lock()
        self._ids = {}
        self._next_id = 0
        self._streams = {}
        self._t0 = time.perf_counter()
        self._closed = False

    def _stream_id(self, stream):
        if stream is None:
            return None
        # By equality where streams define it: two wrappers of one CUDA stream
        # compare equal (the allocator treats them as one), and numbering them
        # apart made a replay order their blocks as two streams'.
        try:
            key = (stream,)
            hash(key)
        except TypeError:
            key = id(stream)
        if key not in self._streams:
            self._streams[key] = (len(self._streams), stream)  # keep alive: ids stay unique
        return self._streams[key][0]

    def _write(self, **rec):
        if self._closed:    # the recording ended; the allocator goes on
            return
        rec["t"] = round(time.perf_counter() - self._t0, 9)
        self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def allocate(self, nbytes: int, stream=None):
        """Allocate and record it (a refusal is recorded as ``oom``)."""
        try:
            block = self.upstream.allocate(nbytes, stream)
        except OutOfMemoryError:
            with self._lock:
                self._write(op="oom", nbytes=int(nbytes), stream=self._stream_id(stream))
            raise
        try:
            with self._lock:
                self._write(op="alloc", id=self._next_id, nbytes=int(nbytes),
                            stream=self._stream_id(stream))
                self._ids[block] = self._next_id
                self._next_id += 1
        except BaseException:
            _withdraw(self.upstream, block)   # the sink failed: as if never asked
            raise
        return block

    def deallocate(self, block, *, stream=None, event=None, ordered=False) -> None:
        """Record the free, then free (a failing sink leaves the block live; a
        free the upstream would refuse is refused before anything is written)."""
        _check_free(self.upstream, block, stream, event, ordered)
        with self._lock:
            self._write(op="free", id=self._ids.get(block, -1),
                        stream=self._stream_id(stream))
        self.upstream.deallocate(block, stream=stream, event=event, ordered=ordered)
        with self._lock:
            self._ids.pop(block, None)

    def resize(self, block, nbytes: int, stream=None):
        """Resize and record it (the id follows the block if it moves; a refusal
        is recorded as ``oom``).

        Unlike an allocation, a resize cannot be undone when the sink fails
        after it (a moved block's old bytes are already free, and the caller's
        handle dead): the resize stands and is returned, and the recording ends
        there, as :meth:`close` ends it, with a :class:`RuntimeWarning` naming
        the sink's error (a trace missing a record could not be replayed)."""
        try:
            new = self.upstream.resize(block, nbytes, stream)
        except OutOfMemoryError:
            with self._lock:
                self._write(op="oom", nbytes=int(nbytes), stream=self._stream_id(stream))
            raise
        with self._lock:
            bid = self._ids.pop(block, -1)
            self._ids[new] = bid
            try:
                self._write(op="resize", id=bid, nbytes=int(nbytes),
                            stream=self._stream_id(stream))
            except Exception as exc:
                # raising would leak the block (its only handle is `new`)
                try:
                    self._end_recording()
                except Exception:
                    pass    # the sink is failing; the recording is over either way
                warnings.warn(f"TracingAdaptor: writing a resize record failed "
                              f"({type(exc).__name__}: {exc}); the resize stands and the "
                              f"recording ended here (later operations are not traced)",
                              RuntimeWarning, stacklevel=2)
        return new

    def close(self) -> None:
        """End the recording: flush, and close the file if the adaptor opened it.
        Later calls go to the upstream unrecorded (they failed with "I/O operation
        on closed file", frees included, which left every buffer unfreeable)."""
        with self._lock:
            self._end_recording()

    def _end_recording(self) -> None:
        # under _lock
        if self._closed:
            return
        self._closed = True
        try:
            self._file.flush()
        finally:
            if self._own:
                self._file.close()


# Trace reading and replay live in _trace_replay.py; their public home is here (pickles,
# reprs and help() name rtmem.adaptors, as before the split).
ReplayResult.__module__ = load_trace.__module__ = replay.__module__ = __name__
