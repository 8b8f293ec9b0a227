"""CPU Adam / AdamW optimizers over the fused kernel of :mod:`rtmem.kernels.adam`.

Two front ends share one step routine:

- :class:`CPUAdam` / :class:`CPUAdamW` are ``torch.optim.Optimizer`` subclasses
  for fp32 CPU parameters (param groups, lr schedulers, ``state_dict`` /
  ``load_state_dict``, ``zero_grad``). Parameters are updated in place through
  zero-copy numpy views; the state tensors (``exp_avg``, ``exp_avg_sq``,
  ``max_exp_avg_sq``, ``step``) are laid out as ``torch.optim.Adam``'s, so a
  state dict loads into either optimizer; with ``state_arena=`` the moments
  are zero-copy tensors over a HostArena's buffers (NOTE [ Optimizer state in
  an arena ] in rtmem/_optim_arena.py).
- :class:`NumpyAdam` / :class:`NumpyAdamW` do the same over plain numpy arrays and
  need no torch. torch is imported only when ``CPUAdam``/``CPUAdamW`` is first
  accessed: they are defined in :mod:`rtmem._optim_torch`, which this module
  imports then.

The checks of a loaded state dict (its layout, step counts, moments, skip
counters, and the load hooks) that both front ends and
:class:`rtmem.torch.OffloadedAdam` share are in :mod:`rtmem._optim_state_dict`.

NOTE [ Skipped steps ]
    With ``step(..., grad_scale=S)`` the gradients are unscaled inside the kernel
    (multiplied by ``float32(1/S)``, as ``torch.amp.GradScaler.unscale_`` does,
    bit for bit), and the step is skipped if any unscaled gradient of
    any parameter is inf/NaN: then no parameter, moment or step count changes
    (bit-identical), ``last_step_skipped`` is True and ``skipped_steps`` grows by
    one. All gradients are validated and checked before the first parameter is
    written, so an error or an overflow never leaves a half-applied step.
    :class:`rtmem.LossScaler` chooses S step by step as ``torch.amp.GradScaler``
    does (NOTE [ Loss scale ] in :mod:`rtmem.loss_scale`).
"""

from __future__ import annotations

import bisect
import re

import numpy as np

# The checks of a loaded state dict are in their own module (NumpyAdam's
# load_state_dict uses these; OffloadedAdam and CPUAdam import theirs from it).
from ._optim_state_dict import _MOMENT_DTYPE_HINT, _STATE_KEYS, _check_moment, _saved_skips, \
    _saved_step
from ._optional import installed as _installed
from .arena import is_arena
from .buffer import Buffer
from .errors import OptimizerError, ResidencyError
from .kernels._adam_checks import _check_state
from .kernels._adam_many import ManyUpdates
from .kernels._launch import check_flag
from .kernels.adam import _OPERANDS, _check_finite_switch, _data_address, adam_coefficients, \
    prepare_update, threads

_TORCH_CLASSES = ("CPUAdam", "CPUAdamW")
# Without torch the torch classes stay out of __all__ (and dir()), so that
# `from rtmem.optim import *` and help(rtmem.optim) work on a core install (they
# resolved every listed name and raised CPUAdam's ImportError); rtmem.optim.CPUAdam
# still raises it, naming the extra.
__all__ = [*(_TORCH_CLASSES if _installed("torch") else ()), "NumpyAdam", "NumpyAdamW"]
# The kernel's argument names -> NumpyAdam.step's keywords, for error reports.
_NUMPY_ARGUMENTS = {"grad": "grads", "out": "copies", "out_format": "copy_format"}


# --------------------------------------------------------------------------- shared

def _check_hyper(lr, betas, eps, weight_decay):
    """Validate one set of hyperparameters; raise OptimizerError naming the bad one."""
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise OptimizerError(f"betas={betas!r} must be a pair (beta1, beta2), each in "
                             f"[0, 1).", argument="betas") from None
    # adam_coefficients owns the range checks; step=1 is just a valid placeholder.
    # lr goes in as given: its check converts it (a tensor lr too), where float(lr)
    # here raised a bare TypeError/ValueError for lr=None or "1e-3x".
    adam_coefficients(lr=lr, step=1, beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=weight_decay)


