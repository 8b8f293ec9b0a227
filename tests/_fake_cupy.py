"""A host-memory stand-in for the parts of CuPy that rtmem's cuda backend uses.

:func:`build` returns a :class:`FakeCupy` whose ``modules`` (``cupy``,
``cupy.cuda``, ``cupy.cuda.runtime``, ``cupy.cuda.memory``) a test installs in
``sys.modules`` (with ``monkeypatch.setitem``, so they are removed afterwards) to
drive :class:`rtmem.backends.cuda.CudaBackend` on a machine without a GPU.

Names, argument orders and return types were checked against cupy-cuda13x 14.2.0
(introspected in a scratch venv: ``__doc__`` signatures of the Cython functions)
and CuPy's sources ``cupy_backends/cuda/api/runtime.pyx``,
``cupy/cuda/stream.pyx``, ``cupy/cuda/memory.pyx``, ``cupy/_core/dlpack.pyx``:

- ``runtime.malloc(size) -> int``, ``free(ptr)``, ``hostAlloc(size, flags) -> int``,
  ``freeHost(ptr)``; flags ``hostAllocDefault=0``, ``hostAllocPortable=1``,
  ``hostAllocMapped=2``, ``hostAllocWriteCombined=4``;
- ``pointerGetAttributes(ptr) -> PointerAttributes(device, devicePointer,
  hostPointer, type)``; ``memoryTypeUnregistered=0``, ``Host=1``, ``Device=2``,
  ``Managed=3``;
- ``memcpy(dst, src, size, kind)``, ``memcpyAsync(dst, src, size, kind, stream)``;
  kinds ``memcpyHostToHost=0``, ``HostToDevice=1``, ``DeviceToHost=2``,
  ``DeviceToDevice=3``, ``Default=4``; ``memset(ptr, value, size)``,
  ``memsetAsync(ptr, value, size, stream)``; ``streamSynchronize(stream)``,
  ``deviceSynchronize()``, ``memGetInfo() -> (free, total)``;
- ``getDeviceCount()``, ``getDevice()``, ``getDeviceProperties(device) -> dict``
  (str keys; ``'name'`` is bytes), ``driverGetVersion()``, ``runtimeGetVersion()``;
- ``CUDARuntimeError(status)``: a RuntimeError, message ``"<name>: <text>"``,
  attribute ``status``; ``streamLegacy=1``, ``streamPerThread=2``;
- ``cuda.Stream(null=False, non_blocking=False, ptds=False, priority=None)`` with
  ``ptr``, ``synchronize()``, ``wait_event(event)``, ``record(event=None)``,
  ``launch_host_func(callback, arg)`` (calls ``callback(arg)``), ``done``,
  ``with stream:``; ``Stream.null`` (ptr 0);
- ``cuda.Event(block=False, disable_timing=False, interprocess=False)`` with
  ``record(stream=None)`` (None: the *current* stream), ``done`` (a property),
  ``synchronize()``; ``cuda.get_current_stream(device_id=-1)``;
  ``cuda.ExternalStream(ptr)`` and ``cuda.Stream.from_external(obj)`` (CuPy >= 14);
  ``cuda.get_elapsed_time(start_event, end_event) -> float`` milliseconds
  (``runtime.eventElapsedTime``: cudaErrorInvalidResourceHandle (400) for an
  event never recorded or with timing disabled, cudaErrorNotReady (600) for one
  not reached yet); the fake's times are host clock readings when the stream
  thread reaches the event, meaningless as GPU timings;
- ``cuda.UnownedMemory(ptr, size, owner, device_id=-1)`` (device looked up with
  pointerGetAttributes when < 0), ``cuda.MemoryPointer(mem, offset)`` (``ptr``,
  ``mem``, ``device_id``), ``cuda.MemoryPool(allocator=None)`` with
  ``malloc(size) -> MemoryPointer`` (512-byte units, freed blocks reused),
  ``free_all_blocks(stream=None)``, ``used_bytes()``, ``total_bytes()``,
  ``n_free_blocks()``; ``cuda.set_allocator(allocator=None)``, ``get_allocator()``,
  ``using_allocator(allocator=None)``, ``cupy.get_default_memory_pool()``;
- ``cuda.alloc_pinned_memory(size) -> PinnedMemoryPointer`` (the default pinned
  pool: 512-byte units, ``hostAlloc(size, hostAllocPortable)``);
  ``cuda.PinnedMemory(size, flags=0)`` (``ptr``, ``size``);
  ``cuda.PinnedMemoryPool()`` with ``malloc(size)`` (512-byte units, blocks back
  to the pool with their last reference), ``free_all_blocks()``;
  ``cuda.PinnedMemoryPointer(mem, offset)`` with ``mem``, ``ptr``, ``size()`` (a
  method), ``__int__`` and the buffer protocol (``numpy.frombuffer``), as in
  ``cupy/cuda/pinned_memory.pyx``;
- ``ndarray.__dlpack__(*, stream=None, max_version: tuple = None, dl_device=None,
  copy=None)`` (``stream`` None, -1 or >= 1: 0 is refused on CUDA),
  ``__dlpack_device__() -> (2, device)`` (kDLCUDA); ``asarray(a, dtype=None,
  order=None, *, copy=None, blocking=False)`` of a CUDA array interface reads
  ``shape`` (a tuple: Cython-typed), ``typestr``, ``data``, ``strides``, refuses
  a ``mask`` and ignores ``descr``; of a numpy array it copies to new device
  memory from the current allocator; ``empty(shape, dtype=float, order='C')``;
  ``ndarray.fill(value)``, ``size``, ``ndim``, ``nbytes``, ``data``, ``get()``;
  ``cupy.uint8`` etc. are numpy's types (as in CuPy).

For numba's CUDA simulator, which has no ``cuda.as_cuda_array``,
:meth:`FakeCupy.simulator_array` plays it: a simulator array over the host
bytes behind a fake device (or mapped) address.

How faithful it is (what a test can rely on):

- Device memory is host memory at a fake address ``DEVICE_BASE`` (2**48) above
  it: not host-dereferenceable, like real device memory; the fake translates it
  in copies. Mapped host memory has a device alias ``alias_offset`` bytes away
  from the host pointer (0 as on Linux with UVA; nonzero in tests that check
  rtmem never confuses the two). Copies and memsets check bounds against the live
  allocation and raise ``CUDARuntimeError`` (invalid value) on overrun, use after
  free or a pointer in no allocation above the host address range. ``free`` /
  ``freeHost`` overwrite the bytes with ``FREED``; a view made before (``host_view``,
  an ndarray's DLPack capsule, which holds the ndarray as CuPy's does) reads them.
- Every stream, the null (legacy) stream included, runs its work in order on its
  own thread, so copies really are asynchronous; the synchronous ``memcpy`` /
  ``memset`` run on the null stream and wait. Blocking streams are treated as
  non-blocking (rtmem creates only non-blocking ones). ``free``/``freeHost``
  synchronize the device first, as CUDA does.
- An error raised by queued work is kept (``async_errors``) and raised by the next
  synchronize, like CUDA's sticky errors. Waits time out after ``WAIT_S`` seconds
  (raising) instead of hanging the test run. Event and stream ``done`` (CuPy's
  ``cudaEventQuery`` / ``cudaStreamQuery``) raise a kept error too, as CUDA's
  queries report a sticky error.
- ``calls`` logs every runtime call as ``(name, args)``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import queue
import threading
import time
import types
import weakref

import numpy as np

DEVICE_BASE = 1 << 48          # fake device addresses: never valid host addresses
FREED = 0xFE                   # what free/freeHost write over an allocation's bytes
HOST_LIMIT = 1 << 47           # x86-64 user space ends here
WAIT_S = 20.0                  # longest wait before a fake wait raises

_ERRORS = {1: ("cudaErrorInvalidValue", "invalid argument"),
           2: ("cudaErrorMemoryAllocation", "out of memory"),
           101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
           400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
           600: ("cudaErrorNotReady", "device not ready"),
           700: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
           999: ("fakeWaitTimeout", f"a fake wait took over {WAIT_S} s (a hang)")}


class CUDARuntimeError(RuntimeError):
    """CuPy's ``cupy_backends.cuda.api.runtime.CUDARuntimeError``."""

    def __init__(self, status):
        self.status = status
        name, text = _ERRORS.get(status, ("cudaErrorUnknown", "unknown error"))
        super().__init__(f"{name}: {text}")


