"""The host backend: numpy slabs, copy threads and events, CUDA's ordering rules.

Device memory, pinned memory and mapped memory are all page-aligned numpy slabs
(a mapped slab's "device alias" is its host address). Each stream made by
:meth:`HostBackend.new_stream` owns one worker thread that runs its work in
enqueue order; the compute stream is synchronous (work runs in the caller).
Events are ``threading.Event`` objects replaced on every record, so a copy
enqueued on the H2D stream after an event wait really waits: forgetting a wait
races on CPU just as it would on a GPU. See NOTE [ Stream and event semantics ]
in :mod:`rtmem.backends`.

Pinned slabs are ``mlock``ed when asked (``HostBackend(mlock=True)``, or
``RTMEM_HOST_MLOCK=1`` for the process's backend), so that they cannot be swapped
out, as ``cudaHostAlloc``'s cannot; by default "pinned" only records intent (the
memlock limit, ``ulimit -l``, is often a few MiB). A forked child does not inherit
the locks (mlock(2)). There is no real device, so ``__cuda_array_interface__`` is
not offered by buffers on this backend.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import queue
import threading
import weakref

import numpy as np

from ..errors import BackendError, OutOfMemoryError
from . import Backend, Slab, _check_byte, _check_span, _slab_size

__all__ = ["HostBackend", "HostEvent", "HostStream"]

PAGE = mmap.PAGESIZE


def _page_aligned(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """A uint8 array of ``nbytes`` bytes starting on a page boundary, and its base."""
    base = np.empty(nbytes + PAGE, dtype=np.uint8)
    skip = (-base.ctypes.data) % PAGE
    return base[skip:skip + nbytes], base


#: Environment variable that turns :class:`HostBackend`'s ``mlock`` on (``1``) or off (``0``).
MLOCK_ENV = "RTMEM_HOST_MLOCK"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _mlock_default() -> bool:
    value = os.environ.get(MLOCK_ENV, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise BackendError(f"{MLOCK_ENV}={value!r} is not a switch; set it to 1 to lock "
                           f"pinned host slabs into memory, 0 (or unset it) not to")
    return value in _TRUE


@functools.lru_cache(maxsize=None)
def _libc():
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mlock.argtypes = libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    except (OSError, AttributeError) as exc:    # Windows: no mlock(2)
        raise BackendError(f"mlock is not available here ({exc}); create the host "
                           f"backend without mlock (unset {MLOCK_ENV})") from None
    return libc


def _mlock(ptr: int, nbytes: int) -> int:
    """mlock(2) the range; 0, or the errno of the failure."""
    import ctypes
    return 0 if _libc().mlock(ptr, nbytes) == 0 else ctypes.get_errno()


def _munlock(ptr: int, nbytes: int) -> None:
    # Run when the slab's memory goes (its numpy owner is collected), before numpy
    # frees it: memory given back to the heap unmapped no lock, and kept it locked
    # for whatever malloc put there next.
    _libc().munlock(ptr, nbytes)


def _memlock_limit() -> str:
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    except (ImportError, OSError, AttributeError):
        return "unknown"
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft:,} bytes"


def _stream_failed(name, err) -> BackendError:
    return BackendError(f"work on host stream {name!r} failed: {err!r}; the data that "
                        f"work wrote is not valid")


def _not_an_event(obj) -> TypeError:
    return TypeError(f"cannot wait for a {type(obj).__name__} on a host stream; pass an "
                     f"event of the host backend (backend.new_event())")


def _complete(done, box, failure) -> None:
    # Run by a stream's worker when it reaches a recorded event: the event
    # reports the failures of the work before it that no earlier event reported.
    box[0], failure.error = failure.error, None
    done.set()


def _wait_for(done, box) -> None:
    # Run by a stream's worker for wait_event: later work waits, and a failure
    # of the awaited work becomes this stream's too (as a dependency would).
    done.wait()
    if box[0] is not None:
        raise box[0]


class HostEvent:
    """A CUDA-like event. NOTE: ``_done`` and ``_box`` are replaced (never reset)
    on each record, so waiters that captured the previous recording are not
    confused; guarded by the GIL (single attribute stores).

    NOTE [ Host stream failures ]: work that raises on a stream's worker is
    reported by the first event recorded on that stream after it (its
    :attr:`error`, raised by :meth:`synchronize` and ``stream.synchronize()``),
    and by every event of a stream that waited on that event; events whose work
    completed before the failure stay clean, and the stream serves later work
    normally. :meth:`query` only says whether the work is over, failed or not.
    Events recorded with ``report=False`` (rtmem's own bookkeeping:
    ``backend.marker``, which gates the reuse of freed memory and which no one
    asks for errors) report nothing and leave the failure to the next event.
    """

    __slots__ = ("_done", "_box")

    def __init__(self):
        self._done = threading.Event()
        self._done.set()            # never recorded: complete, as in CUDA
        self._box = [None, None]    # [the failure this recording reports, stream name]

    def record(self, stream=None, *, report: bool = True) -> "HostEvent":
        """Capture the work enqueued so far on ``stream`` (default: compute stream).
        ``report=False``: the event completes with that work but takes none of
        its failures, which stay for the stream's next event or synchronize()
        (NOTE [ Host stream failures ])."""
        done, box = threading.Event(), [None, getattr(stream, "name", "compute")]
        if stream is None or isinstance(stream, HostNullStream):
            done.set()              # the compute stream is synchronous
        else:
            # Enqueued before the event is switched over: a refused record (a
            # closed stream) must leave the event as it was, as cudaEventRecord
            # does, not pending forever (synchronize() hung). The worker sets
            # ``done`` itself, so it may run before the switch.
            # a _Failure of its own when not reporting: one that never holds an error
            failure = stream._failure if report else _Failure()
            stream._put(functools.partial(_complete, done, box, failure))
        self._done, self._box = done, box
        return self

    def query(self) -> bool:
        """True when the captured work is over (see :attr:`error`)."""
        return self._done.is_set()

    @property
    def error(self):
        """The exception of failed work this event covers, once it is over; None
        when it succeeded (NOTE [ Host stream failures ])."""
        return self._box[0] if self._done.is_set() else None

    def synchronize(self) -> None:
        """Block until the captured work is done; raise its failure."""
        self._done.wait()
        err = self._box[0]
        if err is not None:
            raise _stream_failed(self._box[1], err) from err

    @property
    def done(self) -> bool:
        """Same as :meth:`query` (CuPy's spelling)."""
        return self.query()


class HostNullStream:
    """The synchronous compute stream: everything runs in the calling thread."""

    name = "compute"
    synchronous = True

    def ordered(self):
        """Nothing to hold: work on this stream runs in the calling thread."""
        return contextlib.nullcontext()

    def wait_event(self, event: HostEvent) -> None:
        """Block the caller until ``event`` completed (a synchronous stream waits
        by blocking)."""
        if not callable(getattr(event, "synchronize", None)):
            raise _not_an_event(event)      # a TypeError as on a CUDA stream
        event.synchronize()

    def synchronize(self) -> None:
        """Nothing is ever pending on the synchronous stream."""

    def launch_host_func(self, fn) -> None:
        """Run ``fn()`` now."""
        fn()

    def __repr__(self) -> str:
        return "<HostNullStream>"


class _Failure:
    """Holds a stream's first failure not yet reported by an event, and whether
    its worker is running a piece of work; shared by the stream and its worker."""

    __slots__ = ("error", "running")

    def __init__(self):
        self.error = None
        self.running = None     # the work the worker is running, if any


def _serve(q, failure) -> None:
    # A module function, not a bound method: the worker must not keep its stream
    # alive, so a dropped stream's __del__ can stop it (no thread leak).
    while True:
        fn = q.get()
        if fn is None:
            return
        failure.running = fn
        try:
            fn()
        except BaseException as exc:   # reported on synchronize, never lost
            if failure.error is None:
                failure.error = exc
        finally:
            failure.running = None


# NOTE [ Host streams after fork ]
# A child made by fork() (multiprocessing's default start method on Linux, e.g.
# DataLoader workers) inherits every HostStream but none of their worker
# threads: work it enqueued was never run, and every wait, copy and arena
# close() in the child hung forever. In the child, each stream and backend gets
# a fresh lock (another thread may have held it at the fork), and each stream
# an empty queue whose worker starts with the child's first work there. What
# the parent had queued or running at the fork does not run in the child:
# rerunning its copies there would cost each worker (of a DataLoader, say) the
# copy and the copy-on-write pages it touches, for data it never reads. The
# events it recorded complete at once with a BackendError saying so, so a
# buffer whose copy was in flight is undone in the child as after any failed
# copy (its source, the child's snapshot, is intact), and nothing waits forever.
_renewed_after_fork = weakref.WeakSet()


def _renew_after_fork() -> None:
    for obj in list(_renewed_after_fork):       # streams and backends
        obj._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_after_fork)


