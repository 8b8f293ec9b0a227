"""The host side of :class:`~rtmem.torch.ScheduleExecutor`: every host copy it
holds (of activations, weights and gradients), the memory they live in, the
copies between device and host, and the moves of the model's own state: weights
(``w_offload`` / ``w_delete`` / ``w_prefetch``), gradients (``g_offload`` and the
host accumulators behind ``host_grads``) and the parameter and buffer pointers
that weight moves change. Separate from ``executor.py``, which runs the schedule
and decides what is stored, freed and moved when; this module does the moving.

The rules it follows are NOTE [ Executor ] in executor.py: point 5, and point 4
with the paragraph after the list (copies on CUDA streams).
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch

from rtmem.planners import Op

from ._stages import ExecutionError, _storage_ptrs, _storages


def _used_on(storages, stream):
    """Tell torch's caching allocator that work queued on ``stream`` uses these
    device storages, so a block freed meanwhile (on the compute stream) is not
    handed out again before that work is done (``Tensor.record_stream``)."""
    for s in storages:
        torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).record_stream(stream)


class _HostSide:
    """Mixin of :class:`~rtmem.torch.ScheduleExecutor`, which provides ``n``,
    ``_stage_params``, ``_stage_buffers``, ``host_arena``, the copy ``_streams``
    (None until a CUDA step), and per step ``_device`` and ``_ledger``; the
    activation moves (:mod:`._moves`) use ``_host``, :meth:`_host_storage` and
    :meth:`_copy`. A mixin rather than an object the executor owns: both sides
    share that state."""

    def __init__(self):
        # parameter -> pinned host copy of this step's weights; stage -> the CUDA
        # event of the D2H copy that wrote them (a w_prefetch waits for it) and
        # of the H2D copy that brought them back (stage compute waits for it)
        self._w_host: dict = {}
        self._w_saved: dict = {}
        self._w_ready: dict = {}
        # stage -> handle of its state_dict hook while its weights are placeholders
        self._w_hooks: dict = {}
        # parameter -> host gradient accumulator, and the g_offload copies not
        # yet added to it: (parameter, pinned copy, D2H event or None)
        self._g_host: dict = {}
        self._g_pending: list = []
        # (k, aux) -> (host copies aligned with the tensor's storages, None for
        # those never freed, the CUDA event of their D2H copy or None). Kept
        # across recomputations of the tensor: a recomputed value equals the
        # offloaded one, so a later instance may be deleted and prefetched from
        # the same copy (the simulator's Rule 5 keeps host copies the same way).
        self._host: dict = {}
        # device storage (_cdata) -> its newest host copy: (host storage, D2H event,
        # weak reference to the stored tensor copied, position in its storages)
        self._newest: dict = {}
        self._host_bufs: list = []

    def _host_storage(self, nbytes: int):
        """A host byte storage of ``nbytes`` for an offload: from the host arena when
        one was given (pinned on the cuda backend), else torch's allocator."""
        if self.host_arena is None:
            return torch.empty(nbytes, dtype=torch.uint8,
                               pin_memory=self._device.type == "cuda").untyped_storage()
        from .bridge import as_tensor
        # Only the copy streams touch these bytes, each fenced behind the compute
        # stream: reuse in its order (the CPU default would wait for the GPU).
        buf = self.host_arena.alloc(nbytes, kind="activation",
                                    stream=self.host_arena.backend.current_stream())
        self._host_bufs.append(buf)
        return as_tensor(buf).untyped_storage()

    def _release_host(self):
        """Free this step's host copies (arena buffers are freed once their tensor
        views are gone, NOTE [ Pinned views ])."""
        self._host.clear()
        self._newest.clear()
        bufs, self._host_bufs = self._host_bufs, []
        for buf in bufs:
            buf.free()

    def _note_copies(self, st, host: list, done) -> None:
        """Record ``host`` (aligned with ``st.storages``; the offload of stored
        tensor ``st``, its event ``done``) as the newest copy of each storage."""
        ref = weakref.ref(st)
        for i, (s, h) in enumerate(zip(st.storages, host)):
            if h is not None:
                self._newest[s._cdata] = (h, done, ref, i)

    def _restore_sources(self, st, host: list, done) -> list:
        """``(device storage, host copy, D2H event)`` for each storage of stored
        tensor ``st`` that a prefetch must bring back (freed, with a copy in
        ``host``, made by the event ``done``), each from the newest copy of that
        storage.

        That is ``host`` unless another stored tensor holding the same storage was
        offloaded later, after an in-place change to it (a stage's ``x.mul_()`` on
        its input, which the stage's next op saves): then the later copy holds
        what plain autograd reads, and restoring the older one would bring back
        stale bytes that a later prefetch of the other tensor, finding the storage
        back, would keep. The recorded copy counts only while the stored tensor
        it copied is alive and still holds the storage: a live storage's
        ``_cdata`` is unique, a dead one's may be reused by a new storage."""
        out = []
        for i, (s, h) in enumerate(zip(st.storages, host)):
            if h is None or s.nbytes():
                continue
            src, event = h, done
            newest = self._newest.get(s._cdata)
            if newest is not None:
                h2, event2, ref, j = newest
                other = ref()
                if other is not None and other.storages[j]._cdata == s._cdata \
                        and h2.nbytes() == h.nbytes():
                    src, event = h2, event2
            out.append((s, src, event))
        return out

    def _copy(self, direction: str, pairs, device_storages, after=()):
        """``dst.copy_(src)`` for each pair. On CUDA the copies run on the
        ``direction`` ("h2d" / "d2h") stream behind the compute enqueued so far
        (which allocated the destinations) and the events ``after``, and
        ``device_storages`` (their device side) are marked used there, so a drop
        meanwhile does not free them under the copy; returns the copies' event.
        On the CPU they run at once; returns None."""
        if self._device.type != "cuda":
            for dst, src in pairs:
                dst.copy_(src)
            return None
        stream = self._streams[0 if direction == "h2d" else 1]
        stream.wait_stream(torch.cuda.current_stream(self._device))
        for event in after:
            if event is not None:
                stream.wait_event(event)
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        _used_on(device_storages, stream)
        return stream.record_event()

    def _to_host(self, tensors):
        """New host tensors (pinned on CUDA) holding copies of device ``tensors``,
        and the copies' event (:meth:`_copy`)."""
        pinned = self._device.type == "cuda"
        # the device layout (strides): saved views of a weight are re-derived with
        # the strides they had (NOTE rule 5), so a transposed or channels-last
        # weight must come back as it was (a contiguous copy scrambled them)
        host = [torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, pin_memory=pinned)
                for t in tensors]
        return host, self._copy("d2h", list(zip(host, tensors)),
                                _storages(tensors).values())

    def _stage_state(self, i: int) -> tuple:
        """Stage ``i``'s model state: its parameters, buffers and constant tables."""
        return (*self._stage_params[i], *self._stage_buffers[i], *self._stage_consts[i])

    def _stage_state_ptrs(self, i: int) -> tuple:
        # a tuple of ints: made every step and kept all of it, but not tracked by
        # the garbage collector (a set would be, and would reach the oldest
        # generation)
        return tuple(_storage_ptrs(self._stage_state(i)))

    def _refresh_state_ptrs(self):
        """Storages of the parameters and buffers: never freed by a move (rule 4)
        and excluded from activation accounting. They change only when weight
        moves swap ``.data`` (then :meth:`_refresh_stage_ptrs`). Kept per stage,
        with a count per pointer across stages (stages may share a parameter)."""
        self._state_per_stage = [self._stage_state_ptrs(i) for i in range(self.n)]
        # also the set of state pointers (tested with `in`): _refresh_stage_ptrs
        # deletes the counts that reach zero
        self._state_count = Counter(p for ptrs in self._state_per_stage for p in ptrs)
        self._ledger.exclude(self._state_count)

    def _refresh_stage_ptrs(self, i: int):
        """:meth:`_refresh_state_ptrs` after a weight move of stage ``i``, which
        changes only that stage's pointers: O(its parameters), not the model's."""
        old, new = self._state_per_stage[i], self._stage_state_ptrs(i)
        self._state_per_stage[i] = new
        count, removed, added = self._state_count, [], []
        old, new = set(old), set(new)
        for ptr in old - new:
            count[ptr] -= 1
            if not count[ptr]:
                del count[ptr]
                removed.append(ptr)
        for ptr in new - old:
            count[ptr] += 1
            if count[ptr] == 1:
                added.append(ptr)
        self._ledger.exclude_change(removed, added)

    def _wait_weights(self, i: int):
        """Order compute after the H2D copy of stage i's prefetched weights."""
        ready = self._w_ready.pop(i, None)
        if ready is not None:
            torch.cuda.current_stream(self._device).wait_event(ready)

    def _weights(self, op, i: int):
        if op == Op.W_PREFETCH:
            params = [p for p in self._stage_params[i] if p in self._w_host]
            host = [self._w_host[p] for p in params]
            # always new tensors (on the CPU too, where sharing the host copy would
            # hide a stale copy from every test), allocated on the compute stream,
            # filled behind the D2H copy that wrote the host copies; the stage's
            # next compute waits (_wait_weights)
            dev = [torch.empty_like(h, device=self._device) for h in host]
            ready = self._copy("h2d", list(zip(dev, host)), _storages(dev).values(),
                               after=(self._w_saved.get(i),))
            if ready is not None:
                self._w_ready[i] = ready
            for p, d in zip(params, dev):
                p.data = d
        else:
            # Both free the device weights. w_offload copies them first; w_delete
            # (the host is master) copies only what no earlier move of this step
            # copied: the weights do not change within a step, but the optimizer
            # changes them between steps, so each step takes its own copy.
            params = [p for p in self._stage_params[i] if p.numel()]   # on the device
            fresh = [p for p in params if op == Op.W_OFFLOAD or p not in self._w_host]
            if fresh:
                self._wait_weights(i)   # a prefetch may still be filling them
                host, event = self._to_host([p.data for p in fresh])
                self._w_host.update(zip(fresh, host))
                self._w_saved[i] = event
            for p in params:   # freed behind the D2H copy (_to_host marked them used)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            if i not in self._w_hooks:
                self._w_hooks[i] = self.stages[i].register_state_dict_post_hook(
                    lambda *args, i=i: self._host_weights_in(i, *args))
        self._refresh_stage_ptrs(i)

    def _host_weights_in(self, i: int, module, state_dict, prefix, _metadata):
        """state_dict post-hook of stage ``i`` while the step has moved its weights
        off the device: their entries are the host copies, not the 0-element
        placeholders. A state_dict() taken mid-step (by a loss_fn, a hook, a
        SIGTERM handler saving a checkpoint) held the placeholders, and torch.save
        wrote a checkpoint that only failed at load ("size mismatch")."""
        event = self._w_saved.get(i)
        for name, p in module.named_parameters(remove_duplicate=False):
            host = self._w_host.get(p)
            if host is not None and p.data.numel() == 0 and prefix + name in state_dict:
                if event is not None:
                    event.synchronize()         # the D2H copy that wrote it ended
                state_dict[prefix + name] = host

    def _restore_weights(self):
        """Put back weights the schedule left on the host (every step starts with
        all weights on the device, Rule 6 of the simulator) and forget the host
        copies: the optimizer changes the weights between steps, so a copy kept
        for the next step's ``w_delete`` would bring back stale values."""
        for p, host in self._w_host.items():
            if p.data.numel() == 0 and host.numel():
                p.data = host.to(self._device, copy=True)   # compute waited the D2H
        self._w_host.clear()
        self._w_saved.clear()
        self._w_ready.clear()
        for handle in self._w_hooks.values():
            handle.remove()
        self._w_hooks.clear()

    def _grads_to_host(self, i: int):
        # copies that ended are added now: with gradient accumulation and no
        # host_grads() call between micro-batches they piled up, a full host copy
        # of the gradients per micro-batch
        self._settle_grads(wait=False)
        params = [p for p in self._stage_params[i] if p.grad is not None]
        if not params:
            return
        for p in params:
            if p.grad.layout != torch.strided:   # refused before any copy is made
                raise ExecutionError(
                    f"g_offload {i}: parameter {self._param_names.get(p, '?')!r} has a "
                    f"{p.grad.layout} gradient (e.g. nn.Embedding(sparse=True)), and "
                    f"g_offload copies dense ones: make the layer produce dense "
                    f"gradients, or keep stage {i}'s gradients on the device (no "
                    f"g_offload {i} in the schedule)")
        host, event = self._to_host([p.grad for p in params])
        for p, h in zip(params, host):
            p.grad = None   # freed behind the copy (_to_host marked it used there)
            if p in self._g_host:
                self._g_pending.append((p, h, event))
            else:   # the first gradient of p becomes its accumulator (once copied)
                self._g_host[p] = h
                self._g_pending.append((p, None, event))

    def _settle_grads(self, wait: bool = True):
        """Add up the gradient copies that ended; with ``wait``, wait for the rest.
        They run in order on one stream, so the first one still running stops
        the loop (the sums stay in issue order)."""
        pending = self._g_pending
        done = 0
        try:
            for p, h, event in pending:
                if event is not None:
                    if not wait and not event.query():
                        break
                    event.synchronize()
                if h is not None:
                    self._g_host[p] += h
                done += 1
        finally:    # what was added is never added twice
            del pending[:done]
