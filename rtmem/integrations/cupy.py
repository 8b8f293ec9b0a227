"""Use a :class:`~rtmem.arena.DeviceArena` as CuPy's device allocator.

::

    from rtmem.integrations import cupy as rtcupy
    arena = rtmem.DeviceArena("8GiB")
    with rtcupy.using(arena):
        x = cupy.zeros(1 << 20)        # lives in the arena

Every CuPy allocation becomes a ``workspace`` buffer of the arena; it is freed
(stream-ordered, on CuPy's current stream) when CuPy drops the memory.

Frees that CuPy requests during a garbage collection are deferred: NOTE [ Frees
from finalizers ] in :mod:`rtmem._deferred`.
"""

from __future__ import annotations

import contextlib

from ..backends.cuda import import_cupy as _cupy
from .._deferred import flush, release, track
from . import alloc_exported, check_arena

__all__ = ["allocator_for", "flush", "install", "uninstall", "using"]

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
    check_arena(arena, kind, "CuPy")
    device_id = arena.backend.device_id
    track()

    def export(buf):
        ptr = buf.__cuda_array_interface__["data"][0]
        mem = cp.cuda.UnownedMemory(ptr, buf.nbytes, _BufferOwner(buf), device_id)
        return cp.cuda.MemoryPointer(mem, 0)

    def allocate(nbytes):
        return alloc_exported(arena, nbytes, kind, arena.backend.current_stream(), export)
    return allocate


def install(arena, *, kind: str = "workspace"):
    """Make ``arena`` CuPy's allocator; return the previous one (for
    :func:`uninstall`)."""
    cp = _cupy()
    allocator = allocator_for(arena, kind=kind)
    previous = cp.cuda.get_allocator()
    try:
        cp.cuda.set_allocator(allocator)
    except ValueError as exc:   # CuPy refuses inside cupy.cuda.using_allocator
        raise RuntimeError(
            f"cannot install an arena as CuPy's global allocator inside "
            f"cupy.cuda.using_allocator / rtmem.integrations.cupy.using ({exc}); "
            f"install it outside that block, or use using() alone") from exc
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
