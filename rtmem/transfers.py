"""Transfers: prefetch, offload and copy on dedicated H2D / D2H streams.

Every move returns the event that completes with its copy. Copies run on the
backend's two transfer streams (one per direction, so both directions overlap
with each other and with compute), after the compute work enqueued so far (the
data may have just been produced there). ``wait(buf)`` makes the compute stream
wait for a buffer's pending copy; ``synchronize()`` blocks the host.

Residency moves follow NOTE [ Residency state machine ] in :mod:`rtmem.buffer`;
illegal ones raise :class:`~rtmem.errors.ResidencyError` naming the state and
the fix. Destinations are allocated when the move is issued (like the
simulator's Rule 4), so an :class:`~rtmem.errors.OutOfMemoryError` leaves the
buffer exactly as it was.

NOTE [ Keeping memory alive during copies ]
A slab read or written by an in-flight copy must outlive it, and its block must
not be reused before it ends. The block side is stream-ordered freeing: each
placement remembers the last copy's event and stream, and freeing it gates the
block on that event (:meth:`rtmem.arena._Arena._release`). The slab side is
``TransferEngine._inflight``: (event, slabs) pairs held until the event
completes (CuPy's ``_EventWatcher`` idea), guarded by ``TransferEngine._lock``.
"""

from __future__ import annotations

import threading
from collections import deque

from . import _deferred
from .arena import is_arena
from .backends import Backend, get_backend
from .buffer import Buffer
from .errors import BackendError, ResidencyError, UseAfterFreeError

__all__ = ["TransferEngine", "copy", "drop_host", "evict", "get_engine", "offload",
           "prefetch", "synchronize", "wait"]


class TransferEngine:
    """The H2D and D2H streams of one backend and the in-flight keepalive list."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.h2d = backend.new_stream("h2d")
        self.d2h = backend.new_stream("d2h")
        self._lock = threading.Lock()
        self._inflight = deque()

    def _after_compute(self, stream) -> None:
        """Order ``stream``'s next work after the compute work enqueued so far."""
        backend = self.backend
        stream.wait_event(backend.new_event().record(backend.current_stream()))

    def alloc_key(self):
        """The allocation stream of a copy's destination: the compute stream.

        Every copy is fenced behind the compute work enqueued before it
        (:meth:`_after_compute`), so bytes freed in compute-stream order are safe
        for it at once, as for compute work itself.
        """
        return self.backend.current_stream()

    def _track(self, event, *keep) -> None:
        with self._lock:
            self._inflight.append((event, keep))
            self._poll_locked()

    def _poll_locked(self) -> None:
        q = self._inflight
        while q and q[0][0].query():
            q.popleft()

    @property
    def in_flight(self) -> int:
        """Copies whose memory is still held (completed ones are dropped lazily)."""
        with self._lock:
            self._poll_locked()
            return len(self._inflight)

    def synchronize(self) -> None:
        """Block until both transfer streams are idle; release kept memory.
        A stream's failure is raised after both were waited for."""
        try:
            self.h2d.synchronize()
        finally:
            self.d2h.synchronize()
            with self._lock:
                self._poll_locked()


_engines: dict = {}
_engines_lock = threading.Lock()


def get_engine(backend: Backend | str | None = None) -> TransferEngine:
    """The transfer engine of ``backend`` (default: the current backend), one per
    backend per process."""
    if not isinstance(backend, Backend):
        backend = get_backend(backend)
    with _engines_lock:
        eng = _engines.get(id(backend))
        if eng is None or eng.backend is not backend:
            eng = _engines[id(backend)] = TransferEngine(backend)
        return eng


def _state_error(buf, action, why, fix):
    state = buf.residency
    return ResidencyError(f"cannot {action} this {buf.kind} buffer ({buf.nbytes:,} bytes, "
                          f"residency {state!r}): {why}; {fix}", state=state, action=action)


def _engine_for(dst_arena, src_arena, what: str):
    """The transfer engine of the two arenas' common backend; a ValueError naming
    both when they differ (a copy cannot cross backends)."""
    if dst_arena.backend is not src_arena.backend:
        raise ValueError(f"{what}: the destination arena ({dst_arena.backend.name} backend) "
                         f"and the source ({src_arena.backend.name} backend) differ; use "
                         f"arenas of one backend")
    return get_engine(dst_arena.backend)


def _issue(dst, src, stream, engine, wait_for=()):
    """Enqueue the copy src -> dst on ``stream`` and record its event.

    The copy also waits for the last copies that touched either block (possibly
    on the other transfer stream), so its event implies theirs: the placements
    keep one event each, and freeing on it is then safe.
    """
    engine._after_compute(stream)
    for ev in (*wait_for, dst.event, src.event):
        if ev is not None and not ev.query():
            stream.wait_event(ev)
    src_slab, dst_slab = src.slab, dst.slab
    engine.backend.copy_async(dst_slab, dst.offset, src_slab, src.offset,
                              min(src.block.requested, dst.block.requested), stream)
    event = engine.backend.new_event().record(stream)
    for p in (dst, src):
        p.event, p.stream = event, stream
    engine._track(event, dst_slab, src_slab)
    return event


