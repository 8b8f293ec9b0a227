"""The saved-tensor hooks of one ``F_all``: what the graph of stage i keeps for
its backward (NOTE [ Executor ] rule 2 in executor.py).

One object per F_all, not a pair of closures: the hooks live as long as the
graph (from F_all i to B i), and an object with slots is three objects the
garbage collector tracks (it and its two bound methods) where the closures were
nine (two functions, seven cells). Across a deep chain those survive into the
oldest generation and bring full collections sooner (bench/executor.py
measures the collector's cost per step).
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
from torch.nn.utils import parametrize

from ._stages import ExecutionError, _input_key, _rederived_input, param_label


class _SavedHooks:
    """``pack`` / ``unpack`` for ``torch.autograd.graph.saved_tensors_hooks``
    while ``executor`` runs stage ``i`` forward from ``x``; ``saved`` lists the
    tensors the graph keeps as they are (the stored abar's saved tensors)."""

    __slots__ = ("executor", "i", "state", "x_key", "x_version", "x_dtype", "x_layout",
                 "saved", "casts_kept")

    def __init__(self, executor, i: int, x: torch.Tensor):
        self.executor, self.i = executor, i
        # the stage's parameters, buffers and constant tables by storage pointer
        self.state = {s.data_ptr(): t for t in executor._stage_state(i)
                      for s in (t.untyped_storage(),) if s.nbytes()}
        self.x_key, self.x_version, self.x_dtype = _input_key(x), x._version, x.dtype
        # how x lies in its storage (tuples of ints: the collector stops tracking them)
        self.x_layout = _layout(x)
        # asked here, outside the stage: whether autocast's cache outlives its forward
        self.casts_kept = casts_outlive_forward(x.device.type)
        self.saved = []

    def pack(self, t: torch.Tensor):
        # A saved view of a weight (linear saves weight.t()) or of a buffer
        # (batch norm saves its running statistics) is re-derived from the
        # module at unpack time, so that w_delete / w_offload really free the
        # weights between F_all i and B i (Rule 6 of the simulator). A saved view
        # of the input is re-derived from whichever copy of a_i or abar_i is
        # resident at B i (B i needs one of them, Table 2.1), so deleting the
        # copy F_all i happened to read does not break the graph; unless the
        # stage modified its input before saving it: then no copy of a_i holds
        # those values, and the graph keeps the tensor, as autograd would.
        if t.is_conj() or t.is_neg():
            # A lazy conjugate or negative view (z.conj() of a complex input or
            # weight) holds that bit, not the values, in its storage, and the
            # re-derivations below (as_strided) drop the bit: the gradient came out
            # conjugated. Packed as its plain view, the bits put back at unpack.
            conj, neg = t.is_conj(), t.is_neg()
            plain = t.conj() if conj else t            # a view without the bit
            plain = torch._neg_view(plain) if neg else plain
            return (self.pack(plain), conj, neg)
        base = self.state.get(t.untyped_storage().data_ptr())
        if base is not None and base.dtype == t.dtype:
            return (base, t.size(), t.stride(), t.storage_offset(), base._version)
        if _rederived_input(t, t._version, self.x_key, self.x_version, self.x_dtype):
            return (self.i, t.size(), t.stride(), t.storage_offset())   # a view of a_i
        if self.casts_kept and _cached_cast(t):
            # autocast's cached cast of a parameter (linear saves w_bf16.t()), or of
            # any leaf that requires grad (a learnable tensor attribute): the
            # cache holds it for the whole autocast region and hands it to every
            # later forward reading the parameter (a recomputation, a tied weight,
            # the next step in the region), so it is model state, not an activation
            # of abar_{i+1}: an offload + delete must not free it (resize_(0) left
            # the cache a 0-byte tensor: "setStorage ... out of bounds")
            return (t, t._version)
        # Held detached (same storage and version counter; unpack's result gets its
        # autograd edge from the graph, not from this tensor): t's grad_fn leads to
        # the nodes whose saved tensors hold these hooks, and t itself when an op
        # saves its own output (softmax, exp), a reference cycle through C++ that
        # Python's collector cannot see. A B frees the saved tensors and breaks it,
        # but an abar dropped without its B (a failed step, a discarded
        # checkpoint: ``delete abar``) kept its whole graph alive for good.
        t = t.detach()
        self.saved.append(t)
        return (t, t._version)

    def unpack(self, packed):
        i = self.i
        if len(packed) == 3:    # a conjugate or negative view (pack)
            inner, conj, neg = packed
            t = self.unpack(inner)
            t = torch._neg_view(t) if neg else t
            return t.conj() if conj else t
        if len(packed) == 2:
            t, version = packed
            if t._version != version:   # autograd's own check is off under hooks
                raise ExecutionError(
                    f"a tensor stage {i} saved for its backward was modified in place "
                    f"afterwards (later in the stage, or by the next stage or the loss "
                    f"modifying its input in place); plain autograd refuses this too "
                    f"when the stage's input requires grad (as every input after a "
                    f"stage with trainable parameters does). Make that operation "
                    f"out-of-place (x = x * 2 instead of x.mul_(2))")
            return t
        if len(packed) == 5:    # a parameter or buffer: no copy of it was saved
            base, size, stride, offset, version = packed
            if base._version != version:
                raise ExecutionError(
                    f"{param_label(self.executor._param_names, base)}, which stage {i} "
                    f"saved for its backward, "
                    f"was modified in place afterwards (e.g. a running statistic "
                    f"updated after use); plain autograd refuses this too. Update it "
                    f"out-of-place or before the stage uses it")
            return base.detach().as_strided(size, stride, offset)
        k, size, stride, offset = packed
        src = self.executor._source(k)
        # The saved view is of the storage's values, its bits stripped (pack): a_k
        # itself may be a lazy conjugate or negative view (a stage returned
        # x.conj()), whose bit as_strided keeps, and the bit put back at unpack
        # made it conjugated twice, the weight's gradient wrong
        src = src.conj() if src.is_conj() else src
        src = torch._neg_view(src) if src.is_neg() else src
        if _layout(src) != self.x_layout:
            # This copy of a_i lies in its storage unlike the one F_all read (a
            # stage whose output's layout depends on the grad mode: plain a_i
            # from F_ck, abar_i from F_all): the saved view's strides address the
            # old layout, so lay the values out as they were.
            x_size, x_stride, x_offset, nbytes = self.x_layout
            buf = src.new_empty(nbytes // src.element_size())
            # an index write, not copy_ into buf.as_strided(...): that layout may
            # repeat elements (an expanded input, stride 0), which copy_ refuses;
            # repeated indices get equal values here
            where = torch.arange(buf.numel(), device=buf.device)
            buf[where.as_strided(x_size, x_stride, x_offset)] = src
            src = buf
        return src.as_strided(size, stride, offset)

    def unpack_hook(self):
        """:meth:`unpack` as the hook to register, kept out of TorchDynamo once
        TorchDynamo is loaded: under compiled autograd the backward graph calls
        the unpack hook, and traced, its version-counter checks read the traced
        tensors' counters and refused every step ("'4.weight' ... was modified in
        place afterwards"); run eagerly it re-derives and checks the real tensors.

        Asked per stage forward, not at import: ``torch.compiler.disable``
        imports torch._dynamo, which doubled the cost of ``import rtmem.torch``
        (3.6 s of CPU over torch's own 3.5 s) in every process, DataLoader
        workers and CLI runs included. Compiled autograd and torch.compile load
        TorchDynamo before any backward they trace, so while it is not loaded
        no trace can meet this hook."""
        global _eager_unpack
        if "torch._dynamo" not in sys.modules:
            return self.unpack
        if _eager_unpack is None:
            _eager_unpack = torch.compiler.disable(_SavedHooks.unpack)
        return functools.partial(_eager_unpack, self)


#: :meth:`_SavedHooks.unpack` under ``torch.compiler.disable``, made on first need
#: (:meth:`_SavedHooks.unpack_hook`).
_eager_unpack = None


def casts_outlive_forward(device_type: str) -> bool:
    """Whether the casts autocast caches during a stage's forward stay in its
    cache after the forward, asked outside the stage: inside a
    ``torch.autocast`` region, enabled or not (the cache is cleared only when
    the outermost region exits, so a stage's own ``torch.autocast`` inside a
    caller's ``torch.autocast(..., enabled=False)`` caches for the caller's
    whole region), or with autocast enabled for ``device_type`` without one
    (``torch.set_autocast_enabled``). Otherwise a stage entering
    ``torch.autocast`` itself has its casts cleared from the cache at its exit:
    the graph alone holds them, activations like any other."""
    # the nesting count of autocast regions; torch has no getter, and the
    # decrement does not clear the cache (autocast's __exit__ does that)
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return nesting > 0 or torch.is_autocast_enabled(device_type)


def _cached_cast(t: torch.Tensor) -> bool:
    """Whether ``t`` is (a view of) a cast of a float32 leaf that requires grad
    to autocast's dtype for its device, made with autocast's cache on: what
    autocast caches for the autocast region. Asked where autograd saves ``t``
    (a ``saved_tensors_hooks`` pack, inside the op that saves it), where the
    cache setting and the dtype are those of the autocast region the stage
    runs in, its own ``torch.autocast`` included. Not only parameters: a buffer
    or a tensor attribute that requires grad (a learnable offset) is such a
    leaf too, and its cast is cached and reused alike.

    Limitation: a cast the stage makes itself, ``self.w.to(torch.bfloat16)``
    to autocast's dtype, looks the same (a ``ToCopyBackward0`` of the leaf;
    torch offers no way to ask its cache what it holds) and is taken as cached
    too, though autocast never caches it: kept as model state, so the results
    are those of plain autograd, but its bytes, which the graph holds from
    F_all to B, are counted neither in abar (the executor's measured bytes)
    nor in the profiler's ``xbar``, and an offload or delete of abar leaves
    them on the device: a plan undercounts that stage's abar by the cast's
    size. For exact accounting let autocast make the cast (an op on its
    lists, ``x @ self.w``), or cast to another dtype."""
    if not torch.is_autocast_cache_enabled():
        return False
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
        return False
    src = fn.next_functions[0][0]
    return src is not None and type(src).__name__ == "AccumulateGrad" \
        and src.variable.dtype == torch.float32 \
        and base.dtype == torch.get_autocast_dtype(base.device.type)


def _layout(x: torch.Tensor) -> tuple:
    """Size, stride, offset and storage bytes of ``x`` (:attr:`_SavedHooks.x_layout`)."""
    return (tuple(x.size()), x.stride(), x.storage_offset(), x.untyped_storage().nbytes())


# torch before 2.11 kept in autocast's cache a cast made under no_grad and gave
# it, without autograd history, to a later forward of the same autocast region
# that needed the gradient: the weight behind it got none (pytorch issues 112583
# and 158232; fixed by pytorch PR 165068, first released in 2.11; 2.10.0 still
# loses the gradient). A pre-release of 2.11 compares below 2.11: it gets the
# workaround, which only costs casts.
_NO_GRAD_CASTS_CACHED = torch.__version__ < "2.11"


# What the context managers below return when they have nothing to do (no
# autocast, no parametrization cache: the common case): a generator-based
# context manager costs a generator and two frames per use, and they run at
# every forward and backward of a stage (~4% of a CPU step of small stages).
# nullcontext keeps no state, so one instance serves every use, nested too.
_NOTHING = contextlib.nullcontext()


def uncached_casts():
    """Turn autocast's cache off for a forward under ``no_grad`` (F_none, F_ck)
    where this torch would cache its casts without their autograd history; the
    previous setting comes back on exit, also after an error."""
    if not (_NO_GRAD_CASTS_CACHED and torch.is_autocast_cache_enabled()):
        return _NOTHING
    return _casts_uncached()


@contextlib.contextmanager
def _casts_uncached():
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(True)


def fastpaths_as_trained(trains: bool):
    """Turn torch's attention fast path (``torch.backends.mha``) off for a
    forward under ``no_grad`` (F_none, F_ck) of a stage whose output needs a
    gradient in plain training (``trains``), and put the caller's setting back
    on exit, also after an error. In eval mode ``nn.MultiheadAttention`` and the
    ``nn.Transformer*`` layers take a fused path when autograd is off, which
    rounds differently from the path a training forward takes: the no_grad
    forwards gave a_{i+1}, and so every gradient, a few ulp away from plain
    training and from the stage's own F_all. A stage that trains nothing (frozen,
    on an input needing no gradient) takes the fast path in plain training
    too, and keeps it. A global flag, as torch has no other switch: another
    thread's attention forward in the meantime runs the slow path (the same
    values, slower)."""
    if not (trains and torch.backends.mha.get_fastpath_enabled()):
        return _NOTHING
    return _fastpath_off()


@contextlib.contextmanager
def _fastpath_off():
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


def autocast_off(device: torch.device):
    """Run the body (a backward: L's, a B's) with autocast off for the cpu and
    for ``device``'s type where it is on (a stage on the cpu under a cuda batch
    is in the caller's cpu region), and turn it back on on exit, also after an
    error. ``step()`` is called inside the caller's ``torch.autocast`` region
    and runs the backward there, where torch's recipe runs ``loss.backward()``
    outside it ("backward passes under autocast are not recommended"): the
    backward formulas of composite ops (attention, layer norm) were cast by
    autocast too, and the gradients differed from the recipe's by up to ~0.7%
    in bf16 (while matching a backward inside the region bit for bit).
    Autocast's cache and nesting count are left alone: the caller's region
    goes on after the backward, with its cached casts."""
    on = [d for d in dict.fromkeys(("cpu", device.type)) if torch.is_autocast_enabled(d)]
    return _autocast_off(on) if on else _NOTHING


@contextlib.contextmanager
def _autocast_off(on: list):
    for d in on:
        torch.set_autocast_enabled(d, False)
    try:
        yield
    finally:
        for d in on:
            torch.set_autocast_enabled(d, True)


def own_parametrizations():
    """Run one forward (a stage's, or the loss's) with a parametrization cache of
    its own where the caller trains inside ``torch.nn.utils.parametrize.cached()``,
    and put the caller's cache back on exit, also after an error.

    The cache keeps the first value it computes of a parametrized weight until
    the caller's ``cached()`` ends. Plain training runs one grad-mode forward
    per step, which fills it; the executor runs several forwards of a stage,
    and one under ``no_grad`` (F_ck, F_none) cached the weight without autograd
    history for the later F_all, whose parametrization then got no gradient; a
    weight cached by one forward and freed by a move of its abar, or
    backpropagated by two Bs (tied weights), would break the other. Per forward,
    a weight used several times in it (an RNN's kernel) is still computed once,
    as ``cached()`` promises, and it is an activation of that forward only."""
    return _own_parametrizations() if parametrize._cache_enabled else _NOTHING


@contextlib.contextmanager
def _own_parametrizations():
    caller = parametrize._cache
    parametrize._cache = {}
    try:
        yield
    finally:
        parametrize._cache = caller
