"""The torch front end of :mod:`rtmem.optim`: :class:`CPUAdam` and :class:`CPUAdamW`.

It is a module of its own because it imports torch at the top: ``rtmem.optim``
imports it only when one of the two classes is first accessed (its module
``__getattr__``), so that ``import rtmem.optim`` (NumpyAdam) works without torch.
The validation and step routine shared with NumpyAdam stay in ``rtmem.optim``,
the checks of a loaded state dict are in :mod:`rtmem._optim_state_dict`, the
tensor plumbing (numpy views, Buffers as parameters, per-parameter
arguments) is in :mod:`rtmem._optim_tensors`, the arena state in
:mod:`rtmem._optim_arena`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

try:
    import torch
except ImportError as e:
    raise ImportError(
        "rtmem.optim.CPUAdam/CPUAdamW need PyTorch; install it with "
        "`pip install 'rtmem[torch]'`, or use rtmem.optim.NumpyAdam / NumpyAdamW "
        "on numpy arrays.") from e

from ._optim_arena import arena_zeros, load_into_arena
from ._optim_state_dict import (_MOMENT_DTYPE_HINT, _STATE_KEYS, _check_adam_keys,
                                _check_moment, _check_state_dict, _check_state_listed,
                                _check_torch_layout, _loaded, _post_hooked, _pre_hooked,
                                _saved_skips, _saved_step)
from ._optim_tensors import as_numpy, bump_versions, per_param, tensors_of
from .errors import OptimizerError
from .kernels._adam_many import add_one
from .kernels.adam import _prepare_again, _state_bounds, prepare_update
from .optim import (_check_finite_switch, _check_group_hyper, _check_hyper,
                    _check_num_threads, _check_open, _check_state_arena, _check_step_disjoint,
                    _check_switch_flags, _first_overlap, _host_view, _named,
                    _run_step, _span, _StepCoefficients)

__all__ = ["CPUAdam", "CPUAdamW"]

# The kernel's argument names -> CPUAdam.step's keywords, for error reports. No
# grad_format/out_format: as_numpy derives the format from the dtype, so the
# kernel never blames one.
_TORCH_ARGUMENTS = {"grad": "grads", "out": "copies", "copy": "copies"}

# The largest step count state["step"] (a float32 tensor, as torch's) holds
# finite: a larger one is inf, which step() cannot turn back into a count.
_MAX_STEP = int(np.finfo(np.float32).max)


# torch.optim.Adam's switches that change what its step does, which CPUAdam
# cannot do: refused wherever a group can turn them on (constructor,
# add_param_group, load_state_dict, a group edited before a step), instead of
# kept in the group and ignored.
_REFUSED_SWITCHES = {
    "capturable": "CPUAdam updates CPU tensors in a numba kernel, outside CUDA graphs "
                  "(torch.optim.Adam's step refuses it for CPU parameters too)",
    "differentiable": "CPUAdam's update is not recorded by autograd, so no gradient "
                      "flows through it",
}


def _check_switches(where, group, loaded=False, reasons=None) -> None:
    """OptimizerError if ``group`` turns on a switch of ``reasons`` (name -> why
    the optimizer cannot honour it; default :data:`_REFUSED_SWITCHES`, CPUAdam's);
    ``where`` ("" for the constructor's keywords) names the group, ``loaded``
    says it comes from a state dict (the remedy differs)."""
    for name, why in (_REFUSED_SWITCHES if reasons is None else reasons).items():
        if not group.get(name):
            continue
        if not where:
            raise OptimizerError(f"{name}=True is not supported: {why}.", argument=name)
        if not loaded:
            fix = f"leave {name} out of the group (or set it to False)"
        elif name == "capturable":      # the update's math does not depend on it
            fix = ("set it to False in the dict's param_groups before loading (the "
                   "update is the same without it)")
        else:
            fix = ("set it to False in the dict's param_groups to train on without a "
                   "gradient through the step, or keep torch.optim.Adam for it")
        raise OptimizerError(f"{where} has {name}={group[name]!r}, which is not "
                             f"supported: {why}; {fix}.", argument=name)


# NOTE [ Held views ]
# A step needs checked numpy views of each parameter and its moments; making
# them (four Tensor.numpy() calls, prepare_update's checks of the state arrays
# and of their overlaps) cost 5-8 us per tensor per step more than checking
# that they still hold, a fifth of a step over GPT-2's 148 tensors at hidden
# size 16. CPUAdam keeps them from one applied step to the next, with
# the _layout of the tensors they were made from, and makes them again whenever
# it differs: a tensor replaced (param groups or state edited, a state dict
# loaded), its memory moved (``.data =``, ``set_``, a growing ``resize_``) or
# its shape, strides or dtype changed (``resize_``, ``as_strided_``, ``.data =
# a view``). Equal layouts mean the same memory seen the same way, so the kept
# views are the ones the step would make (``_version`` would not do: ``.data
# =`` and ``set_`` leave it alone). The gradient and copy are checked in full
# every step. The views go when close() drops the state. The step count's
# tensor is part of the layout too: while it holds, the step advances the count
# through its address, with the other parameters' counts (_count_steps).

def _layout(p, st, amsgrad):
    """Key of the views a step makes of parameter ``p`` and its state ``st``:
    per tensor, its identity, address, shape, strides, dtype and device; None
    if ``st`` lacks an entry the step needs (the step makes them first)."""
    if st is None:
        return None
    step, m, v = st.get("step"), st.get("exp_avg"), st.get("exp_avg_sq")
    if not (isinstance(step, torch.Tensor) and isinstance(m, torch.Tensor)
            and isinstance(v, torch.Tensor)):
        return None
    if not amsgrad:
        return _facts(p), _facts(m), _facts(v), _facts(step)
    vmax = st.get("max_exp_avg_sq")
    if not isinstance(vmax, torch.Tensor):
        return None
    return _facts(p), _facts(m), _facts(v), _facts(step), _facts(vmax)


def _facts(t):
    return id(t), t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


class _Held(NamedTuple):
    """One parameter's views kept between steps (NOTE [ Held views ])."""
    layout: tuple        # _layout of the tensors the views were made from
    arrays: tuple        # flat (param, exp_avg, exp_avg_sq, max_exp_avg_sq or None)
    bounds: tuple        # their _state_bounds
    shape: tuple         # the parameter's shape (for the grad's and copy's checks)
    tensors: tuple       # the moments and step: alive, so that the layout's ids stay theirs
    counter: int | None  # address of the step count, if _count_steps may add to it


def _counter(step):
    """Address (bytes) of the step count ``step`` (a tensor) if it is a float32
    CPU tensor of one element that in-place ops may change, which
    :func:`_count_steps` then advances with the others in one call; None if
    only ``+= 1`` can."""
    if (step.dtype == torch.float32 and step.device.type == "cpu" and step.numel() == 1
            and not step.is_inference()):
        return step.data_ptr()
    return None


def _count_steps(items, counters):
    """Add 1 to the step count of every ``(update, coefficients, state)`` of
    ``items``: through ``counters`` (their :func:`_counter` addresses) in one
    jitted call, ``+= 1`` where that is None. ``st["step"] += 1`` per
    parameter, a torch op on a scalar, cost ~4 us each: a sixth of a step's
    per-tensor overhead. The float32 sum is the one the op computes."""
    at = [a for a in counters if a is not None]
    if len(at) < len(counters):
        for (_, _, st), a in zip(items, counters):
            if a is None:
                st["step"] += 1
    add_one(np.array(at, np.int64))


class CPUAdam(torch.optim.Optimizer):
    """Adam on CPU float32 parameters with rtmem's fused kernel.

    A drop-in ``torch.optim.Optimizer`` (param groups, lr schedulers,
    ``state_dict``/``load_state_dict``, ``zero_grad``). Parameters must be
    contiguous float32 CPU tensors, or float32 rtmem Buffers in host memory
    (held as zero-copy CPU tensors that pin them; pass their gradients, tensors
    or Buffers, with ``step(grads=...)``, a list or a dict keyed by the
    parameters or by the Buffers); they are updated in place through zero-copy numpy
    views. State per parameter: ``step`` (float32 scalar
    tensor) and float32 ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``
    with ``amsgrad``), 8-12 bytes per parameter, laid out like
    ``torch.optim.Adam`` so state dicts move between the two.

    ``state_arena``: None (the moments are ordinary CPU tensors) or a
    :class:`~rtmem.HostArena` (pinned or mapped; any other value, a
    DeviceArena too, is refused with an OptimizerError): each moment is then
    a zero-copy CPU tensor over its own ``kind="optimizer-state"`` buffer of
    the arena, 8 bytes per parameter element (12 with ``amsgrad``) plus up to
    one alignment (256 bytes by default) per moment, made at the parameter's
    first step, all of them or none (an arena too small raises
    OutOfMemoryError and the optimizer is unchanged). :meth:`load_state_dict`
    copies into the arena, :meth:`state_dict` returns the live arena tensors
    (``torch.save`` writes their values), and a deep copy or pickle of the
    optimizer is an independent one with ordinary CPU tensors
    (``state_arena`` None). :meth:`close` gives the buffers back. NOTE
    [ Optimizer state in an arena ] in rtmem/_optim_arena.py.

    ``lr`` >= 0, ``betas`` in [0, 1), ``eps`` > 0, ``weight_decay`` >= 0 (an
    L2 term added to the gradient; with ``decoupled_weight_decay=True``, as
    in ``torch.optim.Adam``, the decoupled decay ``p *= 1 - lr*weight_decay``
    of AdamW, which :class:`CPUAdamW` always uses); ``num_threads`` as in
    :func:`rtmem.kernels.adam_update`. ``foreach`` and ``fused`` are taken and
    ignored (the update is always one fused pass); ``capturable`` and
    ``differentiable`` must stay False: True is refused with an
    OptimizerError in the constructor, in :meth:`add_param_group`, in a
    loaded state dict's groups (e.g. one saved by
    ``torch.optim.Adam(capturable=True)``: set it to False in the dict) and
    at a step whose group was edited to True.

    ``decoupled_weight_decay`` is a per-group hyperparameter, as in
    ``torch.optim.Adam`` (torch >= 2.6): a state dict carries it, so loading
    one from ``torch.optim.Adam(decoupled_weight_decay=True)`` or ``AdamW``
    keeps AdamW. The step bumps the autograd version counter of every
    updated parameter and copy, as torch's in-place update does. Copies,
    pickles and ``torch.save`` of the optimizer keep ``num_threads`` and
    the skipped-step counters; :meth:`state_dict` keeps the counters.
    """

    #: The class's ``decoupled_weight_decay``: the default for groups (and
    #: loaded state dicts) without one. The step honours each group's value.
    decoupled_weight_decay = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, amsgrad=False, *, maximize=False,
                 bias_correction=True, decoupled_weight_decay=False, num_threads=None,
                 foreach=None, fused=None, capturable=False, differentiable=False,
                 state_arena=None):
        # torch.optim.Adam's implementation switches, taken so a call written for
        # it runs unchanged: the update is always one fused numba pass
        _check_switches("", dict(capturable=capturable, differentiable=differentiable))
        _check_hyper(lr, betas, eps, weight_decay)
        _check_switch_flags("", dict(amsgrad=amsgrad, maximize=maximize,
                                     bias_correction=bias_correction))
        self._check_decoupled(decoupled_weight_decay, "decoupled_weight_decay")
        self.num_threads = _check_num_threads(num_threads)
        _check_state_arena(state_arena)
        self.state_arena = state_arena
        self._closed = False
        self._views = {}        # NOTE [ Held views ]
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
    # pickle made without them gets. Not state_arena: a copy's moments are
    # ordinary tensors (torch's deepcopy and pickle copy the arena tensors'
    # values out), so it has none.
    _EXTRA_STATE = (("num_threads", None), ("skipped_steps", 0),
                    ("last_step_skipped", False), ("_closed", False))

    def __getstate__(self):
        state = super().__getstate__()
        state.update((name, getattr(self, name, default))
                     for name, default in self._EXTRA_STATE)
        return state

    def __setstate__(self, state):
        # Also called by torch's load_state_dict with only state and groups:
        # attributes already set are kept.
        super().__setstate__(state)
        self._views = {}     # made again from the new state (NOTE [ Held views ])
        for name, default in (*self._EXTRA_STATE, ("state_arena", None)):
            if name not in self.__dict__:
                setattr(self, name, default)
        # As torch.optim.Adam.__setstate__, for the keys the step reads: a dict
        # without them (an older torch's, transformers' AdamW's) loaded, then every
        # step raised KeyError 'amsgrad'.
        group_defaults = {"amsgrad": False, "maximize": False,
                          "decoupled_weight_decay": self.decoupled_weight_decay}
        for group in (self.defaults, *self.param_groups):
            for key, value in group_defaults.items():
                group.setdefault(key, value)

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
            _check_switches(f"group {len(self.param_groups) - 1}", group)
            _check_switch_flags(f"group {len(self.param_groups) - 1}", group)
            self._check_decoupled(group["decoupled_weight_decay"],
                                  f"group {len(self.param_groups) - 1}: "
                                  f"decoupled_weight_decay")
            first = {}
            for i, p in enumerate(group["params"]):
                j = first.setdefault(id(p), i)
                if j != i:
                    # torch only warns, then its loop updates it twice per step;
                    # here every step was refused as two params "overlapping in
                    # memory", with advice about gradient and copy buffers
                    raise OptimizerError(
                        f"param {i} of group {len(self.param_groups) - 1} is param {j} "
                        f"again (the same tensor twice in the group); pass each "
                        f"parameter once", argument="params")
                if p.dtype != torch.float32:
                    raise OptimizerError(
                        f"param {i} of group {len(self.param_groups) - 1} has dtype "
                        f"{p.dtype}; CPUAdam keeps float32 master parameters. Keep "
                        f"an fp32 copy on the CPU and upload fp16/bf16 copies "
                        f"(step(copies=...)).", argument="params")
                as_numpy(p, f"param {i}")
            self._check_disjoint_params()
        except Exception:
            self.param_groups.pop()
            raise

    def _check_disjoint_params(self) -> None:
        """Refuse two parameters (of any groups) whose memory overlaps: views of
        one tensor, each updated once per step as if it were alone. They were
        taken here, and every step was then refused with advice about gradient
        and copy buffers, which did not apply."""
        spans = [_span(as_numpy(p, "param")[0], gi, i)
                 for gi, group in enumerate(self.param_groups)
                 for i, p in enumerate(group["params"]) if p.numel()]
        pair = _first_overlap(spans)
        if pair is not None:
            (gi, i), (gj, j) = sorted((pair[0][2:], pair[1][2:]))
            raise OptimizerError(
                f"param {i} of group {gi} and param {j} of group {gj} overlap in memory "
                f"(views of one tensor); each would be updated as if alone, every step. "
                f"Give each parameter its own memory (e.g. a .clone() of one view)",
                argument="params")

    def _state_for(self, p, group, added):
        """``p``'s state, with the entries this step needs added (zeros); each
        added ``(p, key)`` is appended to ``added``, so a step that is refused
        or skipped can take them back."""
        # .get: self.state is a defaultdict, and a failed allocation below must
        # not leave an empty entry behind
        keys = [key for key in _STATE_KEYS if key not in self.state.get(p, ()) and
                (key != "max_exp_avg_sq" or group["amsgrad"])]
        if self.state_arena is None:
            new = [torch.zeros_like(p, memory_format=torch.contiguous_format)
                   for _ in keys]
        else:   # all of them before any is installed (an arena too small: none)
            new = arena_zeros([p.shape] * len(keys), self.state_arena)
        st = self.state[p]
        if "step" not in st:
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            added.append((p, "step"))
        for key, t in zip(keys, new):
            st[key] = t
            added.append((p, key))
        return st

    def close(self) -> None:
        """Drop the state (moments and step counts; with ``state_arena``, its
        buffers go back to the arena once no tensor from :meth:`state_dict`
        views them any more). Afterwards :meth:`step`, :meth:`state_dict` and
        :meth:`load_state_dict` raise OptimizerError: make a new optimizer (and
        load a saved state dict into it) to train on. The parameters are left
        as they are. Idempotent."""
        self.state.clear()
        self._views = {}     # their arena buffers go back with the state's
        self._closed = True

    def _check_open(self, what: str) -> None:
        _check_open(self, what)

    def _take_back(self, added) -> None:
        """Remove the state entries ``_state_for`` added (and states left empty)."""
        for p, key in added:
            st = self.state.get(p)
            if st is not None:
                st.pop(key, None)
                if not st:
                    del self.state[p]

    @torch.no_grad()
    def step(self, closure=None, *, grads=None, grad_scale=None, check_finite=None,
             copies=None):
        """Take one step; returns the closure's loss (or None), like torch.

        ``grads`` overrides ``p.grad``: a dict ``{param: tensor}`` (a
        parameter it does not name uses its ``p.grad``, so
        ``grads=executor.host_grads()`` also steps the stages a schedule does
        not ``g_offload``) or a sequence in param-group order, with float32,
        float16 or bfloat16 tensors (e.g. half gradients flushed from the
        GPU); None entries (or values) skip that parameter. ``grad_scale`` is
        the loss scale the gradients carry (divided out in the kernel, also
        from a ``p.grad`` a dict leaves out); ``check_finite`` (True, False, or
        None: ``grad_scale is not None``) checks them first. ``copies`` (same forms) receives each
        updated parameter as float32/float16/bfloat16 in the same pass; a
        float16 copy of a master value of magnitude >= 65520 (beyond fp16's
        largest finite 65504) is +-inf, while the float32 master stays
        finite and the step counts as applied (the finite check covers the
        gradients only). Whether the step was skipped is recorded in
        ``last_step_skipped`` (NOTE [ Skipped steps ]). An applied step
        bumps the autograd version counter of each updated parameter and
        copy tensor.
        """
        # an argument of the call: refused before the closure runs
        check_finite = _check_finite_switch(check_finite)
        self._check_open("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        grad_of = per_param(grads, params, "grads")
        copy_of = per_param(copies, params, "copies")
        for gi, group in enumerate(self.param_groups):
            _check_hyper(group["lr"], group["betas"], group["eps"],
                         group["weight_decay"])
            _check_switches(f"group {gi}", group)
            _check_switch_flags(f"group {gi}", group)     # edited since, maybe
        # before any state is added: _run_step raises for a num_threads this
        # machine has not (one kept by a pickle from a bigger machine), outside
        # the take-back below
        _check_num_threads(self.num_threads)
        items, added, written, named, counters = [], [], [], [], []
        # NOTE [ Held views ]: the checked numpy views of each parameter's
        # param and moments from the last applied step, reused while _layout
        # says they still describe the same memory
        views, seen = self._views, {}
        try:
            for gi, group in enumerate(self.param_groups):
                decoupled = bool(group.get("decoupled_weight_decay",
                                           self.decoupled_weight_decay))
                coefficients = _StepCoefficients(group, decoupled, grad_scale)
                for pi, p in enumerate(group["params"]):
                    # a dict may name some parameters only (an executor's
                    # host_grads() has those of the g_offload stages): the
                    # others take p.grad, as step() without grads would
                    g = grad_of[id(p)] if id(p) in grad_of else p.grad
                    if g is None:
                        continue
                    out = copy_of.get(id(p))
                    try:
                        # rtmem Buffers (the gradients of Buffer parameters)
                        # as pinned host views, as NumpyAdam takes them
                        g_np, g_fmt = as_numpy(_host_view(g, "grad"), "grad")
                        o_np, o_fmt = ((None, None) if out is None
                                       else as_numpy(_host_view(out, "copy"), "copy"))
                        st = self.state.get(p)
                        held = views.get(p)
                        if (held is not None
                                and _layout(p, st, group["amsgrad"]) == held.layout):
                            update = _prepare_again(held.arrays, held.bounds, held.shape, g_np,
                                                    grad_format=g_fmt, out=o_np,
                                                    out_format=o_fmt)
                        else:
                            st = self._state_for(p, group, added)
                            update = prepare_update(
                                p.detach().numpy(), g_np, st["exp_avg"].numpy(),
                                st["exp_avg_sq"].numpy(),
                                max_exp_avg_sq=(st["max_exp_avg_sq"].numpy()
                                                if group["amsgrad"] else None),
                                grad_format=g_fmt, out=o_np, out_format=o_fmt)
                            # not the gradient's or copy's views (they would
                            # pin those tensors)
                            held = _Held(_layout(p, st, group["amsgrad"]),
                                         (update.p, update.m, update.v, update.vmax),
                                         _state_bounds(update), tuple(p.shape),
                                         (st["exp_avg"], st["exp_avg_sq"], st["step"],
                                          st.get("max_exp_avg_sq")),
                                         _counter(st["step"]))
                        seen[p] = held
                    except OptimizerError as exc:
                        raise _named(f"group {gi} param {pi}", exc,
                                     _TORCH_ARGUMENTS) from None
                    c = coefficients(int(st["step"].item()) + 1)
                    items.append((update, c, st))
                    counters.append(held.counter)
                    if held.counter is not None:    # `+= 1` would bump its version
                        written.append(held.tensors[2])
                    named.append((f"group {gi} param {pi}", update))
                    written.append(p)
                    if isinstance(out, torch.Tensor):
                        written.append(out)
            _check_step_disjoint(named, _TORCH_ARGUMENTS)
        except BaseException:
            self._take_back(added)   # a refused step leaves no new state behind
            # and no view of it in this frame, which the traceback keeps: arena
            # buffers of the taken-back state go back now
            items.clear()
            named.clear()
            seen.clear()
            update = st = held = None      # noqa: F841
            raise
        if _run_step(self, items, grad_scale=grad_scale, check_finite=check_finite,
                     count_steps=lambda: _count_steps(items, counters)):
            # only parameters stepped now: one dropped from the groups (or
            # whose gradient went None) is not kept alive by its views
            self._views = seen
            bump_versions(written)
        else:                        # skipped (NOTE [ Skipped steps ]): nor does a skip
            self._take_back(added)
        return loss

    def state_dict(self):
        """``torch.optim.Optimizer.state_dict`` (``state`` and ``param_groups``,
        in ``torch.optim.Adam``'s layout) plus the top-level ``skipped_steps``
        and ``last_step_skipped`` (NOTE [ Skipped steps ]), which
        ``torch.optim.Adam``'s load ignores, as OffloadedAdam's dict has them.
        The post-hooks see the whole dict. As torch's, its state entries are
        the optimizer's live tensors (not copies): later steps change them,
        and another optimizer loading the dict in memory (``torch.optim.Adam``
        keeps what it is given) then shares them; ``copy.deepcopy`` it (or
        ``torch.save`` it) to keep a snapshot."""
        # a closed optimizer's empty state saved would restart every moment
        self._check_open("save a state dict")
        # torch's state_dict without its post-hooks, which run on the dict with
        # the counters (the same dict goes back: the hooks' handles refer to it)
        hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = {}
        try:
            state_dict = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = hooks
        state_dict["skipped_steps"] = self.skipped_steps
        state_dict["last_step_skipped"] = self.last_step_skipped
        return _post_hooked(self, state_dict, hooks)

    def load_state_dict(self, state_dict):
        """Load a state dict (from CPUAdam, CPUAdamW or torch.optim.Adam/AdamW).
        The state is copied into fresh contiguous float32 tensors, so the
        loaded dict is never aliased (with ``state_arena``, into the arena:
        the buffers of moments the optimizer already holds, which a
        :meth:`state_dict` taken earlier views and so sees the loaded values,
        and new buffers for the rest, an arena too small for them refusing
        the load with OutOfMemoryError); each saved state must have its step, an
        integer >= 0 (a state without one is refused, not restarted),
        each moment real floating point (torch.optim.Adam's load casts an
        integer, bool or complex one to the parameter's dtype; refused here,
        as by NumpyAdam and OffloadedAdam: no Adam saves one), each second
        moment (``exp_avg_sq``, ``max_exp_avg_sq``) >= 0 (torch.optim.Adam
        loads a negative one, and its next step makes the parameter NaN,
        silently; inf/NaN moments, which steps on non-finite gradients write,
        load as they are), and each parameter's
        state must have both ``exp_avg`` and ``exp_avg_sq`` (an Adamax state,
        with ``exp_inf``, is refused), and each state's index must be listed
        by a group (torch's load drops the state of an index it does not know,
        e.g. one a JSON round trip turned into a string: refused here). Groups keep the saved
        ``decoupled_weight_decay`` (the class default where the dict has none;
        :class:`CPUAdamW`, like ``torch.optim.AdamW``, always decouples); a
        group without ``amsgrad`` or ``maximize`` (an older torch's dict) takes
        False for it, as in ``torch.optim.Adam``. A group with ``capturable`` or ``differentiable``
        True is refused (as by the constructor): set them to False in the
        dict to load it. ``skipped_steps`` and ``last_step_skipped`` are
        restored (0 and False from a dict without them: torch's, an older
        rtmem's). A refused dict leaves the optimizer as it was.
        The pre-hooks run first (they may adapt the dict), the post-hooks only
        once the load is accepted."""
        self._check_open("load a state dict")
        state_dict = _pre_hooked(self, state_dict)
        _check_state_dict(state_dict)
        _check_torch_layout(state_dict)
        skips = _saved_skips(state_dict)
        for i, st in state_dict["state"].items():
            for key in _STATE_KEYS:
                # before torch's load, whose cast to the parameter's dtype
                # loaded an integer or bool moment as float, and kept a complex
                # one's real part only, under its generic ComplexWarning
                # (NumpyAdam and OffloadedAdam refuse such moments too)
                dtype = _moment_dtype(st.get(key), f"the state of parameter {i!r}", key)
                if dtype is not None and not dtype.is_floating_point:
                    raise OptimizerError(
                        f"the state of parameter {i!r} has {key} of dtype "
                        f"{dtype}; expected real floating point, "
                        f"{_MOMENT_DTYPE_HINT}", argument="state_dict")
        # torch installs new state and group dicts; the checks below run after
        # it, so keep the old ones to put back.
        old_state, old_groups = self.state, self.param_groups
        try:
            self._load_checked(state_dict)
            if self.state_arena is not None:   # last: nothing can refuse the load after
                load_into_arena(self.state, old_state, self.state_arena)
        except BaseException:
            self.state, self.param_groups = old_state, old_groups
            raise
        self.skipped_steps, self.last_step_skipped = skips
        _loaded(self)

    def _load_checked(self, state_dict):
        # torch's load without its hooks: the pre-hooks ran (once) before the
        # checks, and the post-hooks wait for the checks below. The same dicts
        # go back, which the hooks' removable handles refer to.
        hooks = (self._optimizer_load_state_dict_pre_hooks,
                 self._optimizer_load_state_dict_post_hooks)
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        try:
            super().load_state_dict(state_dict)
        except ValueError as e:
            if isinstance(e, OptimizerError):
                raise
            # torch's own refusal (groups of other sizes): rtmem's error type, as
            # every other refusal of a state dict here
            raise OptimizerError(f"{e}: the state dict belongs to another model or "
                                 f"grouping", argument="state_dict") from e
        finally:
            (self._optimizer_load_state_dict_pre_hooks,
             self._optimizer_load_state_dict_post_hooks) = hooks
        _check_state_listed(state_dict)     # torch's load set such state aside
        for gi, group in enumerate(self.param_groups):
            _check_adam_keys(gi, group)
            _check_group_hyper(f"group {gi} of the state dict", group)
            _check_switches(f"group {gi} of the state dict", group, loaded=True)
            _check_switch_flags(f"group {gi} of the state dict", group)
            self._check_decoupled(group["decoupled_weight_decay"],
                                  f"group {gi}: decoupled_weight_decay")
            for pi, p in enumerate(group["params"]):
                st = self.state.get(p)
                if not st:
                    continue
                step = _saved_step(st, f"group {gi} param {pi}", _MAX_STEP)
                # _state_for zero-fills a missing moment at the next step: an
                # Adamax state (exp_avg and exp_inf) then took its first step with
                # exp_avg_sq zero, ~10x too large, silently
                missing = [key for key in _STATE_KEYS[:2] if key not in st]
                if missing:
                    raise OptimizerError(
                        f"group {gi} param {pi}: the state has "
                        f"{', '.join(map(str, st))} but no {' or '.join(missing)}: it "
                        f"is not an Adam state dict; load one saved by CPUAdam, "
                        f"CPUAdamW, OffloadedAdam or torch.optim.Adam/AdamW",
                        argument="state_dict")
                for key in _STATE_KEYS:
                    if key not in st:
                        continue
                    t = torch.as_tensor(st[key])
                    if t.shape != p.shape:
                        raise OptimizerError(
                            f"state {key} has shape {tuple(t.shape)} but its param "
                            f"has shape {tuple(p.shape)}; the state dict belongs to "
                            f"another model.", argument="state_dict")
                    held = t.detach().to(device="cpu", dtype=torch.float32).clone(
                        memory_format=torch.contiguous_format)
                    _check_moment(f"group {gi} param {pi}", key, held.numpy())
                    st[key] = held
                st["step"] = torch.tensor(float(step), dtype=torch.float32)


def _moment_dtype(value, where, key):
    """The torch dtype a loaded moment ``value`` (a tensor, numpy array or nested
    list) loads as, or None if it is absent. OptimizerError naming ``where``
    (the parameter) and ``key`` if it is no array (a ragged nested list raised
    a bare ValueError from torch.as_tensor further on)."""
    if value is None or torch.is_tensor(value):
        return None if value is None else value.dtype
    try:
        return torch.as_tensor(value).dtype
    except (TypeError, ValueError, RuntimeError) as exc:
        raise OptimizerError(f"{where} has {key} that is no array ({exc}); expected a "
                             f"tensor, as state_dict() saves it",
                             argument="state_dict") from None


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


# Their public home: pickles, reprs and rtmem.optim.__all__ name rtmem.optim, whose
# __getattr__ resolves them, never this private module.
CPUAdam.__module__ = CPUAdamW.__module__ = "rtmem.optim"
