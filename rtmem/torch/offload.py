"""The offloaded optimizer loop: the ZeRO-Offload shape, with the study's fixes.

NOTE [ Offloaded Adam ]
fp32 master weights and the Adam moments live in a host arena (pinned on the cuda
backend); the model keeps its working copy (fp32, fp16 or bf16) on the device.
Following offloaded-optimizer-study.md (§0, proposals 2 and 3):

1. Gradients are flushed to pinned host memory *as backward produces them*: a
   post-accumulate-grad hook per parameter enqueues the D2H copy on a dedicated
   stream and drops the device gradient, so gradients never pile up on the device
   and never land in unpinned memory (the study's 8 GB/s boundary flush). With
   gradient accumulation, a later micro-batch's gradient lands in the staging
   buffer (idle until the update) and is added on the CPU at the parameter's next
   flush or at :meth:`step`, so the hook never blocks on the GPU.
2. The CPU update runs chunk by chunk (the fused kernel of
   :func:`rtmem.kernels.adam_update`, on an element range) and writes the new
   parameters, already converted to the device dtype, into a pinned staging
   buffer; the upload of chunk k is enqueued on the H2D stream before chunk k+1
   is updated, so the copy overlaps the CPU work instead of following it.
3. The compute stream waits for the uploads only at the end of :meth:`step`.

As in ``torch.optim.Adam``, a step updates only the parameters that have a
gradient (a head unused this step, a frozen parameter: no moment decay, no
weight decay), and bias correction uses each parameter's own step count
(:attr:`OffloadedAdam.steps`, torch's ``state["step"]``). A parameter "has a
gradient" when one was flushed since the last step, or when
``zero_grad(set_to_none=False)`` zeroed one it had: torch keeps ``p.grad`` as a
zero tensor then, and Adam still decays the moments of a parameter with a zero
gradient. The one departure from torch: a step consumes the gradients, so
without a ``zero_grad`` in between, the next backward starts from nothing
instead of adding onto the last step's gradients. The update
runs over maximal runs of consecutive parameters that have a gradient and share
a param group and a step count: in the usual step of a one-group optimizer,
where every parameter has one, that is a single run over all elements, chunked
as above.

Since the gradients leave the device during backward, what torch does to
``p.grad`` between backward and step is done here on the host buffer:
:meth:`OffloadedAdam.clip_grad_norm_` clips it (one read pass for the norm, a
scaling pass only when it clips), and ``step(grad_scale=S)`` unscales the
gradients inside the update kernel after a read-only finite check that skips
the whole step on inf/NaN. :class:`rtmem.LossScaler` keeps ``S`` as
``torch.amp.GradScaler`` would; GradScaler itself looks for ``p.grad``, so it
drives only ``flush_in_backward=False`` (NOTE [ GradScaler ]).

Master weights and moments are kept in the parameters' logical (row-major)
order. A non-contiguous parameter (e.g. a channels_last convolution weight) is
uploaded whole, by a strided copy, once the chunk holding its last element is
updated; contiguous ones are uploaded chunk by chunk.

On the host backend every copy is synchronous and the same code runs, so the
numerics are tested on any machine.
"""

from __future__ import annotations

import contextlib
import copy
import signal
import threading
import warnings
import weakref

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from rtmem._deferred import run_or_defer, track
from rtmem.errors import NonFiniteGradientError, OptimizerError
from rtmem.kernels.adam import _unscale_factor, prepare_update, threads
from rtmem.optim import (_check_adam_keys, _check_group_hyper, _check_num_threads,
                         _check_state_dict, _checked_step, _coefficients, _first_overlap,
                         _pre_hooked, _saved_skips)
from rtmem.units import is_whole

from ._stages import SUMS_PARTIAL_GRADIENTS
from .bridge import _placement_of, as_tensor, numpy_dtype

__all__ = ["OffloadedAdam"]

_FORMATS = {torch.float32: None, torch.float16: None, torch.bfloat16: "bfloat16"}

# parameter -> weak reference to the open OffloadedAdam whose hook flushes its
# gradient: a second optimizer's hook would find p.grad already taken. (Keyed by
# identity: tensors compare elementwise.)
_owners = WeakIdKeyDictionary()

# parameter -> nesting count of the passes that own its gradient for a while
# (rtmem.torch.profile_sequential's backward passes, which put the caller's
# p.grad back afterwards): their hooks leave p.grad alone, so an open
# OffloadedAdam does not take those gradients for the next step's.
_paused = WeakIdKeyDictionary()


def _pause_flushes(params) -> None:
    """Stop flushing the gradients of ``params`` until :func:`_resume_flushes`."""
    for p in params:
        _paused[p] = _paused.get(p, 0) + 1


def _resume_flushes(params) -> None:
    """Undo one :func:`_pause_flushes` of ``params``."""
    for p in params:
        count = _paused.get(p, 0) - 1
        if count > 0:
            _paused[p] = count
        else:
            _paused.pop(p, None)


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
        if opt is not None and p not in _paused:
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


def _overlaps(t) -> bool:
    """True unless the layout of ``t`` provably maps distinct elements to distinct
    memory (checked on the strides: sorted by stride, each dimension must step
    past everything the smaller ones span). Expanded (stride-0) tensors overlap;
    permuted (channels_last, transposed) and sliced ones do not."""
    extent = 0   # largest offset reached by the dimensions seen so far
    for stride, size in sorted((abs(st), sz) for sz, st in zip(t.shape, t.stride())
                               if sz > 1):
        if stride <= extent:
            return True
        extent += (size - 1) * stride
    return False


def _check_own_memory(k: int, p) -> None:
    """OptimizerError if parameter ``k`` has elements sharing memory."""
    if _overlaps(p):
        raise OptimizerError(
            f"parameter {k} (shape {tuple(p.shape)}, strides {p.stride()}) has elements "
            f"sharing memory (e.g. made by expand()), so no update can write it element "
            f"by element; give it its own memory first (p.data = p.data.clone())",
            argument="params")


def _check_disjoint(params) -> None:
    """OptimizerError if two parameters share memory (two Parameters made over one
    tensor's data, or views of one buffer): each has its own master weights, so
    the upload of one would overwrite the other's update (torch.optim.Adam
    applies both; CPUAdam refuses them). Compared by the address range each
    spans, so two interleaved views of one buffer are refused as well."""
    by_device = {}      # address spaces of their own
    for k, p in enumerate(params):
        if p.numel():
            lo = p.data_ptr()
            extent = sum((size - 1) * abs(st) for size, st in zip(p.shape, p.stride()))
            by_device.setdefault(p.device, []).append(
                (lo, lo + (extent + 1) * p.element_size(), k))
    for spans in by_device.values():
        pair = _first_overlap(spans)
        if pair is not None:
            i, j = sorted((pair[0][2], pair[1][2]))
            raise OptimizerError(
                f"parameters {i} and {j} share memory (e.g. two nn.Parameter made over "
                f"one tensor's data); each has its own Adam state here, so one's upload "
                f"would undo the other's update. Tie weights by assigning the same "
                f"Parameter object, or give each its own memory (p.data = p.data.clone())",
                argument="params")


def _check_param(k: int, p) -> None:
    """OptimizerError for what OffloadedAdam cannot update: non-tensors, sparse or
    meta tensors, tensors computed from others."""
    if isinstance(p, dict):
        raise OptimizerError("a param group (dict) among tensors: pass either tensors or "
                             "param groups (dicts with 'params'), not both",
                             argument="params")
    if not isinstance(p, torch.Tensor):
        raise OptimizerError(f"parameter {k} is a {type(p).__name__}, not a torch.Tensor",
                             argument="params")
    why = ("is sparse (use torch.optim.SparseAdam)" if p.layout != torch.strided else
           "is a meta tensor (it has no data to update)" if p.is_meta else
           "is not a leaf tensor (it is computed from others; gradient hooks need leaves)"
           if not p.is_leaf else None)
    if why is not None:
        raise OptimizerError(f"parameter {k} (shape {tuple(p.shape)}) {why}",
                             argument="params")