# Adam's switches kept as bools in NumpyAdam.hyper and CPUAdam's groups.
_SWITCH_KEYS = ("amsgrad", "maximize", "bias_correction")


def _check_switch_flags(where: str, values: dict) -> None:
    """OptimizerError unless each of :data:`_SWITCH_KEYS` that ``values`` (keyword
    arguments, a group, a saved ``hyper``) holds is a bool (np.bool_ too), as
    :func:`rtmem.kernels.adam_update` takes them; ``where`` ("" for the
    constructor's keywords) names the group. They were taken by truthiness:
    ``maximize="no"`` (or "False" from a config file) ascended, ``amsgrad="no"``
    ran AMSGrad, silently."""
    for name in _SWITCH_KEYS:
        if name in values:
            try:
                check_flag(values[name], name, OptimizerError)
            except OptimizerError as exc:
                raise OptimizerError(f"{where}: {exc}" if where else str(exc),
                                     argument=name) from None


def _check_group_hyper(where: str, group: dict) -> None:
    """:func:`_check_hyper` of a param group's values, its error prefixed by
    ``where`` (the group)."""
    try:
        _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    except OptimizerError as exc:
        raise OptimizerError(f"{where}: {exc}", argument=exc.argument) from None


def _host_view(x, name):
    """``x`` itself, or for an rtmem :class:`~rtmem.Buffer` a zero-copy numpy view
    of its host-addressable bytes that pins the buffer while the view lives
    (NOTE [ Pinned views ] in rtmem/buffer.py)."""
    if not isinstance(x, Buffer):
        return x
    try:
        return x.numpy("host" if x.placement("host") is not None else None, pin=True)
    except ResidencyError as exc:
        raise OptimizerError(
            f"{name} is an rtmem Buffer the CPU cannot address ({exc}); the CPU "
            f"optimizer needs host memory: allocate it in a HostArena, or offload "
            f"it first.", argument=name) from exc


def _check_state_arena(arena) -> None:
    """OptimizerError unless ``arena`` (an optimizer's ``state_arena=``) is None
    or a :class:`~rtmem.HostArena` (pinned or mapped): the CPU kernel reads and
    writes the state through host views. A DeviceArena is refused on every
    backend, so code tried on the host backend (where its slabs happen to be
    host memory) does not break on a GPU."""
    if arena is None or is_arena(arena, "host"):
        return
    if is_arena(arena):
        raise OptimizerError(
            f"state_arena is a {type(arena).__name__} ({arena.location} memory), which "
            f"the CPU optimizer's kernel cannot address; pass a rtmem.HostArena (e.g. "
            f"rtmem.HostArena('1GiB')), or None for ordinary host memory",
            argument="state_arena")
    raise OptimizerError(
        f"state_arena is a {type(arena).__name__}, not an rtmem arena; pass a "
        f"rtmem.HostArena, or None for ordinary host memory", argument="state_arena")


def _zeros_state(shape, arena):
    """A zeroed float32 state array of ``shape``: numpy memory, or a buffer of the
    host ``arena`` whose release waits for the returned (pinning) view to die."""
    if arena is None:
        return np.zeros(shape, dtype=np.float32)
    buf = arena.alloc(shape=tuple(shape), dtype=np.float32, kind="optimizer-state")
    try:
        view = _host_view(buf, "state")
    finally:
        buf.free()          # deferred by the view's pin: freed with the optimizer
    view[...] = 0.0
    return view


def _zeros_states(shapes, arena) -> list:
    """Zeroed float32 state arrays of ``shapes`` (:func:`_zeros_state`), all or
    none: when one allocation fails (OutOfMemoryError) the arrays made so far
    are dropped before the error propagates, so their arena buffers go back at
    once, not when the traceback (whose frames would hold them) dies."""
    made = []
    try:
        for shape in shapes:
            made.append(_zeros_state(tuple(shape), arena))
    except BaseException:
        made.clear()
        raise
    return made


def _check_open(opt, what: str) -> None:
    """OptimizerError if ``opt`` (CPUAdam, NumpyAdam) was closed: ``what`` is
    the refused call ("step", "save a state dict", ...)."""
    if opt._closed:
        raise OptimizerError(
            f"cannot {what}: this {type(opt).__name__} was closed (close() dropped "
            f"its state); make a new one, and load_state_dict a state dict saved "
            f"before close() into it to resume", argument="self")


