"""The gradients of :class:`~rtmem.torch.OffloadedAdam` on their way to the
host: the flush of ``p.grad`` into the pinned host buffer (by the hook, or at
the step), the partial gradients of later micro-batches added on the CPU, the
gathering of every gradient before a step, which parameters have one, the clip
of the host buffer (:meth:`~rtmem.torch.OffloadedAdam.clip_grad_norm_`) and
``zero_grad``. NOTE [ Offloaded Adam ] in offload.py, 1, says how; the update
that consumes them is :mod:`._offload_update`'s.
"""

from __future__ import annotations

import torch

from rtmem.errors import NonFiniteGradientError, OptimizerError
from rtmem.kernels.adam import _unscale_factor

from ._offload_checks import _check_grad
from ._offload_hooks import _interrupts_held


class _Gradients:
    """Mixin of :class:`~rtmem.torch.OffloadedAdam`, which provides ``params``,
    the host gradient and staging buffers (``_grad_t``, ``_stage_t``), the copy
    ``_streams`` (None on the host backend), the per-parameter flags ``_fresh``
    and ``_had_grad``, ``_grads_zeroed``, ``_partial``,
    ``_done_when_interrupted`` and ``_left_by_interrupt``, and :meth:`_span`,
    :meth:`_check_open` and :meth:`_check_params`."""

    def _flush(self, k: int, p) -> None:
        """Parameter k's gradient hook: move ``p.grad`` to the host."""
        if p.grad is None:
            return
        lo, hi = self._span(k)
        _check_grad(k, p, hi - lo)
        g = p.grad.reshape(-1)
        fresh = self._fresh[k]
        if not fresh:
            # A later micro-batch: land it in the (idle until step) staging
            # buffer and add it on the CPU once that copy is done, lazily, so
            # backward never waits for the GPU (NOTE [ Offloaded Adam ], 1).
            self._settle(k)
        dst = (self._grad_t if fresh else self._stage_t)[lo:hi]
        done = None
        if self._streams is not None:   # rule 1: async D2H on its own stream
            d2h = self._streams[1]
            d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(d2h):
                dst.copy_(g, non_blocking=True)
                g.record_stream(d2h)
                if not fresh:
                    done = d2h.record_event()
        else:
            dst.copy_(g)
        # on the host or in p.grad, never both: cut in between, the next flush
        # added the same gradient again as a later micro-batch's
        with _interrupts_held():
            if not fresh:
                self._partial[k] = done
            self._fresh[k] = False
            self._had_grad[k] = True
            self._done_when_interrupted = False     # a new gradient: a new step
            p.grad = None          # the device gradient is freed right away

    def _settle(self, k: int) -> None:
        """Add parameter k's staged partial gradient (if any) into its host
        gradient, after waiting for its D2H copy (done long ago, in practice)."""
        if k not in self._partial:
            return
        done = self._partial[k]
        if done is not None:
            done.synchronize()
        lo, hi = self._span(k)
        with _interrupts_held():    # added and forgotten together, never one alone
            self._grad_t[lo:hi].add_(self._stage_t[lo:hi])
            del self._partial[k]

    def _with_gradient(self):
        """(parameters whose gradient is still on the device, the ``fresh`` list
        with every parameter that has a gradient False, those with a zeroed one):
        what :meth:`step` updates. Changes nothing."""
        # A gradient still on the device had no hook to flush it: the parameter
        # was frozen at construction and unfrozen since, or p.grad was set by hand.
        pending = [k for k, p in enumerate(self.params) if p.grad is not None]
        fresh = list(self._fresh)
        for k in pending:
            fresh[k] = False
        # zeroed by zero_grad(set_to_none=False) and nothing flushed since: torch
        # steps them with a zero gradient
        zeroed = [k for k, had in enumerate(self._had_grad)
                  if had and fresh[k]] if self._grads_zeroed else []
        for k in zeroed:
            fresh[k] = False
        return pending, fresh, zeroed

    def _gather(self, pending, zeroed) -> None:
        """Bring every gradient to the host buffer: flush ``pending`` ones, wait
        for the D2H copies, add staged partial ones, zero ``zeroed`` ones."""
        for k in pending:
            self._flush(k, self.params[k])
        if self._streams is not None:
            # every gradient is on the host (D2H), and the last step's uploads
            # (H2D) no longer read the staging buffer the update writes: a flush
            # orders D2H after them, but step(); step() has no flush in between
            for stream in self._streams:
                stream.synchronize()
        for k in list(self._partial):             # before the staging buffer is reused
            self._settle(k)
        for k in zeroed:
            self._grad_t[slice(*self._span(k))].zero_()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, *, grad_scale=None,
                        error_if_nonfinite=False):
        """Scale the gradients in place so that their total norm is at most
        ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does for ``p.grad``
        (which is None here: the gradients live in the host buffer). Returns
        the total norm (a float32 CPU tensor) of the gradients the next step
        uses, before clipping.

        ``grad_scale``: the loss scale the gradients carry; the norm is that of
        the unscaled gradients (what torch computes after
        ``GradScaler.unscale_``), and the gradients keep their scale for
        ``step(grad_scale=...)``. Finite gradients whose float32 norm overflows
        (a loss spike, or the scale still in them) are normed in float64 and
        clipped (torch's inf norm would zero them). Non-finite gradients give a
        non-finite norm: :class:`~rtmem.errors.NonFiniteGradientError` (a
        RuntimeError, as torch's) with ``error_if_nonfinite=True``; else they are
        left as they are (torch would multiply them by nan), so a step with the
        finite check skips them.

        Under ``torch.amp.GradScaler`` call ``scaler.unscale_(optimizer)`` first,
        as with torch's ``clip_grad_norm_``: this moves the gradients from
        ``p.grad`` to the host, where GradScaler's inf check does not look, and a
        ``scaler.step`` after a clip of still-scaled gradients is refused (the
        gradients are put back in ``p.grad``)."""
        self._check_open("clip_grad_norm_")
        if not float(max_norm) >= 0:    # a negative one would flip the gradients
            raise OptimizerError(f"max_norm must be >= 0, got {max_norm!r}",
                                 argument="max_norm")
        try:    # as torch's: 'inf' (a string) for the infinity norm, any real order
            norm_type = float(norm_type)
        except (TypeError, ValueError):
            raise OptimizerError(f"norm_type must be a real number or 'inf', got "
                                 f"{norm_type!r}", argument="norm_type") from None
        _unscale_factor(grad_scale)     # checks it: finite, > 0, float32-representable
        scale = 1.0 if grad_scale is None else float(grad_scale)
        self._check_params()
        pending, fresh, zeroed = self._with_gradient()
        self._gather(pending, zeroed)
        grads = [self._grad_t[slice(*self._span(k))] for k, f in enumerate(fresh) if not f]
        if not grads:
            return torch.tensor(0.0)
        norms = []
        for g in grads:
            n = torch.linalg.vector_norm(g, norm_type, dtype=torch.float32)
            if not torch.isfinite(n) and bool(torch.isfinite(g).all()):
                # finite gradients whose norm overflowed float32 (a loss spike, or
                # the loss scale still in them): the float64 norm is finite
                n = torch.linalg.vector_norm(g, norm_type, dtype=torch.float64)
            norms.append(n.double())
        total64 = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if norm_type != 0:              # the 0-"norm" counts non-zeros: no scale in it
            total64 = total64 / scale
        total = total64.float()
        if not torch.isfinite(total64):
            if error_if_nonfinite:
                raise NonFiniteGradientError(
                    f"the total norm {float(total)} of order {norm_type} of the "
                    f"gradients is non-finite, so they cannot be clipped; pass "
                    f"error_if_nonfinite=False to go on (a step with the finite check "
                    f"then skips them)", argument="grads")
            return total
        coef = float(max_norm) / (float(total64) + 1e-6)   # torch's epsilon
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget flushed gradients, as ``torch.optim.Optimizer.zero_grad``.

        ``set_to_none=True``: the parameters have no gradient until the next
        flush. ``set_to_none=False``: every parameter that had one since the last
        ``zero_grad(set_to_none=True)`` (steps included, as torch keeps ``p.grad``
        across them) now has a zero gradient, so the next step updates it even if
        no backward reaches it (its moments decay, as in torch). Device
        gradients are dropped either way: they live on the host once flushed."""
        self._check_open("zero_grad")
        # (copies still in flight are ordered before the next ones on the D2H
        # stream, and step() waits for that stream before reading or writing)
        for k, p in enumerate(self.params):
            if p.grad is not None:    # not flushed yet (set by hand): torch zeroes it too
                self._had_grad[k] = True
            p.grad = None
        self._fresh = [True] * len(self.params)
        self._partial.clear()
        self._done_when_interrupted = self._left_by_interrupt = False
        if set_to_none:
            self._had_grad = [False] * len(self.params)
        self._grads_zeroed = not set_to_none
