"""Zero-copy tensors over arena buffers, and module parameters placed in arenas.

:func:`as_tensor` views a :class:`~rtmem.Buffer` as a ``torch.Tensor`` without
copying: host-addressable memory (pinned or mapped host arenas, and every arena
of the host backend) as a CPU tensor, device memory of the cuda backend as a CUDA
tensor, and mapped host memory also as a CUDA tensor over its device alias
(``device_alias=True``: the GPU reads it over PCIe, the DHA path).

Streams: rtmem orders device work on CuPy's current stream (the wait for an
in-flight prefetch, stream-ordered frees: ``rtmem/transfers.py``), torch
launches on its own current stream. :func:`as_tensor` makes torch's current
stream CuPy's while it exports a CUDA view (:func:`on_torch_stream`), so a
buffer still being prefetched is waited for on the stream torch kernels will
read it on, also under ``with torch.cuda.stream(s)``.

Lifetimes: the tensor pins the buffer (NOTE [ Pinned views ] in
``rtmem/buffer.py``). The pin is held by the object that exports the memory to
torch, which torch keeps alive as long as *any* tensor shares the storage (views,
slices, ``.data`` swaps included), so a ``buf.free()`` while tensors view it only
takes effect once the last of them is garbage collected: the arena never hands
those bytes to another allocation while a tensor can still read them.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from rtmem._deferred import run_or_defer
from rtmem.arena import is_arena
from rtmem.buffer import Buffer
from rtmem.errors import DoubleFreeError, ResidencyError

__all__ = ["as_tensor", "from_tensor", "place_parameters", "ModulePlacement",
           "on_torch_stream"]

# torch dtypes without a numpy twin are stored as same-width integer bits
_BITS = {torch.bfloat16: np.uint16, torch.float8_e4m3fn: np.uint8,
         torch.float8_e5m2: np.uint8}


# torch deprecates making tensors of these (a warning): known by name instead
_QUANTIZED = frozenset(getattr(torch, name) for name in
                       ("quint8", "qint8", "qint32", "quint4x2", "quint2x4")
                       if hasattr(torch, name))


def _cannot_hold(dtype) -> TypeError:
    return TypeError(f"rtmem buffers cannot hold {dtype} tensors (quantized, sub-byte "
                     f"and bits dtypes have no numpy layout); convert the tensor first, "
                     f"e.g. .dequantize() or .to(torch.uint8)")


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype an arena buffer uses to hold ``dtype`` (bit patterns for
    bfloat16 and float8)."""
    if dtype in _QUANTIZED:
        raise _cannot_hold(dtype)
    if dtype in _BITS:
        return np.dtype(_BITS[dtype])
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        pass
    if dtype.is_floating_point or dtype.is_complex:
        # the other float8 formats (fnuz, e8m0), packed float4, complex32: torch
        # has no numpy twin for them either (it raised "Got unsupported
        # ScalarType"), and any same-width integer holds their bits
        return np.dtype(f"u{dtype.itemsize}")
    raise _cannot_hold(dtype)


@functools.lru_cache(maxsize=None)
def _torch_shares(dtype: np.dtype) -> bool:
    """Whether torch has a dtype for numpy's ``dtype`` (not for long double,
    strings, records, datetimes or non-native byte orders)."""
    try:
        torch.from_numpy(np.empty(0, dtype))
    except (TypeError, ValueError):
        return False
    return True


def on_torch_stream(device: int | torch.device | None = None):
    """A context in which CuPy's current stream (the one rtmem orders device work
    on: waits for transfers, stream-ordered frees and reuse) is torch's current
    stream on ``device`` (default: torch's current device). Use it around rtmem
    calls whose results torch kernels consume while torch runs on a side stream.
    A no-op context when the two already agree (both on the legacy default
    stream, the usual case), and when torch has no CUDA or CuPy is not
    installed (then no stream orders rtmem's work), so one training loop runs
    on CPU and GPU.
    """
    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    from rtmem.backends.cuda import import_cupy
    try:
        cp = import_cupy()
    except ModuleNotFoundError:
        return contextlib.nullcontext()
    dev = torch.device("cuda", device) if isinstance(device, int) else device
    ptr = int(torch.cuda.current_stream(dev).cuda_stream)
    if int(cp.cuda.get_current_stream().ptr) == ptr:
        return contextlib.nullcontext()
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:
        # CuPy >= 14 deprecates ExternalStream (a warning per call) for the CUDA
        # stream protocol; the handle object carries it whatever torch's version.
        return from_external(_StreamHandle(ptr))
    index = dev.index if dev is not None and dev.index is not None else \
        torch.cuda.current_device()
    return cp.cuda.ExternalStream(ptr, index)