def _named(where, exc, arguments):
    """``exc`` (an OptimizerError from the kernel's checks, which know an array
    only as "grad" or "out") again, prefixed with the parameter it is about and
    with its argument renamed to the caller's keyword (``arguments``), in the
    text too ("out has shape (8,)" reached a caller who passed ``copies=``)."""
    text = str(exc)
    # only the copies' names differ in kind ("grad" is the parameter's gradient
    # either way, "param" the parameter)
    for kernel_name in ("out", "out_format"):
        if kernel_name in arguments:
            text = re.sub(rf"(?<![\w.]){kernel_name}(?= has | is |=)",
                          arguments[kernel_name], text)
    return OptimizerError(f"{where}: {text}",
                          argument=arguments.get(exc.argument, exc.argument))


def _span(a, *tag) -> tuple:
    """``(first address, end address, *tag)`` of C-contiguous array ``a``."""
    lo = _data_address(a)
    return (lo, lo + a.nbytes, *tag)


def _first_overlap(spans):
    """Sort ``spans`` (:func:`_span`) by address and return the first pair of
    neighbours that overlap, or None: sorted by start, any overlapping pair
    implies an overlapping pair of neighbours, O(n log n)."""
    spans.sort(key=lambda span: span[0])
    return next(((a, b) for a, b in zip(spans, spans[1:]) if b[0] < a[1]), None)


def _check_disjoint(params) -> None:
    """Refuse parameters whose memory overlaps (the same array twice, or views of
    one array): each would be updated once per occurrence per step."""
    pair = _first_overlap([_span(p, i) for i, p in enumerate(params) if p.nbytes])
    if pair is not None:
        i, j = sorted((pair[0][2], pair[1][2]))
        raise OptimizerError(
            f"params[{i}] and params[{j}] overlap in memory (the same array twice, "
            f"or views of one array); each would be updated once per occurrence "
            f"every step. Pass each parameter once, with its own memory.",
            argument="params")


def _check_step_disjoint(named, arguments) -> None:
    """Refuse a step in which an array that one parameter's update writes (its
    param, moments or copy) shares memory with an array of another parameter's
    update. ``named`` holds ``(where, update)`` per parameter, ``arguments`` maps
    the kernel's array names to the caller's keywords (for the error's argument).

    prepare_update refuses overlaps within one update only; across updates, the
    updates run one after the other, so a copy buffer that is another parameter's
    gradient (or a view of its master) silently changed that parameter's step.
    The written spans must be disjoint (:func:`_first_overlap`); then each read
    span is bisected into them, O(n log n) in all.
    """
    writes, reads = [], []
    for where, u in named:
        # the update's own spans: its arrays' addresses are looked up once a step
        for name, span in zip(_OPERANDS, u._spans()):
            if span is not None:
                (reads if name == "grad" else writes).append((*span, where, name))
    pair = _first_overlap(writes)
    if pair is None:
        starts = [span[0] for span in writes]
        for r in reads:
            j = bisect.bisect_left(starts, r[1]) - 1
            if j >= 0 and writes[j][1] > r[0]:
                pair = (writes[j], r)
                break
    if pair is not None:
        (_, _, wa, na), (_, _, wb, nb) = pair
        keyword = next((arguments[n] for n in (nb, na) if n in arguments), "params")
        raise OptimizerError(
            f"{wa} {na} and {wb} {nb} overlap in memory; one parameter's update would "
            f"change an array of another's. Give each parameter its own gradient and "
            f"copy buffers.", argument=keyword)


def _check_num_threads(num_threads):
    with threads(num_threads):  # validates (and restores the count at once)
        pass
    return num_threads


