"""The cuda backend: CuPy for cudaMalloc, cudaHostAlloc, streams, events, copies.

Device slabs come from ``cudaMalloc`` (``cupy.cuda.runtime.malloc``), host slabs
from ``cudaHostAlloc`` with ``cudaHostAllocPortable`` (and ``Mapped`` for mapped
arenas; the device alias is read with ``cudaPointerGetAttributes``). Copies are
``cudaMemcpyAsync(..., cudaMemcpyDefault, stream)`` (unified addressing infers
the direction). Streams are non-blocking CuPy streams, events CuPy events with
timing disabled. numba.cuda kernels consume buffers through
``__cuda_array_interface__``; nothing here imports numba.

CuPy is imported when this backend is first used, never at ``import rtmem``;
without it, :func:`import_cupy` raises :class:`~rtmem.errors.CuPyMissingError` naming the extra
(a :class:`~rtmem.errors.BackendError` and a ``ModuleNotFoundError``).
See NOTE [ Stream and event semantics ] in :mod:`rtmem.backends`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import sys
import threading
import weakref

import numpy as np

from ..errors import BackendError, CuPyMissingError
from . import Backend, Slab, _check_byte, _check_span, _slab_size

__all__ = ["CudaBackend", "CudaEvent", "CudaStream", "PER_THREAD_STREAM", "import_cupy"]

_INSTALL_HINT = ("the cuda backend needs CuPy: pip install rtmem[cuda12] (or "
                 "rtmem[cuda13]); set RTMEM_BACKEND=host to run without a GPU")


def import_cupy():
    """Import CuPy, or raise :class:`CuPyMissingError` (a BackendError and a
    ModuleNotFoundError) saying which extra to install."""
    try:
        import cupy
    except ImportError as exc:
        # a plain ModuleNotFoundError escaped `except BackendError`, which the
        # BackendError docstring promises for a missing CuPy
        raise CuPyMissingError(f"cupy is not installed: {_INSTALL_HINT}") from exc
    return cupy


def _host_view(ptr: int, nbytes: int, owner) -> np.ndarray:
    """A numpy uint8 view of ``nbytes`` bytes of host memory at ``ptr``; it and
    every view of it keep ``owner`` (the allocation) alive."""
    raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
    raw.owner = owner           # numpy views reach it: array -> memoryview -> raw
    return np.ctypeslib.as_array(raw)


#: ``cudaStreamPerThread``: the handle of every host thread's own default stream
#: (CuPy's under CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1).
PER_THREAD_STREAM = 2


class CudaStream:
    """A CuPy stream with rtmem's stream interface; equal iff the same CUDA
    stream (so the allocator's per-stream reuse recognises the current stream):
    the same handle, and for the per-thread default stream the same host thread,
    since that one handle names a different stream in every thread."""

    __slots__ = ("raw", "name", "ptr", "thread", "_key", "_cuda_error")
    synchronous = False

    def __init__(self, raw, name="stream", cuda_error=RuntimeError):
        self.raw = raw
        self.name = name
        #: CuPy's CUDARuntimeError class, what :meth:`synchronize` raises as a
        #: BackendError (from the backend, as for :class:`CudaEvent`)
        self._cuda_error = cuda_error
        #: The ``cudaStream_t`` handle (fixed for the stream's life; read once
        #: because the allocator hashes streams on every allocation).
        self.ptr = int(raw.ptr)
        #: The host thread whose default stream this is, for the per-thread
        #: default stream; None for every other stream.
        self.thread = threading.get_ident() if self.ptr == PER_THREAD_STREAM else None
        self._key = self.ptr if self.thread is None else (self.ptr, self.thread)

    def __eq__(self, other):
        return isinstance(other, CudaStream) and other._key == self._key

    def __hash__(self):
        return hash(self._key)

    def ordered(self):
        """The stream interface's :meth:`HostStream.ordered
        <rtmem.backends.host.HostStream.ordered>`: nothing to hold, since CUDA
        reports a failed copy as a sticky error, not on the next event."""
        return contextlib.nullcontext()

    def wait_event(self, event) -> None:
        """Later work on this stream waits for ``event`` (host not blocked): an
        rtmem event, a CuPy event, or a ``torch.cuda.Event``."""
        raw = getattr(event, "raw", None)
        if raw is not None:
            self.raw.wait_event(raw)
            return
        # A torch.cuda.Event: its cudaEvent_t is made at its first record (0 until
        # then: nothing to wait for). A CuPy event: its handle is .ptr.
        handle = getattr(event, "cuda_event", None)
        if handle is None:
            handle = getattr(event, "ptr", None)
        if not isinstance(handle, int):
            raise TypeError(f"cannot wait for a {type(event).__name__} on a CUDA stream; "
                            f"pass an rtmem, CuPy or torch.cuda event")
        if handle:
            from cupy.cuda import runtime
            runtime.streamWaitEvent(self.ptr, handle, 0)

    def synchronize(self) -> None:
        """Block the host until this stream's work is done. A failure of that
        work (or of any earlier work on the device) is raised as
        :class:`~rtmem.errors.BackendError`, as the host backend's streams
        raise theirs: CuPy's own CUDARuntimeError escaped
        ``except BackendError`` in rtmem.transfers.synchronize()."""
        _synchronize(self.raw, f"work on CUDA stream {self.name!r}", self._cuda_error)

    def launch_host_func(self, fn) -> None:
        """Run ``fn()`` on a driver thread once earlier work is done; ``fn`` must
        not call CUDA."""
        self.raw.launch_host_func(lambda _arg: fn(), None)

    def __repr__(self) -> str:
        return f"<CudaStream {self.name} 0x{self.ptr:x}>"


class CudaEvent:
    """A CuPy event (timing disabled) with rtmem's event interface;
    ``cuda_error``: CuPy's CUDARuntimeError class (what :meth:`synchronize`
    raises as a BackendError)."""

    __slots__ = ("raw", "_cuda_error")

    def __init__(self, raw, cuda_error=RuntimeError):
        self.raw = raw
        self._cuda_error = cuda_error

    def record(self, stream=None) -> "CudaEvent":
        """Capture the work enqueued so far on ``stream`` (default: current)."""
        self.raw.record(None if stream is None else stream.raw)
        return self

    def query(self) -> bool:
        """True when the captured work is done (or never recorded). A failure
        of earlier work on the device, which ``cudaEventQuery`` reports as CUDA
        errors are sticky, is raised as :class:`~rtmem.errors.BackendError`, as
        :meth:`synchronize` raises it (CuPy's own CUDARuntimeError escaped
        ``except BackendError`` in the callers that poll events)."""
        try:
            return bool(self.raw.done)
        except self._cuda_error as exc:
            raise _failure("the CUDA work an event waits for", exc) from exc

    @property
    def done(self) -> bool:
        """Same as :meth:`query`."""
        return self.query()

    def synchronize(self) -> None:
        """Block the host until the captured work is done. A failure of it (or
        of earlier work on the device: CUDA errors are sticky) is raised as
        :class:`~rtmem.errors.BackendError`, chained to CuPy's error. Unlike a
        host event's, it is not the event's own (``error`` is absent): callers
        that leave an event's failure to its buffer must raise this one."""
        _synchronize(self.raw, "the CUDA work an event waits for", self._cuda_error)


def _synchronize(raw, what: str, cuda_error) -> None:
    """``raw.synchronize()`` of a CuPy stream or event, its CUDA failure (of
    class ``cuda_error``) raised as a BackendError: CuPy's own
    CUDARuntimeError escaped ``except BackendError`` in
    rtmem.transfers.synchronize()."""
    try:
        raw.synchronize()
    except cuda_error as exc:
        raise _failure(what, exc) from exc


def _failure(what: str, exc) -> BackendError:
    """The BackendError for CuPy's CUDA error ``exc`` met while waiting for or
    querying ``what``."""
    # CUDA reports an asynchronous failure only at a synchronization or query,
    # and as a sticky error: every later call fails too, so the remedy is a
    # restart.
    return BackendError(
        f"{what} failed: {exc}; CUDA errors are sticky, so the context is "
        f"unusable and every buffer on the device is suspect: restart the "
        f"process (run with CUDA_LAUNCH_BLOCKING=1 to find the failing kernel "
        f"or copy)")


def _free_unless_exiting(release, ptr) -> None:
    # At interpreter exit the CUDA context may be gone already; the driver
    # reclaims everything with the process anyway.
    if not sys.is_finalizing():
        release(ptr)


class _CudaAlloc:
    """Owns one allocation at ``ptr``; gives it back once, with the runtime call
    that matches how it was made (``free`` or ``freeHost``), on :meth:`free` or
    when the last reference goes: an arena dropped without ``close()`` returns
    its slabs as a host-backend one does. Whatever addresses the memory holds
    this object: its slab, the ctypes array behind host views, and the views
    rtmem exports of device memory (:meth:`CudaBackend.release`)."""

    __slots__ = ("_finalizer", "__weakref__")

    def __init__(self, ptr, release):
        # No cudaFree runs inside rtmem's locks: a collection that drops this
        # object only calls the runtime, which takes none of them.
        self._finalizer = weakref.finalize(self, _free_unless_exiting, release, ptr)
        self._finalizer.atexit = False

    def free(self):
        self._finalizer()       # runs the release once; later calls do nothing


class CudaBackend(Backend):
    """Slabs, streams and copies on the current CUDA device through CuPy."""

    name = "cuda"
    stream_types = (CudaStream,)

    def __init__(self):
        cp = import_cupy()
        self.cupy = cp
        self.runtime = cp.cuda.runtime
        self._get_current_stream = cp.cuda.get_current_stream
        # Per thread: one shared slot would be rebuilt at every switch between
        # threads, and CuPy's per-thread default stream (one object for all
        # threads) must wrap as a different stream in each.
        self._compute = threading.local()
        self._cuda_error = getattr(self.runtime, "CUDARuntimeError", RuntimeError)
        # allocator cores whose stream-ordered frees synchronize() retires
        self._ordered = weakref.WeakSet()
        self._ordered_lock = threading.Lock()
        try:
            if self.runtime.getDeviceCount() < 1:
                raise BackendError("CuPy sees no CUDA device")
            self.device_id = int(self.runtime.getDevice())
        except BackendError:
            raise
        except Exception as exc:   # CUDARuntimeError and friends: no usable GPU
            raise BackendError(f"no usable CUDA device ({exc}); check the driver with "
                               f"`rtmem doctor`, or set RTMEM_BACKEND=host") from exc

    def _oom(self, what, nbytes, exc):
        from ..errors import OutOfMemoryError
        return OutOfMemoryError(f"{what} of {nbytes:,} bytes failed: {exc}; use a "
                                f"smaller arena (nbytes=) or free memory held by other "
                                f"pools (cupy.get_default_memory_pool().free_all_blocks())",
                                requested=nbytes)

    def device_slab(self, nbytes: int) -> Slab:
        """``cudaMalloc`` of ``nbytes`` bytes (256-byte aligned by CUDA)."""
        nbytes = _slab_size(nbytes)     # as on the host backend
        try:
            ptr = int(self.runtime.malloc(nbytes))
        except self._cuda_error as exc:
            raise self._oom("cudaMalloc", nbytes, exc) from exc
        return Slab(self, nbytes, ptr, location="device", device_ptr=ptr,
                    owner=_CudaAlloc(ptr, self.runtime.free))

    def host_slab(self, nbytes: int, *, pinned: bool = True, mapped: bool = False) -> Slab:
        """``cudaHostAlloc`` (portable, plus mapped when asked) of exactly
        ``nbytes`` bytes: no power-of-two pool."""
        nbytes = _slab_size(nbytes)
        rt = self.runtime
        if not (pinned or mapped):
            # Pageable host memory: a page-aligned numpy slab, as on the host
            # backend (copies from it are synchronous in practice).
            from .host import _page_aligned
            arr, base = _page_aligned(nbytes)
            return Slab(self, nbytes, arr.ctypes.data, location="host", host_array=arr,
                        owner=base)
        flags = rt.hostAllocPortable | (rt.hostAllocMapped if mapped else 0)
        try:
            ptr = int(rt.hostAlloc(nbytes, flags))
        except self._cuda_error as exc:
            raise self._oom("cudaHostAlloc", nbytes, exc) from exc
        owner = _CudaAlloc(ptr, rt.freeHost)
        device_ptr = None
        if mapped:
            device_ptr = int(rt.pointerGetAttributes(ptr).devicePointer)
        return Slab(self, nbytes, ptr, location="host", device_ptr=device_ptr,
                    host_array=_host_view(ptr, nbytes, owner), pinned=True,
                    mapped=mapped, owner=owner)

    def release(self, slab: Slab) -> None:
        """Give the slab's memory back (the caller synchronized its users): at
        once when nothing else holds it, else when the last view of it goes, as
        on the host backend. Views that hold it: numpy views of host memory
        (``buf.numpy()``), and CuPy arrays (``buf.cupy()``), DLPack capsules
        (``buf.__dlpack__()``) and CUDA-array-interface exports (the tensors of
        ``rtmem.torch.as_tensor``) of device or mapped memory."""
        slab.host_array = None
        # Only the reference is dropped, never an explicit cudaFree/cudaFreeHost:
        # under a live view (valid after arena.close() on the host backend) it
        # left a tensor on freed GPU memory, or made reading a numpy view of
        # pinned memory a segfault. The slab was the allocation's only other
        # holder, so with no view left _CudaAlloc's finalizer frees it here.
        slab.owner = None

    def new_stream(self, name: str = "stream") -> CudaStream:
        """A new non-blocking CUDA stream."""
        return CudaStream(self.cupy.cuda.Stream(non_blocking=True), name, self._cuda_error)

    def new_event(self) -> CudaEvent:
        """A new event with timing disabled (cheaper to record and query)."""
        return CudaEvent(self.cupy.cuda.Event(block=False, disable_timing=True),
                         self._cuda_error)

    def current_stream(self) -> CudaStream:
        """CuPy's current stream (where user kernels run)."""
        # Every allocation and free asks: reuse this thread's wrapper while CuPy
        # returns the same stream object.
        raw = self._get_current_stream()
        cache = self._compute
        wrapped = getattr(cache, "stream", None)
        if wrapped is None or wrapped.raw is not raw:
            wrapped = cache.stream = CudaStream(raw, "compute", self._cuda_error)
        return wrapped

    def copy_async(self, dst: Slab, dst_offset: int, src: Slab, src_offset: int,
                   nbytes: int, stream) -> None:
        """``cudaMemcpyAsync`` with ``cudaMemcpyDefault`` on ``stream``."""
        if dst.owner is None or src.owner is None:
            raise BackendError(f"copy between released slabs ({dst!r} <- {src!r}); "
                               f"a buffer was used after its arena was closed")
        _check_span(dst, dst_offset, nbytes, "copy_async destination")
        _check_span(src, src_offset, nbytes, "copy_async source")
        stream_ptr = 0 if stream is None else stream.ptr
        try:
            self.runtime.memcpyAsync(dst.ptr + dst_offset, src.ptr + src_offset, int(nbytes),
                                     self.runtime.memcpyDefault, stream_ptr)
        except self._cuda_error as exc:
            # Nothing was enqueued; the caller undoes its bookkeeping. CUDA errors
            # are sticky: a kernel that faulted earlier makes every later call fail,
            # so the message points there as well as at this copy.
            raise BackendError(f"cudaMemcpyAsync of {int(nbytes):,} bytes ({src!r} -> "
                               f"{dst!r}) failed: {exc}; if an earlier kernel faulted, the "
                               f"CUDA context is unusable (restart the process, and run "
                               f"with CUDA_LAUNCH_BLOCKING=1 to find the kernel)") from exc

    def fill(self, slab: Slab, offset: int, nbytes: int, value: int) -> None:
        """Set bytes synchronously (``cudaMemsetAsync`` on the current stream,
        then a synchronize of it, for device memory)."""
        _check_span(slab, offset, nbytes, "fill")
        value = _check_byte(value)
        if slab.host_array is not None:
            slab.host_array[offset:offset + nbytes] = value
            return
        # Not plain cudaMemset: on device memory it returns before the bytes are
        # set and runs on the legacy stream, which the non-blocking transfer
        # streams do not wait for; a copy issued right after could race it.
        stream = self.cupy.cuda.get_current_stream()
        self.runtime.memsetAsync(slab.ptr + offset, int(value), int(nbytes), int(stream.ptr))
        stream.synchronize()

    def read(self, slab: Slab, offset: int, nbytes: int) -> np.ndarray:
        """A host copy of ``nbytes`` bytes (synchronous ``cudaMemcpy`` for device)."""
        _check_span(slab, offset, nbytes, "read")
        if slab.host_array is not None:
            return slab.host_array[offset:offset + nbytes].copy()
        out = np.empty(nbytes, np.uint8)
        # cudaMemcpy runs on the legacy stream: finish the user's current stream
        # first so data produced there is what we read.
        self.cupy.cuda.get_current_stream().synchronize()
        self.runtime.memcpy(out.ctypes.data, slab.ptr + offset, int(nbytes),
                            self.runtime.memcpyDefault)
        return out

    def retire_at_synchronize(self, allocator) -> None:
        """See :meth:`Backend.retire_at_synchronize` (DeviceArenas register
        their allocator core)."""
        with self._ordered_lock:
            self._ordered.add(allocator)

    def synchronize(self) -> None:
        """``cudaDeviceSynchronize``. The stream-ordered frees of this backend's
        DeviceArenas made before the call are then reusable by every stream
        and merged with their free neighbours: each allocator stamps them
        before the wait (one event per stream that has some) and polls after
        it (NOTE [ Stream-ordered frees ]). A failure of the device's work
        (CUDA errors are sticky) is raised as :class:`~rtmem.errors.BackendError`,
        chained to CuPy's error, as the streams and events raise theirs; the
        frees then stay pending."""
        with self._ordered_lock:
            allocators = list(self._ordered)
        # Stamped before the wait, so the events are complete once it returns
        # (the poll never waits), and they cover only frees whose last use was
        # enqueued before it (one on another thread meanwhile is left pending).
        for allocator in allocators:
            allocator.stamp()
        try:
            self.runtime.deviceSynchronize()
        except self._cuda_error as exc:
            # CuPy's own CUDARuntimeError escaped `except BackendError`.
            raise _failure("the work on the CUDA device", exc) from exc
        for allocator in allocators:
            allocator.poll()

    def describe(self) -> dict:
        """Device, driver, runtime and library versions, memory and pinned limits."""
        return describe_cuda(self.cupy)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def describe_cuda(cp=None) -> dict:
    """What the cuda backend would run on; never raises (errors are reported)."""
    info = {"backend": "cuda"}
    try:
        cp = cp or import_cupy()
        info["cupy"] = cp.__version__
        rt = cp.cuda.runtime
        info["driver_version"] = rt.driverGetVersion()
        info["runtime_version"] = rt.runtimeGetVersion()
        n = rt.getDeviceCount()
        info["devices"] = []
        for d in range(n):
            props = rt.getDeviceProperties(d)
            name = props.get("name", b"?")
            info["devices"].append({
                "id": d, "name": name.decode() if isinstance(name, bytes) else str(name),
                "total_bytes": int(props.get("totalGlobalMem", 0)),
                "compute_capability": f"{props.get('major', '?')}.{props.get('minor', '?')}",
                "can_map_host_memory": bool(props.get("canMapHostMemory", 0)),
            })
    except Exception as exc:   # reported, not raised: doctor must always print
        info["error"] = f"{type(exc).__name__}: {exc}"
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    info["memlock_limit_bytes"] = None if soft == resource.RLIM_INFINITY else soft
    info["host_available_bytes"] = _meminfo_available()
    info["cpus"] = os.cpu_count()
    return info
