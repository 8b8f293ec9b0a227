"""Measure an ``nn.Sequential`` into a :class:`~rtmem.planners.Chain`.

For each stage, from a sample input (thesis-remat.md §5.1, "parameter
estimation"): the forward runs under ``enable_grad`` with ``saved_tensors_hooks``
recording what autograd saves, the backward runs with a random gradient of the
output's shape, and:

- ``x``: bytes of the output's storage;
- ``xbar``: bytes of the unique storages of the output and of every saved tensor,
  minus the model's parameters and buffers (batch norm saves its running
  statistics), the constant tables its modules hold as plain tensor attributes
  and, under ``torch.autocast``, autocast's cached casts of the parameters
  (model state for the executor too: NOTE [ Executor ] rule 4; a stage's own
  ``.to()`` of a parameter to autocast's dtype is taken for one, and left out
  too: ``_saved._cached_cast``) and the stage
  input (they are accounted as weights and as the previous activation; a
  cast, as neither), unless the stage modified its
  input in place before autograd saved it, or returns (a view of) its input:
  then the executor keeps that storage with abar, also once a_i is deleted,
  and so does ``xbar``;
- ``u_f``, ``u_b``: median seconds over ``repeats`` runs (CUDA events on a GPU,
  ``perf_counter`` on the CPU); ``u_b`` is 0 for a stage whose output needs no
  gradient (a frozen or parameter-free stage on integer inputs or a batch
  that does not require grad, and so every stage of a frozen prefix; a tensor
  attribute of a stage's modules that requires grad trains as a parameter
  does, NOTE [ Executor ] rule 2);
- ``o_f``, ``o_b``: temporary bytes, from ``torch.cuda.max_memory_allocated`` on a
  GPU (peak minus what is live before and after); 0 on the CPU, where no allocator
  reports a peak;
- ``w``: bytes of the stage's parameters, each storage counted once, at the
  first stage using it (tied weights, a module repeated in the Sequential);
- ``x0``: bytes of the input, numel x element size (the executor works on a
  compact copy when the batch views a larger storage);
- ``u_loss``: loss forward + backward seconds;
- ``o_loss``: the loss's temporary bytes (forward and backward: what a
  cross-entropy saves, the gradient's intermediates), measured as ``o_b`` is on
  a GPU (peak minus what is live before and the gradient left after); 0 on the CPU;
- ``no_recompute``: True for a stage that modifies its input in place (its
  first op is ``x.mul_(2)``, ``nn.ReLU(inplace=True)``, ...): a recomputation
  would read the modified input, which the executor refuses (NOTE [ Executor ]
  rule 7), so the planners must run it once (``plan_remat`` does).

Byte counts use the same storage accounting as
:class:`~rtmem.torch.ScheduleExecutor`, so simulated activation memory and the
executor's measured memory agree, except for a stage whose output shares its
input's storage (``nn.Identity``, a view, an in-place activation as the whole
stage): the chain cannot express sharing, so ``x`` counts that storage again,
which overstates memory (the safe direction); so does an output viewing part of a larger
storage (a slice of an intermediate), whose gradient delta is compact but counted as
``x``. Stages get their input as the executor hands
it (NOTE [ Executor ]), so in-place operations at the start of a stage work;
such a stage is timed on the input its previous run modified (sizes and times do
not depend on the values), and the first stage runs on a copy of ``inputs``.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch
from torch import nn

from rtmem.planners import Chain
from rtmem.planners._validation import check_int

from ._module_state import KeptBuffers, buffer_slots, slot_buffers, stage_state
from ._saved import _cached_cast, autocast_off, casts_outlive_forward, own_parametrizations
from ._stages import (ExecutionError, _check_output, _graph_leaves, _input_key, _rederived_input,
                      _stage_input, _storage_bytes, _storage_ptrs, as_stages, check_cross_stage,
                      check_inputs, check_loss, check_loss_fn, check_needs_grad,
                      differentiable, inputs_need_grad, node_mark, raised_in, stage_label)

__all__ = ["profile_sequential"]


class _Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0


def _peak_start(device) -> int:
    """Open a window for :func:`_peak_above` on CUDA ``device``: wait for the
    queued work, reset the peak and return the bytes allocated now."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_above(device, base: int, kept: int) -> int:
    """Temporary bytes of the work since :func:`_peak_start` returned ``base``:
    the peak over ``base`` less the ``kept`` bytes the work left allocated (its
    output, the gradient it made), at least 0."""
    return max(0, torch.cuda.max_memory_allocated(device) - base - kept)