class _StreamHandle:
    """A raw ``cudaStream_t`` handle with the CUDA stream protocol
    (``__cuda_stream__() -> (version 0, handle)``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _cuda_export(buf: Buffer, where, device_id: int) -> torch.Tensor:
    """A CUDA tensor over ``buf``'s placement ``where`` (its CUDA array interface,
    with the in-flight wait on torch's current stream)."""
    with on_torch_stream(device_id):
        export = buf._export(where, cuda=True)
    return torch.as_tensor(export, device=f"cuda:{device_id}")


def as_tensor(buf: Buffer, *, where: str | None = None, device_alias: bool = False,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """A zero-copy ``torch.Tensor`` over ``buf`` (shape ``buf.shape``).

    Parameters
    ----------
    where:
        ``"device"`` or ``"host"`` placement (default: the primary one: device
        when the buffer has a device copy).
    device_alias:
        View a mapped host buffer as a CUDA tensor through its device pointer
        (cuda backend, ``HostArena(mapped=True)``): kernels then read host memory
        directly over PCIe.
    dtype:
        Reinterpret the bytes as this torch dtype (same item size), e.g.
        ``torch.bfloat16`` over a uint16 buffer.

    Raises :class:`~rtmem.errors.ResidencyError` when the requested placement does
    not exist, :class:`~rtmem.errors.UseAfterFreeError` for a freed buffer, and
    ``TypeError``, as for the other bad arguments (not a Buffer, a buffer dtype
    torch lacks, a quantized ``dtype``), for a ``dtype=`` whose item size is not
    the buffer's (pass ``dtype=None`` or one of that size). No view is made
    then: the buffer is as before.
    """
    if not isinstance(buf, Buffer):
        raise TypeError(f"as_tensor needs an rtmem Buffer, got {type(buf).__name__}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16), got "
                        f"{dtype!r}")
    if dtype in _QUANTIZED:
        # a quantized view came back as a tensor without its scale and zero point,
        # on which every op (dequantize() too) raised
        raise _cannot_hold(dtype)
    if not _torch_shares(buf.dtype):
        raise TypeError(f"torch has no dtype for this buffer's numpy dtype {buf.dtype}; "
                        f"view it with buf.numpy(), or allocate it with a dtype torch "
                        f"shares (uint16 holds bfloat16 bits: as_tensor(buf, "
                        f"dtype=torch.bfloat16))")
    if dtype is not None:
        _check_item_size(buf, dtype)
    if device_alias:
        try:
            p = buf._view_placement("host")
        except ResidencyError:
            p = None      # a DeviceArena's buffer: "offload it first" was no fix
        if p is None or p.arena.backend.name != "cuda" or p.slab.device_ptr is None:
            raise ResidencyError(
                "device_alias=True needs a mapped host buffer on the cuda backend "
                "(HostArena(nbytes, mapped=True) with RTMEM_BACKEND=cuda)",
                state=buf.residency, action="device alias")
        t = _cuda_export(buf, "host", p.arena.backend.device_id)
    else:
        p = buf._view_placement(where)
        if p.slab.host_array is not None:
            t = torch.from_numpy(buf.numpy(where, pin=True))
        else:
            t = _cuda_export(buf, where, p.arena.backend.device_id)
    if dtype is not None and dtype != t.dtype:
        t = t.view(dtype)
    return t


# Candidates named in the item-size error, most used first
_COMMON = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8)


