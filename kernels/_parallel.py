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

NOTE [ Kernels in a child forked after GNU OpenMP started ]
    GNU OpenMP (libgomp, what numba's ``omp`` layer loads on Linux) is not
    fork-safe, and numba guards it bluntly: a parallel region entered in a child
    fork()ed from the process that started the pool prints "Terminating: fork()
    called from a process already using GNU OpenMP, this is unsafe." and kills
    the child with SIGTERM. DataLoader workers are such children (fork is the
    default start method on Linux), so a worker calling ``decode_half`` or
    stepping a ``NumpyAdam`` died without a traceback as soon as the parent had
    run any rtmem kernel (a ``CPUAdam`` step, an ``encode_half``), and a
    training loop failed at its first or second epoch.

    So a child forked after that pool started runs each kernel as a serial
    twin: the same Python function compiled without ``parallel=True``
    (``prange`` is then ``range``: every kernel here updates disjoint elements
    per iteration or sums integers, so the results are the same bits). The twin
    is compiled on the child's first call and cached under a name of its own
    (numba's cache files are named after the function's qualified name, not
    its ``parallel=``), so later workers load it. One thread per worker is
    what torch gives its DataLoader workers too. The ``tbb`` and ``workqueue`` layers, and
    spawn/forkserver children, are fork-safe and keep the parallel kernels.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import types

import numba

__all__ = ["parallel_kernel", "serialized"]

_lock = threading.Lock()
#: True once numba reports a thread-safe layer: the lock is no longer taken.
_concurrent = False
#: True in a child forked after GNU OpenMP started: kernels run their serial twins
#: (NOTE [ Kernels in a child forked after GNU OpenMP started ]).
_serial = False


def _gnu_openmp_started() -> bool:
    """Whether numba's ``omp`` layer, on GNU OpenMP, has started in this process
    (in a child: in the parent it was forked from; the state is inherited)."""
    try:
        if numba.threading_layer() != "omp":
            return False
    except ValueError:     # no parallel region has run yet: nothing started
        return False
    # loaded when the layer was chosen; no import in a fork handler
    omppool = sys.modules.get("numba.np.ufunc.omppool")
    return getattr(omppool, "openmp_vendor", "GNU") == "GNU"


def _after_fork_in_child() -> None:
    global _lock, _concurrent, _serial
    _lock = threading.Lock()
    if _gnu_openmp_started():
        _serial = True
        _concurrent = False     # so that calls reach the _serial test


os.register_at_fork(after_in_child=_after_fork_in_child)


def _layer_is_thread_safe() -> bool:
    try:
        return numba.threading_layer() != "workqueue"
    except ValueError:     # no parallel region has run yet: the layer is not chosen
        return False


def _serial_twin(fn):
    """``fn`` compiled without ``parallel=True`` (``prange`` runs as ``range``),
    cached apart from its parallel version: a copy of the function under the
    qualified name ``<name>__serial``, which names numba's cache files."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "__serial",
                              fn.__defaults__, fn.__closure__)
    copy.__qualname__ = fn.__qualname__ + "__serial"
    copy.__module__ = fn.__module__
    return numba.njit(cache=True)(copy)


def serialized(kernel):
    """Wrap a compiled parallel ``kernel`` (a numba dispatcher) so that calls from
    several threads cannot run two parallel regions at once under numba's
    ``workqueue`` layer (NOTE [ One parallel region at a time under workqueue ]).
    The dispatcher stays reachable as ``.dispatcher``."""
    twin = []   # the serial twin, made on first need

    @functools.wraps(kernel.py_func)
    def call(*args):
        global _concurrent
        if _concurrent:
            return kernel(*args)
        if _serial:
            with _lock:     # one compilation, even with several threads calling
                if not twin:
                    twin.append(_serial_twin(kernel.py_func))
            return twin[0](*args)
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