def _earlier_stage(marks: list, i: int, seq: int):
    """The stage k < ``i`` whose forward recorded the autograd node numbered
    ``seq``, with ``marks[k]`` the :func:`node_mark` taken before stage k's
    first forward (stages run in order here); None for a node made before stage
    0's forward or by stage ``i``'s own (:func:`check_cross_stage`)."""
    if not marks[0] <= seq < marks[i]:
        return None
    return max(k for k in range(i) if marks[k] <= seq)


def _clear_grads(leaves, grads: dict, held: list) -> None:
    """Record the ``.grad`` of each of ``leaves`` not yet in ``grads`` (the same
    object, put back at the end) and set it to None for profiling, and hold
    their gradient hooks off until the end (:func:`_hold_hooks`, into ``held``):
    among them an open :class:`~rtmem.torch.OffloadedAdam`'s flush, which would
    take the profiler's gradients for the next step's."""
    for p in leaves:
        if p not in grads:
            grads[p] = p.grad
            p.grad = None
    # Every leaf so far, not only the new ones: a hook registered since on one
    # already held (by a stage's forward or forward hook setting up a gradient
    # flush at its first call) ran in the next backward on the profiler's
    # gradients. Called before each stage's backward passes and the loss's.
    _hold_hooks(grads, held)


def _held_hook(_):
    """What :func:`_hold_hooks` puts in place of a gradient hook: nothing."""
    return None


def _hold_hooks(leaves, held: list) -> None:
    """Hold off the tensor hooks (``register_hook``) and post-accumulate-grad
    hooks of ``leaves``, adding ``(hooks, hooks held)`` to ``held`` for
    :func:`_put_back_hooks`: the timed backward passes would run them on the
    profiler's gradients, and a hook that acts (the optimizer step in backward
    of PyTorch's tutorial, a gradient all-reduce) would change the weights or
    the optimizer's state. Each is replaced in place, under its own key, by
    :func:`_held_hook`: autograd calls the hooks of the dict the tensor holds,
    and a handle the caller removes meanwhile (from a module hook of a stage,
    or another thread) removes its key from that dict, so the hook stays
    removed. (Emptying the dict left such a handle nothing to remove, and the
    put-back registered the hook again.)"""
    for p in leaves:
        for hooks in (p._backward_hooks, p._post_accumulate_grad_hooks):
            # only those not held yet: called again for leaves held before, it
            # must not take _held_hook for a hook to put back
            new = {key: hook for key, hook in (hooks or {}).items()
                   if hook is not _held_hook}
            if new:
                held.append((hooks, new))
                for key in new:
                    hooks[key] = _held_hook


def _put_back_hooks(held: list) -> None:
    """Undo :func:`_hold_hooks`: each hook whose handle was not removed meanwhile
    back under its key, in its place, before any hook registered meanwhile (by
    a stage's forward)."""
    for hooks, hooks_held in held:
        for key, hook in hooks_held.items():
            if key in hooks:
                hooks[key] = hook