def _check_buffer(buf, what: str) -> None:
    """Type check at a transfer's entry, which also runs the frees a garbage
    collection postponed: here, before any buffer lock is taken, and not in the
    middle of a move (NOTE [ Frees from finalizers ] in rtmem/_deferred.py)."""
    if not isinstance(buf, Buffer):
        raise TypeError(f"{what} takes an rtmem Buffer (from arena.alloc), got "
                        f"{type(buf).__name__}")
    if _deferred.queue:
        _deferred.flush()


def _check_movable(buf) -> None:
    """Raise UseAfterFreeError for a freed buffer, and for one whose ``free()``
    waits for its last zero-copy view (NOTE [ Pinned views ] in buffer.py): a
    move would attach memory the pending free may have released already."""
    buf._check_alive()
    if buf._free_requested:
        raise UseAfterFreeError(
            f"this {buf.kind} buffer ({buf.nbytes:,} bytes) was freed (the release "
            f"waits for views of it still alive); do not move a freed buffer")


def _check_event(obj, what: str) -> None:
    # query(): rtmem, torch and host events; a CuPy event has the .done property.
    if not (callable(getattr(obj, "synchronize", None))
            and (callable(getattr(obj, "query", None)) or hasattr(obj, "done"))):
        raise TypeError(f"{what} takes a Buffer, an event (returned by prefetch, "
                        f"offload or copy) or None, got {type(obj).__name__}")


def _check_location(arena, location: str, what: str) -> None:
    if not is_arena(arena, location):
        want = "DeviceArena" if location == "device" else "HostArena"
        raise ValueError(f"{what} needs a {location} arena (a {want}), got {arena!r}; "
                         f"pass arena=<{want}>")


def _copy_to_new(buf: Buffer, arena, src, direction: str, wait_for=()):
    """The second half of prefetch ("h2d") and offload ("d2h"): a new placement
    of ``buf`` in ``arena``, the copy from ``src`` into it on that direction's
    stream, and the buffer marked in flight. Returns the copy's event. Called
    with ``buf._lock`` held, after the residency checks."""
    engine = _engine_for(arena, src.arena, "prefetch" if direction == "h2d" else "offload")
    stream = engine.h2d if direction == "h2d" else engine.d2h
    dst = arena._allocate(buf.nbytes, buf.kind, engine.alloc_key())
    try:
        event = _issue(dst, src, stream, engine, wait_for)
    except BaseException:
        arena._release(dst, buf.kind)   # nothing was enqueued on it
        raise
    if direction == "h2d":
        buf._device, buf.device_arena = dst, arena
    else:
        buf._host, buf.host_arena = dst, arena
    buf._pending = (event, direction, stream, True)    # made a placement
    return event


def prefetch(buf: Buffer, *, arena=None):
    """Copy ``buf``'s host data to a new device placement; return the copy's event.

    ``arena``: the device arena to allocate in (default: the one the buffer came
    from). Legal from ``"host"`` residency (also while the offload that made the
    host copy is still running: the copy waits for it). The device block is
    reserved now; ``wait(buf)`` before computing on it.
    """
    _check_buffer(buf, "prefetch")
    with buf._lock:
        _check_movable(buf)
        in_flight = buf._settle()
        if buf._device is not None:
            raise _state_error(buf, "prefetch", "it already has a device copy"
                               + (" (a copy to it is in flight)" if in_flight else ""),
                               "use it as is, or evict it first")
        arena = arena if arena is not None else buf.device_arena
        if arena is None:
            raise _state_error(buf, "prefetch", "it has never been in a device arena",
                               "pass arena=<DeviceArena>")
        _check_location(arena, "device", "prefetch")
        return _copy_to_new(buf, arena, buf._host, "h2d",
                            (buf._pending[0],) if in_flight else ())


def offload(buf: Buffer, *, arena=None):
    """Copy ``buf``'s device data to a new host placement; return the copy's event.

    ``arena``: the host arena to allocate in (default: the buffer's last one). The
    device copy stays (evict it to free device memory; that may be done at once,
    the free then waits for the copy). Legal from ``"device"`` residency.
    """
    _check_buffer(buf, "offload")
    with buf._lock:
        _check_movable(buf)
        if buf._settle():
            raise _state_error(buf, "offload", "a transfer is in flight",
                               "call rtmem.transfers.wait(buf) or synchronize(buf) first")
        if buf._device is None:
            raise _state_error(buf, "offload", "it has no device copy",
                               "it is already on the host")
        if buf._host is not None:
            raise _state_error(buf, "offload", "it already has a host copy",
                               "evict() to drop the device copy, or drop_host() first "
                               "to refresh the host copy")
        arena = arena if arena is not None else buf.host_arena
        if arena is None:
            raise _state_error(buf, "offload", "no host arena is known for it",
                               "pass arena=<HostArena>")
        _check_location(arena, "host", "offload")
        return _copy_to_new(buf, arena, buf._device, "d2h")


