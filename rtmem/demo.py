"""``rtmem demo``: the main job, end to end on a small GPT-2 (or ResNet).

1. build a GPT-2-style transformer (rtmem.torch.gpt2_model; ``model="resnet"``:
   the ResNet-style CNN of rtmem.torch.resnet_model) and profile it into a Chain;
2. plan rematerialization under a budget (default: half the no-remat peak) with
   rotor, and compare it with the baselines in the simulator;
3. train a few steps on synthetic data with plain PyTorch and with the plan
   (rtmem.torch.ScheduleExecutor), same seed, same optimizer (rtmem.optim.CPUAdam);
4. print a table (measured peak activation memory, step time, loss) and write the
   schedule / memory plots.

Runs on the CPU (host backend) on any machine, and on the GPU when one is usable
(peak memory then from ``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import statistics
import time

__all__ = ["MODEL_OPTIONS", "build_model", "default_budget", "run_demo"]


def _import_torch():
    try:
        import torch
    except ModuleNotFoundError as e:  # pragma: no cover - depends on the install
        raise ModuleNotFoundError("the demo trains a model: pip install 'rtmem[torch]'") from e
    return torch


#: the models the demo trains, with the options that size each (run_demo's defaults)
MODEL_OPTIONS = {"gpt2": {"layers": 6, "hidden": 128, "heads": 4, "seq": 128, "vocab": 512},
                 "resnet": {"blocks": (2, 2, 2), "width": 16, "image": 32}}


def missing_folders(path: str) -> list:
    """The folders of ``path`` (absolute; ``path`` itself first) up to the
    first that exists, deepest first: what ``os.makedirs(path)`` would make,
    and so what to remove again when the work they were made for fails."""
    made, folder = [], os.path.abspath(path)
    while not os.path.isdir(folder):
        made.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return made


def remove_empty_folders(made: list) -> None:
    """Remove again the folders :func:`missing_folders` listed that are empty,
    deepest first; one that was never made or holds something is kept (a full
    folder's parents are not empty either, and rmdir refuses them)."""
    for folder in made:
        try:
            os.rmdir(folder)
        except OSError:
            continue


@contextlib.contextmanager
def _output_folder(path: str):
    """Make ``path`` (and missing parents) for the run; if the run fails, remove
    again the folders made here that stayed empty (only the last one went, and
    ``--out a/b/c`` left ``a`` and ``a/b`` behind)."""
    made = missing_folders(path)
    os.makedirs(path, exist_ok=True)
    try:
        yield
    except BaseException:
        remove_empty_folders(made)               # one that is not empty keeps what was written
        raise


def build_model(model: str = "gpt2", *, batch: int = 4, **sizes):
    """The model ``rtmem demo`` (and ``rtmem profile``) builds: ``(net, loss_fn,
    make_batch, name)``, as :func:`rtmem.torch.gpt2_model` /
    :func:`rtmem.torch.resnet_model` return them, plus the chain name the run
    gives it (the sizes and ``batch`` in it). ``sizes``: the options of
    ``MODEL_OPTIONS[model]``; those left out take its defaults."""
    if model not in MODEL_OPTIONS:
        raise ValueError(f"model must be one of {', '.join(MODEL_OPTIONS)}, got {model!r}")
    unknown = sorted(set(sizes) - set(MODEL_OPTIONS[model]))
    if unknown:
        raise ValueError(f"{', '.join(unknown)} do not size the {model} model; its options "
                         f"are {', '.join(MODEL_OPTIONS[model])}")
    _import_torch()
    from rtmem.torch import gpt2_model, resnet_model
    o = {**MODEL_OPTIONS[model], **sizes}
    if model == "gpt2":
        net, loss_fn, make_batch = gpt2_model(**o)
        name = f"gpt2-L{o['layers']}-h{o['hidden']}-s{o['seq']}-b{batch}"
    else:
        blocks = tuple(o["blocks"])
        net, loss_fn, make_batch = resnet_model(blocks=blocks, width=o["width"],
                                                image=o["image"])
        name = f"resnet-{'.'.join(map(str, blocks))}-w{o['width']}-i{o['image']}-b{batch}"
    return net, loss_fn, make_batch, name


def default_budget(least: int, peak: int) -> tuple[int, str]:
    """The demo's budget for a chain whose least feasible memory
    (:func:`~rtmem.planners.min_feasible_memory`) is ``least`` bytes and whose
    no-remat peak is ``peak`` bytes: half the peak, unless weights leave no
    schedule that small; then halfway between the two. Returns (bytes, why)."""
    from rtmem.units import format_bytes
    if peak // 2 >= least:
        return peak // 2, "half the peak"
    if least >= peak:
        return peak, "no schedule needs less than the peak"
    return (least + peak) // 2, f"half the peak is below the least feasible {format_bytes(least)}"


def run_demo(*, model: str = "gpt2", layers: int = 6, hidden: int = 128, heads: int = 4,
             seq: int = 128, vocab: int = 512, blocks=(2, 2, 2), width: int = 16,
             image: int = 32, batch: int = 4, steps: int = 5, memory=None,
             slots: int = 500, out: str = "out/demo", device: str | None = None,
             say=print) -> dict:
    """Profile, plan, train with and without the plan; return the measured figures.

    ``model``: ``"gpt2"`` (sized by ``layers``, ``hidden``, ``heads``, ``seq``,
    ``vocab``) or ``"resnet"`` (``blocks`` residual blocks per group, base
    ``width`` channels, ``image`` x ``image`` inputs; batch norm in training mode).
    ``memory``: device budget in bytes or a string like ``"40MiB"`` (default half of
    the simulated no-remat peak, or halfway between the least feasible memory and
    that peak when half is not feasible). Returns a dict with the plan, the per-step losses
    of both runs, their median step times (s) and measured peak activation bytes.
    """
    torch = _import_torch()
    from rtmem._table import format_table
    from rtmem.cli_plan import COMPARISON_HEADERS, comparison_rows
    from rtmem.optim import CPUAdam
    from rtmem.planners import (Platform, compare_remat, min_feasible_memory, plan_store_all,
                                store_all_schedule)
    from rtmem.planners.plan import Plan, as_budget
    from rtmem.plot import plot_schedule
    from rtmem.torch import ScheduleExecutor, profile_sequential
    from rtmem.units import format_bytes, format_seconds

    if model not in MODEL_OPTIONS:    # before anything is made
        raise ValueError(f"model must be one of {', '.join(MODEL_OPTIONS)}, got {model!r}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # an unusable folder fails now, not after training; one made here goes again if
    # the run fails before writing into it (an infeasible --memory left it empty)
    with _output_folder(out):
        torch.manual_seed(0)
        sizes = ({"layers": layers, "hidden": hidden, "heads": heads, "seq": seq,
                  "vocab": vocab} if model == "gpt2" else
                 {"blocks": blocks, "width": width, "image": image})
        net, loss_fn, make_batch, name = build_model(model, batch=batch, **sizes)
        model = net.to(device)
        gen = torch.Generator().manual_seed(1)
        batches = [tuple(t.to(device) for t in make_batch(batch, gen)) for _ in range(steps)]
        chain = profile_sequential(model, *batches[0], loss_fn, repeats=3, name=name)
        full = plan_store_all(chain, math.inf)
        why = ""
        if memory is not None:
            budget = as_budget(memory)
        else:
            budget, why = default_budget(min_feasible_memory(chain), full.peak)
            why = f" ({why})"
        say(f"{chain.name}: {chain.n} stages, {format_bytes(int(chain.w.sum()))} of weights, "
            f"no-remat peak {format_bytes(full.peak)} (simulated), budget "
            f"{format_bytes(budget)}{why}\n")

        plans = compare_remat(chain, budget, slots=slots)
        rows, _ = comparison_rows(plans, chain.compute_time)
        say(format_table(["planner (simulated)"] + COMPARISON_HEADERS[1:], rows, align="lrrrl"))
        plan = plans["rotor"]
        if not isinstance(plan, Plan):
            raise plan

        def train(schedule):
            m = copy.deepcopy(model)
            opt = CPUAdam(m.parameters(), lr=1e-3) if device.type == "cpu" else \
                torch.optim.Adam(m.parameters(), lr=1e-3)
            # on the GPU the allocator's peak is the figure; the executor's count is
            # needed (and paid for) only on the CPU
            ex = ScheduleExecutor(m, schedule, loss_fn, track_memory=device.type == "cpu")
            losses, times, peaks = [], [], []
            for x, y in batches:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = time.perf_counter()
                losses.append(float(ex.step(x, y)))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    peaks.append(torch.cuda.max_memory_allocated(device))
                else:
                    peaks.append(ex.peak_bytes)
                times.append(time.perf_counter() - t0)
                opt.step()
                opt.zero_grad()
            return losses, statistics.median(times), max(peaks)

        torch.manual_seed(2)
        plain = train(store_all_schedule(chain.n))
        torch.manual_seed(2)
        planned = train(plan.schedule)
        what = "peak memory (GPU)" if device.type == "cuda" else "peak activations"
        say("\n" + format_table(
            ["training run", what, "step time", "final loss"],
            [["no rematerialization", format_bytes(plain[2]), format_seconds(plain[1]),
              f"{plain[0][-1]:.6f}"],
             [f"rotor plan, {format_bytes(budget)}", format_bytes(planned[2]),
              format_seconds(planned[1]), f"{planned[0][-1]:.6f}"]]))
        same = max(abs(a - b) for a, b in zip(plain[0], planned[0]))
        say(f"\nlosses of the two runs differ by at most {same:.2e} over {steps} steps; "
            f"step time ratio {planned[1] / plain[1]:.2f} (simulated "
            f"{plan.makespan / full.makespan:.2f})")
        # The plan and chain first: they are written even if plotting fails.
        plan.save(os.path.join(out, "rotor_plan.json"))
        chain.save(os.path.join(out, "chain.json"))
        paths = [plot_schedule(chain, plan.schedule, Platform(budget),
                               os.path.join(out, "rotor_plan.png"),
                               title=f"rotor plan for {chain.name} under {format_bytes(budget)}"),
                 plot_schedule(chain, full.schedule, Platform(math.inf),
                               os.path.join(out, "no_remat.png"))]
        say("wrote " + ", ".join(paths + [os.path.join(out, "rotor_plan.json"),
                                          os.path.join(out, "chain.json")]))
        return {"chain": chain, "plan": plan, "budget": budget, "plain_losses": plain[0],
                "plan_losses": planned[0], "plain_step_s": plain[1], "plan_step_s": planned[1],
                "plain_peak_bytes": plain[2], "plan_peak_bytes": planned[2],
                "max_loss_difference": same}
