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

NOTE [ Copy failures at synchronize ]
A copy that fails (NOTE [ Host stream failures ] in rtmem/backends/host.py)
is reported by its own event, not by the stream: ``synchronize()`` (no
argument) waited for it and returned, and the failure came out at the
buffer's next use, possibly much later and far from the cause, while
``residency`` (an offload evicted meanwhile: ``"host"``) looked like a
success. So every engine remembers the buffers it moved, and its
``synchronize()`` settles them once the streams are idle: a failed move is
undone (see NOTE [ Residency state machine ] in rtmem/buffer.py) and its
BackendError raised there, one per call (the first found); the next buffer's
by the next ``synchronize()``. Each is raised exactly once: by
``synchronize()``, or, when the buffer is used first, by that use
(``synchronize(buf)``, ``wait(buf)``, a move or a view), never both. A
failure of a buffer freed meanwhile is not raised: freeing discarded its data.
``wait()`` with no argument reports nothing, on either backend: it only orders
the compute stream after the transfer streams, and on cuda it must not block
the host, while CUDA tells of an asynchronous failure only at a
synchronization. (On the host backend it blocks; a failed move it waited for
is undone when the buffer is next looked at, ``residency`` included, and
raised by the next ``synchronize()`` or use of the buffer.) On the cuda
backend a failed copy is a sticky CUDA error rather than one event's:
``synchronize()`` raises it as a BackendError (so do ``synchronize(buf)``,
``synchronize(event)`` and a host view waiting for the copy, the buffer left
as it was), and so does every later synchronization, since the CUDA context
is unusable until the process restarts.

NOTE [ Keeping memory alive during copies ]
A slab read or written by an in-flight copy must outlive it, and its block must
not be reused before it ends. The block side is stream-ordered freeing: each
placement remembers the last copy's event and stream, and freeing it gates the
block on that event (:meth:`rtmem._arena_free.ArenaFree._release`, which arenas
inherit). The slab side is ``TransferEngine._inflight``: (event, slabs) pairs
held until the event completes (CuPy's ``_EventWatcher`` idea), guarded by
``TransferEngine._lock``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque

from . import _deferred
from ._fork import HeldAtFork
from .arena import is_arena
from .backends import Backend, get_backend
from .buffer import Buffer, _Move
from .errors import BackendError, ResidencyError

__all__ = ["TransferEngine", "copy", "drop_host", "evict", "get_engine", "offload",
           "prefetch", "synchronize", "wait"]


class TransferEngine:
    """The H2D and D2H streams of one backend and the in-flight keepalive list."""

    def __init__(self, backend: Backend):
        # weak: _engines holds engines for as long as their backend lives, and a
        # strong reference here kept every Backend ever used (and its two copy
        # threads) alive for good
        self._backend = weakref.ref(backend)
        self.h2d = backend.new_stream("h2d")
        self.d2h = backend.new_stream("d2h")
        self._lock = threading.Lock()
        self._inflight = deque()
        # Buffers with a move issued here and not yet seen settled by
        # synchronize(), which reports their failed copies (NOTE [ Copy failures
        # at synchronize ]); weak: a dropped buffer has nobody to report to.
        self._moved = weakref.WeakSet()

    @property
    def backend(self) -> Backend:
        """The backend whose transfers this engine runs."""
        backend = self._backend()
        if backend is None:     # only an engine kept past its backend's life sees this
            raise BackendError("this transfer engine's backend was garbage-collected; "
                               "get the engine of a live backend with get_engine()")
        return backend

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

    def poll(self) -> None:
        """Drop the keepalives of copies that have completed."""
        with self._lock:
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

    def _watch(self, buf) -> None:
        """Remember ``buf``, whose move was just issued here, for synchronize()."""
        with self._lock:
            self._moved.add(buf)

    def synchronize(self) -> None:
        """Block until both transfer streams are idle; release kept memory.
        A stream's failure is raised after both were waited for; then the
        failure of a buffer's move (NOTE [ Copy failures at synchronize ])."""
        try:
            self.h2d.synchronize()
        finally:
            self.d2h.synchronize()
            self.poll()
        self._report_failed_move()

    def _report_failed_move(self) -> None:
        """Settle the buffers moved here (NOTE [ Copy failures at synchronize ])
        and raise the first failed move's BackendError; the others stay
        watched, for the next synchronize() or their buffer's next use. In a
        forked child, a buffer refused there (NOTE [ Arenas after fork ] in
        _fork.py, Rule 5) is raised instead when no move failed, and forgotten."""
        with self._lock:        # never held while taking a buffer's lock
            bufs = list(self._moved)
        settled, failed, refused = [], None, None
        for buf in bufs:
            if isinstance(buf._lock, HeldAtFork):
                # in a forked child, in use by another thread at the fork: never
                # settled here (NOTE [ Arenas after fork ] in _fork.py, Rule 5)
                refused = refused or buf
                continue
            with buf._lock:
                if buf._freed or buf._free_requested:
                    settled.append(buf)     # its free discarded the data
                elif not buf._settle(report=False):     # a move issued since waits
                    if buf._failed is None:
                        settled.append(buf)
                    elif failed is None:
                        failed = buf
                        settled.append(buf)
        with self._lock:
            for buf in settled:
                self._moved.discard(buf)
            if failed is None and refused is not None:
                # raised once, as a failed move is: else every later
                # synchronize() raised for a buffer it can never settle
                self._moved.discard(refused)
        if failed is not None:
            failed._settle()    # raises it, once: the buffer no longer holds it
        if refused is not None:
            raise refused._lock.error()


# backend -> its engine, for as long as the backend lives (a backend made per
# arena, DeviceArena(..., backend=HostBackend()), is dropped with its arenas)
_engines = weakref.WeakKeyDictionary()
_engines_lock = threading.Lock()


def _renew_locks_after_fork() -> None:
    """In a child made by fork(): fresh locks for the engines (Rule 3 of NOTE
    [ Arenas after fork ] in rtmem/_fork.py). Each guards single deque or set
    operations, so a lock another thread held at the fork left no half-done
    update, only a child whose every transfer waited forever."""
    global _engines_lock
    _engines_lock = threading.Lock()
    for eng in list(_engines.values()):
        eng._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_locks_after_fork)