# Adam options of torch.optim.Adam this optimizer does not implement: refused when
# a group (or a loaded state dict) turns them on, instead of silently ignored.
_UNSUPPORTED = ("amsgrad", "maximize")


def _check_group(where: str, group: dict) -> None:
    """OptimizerError unless ``group`` holds hyperparameters this optimizer runs."""
    _check_group_hyper(where, group)
    if not isinstance(group["decoupled_weight_decay"], (bool, np.bool_)):
        raise OptimizerError(f"{where}: decoupled_weight_decay="
                             f"{group['decoupled_weight_decay']!r} must be True or False",
                             argument="decoupled_weight_decay")
    for key in _UNSUPPORTED:
        if group.get(key):
            raise OptimizerError(f"{where}: {key}=True is not supported by OffloadedAdam; "
                                 f"use rtmem.optim.CPUAdam (CPU parameters) or "
                                 f"torch.optim.Adam for it", argument=key)


def _param_groups(params, defaults: dict) -> list:
    """``params`` (tensors, ``(name, tensor)`` pairs or param-group dicts) as
    torch-style groups, every parameter and group checked, duplicates within a
    group dropped; OptimizerError for anything OffloadedAdam cannot take."""
    if isinstance(params, torch.Tensor):
        # list() would split it into rows, each refused as "not a leaf tensor"
        raise OptimizerError("params must be an iterable of tensors (e.g. "
                             "model.parameters()), got a single tensor: pass [p]",
                             argument="params")
    items = list(params)
    if not items:
        raise OptimizerError("params is empty; pass the model's parameters",
                             argument="params")
    if not isinstance(items[0], dict):
        items = [{"params": items}]
    groups, seen, k = [], {}, 0
    for gi, item in enumerate(items):
        if not isinstance(item, dict) or "params" not in item:
            raise OptimizerError(f"param group {gi} is a {type(item).__name__}; pass "
                                 f"either tensors or dicts with a 'params' entry, not "
                                 f"both", argument="params")
        ps = item["params"]
        if isinstance(ps, set):
            raise OptimizerError(f"param group {gi}: 'params' is a set, whose order "
                                 f"changes between runs; pass a list",
                                 argument="params")
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        kept = {}
        for entry in ps:
            named = isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
            p = entry[1] if named else entry
            _check_param(k, p)
            k += 1
            if id(p) in seen and seen[id(p)] != gi:
                raise OptimizerError(f"a parameter (shape {tuple(p.shape)}) is in param "
                                     f"groups {seen[id(p)]} and {gi}; each parameter "
                                     f"belongs to one group", argument="params")
            seen[id(p)] = gi
            kept.setdefault(id(p), entry)
        group = {**defaults, **item, "params": list(kept.values())}
        _check_group(f"param group {gi}", group)
        groups.append(group)
    return groups


def _check_grad(k: int, p, size: int) -> None:
    """OptimizerError for a gradient the host buffers cannot take (checked before
    anything is copied: the flush would fail half way, with torch's message)."""
    g = p.grad
    if g.layout != torch.strided:
        raise OptimizerError(
            f"parameter {k} (shape {tuple(p.shape)}) has a {g.layout} gradient (e.g. "
            f"nn.Embedding(sparse=True)); OffloadedAdam updates dense gradients: make "
            f"the layer produce dense ones (sparse=False)", argument="params")
    if g.numel() != size:
        raise OptimizerError(
            f"parameter {k} has a gradient of {g.numel()} elements for {size} parameter "
            f"elements: its data was replaced after construction (make a new "
            f"OffloadedAdam for the changed model), or p.grad was set to a tensor of "
            f"another shape", argument="params")


def _held_by_open_optimizer(p) -> bool:
    """Whether an open OffloadedAdam updates ``p`` (and takes its gradients to
    the host, in backward or at its step)."""
    owner = _owners.get(p)
    return owner is not None and owner() is not None


def _disown(params, ref) -> None:
    """Forget the parameters ``ref`` (an optimizer's weak reference) owns."""
    for p in params:
        if _owners.get(p) is ref:
            del _owners[p]


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


