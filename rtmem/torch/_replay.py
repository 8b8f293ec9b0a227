"""The step loop of :class:`~rtmem.torch.ScheduleExecutor` and its compute
operations: one step walks the compiled schedule, running ``F_none``/``F_ck``/
``F_all`` (:meth:`_StepReplay._forward`), ``L`` and ``B`` here and handing the
activation moves to :class:`~rtmem.torch._moves._ActivationMoves` and the weight
and gradient moves to :class:`~rtmem.torch._host_side._HostSide`.

Separate from ``executor.py``, which holds what a user calls and what is
checked before a step (the constructor, :meth:`~rtmem.torch.ScheduleExecutor.step`,
the schedule's compilation); this module replays the operations. The rules it
follows are NOTE [ Executor ] in executor.py (the rule numbers in the comments
below are that note's).
"""

from __future__ import annotations

from bisect import bisect_right

import torch

from rtmem.planners import Op

from ._module_state import FirstBuffers, KeptBuffers, replayed_generators, stage_state
from ._offload_hooks import _interrupts_held
from ._saved import (_SavedHooks, autocast_off, fastpaths_as_trained, own_parametrizations,
                     uncached_casts)
from ._stages import (_WEIGHT_MOVES, ExecutionError, _check_output, _stage_input, _storage_ptrs,
                      add_note, check_cross_stage, check_loss, check_needs_grad,
                      handed_over_advice, inputs_need_grad, mark_raised, node_mark,
                      nothing_trains, stage_label, trains_beyond)
from ._stored import _Stored


#: The note on an exception (or KeyboardInterrupt) that ends a step after its
#: backward began writing gradients (NOTE [ Executor ] rule 3).
_GRADIENTS_KEPT = (
    "rtmem: the step failed after its backward began, so the gradients it had "
    "accumulated stay in the parameters' .grad (and in host_grads() for stages the "
    "schedule g_offloads), as after a failed loss.backward(): zero them (with "
    "zero_host_grads()) before retrying the batch")


def _changed(now: list, before: list) -> bool:
    """Whether two lists of tensors differ (by identity)."""
    return len(now) != len(before) or any(a is not b for a, b in zip(now, before))


