"""GPU section of bench/train.py: the largest GPT-2 trainable with plain torch and
with rtmem, and throughput against a ZeRO-Offload-shaped baseline.

Runs only when ``torch.cuda.is_available()`` (see bench/train.py's docstring for
what is measured); without a GPU it returns ``{"measured": False, "reason": ...}``
(``_common.not_measured``) and nothing is fabricated.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint_sequential

from _common import not_measured  # bench/ is on sys.path: train.py put it there
from rtmem.errors import InfeasibleError
from rtmem.planners.chain import Chain
from rtmem.planners.remat import plan_remat
from rtmem.torch import OffloadedAdam, ScheduleExecutor, gpt2_model, profile_sequential

#: Device of the GPU section (a module global so the section can be smoke-tested).
GPU_DEVICE = "cuda"


def _chain_for_layers(block_chain: Chain, layers: int) -> Chain:
    """The profiled 2-block chain [emb, block, block, head] stretched to
    ``layers`` blocks (every block has the same costs and sizes)."""
    # select keeps every per-stage field (no_recompute included): a block the
    # profiler flagged stays flagged in each of its copies
    return block_chain.select([0] + [1] * layers + [3], name=f"gpt2-gpu-{layers}L")


def _free_cuda():
    # synchronize first: torch's pinned-host cache frees only blocks whose copies
    # have completed, and a trial stopped by an OOM left copies in flight
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    # torch's pinned-host cache (the ZeRO-shaped baseline's pin_memory) too, or a
    # depth search holds every trial's pinned bytes until exit
    empty_host = getattr(torch._C, "_host_emptyCache", None)
    if empty_host is not None:
        empty_host()
    torch.cuda.synchronize()


def _host_adam(params, lr):
    """torch's fastest CPU Adam: the fused kernel (torch >= 2.4 on CPU), else the
    multi-tensor one. Returns (optimizer, its name). The default single-tensor
    loop would make a needlessly slow baseline."""
    try:
        return torch.optim.Adam(params, lr=lr, fused=True), "fused"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(params, lr=lr, foreach=True), "foreach"


class ZeroOffloadShaped:
    """The ZeRO-Offload shape, written plainly with torch: fp32 master parameters
    and Adam state on pinned host memory; each step copies every parameter to the
    device, runs forward/backward with per-stage checkpointing (the activation
    checkpointing ZeRO-Offload is run with), copies every gradient to the host,
    then runs torch's fused CPU Adam (:func:`_host_adam`) after backward."""

    def __init__(self, model, loss_fn, lr=1e-4):
        self.model, self.loss_fn = model, loss_fn
        self.params = list(model.parameters())
        self.master = [p.detach().to("cpu").pin_memory() for p in self.params]
        for m in self.master:
            m.requires_grad_(True)
            m.grad = torch.zeros_like(m).pin_memory()
        self.opt, self.adam = _host_adam(self.master, lr)

    def step(self, x, y):
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m, non_blocking=True)                  # H2D: all parameters
        out = checkpoint_sequential(self.model, len(self.model), x, use_reentrant=False)
        loss = self.loss_fn(out, y)
        loss.backward()
        for p, m in zip(self.params, self.master):
            m.grad.copy_(p.grad, non_blocking=True)            # D2H: all gradients
            p.grad = None
        torch.cuda.synchronize()
        self.opt.step()                                        # CPU Adam after backward
        return loss.detach()


def _is_oom(exc: BaseException) -> bool:
    """Whether a RuntimeError from CUDA libraries means memory ran out."""
    text = str(exc)
    return "ALLOC_FAILED" in text or "out of memory" in text.lower()


