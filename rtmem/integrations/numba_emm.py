"""A numba.cuda External Memory Manager (EMM) plugin backed by rtmem.

Device allocations made by numba.cuda (``cuda.device_array``, ``to_device``,
...) come from a :class:`~rtmem.arena.DeviceArena` as ``workspace`` buffers.
Enable it before numba creates its CUDA context, either with::

    from rtmem.integrations import numba_emm
    numba_emm.install(arena)                     # or install(nbytes="4GiB")

or with the environment: ``NUMBA_CUDA_MEMORY_MANAGER=rtmem.integrations.numba_emm``
(``RTMEM_NUMBA_ARENA_BYTES`` then sizes the arena, default half the free memory).
Pinned host allocations stay with numba (``HostOnlyCUDAMemoryManager``).

One device: rtmem's cuda backend serves the CUDA device that was current when
rtmem first used it, and so does the arena. numba's context for any other
device is refused (:class:`~rtmem.errors.BackendError`, at its first use) rather
than given memory of the wrong GPU; on several GPUs run one process per GPU.
"""

from __future__ import annotations

import inspect
import os
import threading
import weakref

from .._deferred import release, track
from ..arena import UNORDERED
from ..errors import BackendError, OutOfMemoryError
from . import alloc_exported, check_arena

__all__ = ["install", "manager_class"]

_HINT = "pip install rtmem[cuda12] or rtmem[cuda13] (numba-cuda for your CUDA major)"
_lock = threading.Lock()
_arena = None          # the arena plugged in by install(); guarded by _lock
_class = None


def _numba_cuda():
    try:
        from numba import config, cuda
        from numba.cuda.cudadrv import driver
    except ImportError as exc:
        raise ModuleNotFoundError(f"rtmem.integrations.numba_emm needs numba.cuda: "
                                  f"{_HINT}") from exc
    if getattr(config, "ENABLE_CUDASIM", False) or \
            not hasattr(driver, "HostOnlyCUDAMemoryManager"):
        raise RuntimeError("numba.cuda is running the CUDA simulator "
                           "(NUMBA_ENABLE_CUDASIM=1), which has no External Memory "
                           "Manager; unset NUMBA_ENABLE_CUDASIM to use the rtmem plugin")
    return cuda, driver


def _device_pointer(driver, address: int):
    """The pointer object numba's ``MemoryPointer`` expects for ``address``.

    numba-cuda >= 0.2x always uses the NVIDIA bindings and has no
    ``USE_NV_BINDING`` flag any more: it wants a ``binding.CUdeviceptr`` (it
    reads it back with ``int()``, which a ctypes integer does not support).
    numba's built-in ``numba.cuda`` has the flag: a ``CUdeviceptr`` when it is
    set, else a ``ctypes.c_void_p`` (what its own ``MemoryPointer.view`` builds).
    """
    binding = getattr(driver, "binding", None)
    if binding is not None and getattr(driver, "USE_NV_BINDING", True):
        return binding.CUdeviceptr(int(address))
    import ctypes
    return ctypes.c_void_p(int(address))


def _release_held(held) -> None:
    """numba's deferred free of one allocation: ``held`` is (buffer, the
    allocation of its slab); the slab goes with the tuple once the buffer is
    released (at once if ``arena.close()`` dropped the arena's hold)."""
    release(held[0])