def _check_item_size(buf: Buffer, dtype: torch.dtype) -> None:
    """Refuse to view ``buf`` as a ``dtype`` of another item size (bytes), naming
    the dtypes that fit. Checked before any view is made: a pinned view alive in
    the error's traceback postponed a ``free()`` of the buffer."""
    size = torch.empty(0, dtype=dtype).element_size()
    have = buf.dtype.itemsize
    if size != have:
        fits = ", ".join(str(d) for d in _COMMON
                         if torch.empty(0, dtype=d).element_size() == have)
        raise TypeError(
            f"cannot view this buffer's {buf.dtype} memory ({have} bytes per item) as "
            f"{dtype} ({size} bytes): the item sizes differ; pass dtype=None or one of "
            f"{have} bytes ({fits}), or allocate the buffer with a dtype of {size} bytes")


# id(parameter) -> weak reference to the ModulePlacement that put it in an arena.
# Keyed by id, not by a weak reference to the parameter (a WeakIdKeyDictionary):
# torch.utils.swap_tensors refuses a tensor that has weak references, so
# module.half() / .to() under torch.__future__.set_swap_module_params_on_conversion
# (True) failed on a placed module with "Couldn't swap Linear.weight". An id stays
# its parameter's while the placement lives (its weights hold the parameter); the
# entries go with release() or with the placement (_forget).
_placed: dict = {}


def _forget(ids, ref) -> None:
    """Drop the ``_placed`` entries of the parameter ids ``ids`` still pointing
    to the placement ``ref`` (a weak reference; a later placement's stay)."""
    for i in ids:
        if _placed.get(i) is ref:
            del _placed[i]


def _check_arena(arena, name: str) -> None:
    if not is_arena(arena):
        raise TypeError(f"{name} must be an rtmem.DeviceArena or HostArena, got {arena!r}")


