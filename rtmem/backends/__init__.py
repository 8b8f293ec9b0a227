"""Memory backends: where slabs come from and how copies run.

Two backends implement one interface (:class:`Backend`):

- ``cuda`` (:mod:`rtmem.backends.cuda`): cudaMalloc slabs, cudaHostAlloc pinned /
  mapped slabs, CUDA streams and events, ``cudaMemcpyAsync``; needs CuPy.
- ``host`` (:mod:`rtmem.backends.host`): page-aligned numpy slabs, one copy
  thread per stream, events built on ``threading.Event``. It is the faithful twin
  of the cuda backend: the same ordering rules, so a missing wait fails on CPU.

Selection (:func:`get_backend`): ``RTMEM_BACKEND=cuda|host``, else ``cuda`` when a
GPU is usable through CuPy, else ``host``.

NOTE [ Stream and event semantics ]
Both backends follow CUDA's rules:

1. Work enqueued on one stream runs in enqueue order; different streams may run
   concurrently.
2. ``event.record(stream)`` captures the work enqueued on ``stream`` so far;
   ``event.query()`` is True once that work is done (and for a never-recorded
   event); ``event.synchronize()`` blocks the calling thread until then.
3. ``stream.wait_event(event)`` makes work enqueued later on ``stream`` wait for
   the event's captured work; it does not block the caller.
4. The *compute* stream (``backend.current_stream()``) is where user work runs.
   On the host backend it is synchronous: work runs in the calling thread, and
   the stream says so (``stream.synchronous``), so a free on it needs no ordering.
"""

from __future__ import annotations

import abc
import os
import threading

from ..errors import BackendError

__all__ = ["Backend", "Slab", "BACKENDS", "backend_name", "cuda_available",
           "get_backend"]

#: Names accepted by ``RTMEM_BACKEND`` and :func:`get_backend`.
BACKENDS = ("cuda", "host")


class Slab:
    """One upstream allocation: a contiguous range of ``nbytes`` bytes.

    ``location`` is ``"device"`` or ``"host"``. ``ptr`` is its address in its own
    address space (device address for device slabs). ``device_ptr`` is the
    address kernels use (device slabs: ``ptr``; mapped host slabs: the device
    alias; ``None`` for host memory the device cannot address). ``host_array`` is
    a numpy ``uint8`` view of the whole slab when the host can address it, else
    ``None``. ``owner`` keeps the underlying memory alive.
    """

    __slots__ = ("backend", "nbytes", "ptr", "device_ptr", "host_array", "location",
                 "pinned", "mapped", "owner", "__weakref__")

    def __init__(self, backend, nbytes, ptr, *, location, device_ptr=None,
                 host_array=None, pinned=False, mapped=False, owner=None):
        self.backend = backend
        self.nbytes = int(nbytes)
        self.ptr = int(ptr)
        self.device_ptr = None if device_ptr is None else int(device_ptr)
        self.host_array = host_array
        self.location = location
        self.pinned = pinned
        self.mapped = mapped
        self.owner = owner

    def __repr__(self) -> str:
        extra = " pinned" if self.pinned else ""
        extra += " mapped" if self.mapped else ""
        return (f"<Slab {self.backend.name}:{self.location}{extra} "
                f"{self.nbytes} B at 0x{self.ptr:x}>")


def _slab_size(nbytes) -> int:
    """``nbytes`` as the size of a new slab; a ValueError unless > 0. Checked by
    both backends alike: cudaMalloc(0) succeeds with a null pointer, and a
    negative size failed deep in CuPy (OverflowError) or not at all (fakes)."""
    nbytes = int(nbytes)
    if nbytes <= 0:
        raise ValueError(f"slab size must be > 0 bytes, got {nbytes}")
    return nbytes


def _check_span(slab: Slab, offset, nbytes, what: str) -> None:
    """A ValueError unless ``nbytes`` bytes at ``offset`` lie inside ``slab``.
    Checked by both backends alike: the host one's slicing cut a bad span short
    (a short copy, or nearly the whole slab for a negative size) and CUDA
    touches whatever memory follows the slab."""
    if offset < 0 or nbytes < 0 or offset + nbytes > slab.nbytes:
        raise ValueError(f"{what}: {nbytes} bytes at offset {offset} do not fit in "
                         f"{slab!r}; pass a span inside the slab")


def _check_byte(value) -> int:
    """``value`` for ``fill``: an int 0..255 (CUDA's memset silently kept the low
    byte of anything else, numpy raised OverflowError)."""
    value = int(value)
    if not 0 <= value <= 255:
        raise ValueError(f"fill value must be a byte (0..255), got {value}")
    return value