def _default_arena():
    from ..arena import DeviceArena
    from ..units import parse_bytes
    nbytes = os.environ.get("RTMEM_NUMBA_ARENA_BYTES")
    if nbytes:
        try:
            return DeviceArena(parse_bytes(nbytes), backend="cuda")
        except (ValueError, OutOfMemoryError) as exc:
            # numba makes this arena while it creates its context, far from where
            # the variable was set, and the message alone told users to pass
            # nbytes= or "1 << 30", which they never called: name the variable.
            # Same type and attributes (rtmem errors take the message positionally).
            err = type(exc)(f"RTMEM_NUMBA_ARENA_BYTES={nbytes!r}: {exc}. Set it to a "
                            f"size the device can hold (e.g. '4GiB'), or unset it for "
                            f"half the free device memory")
            err.__dict__.update(exc.__dict__)
            raise err from None
    from ..backends import get_backend
    free, _total = get_backend("cuda").runtime.memGetInfo()
    return DeviceArena(max(int(free) // 2, 1 << 20), backend="cuda")


def _backend_device() -> int:
    """The CUDA device (ordinal) of rtmem's cuda backend."""
    from ..backends import get_backend
    return get_backend("cuda").device_id


def _check_device(context, device: int) -> None:
    """Refuse numba's ``context`` unless it is for ``device`` (the ordinal of
    the arena's memory). rtmem's cuda backend serves one device per process
    (the current one when it was first used), so no arena can be made for
    another: numba allocating there must fail here, not get memory of the wrong
    GPU, which its kernels on that device would then read and write."""
    numba_device = int(context.device.id)
    if numba_device != device:
        raise BackendError(
            f"numba.cuda's context for device {numba_device} cannot allocate from "
            f"rtmem: the arena of rtmem.integrations.numba_emm is on device {device} "
            f"(rtmem's cuda backend serves one device per process, the current CUDA "
            f"device when rtmem first used it). Use numba.cuda on device {device} "
            f"only (numba.cuda.select_device({device})), or run one process per GPU "
            f"(CUDA_VISIBLE_DEVICES=<gpu>) with the plugin installed in each")


def _contexts(driver) -> list:
    """The CUDA contexts numba has made so far (a device's primary context,
    made at its first numba.cuda use). ``driver.driver.devices`` is a plain
    attribute: reading it initializes nothing."""
    devices = getattr(getattr(driver, "driver", None), "devices", None) or {}
    return [ctx for ctx in (getattr(dev, "primary_context", None)
                            for dev in list(devices.values())) if ctx is not None]


def _capacity(arena) -> tuple[int, int]:
    """(free, total) bytes of ``arena``: what it can still hand out (free bytes
    in its slabs plus the growth left) and the most it can hold (its capacity),
    each capped by the budget of every :class:`~rtmem.adaptors.LimitAdaptor` in
    its allocator stack (a 64 KiB budget on a 1 MiB arena was reported as 1 MiB
    free, more than any allocation could get)."""
    from ..adaptors import LimitAdaptor
    st = arena.stats()
    total = max(arena.core.max_bytes, st.reserved_bytes)
    free = st.free_bytes + total - st.reserved_bytes
    for limit in arena._adaptors(LimitAdaptor):
        total = min(total, limit.budget_bytes)
        free = min(free, max(limit.budget_bytes - limit.used_bytes, 0))
    return free, total


def _bind(manager, arena) -> None:
    """Make ``manager`` (a plugin instance) allocate from ``arena``, and size
    numba's deallocation threshold on it: numba frees its pending deallocations
    in a batch once they exceed a share (``CUDA_DEALLOCS_RATIO``) of
    ``deallocations.memory_capacity`` (bytes). Kept from the previous arena
    after install() switched, that threshold referred to the old arena's size:
    frees held back past what a smaller new arena can spare (or flushed early
    in a larger one)."""
    if getattr(manager, "arena", None) is not arena or \
            not manager.deallocations.memory_capacity:      # numba's 0: not set yet
        manager.deallocations.memory_capacity = _capacity(arena)[1]
    manager.arena = arena


def manager_class():
    """The EMM plugin class (built on first use so numba is imported lazily)."""
    global _class
    if _class is not None:
        return _class
    cuda, driver = _numba_cuda()
    # numba's MemoryPointer takes a context first; later numba-cuda releases may
    # drop it, so look instead of guessing.
    takes_context = "context" in inspect.signature(driver.MemoryPointer).parameters

    class RtmemNumbaMemoryManager(driver.GetIpcHandleMixin,
                                  driver.HostOnlyCUDAMemoryManager):
        """numba EMM plugin (interface version 1) allocating from an rtmem arena."""

        def initialize(self):
            """Bind to the installed arena, or make one (see module docs).

            Raises :class:`~rtmem.errors.BackendError` for a context of another
            device than the arena's: numba makes one context (and one manager)
            per device, and every one of them was bound to the one arena, so
            numba's arrays on device 1 were given device 0's memory."""
            global _arena
            track()
            with _lock:
                # One check: the default arena is on _backend_device() too. Made
                # after it, since it takes half the free memory of rtmem's device,
                # which this context could not use.
                _check_device(self.context, _backend_device() if _arena is None
                              else _arena.backend.device_id)
                if _arena is None:
                    _arena = _default_arena()
                _bind(self, _arena)

        def memalloc(self, size):
            """Allocate ``size`` bytes of device memory from the arena.

            Frees go through numba's pending-deallocation queue, as numba's own
            manager's do, so ``cuda.defer_cleanup()`` keeps the bytes reserved
            while work may still use them. They are keyed to no stream: numba
            kernels run on numba's streams, which rtmem does not see, so freed
            bytes come back only once an event recorded on the compute stream
            (the legacy default stream unless CuPy's current stream was changed),
            and with it numba's blocking streams, has passed the free: what
            numba's synchronizing cuMemFree guaranteed. The memory holds
            its slab until that free: ``arena.close()`` leaves numba's live
            device arrays valid.

            When the arena cannot serve it (after numba has flushed its pending
            frees and retried once), :class:`~rtmem.errors.OutOfMemoryError`
            is raised, not the ``CudaAPIError`` numba's own manager raises:
            code catching that misses it.
            """
            deallocations = self.deallocations

            def export(buf, address, keep):
                def finalizer(held=(buf, keep)):
                    # release() may run inside a garbage collection: NOTE [ Frees
                    # from finalizers ] in rtmem/_deferred.py. The pending free
                    # holds the slab (keep) until it runs: numba's work may use
                    # the bytes until then, after arena.close() too.
                    deallocations.add_item(_release_held, held, held[0].nbytes)
                ptr = _device_pointer(driver, address)
                if takes_context:
                    return driver.MemoryPointer(weakref.proxy(self.context), ptr, size,
                                                finalizer=finalizer)
                return driver.MemoryPointer(ptr, size, finalizer=finalizer)
            try:
                return alloc_exported(self.arena, size, "workspace", UNORDERED, export)
            except OutOfMemoryError:
                # As numba's _attempt_allocation: free what is pending, retry once.
                deallocations.clear()
                return alloc_exported(self.arena, size, "workspace", UNORDERED, export)

        def get_memory_info(self):
            """(free, total) bytes of the arena: ``total`` its capacity (the most it
            may grow to, or a ``LimitAdaptor``'s budget when smaller), ``free`` what
            it can still hand out (free bytes in its slabs plus the growth left, at
            most what the budget leaves). The reserved size alone told a growable
            arena's users a fraction of what fits."""
            free, total = _capacity(self.arena)
            return driver.MemoryInfo(free=free, total=total)

        # reset() and defer_cleanup() are HostOnlyCUDAMemoryManager's: they act
        # on self.deallocations, which holds the pending device frees too.

        @property
        def interface_version(self):
            """EMM plugin interface version (1)."""
            return 1

    RtmemNumbaMemoryManager.__qualname__ = "RtmemNumbaMemoryManager"
    RtmemNumbaMemoryManager.__module__ = __name__
    _class = RtmemNumbaMemoryManager
    return _class


def install(arena=None, *, nbytes=None) -> None:
    """Plug rtmem into numba.cuda: allocations come from ``arena`` (or a new
    DeviceArena of ``nbytes`` bytes; with neither, one numba makes when it
    creates its context, see the module docs). Call before numba's context exists.

    numba gives each context its memory manager once, when it makes the context
    (at the first numba.cuda use on a device): a context made before this call
    keeps numba's own manager for good, so install() then raises
    :class:`~rtmem.errors.BackendError` (it returned, and numba went on
    allocating with cudaMalloc as if nothing had been asked). Contexts already
    using this plugin allocate from ``arena`` from now on.

    Raises :class:`~rtmem.errors.CuPyMissingError` (a ``ModuleNotFoundError``)
    when CuPy is not installed: every arena the plugin can use is on the cuda
    backend, which needs CuPy.
    """
    global _arena
    if arena is not None and nbytes is not None:
        raise ValueError("give an arena or nbytes=, not both")
    # Everything that can fail before anything changes: a refused install
    # leaves the plugged-in arena as it was and allocates nothing.
    cuda, driver = _numba_cuda()
    cls = manager_class()
    contexts = _contexts(driver)
    for ctx in contexts:
        if not isinstance(ctx.memory_manager, cls):
            raise BackendError(
                f"numba.cuda already made its CUDA context for device {ctx.device.id}, "
                f"with its own memory manager ({type(ctx.memory_manager).__name__}), "
                f"which it keeps: install() would take effect only for contexts made "
                f"later. Call rtmem.integrations.numba_emm.install() before any "
                f"numba.cuda use, or set NUMBA_CUDA_MEMORY_MANAGER="
                f"rtmem.integrations.numba_emm before starting Python")
    if arena is None and nbytes is None:
        # The default arena is made only when numba creates its context, far from
        # this call: without CuPy, install() returned and the first numba.cuda
        # allocation failed instead. Say it here, naming the extra.
        from ..backends.cuda import import_cupy
        from ..errors import CuPyMissingError
        try:
            import_cupy()
        except CuPyMissingError as exc:
            # not import_cupy's own hint, RTMEM_BACKEND=host: no help to numba.cuda
            raise CuPyMissingError(f"rtmem.integrations.numba_emm needs CuPy (the arena "
                                   f"numba allocates from is on the cuda backend): "
                                   f"{_HINT}") from exc
    if arena is None and nbytes is not None:
        from ..arena import DeviceArena
        arena = DeviceArena(nbytes, backend="cuda")
    if arena is not None:
        check_arena(arena, "workspace", "numba.cuda")
        for ctx in contexts:
            _check_device(ctx, arena.backend.device_id)
    with _lock:
        if arena is not None:
            _arena = arena
            # The plugin's own contexts rebound only at their next push (numba
            # calls initialize() there), which most numba.cuda calls skip: now.
            for ctx in contexts:
                _bind(ctx.memory_manager, arena)
    cuda.set_memory_manager(cls)


def __getattr__(name):
    # numba's NUMBA_CUDA_MEMORY_MANAGER hook reads _numba_memory_manager.
    if name == "_numba_memory_manager":
        return manager_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