def gpu_section(args, save=None):
    """The GPU results (a dict). ``save(partial)``, when given, is called after
    each depth search (plain torch's, then rtmem's) and after each throughput
    size, so a run stopped by a time limit still leaves what it measured."""
    save = save or (lambda partial: None)
    if not torch.cuda.is_available():
        return not_measured("no GPU: GPU section not measured "
                            "(torch.cuda.is_available() is False on this machine)")
    torch.set_float32_matmul_precision(args.gpu_matmul_precision)
    dev = torch.device(GPU_DEVICE)
    total = torch.cuda.get_device_properties(dev).total_memory
    cfg = dict(hidden=args.gpu_hidden, heads=args.gpu_heads, seq=args.gpu_seq,
               vocab=args.gpu_vocab)
    tokens = args.gpu_batch * args.gpu_seq
    t_start = time.perf_counter()
    out = {"measured": True, "device": torch.cuda.get_device_name(dev),
           "total_memory_bytes": total, "config": {**cfg, "batch": args.gpu_batch},
           "matmul_precision": args.gpu_matmul_precision, "dtype": "float32",
           "reserve_fraction": args.gpu_reserve}
    gen = torch.Generator().manual_seed(args.seed)

    def build(layers):
        torch.manual_seed(args.seed)
        with torch.device(dev):
            model, loss_fn, make_batch = gpt2_model(layers, cfg["hidden"], cfg["heads"],
                                                    cfg["seq"], cfg["vocab"], dropout=0.0)
        x, y = make_batch(args.gpu_batch, gen, device=dev)
        return model, loss_fn, x, y

    model, loss_fn, x, y = build(2)
    block_chain = profile_sequential(model, x, y, loss_fn, repeats=3, name="gpt2-gpu-2L")
    del model
    _free_cuda()
    out["block_profile"] = block_chain.to_dict()

    def plain_setup(layers):
        model, loss_fn, x, y = build(layers)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
        return step, (model, opt), {}

    def rtmem_setup(layers):
        _free_cuda()
        model, loss_fn, x, y = build(layers)
        opt = OffloadedAdam(model.parameters(), lr=1e-4)
        try:   # trial() closes it only once setup returns: tens of GB stay pinned else
            torch.cuda.synchronize()
            free, _ = torch.cuda.mem_get_info(dev)
            cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            # the chain counts the weights (already allocated) and the batch plus
            # everything else; what the caching allocator holds unused is available
            budget = int(free + cached + weights - args.gpu_reserve * total)
            chain = _chain_for_layers(block_chain, layers)
            try:
                plan = plan_remat(chain, budget, slots=args.gpu_slots)
            except InfeasibleError:
                raise torch.cuda.OutOfMemoryError(
                    f"plan_remat: infeasible at {budget} bytes") from None
            # the figures come from torch.cuda.max_memory_allocated: skip the
            # executor's per-operation count (~20 us of Python per op)
            ex = ScheduleExecutor(model, plan, loss_fn, track_memory=False)
        except BaseException:
            opt.close()
            raise

        def step():
            ex.step(x, y)
            opt.step()
        info = {"budget_bytes": budget, "plan_peak_bytes": int(plan.peak),
                "plan_makespan_s": float(plan.makespan), "method": plan.info.get("method")}
        return step, (model, opt, ex), info

    def zero_setup(layers):
        model, loss_fn, x, y = build(layers)
        z = ZeroOffloadShaped(model, loss_fn)
        return (lambda: z.step(x, y)), (model, z), {"host_adam": z.adam}

    def trial(setup, layers, timed=0):
        """Two steps (plus ``timed`` timed ones) at ``layers``; None on OOM."""
        step = objs = None
        try:
            step, objs, info = setup(layers)
            torch.cuda.reset_peak_memory_stats(dev)
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            times = []
            for _ in range(timed):
                gc.collect()     # as _common.round_robin does, and why
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            res = {"layers": layers, "max_allocated_bytes": torch.cuda.max_memory_allocated(dev),
                   **info}
            if times:
                res["median_step_s"] = statistics.median(times)
                res["tokens_per_s"] = tokens / res["median_step_s"]
            return res
        except (torch.cuda.OutOfMemoryError, MemoryError):
            # MemoryError: rtmem's OutOfMemoryError (pinned host memory) or the
            # host itself: this depth does not fit either way
            return None
        except RuntimeError as exc:
            # near the limit cuBLAS/cuDNN fail to get their workspace with a plain
            # RuntimeError ("CUBLAS_STATUS_ALLOC_FAILED"), which ended the whole
            # depth search instead of counting as "does not fit"
            if not _is_oom(exc):
                raise
            return None
        finally:
            for o in objs or ():
                if isinstance(o, OffloadedAdam):
                    o.close()
            step = objs = None      # drop the model before emptying the cache
            _free_cuda()

    def largest(setup, label):
        """Double from --gpu-start-layers until failure (or the cap), then bisect."""
        ok, bad, lo_res, tried = 0, None, None, []
        layers = min(args.gpu_start_layers, args.gpu_max_layers)
        while time.perf_counter() - t_start < args.gpu_time_s:
            r = trial(setup, layers)
            tried.append((layers, r is not None))
            print(f"  {label}: {layers} layers -> {'ok' if r else 'OOM'}", flush=True)
            if r is None:
                bad = layers
                break
            ok, lo_res = layers, r
            if layers >= args.gpu_max_layers:
                break
            layers = min(2 * layers, args.gpu_max_layers)
        while bad is not None and bad - ok > 1 and ok > 0 and \
                time.perf_counter() - t_start < args.gpu_time_s:
            mid = (ok + bad) // 2
            r = trial(setup, mid)
            tried.append((mid, r is not None))
            print(f"  {label}: {mid} layers -> {'ok' if r else 'OOM'}", flush=True)
            if r is None:
                bad = mid
            else:
                ok, lo_res = mid, r
        capped = bad is None and ok >= args.gpu_max_layers
        return {"largest_layers": ok, "first_failing_layers": bad, "cap_reached": capped,
                "cap_layers": args.gpu_max_layers, "tried": tried, "at_largest": lo_res}

    print("GPU: searching the largest trainable depth", flush=True)
    out["plain_torch"] = largest(plain_setup, "plain torch + Adam")
    save(out)     # a stop in rtmem's search (minutes) must not take this one with it
    out["rtmem"] = largest(rtmem_setup, "rtmem (rotor + OffloadedAdam)")
    out["time_limited"] = time.perf_counter() - t_start >= args.gpu_time_s
    sizes = sorted({s for s in (out["plain_torch"]["largest_layers"],
                                out["rtmem"]["largest_layers"]) if s})
    out["throughput"] = {}
    save(out)
    for layers in sizes:
        row = {}
        for name, setup in (("rtmem", rtmem_setup), ("plain torch", plain_setup),
                            ("zero-offload-shaped", zero_setup)):
            if name == "plain torch" and layers > out["plain_torch"]["largest_layers"]:
                row[name] = None
                continue
            if time.perf_counter() - t_start >= args.gpu_deadline_s:
                row[name] = "skipped: --gpu-deadline-s reached"
                continue
            r = trial(setup, layers, timed=args.gpu_repeats)
            row[name] = r if r is not None else "OOM"
        z, r = row.get("zero-offload-shaped"), row.get("rtmem")
        if isinstance(z, dict) and isinstance(r, dict):
            row["rtmem_over_zero_tokens_per_s"] = r["tokens_per_s"] / z["tokens_per_s"]
        p = row.get("plain torch")
        if isinstance(p, dict) and isinstance(r, dict):
            row["rtmem_over_plain_tokens_per_s"] = r["tokens_per_s"] / p["tokens_per_s"]
        out["throughput"][str(layers)] = row
        save(out)
    out["params_per_block"] = 12 * cfg["hidden"] ** 2 + 13 * cfg["hidden"]
    out["seconds"] = time.perf_counter() - t_start
    return out


