"""CPU Adam / AdamW optimizers over the fused kernel of :mod:`rtmem.kernels.adam`.

Two front ends share one step routine:

- :class:`CPUAdam` / :class:`CPUAdamW` are ``torch.optim.Optimizer`` subclasses
  for fp32 CPU parameters (param groups, lr schedulers, ``state_dict`` /
  ``load_state_dict``, ``zero_grad``). Parameters are updated in place through
  zero-copy numpy views; the state tensors (``exp_avg``, ``exp_avg_sq``,
  ``max_exp_avg_sq``, ``step``) are laid out as ``torch.optim.Adam``'s, so a
  state dict loads into either optimizer.
- :class:`NumpyAdam` / :class:`NumpyAdamW` do the same over plain numpy arrays and
  need no torch. torch is imported only when ``CPUAdam``/``CPUAdamW`` is first
  accessed.

NOTE [ Skipped steps ]
    With ``step(..., grad_scale=S)`` the gradients are divided by the loss scale
    ``S`` inside the kernel, and the step is skipped if any unscaled gradient of
    any parameter is inf/NaN: then no parameter, moment or step count changes
    (bit-identical), ``last_step_skipped`` is True and ``skipped_steps`` grows by
    one. All gradients are validated and checked before the first parameter is
    written, so an error or an overflow never leaves a half-applied step.
"""

from __future__ import annotations

import numpy as np

from .buffer import Buffer
from .errors import OptimizerError, ResidencyError
from .kernels.adam import adam_coefficients, prepare_update, threads

__all__ = ["CPUAdam", "CPUAdamW", "NumpyAdam", "NumpyAdamW"]

_TORCH_CLASSES = ("CPUAdam", "CPUAdamW")
# The kernel's argument names -> NumpyAdam.step's keywords, for error reports.
_NUMPY_ARGUMENTS = {"grad": "grads", "out": "copies", "out_format": "copy_format"}
# ... and -> CPUAdam.step's (formats come from the tensors' dtypes).
_TORCH_ARGUMENTS = {"grad": "grads", "grad_format": "grads", "out": "copies",
                    "out_format": "copies", "copy": "copies"}
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


# --------------------------------------------------------------------------- shared

def _check_hyper(lr, betas, eps, weight_decay):
    """Validate one set of hyperparameters; raise OptimizerError naming the bad one."""
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise OptimizerError(f"betas={betas!r} must be a pair (beta1, beta2), each in "
                             f"[0, 1).", argument="betas") from None
    # adam_coefficients owns the range checks; step=1 is just a valid placeholder.
    adam_coefficients(lr=float(lr), step=1, beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=weight_decay)


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


def _checked_step(step, where) -> int:
    """A saved step count as an int; raise OptimizerError naming ``where`` (the
    parameter) unless it is an integer >= 0 (a Python/numpy number or a
    one-element tensor; -3, NaN and 2.5 are refused)."""
    try:
        count = int(step)
        ok = bool(count == step) and count >= 0
    except (TypeError, ValueError, OverflowError, RuntimeError):
        ok = False
    if not ok:
        raise OptimizerError(f"{where}: step is {step!r}; expected an integer >= 0.",
                             argument="state_dict")
    return count


def _named(where, exc, arguments):
    """``exc`` (an OptimizerError from the kernel's checks, which know an array
    only as "grad" or "out") again, prefixed with the parameter it is about and
    with its argument renamed to the caller's keyword (``arguments``)."""
    return OptimizerError(f"{where}: {exc}",
                          argument=arguments.get(exc.argument, exc.argument))


def _check_disjoint(params) -> None:
    """Refuse parameters whose memory overlaps (the same array twice, or views of
    one array): each would be updated once per occurrence per step. Params are
    C-contiguous, so each spans [address, address + nbytes); sorting by address
    finds any overlap between neighbours, O(n log n)."""
    spans = sorted((p.__array_interface__["data"][0], p.nbytes, i)
                   for i, p in enumerate(params) if p.nbytes)
    for (lo, size, i), (next_lo, _, j) in zip(spans, spans[1:]):
        if next_lo < lo + size:
            i, j = sorted((i, j))
            raise OptimizerError(
                f"params[{i}] and params[{j}] overlap in memory (the same array twice, "
                f"or views of one array); each would be updated once per occurrence "
                f"every step. Pass each parameter once, with its own memory.",
                argument="params")


