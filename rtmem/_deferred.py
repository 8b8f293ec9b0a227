"""Frees requested by finalizers.

NOTE [ Frees from finalizers ]
Some frees arrive from ``__del__`` / ``weakref.finalize`` callbacks: CuPy
(:mod:`rtmem.integrations.cupy`) and numba (:mod:`rtmem.integrations.numba_emm`)
dropping memory they got from an arena, and the last zero-copy view of a buffer
whose free waited for it (NOTE [ Pinned views ] in ``rtmem/buffer.py``). For
objects caught in a reference cycle (an exception traceback is enough) those
callbacks run inside a garbage collection, which Python may start at any
allocation of a Python object, including one made while rtmem's allocator or an
arena holds its (non-reentrant) lock: freeing right there would deadlock the
thread, and a reentrant lock would let the free run on half-updated state. So a
free that arrives during a collection is queued, and done by the next allocation
from any arena (``_Arena._allocate``, which the integrations' hooks go
through too) or by :func:`flush`.
"""

from __future__ import annotations

import collections
import gc
import sys
import warnings

__all__ = ["flush", "release", "run_or_defer", "track"]

#: Frees requested during a collection (deque.append is atomic). Allocation
#: paths test it before calling :func:`flush`, so the common case costs a read.
queue = collections.deque()
_collecting = False                # a garbage collection is running (see the NOTE)
_tracking = False


def _gc_phase(phase, _info):
    global _collecting
    _collecting = phase == "start"


def track() -> None:
    """Start following garbage collections (idempotent). Called when memory is
    first handed to something that frees from a finalizer, so processes that
    never do pay nothing."""
    global _tracking
    if not _tracking:
        _tracking = True
        if _gc_phase not in gc.callbacks:
            gc.callbacks.append(_gc_phase)


def run_or_defer(free) -> None:
    """Call ``free()`` now, or after the running garbage collection (see the NOTE).
    At interpreter exit nothing is called: the CUDA context may already be gone,
    and the process releases everything then anyway."""
    if _collecting:
        queue.append(free)
    elif not sys.is_finalizing():
        free()


def release(buf) -> None:
    """Free ``buf`` now, or after the running garbage collection. For finalizers
    of memory handed to other libraries."""
    if buf is not None and not buf.is_freed:
        run_or_defer(lambda: None if buf.is_freed else buf.free())


def flush() -> int:
    """Do the frees deferred by garbage collections; returns how many ran."""
    n = 0
    while True:
        # Pop, then test: with ``while queue: queue.popleft()`` a thread could see
        # one entry that another thread's flush takes first (IndexError).
        try:
            free = queue.popleft()
        except IndexError:
            return n
        try:
            free()
        except Exception as exc:
            # It was a finalizer's free: its failure belongs to no caller, and
            # raising it out of the unrelated alloc() or copy that flushes would
            # fail that call and leave the frees queued after it undone.
            # Reported as Python reports an exception in __del__.
            warnings.warn(f"a free deferred from a finalizer failed: "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
        n += 1