def from_tensor(tensor: torch.Tensor, arena, *, kind: str = "activation") -> Buffer:
    """Copy ``tensor`` into a new buffer of ``arena`` (same shape; bfloat16 and float8
    held as integer bits) and return the buffer.

    The buffer holds the tensor's elements in row-major order, whatever its
    strides (transposed, channels_last, sliced with steps, expanded): a buffer
    has a shape and no strides, so ``as_tensor(buf)`` is a contiguous tensor
    equal to ``tensor``, as ``tensor.contiguous()`` is. To keep a permuted
    layout, copy ``tensor.permute(order)`` (the dimensions outermost first in
    memory) and view the result with ``.as_strided(tensor.shape,
    tensor.stride())``, as :func:`place_parameters` does for channels_last
    weights."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"from_tensor copies a torch.Tensor, got {type(tensor).__name__}; "
                        f"convert it with torch.as_tensor first")
    _check_arena(arena, "arena")
    if tensor.layout != torch.strided:
        raise TypeError(f"from_tensor copies dense tensors; got a {tensor.layout} one: "
                        f"convert it with .to_dense() first")
    if tensor.is_nested:
        # a nested tensor reports a strided layout, but has no single shape
        # (tensor.shape raised torch's "Internal error ... Please file an issue")
        raise TypeError("from_tensor copies dense tensors; got a nested one: copy each "
                        "component (tensor.unbind()) or pad it first "
                        "(tensor.to_padded_tensor(0))")
    if tensor.is_meta:
        raise TypeError("from_tensor copies data, and a meta tensor has none: "
                        "materialize it first (e.g. module.to_empty(device=...) and "
                        "initialize the parameters)")
    tensor = tensor.detach()
    buf = arena.alloc(shape=tuple(tensor.shape), dtype=numpy_dtype(tensor.dtype), kind=kind)
    try:
        as_tensor(buf, dtype=tensor.dtype).copy_(tensor)
    except BaseException:
        buf.free()   # no leak when the copy fails (e.g. a CPU tensor into CUDA memory)
        raise
    return buf


@dataclass
class ModulePlacement:
    """Where :func:`place_parameters` put a module's parameters and gradients.

    ``weights`` / ``grads`` map each parameter to its buffer. :meth:`release`
    moves the parameters back to ordinary torch memory and frees the buffers.
    A placement dropped without :meth:`release` frees its buffers when it is
    garbage collected; their bytes come back once the parameters stop viewing
    them (e.g. a new placement, or the module itself collected).
    """

    weights: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    # frees the buffers if the placement is dropped without release() (see
    # place_parameters); detached by release()
    _finalizer: object = field(default=None, init=False, repr=False, compare=False)
    # the weak reference to it that _placed holds for its parameters
    _ref: object = field(default=None, init=False, repr=False, compare=False)
    # handles of the load_state_dict pre-hooks refusing assign=True (_refuse_assign)
    _hooks: list = field(default_factory=list, init=False, repr=False, compare=False)

    def release(self) -> None:
        """Copy every parameter (and gradient) out of the arenas and free the buffers.

        Releasing again does nothing, and a buffer already freed by hand is
        skipped (its bytes come back once the parameter no longer views it)."""
        # Copies first: if one fails (out of memory), nothing has moved yet.
        copies = [(p, p.data.clone(),
                   p.grad.clone() if p in self.grads and p.grad is not None else None)
                  for p in self.weights]
        for p, data, grad in copies:
            p.data = data
            if grad is not None:
                p.grad = grad
        bufs = [*self.weights.values(), *self.grads.values()]
        if self._finalizer is not None:
            self._finalizer.detach()
        _remove_hooks(self._hooks)
        _forget([id(p) for p in self.weights], self._ref)   # none left once released
        self.weights.clear()
        self.grads.clear()
        _free_all(bufs)


def _free_all(bufs) -> None:
    """Free a placement's buffers, skipping those freed by hand while placed
    (given back already, once the parameter stopped viewing them): the others
    must still go."""
    for buf in bufs:
        try:
            buf.free()
        except DoubleFreeError:
            pass


def _remove_hooks(handles) -> None:
    """Remove a placement's load_state_dict pre-hooks (weakly held: a module
    already collected is skipped)."""
    for handle in handles:
        handle.remove()
    handles.clear()


def _refuse_assign(module, state_dict, prefix, local_metadata, *_) -> None:
    """``load_state_dict`` pre-hook of each submodule of a placed module: refuse
    ``assign=True`` while a parameter under ``module`` is placed.

    Plain loading copies into the parameters in place, so they keep viewing
    their buffers. ``assign=True`` replaced them with the state dict's tensors
    (or, under ``torch.__future__.set_swap_module_params_on_conversion(True)``,
    swapped those in): the module silently left the arena while its buffers
    stayed reserved and went stale. Run on the topmost module loaded before
    any of its parameters change, so the refusal leaves the module as it was.
    """
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    placed = [name for name, p in module.named_parameters() if _placement_of(p) is not None]
    if placed:
        raise ResidencyError(
            f"load_state_dict(assign=True) would replace parameter {prefix + placed[0]!r}"
            f"{f' (and {len(placed) - 1} more)' if len(placed) > 1 else ''} placed in an "
            f"arena by place_parameters with the "
            f"state dict's tensors, outside the arena; load without assign=True (it "
            f"copies the values into the arena in place), or call release() on the "
            f"ModulePlacement first", state="placed", action="load_state_dict(assign=True)")


def _free_dropped(bufs, ids, ref, hooks=()) -> None:
    """Free the buffers of a placement garbage-collected without ``release()``.

    The parameters then count as placed no more (:func:`_placement_of`), so the
    buffers must not stay allocated: a second placement doubled the arena use,
    and nothing could ever free the first one's buffers. Each free waits for the
    parameter tensors still viewing its bytes (NOTE [ Pinned views ] in
    ``rtmem/buffer.py``), so the module keeps working meanwhile. May run inside
    a garbage collection: NOTE [ Frees from finalizers ] in rtmem/_deferred.py.
    ``ids`` and ``ref``: the parameters' entries to :func:`_forget`; ``hooks``:
    the placement's load_state_dict pre-hook handles.
    """
    _remove_hooks(list(hooks))
    _forget(ids, ref)
    run_or_defer(lambda: _free_all(bufs))


def _placement_of(p):
    """The live :class:`ModulePlacement` whose arena holds parameter ``p``, or None."""
    ref = _placed.get(id(p))
    placement = ref() if ref is not None else None
    return placement if placement is not None and p in placement.weights else None


def _memory_order(t: torch.Tensor) -> list | None:
    """The dimensions of ``t`` from outermost to innermost in memory when ``t``
    is dense and non-overlapping but not row-major (a channels_last weight, a
    transposed one), else None (row-major, or not dense: placed row-major)."""
    if t.is_contiguous():
        return None
    # preserve_format keeps the strides of exactly the dense, non-overlapping
    # layouts (torch's own test for them)
    if torch.empty_like(t, device="meta").stride() != t.stride():
        return None
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))


def _view_like(buf: Buffer, like: torch.Tensor, order, **view) -> torch.Tensor:
    """A tensor over ``buf`` with the shape and strides of ``like``: ``buf``
    holds its elements in memory order, shaped ``like.permute(order)``."""
    t = as_tensor(buf, dtype=like.dtype, **view)
    return t if order is None else t.as_strided(like.shape, like.stride())


def place_parameters(module: torch.nn.Module, arena, *, grads: bool = True,
                     grad_arena=None, device_alias: bool = False) -> ModulePlacement:
    """Move ``module``'s parameters (and gradient buffers) into arena memory.

    Each parameter's data is copied into a ``kind="weight"`` buffer of ``arena``
    and the parameter then views it (``p.data = as_tensor(buf)``), so the module
    works unchanged. With ``grads=True`` a ``kind="gradient"`` buffer (in
    ``grad_arena``, default ``arena``) becomes ``p.grad``, holding the gradient
    ``p`` had (zeros if none); autograd accumulates into it in place, so clear
    gradients with ``zero_grad(set_to_none=False)`` to keep them there. Every
    trainable parameter thus has a gradient: a torch optimizer steps one that no
    backward reached (with a zero gradient: AdamW's decay and Adam's moments still
    move it, where plain torch skips ``p.grad is None``); use ``grads=False`` to
    keep that behaviour, and with :class:`~rtmem.torch.OffloadedAdam`, which keeps
    the gradients in its own pinned buffer (placed gradients are refused while
    one is open on the parameters).

    ``device_alias=True`` places weights in a mapped host arena viewed from the
    GPU (the DHA layers of MemFerry). Gradients live where the parameter does
    (torch requires it): in a DeviceArena, or in a mapped HostArena viewed from the
    GPU when the parameter is a CUDA tensor, so each of MemFerry's modes can be
    placed: weights and gradients mapped ("dha_go"), mapped weights with
    ``grad_arena`` a DeviceArena ("dha"), device weights with ``grad_arena`` a
    mapped HostArena (GO-MemFerry, "gpu_go"). Returns a :class:`ModulePlacement`.
    All or nothing: if a buffer cannot be made, every parameter keeps its own
    tensors.

    A parameter in another dense layout than row-major (a channels_last
    convolution weight, a transposed one) keeps its strides, and so does its
    gradient: its buffers hold the elements in memory order, shaped as they are
    laid out (``(N, H, W, C)`` for a channels_last ``(N, C, H, W)`` weight), so
    ``buf.numpy()`` reads them in that order. Other layouts (overlapping,
    sliced) are placed row-major.

    ``module.load_state_dict(sd)`` copies into the placed parameters in place;
    ``load_state_dict(sd, assign=True)`` would replace them with tensors outside
    the arena, and is refused (:class:`~rtmem.errors.ResidencyError`, the module
    unchanged) until :meth:`ModulePlacement.release`. A load of a module that
    contains ``module`` is refused when torch reaches ``module``: the parameters
    loaded before it (in ``named_parameters()`` order) have been replaced by
    then (torch has no load hook above ``module`` for the refusal to run in).

    Convert the module first (``module.half()``, ``.to(dtype)``, ``.to(device)``):
    a conversion after placing gives each parameter new data outside the arena,
    whose bytes stay reserved until :meth:`ModulePlacement.release` (also with
    ``torch.__future__.set_swap_module_params_on_conversion(True)``); to convert
    a placed module, release it, convert, and place it again.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"place_parameters moves a torch.nn.Module's parameters, got "
                        f"{type(module).__name__}")
    _check_arena(arena, "arena")
    if grad_arena is not None:
        _check_arena(grad_arena, "grad_arena")
    grads_in = grad_arena or arena
    if device_alias and not (arena.location == "host" and getattr(arena, "mapped", False)):
        # refused before anything moves, by its real cause (the first weight
        # buffer was made, then refused as "no host copy; prefetch or offload it")
        raise ValueError(f"device_alias=True runs the GPU on weights in mapped host "
                         f"memory: give a HostArena(nbytes, mapped=True), got {arena!r}")
    # Gradients of CUDA parameters must be CUDA tensors: device memory, or mapped
    # host memory through its device alias. Decided once, before anything moves.
    cuda_params = device_alias or (arena.location == "device"
                                   and arena.backend.name == "cuda")
    grad_alias = cuda_params and grads_in.location == "host"
    if grads and grad_alias and not getattr(grads_in, "mapped", False):
        raise ValueError("gradients of parameters the GPU computes with must be in a "
                         "DeviceArena or a HostArena(mapped=True) the GPU can write; got "
                         f"{grads_in!r} as the gradient arena")
    from .offload import _held_by_open_optimizer   # offload imports this module
    for i, p in enumerate(dict.fromkeys(module.parameters())):
        if torch.nn.parameter.is_lazy(p):
            # its data is an empty placeholder: grads=False placed that (forward
            # then materialized the weight outside the arena), grads=True failed
            # half-way on torch's "Can't access the shape" about load_state_dict
            raise ValueError(f"parameter {i} is not initialized yet (a lazy module such "
                             f"as nn.LazyLinear): run one forward pass with a sample "
                             f"batch first, then place the module")
        if _placement_of(p) is not None:
            # placed, or placed and then converted (module.half(), .to(dtype)
            # give the same Parameter new data, out of the arena): both release
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is already in an "
                             f"arena, or was and has been converted out of it since "
                             f"(module.half(), .to()); call release() on its "
                             f"ModulePlacement first")
        if grads and p.requires_grad and _held_by_open_optimizer(p):
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) has its gradients "
                             f"taken to the host by an open rtmem.torch.OffloadedAdam, "
                             f"which would leave a gradient buffer here unused; pass "
                             f"grads=False")
    placement = ModulePlacement()
    before = {}     # parameter -> (its data, its grad) before placement
    g = None        # the last gradient view (dropped on failure)
    try:
        for p in dict.fromkeys(module.parameters()):   # shared parameters once
            before[p] = (p.data, p.grad)
            # A channels_last (or otherwise permuted) weight keeps its strides:
            # made row-major, a convolution chose other kernels and
            # is_contiguous(memory_format=torch.channels_last) turned False. Its
            # buffer holds the same bytes, shaped in memory order.
            order = _memory_order(p.data)
            data = p.data if order is None else p.data.permute(order)
            buf = from_tensor(data, arena, kind="weight")
            placement.weights[p] = buf
            p.data = _view_like(buf, p.data, order, device_alias=device_alias)
            if grads and p.requires_grad:
                # a frozen parameter keeps .grad None: optimizers skip only those
                # (a zero gradient let weight decay and momentum move it). Strided
                # as the parameter, as autograd lays out the gradients it makes.
                gbuf = grads_in.alloc(
                    shape=tuple(data.shape), dtype=numpy_dtype(p.dtype), kind="gradient")
                placement.grads[p] = gbuf
                g = _view_like(gbuf, p.data, order, device_alias=grad_alias)
                old = before[p][1]
                if old is None:
                    g.zero_()
                elif old.layout != torch.strided:
                    # a sparse gradient (nn.Embedding(sparse=True)), which copy_
                    # refuses; autograd adds the next ones into the dense buffer
                    g.zero_().add_(old)
                else:
                    g.copy_(old)
                p.grad = g
    except BaseException:
        for p, (data, grad) in before.items():   # the module is exactly as it was
            p.data = data
            p.grad = grad
        # The last gradient view would pin its buffer for as long as the raised
        # exception's traceback keeps this frame (the whole except clause of the
        # caller): its bytes stayed allocated while the caller handled the error.
        del g
        for buf in (*placement.weights.values(), *placement.grads.values()):
            buf.free()
        raise
    ref = weakref.ref(placement)
    for p in placement.weights:
        _placed[id(p)] = ref
    # On every submodule: load_state_dict may be called on any of them, and the
    # topmost one loaded refuses before anything under it changes.
    placement._hooks = [m.register_load_state_dict_pre_hook(_refuse_assign)
                        for m in module.modules()]
    finalizer = weakref.finalize(
        placement, _free_dropped, [*placement.weights.values(), *placement.grads.values()],
        [id(p) for p in placement.weights], ref, placement._hooks)
    finalizer.atexit = False     # the process gives everything back at exit
    placement._finalizer, placement._ref = finalizer, ref
    return placement
