"""Frees of rtmem buffers requested by other libraries' finalizers.

NOTE [ Frees from finalizers ]
CuPy (:mod:`rtmem.integrations.cupy`) and numba
(:mod:`rtmem.integrations.numba_emm`) drop memory from ``__del__`` /
``weakref.finalize`` callbacks. For memory caught in a reference cycle (an
exception traceback is enough) those run inside a garbage collection, which
Python may start at any allocation, including one made while rtmem's allocator
or an arena holds its (non-reentrant) lock: freeing the buffer right there would
deadlock the thread. So a free that arrives during a collection is queued, and
done by the next allocation through these hooks or by :func:`flush`.
"""

from __future__ import annotations

import collections
import gc
import sys

__all__ = ["flush", "release", "track"]

_deferred = collections.deque()    # buffers freed during a collection (append is atomic)
_collecting = False                # a garbage collection is running (see the NOTE)


def _gc_phase(phase, _info):
    global _collecting
    _collecting = phase == "start"


def track() -> None:
    """Start following garbage collections (idempotent). Called when a hook is
    made, so processes that never hand memory to CuPy or numba pay nothing."""
    if _gc_phase not in gc.callbacks:
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
    returns how many. Called by every allocation through the hooks."""
    n = 0
    while _deferred:
        buf = _deferred.popleft()
        if not buf.is_freed:
            buf.free()
            n += 1
    return n