@contextlib.contextmanager
def _interrupts_held():
    """Hold a KeyboardInterrupt (SIGINT, ``_thread.interrupt_main``) until the
    block ends, then raise it: bookkeeping that a step's gradients were used
    (step counts, consumed gradients, ``state``) must not be cut in half
    (NOTE [ Interrupted step ]). Only where Python raises KeyboardInterrupt
    itself: in the main thread, under the default SIGINT handler."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield        # another thread, a handler of the caller's, or already held
        return
    received = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if received:
            signal.default_int_handler(*received[0])     # raises KeyboardInterrupt


class OffloadedAdam(torch.optim.Optimizer):
    """Adam/AdamW whose state and update live on the host, for device parameters.

    NOTE [ GradScaler ]
    Loss scaling: :class:`rtmem.LossScaler` drives any instance (its ``step``
    passes ``grad_scale=S``). ``torch.amp.GradScaler`` drives one made with
    ``flush_in_backward=False``, whose gradients are still in ``p.grad`` for its
    inf check: as for torch's fused Adam (``_step_supports_amp_scaling``), it
    then sets ``grad_scale`` (None after ``unscale_``) and ``found_inf`` on the
    optimizer, and the step divides the scale out in the fused kernel instead of
    a pass over ``p.grad``, after the finite check (which finds what GradScaler
    found). With the default flushing, GradScaler would see no gradient and
    never lower the scale: the step refuses it and names LossScaler. A step
    interrupted under GradScaler puts the gradients it did not use back in
    ``p.grad`` for GradScaler's check of the retry (NOTE [ Interrupted step ]).
    ``clip_grad_norm_`` moves the gradients to the host, so under GradScaler it
    comes after ``scaler.unscale_(optimizer)``, as torch's does; a step after a
    clip of still-scaled gradients is refused, with the gradients put back.

    A ``torch.optim.Optimizer``: param groups (each with its own ``lr``,
    ``betas``, ``eps``, ``weight_decay`` and ``decoupled_weight_decay``, e.g.
    no weight decay on biases and norms), lr schedulers, ``state_dict`` /
    ``load_state_dict`` (in ``torch.optim.Adam``'s layout, plus each
    parameter's fp32 ``master`` weights and their ``master_step``), ``zero_grad``.

    Parameters
    ----------
    params:
        The model's parameters (any device; all float32, all float16 or all
        bfloat16), ``(name, parameter)`` pairs, or param-group dicts.
    lr, betas, eps, weight_decay:
        Default hyperparameters of the groups (``lr`` in parameter units per
        step, ``lr >= 0``, ``betas`` in [0, 1), ``eps > 0``, ``weight_decay >= 0``).
    adamw:
        Default ``decoupled_weight_decay`` of the groups (True: AdamW's
        ``p *= 1 - lr * weight_decay``; False: an L2 term added to the gradient).
        The default ``weight_decay`` stays 0.0 with ``adamw=True`` (torch's
        ``AdamW`` defaults to 1e-2): pass it.
    host_arena:
        A :class:`~rtmem.HostArena` for the master weights, moments, gradients and
        the upload staging buffer (``12 + 2 * itemsize`` bytes per parameter, plus
        alignment); a new one of that size is made when None.
    chunk_elements:
        Elements per update chunk (>= 1): smaller chunks overlap more, larger ones
        pay less per-call overhead. Default 4 Mi elements (16 MiB of fp32 master).
    num_threads:
        CPU threads of the update kernel (None: numba's current setting).
    flush_in_backward:
        True: each gradient goes to the host as backward produces it (a
        post-accumulate-grad hook per parameter). False: gradients stay in
        ``p.grad`` on the device, accumulating there, until :meth:`step` (or
        :meth:`clip_grad_norm_`) takes them. Needed under
        ``DistributedDataParallel``, whose reducer all-reduces ``p.grad`` in a
        hook that runs after this one: with True it finds the gradient already
        taken, all-reduces zeros, and every rank steps with its own local
        gradient. None (the default): False when ``torch.distributed`` has a
        process group of more than one rank at construction, else True; the
        choice is in :attr:`flush_in_backward`.

    Call :meth:`step` after backward; gradients are already on the host by then
    (taken by a post-accumulate-grad hook on each parameter: a hook of that kind
    registered after this optimizer finds ``p.grad`` None; with
    ``flush_in_backward=False`` they stay in ``p.grad`` until the step).
    Gradients of several backward passes accumulate (in the parameter dtype)
    until the next :meth:`step`, which consumes them. Parameters without a
    gradient are left alone, as by ``torch.optim.Adam``; ``zero_grad`` with
    ``set_to_none=False`` gives a zero one, as in torch (NOTE [ Offloaded Adam ]).
    Since the gradients leave the device during backward (or at the step), clip
    with :meth:`clip_grad_norm_` and unscale a loss scale with
    ``step(grad_scale=...)`` (NOTE [ Skipped steps ] in :mod:`rtmem.optim`).

    The fp32 master weights follow what is written to a parameter in place
    after construction (``model.load_state_dict``, ``torch.nn.init``, ``with
    torch.no_grad(): p.copy_(...)``): the next :meth:`step` or
    :meth:`state_dict` takes the elements that no longer equal the master
    rounded to the parameter's dtype (so reloading a bf16 model after
    :meth:`load_state_dict` keeps the saved fp32 master). A write through
    ``p.data`` moves no version counter, is not seen, and the next step
    overwrites it. The master weights and moments live in
    the host arena (:attr:`master`, :attr:`exp_avg`, :attr:`exp_avg_sq`: flat
    float32 arrays in parameter order); ``state[p]`` of a parameter that has
    stepped holds its ``step`` and CPU tensor views of them (shaped like ``p``),
    as ``torch.optim.Adam``'s would, and :meth:`state_dict` copies them. A
    closed optimizer's ``state`` is empty.

    Attributes
    ----------
    step_count:
        Number of steps applied (calls to :meth:`step` that updated something).
    steps:
        int64 array, one entry per parameter: the steps that updated it (its
        Adam bias-correction step, torch's ``state["step"]``).
    skipped_steps, last_step_skipped:
        Steps skipped by the finite check (non-finite unscaled gradients).
    """

    _step_supports_amp_scaling = True       # NOTE [ GradScaler ]

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 *, adamw=False, host_arena=None, chunk_elements=1 << 22,
                 num_threads=None, flush_in_backward=None):
        from rtmem.arena import HostArena, is_arena
        if host_arena is not None and not is_arena(host_arena, "host"):
            raise OptimizerError(f"host_arena must be an rtmem.HostArena or None, got "
                                 f"{host_arena!r}", argument="host_arena")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=False, decoupled_weight_decay=adamw)
        _check_group("OffloadedAdam", defaults)
        defaults["betas"] = tuple(betas)
        groups = _param_groups(params, defaults)
        flat = [e[1] if isinstance(e, tuple) else e for g in groups for e in g["params"]]
        if not flat:
            raise OptimizerError("every param group is empty; pass the model's "
                                 "parameters", argument="params")
        dtypes = {p.dtype for p in flat}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _FORMATS:
            raise OptimizerError(f"all parameters must share one dtype among float32, "
                                 f"float16, bfloat16; got {sorted(map(str, dtypes))}",
                                 argument="params")
        for i, p in enumerate(flat):
            if _held_by_open_optimizer(p):
                raise OptimizerError(
                    f"parameter {i} (shape {tuple(p.shape)}) already has its gradients "
                    f"flushed by another open OffloadedAdam; close() that one first",
                    argument="params")
            placement = _placement_of(p)
            if placement is not None and p in placement.grads:
                # its hook takes p.grad to the host buffer and sets None: the arena
                # buffer would stay allocated, unused, and the next backward make a
                # torch gradient outside the arena
                raise OptimizerError(
                    f"parameter {i} (shape {tuple(p.shape)}) has its gradient in an "
                    f"arena (rtmem.torch.place_parameters with grads=True); "
                    f"OffloadedAdam keeps every gradient in its own pinned host buffer "
                    f"and would leave that one unused: place the parameters with "
                    f"grads=False", argument="params")
            _check_own_memory(i, p)
        _check_disjoint(flat)
        if not is_whole(chunk_elements) or chunk_elements < 1:
            raise OptimizerError(f"chunk_elements must be an integer >= 1, got "
                                 f"{chunk_elements!r}", argument="chunk_elements")
        self.num_threads = _check_num_threads(num_threads)
        if flush_in_backward is None:
            flush_in_backward = not _data_parallel()
        if not isinstance(flush_in_backward, bool):
            raise OptimizerError(f"flush_in_backward must be True, False or None, got "
                                 f"{flush_in_backward!r}", argument="flush_in_backward")
        if flush_in_backward and _data_parallel():
            # not an error: pipeline or tensor parallel ranks own disjoint parameters
            # and may flush; under DDP it trains each rank on its own gradient with
            # nothing failing, so say so where the choice was made
            warnings.warn(
                f"OffloadedAdam(flush_in_backward=True) in a torch.distributed process "
                f"group of {torch.distributed.get_world_size()} ranks: if these "
                f"parameters are in DistributedDataParallel, the gradient leaves "
                f"p.grad before DDP all-reduces it and every rank steps with its own "
                f"local gradient; pass flush_in_backward=False (or leave the default) "
                f"for data parallelism", UserWarning, stacklevel=2)
        self.flush_in_backward = flush_in_backward
        # every group is checked: torch's constructor adds them (add_param_group)
        # and refuses nothing more; later additions are refused (_bufs is set)
        self._bufs = None
        super().__init__(groups, defaults)
        self.params = [p for g in self.param_groups for p in g["params"]]
        # param k's group: runs of the update never mix two groups' coefficients
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self.dtype = next(iter(dtypes))
        self.chunk = int(chunk_elements)
        self.step_count = 0
        self.skipped_steps = 0
        self.last_step_skipped = False
        # a GradScaler-driven step raised after using every gradient: GradScaler's
        # retry would find nothing to check (_return_grads)
        self._done_when_interrupted = False
        self.steps = np.zeros(len(self.params), dtype=np.int64)
        self._closed = False
        self.offsets = np.cumsum([0] + [p.numel() for p in self.params])
        n = int(self.offsets[-1])
        item = torch.empty(0, dtype=self.dtype).element_size()
        need = n * (12 + 2 * item) + 8 * 256
        # an arena made here is this optimizer's to close (pinned memory has no
        # finalizer: a dropped arena would keep its slabs pinned until exit)
        self._own_arena = host_arena is None
        if self._own_arena:
            track()     # its finalizer may close the arena in a collection (_drop)
        self.arena = host_arena if host_arena is not None else HostArena(need)
        self._bufs = []
        self._hooks = []
        self._ref = weakref.ref(self)
        try:
            self._setup(n)
        except BaseException:   # e.g. a host_arena too small: give back what we took
            _drop(self._hooks, self.params, self._ref, None)
            self._free_buffers()
            raise
        self._finalizer = weakref.finalize(
            self, _drop, self._hooks, self.params, self._ref,
            self.arena if self._own_arena else None, self._bufs, self._streams)

    def add_param_group(self, param_group) -> None:
        """Refused after construction: the host buffers are sized for the
        parameters given then. (Used by the constructor for its groups.)"""
        if self._bufs is not None:
            raise OptimizerError("OffloadedAdam cannot add a param group after "
                                 "construction (its host buffers are sized for the "
                                 "parameters given then); make a new OffloadedAdam with "
                                 "every group", argument="param_group")
        super().add_param_group(param_group)

    def __getstate__(self):
        raise TypeError("an OffloadedAdam holds host-arena buffers and gradient hooks and "
                        "cannot be pickled or copied; save its state_dict() instead")

    def _setup(self, n: int) -> None:
        """The host buffers, the initial state and the gradient hooks of
        ``__init__``, which undoes them all when this raises."""
        for dtype, kind in ((np.float32, "weight"), (np.float32, "optimizer-state"),
                            (np.float32, "optimizer-state"),
                            (numpy_dtype(self.dtype), "gradient"),
                            (numpy_dtype(self.dtype), "workspace")):
            self._bufs.append(self.arena.alloc(shape=(n,), dtype=dtype, kind=kind))
        # pinned (NOTE [ Pinned views ]), as the state[p] tensors over them are:
        # public arrays a caller may keep past close() must not start reading
        # whatever the arena hands out next
        self.master, self.exp_avg, self.exp_avg_sq = (b.numpy(pin=True)
                                                      for b in self._bufs[:3])
        grad_buf, stage_buf = self._bufs[3:]
        self._grad_t = as_tensor(grad_buf, dtype=self.dtype)
        self._stage_t = as_tensor(stage_buf, dtype=self.dtype)
        self._grad_np, self._stage_np = grad_buf.numpy(), stage_buf.numpy()
        fmt = _FORMATS[self.dtype]
        # validated once: the arrays never change while the optimizer is open
        self._update = prepare_update(self.master, self._grad_np, self.exp_avg,
                                      self.exp_avg_sq, grad_format=fmt,
                                      out=self._stage_np, out_format=fmt)
        self.exp_avg[:] = 0
        self.exp_avg_sq[:] = 0
        # the version counters the master weights agree with (_adopt_changes)
        self._versions = [None] * len(self.params)
        self._state_synced = True   # state[p] matches steps (_sync_state)
        for k in range(len(self.params)):
            self._read_param(k)
        self._fresh = [True] * len(self.params)   # no gradient flushed since the step
        # torch would hold a p.grad (flushed since the last zero_grad(set_to_none=True))
        self._had_grad = [False] * len(self.params)
        # zero_grad(set_to_none=False) since the last step: those _had_grad have a
        # zero gradient at the next step
        self._grads_zeroed = False
        self._partial = {}     # k -> event of a staged gradient not yet added (or None)
        cuda = any(p.is_cuda for p in self.params)
        self._streams = (torch.cuda.Stream(), torch.cuda.Stream()) if cuda else None
        # The hooks reach the optimizer through a weak reference, so dropping it
        # without close() lets it be collected; its finalizer then removes them
        # (and closes the arena it made).
        for k, p in enumerate(self.params):
            if p.requires_grad and self.flush_in_backward:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    _hook(self._ref, k)))
        for p in self.params:
            _owners[p] = self._ref

    # ------------------------------------------------------------ internals
    def _span(self, k: int) -> tuple:
        """Parameter k's element range ``(lo, hi)`` in the flat host arrays."""
        return int(self.offsets[k]), int(self.offsets[k + 1])

    def _read_param(self, k: int) -> None:
        """Parameter k's values into its master weights, which now agree with it."""
        p = self.params[k]
        lo, hi = self._span(k)
        self.master[lo:hi] = p.detach().reshape(-1).float().cpu().numpy()
        self._versions[k] = p._version

    def _slices(self):
        for k, p in enumerate(self.params):
            yield (p, *self._span(k))

    def _flush(self, k: int, p) -> None:
        """Parameter k's gradient hook: move ``p.grad`` to the host."""
        if p.grad is None:
            return
        lo, hi = self._span(k)
        _check_grad(k, p, hi - lo)
        g = p.grad.reshape(-1)
        fresh = self._fresh[k]
        if not fresh:
            # A later micro-batch: land it in the (idle until step) staging
            # buffer and add it on the CPU once that copy is done, lazily, so
            # backward never waits for the GPU (NOTE [ Offloaded Adam ], 1).
            self._settle(k)
        dst = (self._grad_t if fresh else self._stage_t)[lo:hi]
        done = None
        if self._streams is not None:   # rule 1: async D2H on its own stream
            d2h = self._streams[1]
            d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(d2h):
                dst.copy_(g, non_blocking=True)
                g.record_stream(d2h)
                if not fresh:
                    done = d2h.record_event()
        else:
            dst.copy_(g)
        if not fresh:
            self._partial[k] = done
        self._fresh[k] = False
        self._had_grad[k] = True
        self._done_when_interrupted = False     # a new gradient: a new step
        p.grad = None          # the device gradient is freed right away

    def _settle(self, k: int) -> None:
        """Add parameter k's staged partial gradient (if any) into its host
        gradient, after waiting for its D2H copy (done long ago, in practice)."""
        if k not in self._partial:
            return
        done = self._partial[k]
        if done is not None:
            done.synchronize()
        lo, hi = self._span(k)
        with _interrupts_held():    # added and forgotten together, never one alone
            self._grad_t[lo:hi].add_(self._stage_t[lo:hi])
            del self._partial[k]

    def _upload(self, lo: int, hi: int):
        """Copy staged elements [lo, hi) into the device parameters they cover.

        A non-contiguous parameter has no flat view to copy a range into: it is
        copied whole (a strided copy from its staged logical-order elements) by
        the call whose range reaches its last element; the update writes every
        element of a parameter before that call, since runs hold whole ones."""
        non_blocking = self._streams is not None
        k = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        while k < len(self.params) and self.offsets[k] < hi:
            p = self.params[k]
            start, end = self._span(k)
            a, b = max(lo, start), min(hi, end)
            dst = p.data
            if dst.is_contiguous():
                dst.view(-1)[a - start:b - start].copy_(self._stage_t[a:b],
                                                        non_blocking=non_blocking)
            elif b == end:
                dst.copy_(self._stage_t[start:end].view(dst.shape),
                          non_blocking=non_blocking)
            k += 1

    def _check_not_replaced(self, k: int, p) -> None:
        """Refuse parameter k if it no longer matches the host state made for it
        (its data replaced since construction, with another dtype or size)."""
        lo, hi = self._span(k)
        size = hi - lo
        if p.dtype != self.dtype or p.numel() != size:
            raise OptimizerError(
                f"parameter {k} is now {p.dtype} with {p.numel()} elements (shape "
                f"{tuple(p.shape)}), but this optimizer holds {self.dtype} state "
                f"for {size} elements: its data was replaced after construction; "
                f"make a new OffloadedAdam for the changed model", argument="params")

    def _check_params(self) -> None:
        """Refuse a step, before anything changes, if a parameter no longer matches
        the host state made for it (its data replaced since construction)."""
        for k, p in enumerate(self.params):
            self._check_not_replaced(k, p)     # so p.numel() is its span's size
            if not p.is_contiguous():
                _check_own_memory(k, p)
            if p.grad is not None:
                _check_grad(k, p, p.numel())
        _check_disjoint(self.params)     # their data may have been tied since

    def _runs(self, fresh):
        """Maximal runs ``(lo, hi, group, step)`` of consecutive parameters that
        have a gradient (not ``fresh``), the same group and the same next step:
        one coefficient vector per run, and a single run in a step where every
        parameter of a one-group optimizer has a gradient."""
        runs = []
        for k, f in enumerate(fresh):
            if f:
                continue
            key = (self._group_of[k], int(self.steps[k]) + 1)
            lo, hi = self._span(k)
            # (a run is a list, to grow in place: its key compared as a list
            # never equalled the tuple, and every parameter was a run of its own)
            if runs and runs[-1][1] == lo and tuple(runs[-1][2:]) == key:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, *key])
        return runs

    def _with_gradient(self):
        """(parameters whose gradient is still on the device, the ``fresh`` list
        with every parameter that has a gradient False, those with a zeroed one):
        what :meth:`step` updates. Changes nothing."""
        # A gradient still on the device had no hook to flush it: the parameter
        # was frozen at construction and unfrozen since, or p.grad was set by hand.
        pending = [k for k, p in enumerate(self.params) if p.grad is not None]
        fresh = list(self._fresh)
        for k in pending:
            fresh[k] = False
        # zeroed by zero_grad(set_to_none=False) and nothing flushed since: torch
        # steps them with a zero gradient
        zeroed = [k for k, had in enumerate(self._had_grad)
                  if had and fresh[k]] if self._grads_zeroed else []
        for k in zeroed:
            fresh[k] = False
        return pending, fresh, zeroed

    def _gather(self, pending, zeroed) -> None:
        """Bring every gradient to the host buffer: flush ``pending`` ones, wait
        for the D2H copies, add staged partial ones, zero ``zeroed`` ones."""
        for k in pending:
            self._flush(k, self.params[k])
        if self._streams is not None:
            # every gradient is on the host (D2H), and the last step's uploads
            # (H2D) no longer read the staging buffer the update writes: a flush
            # orders D2H after them, but step(); step() has no flush in between
            for stream in self._streams:
                stream.synchronize()
        for k in list(self._partial):             # before the staging buffer is reused
            self._settle(k)
        for k in zeroed:
            self._grad_t[slice(*self._span(k))].zero_()

    def _adopt_changes(self) -> None:
        """Take what was written to a parameter in place since the master weights
        last agreed with it (``model.load_state_dict``, ``nn.init``, a broadcast:
        its version counter moved) into the master weights, which the next upload
        would otherwise write back over it. Only the elements that differ from the
        master rounded to the parameter's dtype: a bf16 model reloaded after
        :meth:`load_state_dict` keeps the saved fp32 master. (Writes through
        ``p.data`` move no version counter and are not seen; this optimizer's own
        uploads go that way.)"""
        for k, p in enumerate(self.params):
            version = p._version
            if version == self._versions[k]:
                continue
            lo, hi = self._span(k)
            if p.dtype != self.dtype or p.numel() != hi - lo:
                continue    # its data was replaced: step() refuses it by name
            now = p.detach().reshape(-1).cpu()
            master = torch.from_numpy(self.master[lo:hi])
            if self.dtype == torch.float32:
                master.copy_(now)
            else:
                changed = now.view(torch.int16) != master.to(self.dtype).view(torch.int16)
                master[changed] = now[changed].float()
            self._versions[k] = version

    def _sync_state(self, ks=None) -> None:
        """``state[p]`` as ``torch.optim.Adam`` keeps it, for every parameter that
        has stepped: ``step`` and live views of its ``exp_avg``, ``exp_avg_sq``
        and ``master`` in the host arena (pinned views: a free waits for any
        still held). Code that takes an empty ``state`` for an optimizer never
        stepped sees the truth (torch.distributed.checkpoint "initializes" one
        by stepping it with zero gradients). ``ks``: the parameters whose step
        changed (default: all). A pass cut short (an exception, an interrupt)
        leaves ``_state_synced`` False: the next step or state_dict() redoes all."""
        if not self._state_synced:
            ks = None
        for k in range(len(self.params)) if ks is None else ks:
            p = self.params[k]
            if not self.steps[k]:
                self.state.pop(p, None)
                continue
            st = self.state.get(p)
            if st is None or "step" not in st:
                lo, hi = self._span(k)
                st = {key: torch.from_numpy(buf.numpy(pin=True)[lo:hi]).view(p.shape)
                      for key, buf in zip(("master", "exp_avg", "exp_avg_sq"), self._bufs)}
                st["step"] = torch.zeros((), dtype=torch.float32)
                self.state[p] = st     # whole: an entry without "step" broke every step
            st["step"].fill_(float(self.steps[k]))
        self._state_synced = True

    def _consume(self) -> None:
        """A step's end, applied or skipped: the gradients are used up."""
        self._fresh = [True] * len(self.params)
        self._grads_zeroed = False

    # ------------------------------------------------------------ public API
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, check_finite=None):
        """Update the parameters that have a gradient (flushed since the last
        step, or zeroed by ``zero_grad(set_to_none=False)``), chunked and
        overlapped with the uploads; the others, frozen ones included, keep
        their values and state. Returns the closure's loss (or None), like torch.

        ``grad_scale`` is the loss scale the gradients carry (unscaled in the
        kernel, NOTE [ Skipped steps ] in :mod:`rtmem.optim`); ``check_finite``
        (default: ``grad_scale is not None``) first checks every unscaled
        gradient and skips the whole step if one is inf or NaN: no parameter,
        moment or step count changes, ``last_step_skipped`` is True and
        ``skipped_steps`` grows by one. Either way the step consumes the
        gradients. Everything that can be refused (hyperparameters, replaced
        parameters) is checked before any host state or parameter changes.

        NOTE [ Interrupted step ]
        An exception raised once the update has started (a KeyboardInterrupt, a
        failed upload) leaves no parameter half counted: each parameter the
        chunked update had reached counts as stepped (its step count advanced,
        its gradient consumed; elements of it past the failing chunk keep their
        values and moments this step), and the ones it had not reached keep
        their gradients, so the next ``step()`` updates just those, once. No
        element is ever updated twice with one gradient.

        Under ``torch.amp.GradScaler`` (``scaler.step(optimizer)``), the
        gradients this step took from ``p.grad`` and did not use go back to
        ``p.grad`` (all of them if it raised before the update started), where
        GradScaler's inf check looks for them: recover with
        ``scaler.step(optimizer)`` again, then ``scaler.update()``, as with
        torch's optimizers. If the step had reached every parameter, no
        gradient is left and it counts as done: call ``scaler.update()``
        without stepping again (a second ``scaler.step`` finds no gradient to
        check, and GradScaler's ``update()`` then fails with "No inf checks
        were recorded"). The exception carries a note saying which case it is
        (Python >= 3.11)."""
        self._check_open("step")
        if "found_inf" not in self.__dict__:
            return self._step(closure, grad_scale, check_finite)
        # Set by torch.amp.GradScaler.step, which deletes them only after a step
        # that returns, and multiplies a grad_scale it finds into the next one:
        # left behind by a raising step (refused, interrupted), the retry
        # unscaled by S**2.
        checked = None       # the parameters whose p.grad GradScaler checked
        try:
            grad_scale, check_finite = self._grad_scaler_args(grad_scale, check_finite)
            checked = [p.grad is not None for p in self.params]
            # Scaled gradients already on the host (clip_grad_norm_ took them)
            # escaped GradScaler's inf check: it recorded none, and its update()
            # would assert. Back to p.grad with them (by _return_grads), and say
            # how the loop goes (after unscale_, grad_scale is None: allowed).
            escaped = [grad_scale is not None and not took and not fresh
                       for took, fresh in zip(checked, self._fresh)]
            if any(escaped):
                checked = [a or b for a, b in zip(checked, escaped)]
                raise OptimizerError(
                    f"scaler.step(optimizer): GradScaler checks p.grad for inf/NaN, but "
                    f"{sum(escaped)} gradient(s) had already left p.grad for the host "
                    f"buffer (optimizer.clip_grad_norm_ moves them there), so its check "
                    f"missed them and scaler.update() would fail with 'No inf checks "
                    f"were recorded'. They are back in p.grad and nothing has stepped: "
                    f"call scaler.unscale_(optimizer) before optimizer.clip_grad_norm_"
                    f"(...), then scaler.step(optimizer), as with torch's "
                    f"clip_grad_norm_ under GradScaler", argument="optimizer")
            if self._done_when_interrupted and not any(checked) and \
                    all(self._with_gradient()[1]):
                raise OptimizerError(
                    "scaler.step(optimizer) after an interrupted step that had applied "
                    "every gradient: nothing is left to step, and GradScaler, finding "
                    "no gradient in p.grad, has just replaced its record of that step's "
                    "inf check with an empty one, so scaler.update() would fail with "
                    "'No inf checks were recorded'. End this iteration with "
                    "scaler.update(new_scale=scaler.get_scale()) (the scale unchanged); "
                    "after such an interrupt, call scaler.update() without stepping "
                    "again (NOTE [ Interrupted step ])", argument="optimizer")
            return self._step(closure, grad_scale, check_finite)
        except BaseException as exc:
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            if checked is not None:
                self._return_grads(checked, exc)
            raise

    def _return_grads(self, checked, exc) -> None:
        """After a GradScaler-driven step raised: put the gradients it took from
        ``p.grad`` (``checked``) and did not use back there, and note on ``exc``
        how to recover (NOTE [ Interrupted step ]).

        GradScaler's retry re-runs its inf check over ``p.grad`` and records
        what it finds for ``update()``; left on the host, the gradients were
        invisible to it, so it recorded nothing and ``update()`` asserted "No
        inf checks were recorded" (torch's optimizers keep ``p.grad`` through a
        step, so their retry is checked as the first try was)."""
        back = [k for k, took in enumerate(checked)
                if took and not self._fresh[k] and self.params[k].grad is None]
        if back and self._streams is not None:
            for stream in self._streams:     # the D2H copies into the host buffer
                stream.synchronize()
        for k in back:
            self._settle(k)                  # a staged partial gradient included
            p = self.params[k]
            lo, hi = self._span(k)
            g = torch.empty_like(p, memory_format=torch.preserve_format)
            g.copy_(self._grad_t[lo:hi].view(p.shape))
            with _interrupts_held():         # in p.grad or on the host, never both
                p.grad = g
                self._fresh[k] = True
        if not any(checked) or isinstance(exc, OptimizerError):
            return                  # refused before taking anything: no note needed
        if back or any(p.grad is not None for p in self.params):
            note = ("OffloadedAdam: the gradients the interrupted step did not use "
                    "are in p.grad; call scaler.step(optimizer) again, then "
                    "scaler.update().")
        else:
            self._done_when_interrupted = True
            note = ("OffloadedAdam: the interrupted step had reached every parameter "
                    "and counts as done (no gradient is left); call scaler.update() "
                    "without calling scaler.step(optimizer) again.")
        if hasattr(exc, "add_note"):     # Python >= 3.11
            exc.add_note(note)

    def _step(self, closure, grad_scale, check_finite):
        """:meth:`step` once GradScaler's arguments are read."""
        self._done_when_interrupted = False
        if not self._state_synced:      # a step's state update was cut short
            self._sync_state()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_params()
        for gi, group in enumerate(self.param_groups):
            _check_group(f"param group {gi}", group)
        _unscale_factor(grad_scale)       # refused even when there is nothing to do
        pending, fresh, zeroed = self._with_gradient()
        self.last_step_skipped = False
        if all(fresh):
            return loss
        runs = self._runs(fresh)
        # one coefficient vector per (group, step), all computed (validated) first
        coeffs = {}
        for _, _, gi, s in runs:
            if (gi, s) not in coeffs:
                group = self.param_groups[gi]
                coeffs[gi, s] = _coefficients(group, s, bool(group["decoupled_weight_decay"]),
                                              grad_scale)
        if check_finite is None:
            check_finite = grad_scale is not None
        self._adopt_changes()            # all checked: what the caller wrote is kept
        self._gather(pending, zeroed)
        with threads(self.num_threads):
            if check_finite and not all(self._update._grads_finite(coeffs[gi, s], lo, hi)
                                        for lo, hi, gi, s in runs):
                with _interrupts_held():
                    self.skipped_steps += 1
                    self.last_step_skipped = True
                    self._consume()
                return loss
            h2d = self._streams[0] if self._streams is not None else None
            if h2d is not None:
                # the uploads replace p.data's contents: after all GPU work queued so
                # far (a weight prefetch of the executor may still be writing p.data)
                h2d.wait_stream(torch.cuda.current_stream())
            reached = None      # the chunk the update is at (NOTE [ Interrupted step ])
            counted = False
            try:
                for lo, hi, gi, step in runs:
                    c = coeffs[gi, step]
                    for a in range(lo, hi, self.chunk):
                        b = min(hi, a + self.chunk)
                        reached = a, b
                        self._update.apply(c, a, b)
                        self._upload_on(h2d, a, b)   # rule 2: upload k while updating k+1
                # Counted in the try: an interrupt between the last chunk and the
                # count is an interrupted step at that chunk (all reached), where
                # outside it the next step applied every gradient again. The
                # count itself holds interrupts, raised once it is whole.
                with _interrupts_held():
                    stepped = [k for k, f in enumerate(fresh) if not f]
                    self._count_step(stepped)
                    counted = True
                    self._sync_state(stepped)
            except BaseException:
                if reached is not None and not counted:
                    self._interrupted(fresh, h2d, *reached)
                raise
            finally:
                if h2d is not None:               # rule 3 (the uploads enqueued)
                    torch.cuda.current_stream().wait_stream(h2d)
        return loss

    def _upload_on(self, h2d, lo: int, hi: int) -> None:
        """:meth:`_upload` of ``[lo, hi)`` on the H2D stream (None: host backend)."""
        if h2d is None:
            self._upload(lo, hi)
        else:
            with torch.cuda.stream(h2d):
                self._upload(lo, hi)

    def _count_step(self, stepped) -> None:
        """A step's end: the parameters ``stepped`` (indices) advance a step, and
        every gradient is used up; ``state`` follows with :meth:`_sync_state`
        (a failure there leaves it to the next step or state_dict())."""
        self._state_synced = False
        self.steps[stepped] += 1
        self.step_count += 1
        self._consume()

    def _interrupted(self, fresh, h2d, a: int, b: int) -> None:
        """The bookkeeping of a step whose update raised in the chunk ``[a, b)``
        (NOTE [ Interrupted step ]): the parameters it reached count as stepped,
        the others keep their gradients for the next step, and the device copy
        of the parameters the chunk covers is made from their master weights."""
        updated = [k for k, f in enumerate(fresh) if not f]
        reached = [k for k in updated if self.offsets[k] < b]
        with _interrupts_held():          # a second interrupt waits for the count
            self._count_step(reached)
            for k in updated:
                if self.offsets[k] >= b:  # not reached: still has its gradient
                    self._fresh[k] = False
        self._sync_state(reached)
        # the chunk in flight may be written in part (master and staging buffer
        # alike), or written and not uploaded: upload the parameters it covers
        # from their master weights (those before it were uploaded whole, those
        # after it are unchanged)
        cover = [k for k in reached if self.offsets[k + 1] > a]
        if cover:
            lo, hi = self._span(cover[0])[0], self._span(cover[-1])[1]
            if h2d is not None:
                h2d.synchronize()         # no upload still reads the staging buffer
            self._stage_t[a:hi].copy_(torch.from_numpy(self.master[a:hi]))
            self._upload_on(h2d, lo, hi)

    def _grad_scaler_args(self, grad_scale, check_finite) -> tuple:
        """``step``'s (grad_scale, check_finite) when ``torch.amp.GradScaler``
        drives it (NOTE [ GradScaler ])."""
        s = self.grad_scale      # None after scaler.unscale_(optimizer): unscaled
        if self.flush_in_backward or grad_scale is not None or check_finite is not None:
            # GradScaler deletes its attributes only after a step that returns: a
            # later plain step() must not find them
            del self.grad_scale, self.found_inf
        if self.flush_in_backward:
            raise OptimizerError(
                "torch.amp.GradScaler cannot drive an OffloadedAdam that flushes the "
                "gradients during backward: they left p.grad before its inf check, so "
                "it would never lower the scale. Use rtmem.LossScaler (the same calls: "
                "scale, step, update), or flush_in_backward=False.", argument="optimizer")
        if grad_scale is not None or check_finite is not None:
            raise OptimizerError(
                "scaler.step(optimizer) passes the scale itself; drop grad_scale= and "
                "check_finite=", argument="grad_scale")
        return (None if s is None else float(s)), True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, *, grad_scale=None,
                        error_if_nonfinite=False):
        """Scale the gradients in place so that their total norm is at most
        ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does for ``p.grad``
        (which is None here: the gradients live in the host buffer). Returns
        the total norm (a float32 CPU tensor) of the gradients the next step
        uses, before clipping.

        ``grad_scale``: the loss scale the gradients carry; the norm is that of
        the unscaled gradients (what torch computes after
        ``GradScaler.unscale_``), and the gradients keep their scale for
        ``step(grad_scale=...)``. Finite gradients whose float32 norm overflows
        (a loss spike, or the scale still in them) are normed in float64 and
        clipped (torch's inf norm would zero them). Non-finite gradients give a
        non-finite norm: :class:`~rtmem.errors.NonFiniteGradientError` (a
        RuntimeError, as torch's) with ``error_if_nonfinite=True``; else they are
        left as they are (torch would multiply them by nan), so a step with the
        finite check skips them.

        Under ``torch.amp.GradScaler`` call ``scaler.unscale_(optimizer)`` first,
        as with torch's ``clip_grad_norm_``: this moves the gradients from
        ``p.grad`` to the host, where GradScaler's inf check does not look, and a
        ``scaler.step`` after a clip of still-scaled gradients is refused (the
        gradients are put back in ``p.grad``)."""
        self._check_open("clip_grad_norm_")
        if not float(max_norm) >= 0:    # a negative one would flip the gradients
            raise OptimizerError(f"max_norm must be >= 0, got {max_norm!r}",
                                 argument="max_norm")
        try:    # as torch's: 'inf' (a string) for the infinity norm, any real order
            norm_type = float(norm_type)
        except (TypeError, ValueError):
            raise OptimizerError(f"norm_type must be a real number or 'inf', got "
                                 f"{norm_type!r}", argument="norm_type") from None
        _unscale_factor(grad_scale)     # checks it: finite, > 0, float32-representable
        scale = 1.0 if grad_scale is None else float(grad_scale)
        self._check_params()
        pending, fresh, zeroed = self._with_gradient()
        self._gather(pending, zeroed)
        grads = [self._grad_t[slice(*self._span(k))] for k, f in enumerate(fresh) if not f]
        if not grads:
            return torch.tensor(0.0)
        norms = []
        for g in grads:
            n = torch.linalg.vector_norm(g, norm_type, dtype=torch.float32)
            if not torch.isfinite(n) and bool(torch.isfinite(g).all()):
                # finite gradients whose norm overflowed float32 (a loss spike, or
                # the loss scale still in them): the float64 norm is finite
                n = torch.linalg.vector_norm(g, norm_type, dtype=torch.float64)
            norms.append(n.double())
        total64 = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if norm_type != 0:              # the 0-"norm" counts non-zeros: no scale in it
            total64 = total64 / scale
        total = total64.float()
        if not torch.isfinite(total64):
            if error_if_nonfinite:
                raise NonFiniteGradientError(
                    f"the total norm {float(total)} of order {norm_type} of the "
                    f"gradients is non-finite, so they cannot be clipped; pass "
                    f"error_if_nonfinite=False to go on (a step with the finite check "
                    f"then skips them)", argument="grads")
            return total
        coef = float(max_norm) / (float(total64) + 1e-6)   # torch's epsilon
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total

    def state_dict(self) -> dict:
        """The state in ``torch.optim.Adam``'s layout (``state``: per parameter
        index that was ever updated, ``step``, ``exp_avg``, ``exp_avg_sq`` shaped
        like the parameter, plus its fp32 ``master`` weights and ``master_step``,
        the int step they are the weights of; ``param_groups``: the
        hyperparameters and parameter indices), and ``step_count``,
        ``skipped_steps`` and ``last_step_skipped``. Tensors are CPU float32
        copies, never views of the host arena. The flushed gradients are not
        part of it."""
        self._check_open("state_dict")
        if not self._state_synced:      # a step's state update was cut short
            self._sync_state()
        self._adopt_changes()           # the master weights saved are the model's
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state, groups, index = {}, [], 0
        for group in self.param_groups:
            packed = {key: value for key, value in group.items() if key != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(packed)
        for k, p in enumerate(self.params):
            if p in self.state:                  # as torch: no state before a step
                state[k] = {key: t.clone() for key, t in self.state[p].items()}
                # A Python int: torch.optim.Adam and CPUAdam carry it through their
                # load, state_dict and steps unchanged (a tensor would be cast to
                # the parameter's dtype), while their steps move "step" on.
                state[k]["master_step"] = int(self.steps[k])
        state_dict = {"state": state, "param_groups": groups,
                      "step_count": self.step_count, "skipped_steps": self.skipped_steps,
                      "last_step_skipped": self.last_step_skipped}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict) -> None:
        """Load a state dict of this class or of ``torch.optim.Adam``/``AdamW``
        (same groups, same parameter counts and shapes). Parameters without a
        saved state start over (step 0, zero moments). A saved ``master`` is of
        record (a bf16 model's weights, loaded before or after, do not replace
        it; elements written in place that differ from it rounded to the
        parameter's dtype, before or after the load, do, as with plain torch)
        unless its ``master_step`` differs from the saved ``step``: then
        another optimizer (``torch.optim.Adam``, CPUAdam, which keep unknown
        keys) trained the parameter after this class saved it, and the master is
        stale. A stale master, or none (a torch dict), is read from the
        parameter, so load the model's weights first. A ``master`` without a
        ``master_step`` (a dict of an older rtmem) is of record. A master cast
        below float32 (``torch.optim.Adam``'s load casts its state to a bf16
        parameter's dtype) is read from the parameter, with a RuntimeWarning
        that its extra precision was lost. A parameter
        whose data was replaced since construction (another dtype or size) is
        refused, as :meth:`step` refuses it. Everything is checked before
        anything changes; a refused load leaves the optimizer as it was.
        ``step_count``, ``skipped_steps`` and ``last_step_skipped`` are
        restored (from a torch dict, without them: the largest saved step, 0
        and False). Flushed gradients are kept."""
        self._check_open("load_state_dict")
        state_dict = _pre_hooked(self, state_dict)
        _check_state_dict(state_dict)
        # deep-copied as torch does: a tensor lr (which schedulers fill_ in place)
        # must not stay shared with the dict or the optimizer it came from
        saved_groups = copy.deepcopy(list(state_dict["param_groups"]))
        if not all(isinstance(s, dict) for s in saved_groups) or \
                not isinstance(state_dict["state"], dict) or \
                not all(isinstance(st, dict) for st in state_dict["state"].values()):
            raise OptimizerError("state_dict['param_groups'] must be a list of dicts and "
                                 "state_dict['state'] a dict of dicts, as returned by "
                                 "state_dict()", argument="state_dict")
        if len(saved_groups) != len(self.param_groups) or any(
                len(s.get("params", ())) != len(g["params"])
                for s, g in zip(saved_groups, self.param_groups)):
            raise OptimizerError(
                f"the state dict has groups of "
                f"{[len(s.get('params', ())) for s in saved_groups]} parameters, this "
                f"optimizer {[len(g['params']) for g in self.param_groups]}: it belongs "
                f"to another model or grouping", argument="state_dict")
        groups = []
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            merged = {**group, **{key: value for key, value in saved.items()
                                  if key not in ("params", "param_names")}}
            _check_adam_keys(gi, saved)
            _check_group(f"group {gi} of the state dict", merged)
            groups.append(merged)
        # Before the state's shapes are held to the parameters' (a replaced one
        # would be blamed on the dict) and before anything changes: loading into
        # its span raised numpy's ValueError half-way, the earlier parameters
        # already overwritten.
        for k, p in enumerate(self.params):
            self._check_not_replaced(k, p)
        # saved index -> this optimizer's parameter (the same order, group by group)
        index = {i: k for k, i in enumerate(
            i for saved in saved_groups for i in saved.get("params", ()))}
        arrays, cast = {}, []
        for i, st in state_dict["state"].items():
            if i not in index:
                raise OptimizerError(f"the state dict has state for parameter {i!r}, "
                                     f"which none of its groups lists",
                                     argument="state_dict")
            k = index[i]
            where = f"parameter {k}"
            if st.get("max_exp_avg_sq") is not None:
                raise OptimizerError(f"{where}: the state has max_exp_avg_sq (amsgrad), "
                                     f"which OffloadedAdam does not run",
                                     argument="state_dict")
            # steps is int64, and a step adds one to it
            step = _checked_step(st.get("step", 0), where, np.iinfo(np.int64).max - 1)
            arrays[k] = [step]
            # the master's step, when saved: another optimizer's steps moved the
            # parameter and "step" on, and carried the master along unchanged
            stale = "master_step" in st and _checked_step(
                st["master_step"], f"{where}: master_step") != step
            for key in ("exp_avg", "exp_avg_sq", "master"):
                if key == "master" and (key not in st or stale):
                    arrays[k].append(None)       # read from the parameter
                    continue
                if key not in st:
                    raise OptimizerError(f"{where}: the state has no {key}",
                                         argument="state_dict")
                t = torch.as_tensor(st[key])
                if tuple(t.shape) != tuple(self.params[k].shape) or \
                        not t.is_floating_point():
                    raise OptimizerError(
                        f"{where}: state {key} is {t.dtype} of shape {tuple(t.shape)}, "
                        f"the parameter has shape {tuple(self.params[k].shape)}; the "
                        f"state dict belongs to another model", argument="state_dict")
                if key == "master" and t.element_size() < 4:
                    # torch.optim.Adam's load casts its state to the parameter's
                    # dtype, master included, and keeps master_step: a trip through
                    # it (a conversion, no step) rounded the master unnoticed
                    cast.append((k, t.dtype))
                    arrays[k].append(None)       # read from the parameter
                    continue
                arrays[k].append(t.detach().reshape(-1).to("cpu", torch.float32).numpy())
        counts = (_checked_step(state_dict.get("step_count", max(
                      [a[0] for a in arrays.values()], default=0)), "step_count"),
                  *_saved_skips(state_dict))
        if cast:
            warnings.warn(
                f"the saved fp32 master weights of parameter(s) "
                f"{', '.join(str(k) for k, _ in cast)} were cast to {cast[0][1]} (by "
                f"another optimizer's load_state_dict, e.g. torch.optim.Adam's): they are "
                f"read from the parameters, and their precision beyond the parameters' "
                f"dtype is lost", RuntimeWarning, stacklevel=2)
        # checked: now change things
        for k, p in enumerate(self.params):
            lo, hi = self._span(k)
            step, m, v, master = arrays.get(k, (0, None, None, None))
            if master is None:
                self._read_param(k)
            else:
                # The loaded master is of record, except where the parameter was
                # written in place since the master last agreed with it (its
                # version moved): _adopt_changes takes those elements at the next
                # step or state_dict(), as for writes after the load. Declaring
                # them agreed here dropped a re-initialised head (nn.init before
                # the load) and the next step wrote the old weights back.
                self.master[lo:hi] = master
            self.exp_avg[lo:hi] = 0 if m is None else m
            self.exp_avg_sq[lo:hi] = 0 if v is None else v
            self.steps[k] = step
        for group, merged in zip(self.param_groups, groups):
            group.clear()
            group.update(merged)
        self.step_count, self.skipped_steps, self.last_step_skipped = counts
        self._sync_state()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise OptimizerError(f"cannot {what}: this OffloadedAdam was closed (its host "
                                 f"buffers are freed); make a new one", argument="self")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget flushed gradients, as ``torch.optim.Optimizer.zero_grad``.

        ``set_to_none=True``: the parameters have no gradient until the next
        flush. ``set_to_none=False``: every parameter that had one since the last
        ``zero_grad(set_to_none=True)`` (steps included, as torch keeps ``p.grad``
        across them) now has a zero gradient, so the next step updates it even if
        no backward reaches it (its moments decay, as in torch). Device
        gradients are dropped either way: they live on the host once flushed."""
        self._check_open("zero_grad")
        # (copies still in flight are ordered before the next ones on the D2H
        # stream, and step() waits for that stream before reading or writing)
        for k, p in enumerate(self.params):
            if p.grad is not None:    # not flushed yet (set by hand): torch zeroes it too
                self._had_grad[k] = True
            p.grad = None
        self._fresh = [True] * len(self.params)
        self._partial.clear()
        self._done_when_interrupted = False
        if set_to_none:
            self._had_grad = [False] * len(self.params)
        self._grads_zeroed = not set_to_none

    def close(self) -> None:
        """Remove the gradient hooks and free the host buffers; close the host
        arena too when the optimizer made it. Idempotent."""
        # the finalizer's work, but the arena: closed after the buffers are freed
        _drop(self._hooks, self.params, self._ref, None)
        self._hooks = []
        self._finalizer.detach()
        if not self._bufs:
            return
        if self._streams is not None:   # no copy may still use the buffers
            for stream in self._streams:
                stream.synchronize()
        self._closed = True
        self._free_buffers()

    def _free_buffers(self) -> None:
        """Free the host buffers and close the arena if this optimizer made it.
        No view of the freed memory may outlive it (a later step would write into
        whatever the arena hands out next)."""
        self.state.clear()
        self._grad_t = self._stage_t = None
        self.master = self.exp_avg = self.exp_avg_sq = None
        self._grad_np = self._stage_np = self._update = None
        for b in self._bufs:
            b.free()
        self._bufs = []
        if self._own_arena:
            self.arena.close()
