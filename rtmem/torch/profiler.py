"""Measure an ``nn.Sequential`` into a :class:`~rtmem.planners.Chain`.

For each stage, from a sample input (thesis-remat.md §5.1, "parameter
estimation"): the forward runs under ``enable_grad`` with ``saved_tensors_hooks``
recording what autograd saves, the backward runs with a random gradient of the
output's shape, and:

- ``x``: bytes of the output's storage;
- ``xbar``: bytes of the unique storages of the output and of every saved tensor,
  minus parameters and the stage input (they are accounted as weights and as the
  previous activation);
- ``u_f``, ``u_b``: median seconds over ``repeats`` runs (CUDA events on a GPU,
  ``perf_counter`` on the CPU);
- ``o_f``, ``o_b``: temporary bytes, from ``torch.cuda.max_memory_allocated`` on a
  GPU (peak minus what is live before and after); 0 on the CPU, where no allocator
  reports a peak;
- ``w``: bytes of the stage's parameters;
- ``x0``: bytes of the input, numel x element size (the executor works on a
  compact copy when the batch views a larger storage);
- ``u_loss``: loss forward + backward seconds.

Byte counts use the same storage accounting as
:class:`~rtmem.torch.ScheduleExecutor`, so simulated activation memory and the
executor's measured memory agree.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from rtmem.errors import RtmemError
from rtmem.planners import Chain

from .executor import _storages

__all__ = ["profile_sequential"]


def _storage_bytes(tensors, exclude=()):
    """Bytes of the distinct storages of ``tensors`` whose data pointer is not in
    ``exclude``: the executor's accounting (its ``_storages``), so planned and
    measured bytes agree."""
    return sum(s.nbytes() for k, s in _storages(tensors).items() if k not in exclude)


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


def profile_sequential(model: nn.Sequential, inputs: torch.Tensor, target, loss_fn, *,
                       repeats: int = 3, name: str = "") -> Chain:
    """Profile ``model`` (an ``nn.Sequential`` of stages) on one batch.

    ``inputs``/``target`` are a representative batch and ``loss_fn(output, target)``
    the loss. ``repeats`` (>= 1) timed runs per operation, median kept. Parameter
    gradients, module buffers and the RNG state are restored afterwards, so
    profiling does not perturb training. Returns a :class:`~rtmem.planners.Chain`
    with times in seconds and sizes in bytes.
    """
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise RtmemError("profile_sequential needs a non-empty nn.Sequential of stages")
    if int(repeats) != repeats or repeats < 1:
        raise RtmemError(f"repeats must be an integer >= 1, got {repeats!r}")
    device = inputs.device
    timer = _Timer(device)
    buffers = {b: b.detach().clone() for b in model.buffers()}
    grads = {p: p.grad for p in model.parameters()}
    rng = torch.get_rng_state()
    cuda = device.type == "cuda"
    cols = {k: [] for k in ("u_f", "u_b", "x", "xbar", "w", "o_f", "o_b")}
    x = inputs.detach()
    try:
        for stage in model.children():
            params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
            xin = x.detach().requires_grad_(x.is_floating_point())
            saved = []

            def pack(t, saved=saved):
                saved.append(t)
                return t

            fwd_times = []
            for r in range(repeats):
                saved.clear()
                if cuda:
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                        pack, lambda t: t):
                    y, t_f = timer(lambda: stage(xin))
                fwd_times.append(t_f)
            xbar = _storage_bytes([y, *saved], exclude=params | {xin.untyped_storage().data_ptr()})
            o_f = 0
            if cuda:
                o_f = max(0, torch.cuda.max_memory_allocated(device) - base - xbar)
            delta = torch.randn_like(y) if y.is_floating_point() else None
            bwd_times = []
            for r in range(repeats):
                if cuda:
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                _, t_b = timer(lambda: torch.autograd.backward(
                    y, delta, retain_graph=r < repeats - 1))
                bwd_times.append(t_b)
                xin.grad = None
            o_b = 0
            if cuda:
                o_b = max(0, torch.cuda.max_memory_allocated(device) - base
                          - _storage_bytes([xin]))
            cols["u_f"].append(statistics.median(fwd_times))
            cols["u_b"].append(statistics.median(bwd_times))
            cols["x"].append(_storage_bytes([y]))
            cols["xbar"].append(max(xbar, _storage_bytes([y])))
            cols["w"].append(_storage_bytes(list(stage.parameters())))
            cols["o_f"].append(o_f)
            cols["o_b"].append(o_b)
            x = y.detach()
        z = x.detach().requires_grad_(True)
        loss_times = []
        for _ in range(repeats):
            def run():
                with torch.enable_grad():
                    loss_fn(z, target).backward()
            loss_times.append(timer(run)[1])
            z.grad = None
    finally:
        with torch.no_grad():
            for b, v in buffers.items():
                b.copy_(v)
        for p, g in grads.items():
            p.grad = g
        torch.set_rng_state(rng)
    return Chain(**cols, x0=inputs.numel() * inputs.element_size(),
                 u_loss=statistics.median(loss_times), name=name or f"profiled-{len(model)}-stages")
