"""Use a :class:`~rtmem.arena.DeviceArena` as CuPy's device allocator.

::

    from rtmem.integrations import cupy as rtcupy
    arena = rtmem.DeviceArena("8GiB")
    with rtcupy.using(arena):
        x = cupy.zeros(1 << 20)        # lives in the arena

Every CuPy allocation becomes a ``workspace`` buffer of the arena; it is freed
(stream-ordered, on CuPy's current stream) when CuPy drops the memory. Until
then it holds its slab: ``arena.close()`` with CuPy arrays alive leaves them
valid, and the slab goes back to CUDA with the last of them.

Frees that CuPy requests during a garbage collection are deferred: NOTE [ Frees
from finalizers ] in :mod:`rtmem._deferred`.
"""

from __future__ import annotations

import contextlib

from ..backends.cuda import import_cupy as _cupy
from .._deferred import flush, release, track
from ..errors import OutOfMemoryError
from . import alloc_exported, check_arena

__all__ = ["allocator_for", "flush", "install", "uninstall", "using"]


class _BufferOwner:
    """Owner object of an ``UnownedMemory``: frees the rtmem buffer when CuPy
    garbage-collects the memory. ``keep`` (the slab's allocation) keeps the
    bytes alive until then, after ``arena.close()`` too: the arena's reference
    was the only other one, and CuPy arrays used to point at freed memory."""

    __slots__ = ("buf", "keep")

    def __init__(self, buf, keep):
        self.buf, self.keep = buf, keep

    def __del__(self):
        buf, self.buf = self.buf, None
        release(buf)
        # the slab (if close() dropped the arena's hold) goes with this object


_oom_classes = {}


def _cupy_oom_class(cp):
    """An :class:`~rtmem.errors.OutOfMemoryError` that is also CuPy's
    ``cupy.cuda.memory.OutOfMemoryError`` (None if this CuPy has none).

    CuPy's callers catch its own class: cuTENSOR falls back to no workspace on
    it, user code retries smaller. rtmem's error alone went past them all.
    """
    base = getattr(getattr(cp.cuda, "memory", None), "OutOfMemoryError", None)
    if not (isinstance(base, type) and issubclass(base, BaseException)):
        return None
    cls = _oom_classes.get(base, False)
    if cls is False:
        try:
            class CupyOutOfMemoryError(OutOfMemoryError, base):
                """rtmem's OutOfMemoryError, raised to CuPy as its own class too."""

                def __init__(self, message, *, requested=None, stats=None):
                    MemoryError.__init__(self, message)     # not CuPy's (size, total)
                    self.requested, self.stats = requested, stats
                    # the attributes CuPy's own error has (-1: total not known)
                    self._size, self._total, self._limit = requested, -1, 0

                def __reduce__(self):
                    # unpickled as rtmem's class: the other side may have no CuPy
                    return (OutOfMemoryError, self.args, self.__dict__)
        except TypeError:   # a CuPy whose class cannot be combined: rtmem's alone
            CupyOutOfMemoryError = None
        cls = _oom_classes[base] = CupyOutOfMemoryError
    return cls


def allocator_for(arena, *, kind: str = "workspace"):
    """A CuPy allocator function ``(nbytes) -> cupy.cuda.MemoryPointer`` serving
    every request (bytes) from ``arena`` (a cuda-backend DeviceArena).

    Out of memory raises an :class:`~rtmem.errors.OutOfMemoryError` that is
    also a ``cupy.cuda.memory.OutOfMemoryError``, as CuPy's own pool raises."""
    cp = _cupy()
    check_arena(arena, kind, "CuPy")
    device_id = arena.backend.device_id
    oom = _cupy_oom_class(cp)
    track()

    def export(buf, ptr, keep):
        mem = cp.cuda.UnownedMemory(ptr, buf.nbytes, _BufferOwner(buf, keep), device_id)
        return cp.cuda.MemoryPointer(mem, 0)

    def allocate(nbytes):
        try:
            return alloc_exported(arena, nbytes, kind, arena.backend.current_stream(),
                                  export)
        except OutOfMemoryError as exc:
            if oom is None or isinstance(exc, oom):
                raise
            err = oom(str(exc))
            err.__dict__.update(exc.__dict__)
            raise err from None
    return allocate


def install(arena, *, kind: str = "workspace"):
    """Make ``arena`` CuPy's allocator; return the previous one (for
    :func:`uninstall`). Out of memory raises :func:`allocator_for`'s error, both
    rtmem's and CuPy's ``OutOfMemoryError``. CuPy arrays allocated from the
    arena stay valid after :meth:`~rtmem.DeviceArena.close`: each holds its slab,
    which goes back to CUDA with the last of them (uninstall first: a closed
    arena refuses new allocations)."""
    cp = _cupy()
    allocator = allocator_for(arena, kind=kind)
    previous = cp.cuda.get_allocator()
    _set_global(cp, allocator, "install an arena as")
    return previous


def uninstall(previous=None) -> None:
    """Restore ``previous`` (from :func:`install`; None: CuPy's default pool)."""
    cp = _cupy()
    _set_global(cp, previous if previous is not None
                else cp.get_default_memory_pool().malloc, "uninstall")


def _set_global(cp, allocator, what: str) -> None:
    """``cupy.cuda.set_allocator(allocator)``, whose refusal inside a
    ``using_allocator`` block (CuPy's bare ValueError) says what to do."""
    try:
        cp.cuda.set_allocator(allocator)
    except ValueError as exc:   # CuPy refuses inside cupy.cuda.using_allocator
        raise RuntimeError(
            f"cannot {what} CuPy's global allocator inside cupy.cuda.using_allocator / "
            f"rtmem.integrations.cupy.using ({exc}); call it outside that block, or use "
            f"using() alone") from exc


@contextlib.contextmanager
def using(arena, *, kind: str = "workspace"):
    """Context manager: CuPy allocates from ``arena`` inside the block (this
    thread only, as ``cupy.cuda.using_allocator``); the previous allocator is
    back after it, also after an exception. Out of memory raises
    :func:`allocator_for`'s error, both rtmem's and CuPy's ``OutOfMemoryError``.
    Arrays made inside the block may outlive it and the arena's
    :meth:`~rtmem.DeviceArena.close`, as with :func:`install`."""
    cp = _cupy()
    with cp.cuda.using_allocator(allocator_for(arena, kind=kind)):
        yield arena
