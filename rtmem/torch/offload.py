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
a step count: in the usual step, where every parameter has one, that is a single
run over all elements, chunked as above.

Master weights and moments are kept in the parameters' logical (row-major)
order. A non-contiguous parameter (e.g. a channels_last convolution weight) is
uploaded whole, by a strided copy, once the chunk holding its last element is
updated; contiguous ones are uploaded chunk by chunk.

On the host backend every copy is synchronous and the same code runs, so the
numerics are tested on any machine.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from rtmem._deferred import run_or_defer, track
from rtmem.errors import OptimizerError
from rtmem.kernels.adam import adam_coefficients, prepare_update, threads
from rtmem.optim import _check_hyper, _check_num_threads, _first_overlap

from .bridge import as_tensor, numpy_dtype

__all__ = ["OffloadedAdam"]

_FORMATS = {torch.float32: None, torch.float16: None, torch.bfloat16: "bfloat16"}

# parameter -> weak reference to the open OffloadedAdam whose hook flushes its
# gradient: a second optimizer's hook would find p.grad already taken. (Keyed by
# identity: tensors compare elementwise.)
_owners = WeakIdKeyDictionary()


def _hook(ref, k: int):
    """Parameter k's post-accumulate-grad hook, holding the optimizer weakly."""
    def flush(p):
        opt = ref()
        if opt is not None:
            opt._flush(k, p)
    return flush


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
    """OptimizerError for what OffloadedAdam cannot update: non-tensors (param
    group dicts), sparse or meta tensors, tensors computed from others."""
    if isinstance(p, dict):
        raise OptimizerError("OffloadedAdam takes one flat list of parameters; torch-style "
                             "param groups (dicts) are not supported: make one optimizer "
                             "per group", argument="params")
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


def _disown(params, ref) -> None:
    """Forget the parameters ``ref`` (an optimizer's weak reference) owns."""
    for p in params:
        if _owners.get(p) is ref:
            del _owners[p]


def _drop(hooks, params, ref, arena) -> None:
    """Finalizer of an OffloadedAdam dropped without close(): remove its hooks and
    ownership (a new optimizer may take the parameters) and close its own arena.

    An optimizer caught in a reference cycle (a traceback holding it) is finalized
    by a garbage collection, which may start while rtmem holds the backend's
    lock, which closing takes: the close waits for the collection's end (NOTE
    [ Frees from finalizers ] in rtmem/_deferred.py)."""
    for h in hooks:
        h.remove()
    _disown(params, ref)
    if arena is not None:
        run_or_defer(arena.close)


