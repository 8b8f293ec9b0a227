"""Replay a schedule in autograd: rematerialization, activation offload, weight and
gradient moves, on an ``nn.Sequential``.

NOTE [ Executor ]
Each operation of a :class:`~rtmem.planners.Schedule` maps onto PyTorch
(thesis-remat.md §5.1, Table 2.1; the simulator's NOTE [ Simulator semantics ]):

1. ``F_none i`` / ``F_ck i``: stage i under ``no_grad``; F_none drops its plain
   input, F_ck keeps it. The output is a plain tensor a_{i+1} (detached when
   the stage enabled grad itself and gave it autograd history). Under
   ``torch.autocast`` with torch < 2.11, autocast's cache is off for them: that
   torch cached a weight's cast made under no_grad and handed it, with no
   autograd history, to the later F_all reading the weight, whose gradient was
   then silently lost (pytorch issues 112583 and 158232, fixed in 2.11).
   In eval mode, torch's attention fast path (``torch.backends.mha``: the
   fused ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` kernels
   taken when autograd is off) is turned off for them when the stage's output
   needs a gradient, so they compute what a training forward computes, bit
   for bit (with it, gradients came out a few ulp from plain training's).
   Inside ``torch.nn.utils.parametrize.cached()``, every forward of a stage
   (and the loss) computes the parametrized weights in a cache of its own,
   the caller's put back afterwards: one filled under no_grad handed the
   weight, with no autograd history, to the later F_all, and the
   parametrization got no gradient. A stage that differentiates inside its
   forward (``torch.autograd.grad``: a gradient penalty) fails there unless it
   enables grad for that itself; torch's error ("does not require grad and
   does not have a grad_fn") becomes an :class:`ExecutionError` naming the
   stage and the remedy.
2. ``F_all i``: stage i under ``enable_grad`` from a detached leaf that requires
   grad (its ``.grad`` becomes delta_i) when a_i is floating-point or complex
   (integer a_i, token ids, carry no gradient), handed to the stage through an identity
   autograd op so that in-place ops at the start of a stage work as in plain
   training. A stage whose input needs no gradient in plain autograd (stage 0
   unless the batch requires grad, and every stage up to the first with a
   parameter, buffer, or tensor its modules hold as an attribute (rule 4: a
   learnable ``self.offset = torch.zeros(8, requires_grad=True)``), that
   requires grad: a frozen prefix; decided at the start of every step, as
   ``requires_grad`` may change between steps) gets its input itself, as
   plain autograd neither records what only an input gradient needs nor
   computes one. A grad-mode forward of such a stage whose output requires
   grad all the same (it reads a tensor that requires grad from a global or a
   closure, which the executor cannot see) raises :class:`ExecutionError`,
   where handing the next stage its input without gradient would silently
   give that tensor none. When the batch requires grad, ``B 0`` passes
   delta_0 on to it (``inputs.grad``, or the caller's graph that made it, as
   ``loss.backward()`` would). The recorded graph (its saved tensors) and the
   output form abar_{i+1}. Saved tensors go through ``saved_tensors_hooks``
   so the executor knows their storages (for accounting and offload); views
   of the stage's parameters, buffers and input are re-derived when the
   backward reads them (a lazy conjugate view, ``z.conj()`` of a complex one,
   with its conj bit).
   A forward whose output (a_{i+1} or abar_{i+1}) is already resident keeps
   the resident one, as the simulator does.
3. ``L``: the loss on a_n; its gradient is delta_n. ``B i``: backward through the
   graph of abar_{i+1} with delta_{i+1}; the input's ``.grad`` is delta_i, as
   the stage's backward made it (the identity op puts it there): plain
   autograd hands that tensor to the previous stage's backward, where the
   leaf's AccumulateGrad would lay it out like a_i (a Flatten's contiguous
   gradient of a channels_last a_i), and the previous stage would compute on
   another layout, with other rounding (under compiled autograd it still does).
   Under ``torch.autocast``, L's backward and every B run with autocast off
   (``_saved.autocast_off``), as torch's recipe calls ``loss.backward()``
   after the region; the forwards (recomputations included) and the loss run in it.
   Parameter gradients accumulate in ``.grad`` as with ``loss.backward()``; a
   parameter several stages use (tied weights) gets one part per stage, each
   added by that stage's B. A gradient hook on it would run once per part, where
   ``loss.backward()`` runs it once on the sum, so such a parameter with tensor
   hooks or post-accumulate-grad hooks is refused with :class:`ExecutionError`,
   at construction and at every step, unless the hooks are rtmem's own that add
   up what they get (:class:`~rtmem.torch.OffloadedAdam`'s gradient flush). A B i
   with nothing to backpropagate (a frozen or parameter-free stage on integer
   inputs, or an output nothing used) is skipped, and delta_i is None. A step
   whose loss needs no gradient at all, where ``loss.backward()`` raises, is
   refused with :class:`ExecutionError` before any gradient is written: at L
   when the loss does not require grad, or at the first ``B i`` (from ``B n-1``
   down) whose abar_{i+1} output has no autograd history while nothing has
   written a gradient yet: the loss reads nothing else that requires grad (a
   loss module's parameter, a target that requires grad), and the Bs after
   ``B i`` wrote only delta (their stages frozen). The cause is every parameter
   frozen with a batch that needs no gradient, or a stage detaching its output
   (``.detach()``, ``torch.no_grad()``) with every stage after it frozen: the
   loss, and each stage after one that trains, get a leaf that requires grad
   whatever a_i needs (rule 2), so without the check such a step trained
   nothing, silently.
4. ``offload`` copies the storages of a tensor (abar: output and saved tensors)
   to host memory; ``delete`` frees the device storages with
   ``untyped_storage().resize_(0)``, which keeps every tensor object (and the
   autograd graph) intact; ``prefetch`` re-allocates and copies back, each
   storage from its newest host copy (two stored tensors may share a storage
   that a stage changed in place between their offloads).
   Storage-level copies do not bump version counters, so autograd's in-place
   checks stay quiet. A storage is *protected* (:meth:`ScheduleExecutor._protected`)
   and never freed when it belongs to a parameter or buffer of the model, to
   a tensor a stage's module holds as a plain attribute (a constant table
   such as a rotary or mask cache, ``self.table = t``, which autograd may
   save; a constant a stage reads from outside the model, a global or a
   closure, is not known to the executor: make it a buffer or an attribute;
   an activation a module keeps as an attribute, ``self.last = h``, is such
   state too: never freed, and counted neither as activation nor as weight;
   so is autocast's cached cast of a parameter, which its cache holds for the
   whole ``torch.autocast`` region and hands to every later forward; also
   when the stage enters ``torch.autocast`` itself inside a caller's region,
   enabled or not, whose end alone clears the cache),
   to the caller's inputs or target, or to the output or saved tensors of another
   resident stored tensor (an ``nn.Identity`` or view stage returns its input's
   storage, batch norm saves its running statistics): a delete leaves it on the
   device, as its other owner needs it. Conversely, dropping or consuming a
   tensor also frees its storages that other stored tensors hold without
   needing them (the leaf input of an abar built from it, a deleted view of
   it), as the simulator does. A schedule that frees a_0 before ``B 0`` runs on
   a private copy of the caller's batch, and so does a batch that autograd
   refuses to change in place (rule 7).
5. ``w_offload``/``w_delete``/``w_prefetch`` swap the parameters' ``.data`` with an
   empty placeholder and back (a host copy of this step's weights is kept; a
   ``state_dict()`` taken mid-step, by the ``loss_fn`` or a signal handler
   saving a checkpoint, holds that host copy in the placeholder's place);
   ``g_offload i`` moves the stage's parameter gradients into host accumulators
   (:meth:`host_grads`). Schedules that move the weights of a parameter shared
   by several stages (tied weights), ``g_offload`` of some but not all of the
   stages using a parameter (its gradient would be split between
   :meth:`host_grads` and ``.grad``), or weights or gradients that
   :func:`~rtmem.torch.place_parameters` put in an arena, are refused with
   :class:`ExecutionError` before any work: a move would free a weight another
   stage still reads, or take it out of its arena. A stored activation that is
   a view of a weight (a stage returning ``w.expand(...)``) keeps the old
   storage alive through a weight move: those bytes then count as activation
   bytes, beyond what the simulator, which frees the weights, counts.
6. Every execution of a stage after its first restores the RNG state of the first
   (dropout draws the same masks) and the module buffers, updated in place or
   reassigned (batch-norm running statistics are updated once per step, as in
   plain training). The RNG state is that of the default generators (the
   CPU's and the batch's CUDA device's) and of every ``torch.Generator`` the
   stage's modules hold as attributes (``self.gen = torch.Generator()``, or in
   a list, tuple or dict attribute; found as rule 4 finds constant tables, at
   the start of each step): a recomputation runs from the state each had
   before the first forward, and afterwards each is put back where it was, so
   it ends the step advanced once, as in plain training. A generator the
   executor cannot see (a global, a closure, one passed through
   ``functools.partial``, or one a forward creates, which is seen from the next
   step on) is neither replayed nor put back: a recomputation draws new
   numbers from it (other noise than the first forward: wrong gradients) and
   advances it again; hold it as a module attribute made before the step.
   A stage the schedule recomputes on another device (a batch on ``mps`` or
   ``xpu``, a CPU batch with the stage's weights on a GPU) is refused with
   :class:`ExecutionError` at the start of the step, as its generator would
   not be replayed.
   With ``preserve_rng_state=False`` no generator is replayed. A
   recomputation also reads the buffers the first forward read: a stage whose
   output depends on a buffer it updates (spectral norm's power iteration, an
   EMA codebook, a step counter) computes what the first forward computed, as
   in plain training, where ``torch.utils.checkpoint`` would read the updated
   ones. The first forward of a stage the schedule runs again copies the
   stage's buffers and keeps, for the step, those it changed (a reassigned
   slot, a moved version counter: any in-place op, or another storage:
   ``self.buf.data = new``). A buffer changed in place through ``.data``
   (``self.buf.data.mul_(0.9)``), which moves no version counter, is found
   by comparing its values after the stage's first forward in the first step
   whose schedule recomputes the stage (a device sync per buffer, once), and
   kept at every later step; a stage that starts changing a buffer that way
   only after that step
   (every k steps, or under a condition the first step did not meet) is not
   seen, and its recomputation reads the buffer as the first forward left it
   (wrong gradients where the output depends on it): update it with an
   in-place op on the buffer itself (``self.buf.mul_(0.9)`` under
   ``torch.no_grad()``) instead.
   These buffer copies are memory no plan counts (neither the chain's
   ``xbar``/``o_f`` nor :attr:`peak_bytes`), for the stages the schedule runs
   more than once only: with B_i the bytes of all the buffers of such a stage
   i and C_i those its first forward changes, its first forward copies B_i
   (C_i of it kept to the end of the step) and each recomputation copies B_i
   again (to put them back after it), so the device holds up to
   sum(C_j over those stages) + max(B_i) bytes beyond the plan. Batch norm's
   statistics are tiny next to a stage's activations (2 x channels values);
   a causal-mask buffer is copied for the first forward only (it is not
   changed); an EMA codebook (K codes x D dims, and an EMA of it of the same
   size) is kept: 16 MiB in float32 at K = 8192, D = 256, half of that
   stage's 32 MiB input at batch 32 on a 32 x 32 latent grid. Leave room for
   it in the budget given to the planner: after a step with ``track_memory``,
   :attr:`ScheduleExecutor.buffer_copy_bytes` is the most bytes of such copies
   the last step held at once (within that bound).
7. A stored tensor records its version counter. A stage (or the loss) may modify
   its input in place, but a stored tensor read again after such a change (to
   recompute from it, or by a backward that saved it) would give wrong values,
   so reading it raises :class:`ExecutionError`, where plain autograd raises its
   "modified by an inplace operation" error for saved tensors.
   :func:`~rtmem.torch.profile_sequential` marks a stage that changes its
   input ``no_recompute`` in the chain, and ``plan_remat`` then runs it once
   (as ``F_all``), so its plans never meet this error. Stage 0 gets an
   alias of the batch, on which in-place ops are allowed; a batch that is a leaf
   requiring grad (or a view of one), which plain autograd refuses to change in
   place, is copied first (the stages never change the caller's batch), and a
   grad-mode forward of stage 0 (``F_all 0``) whose change autograd recorded
   raises :class:`ExecutionError` at once, as plain autograd refuses it; a
   change under the stage's own ``torch.no_grad()`` is allowed, as in torch.
   Under the executor's ``no_grad`` (``F_ck 0``, ``F_none 0``) the two cannot
   be told apart: the change goes on the copy, and a recomputation of stage 0
   then finds a0 changed (above).

On a CUDA device every move (activations, weights, gradients) is a copy on a
dedicated H2D / D2H stream to or from pinned memory, so it overlaps compute:
compute waits for a prefetch's event before reading the tensor (for weights:
before stage i's next forward or backward), a prefetch waits for the offload
that wrote its host copy, and the device storages a copy reads or writes are
marked used on its stream (``record_stream``), so a ``delete`` (or any drop)
frees them behind the copy without stalling compute, as Rule 5 of the simulator
assumes. Offloaded gradients are added to their host accumulators only when
:meth:`ScheduleExecutor.host_grads` asks for them (after their copies end). At
the end of a step compute waits for both copy streams, so the optimizer sees
every weight and gradient in place. On the CPU the same code paths run
synchronously, so the semantics are tested on any machine.

This module holds what a user calls and what is checked before a step runs;
the step loop and its compute operations (F, L, B) are in ``_replay.py``, the
activation moves in ``_moves.py``, the weight and gradient moves in
``_host_side.py``, the byte counts in ``_bookkeeping.py``: all follow this note.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter

import torch
from torch import nn

from rtmem.arena import is_arena
from rtmem.errors import ScheduleError
from rtmem.planners import Chain, Op, Platform, Schedule, simulate
from rtmem.planners._validation import type_label

from ._bookkeeping import _Bookkeeping
from ._host_side import _HostSide
from ._module_state import buffer_slots, slot_buffers, stage_state
from ._moves import _ActivationMoves, _check_graph_moves
from ._replay import _StepReplay
from ._stages import (_WEIGHT_MOVES, ExecutionError, as_stages, check_inputs, check_loss_fn,
                      check_placement, check_shared_hooks, check_shared_weights,
                      shared_parameters)

__all__ = ["ScheduleExecutor", "ExecutionError"]


class ScheduleExecutor(_StepReplay, _Bookkeeping, _HostSide, _ActivationMoves):
    """Run training steps of ``model`` following ``schedule``.

    Parameters
    ----------
    model:
        An ``nn.Sequential`` (or a list of modules) whose items are the chain's
        stages, each taking
        and returning a single tensor. Their parameters and buffers are listed
        once, here: build a new executor after adding or replacing any (``.data``
        swaps and in-place updates are fine); a stage appended to, removed from or
        replaced in the ``nn.Sequential`` or list after this is refused by :meth:`step`
        (:class:`ExecutionError`). A parameter several stages share
        (tied weights) must have no gradient hooks, here and at every step
        (:class:`ExecutionError`; NOTE [ Executor ] rule 3).
    schedule:
        A :class:`~rtmem.planners.Schedule`, or any object with a ``.schedule``
        (a planner's ``Plan``). It is validated against ``len(model)`` stages
        first; a plan for another chain length is refused with
        :class:`ExecutionError`, and so is one that moves the weights of a
        parameter shared by several stages, or the weights or gradients of
        parameters placed in an arena (NOTE [ Executor ] rule 5; placement is
        checked again at every step). It is decoded once, here; a
        :class:`~rtmem.planners.Schedule` assigned to :attr:`schedule` later
        is checked and decoded alike by the next :meth:`step`.
    loss_fn:
        ``loss_fn(output, target) -> scalar tensor``. It runs at the schedule's
        ``L``, where a weight the schedule has moved off the device
        (``w_offload``, ``w_delete``) is an empty placeholder: a loss term on a stage's
        weights (an L2 penalty) needs a schedule that keeps them there
        (``model.state_dict()`` gives their host copies).
    preserve_rng_state:
        Replay recomputations with the RNG state of the first execution (needed
        for dropout; costs a state copy per step for each stage the schedule
        recomputes, and per generator its modules hold: NOTE [ Executor ] rule 6;
        stages run once copy nothing).
    host_arena:
        A :class:`~rtmem.HostArena` (pinned) that receives offloaded activations.
        Its buffers are freed at the end of every step. Without one, offloaded data
        goes to torch's pinned memory (CPU tensors on the host backend).
    track_memory:
        Record the activation bytes after every operation (below). The count is
        kept up to date as tensors are stored, dropped, freed and restored (a
        few dictionary updates per tensor; it used to walk every stored tensor
        after every operation, which made a step of n small stages O(n^2));
        ``False`` only skips recording it (the attribute may be flipped
        between steps).

    After :meth:`step` with ``track_memory``, ``peak_bytes`` is the largest number
    of activation bytes (unique device storages of stored tensors and gradients,
    parameters and buffers excluded) held between two operations, the quantity
    the simulator's memory counts for activations, and ``resident_bytes`` that
    count after each operation. ``buffer_copy_bytes`` is the largest number of
    bytes of buffer copies held at once for recomputed stages (NOTE [ Executor ]
    rule 6), which neither ``peak_bytes`` nor any plan counts: add it to the
    budget given to the planner. Without tracking, ``peak_bytes`` and
    ``buffer_copy_bytes`` are ``None`` and ``resident_bytes`` empty.
    """

    def __init__(self, model: nn.Sequential, schedule, loss_fn, *,
                 preserve_rng_state: bool = True, host_arena=None,
                 track_memory: bool = True):
        # what step() checks the stages against: the user's list when given one
        # (as_stages wraps it in a Sequential of our own, which no one changes)
        self._given = model
        model = as_stages(model, "ScheduleExecutor")
        # the batch a Plan's memory was planned for (Plan.info "input_bytes": the
        # profiled input's bytes), to warn at a larger one; None once warned
        planned = getattr(schedule, "info", None)
        planned = planned.get("input_bytes") if isinstance(planned, dict) else None
        self._planned_input = planned if type(planned) is int and planned > 0 else None
        schedule = getattr(schedule, "schedule", schedule)
        if not isinstance(schedule, Schedule):
            raise ExecutionError(f"schedule must be a Schedule or a Plan, got "
                                 f"{type_label(schedule, Schedule)}")
        check_loss_fn(loss_fn)
        for flag, value in (("preserve_rng_state", preserve_rng_state),
                            ("track_memory", track_memory)):
            if not isinstance(value, bool):
                raise ExecutionError(f"{flag} must be True or False, got {value!r}")
        if host_arena is not None and not is_arena(host_arena, "host"):
            raise ExecutionError(f"host_arena must be an rtmem.HostArena or None, got "
                                 f"{host_arena!r}")
        self.n = len(model)
        self.model = model
        self.loss_fn = loss_fn
        self.preserve_rng_state = preserve_rng_state
        self.track_memory = track_memory
        # Iteration, not children(), which skips a module repeated in the Sequential.
        self.stages = list(model)
        # Module structure is fixed while the executor lives: walking the module
        # tree for every F_all was ~9% of a CPU step of small stages.
        self._stage_params = [list(stage.parameters()) for stage in self.stages]
        # Buffers by slot: a forward may reassign one (rule 6). Plain tensor
        # attributes of the stages' modules (constant tables) are model state too,
        # found by module as a forward may assign them (rule 4)
        self._buffer_slots = [buffer_slots(stage) for stage in self.stages]
        self._stage_modules = [list(stage.modules()) for stage in self.stages]
        self._scan_state()
        self._param_names = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self._param_names.setdefault(p, name)
        for name, b in model.named_buffers(remove_duplicate=False):
            self._param_names.setdefault(b, name)   # for errors about saved buffers
        self._compiled = None
        self._compile(schedule)
        self._shared = shared_parameters(self._stage_params)   # tied weights
        check_shared_hooks(self._shared, self._param_names)
        self.peak_bytes: int | None = 0 if track_memory else None
        self.resident_bytes: list[int] = []
        self.buffer_copy_bytes: int | None = 0 if track_memory else None
        self._copies_kept = 0   # bytes of the FirstBuffers copies kept this step
        super().__init__()
        self.host_arena = host_arena
        self._streams = None
        self._new_ledger()
        self._caller_keys: set = set()
        self._caller_inputs = None   # the batch during a step, when it requires grad
        self._fixed_batch = False    # whether autograd refuses in-place ops on it
        self._op_index = 0   # of the operation running, for error messages
        # recomputed stage -> the indices of its buffer slots that its first
        # forward changes through .data (no version bump), found by comparing
        # values at the first step that recomputes it (rule 6)
        self._by_value: dict[int, frozenset] = {}
        # stage -> its first forward's RNG states and FirstBuffers, for the
        # step's recomputations (emptied when the step ends)
        self._first: dict[int, tuple] = {}

    def _compile(self, schedule: Schedule) -> None:
        """Check ``schedule`` against the model and derive, once, what every step
        reads from it: its operations as Python values (decoding the arrays
        was an enum construction per operation per step), the weight and
        gradient moves per stage, whether a0 is freed and which stages are
        recomputed. :meth:`step` compiles again when :attr:`schedule` was
        replaced since. Raises :class:`ExecutionError` with the executor
        unchanged."""
        try:   # structural check: ranges, order, inputs present, complete backward
            simulate(Chain.homogeneous(self.n), schedule, Platform(math.inf))
        except ScheduleError as e:
            raise ExecutionError(f"the schedule cannot run on this model of {self.n} stages "
                                 f"(was it planned for another chain?): {e}") from e
        _check_graph_moves(schedule)
        ops = tuple(schedule)
        # stage -> the weight and gradient moves the schedule makes on it
        moves: dict[int, set] = {}
        for op, s, _ in ops:
            if op in _WEIGHT_MOVES or op == Op.G_OFFLOAD:
                moves.setdefault(s, set()).add(op)
        check_shared_weights(self._stage_params, moves, self._param_names)
        check_placement(self._stage_params, moves, self._param_names)
        self.schedule = self._compiled = schedule
        self._ops, self._moves = ops, moves
        # If the schedule frees a0 before B 0 (a delete, or F_none 0 consuming it),
        # work on a private copy, which it can free: the caller holds its batch,
        # which may also share its storage with other tensors (targets are often
        # a view of the same tokens).
        self._own_input = any(op in (Op.DELETE, Op.F_NONE) and k == 0 for op, k, _ in ops)
        # Stages the schedule runs more than once: their first forward keeps the
        # buffers it read and the RNG states, for the recomputations (rule 6)
        forwards = Counter(s for op, s, _ in ops if op in (Op.F_NONE, Op.F_CK, Op.F_ALL))
        self._recomputed = {s for s, count in forwards.items() if count > 1}
        # Stages whose first grad-mode forward under this schedule is still to be
        # checked for a tensor with autograd history handed over outside the
        # activations (_StepReplay._check_cross_stage): what a stage's F_all can
        # see depends on the forwards the schedule runs before it
        self._cross_unchecked = set(range(self.n))

    # ------------------------------------------------------------ public API
    def host_grads(self) -> dict:
        """Parameter -> host gradient (CPU tensor, pinned on CUDA) accumulated by
        ``g_offload`` operations since :meth:`zero_host_grads`. Waits for the
        gradient copies still running."""
        self._settle_grads()
        return dict(self._g_host)

    def zero_host_grads(self) -> None:
        """Forget the host gradients (call after the optimizer consumed them)."""
        self._settle_grads()   # no copy may still write into a forgotten tensor
        self._g_host.clear()

    def _check_batch_size(self, inputs) -> None:
        """Warn (RuntimeWarning, once per executor) at a batch larger than the one
        the plan was made for: every size the planner counted (activations grow
        with the batch) was that batch's, so the plan's memory bound no longer
        holds, and nothing else said so (4x the batch ran at 4x the activation
        peak). Only a Plan carries its batch size (``info["input_bytes"]``)."""
        planned = self._planned_input
        nbytes = inputs.numel() * inputs.element_size()
        if planned is None or nbytes <= planned:
            return
        self._planned_input = None          # warned: once per executor
        warnings.warn(
            f"this batch is {nbytes:,} bytes, larger than the {planned:,}-byte input the "
            f"plan was made for: its memory bound holds for that batch only (activations "
            f"grow with the batch). Profile and plan again for this batch shape",
            RuntimeWarning, stacklevel=3)

    def step(self, inputs, target) -> torch.Tensor:
        """One forward + backward pass following the schedule; returns the loss
        (detached). Parameter ``.grad`` accumulate as with ``loss.backward()``.
        ``inputs`` and ``target`` are never freed or moved (a0 is a private copy
        when the schedule frees it before B 0: ``delete a0`` or ``F_none 0``, and
        when ``inputs`` are a leaf that requires grad, or a view of one, which a
        first stage changing them in place under autograd makes raise
        :class:`ExecutionError`, as plain autograd refuses that; NOTE rule 7).
        ``inputs`` that require grad get their
        gradient as from ``loss.backward()``: in ``.grad``, or through the graph
        that made them.

        A step in which nothing needs a gradient (every parameter frozen and a
        batch that does not require grad, or a stage that detaches its output
        with every stage after it frozen) raises :class:`ExecutionError` before
        any gradient is written, as ``loss.backward()`` raises.

        A stage that reads a tensor with autograd history another stage's
        forward made, handed over outside the activations (``self.ctx.bias =
        ...`` on a module the stages share), is refused with
        :class:`ExecutionError` at the first step under a schedule (at each
        stage's first ``F_all``; the gradients of that step's earlier ``B``
        stay, as below), as :func:`~rtmem.torch.profile_sequential` refuses it:
        its gradient would be lost or wrong under recomputation. Later steps
        do not check again.

        An exception raised by a stage's forward (the first or a
        recomputation), its backward, or the loss function reaches the caller
        unchanged (its type, message and traceback: ``except
        torch.OutOfMemoryError`` still catches it) with a note naming where, as
        :func:`~rtmem.torch.profile_sequential` marks it: ``rtmem: raised in the
        recomputed forward of stage 2 (Block), operation 12 of the schedule
        (F_all 2)``. If the step raises (a ``KeyboardInterrupt`` too), the
        executor can step again at once: the weights are all back on the
        device, and it holds nothing of the step (stored tensors, host buffers,
        hooks). The gradients the step produced before the error stay where
        they went (``.grad``, or the :meth:`host_grads` of ``g_offload``), as
        after a failed ``loss.backward()`` (or a recomputation of
        ``torch.utils.checkpoint`` failing inside it); where the step's
        backward had begun, a second note on the exception says so: zero both
        before retrying the batch."""
        check_inputs(inputs)
        if self.schedule is not self._compiled:
            # replaced since the last step: checked and compiled as __init__ does
            schedule = self.schedule
            if not isinstance(schedule, Schedule):
                raise ExecutionError(f"ScheduleExecutor.schedule must be a Schedule, got "
                                     f"{type_label(schedule, Schedule)}")
            self._compile(schedule)
        self._check_batch_size(inputs)
        if torch.is_inference_mode_enabled() or inputs.is_inference():
            raise ExecutionError(
                "step() trains, so it cannot run under torch.inference_mode() or on an "
                "inference tensor (autograd refuses to record them); call it outside "
                "inference_mode, with a batch made (or cloned) outside it")
        if not torch.is_grad_enabled():
            # F_all, L and B enable grad themselves: under no_grad() the step would
            # silently accumulate gradients, where loss.backward() raises
            raise ExecutionError(
                "step() trains (it accumulates parameter gradients), so it cannot run "
                "with gradients disabled (torch.no_grad(), set_grad_enabled(False)); for "
                "a validation loss call loss_fn(model(inputs), target) under no_grad")
        # The stages were listed once, in __init__: a stage appended, removed or
        # replaced since then would be skipped (or its old module run) while
        # model(x) runs the new model, and the step would train another network
        current = list(self._given)
        changed = next((k for k, (a, b) in enumerate(zip(current, self.stages)) if a is not b),
                       None if len(current) == self.n else min(len(current), self.n))
        if changed is not None:
            raise ExecutionError(
                f"the model's stages changed after this executor was built (now "
                f"{len(current)} stages, {self.n} when built; the first difference is at "
                f"stage {changed}): the step would run the stages it listed, not the "
                f"model's. Build a new ScheduleExecutor, with a schedule planned for the "
                f"changed model (profile_sequential, then a planner)")
        # a placement, or a gradient hook, may have been made after __init__
        check_placement(self._stage_params, self._moves, self._param_names)
        check_shared_hooks(self._shared, self._param_names)
        self._check_replayable(inputs.device)
        if inputs.device.type == "cuda" and self.host_arena is not None and \
                self.host_arena.backend.name == "cuda":
            # the host arena reuses its blocks in the order of CuPy's current
            # stream; this step's compute stream is torch's (on_torch_stream)
            from .bridge import on_torch_stream
            with on_torch_stream(inputs.device):
                return self._step(inputs, target)
        return self._step(inputs, target)

    def _check_replayable(self, device: torch.device) -> None:
        """Refuse, before any stage runs, a step whose recomputations could not
        replay the random numbers of their first forward (rule 6): with
        ``preserve_rng_state`` the executor replays the CPU's generator and the
        batch's CUDA device's only, so a stage it recomputes on another device
        (a batch on ``mps`` or ``xpu``, a CPU batch with the stage's weights on
        a GPU) drew new dropout masks there, and the gradients were silently
        wrong."""
        if not (self.preserve_rng_state and self._recomputed):
            return
        replayed = {"cpu", str(device)} if device.type == "cuda" else {"cpu"}
        for i in sorted(self._recomputed):
            devices = {str(t.device) for t in (*self._stage_params[i], *self._stage_buffers[i])}
            if device.type not in ("cpu", "cuda"):
                devices.add(str(device))
            other = sorted(devices - replayed)
            if other:
                raise ExecutionError(
                    f"stage {i} ({type(self.stages[i]).__name__}), which the schedule "
                    f"recomputes, runs on {', '.join(other)}, whose random generator the "
                    f"executor does not replay (it replays the CPU's and the batch's CUDA "
                    f"device's; the batch is on {device}): a recomputation would draw new "
                    f"dropout masks and give wrong gradients. Put the batch on the device "
                    f"the stages run on (a CUDA device), use a schedule that recomputes no "
                    f"stage (plan_store_all), or pass preserve_rng_state=False if the "
                    f"recomputed stages draw no random numbers")

    # ------------------------------------------------------------- internals
    def _scan_state(self) -> None:
        """Each stage's buffers, constant tables and generators as the modules
        hold them now."""
        scans = [self._scan_stage(i) for i in range(len(self.stages))]
        self._stage_buffers = [buffers for buffers, _, _ in scans]
        self._stage_consts = [consts for _, consts, _ in scans]
        self._stage_gens = [gens for _, _, gens in scans]

    def _stage_tensors(self) -> list:
        """Each stage's parameters, buffers and constant tables (tensor
        attributes), the tensors that may require grad in it
        (:func:`inputs_need_grad`; a buffer that does trains in plain autograd)."""
        return [[*params, *buffers, *consts] for params, buffers, consts
                in zip(self._stage_params, self._stage_buffers, self._stage_consts)]

    def _scan_stage(self, i: int) -> tuple[list, list, list]:
        """Stage ``i``'s buffers, constant tables and generators as its modules
        hold them now."""
        return (slot_buffers(self._buffer_slots[i]),
                *stage_state(self._stage_modules[i]))