class PointerAttributes:
    """CuPy's ``runtime.PointerAttributes(device, devicePointer, hostPointer, type)``."""

    def __init__(self, device, devicePointer, hostPointer, type=-1):  # noqa: A002
        self.device, self.devicePointer = device, devicePointer
        self.hostPointer, self.type = hostPointer, type


class _Alloc:
    """One live allocation: ``addr`` is what the caller got; ``host`` the real
    address of its bytes; ``alias`` the device alias of mapped host memory."""

    __slots__ = ("kind", "addr", "host", "size", "flags", "alias", "keep")

    def __init__(self, kind, addr, host, size, flags, alias, keep):
        self.kind, self.addr, self.host, self.size = kind, addr, host, size
        self.flags, self.alias, self.keep = flags, alias, keep


class FakeCupy:
    """The fake's state plus its module tree (``modules``); see the module doc."""

    def __init__(self, *, device: int = 0, device_count: int = 1,
                 device_bytes: int = 1 << 30, host_bytes: int = 1 << 30,
                 alias_offset: int = 0, name: bytes = b"Fake H200"):
        self.device, self.device_count = device, device_count
        self.device_bytes, self.host_bytes = device_bytes, host_bytes
        self.alias_offset, self.name = alias_offset, name
        self.calls = []
        self.async_errors = []
        self.dlpack_calls = []
        self.live = {}                 # addr -> _Alloc
        self.device_used = self.host_used = 0
        self.fail_malloc = self.fail_host_alloc = False
        self.raw_kernels = True        # False: RawKernel fails as without NVRTC
        self._lock = threading.Lock()
        self._ids = itertools.count(0x5000, 0x10)
        self._streams = {}             # ptr -> Stream (all live streams)
        self._events = weakref.WeakValueDictionary()   # ptr -> Event
        self._tls = threading.local()
        self._closed = False
        self.modules = self._build_modules()

    # ------------------------------------------------------------ memory
    def _log(self, name, *args):
        self.calls.append((name, args))

    def calls_named(self, name):
        """Argument tuples of every logged call of runtime function ``name``."""
        return [args for n, args in self.calls if n == name]

    def _new_bytes(self, size, align):
        keep = np.empty(size + align, dtype=np.uint8)
        host = keep.ctypes.data + (-keep.ctypes.data) % align
        return keep, host

    def _find(self, ptr):
        """(allocation, offset, via_alias) holding address ``ptr``, or None."""
        for a in list(self.live.values()):
            if a.addr <= ptr < a.addr + max(a.size, 1):
                return a, ptr - a.addr, False
            if a.alias is not None and a.alias != a.addr and \
                    a.alias <= ptr < a.alias + max(a.size, 1):
                return a, ptr - a.alias, True
        return None

    def resolve(self, ptr: int, nbytes: int) -> int:
        """The real host address of ``nbytes`` bytes at fake address ``ptr``
        (device, alias or host); CUDARuntimeError(1) when they are not inside
        one live allocation."""
        ptr, nbytes = int(ptr), int(nbytes)
        hit = self._find(ptr)
        if hit is None:
            if ptr >= HOST_LIMIT or ptr <= 0:
                raise CUDARuntimeError(1)     # a dangling or wild device pointer
            return ptr                         # pageable host memory (numpy, ...)
        a, off, _ = hit
        if off + nbytes > a.size:
            raise CUDARuntimeError(1)          # runs past the allocation
        return a.host + off

    def host_view(self, ptr: int, nbytes: int, owner=None) -> np.ndarray:
        """A numpy uint8 view of ``nbytes`` bytes at fake address ``ptr`` (how a
        test plays a GPU kernel reading or writing device memory); it keeps
        ``owner`` alive. The view holds the allocation's bytes, so reading it
        after the allocation was freed reads ``FREED`` bytes (the fake's
        use-after-free mark), not memory numpy gave back (a crash or garbage)."""
        real = self.resolve(ptr, nbytes)
        raw = (ctypes.c_uint8 * int(nbytes)).from_address(real)
        hit = self._find(int(ptr))
        raw._keep = None if hit is None else hit[0].keep
        raw._owner = owner
        return np.ctypeslib.as_array(raw)

    def simulator_array(self, obj, sync: bool = True):
        """``numba.cuda.as_cuda_array(obj, sync=True)`` for numba's CUDA simulator,
        which lacks it (and ``is_cuda_array``): a simulator array over the bytes
        that ``obj.__cuda_array_interface__`` points at, translated to the host
        memory behind the fake's address, so a simulated kernel reads and writes
        the fake's device memory in place. Like numba, ``sync`` first waits for
        the interface's ``stream`` (1 and 2: the legacy / per-thread default
        stream). Simulator arrays pass through; the view keeps ``obj`` alive.
        A test installs it with ``monkeypatch.setattr(numba.cuda, "as_cuda_array",
        fake.simulator_array, raising=False)``."""
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        if isinstance(obj, FakeCUDAArray):
            return obj
        cai = obj.__cuda_array_interface__
        shape, dtype = tuple(int(d) for d in cai["shape"]), np.dtype(cai["typestr"])
        c_strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * dtype.itemsize
                          for i in range(len(shape)))
        if cai.get("strides") is not None and tuple(cai["strides"]) != c_strides:
            raise NotImplementedError("the fake's simulator view takes C-contiguous "
                                      "arrays only")
        stream = cai.get("stream")
        if sync and stream:
            (self.null_stream if stream in (1, 2) else self._stream_of(stream)).synchronize()
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return FakeCUDAArray(np.empty(shape, dtype))
        raw = (ctypes.c_uint8 * nbytes).from_address(self.resolve(cai["data"][0], nbytes))
        raw._owner = obj                               # the memory outlives every view
        return FakeCUDAArray(np.ctypeslib.as_array(raw).view(dtype).reshape(shape))

    # ----------------------------------------------------------- streams
    def _current(self):
        stack = getattr(self._tls, "stack", None)
        return stack[-1] if stack else self.null_stream

    def _stream_of(self, ptr):
        s = self._streams.get(int(ptr))
        if s is None:
            raise CUDARuntimeError(400)
        return s

    def _wait(self, flag):
        if not flag.wait(WAIT_S):
            raise CUDARuntimeError(999)        # a hang in the code under test

    def _raise_sticky(self):
        if self.async_errors:
            raise self.async_errors[0]

    def synchronize_all(self):
        for s in list(self._streams.values()):
            s.synchronize()

    def shutdown(self):
        """Stop every stream thread (after draining it)."""
        self._closed = True
        for s in list(self._streams.values()):
            s._stop()
        self._streams.clear()

    # ----------------------------------------------------------- modules
    def _build_modules(self):
        fake = self
        rt = types.ModuleType("cupy.cuda.runtime")
        rt.CUDARuntimeError = CUDARuntimeError
        rt.PointerAttributes = PointerAttributes
        rt.hostAllocDefault, rt.hostAllocPortable = 0, 1
        rt.hostAllocMapped, rt.hostAllocWriteCombined = 2, 4
        rt.memoryTypeUnregistered, rt.memoryTypeHost = 0, 1
        rt.memoryTypeDevice, rt.memoryTypeManaged = 2, 3
        rt.memcpyHostToHost, rt.memcpyHostToDevice = 0, 1
        rt.memcpyDeviceToHost, rt.memcpyDeviceToDevice, rt.memcpyDefault = 2, 3, 4
        rt.streamLegacy, rt.streamPerThread = 1, 2

        def getDeviceCount():
            fake._log("getDeviceCount")
            return fake.device_count

        def getDevice():
            fake._log("getDevice")
            return fake.device

        def getDeviceProperties(device):
            fake._log("getDeviceProperties", device)
            if not 0 <= int(device) < fake.device_count:
                raise CUDARuntimeError(101)
            return {"name": fake.name, "totalGlobalMem": fake.device_bytes,
                    "major": 9, "minor": 0, "canMapHostMemory": 1,
                    "multiProcessorCount": 132, "unifiedAddressing": 1,
                    "l2CacheSize": 50 << 20}

        def driverGetVersion():
            return 13000

        def runtimeGetVersion():
            return 13000

        def memGetInfo():
            return fake.device_bytes - fake.device_used, fake.device_bytes

        def malloc(size):
            size = int(size)
            fake._log("malloc", size)
            with fake._lock:
                if fake.fail_malloc or fake.device_used + size > fake.device_bytes:
                    raise CUDARuntimeError(2)
                keep, host = fake._new_bytes(size, 256)
                a = _Alloc("device", DEVICE_BASE + host, host, size, 0, None, keep)
                fake.live[a.addr] = a
                fake.device_used += size
            return a.addr

        def hostAlloc(size, flags):
            size, flags = int(size), int(flags)
            fake._log("hostAlloc", size, flags)
            if flags & ~7:
                raise CUDARuntimeError(1)
            with fake._lock:
                if fake.fail_host_alloc or fake.host_used + size > fake.host_bytes:
                    raise CUDARuntimeError(2)
                keep, host = fake._new_bytes(size, 4096)
                alias = host + fake.alias_offset if flags & 2 else None
                a = _Alloc("host", host, host, size, flags, alias, keep)
                fake.live[a.addr] = a
                fake.host_used += size
            return a.addr

        def _release(ptr, kind):
            fake.synchronize_all()             # cudaFree/cudaFreeHost synchronize
            with fake._lock:
                a = fake.live.get(int(ptr))
                if a is None or a.kind != kind:
                    raise CUDARuntimeError(1)
                del fake.live[a.addr]
                # views made before the free still hold the bytes: they read this
                a.keep[:] = FREED
                if kind == "device":
                    fake.device_used -= a.size
                else:
                    fake.host_used -= a.size

        def free(ptr):
            fake._log("free", ptr)
            _release(ptr, "device")

        def freeHost(ptr):
            fake._log("freeHost", ptr)
            _release(ptr, "host")

        def pointerGetAttributes(ptr):
            fake._log("pointerGetAttributes", ptr)
            hit = fake._find(int(ptr))
            if hit is None:
                return PointerAttributes(-2, 0, 0, 0)
            a, off, _ = hit
            if a.kind == "device":
                return PointerAttributes(fake.device, a.addr + off, 0, 2)
            dev = 0 if a.alias is None else a.alias + off
            return PointerAttributes(fake.device, dev, a.host + off, 1)

        def _check_kind(kind, dst, src):
            kind = int(kind)
            if kind not in (0, 1, 2, 3, 4):
                raise CUDARuntimeError(1)
            if kind == 4:
                return
            on_dev = []
            for p in (dst, src):
                hit = fake._find(int(p))
                on_dev.append(hit is not None and (hit[0].kind == "device" or hit[2]))
            if on_dev != [kind in (1, 3), kind in (2, 3)]:
                raise CUDARuntimeError(1)      # the kind contradicts the pointers

        def _copy_op(dst, src, size):
            size = int(size)
            real_dst, real_src = fake.resolve(dst, size), fake.resolve(src, size)
            return lambda: ctypes.memmove(real_dst, real_src, size)

        def memcpyAsync(dst, src, size, kind, stream):
            fake._log("memcpyAsync", dst, src, size, kind, stream)
            _check_kind(kind, dst, src)
            fake._stream_of(stream)._enqueue(_copy_op(dst, src, size))

        def memcpy(dst, src, size, kind):
            fake._log("memcpy", dst, src, size, kind)
            _check_kind(kind, dst, src)
            fake.null_stream._enqueue(_copy_op(dst, src, size))
            fake.null_stream.synchronize()

        def _set_op(ptr, value, size):
            real = fake.resolve(ptr, int(size))
            return lambda: ctypes.memset(real, int(value) & 0xFF, int(size))

        def memsetAsync(ptr, value, size, stream):
            fake._log("memsetAsync", ptr, value, size, stream)
            fake._stream_of(stream)._enqueue(_set_op(ptr, value, size))

        def memset(ptr, value, size):
            fake._log("memset", ptr, value, size)
            fake.null_stream._enqueue(_set_op(ptr, value, size))
            fake.null_stream.synchronize()

        def streamSynchronize(stream):
            fake._stream_of(stream).synchronize()

        def deviceSynchronize():
            fake._log("deviceSynchronize")
            fake.synchronize_all()
            fake._raise_sticky()

        def streamWaitEvent(stream, event, flags=0):
            fake._log("streamWaitEvent", stream, event, flags)
            ev = fake._events.get(int(event))
            if ev is None:
                raise CUDARuntimeError(400)         # cudaErrorInvalidResourceHandle
            fake._stream_of(stream).wait_event(ev)

        for f in (getDeviceCount, getDevice, getDeviceProperties, driverGetVersion,
                  runtimeGetVersion, memGetInfo, malloc, hostAlloc, free, freeHost,
                  pointerGetAttributes, memcpyAsync, memcpy, memsetAsync, memset,
                  streamSynchronize, deviceSynchronize, streamWaitEvent):
            setattr(rt, f.__name__, f)

        class _Mark(threading.Event):
            """One recording of an event: set, with the time ``t`` it was reached
            (time.perf_counter seconds), when the stream gets there."""
            t = None

        class Event:
            """``cupy.cuda.Event``: ``record`` replaces the flag, so waiters that
            captured an earlier recording are not confused."""

            def __init__(self, block=False, disable_timing=False, interprocess=False):
                if interprocess and not disable_timing:
                    raise ValueError("Timing must be disabled for interprocess events")
                self.block, self.disable_timing = block, disable_timing
                self.ptr = next(fake._ids)
                self._flag = None
                fake._events[self.ptr] = self

            def record(self, stream=None):
                s = fake._current() if stream is None else stream
                flag = _Mark()
                self._flag = flag

                def reached():
                    flag.t = time.perf_counter()
                    flag.set()
                s._enqueue(reached)

            @property
            def done(self):
                fake._raise_sticky()        # cudaEventQuery reports a sticky error
                flag = self._flag
                return flag is None or flag.is_set()

            def synchronize(self):
                flag = self._flag
                if flag is not None:
                    fake._wait(flag)
                fake._raise_sticky()

        class Stream:
            """``cupy.cuda.Stream``: one worker thread runs its work in order."""

            null = None

            def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
                if fake._closed:
                    raise CUDARuntimeError(400)
                self.ptr = 0 if null else next(fake._ids)
                self.device_id = fake.device
                self.non_blocking = bool(non_blocking)
                self._queue = queue.Queue()
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"fake-stream-{self.ptr:x}")
                self._thread.start()
                fake._streams[self.ptr] = self

            def _run(self):
                while True:
                    op = self._queue.get()
                    if op is None:
                        return
                    try:
                        op()
                    except BaseException as exc:   # kept, raised at the next sync
                        fake.async_errors.append(exc)
                    finally:
                        self._queue.task_done()

            def _enqueue(self, op):
                if fake._closed:
                    raise CUDARuntimeError(400)
                self._queue.put(op)

            def _stop(self):
                self._queue.put(None)
                self._thread.join(WAIT_S)

            def synchronize(self):
                flag = threading.Event()
                self._enqueue(flag.set)
                fake._wait(flag)
                fake._raise_sticky()

            @property
            def done(self):
                fake._raise_sticky()        # cudaStreamQuery reports a sticky error
                return self._queue.unfinished_tasks == 0

            def wait_event(self, event):
                flag = event._flag
                if flag is not None:
                    self._enqueue(lambda: fake._wait(flag))

            def record(self, event=None):
                event = Event() if event is None else event
                event.record(self)
                return event

            def launch_host_func(self, callback, arg):
                self._enqueue(lambda: callback(arg))

            def __enter__(self):
                stack = getattr(fake._tls, "stack", None)
                if stack is None:
                    stack = fake._tls.stack = []
                stack.append(self)
                return self

            def __exit__(self, *exc):
                fake._tls.stack.pop()

            def __eq__(self, other):
                return isinstance(other, Stream) and other.ptr == self.ptr

            @classmethod
            def from_external(cls, obj):
                """``cupy.cuda.Stream.from_external(obj)`` (CuPy >= 14): the
                stream whose handle ``obj.__cuda_stream__()`` returns."""
                version, ptr = obj.__cuda_stream__()
                if version != 0:
                    raise TypeError(f"unknown __cuda_stream__ version {version}")
                return ExternalStream(ptr)

            def __hash__(self):
                return self.ptr

            def __repr__(self):
                return f"<fake Stream {self.ptr:#x}>"

        def get_current_stream(device_id=-1):
            return fake._current()

        def ExternalStream(ptr, device_id=-1):
            """``cupy.cuda.ExternalStream``: a handle on a stream made elsewhere (a
            torch stream); here, the fake stream with that handle."""
            return fake.null_stream if int(ptr) == 0 else fake._stream_of(ptr)

        def get_elapsed_time(start_event, end_event):
            """``cupy.cuda.get_elapsed_time(start_event, end_event) -> float``
            milliseconds (cudaEventElapsedTime: invalid resource handle when an
            event was never recorded or has timing disabled, not ready while one
            has not completed)."""
            marks = []
            for ev in (start_event, end_event):
                if ev.disable_timing or ev._flag is None:
                    raise CUDARuntimeError(400)
                if not ev._flag.is_set():
                    raise CUDARuntimeError(600)
                marks.append(ev._flag.t)
            return (marks[1] - marks[0]) * 1e3

        class BaseMemory:
            pass

        class UnownedMemory(BaseMemory):
            """``cupy.cuda.UnownedMemory(ptr, size, owner, device_id=-1)``."""

            def __init__(self, ptr, size, owner, device_id=-1):
                if device_id < 0:
                    device_id = pointerGetAttributes(ptr).device
                self.ptr, self.size, self._owner = int(ptr), int(size), owner
                self.device_id = device_id

        class _PoolMemory(BaseMemory):
            """A block of a MemoryPool (CuPy's PooledMemory): back to the pool's
            free list when the last MemoryPointer to it goes."""

            def __init__(self, pool, ptr, size):
                self.pool, self.ptr, self.size = pool, ptr, size
                self.device_id = fake.device

            def __del__(self):
                if self.ptr and not fake._closed:
                    self.pool._give_back(self.ptr, self.size)

        class MemoryPointer:
            """``cupy.cuda.MemoryPointer(mem, offset)``."""

            def __init__(self, mem, offset):
                if not isinstance(mem, BaseMemory):
                    raise TypeError("mem must be a cupy.cuda.BaseMemory")
                self.mem, self.ptr = mem, mem.ptr + int(offset)
                self.device_id = mem.device_id

        class MemoryPool:
            """``cupy.cuda.MemoryPool(allocator=None)``: ``malloc(size) ->
            MemoryPointer`` (rounded up to 512 bytes; a freed block of that size is
            reused, else cudaMalloc; on out-of-memory the free blocks are released
            and the cudaMalloc retried, as CuPy does), ``free_all_blocks(stream=None)``,
            ``used_bytes()``, ``total_bytes()``, ``n_free_blocks()``."""

            UNIT = 512

            def __init__(self, allocator=None):
                self._lock = threading.RLock()   # a block may come back from a GC
                self._free = collections.defaultdict(list)    # size -> [ptr]
                self._used = self._total = 0

            def malloc(self, size):
                size = int(size)
                if size == 0:
                    return MemoryPointer(_PoolMemory(self, 0, 0), 0)
                size = -(-size // self.UNIT) * self.UNIT
                with self._lock:
                    ptr = self._free[size].pop() if self._free[size] else None
                if ptr is None:
                    try:
                        ptr = malloc(size)
                    except CUDARuntimeError as e:
                        if e.status != 2:
                            raise
                        self.free_all_blocks()
                        ptr = malloc(size)
                    with self._lock:
                        self._total += size
                with self._lock:
                    self._used += size
                return MemoryPointer(_PoolMemory(self, ptr, size), 0)

            def _give_back(self, ptr, size):
                with self._lock:
                    self._free[size].append(ptr)
                    self._used -= size

            def free_all_blocks(self, stream=None):
                with self._lock:
                    blocks = [(p, n) for n, ps in self._free.items() for p in ps]
                    self._free.clear()
                    self._total -= sum(n for _, n in blocks)
                for p, _ in blocks:
                    free(p)

            def used_bytes(self):
                return self._used

            def total_bytes(self):
                return self._total

            def n_free_blocks(self):
                with self._lock:
                    return sum(len(ps) for ps in self._free.values())

        class PinnedMemory:
            """``cupy.cuda.PinnedMemory(size, flags=0)``: ``ptr``, ``size``;
            cudaFreeHost when it goes."""

            def __init__(self, size, flags=0):
                self.size, self.ptr = int(size), 0
                if self.size > 0:
                    self.ptr = hostAlloc(self.size, flags)

            def __del__(self):
                if self.ptr and not fake._closed and self.ptr in fake.live:
                    freeHost(self.ptr)

            def __int__(self):
                return self.ptr

        class PinnedMemoryPointer:
            """``cupy.cuda.PinnedMemoryPointer(mem, offset)``: ``mem``, ``ptr``,
            ``size()`` (a method: ``mem.size - offset``), ``int()`` and the buffer
            protocol over ``size()`` bytes (what ``numpy.frombuffer`` reads). A
            Python 3.11 class cannot export a buffer, so an instance is of a
            ctypes-array subclass of its byte count."""

            _types = {}

            def __new__(cls, mem, offset):
                offset = int(offset)
                n = mem.size - offset
                sub = cls._types.get(n)
                if sub is None:
                    sub = cls._types[n] = type("PinnedMemoryPointer",
                                               (cls, ctypes.c_uint8 * n), {})
                if n > 0:
                    self = sub.from_address(fake.resolve(mem.ptr + offset, n))
                else:
                    self = sub()
                self.mem, self.ptr = mem, mem.ptr + offset
                return self

            def __init__(self, mem, offset):
                pass

            def size(self):
                return self.mem.size - (self.ptr - self.mem.ptr)

            def __int__(self):
                return self.ptr

        def alloc_pinned_memory(size):
            """``cupy.cuda.alloc_pinned_memory(size) -> PinnedMemoryPointer``
            through CuPy's default allocator, the pinned memory pool (sizes rounded
            up to 512 bytes, cudaHostAlloc with hostAllocPortable); the fake does not
            reuse blocks: each goes back with its last reference."""
            size = int(size)
            if size == 0:
                return PinnedMemoryPointer(PinnedMemory(0), 0)
            size = -(-size // 512) * 512
            return PinnedMemoryPointer(PinnedMemory(size, rt.hostAllocPortable), 0)

        class PinnedMemoryPool:
            """``cupy.cuda.PinnedMemoryPool()``: ``malloc(size) ->
            PinnedMemoryPointer`` whose ``mem.size`` is the size rounded up to 512
            bytes (cudaHostAlloc with hostAllocPortable); a block goes back to the
            pool with its last reference, ``free_all_blocks()`` releases them, as
            in ``cupy/cuda/pinned_memory.pyx``."""

            UNIT = 512

            def __init__(self):
                self._free = collections.defaultdict(list)    # size -> [PinnedMemory]

            def malloc(self, size):
                size = int(size)
                if size == 0:
                    return PinnedMemoryPointer(PinnedMemory(0), 0)
                size = -(-size // self.UNIT) * self.UNIT
                free = self._free[size]
                mem = free.pop() if free else PinnedMemory(size, rt.hostAllocPortable)
                return PinnedMemoryPointer(_PooledPinned(self, mem), 0)

            def free_all_blocks(self):
                self._free.clear()

        class _PooledPinned:
            """A pool block: ``ptr``, ``size``; back to the pool when it goes."""

            def __init__(self, pool, mem):
                self.pool, self.mem, self.ptr, self.size = pool, mem, mem.ptr, mem.size

            def __del__(self):
                if not fake._closed:
                    self.pool._free[self.size].append(self.mem)

        default_pool = MemoryPool()
        allocator_state = {"global": default_pool.malloc}

        def set_allocator(allocator=None):
            if getattr(fake._tls, "allocator", None):       # as CuPy's memory.pyx
                raise ValueError("Can't change the global allocator inside "
                                 "`using_allocator` context manager")
            allocator_state["global"] = allocator

        def get_allocator():
            local = getattr(fake._tls, "allocator", None)
            return local[-1] if local else allocator_state["global"]

        @contextlib.contextmanager
        def using_allocator(allocator=None):
            local = getattr(fake._tls, "allocator", None)
            if local is None:
                local = fake._tls.allocator = []
            local.append(allocator)
            try:
                yield
            finally:
                local.pop()

        class ndarray:
            """A CuPy array over a ``__cuda_array_interface__`` (zero-copy)."""

            def __init__(self, cai, owner):
                if not isinstance(cai["shape"], tuple):      # CuPy: `cdef tuple shape`
                    raise TypeError("__cuda_array_interface__['shape'] must be a tuple")
                if cai.get("mask") is not None:
                    raise ValueError("CuPy currently does not support masked arrays.")
                self._cai, self._owner = dict(cai), owner
                self.shape = tuple(cai["shape"])
                self.dtype = np.dtype(cai["typestr"])
                self.data = MemoryPointer(UnownedMemory(
                    cai["data"][0], self.nbytes, owner, -1), 0)

            @classmethod
            def _allocate(cls, shape, dtype):
                """A C-contiguous array in memory from the current allocator (what
                ``cupy.empty`` does)."""
                shape = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
                dtype = np.dtype(dtype)
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                memptr = get_allocator()(nbytes)
                arr = cls({"shape": shape, "typestr": dtype.str, "data": (memptr.ptr, False),
                           "strides": None, "version": 3}, memptr)
                arr.data = memptr
                return arr

            @property
            def nbytes(self):
                return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

            @property
            def size(self):
                return int(np.prod(self.shape, dtype=np.int64))

            @property
            def ndim(self):
                return len(self.shape)

            def fill(self, value):
                """``ndarray.fill(value)``: a kernel on the current stream."""
                self[...] = value

            @property
            def __cuda_array_interface__(self):
                cur = fake._current().ptr
                return {**self._cai, "stream": cur or rt.streamLegacy}

            def view_host(self):
                """Test helper: a numpy view of the bytes (as a kernel sees them)."""
                # the view keeps the array (its memory's owner) alive: a DLPack
                # capsule of it does, as CuPy's capsule holds its ndarray
                raw = fake.host_view(self.data.ptr, self.nbytes, owner=self)
                return raw.view(self.dtype).reshape(self.shape)

            def get(self):
                fake._current().synchronize()
                return self.view_host().copy()

            def __setitem__(self, key, value):
                # a kernel: enqueued on the current stream, like CuPy's
                view = self.view_host()

                def kernel():
                    view[key] = value
                fake._current()._enqueue(kernel)

            def __dlpack_device__(self):
                return (2, self.data.device_id)

            def __dlpack__(self, *, stream=None, max_version=None, dl_device=None,
                           copy=None):
                if max_version is not None and not isinstance(max_version, tuple):
                    raise TypeError("max_version must be a tuple")   # Cython-typed
                if stream is not None and not (isinstance(stream, int)
                                               and (stream == -1 or stream >= 1)):
                    raise ValueError("On CUDA, the valid stream for the DLPack protocol "
                                     f"is -1, 1, 2, or any larger value, not {stream}")
                fake.dlpack_calls.append(dict(stream=stream, max_version=max_version,
                                              dl_device=dl_device, copy=copy))
                return self.view_host().__dlpack__()

        def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
            """``cupy.asarray(a, dtype=None, order=None, *, copy=None,
            blocking=False)``: zero-copy over a CUDA array interface; a numpy
            array (or anything numpy takes) is copied to new device memory on the
            current stream (waited for here: the fake always blocks)."""
            if dtype is not None or order not in (None, "C", "K", "A"):
                raise NotImplementedError("the fake cupy.asarray takes no dtype/order")
            if isinstance(a, ndarray):
                return a
            cai = getattr(a, "__cuda_array_interface__", None)
            if cai is not None:
                return ndarray(cai, a)
            host = np.ascontiguousarray(a)
            arr = ndarray._allocate(host.shape, host.dtype)
            if host.nbytes:
                cur = fake._current()
                memcpyAsync(arr.data.ptr, host.ctypes.data, host.nbytes,
                            rt.memcpyHostToDevice, cur.ptr)
                cur.synchronize()
            return arr

        def empty(shape, dtype=float, order="C"):
            """``cupy.empty(shape, dtype=float, order='C')`` (C order only)."""
            if order != "C":
                raise NotImplementedError("the fake cupy.empty is C-order only")
            return ndarray._allocate(shape, dtype)

        class RawKernel:
            """``cupy.RawKernel(code, name)``: no compiler here, so only the delay
            kernel of bench/pcie.py (a nap of ``args[0]`` ns on the current
            stream) runs; ``fake.raw_kernels = False`` plays a missing NVRTC."""

            def __init__(self, code, name, options=(), backend="nvrtc"):
                if not fake.raw_kernels:
                    raise RuntimeError("nvrtc: libnvrtc.so cannot be loaded")
                if f"void {name}(" not in code or name != "rtmem_delay":
                    raise NotImplementedError(f"the fake RawKernel only runs rtmem_delay, "
                                              f"got {name!r}")
                self.code, self.name = code, name

            def __call__(self, grid, block, args, *, shared_mem=0):
                fake._log("RawKernel", self.name, grid, block, args)
                ns = int(args[0])
                fake._current()._enqueue(lambda: time.sleep(ns * 1e-9))

        cuda = types.ModuleType("cupy.cuda")
        memory = types.ModuleType("cupy.cuda.memory")
        for name, obj in (("BaseMemory", BaseMemory), ("UnownedMemory", UnownedMemory),
                          ("MemoryPointer", MemoryPointer), ("MemoryPool", MemoryPool)):
            setattr(cuda, name, obj)
            setattr(memory, name, obj)
        cuda.runtime, cuda.memory = rt, memory
        cuda.Stream, cuda.Event = Stream, Event
        cuda.get_current_stream = get_current_stream
        cuda.ExternalStream = ExternalStream
        cuda.get_elapsed_time = get_elapsed_time
        cuda.PinnedMemory, cuda.PinnedMemoryPointer = PinnedMemory, PinnedMemoryPointer
        cuda.alloc_pinned_memory = alloc_pinned_memory
        cuda.PinnedMemoryPool = PinnedMemoryPool
        cuda.set_allocator, cuda.get_allocator = set_allocator, get_allocator
        cuda.using_allocator = using_allocator
        cupy = types.ModuleType("cupy")
        cupy.__version__ = "14.2.0+fake"
        cupy.cuda, cupy.ndarray, cupy.asarray, cupy.empty = cuda, ndarray, asarray, empty
        cupy.RawKernel = RawKernel
        for name in ("uint8", "int32", "int64", "uint64", "float32", "float64"):
            setattr(cupy, name, getattr(np, name))      # CuPy re-exports numpy's types
        cupy.get_default_memory_pool = lambda: default_pool
        self.null_stream = Stream(null=True)
        Stream.null = self.null_stream
        return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": rt,
                "cupy.cuda.memory": memory}


def build(**kwargs) -> FakeCupy:
    """A new fake (see :class:`FakeCupy` for the keyword arguments)."""
    return FakeCupy(**kwargs)
