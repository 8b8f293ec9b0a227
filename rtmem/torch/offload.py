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

The class is assembled from mixins, one module each: the gradients' way to the
host, their clip and ``zero_grad`` (point 1) in ``_offload_grads.py``; the
chunked update and its uploads (points 2 and 3, NOTE [ Interrupted step ]) in
``_offload_update.py``; ``state`` and the state dicts in ``_offload_state.py``.
What it accepts is checked by ``_offload_checks.py``; its gradient hooks, the
parameters' ownership and its finalizer are ``_offload_hooks.py``'s.
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np
import torch

from rtmem._deferred import track
from rtmem.errors import OptimizerError
from rtmem.kernels.adam import prepare_update
from rtmem.optim import _check_num_threads
from rtmem.units import is_whole

from ._offload_checks import (_SWITCHES, _check_disjoint, _check_grad, _check_group,
                              _check_own_memory, _check_switches, _param_groups)
from ._offload_grads import _Gradients
from ._offload_hooks import _data_parallel, _drop, _held_by_open_optimizer, _hook, _owners
# imported from here by the tests
from ._offload_hooks import _interrupts_held  # noqa: F401
from ._offload_state import _StateDict
from ._offload_update import _ChunkedUpdate
from .bridge import _placement_of, as_tensor, numpy_dtype

__all__ = ["OffloadedAdam"]

_FORMATS = {torch.float32: None, torch.float16: None, torch.bfloat16: "bfloat16"}


def _decoupled(adamw, decoupled_weight_decay):
    """The groups' default ``decoupled_weight_decay`` from OffloadedAdam's two
    spellings of it (None: not given; False when neither is). Only torch's
    ``adamw=`` was taken, so a call written for ``torch.optim.Adam`` or
    :class:`~rtmem.optim.CPUAdam` (``decoupled_weight_decay=True``) failed with
    Python's "unexpected keyword argument". A value that is not a bool is left
    for the group check to refuse by name."""
    if decoupled_weight_decay is None:
        return False if adamw is None else adamw
    if adamw is not None and adamw != decoupled_weight_decay:
        raise OptimizerError(f"adamw={adamw!r} and decoupled_weight_decay="
                             f"{decoupled_weight_decay!r} contradict each other; pass "
                             f"only decoupled_weight_decay (torch.optim.Adam's name)",
                             argument="decoupled_weight_decay")
    return decoupled_weight_decay


class OffloadedAdam(_Gradients, _ChunkedUpdate, _StateDict, torch.optim.Optimizer):
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
    clip of still-scaled gradients is refused, with the gradients put back, as
    is one after a plain ``optimizer.step()`` that was interrupted (its error
    says which, and what to do).

    A ``torch.optim.Optimizer``: param groups (each with its own ``lr``,
    ``betas``, ``eps``, ``weight_decay`` and ``decoupled_weight_decay``, e.g.
    no weight decay on biases and norms), lr schedulers, ``state_dict`` /
    ``load_state_dict`` (in ``torch.optim.Adam``'s layout, plus each
    parameter's fp32 ``master`` weights and their ``master_step``), ``zero_grad``.
    torch's switches ``capturable`` and ``differentiable`` cannot be honoured
    (the update runs on the host, in a numba kernel autograd does not see): a
    group with either True is refused, naming the group, by the constructor
    and by a step after the group was edited so. A loaded state dict with
    ``differentiable=True`` is refused too; one with ``capturable=True`` (a
    checkpoint of a GPU ``torch.optim.Adam(capturable=True)``) is loaded as
    ``capturable=False``, the same update, its device ``step`` tensors read as
    step counts (:meth:`load_state_dict`).

    Parameters
    ----------
    params:
        The model's parameters (any device; all float32, all float16 or all
        bfloat16), ``(name, parameter)`` pairs, or param-group dicts.
    lr, betas, eps, weight_decay:
        Default hyperparameters of the groups (``lr`` in parameter units per
        step, ``lr >= 0``, ``betas`` in [0, 1), ``eps > 0``, ``weight_decay >= 0``).
    decoupled_weight_decay, adamw:
        Default ``decoupled_weight_decay`` of the groups (True: AdamW's
        ``p *= 1 - lr * weight_decay``; False, the default: an L2 term added to
        the gradient). ``decoupled_weight_decay`` is the keyword of
        ``torch.optim.Adam`` and :class:`~rtmem.optim.CPUAdam`; ``adamw`` the
        older name of this class, still taken. Giving both with different
        values raises :class:`~rtmem.errors.OptimizerError`. The default
        ``weight_decay`` stays 0.0 with decoupled weight decay (torch's
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
    amsgrad, maximize, foreach, fused, capturable, differentiable:
        ``torch.optim.Adam``'s keywords, taken so a call written for it runs
        unchanged: ``foreach`` and ``fused`` are ignored (the update is always
        the fused kernel, chunk by chunk); the others must stay False (True
        raises :class:`~rtmem.errors.OptimizerError` saying why).

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
                 *, adamw=None, host_arena=None, chunk_elements=1 << 22,
                 num_threads=None, flush_in_backward=None, amsgrad=False, maximize=False,
                 foreach=None, fused=None, capturable=False, differentiable=False,
                 decoupled_weight_decay=None):
        from rtmem.arena import HostArena, is_arena
        # torch.optim.Adam's keywords, so a call written for it runs or is refused
        # by name (it was Python's "unexpected keyword argument"): foreach and
        # fused are implementation choices (the update is one fused kernel, chunk
        # by chunk); amsgrad, maximize, capturable, differentiable are refused
        # when True, as in a param group
        switches = dict(capturable=capturable, differentiable=differentiable)
        if host_arena is not None and not is_arena(host_arena, "host"):
            raise OptimizerError(f"host_arena must be an rtmem.HostArena or None, got "
                                 f"{host_arena!r}", argument="host_arena")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize,
                        decoupled_weight_decay=_decoupled(adamw, decoupled_weight_decay))
        _check_switches("", switches, reasons=_SWITCHES)
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
        # an interrupted step left gradients it had not reached on the host (not
        # in p.grad, where a GradScaler driving the retry checks them)
        self._left_by_interrupt = False
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
            _owners[id(p)] = self._ref

    # ------------------------------------------------------------ internals
    def _span(self, k: int) -> tuple:
        """Parameter k's element range ``(lo, hi)`` in the flat host arrays."""
        return int(self.offsets[k]), int(self.offsets[k + 1])

    def _slices(self):
        for k, p in enumerate(self.params):
            yield (p, *self._span(k))

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

    # ------------------------------------------------------------ public API
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise OptimizerError(f"cannot {what}: this OffloadedAdam was closed (its host "
                                 f"buffers are freed); make a new one", argument="self")

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