def evict(buf: Buffer) -> None:
    """Drop the device copy of ``buf`` (it must have a host copy, possibly still
    being written by an offload: the device block is then freed when that copy
    completes). Residency becomes ``"host"``."""
    _check_buffer(buf, "evict")
    with buf._lock:
        _check_movable(buf)
        in_flight = buf._settle()
        if buf._device is None:
            raise _state_error(buf, "evict", "it has no device copy", "nothing to do")
        if buf._host is None:
            raise _state_error(buf, "evict", "the device copy is the only copy",
                               "offload(buf) first, or buf.free() to discard it")
        if in_flight and buf._pending[1] == "h2d":
            raise _state_error(buf, "evict", "a prefetch into the device copy is in "
                               "flight", "synchronize(buf) first")
        buf._device.arena._release(buf._device, buf.kind)
        buf._device = None


def drop_host(buf: Buffer) -> None:
    """Free the host copy of ``buf`` (a device copy must exist and no transfer be
    in flight). Residency becomes ``"device"``."""
    _check_buffer(buf, "drop_host")
    with buf._lock:
        _check_movable(buf)
        if buf._settle():
            raise _state_error(buf, "drop the host copy of", "a transfer is in flight",
                               "synchronize(buf) first")
        if buf._host is None:
            raise _state_error(buf, "drop the host copy of", "it has no host copy",
                               "nothing to do")
        if buf._device is None:
            raise _state_error(buf, "drop the host copy of", "the host copy is the only "
                               "copy", "prefetch(buf) first, or buf.free() to discard it")
        buf._host.arena._release(buf._host, buf.kind)
        buf._host = None


def copy(dst: Buffer, src: Buffer):
    """Copy ``src``'s bytes into ``dst`` (primary placements, ``dst.nbytes >=
    src.nbytes``) on the transfer stream of the direction (H2D when ``dst`` is on
    the device, else D2H); return the event. ``dst`` must have one copy
    (residency ``"device"`` or ``"host"``): with both, one would go stale.
    ``dst`` is in flight until it completes; both blocks stay reserved until
    then, and new views of ``src`` (``numpy()``, tensors) wait for it, so
    writing through them cannot race it.

    Views made *before* the call are not ordered after it (a numpy array or
    tensor holds a raw address; nothing runs when it is used): writing ``src``
    or reading ``dst`` through such a view needs ``synchronize(dst)`` (host
    code) or ``wait(dst)`` (work on the compute stream) first."""
    for b in (dst, src):
        _check_buffer(b, "copy")
        b._check_alive()    # before the size check: a freed buffer's sizes mean nothing
    if dst is src:
        raise ValueError("copy(dst, src) needs two different buffers")
    if dst.nbytes < src.nbytes:
        raise ValueError(f"dst holds {dst.nbytes:,} bytes, fewer than src's "
                         f"{src.nbytes:,}; allocate a larger destination")
    first, second = sorted((dst, src), key=id)      # lock order avoids deadlock
    with first._lock, second._lock:
        for b in (dst, src):
            _check_movable(b)
        if dst._device is not None and dst._host is not None:
            # Only the primary (device) copy would be written; the host copy would
            # stay attached but stale, and evict() would then keep the stale one.
            raise _state_error(dst, "copy into", "it has a device and a host copy "
                               "(or a move between them in flight), and a copy writes "
                               "only one", "drop_host(dst) or evict(dst) first "
                               "(after synchronize(dst) if a move is in flight)")
        d, s = dst.primary, src.primary
        engine = _engine_for(d.arena, s.arena, "copy")
        if d.arena.location == "device":
            stream, direction = engine.h2d, "h2d"
        else:
            stream, direction = engine.d2h, "d2h"
        waits = [p[0] for p in (dst._pending, src._pending) if p is not None]
        event = _issue(d, s, stream, engine, waits)
        dst._pending = (event, direction, stream, False)
        return event


def wait(obj=None) -> None:
    """Make the compute stream wait for ``obj``: a Buffer's pending copy, an
    event, or (None) everything enqueued on the current backend's transfer
    streams. On the host backend this blocks (its compute stream is synchronous);
    on cuda it does not block the host."""
    if isinstance(obj, Buffer):
        pending = obj._pending
        if pending is None:
            return
        backend = obj.primary.arena.backend
        try:
            backend.current_stream().wait_event(pending[0])
        except BackendError:
            pass        # as in synchronize()
        obj._settle()
        return
    if obj is not None:
        _check_event(obj, "wait")
        get_backend().current_stream().wait_event(obj)
        return
    engine = get_engine()
    backend = engine.backend
    for stream in (engine.h2d, engine.d2h):
        backend.current_stream().wait_event(backend.new_event().record(stream))


def synchronize(obj=None) -> None:
    """Block the host until ``obj`` (a Buffer's pending copy, an event) or, with
    None, every transfer of the current backend has completed."""
    if isinstance(obj, Buffer):
        pending = obj._pending
        if pending is not None:
            try:
                pending[0].synchronize()
            except BackendError:
                pass    # _settle undoes the failed move and raises a clearer error
            obj._settle()
        return
    if obj is not None:
        _check_event(obj, "synchronize")
        obj.synchronize()
        return
    get_engine().synchronize()
