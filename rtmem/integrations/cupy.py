"""Use a :class:`~rtmem.arena.DeviceArena` as CuPy's device allocator.

::

    from rtmem.integrations import cupy as rtcupy
    arena = rtmem.DeviceArena("8GiB")
    with rtcupy.using(arena):
        x = cupy.zeros(1 << 20)        # lives in the arena

Every CuPy allocation becomes a ``workspace`` buffer of the arena; it is freed
(stream-ordered, on CuPy's current stream) when CuPy drops the memory.

NOTE [ Frees from finalizers ]
CuPy (and numba, :mod:`rtmem.integrations.numba_emm`) drop memory from ``__del__``
/ ``weakref.finalize`` callbacks. For memory caught in a reference cycle (an
exception traceback is enough) those run inside a garbage collection, which
Python may start at any allocation, including one made while rtmem's allocator
or an arena holds its (non-reentrant) lock: freeing the buffer right there would
deadlock the thread. So a free that arrives during a collection is queued, and
done by the next allocation through these hooks or by :func:`flush`.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import sys

__all__ = ["allocator_for", "flush", "install", "uninstall", "using"]

_deferred = collections.deque()    # buffers freed during a collection (append is atomic)
_collecting = False                # a garbage collection is running (see the NOTE)


def _gc_phase(phase, _info):
    global _collecting
    _collecting = phase == "start"


gc.callbacks.append(_gc_phase)


def release(buf) -> None:
    """Free ``buf`` now, or after the running garbage collection (NOTE [ Frees
    from finalizers ]). For finalizers of memory handed to other libraries."""
    if buf is None or buf.is_freed:
        return
    if _collecting:
        _deferred.append(buf)
    elif not sys.is_finalizing():
        # At interpreter exit the CUDA context may already be gone; the process
        # releases everything then anyway.
        buf.free()


def flush() -> int:
    """Free the buffers whose release was deferred by a garbage collection;
    returns how many. Called by every allocation through these hooks."""
    n = 0
    while _deferred:
        buf = _deferred.popleft()
        if not buf.is_freed:
            buf.free()
            n += 1
    return n

_HINT = "pip install rtmem[cuda12] (or rtmem[cuda13])"


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise ModuleNotFoundError(f"rtmem.integrations.cupy needs CuPy: {_HINT}") from exc
    return cupy


class _BufferOwner:
    """Owner object of an ``UnownedMemory``: frees the rtmem buffer when CuPy
    garbage-collects the memory."""

    __slots__ = ("buf",)

    def __init__(self, buf):
        self.buf = buf

    def __del__(self):
        buf, self.buf = self.buf, None
        release(buf)


def allocator_for(arena, *, kind: str = "workspace"):
    """A CuPy allocator function ``(nbytes) -> cupy.cuda.MemoryPointer`` serving
    every request (bytes) from ``arena`` (a cuda-backend DeviceArena)."""
    cp = _cupy()
    if arena.backend.name != "cuda" or arena.location != "device":
        raise ValueError(f"CuPy needs device memory of the cuda backend; got a "
                         f"{arena.location} arena on the {arena.backend.name} backend")
    device_id = arena.backend.device_id

    def allocate(nbytes):
        if _deferred:
            flush()
        stream = arena.backend.current_stream()
        buf = arena.alloc(max(int(nbytes), 1), kind=kind, stream=stream)
        ptr = buf.__cuda_array_interface__["data"][0]
        mem = cp.cuda.UnownedMemory(ptr, max(int(nbytes), 1), _BufferOwner(buf),
                                    device_id)
        return cp.cuda.MemoryPointer(mem, 0)
    return allocate


def install(arena, *, kind: str = "workspace"):
    """Make ``arena`` CuPy's allocator; return the previous one (for
    :func:`uninstall`)."""
    cp = _cupy()
    previous = cp.cuda.get_allocator()
    cp.cuda.set_allocator(allocator_for(arena, kind=kind))
    return previous


def uninstall(previous=None) -> None:
    """Restore ``previous`` (from :func:`install`; None: CuPy's default pool)."""
    cp = _cupy()
    cp.cuda.set_allocator(previous if previous is not None
                          else cp.get_default_memory_pool().malloc)


@contextlib.contextmanager
def using(arena, *, kind: str = "workspace"):
    """Context manager: CuPy allocates from ``arena`` inside the block (this
    thread only, as ``cupy.cuda.using_allocator``)."""
    cp = _cupy()
    with cp.cuda.using_allocator(allocator_for(arena, kind=kind)):
        yield arena