def _run_step(opt, items, *, grad_scale, check_finite, count_steps=None) -> bool:
    """Apply one Adam step to every item, or to none (NOTE [ Skipped steps ]).

    ``items`` holds ``(update, coefficients, state)``: a validated
    :class:`~rtmem.kernels.adam.PreparedUpdate`, its float32 kernel coefficients
    and the parameter's state dict, whose ``"step"`` advances on success (by
    ``count_steps()`` if given, else ``+= 1`` each). The
    optimizer's ``skipped_steps`` / ``last_step_skipped`` record a skip. Returns
    True if the step was applied.
    """
    if check_finite is None:
        check_finite = grad_scale is not None
    applied = True
    # The unchecked halves: c comes from adam_coefficients and the range is the
    # whole tensor, so re-checking both per tensor per step would only cost time.
    # NOTE [ Many tensors, one launch ]: a call per kind of tensor, not per tensor
    batch = ManyUpdates([(update, c) for update, c, _ in items])
    with threads(opt.num_threads):
        if check_finite:
            applied = not batch.count_nonfinite()
        if applied:
            batch.apply()
    if applied and count_steps is not None:
        count_steps()
    elif applied:
        for _, _, st in items:
            st["step"] += 1
    else:
        opt.skipped_steps += 1
    opt.last_step_skipped = not applied
    return applied


def _coefficients(group, step, decoupled, grad_scale):
    beta1, beta2 = group["betas"]
    return adam_coefficients(lr=float(group["lr"]), step=step, beta1=beta1, beta2=beta2,
                             eps=group["eps"], weight_decay=group["weight_decay"],
                             decoupled_weight_decay=decoupled, grad_scale=grad_scale,
                             maximize=group.get("maximize", False),
                             bias_correction=group.get("bias_correction", True))


class _StepCoefficients:
    """:func:`_coefficients` of one group within one ``step()`` call, computed
    once per distinct step count (usually one for the whole group).

    The vector depends only on the group's hyperparameters, the 1-based step,
    the weight-decay mode and the loss scale, none of which change during a
    call; computing it per tensor (range checks, an ``np.errstate``) cost about
    as much as updating a 3072-element bias. The kernels only read it, so the
    tensors of a group share one array.
    """

    __slots__ = ("_group", "_decoupled", "_grad_scale", "_by_step")

    def __init__(self, group, decoupled, grad_scale):
        self._group, self._decoupled, self._grad_scale = group, decoupled, grad_scale
        self._by_step = {}

    def __call__(self, step):
        c = self._by_step.get(step)
        if c is None:
            c = self._by_step[step] = _coefficients(self._group, step, self._decoupled,
                                                    self._grad_scale)
        return c


# --------------------------------------------------------------------------- numpy front end

def _hyper_dict(lr, betas, eps, weight_decay, amsgrad, maximize, bias_correction) -> dict:
    """The hyperparameters as :attr:`NumpyAdam.hyper` holds them (checked before):
    floats, a pair of floats, bools."""
    return dict(lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(eps),
                weight_decay=float(weight_decay), amsgrad=bool(amsgrad),
                maximize=bool(maximize), bias_correction=bool(bias_correction))