def _check_num_threads(num_threads):
    with threads(num_threads):  # validates (and restores the count at once)
        pass
    return num_threads


def _run_step(opt, items, *, grad_scale, check_finite) -> bool:
    """Apply one Adam step to every item, or to none (NOTE [ Skipped steps ]).

    ``items`` holds ``(update, coefficients, state)``: a validated
    :class:`~rtmem.kernels.adam.PreparedUpdate`, its float32 kernel coefficients
    and the parameter's state dict, whose ``"step"`` advances on success. The
    optimizer's ``skipped_steps`` / ``last_step_skipped`` record a skip. Returns
    True if the step was applied.
    """
    if check_finite is None:
        check_finite = grad_scale is not None
    applied = True
    with threads(opt.num_threads):
        if check_finite:
            applied = all(update.grads_finite(c) for update, c, _ in items)
        if applied:
            for update, c, _ in items:
                update.apply(c)
    if applied:
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
        Keep ``max_exp_avg_sq`` and normalise by it (AMSGrad).
    maximize, bias_correction:
        As in :func:`rtmem.kernels.adam_update`.
    num_threads:
        Kernel threads per step (1..numba.config.NUMBA_NUM_THREADS), or None for
        ``numba.get_num_threads()``.

    state_arena:
        A :class:`~rtmem.HostArena` for the moments (``kind="optimizer-state"``
        buffers, released when the optimizer is dropped), or None for numpy
        memory.

    State lives in ``self.state[i]`` (float32 arrays, 8 bytes per parameter, 12
    with AMSGrad) next to ``self.params[i]``.
    """

    decoupled_weight_decay = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, bias_correction=True, num_threads=None,
                 state_arena=None):
        _check_hyper(lr, betas, eps, weight_decay)
        if isinstance(params, (np.ndarray, Buffer)):
            raise OptimizerError("params must be a list of arrays, got a single "
                                 f"{type(params).__name__}; pass [params]",
                                 argument="params")
        self.params = [_host_view(p, f"params[{i}]") for i, p in enumerate(params)]
        if not self.params:
            raise OptimizerError("params is empty; pass at least one float32 array.",
                                 argument="params")
        self.hyper = _hyper_dict(lr, betas, eps, weight_decay, amsgrad, maximize,
                                 bias_correction)
        self.num_threads = _check_num_threads(num_threads)
        self.state = []
        for i, p in enumerate(self.params):
            # Validates the parameter (dtype, contiguity, writeability) up front;
            # np.zeros is lazily zeroed memory, unlike copies of it.
            shape = getattr(p, "shape", ())
            try:
                prepare_update(p, *(np.zeros(shape, dtype=np.float32) for _ in range(3)))
            except OptimizerError as exc:
                raise _named(f"params[{i}]", exc, {"param": "params"}) from None
        _check_disjoint(self.params)
        keys = _STATE_KEYS if amsgrad else _STATE_KEYS[:2]
        for p in self.params:
            st = {"step": 0}
            st.update((key, _zeros_state(p.shape, state_arena)) for key in keys)
            self.state.append(st)
        self.last_step_skipped = False
        self.skipped_steps = 0

    def step(self, grads, *, grad_scale=None, check_finite=None, grad_format=None,
             copies=None, copy_format=None) -> bool:
        """Take one step; return True if applied, False if skipped (overflow).

        ``grads`` is a sequence aligned with ``params`` (float32, float16, or
        uint16 bits with ``grad_format``); a None entry leaves that parameter
        alone. ``grad_scale`` is the loss scale the gradients carry (divided out
        in the kernel); ``check_finite`` defaults to ``grad_scale is not None``.
        ``copies`` optionally gives, per parameter, an array (float32, float16,
        or uint16 with ``copy_format``) that receives the updated parameter in
        the same pass (a float16 copy is +-inf where the parameter exceeds fp16's
        range, see :func:`rtmem.kernels.adam_update`). See NOTE [ Skipped steps ].
        """
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
        items = []
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
            c = _coefficients(self.hyper, st["step"] + 1, self.decoupled_weight_decay,
                              grad_scale)
            items.append((update, c, st))
        return _run_step(self, items, grad_scale=grad_scale, check_finite=check_finite)

    def state_dict(self) -> dict:
        """A deep copy of the hyperparameters and per-parameter state (arrays copied)."""
        return {"hyper": dict(self.hyper),
                "state": [{k: (v.copy() if isinstance(v, np.ndarray) else v)
                           for k, v in st.items()} for st in self.state]}

    def load_state_dict(self, state_dict) -> None:
        """Restore :meth:`state_dict` output, copying into the existing state arrays
        (their memory stays where it was allocated). ``hyper`` must hold every
        hyperparameter, with this optimizer's ``amsgrad``; each ``step`` must be an
        integer >= 0. A refused dict leaves the optimizer as it was."""
        if not isinstance(state_dict, dict) or not {"state", "hyper"} <= set(state_dict):
            raise OptimizerError("state_dict must be a dict with 'hyper' and 'state', as "
                                 "returned by state_dict()", argument="state_dict")
        states = state_dict["state"]
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
                    a = arrays[key] = np.asarray(src[key])
                    if a.shape != dst[key].shape:
                        raise OptimizerError(f"param {i}: {key} has shape {a.shape}, "
                                             f"expected {dst[key].shape}.",
                                             argument="state_dict")
                    if not np.can_cast(a.dtype, np.float32, "same_kind"):
                        raise OptimizerError(f"param {i}: {key} has dtype {a.dtype}; "
                                             f"expected real floating point.",
                                             argument="state_dict")
            checked.append((arrays, _checked_step(src.get("step"), f"param {i}")))
        # Everything checked: copying can no longer fail half-way.
        for (arrays, step), dst in zip(checked, self.state):
            for key, a in arrays.items():
                np.copyto(dst[key], a, casting="same_kind")
            dst["step"] = step
        self.hyper = hyper


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
        classes = _build_torch_optimizers()
        globals().update(classes)
        return classes[name]
    raise AttributeError(f"module 'rtmem.optim' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _build_torch_optimizers():
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "rtmem.optim.CPUAdam/CPUAdamW need PyTorch; install it with "
            "`pip install 'rtmem[torch]'`, or use rtmem.optim.NumpyAdam / NumpyAdamW "
            "on numpy arrays.") from e

    def as_numpy(t, name):
        """(numpy view, 16-bit format or None) of a CPU tensor, zero-copy."""
        if isinstance(t, np.ndarray):
            if t.dtype == np.uint16:
                # The kernel's advice (grad_format=) does not apply here: CPUAdam
                # takes the format from the tensor's dtype.
                raise OptimizerError(
                    f"{name} is a numpy uint16 array, whose bits could be bfloat16 or "
                    f"float16. Pass bfloat16 as a torch.bfloat16 tensor (zero-copy: "
                    f"torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)) and "
                    f"float16 as a float16 array or tensor.", argument=name)
            return t, None
        if not isinstance(t, torch.Tensor):
            raise OptimizerError(f"{name} must be a torch.Tensor or numpy array, got "
                                 f"{type(t).__name__}.", argument=name)
        if t.device.type != "cpu" or t.layout != torch.strided:
            raise OptimizerError(
                f"{name} is a {t.device.type} {t.layout} tensor; the CPU optimizer needs "
                f"dense CPU tensors (copy with .to('cpu'), or .to_dense()).",
                argument=name)
        if not t.is_contiguous():
            raise OptimizerError(f"{name} is not contiguous (strides {t.stride()}); the "
                                 f"fused kernel walks flat memory. Use .contiguous().",
                                 argument=name)
        t = t.detach()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16), "bfloat16"
        if t.dtype in (torch.float32, torch.float16):
            return t.numpy(), None
        raise OptimizerError(f"{name} has dtype {t.dtype}; expected float32, float16 or "
                             f"bfloat16.", argument=name)

    def tensors_of(params):
        """``params`` with rtmem Buffers replaced by zero-copy CPU tensors over their
        host memory (which pin the buffers while the optimizer holds them)."""
        if isinstance(params, torch.Tensor):
            return params          # torch.optim raises its own clear error for this

        def one(p):
            if not isinstance(p, Buffer):
                return p
            return torch.from_numpy(_host_view(p, "params"))
        out = []
        for item in params:
            if isinstance(item, dict):
                item = {**item, "params": [one(p) for p in (
                    [item["params"]] if isinstance(item["params"], (torch.Tensor, Buffer))
                    else item["params"])]}
                out.append(item)
            else:
                out.append(one(item))
        return out

    def per_param(values, params, name):
        """Map a dict {param: value} or a sequence aligned with params to a dict."""
        if values is None:
            return {}
        if isinstance(values, dict):
            ids = {id(p) for p in params}
            if any(id(k) not in ids for k in values):
                raise OptimizerError(f"{name} has a key that is not a parameter of this "
                                     f"optimizer; key the dict by the parameters passed "
                                     f"to it", argument=name)
            return {id(k): v for k, v in values.items()}
        values = list(values)
        if len(values) != len(params):
            raise OptimizerError(f"{name} has {len(values)} entries for {len(params)} "
                                 f"params; pass one per param in param-group order, or a "
                                 f"dict {{param: tensor}}.", argument=name)
        return {id(p): v for p, v in zip(params, values)}

    def bump_versions(tensors):
        """Tell autograd the ``tensors`` were modified in place.

        The kernel writes them through numpy views, which autograd cannot see:
        without this, backward through a graph that saved a parameter before the
        step would silently use the new values, where torch.optim.Adam's in-place
        update makes it raise "modified by an inplace operation".
        """
        increment = getattr(torch.autograd.graph, "increment_version", None)
        for t in tensors:
            if increment is not None:
                increment(t)           # one tensor per call: older torch takes no lists
            elif not t.is_inference():  # inference tensors have no version counter
                # Any in-place op bumps the (shared) counter, even on no elements.
                with torch.no_grad():
                    t.view(-1)[:0].zero_()

    class CPUAdam(torch.optim.Optimizer):
        """Adam on CPU float32 parameters with rtmem's fused kernel.

        A drop-in ``torch.optim.Optimizer`` (param groups, lr schedulers,
        ``state_dict``/``load_state_dict``, ``zero_grad``). Parameters must be
        contiguous float32 CPU tensors, or float32 rtmem Buffers in host memory
        (held as zero-copy CPU tensors that pin them; pass their gradients with
        ``step(grads=...)``); they are updated in place through zero-copy numpy
        views. State per parameter: ``step`` (float32 scalar
        tensor) and float32 ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``
        with ``amsgrad``), 8-12 bytes per parameter, laid out like
        ``torch.optim.Adam`` so state dicts move between the two.

        ``lr`` >= 0, ``betas`` in [0, 1), ``eps`` > 0, ``weight_decay`` >= 0 (an
        L2 term added to the gradient; with ``decoupled_weight_decay=True``, as
        in ``torch.optim.Adam``, the decoupled decay ``p *= 1 - lr*weight_decay``
        of AdamW, which :class:`CPUAdamW` always uses); ``num_threads`` as in
        :func:`rtmem.kernels.adam_update`.

        ``decoupled_weight_decay`` is a per-group hyperparameter, as in
        ``torch.optim.Adam`` (torch >= 2.6): a state dict carries it, so loading
        one from ``torch.optim.Adam(decoupled_weight_decay=True)`` or ``AdamW``
        keeps AdamW. The step bumps the autograd version counter of every
        updated parameter and copy, as torch's in-place update does. Copies,
        pickles and ``torch.save`` of the optimizer keep ``num_threads`` and
        the skipped-step counters.
        """

        #: The class's ``decoupled_weight_decay``: the default for groups (and
        #: loaded state dicts) without one. The step honours each group's value.
        decoupled_weight_decay = False

        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=0.0, amsgrad=False, *, maximize=False,
                     bias_correction=True, decoupled_weight_decay=False, num_threads=None):
            _check_hyper(lr, betas, eps, weight_decay)
            self._check_decoupled(decoupled_weight_decay, "decoupled_weight_decay")
            self.num_threads = _check_num_threads(num_threads)
            self.last_step_skipped = False
            self.skipped_steps = 0
            defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                            amsgrad=bool(amsgrad), maximize=bool(maximize),
                            bias_correction=bool(bias_correction),
                            decoupled_weight_decay=bool(decoupled_weight_decay))
            super().__init__(tensors_of(params), defaults)

        def _check_decoupled(self, value, where):
            """Refuse a ``decoupled_weight_decay`` this class cannot honour."""
            if not isinstance(value, (bool, np.bool_)):
                raise OptimizerError(f"{where}={value!r} must be True or False.",
                                     argument="decoupled_weight_decay")

        # torch.optim.Optimizer pickles (and deep-copies) only defaults, state and
        # param_groups; these attributes are this class's own, with the values a
        # pickle made without them gets.
        _EXTRA_STATE = (("num_threads", None), ("skipped_steps", 0),
                        ("last_step_skipped", False))

        def __getstate__(self):
            state = super().__getstate__()
            state.update((name, getattr(self, name, default))
                         for name, default in self._EXTRA_STATE)
            return state

        def __setstate__(self, state):
            # Also called by torch's load_state_dict with only state and groups:
            # attributes already set are kept.
            super().__setstate__(state)
            for name, default in self._EXTRA_STATE:
                if name not in self.__dict__:
                    setattr(self, name, default)
            self.defaults.setdefault("decoupled_weight_decay", self.decoupled_weight_decay)
            for group in self.param_groups:
                group.setdefault("decoupled_weight_decay", self.decoupled_weight_decay)

        def add_param_group(self, param_group):
            """Add a group (see ``torch.optim.Optimizer.add_param_group``); rtmem
            Buffers in it are taken as in the constructor, and its hyperparameters
            and parameters are validated first."""
            if isinstance(param_group, dict) and "params" in param_group:
                param_group = tensors_of([param_group])[0]
            super().add_param_group(param_group)
            group = self.param_groups[-1]
            try:
                _check_hyper(group["lr"], group["betas"], group["eps"],
                             group["weight_decay"])
                self._check_decoupled(group["decoupled_weight_decay"],
                                      f"group {len(self.param_groups) - 1}: "
                                      f"decoupled_weight_decay")
                for i, p in enumerate(group["params"]):
                    if p.dtype != torch.float32:
                        raise OptimizerError(
                            f"param {i} of group {len(self.param_groups) - 1} has dtype "
                            f"{p.dtype}; CPUAdam keeps float32 master parameters. Keep "
                            f"an fp32 copy on the CPU and upload fp16/bf16 copies "
                            f"(step(copies=...)).", argument="params")
                    as_numpy(p, f"param {i}")
            except Exception:
                self.param_groups.pop()
                raise

        def _state_for(self, p, group):
            st = self.state[p]
            if "step" not in st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in _STATE_KEYS:
                if key not in st and (key != "max_exp_avg_sq" or group["amsgrad"]):
                    st[key] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            return st

        @torch.no_grad()
        def step(self, closure=None, *, grads=None, grad_scale=None, check_finite=None,
                 copies=None):
            """Take one step; returns the closure's loss (or None), like torch.

            ``grads`` overrides ``p.grad``: a dict ``{param: tensor}`` or a
            sequence in param-group order, with float32, float16 or bfloat16
            tensors (e.g. half gradients flushed from the GPU); None entries
            skip that parameter. ``grad_scale`` is the loss scale the gradients
            carry (divided out in the kernel); ``check_finite`` defaults to
            ``grad_scale is not None``. ``copies`` (same forms) receives each
            updated parameter as float32/float16/bfloat16 in the same pass; a
            float16 copy of a master value of magnitude >= 65520 (beyond fp16's
            largest finite 65504) is +-inf, while the float32 master stays
            finite and the step counts as applied (the finite check covers the
            gradients only). Whether the step was skipped is recorded in
            ``last_step_skipped`` (NOTE [ Skipped steps ]). An applied step
            bumps the autograd version counter of each updated parameter and
            copy tensor.
            """
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            params = [p for group in self.param_groups for p in group["params"]]
            grad_of = per_param(grads, params, "grads")
            copy_of = per_param(copies, params, "copies")
            for group in self.param_groups:
                _check_hyper(group["lr"], group["betas"], group["eps"],
                             group["weight_decay"])
            items, created, written = [], [], []
            try:
                for gi, group in enumerate(self.param_groups):
                    decoupled = bool(group.get("decoupled_weight_decay",
                                               self.decoupled_weight_decay))
                    for pi, p in enumerate(group["params"]):
                        g = grad_of.get(id(p), None) if grads is not None else p.grad
                        if g is None:
                            continue
                        out = copy_of.get(id(p))
                        try:
                            g_np, g_fmt = as_numpy(g, "grad")
                            o_np, o_fmt = ((None, None) if out is None
                                           else as_numpy(out, "copy"))
                            if not self.state.get(p):
                                created.append(p)
                            st = self._state_for(p, group)
                            update = prepare_update(
                                p.detach().numpy(), g_np, st["exp_avg"].numpy(),
                                st["exp_avg_sq"].numpy(),
                                max_exp_avg_sq=(st["max_exp_avg_sq"].numpy()
                                                if group["amsgrad"] else None),
                                grad_format=g_fmt, out=o_np, out_format=o_fmt)
                        except OptimizerError as exc:
                            raise _named(f"group {gi} param {pi}", exc,
                                         _TORCH_ARGUMENTS) from None
                        c = _coefficients(group, int(st["step"].item()) + 1, decoupled,
                                          grad_scale)
                        items.append((update, c, st))
                        written.append(p)
                        if isinstance(out, torch.Tensor):
                            written.append(out)
            except BaseException:
                for p in created:        # a refused step leaves no new state behind
                    self.state.pop(p, None)
                raise
            if _run_step(self, items, grad_scale=grad_scale, check_finite=check_finite):
                bump_versions(written)
            return loss

        def load_state_dict(self, state_dict):
            """Load a state dict (from CPUAdam, CPUAdamW or torch.optim.Adam/AdamW).
            The state is copied into fresh contiguous float32 tensors, so the
            loaded dict is never aliased; each saved step must be an integer >= 0.
            Groups keep the saved ``decoupled_weight_decay`` (the class default
            where the dict has none; :class:`CPUAdamW`, like
            ``torch.optim.AdamW``, always decouples). A refused dict leaves the
            optimizer as it was."""
            # torch installs new state and group dicts; the checks below run after
            # it, so keep the old ones to put back.
            if not isinstance(state_dict, dict) or \
                    not {"state", "param_groups"} <= set(state_dict):
                raise OptimizerError("state_dict must be a dict with 'state' and "
                                     "'param_groups', as returned by state_dict()",
                                     argument="state_dict")
            old_state, old_groups = self.state, self.param_groups
            try:
                self._load_checked(state_dict)
            except BaseException:
                self.state, self.param_groups = old_state, old_groups
                raise

        def _load_checked(self, state_dict):
            super().load_state_dict(state_dict)
            for gi, group in enumerate(self.param_groups):
                try:
                    _check_hyper(group["lr"], group["betas"], group["eps"],
                                 group["weight_decay"])
                except OptimizerError as exc:
                    raise OptimizerError(f"group {gi} of the state dict: {exc}",
                                         argument=exc.argument) from None
                self._check_decoupled(group["decoupled_weight_decay"],
                                      f"group {gi}: decoupled_weight_decay")
                for pi, p in enumerate(group["params"]):
                    st = self.state.get(p)
                    if not st:
                        continue
                    step = _checked_step(st.get("step", 0), f"group {gi} param {pi}")
                    for key in _STATE_KEYS:
                        if key not in st:
                            continue
                        t = torch.as_tensor(st[key])
                        if t.shape != p.shape:
                            raise OptimizerError(
                                f"state {key} has shape {tuple(t.shape)} but its param "
                                f"has shape {tuple(p.shape)}; the state dict belongs to "
                                f"another model.", argument="state_dict")
                        st[key] = t.detach().to(device="cpu", dtype=torch.float32).clone(
                            memory_format=torch.contiguous_format)
                    st["step"] = torch.tensor(float(step), dtype=torch.float32)

    class CPUAdamW(CPUAdam):
        """AdamW (decoupled weight decay, ``p *= 1 - lr*weight_decay``) on CPU
        float32 parameters; otherwise identical to :class:`CPUAdam`. Default
        ``weight_decay=1e-2`` like ``torch.optim.AdamW``."""

        decoupled_weight_decay = True

        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=1e-2, amsgrad=False, **kwargs):
            kwargs.setdefault("decoupled_weight_decay", True)
            super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)

        def _check_decoupled(self, value, where):
            super()._check_decoupled(value, where)
            if not value:
                raise OptimizerError(
                    f"{where}=False: CPUAdamW always decouples weight decay; use "
                    f"CPUAdam for an L2 penalty added to the gradient.",
                    argument="decoupled_weight_decay")

        def __setstate__(self, state):
            # As torch.optim.AdamW: state loaded into AdamW stays AdamW (a
            # torch.optim.Adam dict says decoupled_weight_decay=False).
            super().__setstate__(state)
            for group in self.param_groups:
                group["decoupled_weight_decay"] = True

    for cls in (CPUAdam, CPUAdamW):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    return {"CPUAdam": CPUAdam, "CPUAdamW": CPUAdamW}
