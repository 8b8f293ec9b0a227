"""What the executor and the profiler share: how a stage is handed its input
and what it must return, storage bookkeeping, and the construction checks of
:class:`~rtmem.torch.ScheduleExecutor` (NOTE [ Executor ] rules 2, 5 and 7 in
``executor.py``)."""

from __future__ import annotations

import torch
from torch import nn

from rtmem.errors import RtmemError
from rtmem.planners import Op

from .bridge import _placement_of   # bridge imports nothing of the executor

__all__ = ["ExecutionError", "check_placement", "check_shared_hooks", "check_shared_weights",
           "param_label", "shared_parameters"]

_WEIGHT_MOVES = frozenset((Op.W_OFFLOAD, Op.W_DELETE, Op.W_PREFETCH))

#: Set (True) on a gradient hook of rtmem's own that adds up the gradients it is
#: given (:class:`~rtmem.torch.OffloadedAdam`'s flush, which adds micro-batches
#: anyway): it may see a tied parameter's per-stage parts one at a time, and
#: :func:`check_shared_hooks` lets it pass.
SUMS_PARTIAL_GRADIENTS = "_rtmem_sums_partial_gradients"


class ExecutionError(RtmemError):
    """:class:`~rtmem.torch.ScheduleExecutor` or
    :func:`~rtmem.torch.profile_sequential` refused a model, schedule, batch,
    loss or argument, before or during a step or profile: bad arguments (a
    schedule that is not a ``Schedule`` or ``Plan``, ``host_arena="x"``,
    ``repeats=0``), a schedule planned for another chain length or moving
    weights it cannot move, a stage that does not return one tensor or hands a
    tensor with autograd history to another stage outside its output, a loss
    that is not a 0-d tensor with autograd history, a step in which nothing
    trains, a stored activation modified in place. The message says what was
    wrong and what to do; the executor can step again after it."""


# Shown, and pickled, under the public path (help(), tracebacks): rtmem.torch
# re-exports it, so pickle finds it there
ExecutionError.__module__ = "rtmem.torch"


#: The attribute :class:`raised_in` sets on an exception from the user's code:
#: a phrase saying where it was raised ("the forward of stage 2 (Block)"), which
#: ``rtmem profile`` prints in place of the traceback.
RAISED_IN = "_rtmem_raised_in"


def stage_label(model: nn.Sequential, i: int) -> str:
    """``stage I (ModuleType)``, with the stage's name in the Sequential when it
    has one of its own (``stage 1 'attn' (Attention)``), for messages."""
    name = list(model._modules)[i]
    named = f" {name!r}" if name != str(i) else ""
    return f"stage {i}{named} ({type(model[i]).__name__})"


class raised_in:
    """Context manager marking an exception raised by the user's code inside
    (a stage's forward or backward, the loss) with ``where`` (a phrase), on
    its :data:`RAISED_IN` attribute and as a note (Python >= 3.11) that the
    traceback prints: a shape mismatch in stage 12's forward showed only
    torch's message and frames. The innermost mark is kept, the exception is
    raised on unchanged (its type, message and traceback). A class, not a
    generator: it wraps timed calls, and its cost is two attribute lookups."""

    __slots__ = ("where",)

    def __init__(self, where: str):
        self.where = where

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is not None:
            mark_raised(exc, self.where)
        return False