class Backend(abc.ABC):
    """Interface of a memory backend. All sizes and offsets are in bytes.

    Streams expose ``wait_event(event)``, ``synchronize()``,
    ``launch_host_func(fn)`` (run ``fn()`` on the host once earlier work on the
    stream is done), ``ordered()`` (a context manager in which no other thread
    enqueues on it, so an event recorded there reports the failure of the work
    before it: NOTE [ Host stream failures ]) and ``synchronous`` (True when work
    on it runs in the calling thread, so nothing is ever pending on it); events
    expose ``record(stream=None)``, ``query()`` and ``synchronize()`` (NOTE [
    Stream and event semantics ]).
    """

    name: str = "?"
    #: The classes of this backend's streams (what ``new_stream`` and
    #: ``current_stream`` return): the streams an arena of it accepts.
    stream_types: tuple = ()

    @abc.abstractmethod
    def device_slab(self, nbytes: int) -> Slab:
        """Allocate ``nbytes`` bytes of device memory."""

    @abc.abstractmethod
    def host_slab(self, nbytes: int, *, pinned: bool = True, mapped: bool = False) -> Slab:
        """Allocate ``nbytes`` bytes of host memory, page-locked when ``pinned``,
        also addressable by the device when ``mapped``."""

    @abc.abstractmethod
    def release(self, slab: Slab) -> None:
        """Give ``slab`` back to the system (no copy may still use it)."""

    @abc.abstractmethod
    def new_stream(self):
        """A new stream, independent of the compute stream."""

    @abc.abstractmethod
    def new_event(self):
        """A new event (complete until first recorded)."""

    @abc.abstractmethod
    def current_stream(self):
        """The compute stream user work runs on."""

    def marker(self, stream):
        """An event recorded on ``stream`` for rtmem's own bookkeeping (when freed
        memory may be reused), which no one asks for errors: on the host backend
        it reports no failure of the work it covers, leaving that to the
        stream's next event or ``synchronize()`` (NOTE [ Host stream failures ]
        in :mod:`rtmem.backends.host`). CUDA events carry no failures."""
        return self.new_event().record(stream)

    @abc.abstractmethod
    def copy_async(self, dst: Slab, dst_offset: int, src: Slab, src_offset: int,
                   nbytes: int, stream) -> None:
        """Enqueue a copy of ``nbytes`` bytes on ``stream``; both slabs are kept
        alive by the caller until the copy's event completed."""

    @abc.abstractmethod
    def fill(self, slab: Slab, offset: int, nbytes: int, value: int) -> None:
        """Set ``nbytes`` bytes to ``value`` (0..255), synchronously."""

    @abc.abstractmethod
    def read(self, slab: Slab, offset: int, nbytes: int):
        """Copy ``nbytes`` bytes to a new numpy ``uint8`` array, synchronously."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all work on all streams of this backend."""

    def retire_at_synchronize(self, allocator) -> None:
        """Have :meth:`synchronize` make ``allocator``'s stream-ordered frees
        made before it reusable by every stream (``allocator.stamp()`` before the
        wait, ``allocator.poll()`` after it; NOTE [ Stream-ordered frees ] in
        rtmem/_stream_order.py). Held weakly. A no-op on backends whose arenas
        make no stream-ordered frees (the host backend's compute stream is
        synchronous)."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """What was found (device, driver, libraries, limits), for ``rtmem doctor``."""


_lock = threading.Lock()
_instances: dict = {}
_cuda_ok = None


def _renew_lock_after_fork() -> None:
    # A thread inside get_backend at a fork() holds _lock, and does not exist in
    # the child: every later get_backend there (each transfer with the default
    # backend) waited forever. The lock guards one dict lookup and insert, so a
    # fresh one is safe (a backend half made at the fork was never inserted).
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock_after_fork)


def cuda_available() -> bool:
    """True if CuPy imports and sees at least one CUDA device (cached)."""
    global _cuda_ok
    if _cuda_ok is None:
        try:
            import cupy
            _cuda_ok = cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:   # no cupy, no driver, no device: all mean "not usable"
            _cuda_ok = False
    return _cuda_ok


def backend_name() -> str:
    """The backend to use: ``RTMEM_BACKEND`` if set, else ``cuda`` when a GPU is
    usable, else ``host``."""
    name = os.environ.get("RTMEM_BACKEND", "").strip().lower()
    if name:
        if name not in BACKENDS:
            raise BackendError(f"RTMEM_BACKEND={name!r} is not a backend; use one of "
                               f"{', '.join(BACKENDS)} or unset it to pick automatically")
        return name
    return "cuda" if cuda_available() else "host"


def get_backend(name: str | None = None) -> Backend:
    """The backend called ``name`` (default :func:`backend_name`), one per process."""
    name = backend_name() if name is None else str(name).lower()
    with _lock:
        inst = _instances.get(name)
        if inst is None:
            if name == "host":
                from .host import HostBackend
                inst = HostBackend()
            elif name == "cuda":
                from .cuda import CudaBackend
                inst = CudaBackend()
            else:
                raise BackendError(f"unknown backend {name!r}; use one of "
                                   f"{', '.join(BACKENDS)}")
            _instances[name] = inst
        return inst
