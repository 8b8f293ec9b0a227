"""What an :class:`~rtmem.torch.OffloadedAdam` sets up outside itself: the
post-accumulate-grad hook that flushes a parameter's gradient (point 1 of
NOTE [ Offloaded Adam ] in offload.py), which open optimizer owns a parameter's
gradients, the finalizer of an optimizer dropped without close(), and the SIGINT
handler held over a step's bookkeeping (NOTE [ Interrupted step ] in
_offload_update.py). Separate from ``offload.py``, which holds the optimizer and
re-exports :func:`_interrupts_held`, imported from there. (The profiler, whose
backward passes own the gradients for a while, holds the flush hook off as it
holds every gradient hook of the caller's: ``profiler._hold_hooks``.)
"""
from __future__ import annotations

import contextlib
import signal
import threading

import torch

from rtmem._deferred import run_or_defer

from ._stages import SUMS_PARTIAL_GRADIENTS

# id(parameter) -> weak reference to the open OffloadedAdam whose hook flushes
# its gradient: a second optimizer's hook would find p.grad already taken.
# Keyed by id, not weakly by the tensor: torch.utils.swap_tensors (module.half()
# under torch.__future__.set_swap_module_params_on_conversion(True)) refuses a
# tensor that has a weak reference ("Couldn't swap Linear.weight"). An id cannot
# be reused while its entry stands: the optimizer, and after it its finalizer,
# hold the parameters until _disown removes their entries.
_owners: dict[int, object] = {}


def _hook(ref, k: int):
    """Parameter k's post-accumulate-grad hook, holding the optimizer weakly.

    Kept out of TorchDynamo: under compiled autograd the backward graph calls
    the hook, and tracing its host-side bookkeeping (numpy offsets, the D2H
    copy into the pinned buffer, ``p.grad = None``) failed inside dynamo
    ("sources must not be empty for symbol s41"); run eagerly, it sees the
    real gradient, as in eager autograd."""
    @torch.compiler.disable
    def flush(p):
        opt = ref()
        if opt is not None:
            opt._flush(k, p)
    # It adds every gradient it is given to the host gradient (micro-batches), so
    # a tied parameter's per-stage parts under the ScheduleExecutor, one backward
    # per stage, add up to the sum one loss.backward() gives: the executor lets
    # it pass where it refuses other hooks on tied weights
    setattr(flush, SUMS_PARTIAL_GRADIENTS, True)
    return flush


def _data_parallel() -> bool:
    """Whether torch.distributed has a process group of more than one rank: then
    the gradients may be all-reduced from ``p.grad`` after backward (DDP's
    reducer, or the caller's own all-reduce), so the default leaves them there.
    Without data parallelism (pipeline or tensor parallel ranks) that costs only
    the device memory of the gradients until the step."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _held_by_open_optimizer(p) -> bool:
    """Whether an open OffloadedAdam updates ``p`` (and takes its gradients to
    the host, in backward or at its step)."""
    owner = _owners.get(id(p))
    return owner is not None and owner() is not None


def _disown(params, ref) -> None:
    """Forget the parameters ``ref`` (an optimizer's weak reference) owns."""
    for p in params:
        if _owners.get(id(p)) is ref:
            del _owners[id(p)]


def _drop(hooks, params, ref, arena, bufs=(), streams=None) -> None:
    """Finalizer of an OffloadedAdam dropped without close(): remove its hooks and
    ownership (a new optimizer may take the parameters), then, once its copies
    are done, close its own ``arena`` or free its ``bufs`` in the caller's.

    An optimizer caught in a reference cycle (a traceback holding it) is finalized
    by a garbage collection, which may start while rtmem holds the backend's
    lock, which closing takes: the close waits for the collection's end (NOTE
    [ Frees from finalizers ] in rtmem/_deferred.py)."""
    for h in hooks:
        h.remove()
    _disown(params, ref)
    if arena is None and not bufs:
        return

    def free_all():
        for stream in streams or ():      # no copy may still use the buffers
            stream.synchronize()
        if arena is not None:
            arena.close()
        else:
            for b in bufs:
                if not b.is_freed:
                    b.free()
    run_or_defer(free_all)


# The SIGINTs received under the outermost _interrupts_held (the main thread's)
_received = []


def _hold(signum, frame):
    """The SIGINT handler while :func:`_interrupts_held` holds: keep it for later."""
    _received.append((signum, frame))


@contextlib.contextmanager
def _interrupts_held():
    """Hold a KeyboardInterrupt (SIGINT, ``_thread.interrupt_main``) until the
    block ends, then raise it: bookkeeping that a step's gradients were used
    (step counts, consumed gradients, ``state``) must not be cut in half
    (NOTE [ Interrupted step ]). Only where Python raises KeyboardInterrupt
    itself: in the main thread, under the default SIGINT handler.

    Yields whether nothing can interrupt the block from outside: True where it
    holds the interrupts, and also where none can come: in another thread
    (Python runs signal handlers in the main thread only), inside an enclosing
    hold, and with SIGINT ignored or left to the OS (``SIG_IGN``, as a shell
    starts a background job or ``nohup`` a command, or ``SIG_DFL``: Python
    raises nothing, and ``_thread.interrupt_main`` does nothing). False only
    under a Python handler of the caller's, which may raise anywhere."""
    if threading.current_thread() is not threading.main_thread():
        yield True
        return
    handler = signal.getsignal(signal.SIGINT)
    if handler is not signal.default_int_handler:
        # None: a handler not installed from Python, which raises nothing here
        yield handler in (signal.SIG_IGN, signal.SIG_DFL, None) or handler is _hold
        return
    _received.clear()
    signal.signal(signal.SIGINT, _hold)
    try:
        yield True
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if _received:
            received = _received[0]
            _received.clear()
            signal.default_int_handler(*received)      # raises KeyboardInterrupt