def profile_sequential(model: nn.Sequential, inputs: torch.Tensor, target, loss_fn, *,
                       repeats: int = 3, name: str = "", progress=None) -> Chain:
    """Profile ``model`` (an ``nn.Sequential`` of stages, or a list of modules) on
    one batch.

    ``inputs``/``target`` are a representative batch and ``loss_fn(output, target)``
    the loss. ``repeats`` (>= 1) timed runs per operation, median kept.
    ``progress``, if given, is called as ``progress(done, total)`` after each
    stage and after the loss (``total`` = stages + 1), for a progress bar on
    long profiles (``rtmem profile`` draws one). Parameter
    gradients (the same ``.grad`` objects, with their values, also of tensors
    outside the model that a stage or the loss uses), module buffers (of the
    model and of a loss that is an ``nn.Module``; updated in place or reassigned)
    and the RNG state (of the default generators, and of the ``torch.Generator``
    objects the modules hold as attributes) are restored afterwards, also after
    an error, so profiling does not perturb training. The gradient hooks of
    those parameters and tensors (``register_hook``,
    ``register_post_accumulate_grad_hook``: an optimizer step in backward, a
    gradient all-reduce) do not run on the profiler's gradients: they are held
    off while it runs (also those registered meanwhile, by a stage's forward
    or a module hook, before the backward passes that would run them) and put
    back afterwards, also after an error. Module
    hooks (forward, backward) run, as part of the stages, as the executor runs
    them at every forward and backward of a stage (recomputations included):
    a module hook with side effects (one that logs statistics) sees the
    profiling passes too. Inside
    ``torch.nn.utils.parametrize.cached()`` each forward computes the
    parametrized weights in a cache of its own, as the executor's forwards do
    (NOTE [ Executor ] rule 1), and the caller's cache is left as it was. Returns a
    :class:`~rtmem.planners.Chain` with times in seconds and sizes in bytes. Raises
    :class:`~rtmem.torch.ExecutionError` for a model, batch or loss it cannot run
    (before running any stage), when a stage does not return a single tensor or
    reads a tensor with autograd history that another stage's forward made and
    handed over outside the outputs (a module attribute the stages share: its
    gradient would be lost under recomputation), and
    when ``loss_fn`` returns what :class:`~rtmem.torch.ScheduleExecutor` refuses
    at ``L`` (not a 0-d tensor, or a loss without autograd history), with the
    executor's message, found at the loss's first call (after the stages were
    measured) and before its backward. An exception raised by a stage's forward
    or backward or by the loss propagates unchanged, with a note naming where
    (``rtmem: raised in the forward of stage 2 (Block)``). Stages that modify their input in place
    are marked ``no_recompute`` in the chain: :func:`~rtmem.planners.plan_remat`
    and :func:`~rtmem.planners.plan_floating` then never recompute them (a
    recomputation would read the modified input, and the executor refuses it),
    and Revolve, which recomputes every stage, refuses the chain.
    """
    model = as_stages(model, "profile_sequential")
    check_inputs(inputs)
    if torch.is_inference_mode_enabled():
        # autograd records nothing there: it failed with torch's "Inference tensors
        # do not track version counter" after running the first stage
        raise ExecutionError(
            "profile_sequential measures backward passes, so it cannot run under "
            "torch.inference_mode() (autograd records nothing there); call it outside "
            "inference_mode")
    check_loss_fn(loss_fn)
    repeats = check_int("repeats", repeats, low=1, error=ExecutionError)
    if progress is not None and not callable(progress):
        raise ExecutionError(f"progress must be a function progress(done, total) or None, "
                             f"got {type(progress).__name__}")
    device = inputs.device
    timer = _Timer(device)
    # a loss module's buffers and gradients are the caller's too
    slots = buffer_slots(model) + (buffer_slots(loss_fn) if isinstance(loss_fn, nn.Module)
                                   else ())
    buffers = KeptBuffers(slots)
    cuda = device.type == "cuda"
    # dropout and the random output gradients below draw from the generator of
    # the input's device too
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if cuda else None
    # and so do stages from generators of their own (NOTE [ Executor ] rule 6):
    # each repeat draws again, which would leave them advanced past plain training
    modules = [*model.modules(), *(loss_fn.modules() if isinstance(loss_fn, nn.Module)
                                   else ())]
    gens = [(g, g.get_state()) for g in stage_state(modules)[1]]
    cols = {k: [] for k in ("u_f", "u_b", "x", "xbar", "w", "o_f", "o_b")}
    # the backward passes below accumulate into .grad in place: profile with
    # none, and put the caller's tensors back afterwards (also those of leaves
    # outside the model that a stage or the loss uses, see _clear_grads). Taken
    # inside the try: whatever raises after it (a storage the accounting cannot
    # read, an out-of-memory clone of the batch) must give them back and put
    # back the gradient hooks it held (an open OffloadedAdam's among them)
    grads, held = {}, []
    try:
        _clear_grads(model.parameters(), grads, held)
        # never counted as activations: the executor's accounting (its _state_count)
        state = _storage_ptrs((*grads, *slot_buffers(slots)))
        x = inputs.detach().clone()   # a first stage may modify its input in place
        stage_params = [list(stage.parameters()) for stage in model]
        # asked out of any stage, as the executor's _SavedHooks asks it
        casts_kept = casts_outlive_forward(device.type)
        # parameters, buffers and tensor attributes (a learnable offset), as the
        # executor decides at the start of a step
        stage_tensors = [[*params, *stage.buffers(), *stage_state(stage.modules())[0]]
                         for params, stage in zip(stage_params, model)]
        needs_grad = inputs_need_grad(stage_tensors, inputs.requires_grad)
        seen_weights = set()
        in_place = []   # stages that modify their input in place: never recomputed
        marks = []      # node_mark() before each stage's first forward
        # Iteration, not children(): a module repeated in the Sequential is one
        # stage per position, as the executor runs it.
        for i, stage in enumerate(model):
            saved = []
            label = stage_label(model, i)

            def pack(t, saved=saved):
                # whether it is autocast's cached cast: asked here, in the
                # autocast region the op saving it runs in (the stage's own too)
                cached = casts_kept and _cached_cast(t)
                # held and packed detached (same storage and version counter), as
                # the executor's pack does: t's grad_fn leads to the nodes holding
                # this hook, and to t itself where an op saves its output
                # (softmax), a cycle through C++ the collector cannot break, which
                # kept the graph of every forward not backpropagated for good
                t = t.detach()
                saved.append((t, t._version, cached))
                return t

            fwd_times = []
            with torch.enable_grad():
                marks.append(node_mark())
            for r in range(repeats):
                saved.clear()
                if cuda:
                    base = _peak_start(device)
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                        pack, lambda t: t):
                    # as the executor's F_all hands it: as it is to a stage whose
                    # input needs no gradient (the batch, a frozen prefix)
                    xin, arg = _stage_input(x, needs_grad=needs_grad[i])
                    x_version = arg._version
                    with own_parametrizations(), raised_in(f"the forward of {label}"):
                        y, t_f = timer(lambda: stage(arg))   # as the executor's F_all
                _check_output(i, stage, y)
                check_needs_grad(i, stage, y, needs_grad, xin)   # as the executor's F_all
                if r == 0:   # before a backward runs into another stage's graph
                    check_cross_stage(i, y, partial(_earlier_stage, marks, i), model,
                                      casts_kept)
                fwd_times.append(t_f)
                # the version counter arg shares with x: any in-place op on the input
                if r == 0 and arg._version != x_version:
                    in_place.append(i)
            # The executor re-derives a saved view of the input from a_i at B i
            # (its _forward_all), unless the stage changed the input before
            # saving it: then abar keeps the input's storage.
            # An output sharing the input's storage (an in-place dropout saving
            # its mask) keeps that storage alive in abar too: the executor never
            # frees it while abar_{i+1} is resident, even when a_i is deleted.
            x_key = _input_key(xin)
            # constant tables the stage holds (after its forward: a lazy cache is
            # made there) are model state for the executor too
            state = state | _storage_ptrs(stage_state(stage.modules())[0])
            exclude = state if (x_key is not None and _input_key(y) == x_key) or any(
                t.untyped_storage().data_ptr() == x_key
                and not _rederived_input(t, version, x_key, x_version, arg.dtype)
                for t, version, _ in saved) else state | {x_key}
            # autocast's cached casts of parameters (and of other leaves that
            # require grad) are model state for the executor (its
            # _SavedHooks.pack), held by the cache, not by abar
            xbar = _storage_bytes([y, *(t for t, _, cached in saved if not cached)],
                                  exclude=exclude)
            o_f = 0
            if cuda:
                o_f = _peak_above(device, base, xbar)
            # complex outputs get a complex delta (randn_like draws one); a delta
            # of None for them made backward fail ("implicitly created only for
            # scalar outputs")
            delta = torch.randn_like(y) if differentiable(y) else None
            _clear_grads(_graph_leaves(y, xin), grads, held)
            # nothing to backpropagate through a frozen stage on integer inputs
            bwd_times = [] if y.requires_grad else [0.0]
            for r in range(repeats if y.requires_grad else 0):
                if cuda:
                    base = _peak_start(device)
                # outside the caller's autocast, as the executor runs its Bs
                with autocast_off(device), raised_in(f"the backward of {label}"):
                    _, t_b = timer(lambda: torch.autograd.backward(
                        y, delta, retain_graph=r < repeats - 1))
                bwd_times.append(t_b)
                xin.grad = None
            o_b = 0
            if cuda and y.requires_grad:
                o_b = _peak_above(device, base, _storage_bytes([xin]))
            cols["u_f"].append(statistics.median(fwd_times))
            cols["u_b"].append(statistics.median(bwd_times))
            cols["x"].append(_storage_bytes([y]))
            cols["xbar"].append(max(xbar, _storage_bytes([y])))
            params = stage_params[i]
            cols["w"].append(_storage_bytes(params, exclude=seen_weights))
            seen_weights |= _storage_ptrs(params)
            cols["o_f"].append(o_f)
            cols["o_b"].append(o_b)
            x = y.detach()
            if progress is not None:
                progress(i + 1, len(model) + 1)
        loss_times, o_loss = [], 0
        for r in range(repeats):
            with torch.enable_grad(), own_parametrizations():
                leaf, z = _stage_input(x)   # as the executor's L hands it to loss_fn
                if r == 0:   # untimed: find the leaves outside the model it uses
                    with raised_in("the loss function"):
                        loss = loss_fn(z, target)
                    # refused as the executor's L refuses it, before a backward
                    # from it raises torch's error (or trains nothing)
                    check_loss(loss, z, stage_tensors, inputs.requires_grad, model)
                    _clear_grads(_graph_leaves(loss, leaf), grads, held)
                    # its graph holds what the loss saved: not alive under o_loss's base
                    loss = None

            def run():
                with torch.enable_grad(), own_parametrizations(), \
                        raised_in("the loss function"):
                    loss = loss_fn(z, target)
                with autocast_off(device), raised_in("the backward of the loss"):
                    loss.backward()
            if cuda:
                base = _peak_start(device)
            loss_times.append(timer(run)[1])
            if cuda:
                # as o_b: the peak over what was live (a_L among it) and the
                # gradient left behind (delta_L, in a_L's slot in the chain's
                # model). For a cross-entropy over logits: log_softmax's saved
                # output and the gradient's intermediates. Left at 0, a GPT-2
                # plan undercounted its measured peak by 6.2 GB (bench/train.py,
                # batch 16 x 1024 tokens, 3.3 GB of logits) on an H200.
                d_loss = leaf.grad
                o_loss = max(o_loss, _peak_above(
                    device, base, _storage_bytes([d_loss]) if d_loss is not None else 0))
        if progress is not None:
            progress(len(model) + 1, len(model) + 1)
    finally:
        try:
            buffers.restore()
        finally:
            for p, g in grads.items():
                p.grad = g
            _put_back_hooks(held)
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, device)
            for g, g_state in gens:
                g.set_state(g_state)
    flags = [i in in_place for i in range(len(model))]
    return Chain(**cols, x0=inputs.numel() * inputs.element_size(), no_recompute=flags,
                 u_loss=statistics.median(loss_times), o_loss=o_loss,
                 name=name or f"profiled-{len(model)}-stages")