class _StepReplay:
    """Mixin of :class:`~rtmem.torch.ScheduleExecutor`: :meth:`_step` and the
    compute operations it runs. The executor provides the model's stages and
    their state (``stages``, ``_stage_buffers``, ``_stage_consts``,
    ``_stage_gens``, ``_buffer_slots``, :meth:`_scan_state`, :meth:`_scan_stage`,
    :meth:`_stage_tensors`), the compiled schedule (``_ops``, ``_own_input``,
    ``_recomputed``) and its settings (``loss_fn``, ``preserve_rng_state``,
    ``track_memory``); the stored tensors and their ledgers come from
    :class:`~rtmem.torch._bookkeeping._Bookkeeping`, the moves from
    :class:`~rtmem.torch._moves._ActivationMoves` and
    :class:`~rtmem.torch._host_side._HostSide`."""

    def _step(self, inputs, target) -> torch.Tensor:
        device = inputs.device
        self._device = device
        self._caller_keys = _storage_ptrs((inputs, target))
        self._caller_inputs = inputs if inputs.requires_grad else None
        # A batch autograd refuses to change in place (a leaf that requires grad,
        # or a view of one) is never handed to stage 0, which gets a detached
        # alias: a private copy keeps it unchanged when stage 0 modifies its
        # input; _run_stage refuses a change autograd recorded (rule 7)
        self._fixed_batch = inputs.requires_grad and (
            inputs.is_leaf or (inputs._is_view() and inputs._base.is_leaf))
        if self._own_input or self._fixed_batch or (
                inputs.untyped_storage().nbytes() != inputs.numel() * inputs.element_size()):
            # a compact private copy: its bytes are exactly the chain's x0
            inputs = inputs.detach().clone(memory_format=torch.contiguous_format)
        if device.type == "cuda" and self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        self._new_ledger()
        self._scan_state()   # the caller may have reassigned buffers since the last step
        self._refresh_state_ptrs()
        # per step (after the scan: tensor attributes count): the caller may freeze
        # or unfreeze parameters and tensor attributes between steps
        # (inputs may be the private copy by now, which requires no grad). The
        # same tensors tell L and B why nothing trains, when nothing does
        self._grad_tensors = self._stage_tensors()
        self._needs_grad = inputs_need_grad(self._grad_tensors,
                                            self._caller_inputs is not None)
        self._plain.store(0, inputs)
        self._trains = False  # whether the backward writes a gradient (_loss, _backward)
        track = self.track_memory
        self.peak_bytes = 0 if track else None
        self.resident_bytes = []
        self.buffer_copy_bytes = 0 if track else None
        self._copies_kept = 0
        loss = None
        # While a stage's first grad-mode forward is still to be checked for a
        # tensor handed over outside the activations (_check_cross_stage), the
        # ops are walked with a node_mark() before each; steady-state steps walk
        # them as they are
        self._op_marks = None
        ops = enumerate(self._ops)
        if self._cross_unchecked:
            self._op_marks = ([], [])
            ops = self._marked_ops(self._op_marks)
        try:
            for j, (op, s, aux) in ops:
                self._op_index = j
                if op in (Op.F_NONE, Op.F_CK, Op.F_ALL):
                    self._forward(op, s)
                elif op == Op.LOSS:
                    loss = self._loss(target)
                elif op == Op.B:
                    self._backward(s)
                elif op in (Op.OFFLOAD, Op.DELETE, Op.PREFETCH):
                    self._move(op, s, aux)
                elif op in _WEIGHT_MOVES:
                    self._weights(op, s)
                else:
                    self._grads_to_host(s)
                if track:
                    self._account()
        except BaseException as e:
            if self._trains:
                # the backward had begun: what it accumulated stays (NOTE rule 3)
                add_note(e, _GRADIENTS_KEPT)
            raise
        finally:   # also after an error: the model keeps all its weights
            # A KeyboardInterrupt (Ctrl-C) landing in here cut the clean-up short:
            # weights the schedule left on the host stayed 0-element placeholders
            # (a checkpoint saved in the caller's `except KeyboardInterrupt` lost
            # them; the next step failed inside a stage) and the host buffers were
            # never freed. Held until the clean-up is done, then raised.
            with _interrupts_held():
                self._plain.clear()
                self._bar.clear()
                # the first forwards' RNG states and buffer copies are for this
                # step's recomputations only: not held through optimizer.step()
                self._first = {}
                self._copies_kept = 0
                self._delta = None
                self._op_marks = None
                self._caller_keys = set()
                self._caller_inputs = None
                if self._streams is not None:
                    # the optimizer and the next step run on the compute stream: every
                    # weight prefetched and gradient offloaded must be in place by then
                    compute = torch.cuda.current_stream(device)
                    for stream in self._streams:
                        compute.wait_stream(stream)
                self._restore_weights()
                self._release_host()
        return loss

    def _marked_ops(self, marks: tuple):
        """The schedule's ``(index, operation)`` pairs, as ``enumerate(self._ops)``,
        appending to ``marks`` (two lists) the :func:`node_mark` taken before each
        and the stage of each forward (None for the other operations): the autograd
        nodes numbered from a forward's mark up to the next mark were recorded by
        that forward."""
        for j, (op, s, aux) in enumerate(self._ops):
            with torch.enable_grad():
                marks[0].append(node_mark())
            marks[1].append(s if op in (Op.F_NONE, Op.F_CK, Op.F_ALL) else None)
            yield j, (op, s, aux)

    def _check_cross_stage(self, i: int, y: torch.Tensor, casts_kept: bool) -> None:
        """Refuse the output ``y`` of stage ``i``'s first grad-mode forward (an
        ``F_all``, whose mark is the last one taken) whose graph reaches a node
        another stage's forward recorded in this step (a tensor with autograd
        history handed over outside the activations:
        :func:`~rtmem.torch._stages.check_cross_stage`, the profiler's check,
        for a plan that did not come from ``profile_sequential``). Checked once
        per stage and schedule: a stage's F_all reads what the same forwards
        made before it at every step. A stage first run under ``no_grad``
        (``F_ck``, ``F_none``) records no graph there, so it is checked at its
        F_all; a tensor made by another stage's ``no_grad`` forward has no
        history to see, and the check cannot tell it apart (README)."""
        marks, stages = self._op_marks
        begin, end = marks[0], marks[-1]

        def origin(seq: int):
            if not begin <= seq < end:
                return None
            k = stages[bisect_right(marks, seq) - 1]
            return None if k == i else k

        check_cross_stage(i, y, origin, self.model, casts_kept)
        self._check_handed_attribute(i, end)
        self._cross_unchecked.discard(i)

    def _check_handed_attribute(self, i: int, mark: int) -> None:
        """Refuse a tensor with autograd history that stage ``i``'s F_all (whose
        :func:`node_mark` is ``mark``) made and left as a tensor attribute of a
        module another stage also holds (``self.ctx.bias = self.pos.expand(...)``
        with ``ctx`` a submodule of every stage): the other stages read it. The
        graph walk of :func:`check_cross_stage` cannot see it where the
        schedule runs the readers' F_all after an ``F_ck``/``F_none`` of stage
        ``i`` (a rotor schedule recomputes stage 0 under no_grad before each
        reader and runs its F_all last): they read a tensor without history,
        and its gradient is lost, silently."""
        fresh = [t for t in self._stage_consts[i]
                 if t.grad_fn is not None and t.grad_fn._sequence_nr() >= mark]
        if not fresh:
            return
        for j in range(self.n):
            if j == i:
                continue
            held = {id(t) for t in stage_state(self._stage_modules[j])[0]}
            t = next((t for t in fresh if id(t) in held), None)
            if t is None:
                continue
            name = next((f"{prefix}.{attr}".lstrip(".")
                         for prefix, m in self.stages[i].named_modules()
                         for attr, v in vars(m).items() if v is t), "a tensor attribute")
            raise ExecutionError(
                f"the forward of {stage_label(self.model, i)} sets {name}, a tensor with "
                f"autograd history ({type(t.grad_fn).__name__}), on a module that "
                f"{stage_label(self.model, j)} also holds: a tensor handed between stages "
                f"outside their outputs (self.ctx.bias = ..., a skip connection kept as an "
                f"attribute). " + handed_over_advice(i, " (or is not read by other stages)",
                                                     "the stages into one"))

    def _raised_in(self, exc: Exception, what: str, i: int | None = None) -> None:
        """Mark ``exc``, raised by the user's code in ``what`` (of stage ``i``),
        as the profiler marks it (:func:`~rtmem.torch._stages.raised_in`: the
        ``rtmem: raised in ...`` note and the attribute ``rtmem profile``
        reads), with the schedule's operation running: ``the recomputed
        forward of stage 2 (Block), operation 12 of the schedule (F_all 2)``.
        Called from ``except`` clauses only, so a step that raises nothing
        builds no phrase; the exception goes on unchanged (type, message,
        traceback), so the caller's ``except torch.OutOfMemoryError`` or
        ``except ValueError`` still catches it."""
        where = what if i is None else f"{what} of {stage_label(self.model, i)}"
        j = self._op_index
        mark_raised(exc, f"{where}, operation {j} of the schedule "
                         f"({self._compiled.op_text(j)})")

    def _resident(self, k: int, plain_only: bool = False) -> _Stored:
        st = self._plain.get(k)
        if (st is None or not st.resident) and not plain_only:
            st = self._bar.get(k)
        if st is None or not st.resident:
            # the structural check makes this unreachable for valid schedules
            raise ExecutionError(f"activation a{k} is not on the device")
        return st

    def _source(self, k: int, plain_only: bool = False) -> torch.Tensor:
        st = self._resident(k, plain_only)
        if st.out._version != st.version:
            name = f"a{k}" if st.inp is None else f"abar{k}"
            raise ExecutionError(
                f"{name} was modified in place after the executor stored it (a stage or "
                f"the loss modifies its input in place), and operation {self._op_index} of "
                f"the schedule ({self.schedule.op_text(self._op_index)}) reads it again, which "
                f"would compute with the modified values; make that in-place operation "
                f"out-of-place (x = x * 2 instead of x.mul_(2)) or move it to the end of "
                f"the previous stage, or use a schedule that does not recompute from a{k}: "
                f"profile_sequential marks such stages no_recompute in the chain, and "
                f"plan_remat then runs them once")
        self._wait(st)
        return st.out.detach()

    def _wait(self, st: _Stored):
        if st.ready is not None:
            torch.cuda.current_stream(self._device).wait_event(st.ready)
            st.ready = None

    def _count_copies(self, taken: int) -> None:
        """Note ``taken`` bytes of buffer copies held, besides the first forwards'
        kept ones, while a stage runs (rule 6), in :attr:`buffer_copy_bytes`
        (tracking only: callers skip the byte counts without it)."""
        self.buffer_copy_bytes = max(self.buffer_copy_bytes, self._copies_kept + taken)

    def _run_stage(self, i: int, x: torch.Tensor):
        stage = self.stages[i]
        first = i not in self._first
        version = x._version   # shared with a_i and every alias of it
        made_by = x.grad_fn    # an in-place op autograd records replaces it
        if first:
            # Only a stage the schedule runs again needs its first forward's RNG
            # states and buffers (rule 6): taking them for every stage was a state
            # copy per stage and generator at every step of a store-all plan
            replayed = i in self._recomputed
            keep_rng = self.preserve_rng_state and replayed
            cpu = torch.get_rng_state() if keep_rng else None
            cuda = (torch.cuda.get_rng_state(self._device)
                    if keep_rng and self._device.type == "cuda" else None)
            # the generators the stage's modules hold (rule 6), as the scan at the
            # start of the step found them
            gens = [(g, g.get_state()) for g in self._stage_gens[i]] if keep_rng else []
            # the buffers this forward reads, for the stage's recomputations (rule 6)
            before = FirstBuffers(self._buffer_slots[i]) if replayed else None
            self._first[i] = (cpu, cuda, gens, before)
            # the copies' bytes are summed only when tracking memory (a walk of
            # the stage's buffers per forward otherwise spent for nothing)
            counting = before is not None and self.buffer_copy_bytes is not None
            if counting:
                self._count_copies(before.nbytes())
            try:
                with own_parametrizations():
                    y = stage(x)
            except Exception as e:
                self._raised_in(e, "the forward", i)
                raise
            if before is not None:
                # Values compared at this stage's first step only (a device sync
                # per buffer on a GPU, once): the slots it changes through .data
                # are then kept at every step without reading them
                checked = i in self._by_value
                found = before.keep_changed(compare_values=not checked,
                                            always=self._by_value.get(i, frozenset()))
                if not checked:
                    self._by_value[i] = found
                if counting:
                    self._copies_kept += before.nbytes()
        else:
            kept = KeptBuffers(self._buffer_slots[i])
            devices = [self._device] if self._device.type == "cuda" else []
            cpu, cuda, gens, before = self._first[i]
            try:
                fresh = before.replay() if before is not None else 0
                if self.buffer_copy_bytes is not None:
                    self._count_copies(kept.nbytes() + fresh)
                with torch.random.fork_rng(devices=devices, enabled=self.preserve_rng_state), \
                        replayed_generators(gens), own_parametrizations():
                    if self.preserve_rng_state:
                        torch.set_rng_state(cpu)
                        if cuda is not None:
                            torch.cuda.set_rng_state(cuda, self._device)
                    try:
                        y = stage(x)
                    except Exception as e:
                        self._raised_in(e, "the recomputed forward", i)
                        raise
            finally:
                # recomputation must not update running statistics again, also when
                # the stage raises after updating them (a failed step leaves the
                # statistics of one forward, as plain training does)
                kept.restore()
        # A first forward may reassign a buffer (a recomputation's are put back),
        # and any forward may set a tensor attribute (a lazy constant table, a
        # cache of the last output): the new tensor is model state, never freed
        # by a move (whose owner could read freed bytes) nor counted as an
        # activation
        now, consts, _ = self._scan_stage(i)   # generators: read at first runs only
        if _changed(now, self._stage_buffers[i]) or _changed(consts, self._stage_consts[i]):
            self._stage_buffers[i] = now
            self._stage_consts[i] = consts
            self._refresh_stage_ptrs(i)
        # Refused where autograd recorded the change, as plain torch refuses it on
        # a leaf: one made under the stage's own torch.no_grad() (allowed by
        # torch: a normalisation in place) leaves grad_fn as it was, and so does
        # every change in the executor's no_grad forwards (F_ck, F_none), which
        # cannot be told apart and go on the private copy; a recomputation of
        # stage 0 then finds its input changed (rule 7)
        if i == 0 and self._fixed_batch and x._version != version and \
                x.grad_fn is not made_by:
            raise ExecutionError(
                f"stage 0 ({type(stage).__name__}) modifies its input in place (x.mul_(2), "
                f"nn.ReLU(inplace=True), ...), and the batch is a leaf tensor that requires "
                f"grad (or a view of one), which plain PyTorch refuses to change in place "
                f"(\"a leaf Variable that requires grad is being used in an in-place "
                f"operation\"); the executor ran the stage on a copy, so the batch is "
                f"unchanged. Make the operation out-of-place (x = x * 2 instead of "
                f"x.mul_(2)), or pass a batch that is not a leaf (step(inputs.clone(), "
                f"target): inputs.grad still gets its gradient)")
        _check_output(i, stage, y)
        return y

    def _forward(self, op, i: int):
        x = self._source(i, plain_only=op == Op.F_NONE)
        self._wait_weights(i)
        # An output already resident is kept, as the simulator keeps it (Table
        # 2.1 adds nothing), and not computed again; a second abar_{i+1} would
        # also leave the first one's output held by the leaf input of
        # abar_{i+2}: bytes not planned.
        old = (self._bar if op == Op.F_ALL else self._plain).get(i + 1)
        if old is None or not old.resident:
            if op == Op.F_ALL:
                self._forward_all(i, x)
                return
            self._plain.store(i + 1, self._run_stage_without_grad(i, x))
        if op == Op.F_NONE:   # after storing a_{i+1}, which may share a_i's storage
            self._drop(self._plain, i)

    def _run_stage_without_grad(self, i: int, x: torch.Tensor):
        """Stage ``i`` on ``x`` under ``no_grad`` (F_ck, F_none). A stage
        that differentiates inside its forward (``torch.autograd.grad`` or
        ``.backward()``: a gradient penalty) gets torch's "does not require grad
        and does not have a grad_fn" there, which names neither the stage nor
        the cause: refused with :class:`ExecutionError` saying both. The
        output comes without autograd history: a plain a_{i+1}."""
        # the path plain training takes where torch's attention has two (in
        # eval mode): whether the stage's output needs a gradient there
        trains = self._needs_grad[i] or any(t.requires_grad for t in self._grad_tensors[i])
        try:
            with torch.no_grad(), uncached_casts(), fastpaths_as_trained(trains):
                y = self._run_stage(i, x)
        except RuntimeError as e:
            if "does not require grad and does not have a grad_fn" not in str(e):
                raise
            stage = self.stages[i]
            raise ExecutionError(
                f"stage {i} ({type(stage).__name__}) failed in operation {self._op_index} "
                f"of the schedule ({self.schedule.op_text(self._op_index)}) on a tensor "
                f"without autograd history ({e}). F_ck and F_none run a stage under "
                f"torch.no_grad(): if it differentiates inside its forward "
                f"(torch.autograd.grad or .backward(), e.g. a gradient penalty), run that "
                f"part under `with torch.enable_grad():` (its input then needs "
                f"x.requires_grad_() where it does not require grad), which trains as plain "
                f"PyTorch does, or use a schedule without F_ck and F_none of stage {i}; if "
                f"it does so already, the tensor it differentiates does not require grad, "
                f"and plain PyTorch fails alike") from e
        # A stage that enables grad itself (for its penalty) returns an output
        # with autograd history even here: kept, its graph, with every tensor
        # the graph saved, lived as long as the plain a_{i+1}, counted nowhere
        return y.detach() if y.requires_grad else y

    def _forward_all(self, i: int, x: torch.Tensor):
        hooks = _SavedHooks(self, i, x)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                hooks.pack, hooks.unpack_hook()):
            leaf, arg = _stage_input(x, needs_grad=self._needs_grad[i])
            y = self._run_stage(i, arg)
        # a tensor that requires grad read from outside what the executor sees:
        # refused, as stage i+1 gets (or got) its input without gradient
        check_needs_grad(i, self.stages[i], y, self._needs_grad, leaf)
        if i in self._cross_unchecked:
            self._check_cross_stage(i, y, hooks.casts_kept)
        self._bar.store(i + 1, y, inp=leaf, saved=hooks.saved)

    def _loss(self, target):
        k = self.n
        src = self._source(k)
        with torch.enable_grad(), own_parametrizations():
            leaf, z = _stage_input(src)
            try:
                loss = self.loss_fn(z, target)
            except Exception as e:
                self._raised_in(e, "the loss function")
                raise
        check_loss(loss, z, self._grad_tensors, self._caller_inputs is not None,
                   self.stages)
        # z is a leaf that requires grad whatever a_n needs, so this loss requires
        # grad where plain autograd's may not; the Bs decide (_backward). What they
        # need from here: whether the loss trains something without a_n (a loss
        # module's parameter, a target that requires grad)
        self._trains = trains_beyond(loss, leaf)
        try:
            with autocast_off(self._device):
                loss.backward()
        except Exception as e:
            self._raised_in(e, "the backward of the loss")
            raise
        self._delta = leaf.grad
        self._consume_plain(k)
        return loss.detach()

    def _backward(self, i: int):
        if self._delta is not None and not self._trains:
            # No gradient written yet (the loss and the Bs after this one wrote
            # only into the executor's input leaves). An output without autograd
            # history (stage i, or one before it, cut the chain) means a_n needs
            # no gradient in plain autograd, where loss.backward() raises (rule 3)
            out, inp = self._bar[i + 1].out, self._bar[i + 1].inp
            if not out.requires_grad:
                raise nothing_trains(self._grad_tensors, self._caller_inputs is not None,
                                     self.stages, cut_at=i)
            # a backward that writes a gradient of its own (a parameter) trains
            # something: no later B may refuse the step
            self._trains = trains_beyond(out, inp)
        bar = self._bar.pop(i + 1)
        self._wait(bar)
        self._wait_weights(i)
        # Drop our references to the saved tensors first, so that autograd frees
        # each one as soon as its node has run, as in native PyTorch (holding them
        # for the whole call raised the in-backward peak by ~10% on GPT-2 blocks).
        bar.saved.clear()
        bar.storages = []
        with autocast_off(self._device):
            if self._delta is not None and bar.out.requires_grad:
                try:
                    torch.autograd.backward(bar.out, self._delta)
                except Exception as e:
                    self._raised_in(e, "the backward", i)
                    raise
            # else nothing flows back (NOTE rule 3): a frozen or parameter-free stage
            # on integer inputs, or an output the rest of the model did not use
            self._delta = (bar.inp.grad if bar.inp is not None and bar.inp.requires_grad
                           else None)
            if i == 0 and self._delta is not None and self._caller_inputs is not None:
                try:   # the caller's graph that made the batch
                    torch.autograd.backward(self._caller_inputs, self._delta)
                except Exception as e:
                    self._raised_in(e, "the backward of the graph that made the batch")
                    raise
        # An abar_{i+2} recomputed from this one and never consumed holds its
        # output as its leaf input; the simulator frees abar_{i+1} whole here
        self._free_unneeded([bar.out.untyped_storage()])
        self._consume_plain(i)

    def _consume_plain(self, k: int):
        """B and L consume a resident plain a_k unless abar_k is resident (Table 2.1)."""
        plain, bar = self._plain.get(k), self._bar.get(k)
        if plain is not None and plain.resident and not (bar is not None and bar.resident):
            self._drop(self._plain, k)
