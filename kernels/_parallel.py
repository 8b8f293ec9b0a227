"""The one way rtmem compiles and enters a numba ``parallel=True`` kernel.

NOTE [ One parallel region at a time under workqueue ]
    numba runs ``prange`` loops on one of three threading layers: OpenMP, TBB, or
    its own ``workqueue``, the one left when neither library can be loaded (a
    pip numba on macOS without libomp, some containers). ``workqueue`` is not
    thread-safe: when two Python threads are inside parallel regions at once it
    prints "Concurrent access has been detected" and aborts the *process*, so a
    training run dies without a traceback and loses what it had not saved.
    rtmem enters parallel regions from more than one thread in ordinary use: two
    optimizers stepped from two threads, OffloadedAdam's update next to a
    ``decode_half`` in a data-loading thread, a DHA CPU twin in a test's worker.

    So every parallel kernel is wrapped by :func:`parallel_kernel`. Until numba has
    chosen its layer (the first parallel call chooses it), and for good when the
    layer is ``workqueue``, the calls take one process-wide lock and so run one at
    a time; under OpenMP or TBB, which are thread-safe, they run concurrently as
    they always did (after one check of a flag). The lock covers rtmem's own
    kernels only: a user's parallel numba functions called at the same time from
    another thread can still abort under ``workqueue``; NUMBA_THREADING_LAYER=omp
    (or tbb) is the remedy there, as numba's message says.

    A fork() while another thread holds the lock would leave the child's copy
    locked forever (that thread does not exist in the child), so the child gets a
    fresh lock, as the host streams renew theirs (NOTE [ Host streams after fork ]).
"""

from __future__ import annotations

import functools
import os
import threading

import numba

__all__ = ["parallel_kernel", "serialized"]

_lock = threading.Lock()
#: True once numba reports a thread-safe layer: the lock is no longer taken.
_concurrent = False


def _renew_lock_in_child() -> None:
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_lock_in_child)


def _layer_is_thread_safe() -> bool:
    try:
        return numba.threading_layer() != "workqueue"
    except ValueError:     # no parallel region has run yet: the layer is not chosen
        return False


def serialized(kernel):
    """Wrap a compiled parallel ``kernel`` (a numba dispatcher) so that calls from
    several threads cannot run two parallel regions at once under numba's
    ``workqueue`` layer (NOTE [ One parallel region at a time under workqueue ]).
    The dispatcher stays reachable as ``.dispatcher``."""
    @functools.wraps(kernel.py_func)
    def call(*args):
        global _concurrent
        if _concurrent:
            return kernel(*args)
        with _lock:
            result = kernel(*args)
            _concurrent = _layer_is_thread_safe()
        return result

    call.dispatcher = kernel
    return call


def parallel_kernel(fn):
    """``numba.njit(parallel=True, cache=True)``, entered through :func:`serialized`.
    For kernels called from Python only (a jitted caller would need the bare
    dispatcher)."""
    return serialized(numba.njit(parallel=True, cache=True)(fn))