def get_engine(backend: Backend | str | None = None) -> TransferEngine:
    """The transfer engine of ``backend`` (default: the current backend), one per
    backend per process."""
    if not isinstance(backend, Backend):
        backend = get_backend(backend)
    with _engines_lock:
        eng = _engines.get(backend)
        if eng is None:
            eng = _engines[backend] = TransferEngine(backend)
        return eng


def _poll_engine(backend: Backend) -> None:
    """Drop the keepalives of ``backend``'s completed copies, if it has an
    engine (never makes one)."""
    with _engines_lock:
        eng = _engines.get(backend)
    if eng is not None:
        eng.poll()


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

    ``wait_for`` holds the events of moves not settled yet (the prior move of a
    chain): they are waited for while unfinished and also once complete with a
    failure, so that the failure reaches this copy's event (NOTE [ Host stream
    failures ]); the placements' events may carry failures already reported, so
    only unfinished ones are waited for.
    """
    # One step on a host stream: another thread's event recorded between this
    # copy and its event would report the copy's failure in its place (and
    # this event success, the host copy garbage). CUDA streams need no lock.
    with stream.ordered():
        engine._after_compute(stream)
        for ev in wait_for:
            # A prior move that completed with an error between the caller's
            # _settle() and here is waited for too: skipped, its failure was
            # lost (the chained copy ran on garbage and reported success).
            if ev is not None and (not ev.query() or getattr(ev, "error", None) is not None):
                stream.wait_event(ev)
        for ev in (dst.event, src.event):
            if ev is not None and ev not in wait_for and not ev.query():
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


def _copy_to_new(buf: Buffer, arena, src, side: str, prior=None):
    """The second half of prefetch (``side`` "device") and offload ("host"): a
    new placement of ``buf`` in ``arena``, the copy from ``src`` into it on that
    direction's stream (after the ``prior`` move still in flight, if any), and the
    buffer marked in flight. Returns the copy's event. Called with ``buf._lock``
    held, after the residency checks."""
    engine = _engine_for(arena, src.arena, "prefetch" if side == "device" else "offload")
    stream = engine.h2d if side == "device" else engine.d2h
    dst = arena._allocate(buf.nbytes, buf.kind, engine.alloc_key())
    try:
        event = _issue(dst, src, stream, engine, () if prior is None else (prior.event,))
    except BaseException:
        arena._release(dst, buf.kind)   # nothing was enqueued on it
        raise
    if side == "device":
        buf._device, buf.device_arena = dst, arena
    else:
        buf._host, buf.host_arena = dst, arena
    buf._pending = _Move(event, side, prior)
    engine._watch(buf)
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
        buf._check_alive()    # freed, or its free waits for views
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
        return _copy_to_new(buf, arena, buf._host, "device", buf._pending)  # None unless in flight


def offload(buf: Buffer, *, arena=None):
    """Copy ``buf``'s device data to a new host placement; return the copy's event.

    ``arena``: the host arena to allocate in (default: the buffer's last one). The
    device copy stays (evict it to free device memory; that may be done at once,
    the free then waits for the copy). Legal from ``"device"`` residency.
    """
    _check_buffer(buf, "offload")
    with buf._lock:
        buf._check_alive()    # freed, or its free waits for views
        # The copies it has before whether a move is in flight: a host-only buffer
        # that a copy() is writing was told to synchronize, only to be refused then.
        in_flight = buf._settle()
        if buf._device is None:
            raise _state_error(buf, "offload", "it has no device copy",
                               "it is already on the host")
        if in_flight:
            raise _state_error(buf, "offload", "a transfer is in flight",
                               "call rtmem.transfers.wait(buf) or synchronize(buf) first")
        if buf._host is not None:
            raise _state_error(buf, "offload", "it already has a host copy",
                               "evict() to drop the device copy, or drop_host() first "
                               "to refresh the host copy")
        arena = arena if arena is not None else buf.host_arena
        if arena is None:
            raise _state_error(buf, "offload", "no host arena is known for it",
                               "pass arena=<HostArena>")
        _check_location(arena, "host", "offload")
        return _copy_to_new(buf, arena, buf._device, "host")


def evict(buf: Buffer) -> None:
    """Drop the device copy of ``buf`` (it must have a host copy, possibly still
    being written by an offload: the device block is then freed when that copy
    completes). Residency becomes ``"host"``."""
    _drop_copy(buf, "device", "evict")


def drop_host(buf: Buffer) -> None:
    """Free the host copy of ``buf`` (a device copy must exist and no transfer be
    in flight). Residency becomes ``"device"``."""
    _drop_copy(buf, "host", "drop the host copy of")


def _drop_copy(buf: Buffer, side: str, action: str) -> None:
    """evict (``side`` "device") and drop_host ("host"): the checks of NOTE
    [ Residency state machine ] rules 3 and 4, then the release."""
    _check_buffer(buf, "evict" if side == "device" else "drop_host")
    other = "host" if side == "device" else "device"
    with buf._lock:
        buf._check_alive()    # freed, or its free waits for views
        in_flight = buf._settle()
        # The copies first: with one copy, synchronizing (what the in-flight
        # refusal says to do) cannot help, and a copy() into a one-copy buffer
        # was called "a prefetch".
        mine, theirs = buf.placement(side), buf.placement(other)
        if mine is None:
            raise _state_error(buf, action, f"it has no {side} copy", "nothing to do")
        if theirs is None:
            fix = ("offload(buf) first" if side == "device" else "prefetch(buf) first")
            raise _state_error(buf, action, f"the {side} copy is the only copy",
                               f"{fix}, or buf.free() to discard it")
        if in_flight and (side == "host" or buf._pending.side == "device"):
            # an offload may go on while its source is evicted (its block is
            # freed stream-ordered); any other copy reads or writes what is dropped
            raise _state_error(buf, action, "a prefetch into the device copy is in flight"
                               if side == "device" else "a transfer is in flight",
                               "synchronize(buf) first")
        if mine.pins:
            raise _state_error(buf, action, f"{mine.pins} pinned view(s) (numpy(pin=True), "
                               f"cupy(pin=True), rtmem.torch.as_tensor) still use its {side} copy",
                               "drop those views first")
        buf._drop(side)


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
            b._check_alive()    # again, under the lock
            b._settle()         # a completed failed move: src's bytes may be garbage
        if dst._device is not None and dst._host is not None:
            # Only the primary (device) copy would be written; the host copy would
            # stay attached but stale, and evict() would then keep the stale one.
            raise _state_error(dst, "copy into", "it has a device and a host copy "
                               "(or a move between them in flight), and a copy writes "
                               "only one", "drop_host(dst) or evict(dst) first "
                               "(after synchronize(dst) if a move is in flight)")
        d, s = dst.primary, src.primary
        engine = _engine_for(d.arena, s.arena, "copy")
        side = d.arena.location
        stream = engine.h2d if side == "device" else engine.d2h
        waits = [m.event for m in (dst._pending, src._pending) if m is not None]
        event = _issue(d, s, stream, engine, waits)
        dst._pending = _Move(event, side, dst._pending)
        engine._watch(dst)
        return event


def wait(obj=None) -> None:
    """Make the compute stream wait for ``obj``: a Buffer's pending copy, an
    event, or (None) everything enqueued on the current backend's transfer
    streams. On the host backend this blocks (its compute stream is synchronous);
    on cuda it does not block the host. On the host backend a Buffer's failed
    copy is raised here (BackendError); on cuda a failure is a sticky CUDA
    error, raised by the next ``synchronize()``. A freed Buffer raises
    UseAfterFreeError, as its other uses. With None nothing is raised on either
    backend: failed copies come out at ``synchronize()`` or at their buffer's
    next use (NOTE [ Copy failures at synchronize ])."""
    if isinstance(obj, Buffer):
        _settle_after(obj, lambda event: obj.primary.arena.backend.current_stream()
                      .wait_event(event))
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
    None, every transfer of the current backend has completed. A Buffer's failed
    copy is raised here (BackendError); with None, a failed copy of any buffer
    moved since, one per call (NOTE [ Copy failures at synchronize ]). A freed
    Buffer raises UseAfterFreeError, as its other uses."""
    if isinstance(obj, Buffer):
        _settle_after(obj, lambda event: event.synchronize())
        return
    if obj is not None:
        _check_event(obj, "synchronize")
        obj.synchronize()
        _drop_completed()
        return
    get_engine().synchronize()


def _drop_completed() -> None:
    """Drop every engine's keepalives of completed copies (NOTE [ Keeping memory
    alive during copies ]). Else only the next copy did: an arena dropped after
    ``synchronize(buf)`` kept its slabs (GPU memory) while no copy followed."""
    with _engines_lock:
        engines = list(_engines.values())
    for engine in engines:
        engine.poll()


def _settle_after(buf: Buffer, wait_on) -> None:
    """``wait_on(event)`` for ``buf``'s pending move, then settle it: a failure
    is raised by ``_settle``, which undoes the move and says what is left.
    A freed buffer (or one whose arena was closed) raises UseAfterFreeError:
    waiting on it returned silently, as if its data were ready, where every
    other use of it raises."""
    buf._check_alive()
    move = buf._pending
    if move is not None:
        try:
            wait_on(move.event)
        except BackendError:
            # A host event's failure is its copy's: _settle undoes the move and
            # raises it, once. A CUDA failure belongs to no event (sticky): it
            # is raised as is, before anything changes (the context is lost).
            if getattr(move.event, "error", None) is None:
                raise
        _drop_completed()
    buf._settle()