class OffloadedAdam:
    """Adam/AdamW whose state and update live on the host, for device parameters.

    Parameters
    ----------
    params:
        The model's parameters (any device; float32, float16 or bfloat16).
    host_arena:
        A :class:`~rtmem.HostArena` for the master weights, moments, gradients and
        the upload staging buffer (``16 + 2 * itemsize`` bytes per parameter); a
        new one of that size is made when None.
    lr, betas, eps, weight_decay, adamw:
        Hyperparameters (``adamw=True``: decoupled weight decay).
    chunk_elements:
        Elements per update chunk (>= 1): smaller chunks overlap more, larger ones
        pay less per-call overhead. Default 4 Mi elements (16 MiB of fp32 master).
    num_threads:
        CPU threads of the update kernel (None: numba's current setting).

    Call :meth:`step` after backward; gradients are already on the host by then.
    Gradients of several backward passes accumulate (in the parameter dtype)
    until the next :meth:`step`, which consumes them. Parameters without a
    gradient are left alone, as by ``torch.optim.Adam``; ``zero_grad`` with
    ``set_to_none=False`` gives a zero one, as in torch (NOTE [ Offloaded Adam ]).

    Attributes
    ----------
    step_count:
        Number of steps applied (calls to :meth:`step` that returned True).
    steps:
        int64 array, one entry per parameter: the steps that updated it (its
        Adam bias-correction step, torch's ``state["step"]``).
    """

    def __init__(self, params, *, host_arena=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, adamw=False, chunk_elements=1 << 22, num_threads=None):
        from rtmem.arena import HostArena, is_arena
        if host_arena is not None and not is_arena(host_arena, "host"):
            raise OptimizerError(f"host_arena must be an rtmem.HostArena or None, got "
                                 f"{host_arena!r}", argument="host_arena")
        if isinstance(params, torch.Tensor):
            # list() would split it into rows, each refused as "not a leaf tensor"
            raise OptimizerError("params must be an iterable of tensors (e.g. "
                                 "model.parameters()), got a single tensor: pass [p]",
                                 argument="params")
        params = list(params)
        for k, p in enumerate(params):
            _check_param(k, p)
        self.params = list(dict.fromkeys(params))
        if not self.params:
            raise OptimizerError("params is empty; pass the model's parameters",
                                 argument="params")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _FORMATS:
            raise OptimizerError(f"all parameters must share one dtype among float32, "
                                 f"float16, bfloat16; got {sorted(map(str, dtypes))}",
                                 argument="params")
        for i, p in enumerate(self.params):
            owner = _owners.get(p)
            if owner is not None and owner() is not None:
                raise OptimizerError(
                    f"parameter {i} (shape {tuple(p.shape)}) already has its gradients "
                    f"flushed by another open OffloadedAdam; close() that one first",
                    argument="params")
            _check_own_memory(i, p)
        _check_disjoint(self.params)
        if int(chunk_elements) != chunk_elements or chunk_elements < 1:
            raise OptimizerError(f"chunk_elements must be an integer >= 1, got "
                                 f"{chunk_elements!r}", argument="chunk_elements")
        _check_hyper(lr, betas, eps, weight_decay)
        self.num_threads = _check_num_threads(num_threads)
        self.dtype = next(iter(dtypes))
        self.hyper = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                          weight_decay=weight_decay, decoupled_weight_decay=adamw)
        self.chunk = int(chunk_elements)
        self.step_count = 0
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
            self.arena if self._own_arena else None)

    def _setup(self, n: int) -> None:
        """The host buffers, the initial state and the gradient hooks of
        ``__init__``, which undoes them all when this raises."""
        for dtype, kind in ((np.float32, "weight"), (np.float32, "optimizer-state"),
                            (np.float32, "optimizer-state"),
                            (numpy_dtype(self.dtype), "gradient"),
                            (numpy_dtype(self.dtype), "workspace")):
            self._bufs.append(self.arena.alloc(shape=(n,), dtype=dtype, kind=kind))
        self.master, self.exp_avg, self.exp_avg_sq = (b.numpy() for b in self._bufs[:3])
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
        for p, lo, hi in self._slices():
            self.master[lo:hi] = p.detach().reshape(-1).float().cpu().numpy()
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
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    _hook(self._ref, k)))
        for p in self.params:
            _owners[p] = self._ref

    # ------------------------------------------------------------ internals
    def _slices(self):
        for k, p in enumerate(self.params):
            yield p, int(self.offsets[k]), int(self.offsets[k + 1])

    def _flush(self, k: int, p) -> None:
        """Parameter k's gradient hook: move ``p.grad`` to the host."""
        if p.grad is None:
            return
        lo, hi = int(self.offsets[k]), int(self.offsets[k + 1])
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
        p.grad = None          # the device gradient is freed right away

    def _settle(self, k: int) -> None:
        """Add parameter k's staged partial gradient (if any) into its host
        gradient, after waiting for its D2H copy (done long ago, in practice)."""
        if k not in self._partial:
            return
        done = self._partial.pop(k)
        if done is not None:
            done.synchronize()
        lo, hi = int(self.offsets[k]), int(self.offsets[k + 1])
        self._grad_t[lo:hi].add_(self._stage_t[lo:hi])

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
            start, end = int(self.offsets[k]), int(self.offsets[k + 1])
            a, b = max(lo, start), min(hi, end)
            dst = p.data
            if dst.is_contiguous():
                dst.view(-1)[a - start:b - start].copy_(self._stage_t[a:b],
                                                        non_blocking=non_blocking)
            elif b == end:
                dst.copy_(self._stage_t[start:end].view(dst.shape),
                          non_blocking=non_blocking)
            k += 1

    def _check_params(self) -> None:
        """Refuse a step, before anything changes, if a parameter no longer matches
        the host state made for it (its data replaced since construction)."""
        for k, p in enumerate(self.params):
            size = int(self.offsets[k + 1] - self.offsets[k])
            if p.dtype != self.dtype or p.numel() != size:
                raise OptimizerError(
                    f"parameter {k} is now {p.dtype} with {p.numel()} elements (shape "
                    f"{tuple(p.shape)}), but this optimizer holds {self.dtype} state "
                    f"for {size} elements: its data was replaced after construction; "
                    f"make a new OffloadedAdam for the changed model", argument="params")
            if not p.is_contiguous():
                _check_own_memory(k, p)
            if p.grad is not None:
                _check_grad(k, p, size)
        _check_disjoint(self.params)     # their data may have been tied since

    def _runs(self, fresh):
        """Maximal runs ``(lo, hi, step)`` of consecutive parameters that have a
        gradient (not ``fresh``) and the same next step: one coefficient vector
        per run, and a single run in a step where every parameter has a gradient."""
        runs = []
        for k, f in enumerate(fresh):
            if f:
                continue
            step = int(self.steps[k]) + 1
            lo, hi = int(self.offsets[k]), int(self.offsets[k + 1])
            if runs and runs[-1][1] == lo and runs[-1][2] == step:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, step])
        return runs

    # ------------------------------------------------------------ public API
    def step(self) -> bool:
        """Update the parameters that have a gradient (flushed since the last
        step, or zeroed by ``zero_grad(set_to_none=False)``), chunked and
        overlapped with the uploads; the others, frozen ones included, keep
        their values and state. Returns False when none has one (nothing to do).

        Everything that can be refused (hyperparameters, replaced parameters) is
        checked before any host state or parameter changes."""
        self._check_open("step")
        self._check_params()
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
        if all(fresh):
            return False
        runs = self._runs(fresh)
        # one coefficient vector per distinct step, all computed (validated) first
        coeffs = {step: adam_coefficients(step=step, **self.hyper)
                  for step in {r[2] for r in runs}}
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
            self._grad_t[int(self.offsets[k]):int(self.offsets[k + 1])].zero_()
        h2d = self._streams[0] if self._streams is not None else None
        if h2d is not None:
            # the uploads replace p.data's contents: after all GPU work queued so
            # far (a weight prefetch of the executor may still be writing p.data)
            h2d.wait_stream(torch.cuda.current_stream())
        with threads(self.num_threads):
            for lo, hi, step in runs:
                c = coeffs[step]
                for a in range(lo, hi, self.chunk):
                    b = min(hi, a + self.chunk)
                    self._update.apply(c, a, b)
                    if h2d is not None:           # rule 2: upload k while updating k+1
                        with torch.cuda.stream(h2d):
                            self._upload(a, b)
                    else:
                        self._upload(a, b)
        if h2d is not None:                       # rule 3
            torch.cuda.current_stream().wait_stream(h2d)
        self.steps[[k for k, f in enumerate(fresh) if not f]] += 1
        self.step_count += 1
        self._fresh = [True] * len(self.params)
        self._grads_zeroed = False
        return True

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
        self._grad_t = self._stage_t = None
        self.master = self.exp_avg = self.exp_avg_sq = None
        self._grad_np = self._stage_np = self._update = None
        for b in self._bufs:
            b.free()
        self._bufs = []
        if self._own_arena:
            self.arena.close()
