"""A stage module's own state besides its parameters: its buffer slots, the
constant tensors and ``torch.Generator`` objects it keeps as attributes, and
how a recomputation or a profiling forward leaves no trace on them (NOTE
[ Executor ] rules 4 and 6 in ``executor.py``). Shared by the executor and the
profiler."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["FirstBuffers", "KeptBuffers", "buffer_slots", "replayed_generators", "slot_buffers",
           "stage_state"]


def buffer_slots(module: nn.Module) -> tuple:
    """``(submodule, name)`` of every buffer slot under ``module`` (``None`` ones
    too). A forward that reassigns a buffer (``self.ema = 0.9 * self.ema + ...``)
    puts a new tensor in its slot, which a list of ``module.buffers()`` made
    before the forward does not see."""
    return tuple((m, name) for m in module.modules() for name in m._buffers)


def slot_buffers(slots) -> list:
    """The tensors in ``slots`` (:func:`buffer_slots`) now, each once, empty slots
    left out: ``module.buffers()`` without walking the module tree again."""
    return list(dict.fromkeys(t for m, name in slots
                              if (t := m._buffers.get(name)) is not None))


# What every nn.Module keeps in its __dict__ (the parameter, buffer, submodule
# and hook dicts, ``training``): never a constant table, and ~15 of the ~19
# entries of a typical module, so skipped by name (the scan runs after every
# forward, over every module of the stage).
_MODULE_INTERNALS = frozenset(vars(nn.Module()))

# Attribute values that hold no tensor and no generator (a Linear's in_features, a
# ReLU's inplace), skipped by their exact type: the isinstance test below goes
# through torch.Generator's metaclass, a Python-level __instancecheck__, for every
# value that is not a tensor, and that was most of the scan's cost on small stages.
_SCALAR_TYPES = frozenset({int, float, bool, str, bytes, complex, type(None)})


def _strided_parts(t: torch.Tensor) -> tuple:
    """The strided tensors holding the data of ``t``: itself, or a sparse
    tensor's indices and values (what autograd saves of it; a sparse tensor has
    no storage of its own: ``untyped_storage()`` raises). None for the layouts
    the executor does not handle (nested, mkldnn)."""
    layout = t.layout
    if layout == torch.strided:
        return () if t.is_nested else (t,)
    if layout == torch.sparse_coo:
        return (t._indices(), t._values())
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices(), t.values())
    return ()


def _attribute_state(v, tensors: dict, generators: dict, depth: int = 2) -> None:
    """Add to ``tensors`` the non-parameter tensors, and to ``generators`` the
    ``torch.Generator`` objects, in attribute value ``v``: one itself, or one in
    a list, tuple or dict (a cache keyed by sequence length holding ``(cos,
    sin)``), ``depth`` containers deep."""
    if isinstance(v, torch.Tensor):
        if not isinstance(v, nn.Parameter):
            for t in _strided_parts(v):
                tensors[id(t)] = t
    elif isinstance(v, torch.Generator):
        generators[id(v)] = v
    elif depth and isinstance(v, (list, tuple, dict)):
        for item in v.values() if isinstance(v, dict) else v:
            if isinstance(item, (torch.Tensor, torch.Generator, list, tuple, dict)):
                _attribute_state(item, tensors, generators, depth - 1)


def stage_state(modules) -> tuple[list, list]:
    """``(constants, generators)`` that ``modules`` hold as plain attributes
    (``self.x = ...``, or in a list, tuple or dict attribute), each once, in one
    walk over their attributes (it runs after every forward):

    - constants: tensors that are neither parameters nor buffers, constant
      tables a forward reads (rotary or mask caches, class weights). When
      autograd saves one, it is model state like a buffer: a move must never
      free it under the module (NOTE [ Executor ] rule 4), nor count it as an
      activation. A sparse one is taken as its indices and values tensors.
    - generators: the ``torch.Generator`` objects a forward may draw from
      (``torch.rand(..., generator=self.gen)``), whose state a recomputation
      replays (NOTE [ Executor ] rule 6)."""
    tensors, generators = {}, {}
    for m in modules:
        d = m.__dict__
        for name in d.keys() - _MODULE_INTERNALS:
            v = d[name]
            if type(v) not in _SCALAR_TYPES and \
                    isinstance(v, (torch.Tensor, torch.Generator, list, tuple, dict)):
                _attribute_state(v, tensors, generators)
    return list(tensors.values()), list(generators.values())


@contextlib.contextmanager
def replayed_generators(first: list):
    """Run the body with each generator of ``first`` (``(generator, state)``
    pairs taken before a stage's first forward) set back to that state, so a
    recomputation draws what the first forward drew, and put each back where
    it was before the body afterwards (also when the body raises), so the
    generator ends the step where plain training leaves it: advanced once."""
    now = [(g, g.get_state()) for g, _ in first]
    try:
        for g, state in first:
            g.set_state(state)
        yield
    finally:
        for g, state in now:
            g.set_state(state)


def _copy_bytes(values) -> int:
    """Bytes of the storages of ``values`` (copies made by ``clone``: one storage
    each, of their own size), None entries skipped."""
    return sum(v.untyped_storage().nbytes() for v in values if v is not None)


class KeptBuffers:
    """Which tensor each of ``slots`` holds now, and its values, to put back with
    :meth:`restore` after a forward that must leave no trace on the module's
    buffers (a recomputation, profiling): in-place updates (batch-norm
    statistics) and reassignments (``self.count = self.count + 1``) alike."""

    __slots__ = ("slots", "held", "values")

    def __init__(self, slots):
        self.slots = slots
        self.held = [m._buffers.get(name) for m, name in slots]
        self.values = [(t, t.detach().clone()) for t in slot_buffers(slots)]

    def nbytes(self) -> int:
        """Bytes of the copies held (of every buffer of the slots)."""
        return _copy_bytes(v for _, v in self.values)

    def restore(self) -> None:
        for (m, name), t in zip(self.slots, self.held):
            if m._buffers.get(name) is not t:
                m._buffers[name] = t
        with torch.no_grad():
            for t, value in self.values:
                # through .data: no version bump, which would fail autograd's check
                # of the views of t a recomputation saved (unpacked at B i)
                t.data.copy_(value)


def _storage(t):
    """The untyped storage of a strided buffer ``t``; None for no tensor and for
    the layouts without one of their own (sparse, nested), whose changes through
    ``.data`` :class:`FirstBuffers` does not look for."""
    if t is None or t.layout != torch.strided or t.is_nested:
        return None
    return t.untyped_storage()


class FirstBuffers:
    """A stage's buffer slots as they were before its first forward of a step,
    for its recomputations to start from (NOTE [ Executor ] rule 6): a stage
    whose output depends on a buffer it updates (spectral norm's power
    iteration vectors, an EMA codebook, a step counter) then recomputes what
    the first forward computed, as the RNG replay makes dropout draw the same
    masks; started from the updated buffers it computed another output, and the
    backward gave gradients other than plain PyTorch's.

    Taken before the first forward (a copy of every buffer of the stage, as
    :class:`KeptBuffers` takes at each recomputation); :meth:`keep_changed`
    then forgets the slots that forward left alone, so constant buffers (a
    causal mask) are not held for the step. A change is a reassigned slot, a
    moved version counter (every in-place op on a tensor moves it, ``out=``
    included) or another storage under the same tensor (``self.buf.data =
    new``), decided without reading the values (no device sync); an in-place
    change through ``.data`` (``self.buf.data.mul_(0.9)``), which moves no
    version counter, is found only by comparing values, which
    :meth:`keep_changed` does when asked (the executor asks at its first step).
    Batch norm's native update of its running statistics moves no version
    counter either: a training-mode batch norm's output does not read them,
    and replaying them (when the values are compared) changes nothing."""

    __slots__ = ("entries",)

    def __init__(self, slots):
        # (slot index, module, name, tensor held then, its version then, its
        # storage then (held, so no new storage can reuse its address before
        # keep_changed compares), a copy of its values)
        self.entries = [(k, m, name, t, None if t is None else t._version,
                         _storage(t), None if t is None else t.detach().clone())
                        for k, (m, name) in enumerate(slots) for t in (m._buffers.get(name),)]

    def nbytes(self) -> int:
        """Bytes of the copies held: every buffer's before :meth:`keep_changed`,
        the kept ones' after it."""
        return _copy_bytes(e[6] for e in self.entries)

    def keep_changed(self, compare_values: bool = False, always=frozenset()) -> frozenset:
        """After the first forward: forget the slots it did not change (with none
        left, :meth:`replay` does nothing). Slot indices in ``always`` are kept
        whatever the forward did (the executor's record of the slots a stage
        changes through ``.data``). With ``compare_values``, a slot whose tensor,
        version and storage did not move is kept when its values changed
        (through ``.data``; a read of every such buffer: a device sync on a GPU).
        Returns the indices of the slots kept for that reason alone."""
        kept, by_value = [], []
        for e in self.entries:
            k, m, name, t, version, storage, value = e
            if k in always or m._buffers.get(name) is not t or (t is not None and (
                    t._version != version or (storage is not None
                                              and t.untyped_storage()._cdata != storage._cdata))):
                kept.append(e)
            elif compare_values and storage is not None and not torch.equal(t, value):
                kept.append(e)
                by_value.append(k)
        # the held storages were for the comparison only: a reassigned buffer's
        # old storage is freed now, as without this record
        self.entries = [(k, m, name, t, None, None, value)
                        for k, m, name, t, _, _, value in kept]
        return frozenset(by_value)

    def replay(self) -> int:
        """Before a recomputation (after :class:`KeptBuffers` noted the state to
        put back after it): each kept slot gets its values from before the first
        forward: copied into the tensor it held then, if it still holds it
        (updated in place; through ``.data``: no version bump, which would fail
        autograd's check of the views of it the first forward saved), else a new
        copy (the slot was reassigned: the old tensor may have gone with an
        activation that saved it), one per tensor, so slots sharing one still do.
        Returns the bytes of those new copies."""
        fresh = {}
        with torch.no_grad():
            for _, m, name, t, _, _, value in self.entries:
                if t is not None and m._buffers.get(name) is t:
                    t.data.copy_(value)
                else:
                    m._buffers[name] = (None if value is None
                                        else fresh.setdefault(id(value), value.clone()))
        return _copy_bytes(fresh.values())