class HostStream:
    """An in-order work queue served by one daemon thread.

    NOTE: ``_queue`` is a thread-safe FIFO; ``_failure.error`` (the first failure
    no event has reported yet: NOTE [ Host stream failures ]) is written only by
    the worker thread; ``_thread`` is started once under ``_lock``, which every
    enqueue takes and :meth:`ordered` holds across several.
    """

    synchronous = False

    def __init__(self, name: str = "stream"):
        self.name = name
        self._queue = queue.SimpleQueue()
        self._failure = _Failure()
        self._thread = None
        self._closed = False
        self._lock = threading.RLock()
        _renewed_after_fork.add(self)

    def _start_worker(self) -> None:
        self._thread = threading.Thread(
            target=_serve, args=(self._queue, self._failure), daemon=True,
            name=f"rtmem-{self.name}")
        self._thread.start()

    def _after_fork_in_child(self) -> None:
        """NOTE [ Host streams after fork ]."""
        self._lock = threading.RLock()
        if self._thread is None:
            return                          # never served: nothing is queued
        self._thread = None                 # started by the child's first work here
        old, self._queue = self._queue, queue.SimpleQueue()
        abandoned = BackendError(
            f"work on host stream {self.name!r} was queued or running when this "
            f"process was forked; it does not run in the child")
        pending = [self._failure.running]
        self._failure.running = None
        while True:
            try:
                pending.append(old.get_nowait())
            except queue.Empty:
                break
        for fn in pending:
            if isinstance(fn, functools.partial) and fn.func is _complete:
                done, box, _ = fn.args      # an event recorded behind that work
                if not done.is_set():
                    box[0] = abandoned
                    done.set()

    def ordered(self):
        """A context manager in which no other thread enqueues on this stream:
        work and the event recorded after it stay adjacent, so that event is
        the one that reports the work's failure (NOTE [ Host stream failures ]).
        Another thread's event recorded in between took the failure, and the
        failed copy's own event reported success."""
        return self._lock

    def _put(self, fn) -> None:
        # Under the lock: work enqueued after close()'s stop marker would never run
        # (and a synchronize() waiting for it would hang), so it is refused.
        with self._lock:
            if self._closed:
                raise BackendError(f"host stream {self.name!r} is closed; enqueue work "
                                   f"on a new stream (backend.new_stream())")
            if self._thread is None:
                self._start_worker()
            self._queue.put(fn)

    def wait_event(self, event: HostEvent) -> None:
        """Make later work on this stream wait for ``event`` (does not block); a
        failure ``event`` reports is reported by this stream's next event too."""
        if not isinstance(event, HostEvent):
            raise _not_an_event(event)      # a TypeError as on a CUDA stream
        done, box = event._done, event._box
        if not done.is_set() or box[0] is not None:
            self._put(functools.partial(_wait_for, done, box))

    def launch_host_func(self, fn) -> None:
        """Run ``fn()`` on the worker once earlier work on this stream is done."""
        self._put(fn)

    def synchronize(self) -> None:
        """Block until all work enqueued so far is done; raise a failure no
        event has reported (NOTE [ Host stream failures ])."""
        with self._lock:
            closed = self._closed
        if not closed:
            HostEvent().record(self).synchronize()
            return
        self.join()                 # it stops after the work enqueued before close()
        err, self._failure.error = self._failure.error, None
        if err is not None:
            raise _stream_failed(self.name, err) from err

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the stream takes no more work)."""
        return self._closed

    def join(self) -> None:
        """Block until a closed stream has run the work enqueued before
        :meth:`close`. Its failures stay to be reported by :meth:`synchronize`.
        An open stream: ValueError (its queue may still grow; use synchronize)."""
        with self._lock:
            closed, thread = self._closed, self._thread
        if not closed:
            raise ValueError(f"host stream {self.name!r} is open; join() waits for a "
                             f"closed stream, synchronize() for an open one")
        if thread is not None:
            thread.join()

    def close(self) -> None:
        """Stop the worker after the work already enqueued; later work is refused."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread is not None:
                self._queue.put(None)

    def __del__(self):
        try:
            self.close()
        except Exception:   # interpreter shutdown: the daemon thread dies anyway
            pass

    def __repr__(self) -> str:
        return f"<HostStream {self.name}>"