def mark_raised(exc: BaseException, where: str) -> None:
    """Mark ``exc`` as :class:`raised_in` does, for code that cannot afford a
    ``with`` block per call: the executor calls it from an ``except`` clause
    (no cost until something raises), with a phrase it builds only then. An
    exception already marked (by an inner call) and a ``BaseException`` that is
    not an ``Exception`` (``KeyboardInterrupt``: not the user's code failing)
    are left as they are."""
    if not isinstance(exc, Exception) or getattr(exc, RAISED_IN, None) is not None:
        return
    try:
        setattr(exc, RAISED_IN, where)
    except (AttributeError, TypeError):     # an exception without __dict__
        return
    add_note(exc, f"rtmem: raised in {where}")


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` where exceptions take notes (Python >= 3.11); on
    3.10 the note is dropped rather than the exception replaced by an
    AttributeError."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def as_stages(model, what: str) -> nn.Sequential:
    """``model`` as the ``nn.Sequential`` of stages ``what`` runs: an
    ``nn.Sequential``, or a list, tuple or ``nn.ModuleList`` of modules
    (wrapped, the modules shared, not copied). Raises :class:`ExecutionError`
    for anything else or for no stages at all."""
    # A ModuleList is how models hold their blocks (model.h in GPT-2 ports); it
    # was refused with "wrap your blocks in nn.Sequential" while a plain list of
    # the same blocks ran.
    if isinstance(model, (list, tuple, nn.ModuleList)) and all(
            isinstance(m, nn.Module) for m in model):
        model = nn.Sequential(*model)
    if not isinstance(model, nn.Sequential):
        raise ExecutionError(f"{what} needs an nn.Sequential of stages or a list of "
                             f"modules, got {type(model).__name__}; wrap your blocks in "
                             f"nn.Sequential")
    if len(model) == 0:
        raise ExecutionError(f"{what} got no stages (an empty model); give it the "
                             f"blocks of the network, in order")
    return model


def check_loss_fn(loss_fn) -> None:
    if not callable(loss_fn):
        raise ExecutionError(f"loss_fn must be callable as loss_fn(output, target), got "
                             f"{type(loss_fn).__name__}")


def check_inputs(inputs) -> None:
    """Refuse, before any stage runs, a batch that is not a tensor."""
    if not isinstance(inputs, torch.Tensor):
        raise ExecutionError(f"inputs must be a torch.Tensor (the first stage's "
                             f"input), got {type(inputs).__name__}; convert it with "
                             f"torch.as_tensor")


def _storages(tensors):
    """Unique untyped storages of ``tensors`` keyed by data pointer (0-byte ones kept
    by identity so freed storages still count once they come back)."""
    return _keyed(t.untyped_storage() for t in tensors if t is not None)


def _keyed(storages, described=None) -> dict:
    """:func:`_storages` of the tensors whose storages are ``storages``;
    ``described``: their :func:`_described` triples, when the caller has them
    (then torch is not asked again)."""
    if described is None:
        return {id(s) if s.nbytes() == 0 else s.data_ptr(): s for s in storages}
    return {ptr if nbytes else id(s): s for s, (_, ptr, nbytes) in zip(storages, described)}


class _Ledger:
    """Bytes of the device storages that a changing set of tensors references,
    kept current at O(1) per change: tensors come (:meth:`add`) and go
    (:meth:`remove`), storages are resized (:meth:`resized`), and the excluded
    data pointers (the model's state) change (:meth:`exclude`). :attr:`total`
    equals summing :func:`_storages` of the whole set with the excluded keys left
    out, which costs O(set) per query: O(operations x stored tensors) per step
    when the executor accounts after every operation.

    Storages are tracked by StorageImpl (``_cdata``: the same for every view and
    kept across ``resize_``), bytes per data pointer as :func:`_storages` keys
    them (two storages over the same memory count once). No storage object is
    held, so the ledger never keeps memory alive; the tensors of the set do,
    while they are counted."""

    __slots__ = ("_refs", "_ptr_of", "_bytes_of", "_at_ptr", "_bytes_at", "_excluded",
                 "total")

    # Only ints in the dicts, and tuples of ints handed out: the garbage collector
    # tracks none of them. Lists per entry were ~5 tracked objects per stage that
    # live from F_all to B, get promoted, and bring full collections sooner
    # (bench/executor.py measures the collector's cost per step).
    def __init__(self):
        self._refs: dict = {}            # _cdata -> references
        self._ptr_of: dict = {}          # _cdata -> data_ptr when counted
        self._bytes_of: dict = {}        # _cdata -> nbytes when counted
        self._at_ptr: dict = {}          # data_ptr -> storages counted there (nbytes > 0)
        self._bytes_at: dict = {}        # data_ptr -> nbytes of the first of them
        self._excluded: set = set()
        #: bytes of the referenced storages outside the excluded pointers
        self.total = 0

    def _count(self, ptr: int, nbytes: int, step: int) -> None:
        if not nbytes:
            return
        n = self._at_ptr.get(ptr, 0) + step
        if n == step:                    # step == 1: the first storage at ptr
            self._bytes_at[ptr] = nbytes
            if ptr not in self._excluded:
                self.total += nbytes
        if n:
            self._at_ptr[ptr] = n
        else:
            del self._at_ptr[ptr]
            first = self._bytes_at.pop(ptr)
            if ptr not in self._excluded:
                self.total -= first

    def add(self, tensors) -> tuple:
        """Count the storages of ``tensors`` (None skipped); returns the keys to
        hand to :meth:`remove`, which holds even if a tensor's ``.data`` is
        swapped meanwhile."""
        return self.add_storages([t.untyped_storage() for t in tensors if t is not None])

    def add_storages(self, storages) -> tuple:
        """:meth:`add` for a caller that has the tensors' untyped storages
        already, one per tensor (a tensor's storage is a lookup in C++)."""
        return self.add_described(_described(storages))

    def add_described(self, described) -> tuple:
        """:meth:`add_storages` for storages given as ``(s._cdata, s.data_ptr(),
        s.nbytes())`` triples (:func:`_described`): the executor counts each
        stored tensor in two ledgers and asks torch once for both (three calls
        into C++ per storage and ledger were ~1/4 of a store's cost)."""
        keys = []
        refs, ptr_of, bytes_of = self._refs, self._ptr_of, self._bytes_of
        for key, ptr, nbytes in described:
            n = refs.get(key)
            if n is None:
                ptr_of[key], bytes_of[key] = ptr, nbytes
                self._count(ptr, nbytes, 1)
                n = 0
            refs[key] = n + 1
            keys.append(key)
        return tuple(keys)

    def remove(self, keys) -> None:
        """Stop counting what :meth:`add` returned ``keys`` for."""
        refs = self._refs
        for key in keys:
            n = refs[key] - 1
            if n:
                refs[key] = n
            else:
                del refs[key]
                self._count(self._ptr_of.pop(key), self._bytes_of.pop(key), -1)

    def resized(self, storage) -> None:
        """Call after ``storage.resize_``: its bytes (and address) changed."""
        key = storage._cdata
        if key not in self._refs:
            return
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        old_ptr, old_nbytes = self._ptr_of[key], self._bytes_of[key]
        if ptr != old_ptr or nbytes != old_nbytes:
            self._count(old_ptr, old_nbytes, -1)
            self._ptr_of[key], self._bytes_of[key] = ptr, nbytes
            self._count(ptr, nbytes, 1)

    def holds(self, ptr: int) -> bool:
        """Whether a counted storage with at least one byte lives at ``ptr`` (a
        :func:`_storages` key), excluded or not."""
        return ptr in self._at_ptr

    def exclude(self, ptrs) -> None:
        """Make ``ptrs`` the excluded data pointers (replacing the previous ones)."""
        new = set(ptrs)
        self.exclude_change(self._excluded - new, new - self._excluded)

    def exclude_change(self, removed, added) -> None:
        """Stop excluding the pointers ``removed`` and start excluding ``added``
        (each pointer in at most one of them): the cost of the change, not of
        everything excluded."""
        for ptrs, sign, update in ((removed, 1, self._excluded.discard),
                                   (added, -1, self._excluded.add)):
            for ptr in ptrs:
                update(ptr)
                nbytes = self._bytes_at.get(ptr)
                if nbytes is not None:
                    self.total += sign * nbytes


def _described(storages) -> list:
    """``(s._cdata, s.data_ptr(), s.nbytes())`` of each of ``storages``, what
    :meth:`_Ledger.add_described` counts."""
    return [(s._cdata, s.data_ptr(), s.nbytes()) for s in storages]


def _storage_bytes(tensors, exclude=()) -> int:
    """Bytes of the distinct storages of ``tensors`` whose key (:func:`_storages`)
    is not in ``exclude``: the executor's accounting, which the profiler uses
    too, so planned and measured bytes agree."""
    return sum(s.nbytes() for k, s in _storages(tensors).items() if k not in exclude)


def _storage_ptrs(tensors) -> set:
    """Data pointers of the non-empty storages of ``tensors`` (None and non-tensors
    skipped): the keys :func:`_storages` gives them."""
    return {s.data_ptr() for t in tensors if isinstance(t, torch.Tensor)
            for s in (t.untyped_storage(),) if s.nbytes()}


def _input_key(x: torch.Tensor):
    """The storage key of a stage input ``x`` that :func:`_rederived_input` takes:
    its data pointer, None for an empty storage (every empty storage may have
    the null pointer, so a saved tensor of another one would match it)."""
    s = x.untyped_storage()
    return s.data_ptr() if s.nbytes() else None


def _rederived_input(t: torch.Tensor, version: int, x_key, x_version: int, x_dtype) -> bool:
    """Whether the executor re-derives ``t``, saved by a stage (at ``version``)
    whose input ``x`` has :func:`_input_key` ``x_key``, version ``x_version`` and
    dtype ``x_dtype``, from the a_i resident at B i rather than keeping it with
    abar_{i+1}: a view of the input's storage holding the input's values as
    they were given. The executor (its F_all) and the profiler (its ``xbar``)
    both decide with this, so planned and measured abar bytes agree."""
    return (t.untyped_storage().data_ptr() == x_key and version == x_version
            and t.dtype == x_dtype)


def _check_output(i: int, stage, y) -> None:
    """Stage outputs are the chain's activations a_{i+1}: single tensors."""
    if not isinstance(y, torch.Tensor):
        raise ExecutionError(
            f"stage {i} ({type(stage).__name__}) returned a {type(y).__name__}; every stage "
            f"of the nn.Sequential must return a single tensor (the activation a{i + 1}). "
            f"Put the stages that pass tuples or dicts between them into one stage, or "
            f"pack the values into one tensor")


class _Alias(torch.autograd.Function):
    """Identity whose output shares its input's storage and version counter but is
    neither a leaf nor a view, so in-place ops on it are allowed (on the leaf
    itself, or on a view of it, autograd refuses them).

    Its backward puts the gradient in the leaf's ``.grad`` itself, as the
    stage's backward made it: the tensor plain autograd hands on to the
    previous stage's backward. Passed on to the leaf's AccumulateGrad, it was
    laid out like the leaf instead (the contiguous gradient of a Flatten
    became channels_last, as its channels_last input), so the previous stage's
    backward ran on another memory layout than in plain autograd: other
    reduction orders, gradients a few ulp apart."""

    @staticmethod
    def forward(ctx, x):
        ctx.leaf = x      # an input, not an output: no reference cycle
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        if torch.compiler.is_compiling():
            # traced by compiled autograd, where ctx.leaf is a proxy of the
            # graph's: setting its .grad reached no tensor. AccumulateGrad then
            return grad
        leaf = ctx.leaf
        if grad.layout == torch.strided and \
                grad.untyped_storage().nbytes() > grad.numel() * grad.element_size():
            # a view of a larger gradient (a cat's or a split's): held as it is,
            # it would keep the whole of that storage alive as delta_i, beyond the
            # x_i bytes the plan counts for it. Copied out dense in the view's own
            # dimension order, what the previous stage's backward reads in plain
            # autograd (the leaf's order, as AccumulateGrad lays it out, changed
            # the rounding of a transposed a_i's backward); an expanded, stride-0
            # gradient is smaller than that and is kept
            order = sorted(range(grad.dim()), key=lambda d: (-grad.stride(d), -d))
            dense = grad.new_empty([grad.size(d) for d in order])
            grad = dense.permute([order.index(d) for d in range(grad.dim())]).copy_(grad)
        leaf.grad = grad if leaf.grad is None else leaf.grad + grad
        return None


def _grad_input(x: torch.Tensor):
    """``(leaf, arg)`` to run a stage (or a loss) on ``x`` under autograd: ``leaf``
    requires grad and receives the input gradient in ``.grad``; ``arg`` is what the
    stage gets (:class:`_Alias`). Call under ``enable_grad``."""
    leaf = x.detach().requires_grad_(True)
    return leaf, _Alias.apply(leaf)


def differentiable(t: torch.Tensor) -> bool:
    """Whether autograd can carry a gradient through ``t``: a floating-point or
    complex tensor (a spectral model's activations are complex). Integer and
    bool tensors (token ids, masks) cannot require grad."""
    return t.is_floating_point() or t.is_complex()


def _stage_input(x: torch.Tensor, needs_grad: bool = True):
    """``(leaf, arg)`` of :func:`_grad_input` for a :func:`differentiable` ``x``
    (floating-point or complex) that ``needs_grad``; other inputs (token ids, the
    input of a stage that :func:`inputs_need_grad` says needs none) go in as they
    are: ``(x, x)``. Testing for floating point alone handed a complex
    activation over as it was, which cut the gradient to every earlier stage
    without a word."""
    return _grad_input(x) if needs_grad and differentiable(x) else (x, x)


def _graph_nodes(t):
    """Each autograd node of the graph behind ``t`` once, as a depth-first walk
    from ``t.grad_fn`` reaches it (none for a tensor without history)."""
    seen, todo = set(), [t.grad_fn] if isinstance(t, torch.Tensor) else []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        todo.extend(nxt for nxt, _ in node.next_functions)


def _iter_graph_leaves(t, own):
    """:func:`_graph_leaves`, one at a time, found as the walk of the graph
    reaches them."""
    for node in _graph_nodes(t):
        leaf = getattr(node, "variable", None)   # an AccumulateGrad node
        if leaf is not None and leaf is not own:
            yield leaf


def _graph_leaves(t, own) -> list:
    """The tensors whose ``.grad`` a backward from ``t`` accumulates into (its
    graph's leaves), but ``own`` (the input leaf the profiler or the executor
    gave the stage or the loss): parameters of the model, any a stage or the
    loss closes over, a target that requires grad."""
    return list(_iter_graph_leaves(t, own))


def node_mark() -> int:
    """The sequence number autograd gives the next node it records on this
    thread: nodes are numbered in the order they are made, so a node of a graph
    numbered below a stage forward's mark was made before that forward.
    Call under ``enable_grad``."""
    return torch.ones((), requires_grad=True).neg().grad_fn._sequence_nr() + 1


# A leaf's AccumulateGrad node carries the largest sequence number (it is made
# for the leaf, not recorded by an op): never taken for a node of another stage.
_NO_SEQUENCE = 2 ** 64 - 1


def _cast_of_leaf(node) -> bool:
    """Whether ``node`` is a dtype cast of a leaf (``ToCopyBackward0`` to an
    AccumulateGrad): what autocast's cache hands every forward reading a
    parameter in its region, model state for the executor (rule 4)."""
    return type(node).__name__ == "ToCopyBackward0" and all(
        nxt is None or hasattr(nxt, "variable") for nxt, _ in node.next_functions)


def check_cross_stage(i: int, y, origin, model, casts_kept: bool) -> None:
    """Refuse the output ``y`` of a grad-mode forward of stage ``i`` whose graph
    reaches a node another stage's forward recorded: the stage read a tensor
    with autograd history that stage k made and handed over outside the
    activations (a module attribute shared by the stages, ``self.ctx.bias =
    ...`` in the style of T5's position bias, a skip connection kept as an
    attribute, a global). The executor runs and backpropagates each stage on
    its own, and recomputes stage k under ``no_grad``, where that tensor has no
    history: its gradient would be lost or wrong, silently. ``origin(seq)`` is
    the stage k whose forward recorded the node numbered ``seq`` (its
    :func:`node_mark`), or None for a node of no other stage's forward (made
    before the forwards, by stage ``i`` itself, by the loss). Leaves (the
    stage's input leaf, parameters) carry no op's number and pass, as do
    autocast's cached casts of parameters (``casts_kept``), model state."""
    for node in _graph_nodes(y):
        seq = node._sequence_nr()
        k = None if seq == _NO_SEQUENCE else origin(seq)
        if k is not None and not (casts_kept and _cast_of_leaf(node)):
            raise ExecutionError(
                f"{stage_label(model, i)} reads a tensor with autograd history that the "
                f"forward of {stage_label(model, k)} made ({type(node).__name__}), handed "
                f"over outside the stages' outputs (a module attribute the stages share, "
                f"e.g. self.ctx.bias = ... or a skip connection kept as an attribute, or "
                f"a global). " + handed_over_advice(k, "", f"stages {min(i, k)} to "
                                                           f"{max(i, k)} into one stage"))


def handed_over_advice(maker: int, detach_when: str, merge: str) -> str:
    """The end of the errors for a tensor with autograd history that stage
    ``maker`` hands to other stages outside the activations (the profiler's and
    the executor's checks): why it is refused and the fixes, ``detach_when``
    added to when detaching is right and ``merge`` naming what to merge."""
    return (f"The executor runs, recomputes (under no_grad) and backpropagates each "
            f"stage on its own, so the gradient through that tensor would be lost or "
            f"wrong. Pass it in the activation (pack it into the tensor stage {maker} "
            f"returns, e.g. torch.cat, and unpack it in the next stages), compute it in "
            f"every stage that reads it, detach it if it should not train{detach_when}, "
            f"or merge {merge}")


def trains_beyond(t, own) -> bool:
    """Whether a backward from ``t`` writes a gradient other than ``own``'s
    (:func:`_graph_leaves` is not empty), the walk stopping at the first leaf:
    a few nodes for a stage or a loss with a parameter that trains."""
    return next(_iter_graph_leaves(t, own), None) is not None


def inputs_need_grad(stage_tensors, batch_needs_grad: bool) -> list:
    """Whether each stage's input a_i requires grad in plain autograd: when the
    batch does, or a stage before i holds a tensor that requires grad.
    ``stage_tensors`` are each stage's parameters, buffers and the tensors its
    modules hold as plain attributes (:func:`~._module_state.stage_state`'s constants: a
    learnable ``self.offset = torch.zeros(8, requires_grad=True)`` of prompt or
    bias tuning trains as a parameter does). Only then does ``F_all i`` record
    what delta_i needs (a frozen prefix, as in fine-tuning, gets its inputs as
    they are and B i computes no delta_i). A tensor that requires grad and that
    a stage reads from where this cannot see it (a global, a closure) makes the
    stage's output require grad all the same: :func:`check_needs_grad` refuses
    that step rather than cutting the chain."""
    needs, trainable = [], batch_needs_grad
    for tensors in stage_tensors:
        needs.append(trainable)
        trainable = trainable or any(t.requires_grad for t in tensors)
    return needs


def check_needs_grad(i: int, stage, y, needs_grad: list, own) -> None:
    """Refuse the output ``y`` of a grad-mode forward of stage ``i`` that requires
    grad where :func:`inputs_need_grad` (``needs_grad``) decided that a_{i+1}
    needs no gradient: the next stage gets (or got) it as it is, which would cut
    the gradient to what stage ``i`` (or one before it) reads that requires grad,
    silently. A stage whose input needs no gradient outputs such a tensor only
    when it reads one that requires grad and that is neither its parameter nor
    its modules' attribute. Only a graph reaching a leaf other than ``own`` (the
    stage's input) loses a gradient: an output made a leaf that requires grad
    (Hugging Face's ``enable_input_require_grads`` hook on a frozen embedding) or
    a graph back to the stage's own input (``autograd.grad(u, x,
    create_graph=True)`` features) trains as in plain autograd."""
    if i + 1 < len(needs_grad) and not needs_grad[i + 1] and y.requires_grad \
            and trains_beyond(y, own):
        raise ExecutionError(
            f"stage {i} ({type(stage).__name__}) returns an output that requires grad, "
            f"although no parameter, buffer or tensor attribute of its modules, or of a "
            f"stage before it, requires grad (nor does the batch): it reads a tensor that "
            f"requires grad from where the executor cannot see it (a global, a closure, "
            f"functools.partial, one made in forward), so the executor handed stage "
            f"{i + 1} its input without gradient and that tensor would get none. Make the "
            f"tensor an nn.Parameter or an attribute of a module of stage {i} "
            f"(self.t = t), or detach it if it should not train")


def nothing_trains(stage_tensors, batch_needs_grad: bool, stages, *,
                   cut_at: int | None = None, loss_cut: bool = False) -> ExecutionError:
    """The error for a step whose loss needs no gradient, where plain
    ``loss.backward()`` raises ("element 0 of tensors does not require grad"):
    the model's output a_n needs none, nor does anything else the loss reads,
    or (``loss_cut``) it does but ``loss_fn`` returned a loss without autograd
    history. ``stage_tensors`` are the stages' parameters and tensor attributes
    (as :func:`inputs_need_grad` takes them) and ``stages`` their modules;
    ``cut_at`` is the stage whose output was found without autograd history,
    every stage after it training nothing (None: the last stage or one before
    it). The message names the likely cause and what to do."""
    if loss_cut:
        return ExecutionError(
            "loss_fn(output, target) returned a loss that does not require grad, "
            "although the output does: it drops the autograd history (a .detach(), "
            ".item() or torch.tensor(...) of the value, a torch.no_grad() block), so "
            "nothing would train; return the loss tensor as computed")
    if batch_needs_grad or any(t.requires_grad for ts in stage_tensors for t in ts):
        last = len(stages) - 1
        k = last if cut_at is None else cut_at
        where = "the last stage" if k == last else f"stage {k}"
        after = ("" if k == last else
                 ", and no stage after it has a parameter (or tensor attribute) that "
                 "requires grad")
        cause = (f"a stage cut it from the parameters that train: {where} "
                 f"({type(stages[k]).__name__}) or one before it returns a tensor without "
                 f"autograd history (a .detach(), an integer result such as argmax, a "
                 f"forward under torch.no_grad()){after}")
        remedy = "return the differentiable tensor"
    else:
        cause = ("no parameter of the model requires grad (all frozen: "
                 "requires_grad=False), nor does a tensor its modules hold as an "
                 "attribute, and the batch does not either")
        remedy = "unfreeze the parameters (model.requires_grad_(True))"
    return ExecutionError(
        f"nothing in this step needs a gradient: the model's output does not require "
        f"grad, nor does anything else the loss reads, because {cause}. Plain "
        f"loss.backward() raises here too. To train, {remedy}; for a loss without "
        f"training, compute loss_fn(model(inputs), target) under torch.no_grad() "
        f"instead of step()")


def check_loss(loss, z, stage_tensors, batch_needs_grad: bool, stages) -> None:
    """Refuse, before its backward, a ``loss_fn(z, target)`` result that
    ``loss.backward()`` cannot run on: one that is not a 0-d tensor, or has no
    autograd history (:func:`nothing_trains`; ``z`` is the output handed to
    ``loss_fn``). The executor's L and the profiler's first loss call share it,
    so a loss the profiler measures is one the executor trains with."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                else f"a {type(loss).__name__}")
        raise ExecutionError(f"loss_fn(output, target) must return a scalar tensor (0-d), "
                             f"got {what}; reduce it (e.g. .mean()) in loss_fn")
    if not loss.requires_grad:   # where loss.backward() raises (rule 3)
        raise nothing_trains(stage_tensors, batch_needs_grad, stages,
                             loss_cut=z.requires_grad)


def param_label(names: dict, p) -> str:
    """``'name' (shape ...)`` of parameter ``p`` for error messages."""
    return f"{names.get(p, '?')!r} (shape {tuple(p.shape)})"


def check_shared_weights(stage_params, moves: dict, names: dict) -> None:
    """Refuse weight moves of a stage holding a parameter (or a parameter storage)
    another stage also uses: freeing it between that stage's ops would empty a
    weight the other stage still reads (NOTE rule 5); or a parameter that is a
    view into a larger storage. Refuse ``g_offload`` of some but not all of the
    stages using a parameter (its gradient would be split)."""
    def key(p):
        s = p.untyped_storage()
        return s.data_ptr() if s.nbytes() else id(p)

    owners: dict = {}   # storage key -> stages using it
    for i, params in enumerate(stage_params):
        for p in params:
            if i not in owners.setdefault(key(p), []):
                owners[key(p)].append(i)
    for i in sorted(moves):
        if not moves[i] & _WEIGHT_MOVES:
            continue
        for p in stage_params[i]:
            s = p.untyped_storage()
            if s.nbytes() and (p.storage_offset() or
                               s.nbytes() != p.numel() * p.element_size()):
                # the moves copy each parameter into a storage of its own, and saved
                # views of it are re-derived with their storage offsets
                raise ExecutionError(
                    f"parameter {param_label(names, p)} of stage {i} is a view into a "
                    f"larger storage ({s.nbytes():,} bytes, element offset "
                    f"{p.storage_offset()}), e.g. a flattened parameter buffer; weight "
                    f"moves copy each parameter on its own. Give it a storage of its own "
                    f"(p.data = p.data.clone()) or remove the w_offload/w_delete/"
                    f"w_prefetch ops of stage {i}")
            stages = owners[key(p)]
            if len(stages) > 1:
                raise ExecutionError(
                    f"parameter {param_label(names, p)} is shared by stages "
                    f"{', '.join(map(str, stages))} (tied weights), so the schedule's "
                    f"weight moves of stage {i} would free it while another stage still "
                    f"reads it; remove the w_offload/w_delete/w_prefetch ops of stages "
                    f"{', '.join(map(str, stages))} from the schedule, or untie the weights")
    # A gradient moved by g_offload of some of the stages using a parameter, and
    # not others, would end up split between host_grads() and p.grad, which an
    # optimizer given either one alone gets wrong.
    for p, stages in shared_parameters(stage_params):
        moved = [i for i in stages if Op.G_OFFLOAD in moves.get(i, ())]
        if moved and len(moved) < len(stages):
            kept = [i for i in stages if i not in moved]
            raise ExecutionError(
                f"parameter {param_label(names, p)} is shared by stages "
                f"{', '.join(map(str, stages))} (tied weights), and the schedule "
                f"g_offloads its gradient at stage(s) {', '.join(map(str, moved))} but "
                f"not {', '.join(map(str, kept))}: it would be split between "
                f"host_grads() and .grad; g_offload every stage using it, or none")


def shared_parameters(stage_params) -> list:
    """``(p, stages)`` for each parameter (by identity) that several stages use
    (tied weights, a module repeated in the Sequential), ``stages`` ascending:
    each of those stages' ``B i`` adds its part of the gradient to ``p.grad``
    in a backward of its own."""
    users: dict = {}    # parameter id -> (parameter, stages using it)
    for i, params in enumerate(stage_params):
        for p in params:
            stages = users.setdefault(id(p), (p, []))[1]
            if not stages or stages[-1] != i:
                stages.append(i)
    return [(p, stages) for p, stages in users.values() if len(stages) > 1]


def check_shared_hooks(shared: list, names: dict) -> None:
    """Refuse gradient hooks on a parameter of :func:`shared_parameters`
    (``shared``): the executor runs one backward per stage, so a tensor hook
    (``register_hook``) or a post-accumulate-grad hook runs once per stage on
    that stage's part of the gradient, where ``loss.backward()`` runs it once on
    their sum, and a hook that is not linear (a clamp, a clip, an optimizer step
    in backward) gives another result. rtmem's own hooks that add up what they
    are given (:data:`SUMS_PARTIAL_GRADIENTS`) pass."""
    for p, stages in shared:
        kinds = []
        if p._backward_hooks:
            kinds.append(f"{len(p._backward_hooks)} tensor hook(s) (register_hook)")
        post = [h for h in (p._post_accumulate_grad_hooks or {}).values()
                if not getattr(h, SUMS_PARTIAL_GRADIENTS, False)]
        if post:
            kinds.append(f"{len(post)} post-accumulate-grad hook(s) "
                         f"(register_post_accumulate_grad_hook)")
        if kinds:
            used = ", ".join(map(str, stages))
            raise ExecutionError(
                f"parameter {param_label(names, p)} is shared by stages {used} (tied "
                f"weights) and has {' and '.join(kinds)}; the executor runs one backward "
                f"per stage, so each hook would run once per stage on that stage's part of "
                f"the gradient, where loss.backward() runs it once on their sum (a clamp "
                f"of each part is not the clamp of the sum). Remove the hook and apply it "
                f"to the summed p.grad after step() instead (before the optimizer's step, "
                f"e.g. in optimizer.register_step_pre_hook), merge stages {stages[0]} to "
                f"{stages[-1]} into one stage, or untie the weights")


def check_placement(stage_params, moves: dict, names: dict) -> None:
    """Refuse weight moves of parameters, and gradient moves of gradients, that
    :func:`~rtmem.torch.place_parameters` put in an arena: the moves swap in
    ordinary torch tensors, silently taking them out of the arena."""
    for i in sorted(moves):
        ops = moves[i]
        moves_weights = bool(ops & _WEIGHT_MOVES)
        for p in stage_params[i]:
            placement = _placement_of(p)
            if placement is None:
                continue
            weights = moves_weights      # placed: p is in placement.weights
            grads = p in placement.grads and Op.G_OFFLOAD in ops
            if weights or grads:
                what = "weight" if weights else "gradient"
                raise ExecutionError(
                    f"parameter {param_label(names, p)} of stage {i} has its {what} in an "
                    f"arena (rtmem.torch.place_parameters), and the schedule's "
                    f"{' / '.join(sorted(op.name.lower() for op in ops))} of stage {i} "
                    f"would replace it with ordinary torch memory, out of the arena; call "
                    f"release() on its ModulePlacement first, or remove the weight and "
                    f"gradient moves of stage {i} from the schedule")
