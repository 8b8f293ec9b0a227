"""The step of :class:`~rtmem.torch.OffloadedAdam`: the chunked CPU update
over runs of parameters and the uploads it overlaps (NOTE [ Offloaded Adam ] in
offload.py, 2 and 3), the bookkeeping of a step interrupted half way (NOTE
[ Interrupted step ], in :meth:`_ChunkedUpdate.step`'s docstring) and the
arguments ``torch.amp.GradScaler`` passes (NOTE [ GradScaler ], in
OffloadedAdam's docstring). Separate from ``offload.py``, which holds the
optimizer; the gradients the update consumes are gathered by
:mod:`._offload_grads`, and ``state`` follows by :mod:`._offload_state`.
"""

from __future__ import annotations

import numpy as np
import torch

from rtmem.errors import OptimizerError
from rtmem.kernels.adam import _unscale_factor, threads
from rtmem.optim import _check_finite_switch, _coefficients

from ._offload_checks import _check_group
from ._offload_hooks import _interrupts_held
from ._stages import add_note


class _ChunkedUpdate:
    """Mixin of :class:`~rtmem.torch.OffloadedAdam`, which provides ``params``,
    ``param_groups``, ``offsets``, ``chunk``, ``num_threads``, the host arrays
    (``master``, the gradient and staging buffers ``_grad_t`` and ``_stage_t``,
    the prepared kernel ``_update``), the copy ``_streams``, the step counters
    (``steps``, ``step_count``, ``skipped_steps``, ``last_step_skipped``),
    :meth:`_span`, :meth:`_check_open` and :meth:`_check_params`, and the
    gradient flags of :class:`~rtmem.torch._offload_grads._Gradients`, whose
    methods it calls, as it does :meth:`_sync_state` and :meth:`_adopt_changes`
    (:class:`~rtmem.torch._offload_state._StateDict`)."""

    def _upload(self, lo: int, hi: int):
        """Copy staged elements [lo, hi) into the device parameters they cover.

        A non-contiguous parameter has no flat view to copy a range into: it is
        copied whole (a strided copy from its staged logical-order elements) by
        the call whose range reaches its last element; the update writes every
        element of a parameter before that call, since runs hold whole ones."""
        non_blocking = self._streams is not None
        k = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        while k < len(self.params) and self.offsets[k] < hi:
            p = self.params[k]
            start, end = self._span(k)
            a, b = max(lo, start), min(hi, end)
            dst = p.data
            if dst.is_contiguous():
                dst.view(-1)[a - start:b - start].copy_(self._stage_t[a:b],
                                                        non_blocking=non_blocking)
            elif b == end:
                dst.copy_(self._stage_t[start:end].view(dst.shape),
                          non_blocking=non_blocking)
            k += 1

    def _runs(self, fresh):
        """Maximal runs ``(lo, hi, group, step)`` of consecutive parameters that
        have a gradient (not ``fresh``), the same group and the same next step:
        one coefficient vector per run, and a single run in a step where every
        parameter of a one-group optimizer has a gradient."""
        runs = []
        for k, f in enumerate(fresh):
            if f:
                continue
            key = (self._group_of[k], int(self.steps[k]) + 1)
            lo, hi = self._span(k)
            # (a run is a list, to grow in place: its key compared as a list
            # never equalled the tuple, and every parameter was a run of its own)
            if runs and runs[-1][1] == lo and tuple(runs[-1][2:]) == key:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, *key])
        return runs

    def _consume(self) -> None:
        """A step's end, applied or skipped: the gradients are used up."""
        self._fresh = [True] * len(self.params)
        self._grads_zeroed = False
        self._left_by_interrupt = False

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, check_finite=None):
        """Update the parameters that have a gradient (flushed since the last
        step, or zeroed by ``zero_grad(set_to_none=False)``), chunked and
        overlapped with the uploads; the others, frozen ones included, keep
        their values and state. Returns the closure's loss (or None), like torch.

        ``grad_scale`` is the loss scale the gradients carry (unscaled in the
        kernel, NOTE [ Skipped steps ] in :mod:`rtmem.optim`); ``check_finite``
        (True or False; None, the default: ``grad_scale is not None``) first
        checks every unscaled gradient and skips the whole step if one is inf
        or NaN: no parameter, moment or step count changes,
        ``last_step_skipped`` is True and ``skipped_steps`` grows by one.
        Either way the step consumes the gradients. Everything that can be
        refused (hyperparameters, ``check_finite``, replaced parameters) is
        checked before any host state or parameter changes.

        NOTE [ Interrupted step ]
        An exception raised once the update has started (a KeyboardInterrupt, a
        failed upload) leaves no parameter half counted: each parameter the
        chunked update had reached (written some of) counts as stepped (its
        step count advanced, its gradient consumed; elements of it the update
        had not written keep their values and moments this step), and the ones
        it had not reached keep their gradients, so the next ``step()`` updates
        just those, once. A chunk whose kernel call raised was not written (a
        KeyboardInterrupt waits for the call's end), so the parameters starting
        in it have not been reached. No element is ever updated twice with one
        gradient.

        Under ``torch.amp.GradScaler`` (``scaler.step(optimizer)``), the
        gradients this step took from ``p.grad`` and did not use go back to
        ``p.grad`` (all of them if it raised before the update started), where
        GradScaler's inf check looks for them: recover with
        ``scaler.step(optimizer)`` again, then ``scaler.update()``, as with
        torch's optimizers. If the step had reached every parameter, no
        gradient is left and it counts as done: call ``scaler.update()``
        without stepping again (a second ``scaler.step`` finds no gradient to
        check, and GradScaler's ``update()`` then fails with "No inf checks
        were recorded"). The exception carries a note saying which case it is
        (Python >= 3.11)."""
        self._check_open("step")
        if "found_inf" not in self.__dict__:
            return self._step(closure, grad_scale, check_finite)
        # Set by torch.amp.GradScaler.step, which deletes them only after a step
        # that returns, and multiplies a grad_scale it finds into the next one:
        # left behind by a raising step (refused, interrupted), the retry
        # unscaled by S**2.
        checked = None       # the parameters whose p.grad GradScaler checked
        try:
            grad_scale, check_finite = self._grad_scaler_args(grad_scale, check_finite)
            checked = [p.grad is not None for p in self.params]
            # Scaled gradients already on the host (clip_grad_norm_ took them, or
            # a plain step() interrupted before it used them) escaped
            # GradScaler's inf check: it recorded none, and its update() would
            # assert. Back to p.grad with them (by _return_grads), and say how
            # the loop goes (after unscale_, grad_scale is None: allowed).
            escaped = [grad_scale is not None and not took and not fresh
                       for took, fresh in zip(checked, self._fresh)]
            if any(escaped):
                checked = [a or b for a, b in zip(checked, escaped)]
                raise OptimizerError(self._escaped_message(sum(escaped)),
                                     argument="optimizer")
            if self._done_when_interrupted and not any(checked) and \
                    all(self._with_gradient()[1]):
                raise OptimizerError(
                    "scaler.step(optimizer) after an interrupted step that had applied "
                    "every gradient: nothing is left to step, and GradScaler, finding "
                    "no gradient in p.grad, has just replaced its record of that step's "
                    "inf check with an empty one, so scaler.update() would fail with "
                    "'No inf checks were recorded'. End this iteration with "
                    "scaler.update(new_scale=scaler.get_scale()) (the scale unchanged); "
                    "after such an interrupt, call scaler.update() without stepping "
                    "again (NOTE [ Interrupted step ])", argument="optimizer")
            return self._step(closure, grad_scale, check_finite)
        except BaseException as exc:
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            if checked is not None:
                self._return_grads(checked, exc)
            raise

    def _escaped_message(self, n: int) -> str:
        """The refusal of a GradScaler-driven step that found ``n`` gradients
        on the host instead of in ``p.grad``, saying how they got there."""
        head = (f"scaler.step(optimizer): GradScaler checks p.grad for inf/NaN, but {n} "
                f"gradient(s) had already left p.grad for the host buffer")
        missed = ("GradScaler's check missed them, and scaler.update() would fail with "
                  "'No inf checks were recorded'. They are back in p.grad")
        clip = ("call scaler.unscale_(optimizer) before optimizer.clip_grad_norm_(...), "
                "then scaler.step(optimizer), as with torch's clip_grad_norm_ under "
                "GradScaler")
        if not self._left_by_interrupt:
            return (f"{head} (optimizer.clip_grad_norm_ moves them there). {missed} and "
                    f"nothing has stepped: {clip}")
        return (f"{head}: an optimizer.step() called without the scaler was interrupted "
                f"after stepping the parameters it had reached, and left these for its "
                f"retry (or optimizer.clip_grad_norm_ moved them since). {missed}: call "
                f"scaler.step(optimizer) again, which steps the parameters that step had "
                f"not reached, then scaler.update(); under GradScaler, step only through "
                f"scaler.step(optimizer), retries after an interrupt included. If "
                f"clip_grad_norm_ took them, {clip}")

    def _return_grads(self, checked, exc) -> None:
        """After a GradScaler-driven step raised: put the gradients it did not use
        in ``p.grad`` (those it took from there, ``checked``, and zeroed ones, as
        zeros), and note on ``exc`` how to recover (NOTE [ Interrupted step ]).

        GradScaler's retry re-runs its inf check over ``p.grad`` and records
        what it finds for ``update()``; left on the host, the gradients were
        invisible to it, so it recorded nothing and ``update()`` asserted "No
        inf checks were recorded" (torch's optimizers keep ``p.grad`` through a
        step, so their retry is checked as the first try was)."""
        # every gradient the retry will use, a zeroed one (zero_grad(set_to_none=
        # False)) the update did not reach included: GradScaler checks p.grad
        # only, and torch holds such a gradient there as zeros
        back = [k for k in range(len(self.params))
                if not self._fresh[k] and self.params[k].grad is None]
        if back and self._streams is not None:
            for stream in self._streams:     # the D2H copies into the host buffer
                stream.synchronize()
        for k in back:
            self._settle(k)                  # a staged partial gradient included
            p = self.params[k]
            lo, hi = self._span(k)
            g = torch.empty_like(p, memory_format=torch.preserve_format)
            g.copy_(self._grad_t[lo:hi].view(p.shape))
            with _interrupts_held():         # in p.grad or on the host, never both
                p.grad = g
                self._fresh[k] = True
        if not any(checked) or isinstance(exc, OptimizerError):
            return                  # refused before taking anything: no note needed
        if back or any(p.grad is not None for p in self.params):
            note = ("OffloadedAdam: the gradients the interrupted step did not use "
                    "are in p.grad; call scaler.step(optimizer) again, then "
                    "scaler.update().")
        else:
            self._done_when_interrupted = True
            note = ("OffloadedAdam: the interrupted step had reached every parameter "
                    "and counts as done (no gradient is left); call scaler.update() "
                    "without calling scaler.step(optimizer) again.")
        add_note(exc, note)

    def _step(self, closure, grad_scale, check_finite):
        """:meth:`step` once GradScaler's arguments are read."""
        self._done_when_interrupted = False
        if not self._state_synced:      # a step's state update was cut short
            self._sync_state()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_params()
        for gi, group in enumerate(self.param_groups):
            _check_group(f"param group {gi}", group)
        _unscale_factor(grad_scale)       # refused even when there is nothing to do
        check_finite = _check_finite_switch(check_finite)
        pending, fresh, zeroed = self._with_gradient()
        self.last_step_skipped = False
        if all(fresh):
            return loss
        runs = self._runs(fresh)
        # one coefficient vector per (group, step), all computed (validated) first
        coeffs = {}
        for _, _, gi, s in runs:
            if (gi, s) not in coeffs:
                group = self.param_groups[gi]
                coeffs[gi, s] = _coefficients(group, s, bool(group["decoupled_weight_decay"]),
                                              grad_scale)
        if check_finite is None:
            check_finite = grad_scale is not None
        self._adopt_changes()            # all checked: what the caller wrote is kept
        self._gather(pending, zeroed)
        with threads(self.num_threads):
            if check_finite and not all(self._update._grads_finite(coeffs[gi, s], lo, hi)
                                        for lo, hi, gi, s in runs):
                with _interrupts_held():
                    self.skipped_steps += 1
                    self.last_step_skipped = True
                    self._consume()
                return loss
            h2d = self._streams[0] if self._streams is not None else None
            if h2d is not None:
                # the uploads replace p.data's contents: after all GPU work queued so
                # far (a weight prefetch of the executor may still be writing p.data)
                h2d.wait_stream(torch.cuda.current_stream())
            reached = None      # the chunk the update is at (NOTE [ Interrupted step ])
            counted = False
            try:
                for lo, hi, gi, step in runs:
                    c = coeffs[gi, step]
                    for a in range(lo, hi, self.chunk):
                        b = min(hi, a + self.chunk)
                        reached, written = (a, b), False
                        # A KeyboardInterrupt waits for the kernel call's end: an
                        # exception out of the call then comes from its checks,
                        # before it wrote anything. Unheld (a SIGINT handler of
                        # the caller's), one may come after it wrote: counted so.
                        with _interrupts_held() as held:
                            written = not held
                            self._update.apply(c, a, b)
                            written = True
                        self._upload_on(h2d, a, b)   # rule 2: upload k while updating k+1
                # Counted in the try: an interrupt between the last chunk and the
                # count is an interrupted step at that chunk (all reached), where
                # outside it the next step applied every gradient again. The
                # count itself holds interrupts, raised once it is whole.
                with _interrupts_held():
                    stepped = [k for k, f in enumerate(fresh) if not f]
                    self._count_step(stepped)
                    counted = True
                    self._sync_state(stepped)
            except BaseException:
                if reached is not None and not counted:
                    # the update wrote the elements before b, or before a when the
                    # chunk's kernel call raised
                    a, b = reached
                    self._interrupted(fresh, h2d, a, b if written else a)
                raise
            finally:
                if h2d is not None:               # rule 3 (the uploads enqueued)
                    torch.cuda.current_stream().wait_stream(h2d)
        return loss

    def _upload_on(self, h2d, lo: int, hi: int) -> None:
        """:meth:`_upload` of ``[lo, hi)`` on the H2D stream (None: host backend)."""
        if h2d is None:
            self._upload(lo, hi)
        else:
            with torch.cuda.stream(h2d):
                self._upload(lo, hi)

    def _count_step(self, stepped) -> None:
        """A step's end: the parameters ``stepped`` (indices) advance a step, and
        every gradient is used up; ``state`` follows with :meth:`_sync_state`
        (a failure there leaves it to the next step or state_dict())."""
        self._state_synced = False
        self.steps[stepped] += 1
        self.step_count += 1
        self._consume()

    def _interrupted(self, fresh, h2d, a: int, end: int) -> None:
        """The bookkeeping of a step whose update raised in the chunk starting
        at ``a``, having written the elements before ``end`` (NOTE [ Interrupted
        step ]): the parameters it reached (starting before ``end``) count as
        stepped, the others keep their gradients for the next step, and the
        device copy of the parameters the chunk covers is made from their
        master weights."""
        updated = [k for k, f in enumerate(fresh) if not f]
        reached = [k for k in updated if self.offsets[k] < end]
        with _interrupts_held():          # a second interrupt waits for the count
            if reached:                   # (none: nothing was written, nor counted)
                self._count_step(reached)
            for k in updated:
                if self.offsets[k] >= end:  # not reached: still has its gradient
                    self._fresh[k] = False
                    self._left_by_interrupt = True
        if not reached:
            return
        self._sync_state(reached)
        # the chunk in flight may be written in part (master and staging buffer
        # alike), or written and not uploaded: upload the parameters it covers
        # from their master weights (those before it were uploaded whole, those
        # after it are unchanged)
        cover = [k for k in reached if self.offsets[k + 1] > a]
        if cover:
            lo, hi = self._span(cover[0])[0], self._span(cover[-1])[1]
            if h2d is not None:
                h2d.synchronize()         # no upload still reads the staging buffer
            self._stage_t[a:hi].copy_(torch.from_numpy(self.master[a:hi]))
            self._upload_on(h2d, lo, hi)

    def _grad_scaler_args(self, grad_scale, check_finite) -> tuple:
        """``step``'s (grad_scale, check_finite) when ``torch.amp.GradScaler``
        drives it (NOTE [ GradScaler ])."""
        s = self.grad_scale      # None after scaler.unscale_(optimizer): unscaled
        if self.flush_in_backward or grad_scale is not None or check_finite is not None:
            # GradScaler deletes its attributes only after a step that returns: a
            # later plain step() must not find them
            del self.grad_scale, self.found_inf
        if self.flush_in_backward:
            raise OptimizerError(
                "torch.amp.GradScaler cannot drive an OffloadedAdam that flushes the "
                "gradients during backward: they left p.grad before its inf check, so "
                "it would never lower the scale. Use rtmem.LossScaler (the same calls: "
                "scale, step, update), or flush_in_backward=False.", argument="optimizer")
        if grad_scale is not None or check_finite is not None:
            raise OptimizerError(
                "scaler.step(optimizer) passes the scale itself; drop grad_scale= and "
                "check_finite=", argument="grad_scale")
        return (None if s is None else float(s)), True