def _copy(dst, src):
    np.copyto(dst, src)


class HostBackend(Backend):
    """Numpy slabs and threads with the cuda backend's semantics (module doc).

    ``mlock``: lock each pinned host slab (``host_slab(pinned=True)``, mapped ones
    included) into RAM with mlock(2) while it lives; a slab the memlock limit
    (``ulimit -l``) cannot take raises :class:`~rtmem.errors.OutOfMemoryError`.
    Default: the ``RTMEM_HOST_MLOCK`` environment variable (``1`` or ``0``), else off.
    """

    name = "host"
    stream_types = (HostNullStream, HostStream)

    def __init__(self, *, mlock: bool | None = None):
        if mlock is None:
            mlock = _mlock_default()
        elif not isinstance(mlock, bool):
            raise TypeError(f"mlock must be True, False or None (from {MLOCK_ENV}), "
                            f"got {mlock!r}")
        self.mlock = mlock
        if mlock:
            _libc()     # a platform without mlock(2) is refused now, not at a slab
        self._null = HostNullStream()
        self._streams = weakref.WeakSet()
        self._lock = threading.Lock()
        _renewed_after_fork.add(self)

    def _after_fork_in_child(self) -> None:
        """NOTE [ Host streams after fork ]."""
        self._lock = threading.Lock()

    def _slab(self, nbytes, location, pinned, mapped):
        nbytes = _slab_size(nbytes)
        try:
            arr, base = _page_aligned(nbytes)
        except MemoryError as exc:
            raise OutOfMemoryError(f"the host could not allocate {nbytes:,} bytes for "
                                   f"a {location} slab; use a smaller arena",
                                   requested=nbytes) from exc
        ptr = arr.ctypes.data
        if pinned and location == "host" and self.mlock:
            err = _mlock(ptr, nbytes)
            if err:
                raise OutOfMemoryError(
                    f"could not lock a pinned host slab of {nbytes:,} bytes into memory "
                    f"(mlock: {os.strerror(err)}); the memlock limit (ulimit -l) is "
                    f"{_memlock_limit()}: raise it, use a smaller arena, or turn mlock "
                    f"off ({MLOCK_ENV}=0, HostBackend(mlock=False))", requested=nbytes)
            weakref.finalize(base, _munlock, ptr, nbytes)
        return Slab(self, nbytes, ptr, location=location,
                    device_ptr=ptr if (location == "device" or mapped) else None,
                    host_array=arr, pinned=pinned, mapped=mapped, owner=base)

    def device_slab(self, nbytes: int) -> Slab:
        """A page-aligned numpy slab of ``nbytes`` bytes standing for device memory."""
        return self._slab(nbytes, "device", False, False)

    def host_slab(self, nbytes: int, *, pinned: bool = True, mapped: bool = False) -> Slab:
        """A page-aligned numpy slab of exactly ``nbytes`` bytes (plus < 1 page of
        alignment slack that is never handed out)."""
        return self._slab(nbytes, "host", bool(pinned or mapped), bool(mapped))

    def release(self, slab: Slab) -> None:
        """Drop the slab's memory (numpy frees it once no view remains)."""
        slab.host_array = None
        slab.owner = None

    def new_stream(self, name: str = "stream") -> HostStream:
        """A new stream with its own worker thread (started on first use)."""
        stream = HostStream(name)
        with self._lock:
            self._streams.add(stream)
        return stream

    def new_event(self) -> HostEvent:
        """A new event (complete until recorded)."""
        return HostEvent()

    def marker(self, stream) -> HostEvent:
        """An event recorded on ``stream`` that reports no failure (``record(stream,
        report=False)``): an event the allocator kept to gate a free took the
        failure of a user stream's work, and that stream's synchronize() then
        raised nothing (NOTE [ Host stream failures ])."""
        return HostEvent().record(stream, report=False)

    def current_stream(self) -> HostNullStream:
        """The synchronous compute stream."""
        return self._null

    def copy_async(self, dst: Slab, dst_offset: int, src: Slab, src_offset: int,
                   nbytes: int, stream) -> None:
        """Enqueue ``nbytes`` bytes from ``src`` to ``dst`` on ``stream``; the
        closure holds both slab views, so their memory outlives the copy."""
        if dst.host_array is None or src.host_array is None:
            raise BackendError(f"copy between released slabs ({dst!r} <- {src!r}); "
                               f"a buffer was used after its arena was closed")
        _check_span(dst, dst_offset, nbytes, "copy_async destination")
        _check_span(src, src_offset, nbytes, "copy_async source")
        d = dst.host_array[dst_offset:dst_offset + nbytes]
        s = src.host_array[src_offset:src_offset + nbytes]
        if stream is None or isinstance(stream, HostNullStream):
            _copy(d, s)
        else:
            stream._put(lambda: _copy(d, s))

    def fill(self, slab: Slab, offset: int, nbytes: int, value: int) -> None:
        """Set ``nbytes`` bytes at ``offset`` to ``value`` now."""
        _check_span(slab, offset, nbytes, "fill")
        slab.host_array[offset:offset + nbytes] = _check_byte(value)

    def read(self, slab: Slab, offset: int, nbytes: int) -> np.ndarray:
        """A copy of ``nbytes`` bytes at ``offset``."""
        _check_span(slab, offset, nbytes, "read")
        return slab.host_array[offset:offset + nbytes].copy()

    def synchronize(self) -> None:
        """Wait for every stream made by this backend; then raise the first
        failure found, if any."""
        with self._lock:
            streams = list(self._streams)
        first = None
        for s in streams:
            # Every stream, even after one failed: callers (arena.close()) release
            # memory once this returns, so no copy may still be running then.
            try:
                s.synchronize()
            except BackendError as exc:
                first = first or exc
        if first is not None:
            raise first

    def describe(self) -> dict:
        """What the host backend runs on."""
        return {"backend": "host", "page_size": PAGE, "cpus": os.cpu_count(),
                "mlock": self.mlock,
                "note": "no GPU: device memory is emulated by numpy slabs"}