class NumpyAdam:
    """Adam over numpy float32 arrays (no torch needed), with the fused CPU kernel.

    Parameters
    ----------
    params:
        Iterable of C-contiguous, writeable float32 numpy arrays, or rtmem
        Buffers in host memory (a :class:`~rtmem.HostArena`; any arena on the
        host backend), updated in place, no two sharing memory (the same array
        twice or overlapping views are refused: each occurrence would be
        updated). The optimizer keeps zero-copy views that pin the buffers: a
        buffer freed meanwhile is released when the optimizer is dropped.
    lr:
        Learning rate, >= 0.
    betas:
        ``(beta1, beta2)``, each in [0, 1).
    eps:
        Denominator term, > 0.
    weight_decay:
        >= 0; an L2 term added to the gradient (``NumpyAdamW``: decoupled decay).
    amsgrad:
        True: keep ``max_exp_avg_sq`` and normalise by it (AMSGrad).
    maximize, bias_correction:
        As in :func:`rtmem.kernels.adam_update` (bools, as every switch here:
        another value raises OptimizerError).
    num_threads:
        Kernel threads per step (1..numba.config.NUMBA_NUM_THREADS), or None for
        ``numba.get_num_threads()``.

    state_arena:
        A :class:`~rtmem.HostArena` for the moments (``kind="optimizer-state"``
        buffers, 4 bytes per parameter element per moment, plus up to one
        alignment each, made in the constructor, all of them or none: an arena
        too small raises OutOfMemoryError and holds none; released when the
        optimizer is closed or dropped), or None for numpy memory. Anything else (a
        DeviceArena too, whose memory the kernel cannot address on a GPU) is
        refused with an OptimizerError.

    State lives in ``self.state[i]`` (float32 arrays, 8 bytes per parameter, 12
    with AMSGrad) next to ``self.params[i]``. :meth:`close` drops it.
    """

    decoupled_weight_decay = False
    # a class default, so that an optimizer pickled before close() existed loads open
    _closed = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, bias_correction=True, num_threads=None,
                 state_arena=None):
        _check_hyper(lr, betas, eps, weight_decay)
        _check_switch_flags("", dict(amsgrad=amsgrad, maximize=maximize,
                                     bias_correction=bias_correction))
        if isinstance(params, (np.ndarray, Buffer)):
            raise OptimizerError("params must be a list of arrays, got a single "
                                 f"{type(params).__name__}; pass [params]",
                                 argument="params")
        _check_state_arena(state_arena)
        self.params = [_host_view(p, f"params[{i}]") for i, p in enumerate(params)]
        if not self.params:
            raise OptimizerError("params is empty; pass at least one float32 array.",
                                 argument="params")
        self.hyper = _hyper_dict(lr, betas, eps, weight_decay, amsgrad, maximize,
                                 bias_correction)
        self.num_threads = _check_num_threads(num_threads)
        self.state = []
        for i, p in enumerate(self.params):
            # Refuse a bad parameter now, not at the first step: the check that
            # prepare_update will make of it each step.
            try:
                _check_state("param", p)
            except OptimizerError as exc:
                raise _named(f"params[{i}]", exc, {"param": "params"}) from None
        _check_disjoint(self.params)
        keys = _STATE_KEYS if amsgrad else _STATE_KEYS[:2]
        # every moment before any is installed: an arena too small raises with
        # none of them held (NOTE [ Optimizer state in an arena ], Rule 1)
        moments = iter(_zeros_states([p.shape for p in self.params for _ in keys],
                                     state_arena))
        for _ in self.params:
            st = {"step": 0}
            st.update((key, next(moments)) for key in keys)
            self.state.append(st)
        self.last_step_skipped = False
        self.skipped_steps = 0

    def step(self, grads, *, grad_scale=None, check_finite=None, grad_format=None,
             copies=None, copy_format=None) -> bool:
        """Take one step; return True if applied, False if skipped (overflow).

        ``grads`` is a sequence aligned with ``params`` (float32, float16, or
        uint16 bits with ``grad_format``); a None entry leaves that parameter
        alone. ``grad_scale`` is the loss scale the gradients carry (divided out
        in the kernel); ``check_finite`` (True, False, or None: ``grad_scale is
        not None``) checks them first.
        ``copies`` optionally gives, per parameter, an array (float32, float16,
        or uint16 with ``copy_format``) that receives the updated parameter in
        the same pass (a float16 copy is +-inf where the parameter exceeds fp16's
        range, see :func:`rtmem.kernels.adam_update`). See NOTE [ Skipped steps ].
        """
        _check_open(self, "step")
        check_finite = _check_finite_switch(check_finite)
        grads = list(grads)
        if len(grads) != len(self.params):
            raise OptimizerError(f"got {len(grads)} gradients for {len(self.params)} "
                                 f"params; pass one per param (None to skip one).",
                                 argument="grads")
        copies = [None] * len(grads) if copies is None else list(copies)
        if len(copies) != len(self.params):
            raise OptimizerError(f"got {len(copies)} copies for {len(self.params)} params.",
                                 argument="copies")
        _check_hyper(self.hyper["lr"], self.hyper["betas"], self.hyper["eps"],
                     self.hyper["weight_decay"])
        items, named = [], []
        coefficients = _StepCoefficients(self.hyper, self.decoupled_weight_decay, grad_scale)
        for i, (p, g, out, st) in enumerate(zip(self.params, grads, copies, self.state)):
            if g is None:
                continue
            g, out = _host_view(g, f"grads[{i}]"), _host_view(out, f"copies[{i}]")
            try:
                update = prepare_update(p, g, st["exp_avg"], st["exp_avg_sq"],
                                        max_exp_avg_sq=st.get("max_exp_avg_sq"),
                                        grad_format=grad_format, out=out,
                                        out_format=copy_format)
            except OptimizerError as exc:
                raise _named(f"param {i}", exc, _NUMPY_ARGUMENTS) from None
            c = coefficients(st["step"] + 1)
            items.append((update, c, st))
            named.append((f"param {i}", update))
        _check_step_disjoint(named, _NUMPY_ARGUMENTS)
        return _run_step(self, items, grad_scale=grad_scale, check_finite=check_finite)

    def state_dict(self) -> dict:
        """A deep copy of the hyperparameters and per-parameter state (arrays
        copied), the ``skipped_steps`` / ``last_step_skipped`` counters, and
        ``decoupled_weight_decay`` (True for :class:`NumpyAdamW`)."""
        _check_open(self, "save a state dict")
        return {"hyper": dict(self.hyper),
                "state": [{k: (v.copy() if isinstance(v, np.ndarray) else v)
                           for k, v in st.items()} for st in self.state],
                "skipped_steps": self.skipped_steps,
                "last_step_skipped": self.last_step_skipped,
                "decoupled_weight_decay": self.decoupled_weight_decay}

    def load_state_dict(self, state_dict) -> None:
        """Restore :meth:`state_dict` output, copying into the existing state arrays
        (their memory stays where it was allocated). ``hyper`` must hold every
        hyperparameter, with this optimizer's ``amsgrad``; each ``step`` must be an
        integer >= 0, each moment real floating point of any precision (an
        integer, bool or complex one is refused, as by CPUAdam and
        OffloadedAdam) and each second moment (``exp_avg_sq``, ``max_exp_avg_sq``)
        >= 0 (else the next step made the parameter NaN, silently); inf/NaN
        moments, which a step on non-finite gradients writes, load as they are.
        The skip counters are restored (0 and False from a dict saved without
        them). A dict of the other class (``decoupled_weight_decay``: NumpyAdamW's
        in NumpyAdam, or the reverse) is refused: its weight decay would run as
        the other algorithm (a dict saved without the key, by an older rtmem,
        loads as before). A refused dict leaves the optimizer as it was."""
        _check_open(self, "load a state dict")
        if not isinstance(state_dict, dict) or not {"state", "hyper"} <= set(state_dict):
            raise OptimizerError("state_dict must be a dict with 'hyper' and 'state', as "
                                 "returned by state_dict()", argument="state_dict")
        states = state_dict["state"]
        # The shape of the dict first: a dict or None here, or a non-dict entry,
        # failed below with a bare TypeError from len() or ``key in src``.
        if not isinstance(states, (list, tuple)) or \
                not all(isinstance(src, dict) for src in states):
            raise OptimizerError("state_dict['state'] must be a list with one dict of "
                                 "state per param, as returned by state_dict().",
                                 argument="state_dict")
        if len(states) != len(self.state):
            raise OptimizerError(f"state_dict has state for {len(states)} params, this "
                                 f"optimizer has {len(self.state)}.", argument="state_dict")
        hyper = state_dict["hyper"]
        if not isinstance(hyper, dict):
            raise OptimizerError(f"state_dict['hyper'] is a {type(hyper).__name__}; expected "
                                 f"the dict of hyperparameters state_dict() returns.",
                                 argument="state_dict")
        missing = [key for key in self.hyper if key not in hyper]
        if missing:
            raise OptimizerError(f"state_dict['hyper'] lacks {', '.join(map(repr, missing))}; "
                                 f"expected all of {sorted(self.hyper)}, as returned by "
                                 f"state_dict().", argument="state_dict")
        _check_hyper(hyper["lr"], hyper["betas"], hyper["eps"], hyper["weight_decay"])
        _check_switch_flags("state_dict['hyper']", hyper)
        decoupled = state_dict.get("decoupled_weight_decay", self.decoupled_weight_decay)
        if not isinstance(decoupled, (bool, np.bool_)):
            raise OptimizerError(f"decoupled_weight_decay is {decoupled!r}; expected True "
                                 f"or False, as state_dict() saves it.",
                                 argument="state_dict")
        if decoupled != self.decoupled_weight_decay:
            # The class is the algorithm (CPUAdam's groups carry the switch; here
            # it has no other home): loaded, the saved weight decay ran as the
            # other one, silently.
            saved = "NumpyAdamW" if decoupled else "NumpyAdam"
            raise OptimizerError(
                f"the state dict was saved by a {saved} (decoupled_weight_decay="
                f"{bool(decoupled)}), this optimizer is a {type(self).__name__}: its "
                f"weight decay would run as the other algorithm; build a {saved} to "
                f"resume it.", argument="state_dict")
        if bool(hyper["amsgrad"]) != self.hyper["amsgrad"]:
            # The state arrays were allocated for this optimizer's setting (and the
            # checks below hold the saved state to them): a flag that contradicts
            # them would be reported while the other algorithm runs.
            raise OptimizerError(
                f"state_dict['hyper'] has amsgrad={hyper['amsgrad']!r} but this optimizer "
                f"was built with amsgrad={self.hyper['amsgrad']} (its state "
                f"{'has' if self.hyper['amsgrad'] else 'has no'} max_exp_avg_sq); build "
                f"it with the amsgrad setting the state was saved with.",
                argument="state_dict")
        hyper = {**hyper, **_hyper_dict(**{key: hyper[key] for key in self.hyper})}
        checked = []        # per param: (the state arrays as arrays, the step as int)
        for i, (src, dst) in enumerate(zip(states, self.state)):
            arrays = {}
            for key in _STATE_KEYS:
                if (key in src) != (key in dst):
                    raise OptimizerError(
                        f"param {i}: state key {key!r} is "
                        f"{'missing' if key not in src else 'unexpected'}; was the "
                        f"state saved with the same amsgrad setting?",
                        argument="state_dict")
                if key in dst:
                    try:
                        a = arrays[key] = np.asarray(src[key])
                    except (TypeError, ValueError) as exc:    # ragged nested lists
                        raise OptimizerError(f"param {i}: {key} is not an array ({exc}).",
                                             argument="state_dict") from None
                    if a.shape != dst[key].shape:
                        raise OptimizerError(f"param {i}: {key} has shape {a.shape}, "
                                             f"expected {dst[key].shape}.",
                                             argument="state_dict")
                    if a.dtype.kind != "f":
                        raise OptimizerError(f"param {i}: {key} has dtype {a.dtype}; "
                                             f"expected real floating point, "
                                             f"{_MOMENT_DTYPE_HINT}.",
                                             argument="state_dict")
                    with np.errstate(over="ignore"):    # beyond float32: the inf held
                        _check_moment(f"param {i}", key, a.astype(np.float32))
            checked.append((arrays, _saved_step(src, f"param {i}")))
        skips = _saved_skips(state_dict)
        # Everything checked: copying can no longer fail half-way.
        for (arrays, step), dst in zip(checked, self.state):
            for key, a in arrays.items():
                np.copyto(dst[key], a, casting="same_kind")
            dst["step"] = step
        self.hyper = hyper
        self.skipped_steps, self.last_step_skipped = skips


    def close(self) -> None:
        """Drop the state (moments and step counts): with ``state_arena``, its
        buffers go back to the arena at once (once no array taken from
        ``self.state`` views them any more; :meth:`state_dict` copies, so its
        arrays do not). Afterwards :meth:`step`, :meth:`state_dict` and
        :meth:`load_state_dict` raise OptimizerError: make a new optimizer (and
        load a state dict saved before into it) to train on. The parameters
        are left as they are. Idempotent."""
        self.state.clear()
        self._closed = True


class NumpyAdamW(NumpyAdam):
    """AdamW (decoupled weight decay, ``p *= 1 - lr*weight_decay``) over numpy arrays;
    otherwise identical to :class:`NumpyAdam`. Default ``weight_decay=1e-2``."""

    decoupled_weight_decay = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


# --------------------------------------------------------------------------- torch front end

def __getattr__(name):
    # Lazy: `import rtmem.optim` must work (NumpyAdam) without torch installed.
    if name in _TORCH_CLASSES:
        from . import _optim_torch
        globals().update((cls, getattr(_optim_torch, cls)) for cls in _TORCH_CLASSES)
        return globals()[name]
    raise AttributeError(f"module 'rtmem.optim' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))

