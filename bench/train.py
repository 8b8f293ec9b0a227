"""Training steps under a memory budget: rtmem's plans replayed by
:class:`~rtmem.torch.ScheduleExecutor` next to plain torch and
``torch.utils.checkpoint.checkpoint_sequential`` at equal memory, in one process.

    .venv/bin/python bench/train.py [--repeats 7] [--layers 8 --hidden 256 --seq 256 --batch 4]

CPU section (always). A GPT-2-style model (``rtmem.torch.gpt2_model``: embedding,
``--layers`` blocks, head; n = layers + 2 stages) is profiled into a Chain with
``profile_sequential``. Contenders, each timed as a whole training step (forward,
loss, backward; gradients zeroed outside the timed region), round-robin over
``--repeats`` rounds after one warm-up step each, median kept (executors time
with ``track_memory=False``; their byte count comes from the warm-up step):

- ``torch plain``: ``loss_fn(model(x), y).backward()``;
- ``torch ckseq k``: ``checkpoint_sequential(model, k, x, use_reentrant=False)``
  for k in {2, round(sqrt(n)), 4};
- ``exec store-all`` / ``exec seq k``: the same two strategies as schedules
  (``store_all_schedule``, ``sequential_schedule``) replayed by the executor,
  so the executor's overhead over native torch is visible;
- ``rotor @seq k``: ``plan_remat(chain, budget)`` with budget = the simulated
  peak (bytes) of ``sequential_schedule(n, k)``: equal memory;
- ``rotor @50%`` / ``exec seq best @50%``: budget = half the simulated peak of
  store-all (bytes, weights included), rotor vs the fastest segment count fitting;
  ``@r80`` the same at 80% of the way from the least feasible memory to the
  store-all peak (where checkpoint_sequential is down to 2 segments).

The rotor rows use ``plan_remat``'s default 500 slots (what a user gets); the JSON
also gives the makespan of the DP with a slot that divides every size (no
rounding), and the predicted rotor / best-sequential curve over budgets.

Memory, per contender: ``exec peak`` is the executor's storage accounting
(``ScheduleExecutor.peak_bytes``: activation bytes between operations, x0 and
gradients delta included, parameters excluded). It is predicted by simulating the
schedule on the chain with its weights set to 0: ``pred between`` is the largest
``mem_after`` of the timeline (the same "between operations" quantity),
``pred during`` the simulator's peak (output and overhead of the running op
included, an upper bound). ``alloc peak`` is measured the same way for every
contender, native torch included: the peak of the CPU allocator's bytes above the
level before the step, from ``torch.profiler`` memory events over one profiled
step started with ``.grad = None`` (activations, weight gradients, temporaries);
its prediction ``sim-w`` is the simulated peak minus weights and x0 (resident
before the step). ``grad diff`` is the largest |difference| of the parameter
gradients from plain torch's (same batch; dropout 0).

Also: a training step with ``rtmem.torch.OffloadedAdam`` vs ``torch.optim.Adam``
on copies of the same model (on the CPU both run on the host: expect ~equal).

GPU section (only when ``torch.cuda.is_available()``): the largest GPT-2 depth
trainable (2 steps without OOM) with plain torch + ``torch.optim.Adam`` on the
device, and with rtmem (``plan_remat`` on a chain built from a profiled block +
ScheduleExecutor + OffloadedAdam), found by doubling then bisecting the layer
count; then tokens/s of rtmem, plain torch and a ZeRO-Offload-shaped baseline
(fp32 master params and Adam on pinned host memory, every parameter copied to the
device each step, per-stage checkpointing, gradients copied to the host, CPU
``torch.optim.Adam`` after backward). Without a GPU nothing is measured and the
JSON says so.

Threads: the CPU section runs torch (and OffloadedAdam's kernel) with
``--threads`` (default 1). On a shared 2-core machine, 2 intra-op threads showed
bursts of 10x slower steps (spin-waiting on a descheduled peer; the process's CPU
time inflates too) while 1 thread stayed within +-10%; ratios are what count.

Writes a table to stdout and JSON to ``bench/results/train.json`` (or ``--out``:
a file path, ending in ``.json`` or with a folder, or a bare result name, written
as NAME.json there). Times are
seconds, sizes bytes; quote the ratios, absolute times are noisy on shared CPUs.
The JSON is also written after the CPU section (when a GPU section follows), after
each GPU depth search and after each GPU throughput size, marked ``"partial":
true`` until the run is complete; a run stopped by SIGINT (bench/gpu_session.sh's
time limit) keeps those and exits with code 130, and one whose GPU section fails
keeps them with the error and exits with code 1.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import math
import os
import statistics
import sys
import time
import traceback

# _common first: a stop while torch loads (seconds) is one line, not a traceback
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (MAX_REPEATS, MAX_THREADS, CommandParser, PartialResults,  # noqa: E402
                     at_least, command_line, count, gpu_required, not_measured, output_file,
                     round_robin, write_results)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint_sequential  # noqa: E402
from train_gpu import gpu_section  # noqa: E402

from rtmem._table import format_table  # noqa: E402
from rtmem.errors import InfeasibleError  # noqa: E402
from rtmem.planners import Platform, simulate  # noqa: E402
from rtmem.planners.baselines import (plan_sequential, sequential_schedule,  # noqa: E402
                                      store_all_schedule)
from rtmem.planners.chain import Chain  # noqa: E402
from rtmem.planners.remat import min_feasible_memory, plan_remat  # noqa: E402
from rtmem.torch import (OffloadedAdam, ScheduleExecutor, gpt2_model,  # noqa: E402
                         profile_sequential)

MB = 2**20


# ----------------------------------------------------------------- measuring
def alloc_peak_bytes(fn) -> int:
    """Peak of the allocator's bytes above the level before ``fn()`` (bytes), from
    torch.profiler memory events (CPU allocations; CUDA ones on a GPU)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return int(peak)


def flat_grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()]).detach().clone()


def predicted_activation_peaks(chain: Chain, schedule) -> tuple[int, int]:
    """(between operations, during operations) activation bytes of ``schedule``:
    the simulator on ``chain`` with its weights (hence weight gradients) set to 0."""
    res = simulate(dataclasses.replace(chain, w=np.zeros(chain.n)), schedule,
                   Platform(math.inf))
    return int(res.timeline["mem_after"].max()), int(res.peak)


# ---------------------------------------------------------------- CPU section
def min_profile(model, x, y, loss_fn, profiles, repeats, name) -> Chain:
    """``profile_sequential`` ``profiles`` times; per stage the least of the median
    times (seconds), which resists bursts of CPU contention. Sizes must agree."""
    runs = [profile_sequential(model, x, y, loss_fn, repeats=repeats, name=name)
            for _ in range(profiles)]
    for r in runs[1:]:
        for k in ("x", "xbar", "w"):
            assert np.array_equal(getattr(r, k), getattr(runs[0], k)), f"{k} differs"
    return dataclasses.replace(runs[0], u_f=np.min([r.u_f for r in runs], axis=0),
                               u_b=np.min([r.u_b for r in runs], axis=0),
                               u_loss=min(r.u_loss for r in runs))


def exact_slot_bytes(chain: Chain, budget: int, max_slots: int = 200_000):
    """A slot size (bytes) dividing every size of ``chain`` and the activation budget,
    so the DP's rounding up is exact; None if that needs more than ``max_slots``."""
    sizes = [int(v) for k in ("x", "xbar", "w", "o_f", "o_b") for v in getattr(chain, k)]
    fixed = int(chain.x0) + int(chain.w.sum())
    g = math.gcd(*sizes, int(chain.x0), int(chain.o_loss), budget - fixed)
    return g if g > 0 and (budget - fixed) // g <= max_slots else None


def exact_prediction(chain, budget) -> dict:
    """Makespan (s) of plan_remat with a slot that divides every size (no rounding
    loss), to separate discretization from the default 500-slot plan."""
    slot = exact_slot_bytes(chain, budget)
    if slot is None:
        return {"exact_dp_makespan_s": None, "exact_dp_slot_bytes": None}
    plan = plan_remat(chain, budget, slot_bytes=slot)
    return {"exact_dp_makespan_s": float(plan.makespan), "exact_dp_slot_bytes": slot}


def build_contenders(model, loss_fn, x, y, chain, ks):
    """Name -> dict(step=callable, kind, schedule, plan facts)."""
    n = chain.n
    out = {}

    def native_plain():
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.detach()

    def native_ckseq(k):
        def step():
            loss = loss_fn(checkpoint_sequential(model, k, x, use_reentrant=False), y)
            loss.backward()
            return loss.detach()
        return step

    def executor(schedule):
        ex = ScheduleExecutor(model, schedule, loss_fn)
        return ex, (lambda: ex.step(x, y))

    def add(name, kind, schedule, budget=None, plan=None, step=None, extra=None):
        sim = simulate(chain, schedule, Platform(math.inf))
        ex = None
        if step is None:
            ex, step = executor(schedule)
        between, during = predicted_activation_peaks(chain, schedule)
        out[name] = dict(step=step, kind=kind, executor=ex, schedule=schedule,
                         budget_bytes=budget, sim_makespan_s=float(sim.makespan),
                         sim_peak_bytes=int(sim.peak), pred_act_between_bytes=between,
                         pred_act_during_bytes=during,
                         plan_info=dict(plan.info) if plan is not None else None,
                         **(extra or {}))

    sa = store_all_schedule(n)
    add("torch plain", "torch", sa, step=native_plain)
    add("exec store-all", "executor", sa)
    for k in ks:
        sched = sequential_schedule(n, k)
        add(f"torch ckseq {k}", "torch", sched, step=native_ckseq(k))
        add(f"exec seq {k}", "executor", sched)
    for k in ks:
        budget = out[f"exec seq {k}"]["sim_peak_bytes"]
        plan = plan_remat(chain, budget)
        add(f"rotor @seq {k}", "executor", plan.schedule, budget, plan,
            extra=exact_prediction(chain, budget))
    peak_all = out["exec store-all"]["sim_peak_bytes"]
    for label, budget in budget_points(chain, peak_all):
        try:
            plan = plan_remat(chain, budget)
        except InfeasibleError as e:
            print(f"note: rotor cannot fit {label}: {e}")
            continue
        add(f"rotor @{label}", "executor", plan.schedule, budget, plan,
            extra=exact_prediction(chain, budget))
        try:
            seq = plan_sequential(chain, budget)
        except InfeasibleError as e:
            print(f"note: no checkpoint_sequential segment count fits {label}: {e}")
            continue
        add(f"exec seq best @{label}", "executor", seq.schedule, budget, seq,
            extra={"segments": seq.info["segments"]})
    return out


def budget_points(chain, peak_all):
    """(label, budget bytes) of the free-budget comparisons: half the store-all peak,
    and 80% of the way from the least feasible memory to the store-all peak (where
    sequential must fall back to 2 segments and rotor can keep more)."""
    lo = min_feasible_memory(chain)
    return [("50%", peak_all // 2), ("r80", int(lo + 0.8 * (peak_all - lo)))]


def predicted_curve(chain, points=11) -> list:
    """rotor / best checkpoint_sequential simulated makespan at budgets from the least
    feasible memory to the store-all peak (fraction 0..1 of that range)."""
    lo = min_feasible_memory(chain)
    hi = simulate(chain, store_all_schedule(chain.n), Platform(math.inf)).peak
    rows = []
    for f in np.linspace(0, 1, points):
        budget = int(lo + f * (hi - lo))
        rotor = plan_remat(chain, budget)
        try:
            seq = plan_sequential(chain, budget)
        except InfeasibleError:
            seq = None
        rows.append({"fraction": float(f), "budget_bytes": budget,
                     "rotor_makespan_s": float(rotor.makespan),
                     "seq_best_segments": None if seq is None else seq.info["segments"],
                     "rotor_over_seq_best": None if seq is None
                     else float(rotor.makespan / seq.makespan)})
    return rows


def time_round_robin(model, contenders, repeats, reference_grads, reference_loss):
    """Warm-up (and correctness check against plain torch) then ``repeats`` rounds."""
    for c in contenders.values():
        model.zero_grad(set_to_none=True)
        loss = c["step"]()
        g = flat_grads(model)
        c["loss_abs_diff"] = abs(float(loss) - reference_loss)
        c["grad_max_abs_diff"] = float((g - reference_grads).abs().max())
        c["times_s"], c["cpu_times_s"] = [], []
        if c["executor"] is not None:
            # the warm-up step counted the activation bytes; timed steps run as a
            # training loop would, without the per-operation count
            c["exec_peak_bytes"] = int(c["executor"].peak_bytes)
            c["executor"].track_memory = False
    for _ in range(repeats):
        for c in contenders.values():
            model.zero_grad(set_to_none=True)
            gc.collect()         # as _common.round_robin does, and why
            t0, c0 = time.perf_counter(), time.process_time()
            c["step"]()
            c["times_s"].append(time.perf_counter() - t0)
            c["cpu_times_s"].append(time.process_time() - c0)
    for c in contenders.values():
        c["median_s"] = statistics.median(c["times_s"])
        c["median_cpu_s"] = statistics.median(c["cpu_times_s"])
        model.zero_grad(set_to_none=True)     # weight gradients are made by the step
        c["alloc_peak_bytes"] = alloc_peak_bytes(c["step"])
    model.zero_grad(set_to_none=True)


def optimizer_section(model, loss_fn, x, y, repeats, threads):
    """Training step (plain fwd/bwd + optimizer step) with torch Adam vs OffloadedAdam
    on two copies of ``model``; same data, same number of steps."""
    m_t, m_r = copy.deepcopy(model), copy.deepcopy(model)
    opt_t = torch.optim.Adam(m_t.parameters(), lr=1e-4)
    opt_r = OffloadedAdam(m_r.parameters(), lr=1e-4, num_threads=threads)

    def step(m, opt):
        def run():
            opt.zero_grad(set_to_none=True)
            loss_fn(m(x), y).backward()
            opt.step()
        return run

    runs = {"torch.optim.Adam": step(m_t, opt_t), "rtmem OffloadedAdam": step(m_r, opt_r)}
    times = round_robin(runs, repeats)   # its warm-up compiles the update kernel
    diff = max(float((a.detach() - b.detach()).abs().max())
               for a, b in zip(m_t.parameters(), m_r.parameters()))
    opt_r.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"steps_each": repeats + 1, "times_s": times, "median_s": med,
            "ratio_offloaded_over_torch": med["rtmem OffloadedAdam"] / med["torch.optim.Adam"],
            "param_max_abs_diff_after_steps": diff,
            "note": "on the CPU both optimizers run on the host; the comparison is "
                    "the update kernel and the gradient-flush hooks, not transfers"}


def cpu_section(args):
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, loss_fn, make_batch = gpt2_model(args.layers, args.hidden, args.heads, args.seq,
                                            args.vocab, dropout=0.0)
    x, y = make_batch(args.batch, torch.Generator().manual_seed(args.seed))
    t0 = time.perf_counter()
    chain = min_profile(model, x, y, loss_fn, args.profiles, args.profile_repeats,
                        name=f"gpt2-cpu-{args.layers}L")
    profile_s = time.perf_counter() - t0
    n = chain.n
    # segment counts of checkpoint_sequential: 2, ~sqrt(n), 4, those the chain has
    ks = sorted(k for k in {2, round(math.sqrt(n)), 4} if 1 <= k <= n)
    contenders = build_contenders(model, loss_fn, x, y, chain, ks)
    model.zero_grad(set_to_none=True)
    ref = loss_fn(model(x), y)
    ref.backward()
    ref_loss, ref_grads = float(ref.detach()), flat_grads(model)
    time_round_robin(model, contenders, args.repeats, ref_grads, ref_loss)
    opt = optimizer_section(model, loss_fn, x, y, args.opt_repeats, args.threads)
    return dict(chain=chain, ks=ks, contenders=contenders, optimizer=opt,
                curve=predicted_curve(chain),
                profile_s=profile_s, n_params=sum(p.numel() for p in model.parameters()))


def _exact_ratio(rotor, seq):
    m = rotor.get("exact_dp_makespan_s")
    return None if m is None else m / seq["sim_makespan_s"]


def ratios(res):
    """The comparisons the benchmark exists for, as ratios of medians."""
    c = res["contenders"]

    def t(name):
        return c[name]["median_s"]

    def pred(name, base):
        return c[name]["sim_makespan_s"] / c[base]["sim_makespan_s"]

    out = {"executor_over_native": {}, "rotor_over_sequential_equal_memory": {},
           "predicted_vs_measured_time": {}, "peaks": {}}

    def cpu(name):
        return c[name]["median_cpu_s"]

    def rotor_vs(r, s, native):
        """Rotor row ``r`` against the executor's sequential row ``s`` at the same
        budget, and against checkpoint_sequential row ``native`` when it was run."""
        def over_native(key, value):
            return value / c[native][key] if native in c else None
        return {"budget_bytes": c[r]["budget_bytes"],
                "measured_rotor_over_exec_seq": t(r) / t(s),
                "measured_rotor_over_torch_ckseq": over_native("median_s", t(r)),
                "cpu_time_rotor_over_exec_seq": cpu(r) / cpu(s),
                "predicted_rotor_over_seq": pred(r, s),
                "predicted_exact_dp_rotor_over_seq": _exact_ratio(c[r], c[s]),
                "alloc_peak_rotor_over_torch_ckseq":
                    over_native("alloc_peak_bytes", c[r]["alloc_peak_bytes"]),
                "alloc_peak_rotor_over_exec_seq":
                    c[r]["alloc_peak_bytes"] / c[s]["alloc_peak_bytes"],
                "exec_peak_rotor_over_exec_seq":
                    c[r]["exec_peak_bytes"] / c[s]["exec_peak_bytes"]}

    out["executor_over_native_cpu_time"] = {
        "store-all / torch plain": cpu("exec store-all") / cpu("torch plain")}
    out["executor_over_native"]["store-all / torch plain"] = t("exec store-all") / t("torch plain")
    for k in res["ks"]:
        out["executor_over_native"][f"seq {k} / torch ckseq {k}"] = \
            t(f"exec seq {k}") / t(f"torch ckseq {k}")
        out["executor_over_native_cpu_time"][f"seq {k} / torch ckseq {k}"] = \
            cpu(f"exec seq {k}") / cpu(f"torch ckseq {k}")
        out["rotor_over_sequential_equal_memory"][f"k={k}"] = rotor_vs(
            f"rotor @seq {k}", f"exec seq {k}", f"torch ckseq {k}")
    for label in ("50%", "r80"):
        s = f"exec seq best @{label}"
        if s not in c:
            continue
        k = c[s]["segments"]
        out["rotor_over_sequential_equal_memory"][f"{label} (seq best k={k})"] = {
            "segments": k, **rotor_vs(f"rotor @{label}", s, f"torch ckseq {k}")}
    for name, d in c.items():
        if d["kind"] != "executor":
            continue
        out["predicted_vs_measured_time"][name] = {
            "predicted_over_store_all": pred(name, "exec store-all"),
            "measured_over_exec_store_all": t(name) / t("exec store-all"),
            "cpu_time_over_exec_store_all": cpu(name) / cpu("exec store-all")}
        out["peaks"][name] = {
            "exec_peak_bytes": d["exec_peak_bytes"],
            "pred_between_bytes": d["pred_act_between_bytes"],
            "pred_during_bytes": d["pred_act_during_bytes"],
            "measured_over_pred_between": d["exec_peak_bytes"] / d["pred_act_between_bytes"],
            "measured_over_pred_during": d["exec_peak_bytes"] / d["pred_act_during_bytes"]}
    out["compute_time_check"] = {
        "chain_compute_time_s": float(res["chain"].compute_time),
        "measured_torch_plain_s": t("torch plain"),
        "measured_over_profiled": t("torch plain") / float(res["chain"].compute_time)}
    return out


# -------------------------------------------------------------------- output
def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def print_tables(cpu, rat):
    c = cpu["contenders"]
    base_t = c["torch plain"]["median_s"]
    fixed = int(cpu["chain"].w.sum()) + int(cpu["chain"].x0)
    rows = []
    for name, d in c.items():
        rows.append([name, f"{d['median_s']:.3f}", f"{d['median_s'] / base_t:.2f}",
                     f"{d['sim_makespan_s'] / c['exec store-all']['sim_makespan_s']:.2f}",
                     f"{d['sim_peak_bytes'] / MB:.1f}",
                     "-" if d.get("exec_peak_bytes") is None
                     else f"{d['exec_peak_bytes'] / MB:.1f}",
                     f"{d['pred_act_between_bytes'] / MB:.1f}",
                     f"{d['pred_act_during_bytes'] / MB:.1f}",
                     f"{d['alloc_peak_bytes'] / MB:.1f}",
                     f"{(d['sim_peak_bytes'] - fixed) / MB:.1f}",
                     f"{d['grad_max_abs_diff']:.1e}"])
    print(format_table(["contender", "median s", "t/torch", "sim t/sa", "sim peak MiB",
                        "exec peak MiB", "pred btw MiB", "pred dur MiB", "alloc peak MiB",
                        "sim-w MiB", "grad diff"], rows))
    print()
    rows = [[k, f"{v:.2f}", f"{rat['executor_over_native_cpu_time'][k]:.2f}"]
            for k, v in rat["executor_over_native"].items()]
    print(format_table(["executor / native torch (same strategy)", "wall ratio",
                        "cpu-time ratio"], rows))
    print()
    rows = []
    for k, v in rat["rotor_over_sequential_equal_memory"].items():
        rows.append([k, f"{v['budget_bytes'] / MB:.1f}", _f(v["measured_rotor_over_exec_seq"]),
                     _f(v["cpu_time_rotor_over_exec_seq"]), _f(v["predicted_rotor_over_seq"]),
                     _f(v["predicted_exact_dp_rotor_over_seq"]),
                     _f(v.get("measured_rotor_over_torch_ckseq")),
                     _f(v.get("alloc_peak_rotor_over_exec_seq")),
                     _f(v.get("alloc_peak_rotor_over_torch_ckseq"))])
    print(format_table(["equal memory", "budget MiB", "rotor/seq wall", "rotor/seq cpu",
                        "pred (500 slots)", "pred (exact DP)", "rotor/torch-ckseq",
                        "alloc rotor/seq", "alloc rotor/torch-ckseq"], rows))
    print()
    opt = cpu["optimizer"]
    print(f"optimizer step (fwd+bwd+step): OffloadedAdam / torch Adam = "
          f"{opt['ratio_offloaded_over_torch']:.2f} (max |param diff| after "
          f"{opt['steps_each']} steps = {opt['param_max_abs_diff_after_steps']:.1e})")


def _jsonable(v):
    """Plain JSON types (numpy scalars and arrays, tuples converted)."""
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def cpu_report(args) -> dict:
    """Run the CPU section, print its tables, return its part of the JSON."""
    cpu = cpu_section(args)
    # the count the section ran at (it sets --threads; kernels.adam.threads keeps
    # numba's thread pool from changing it), checked here rather than assumed
    threads = torch.get_num_threads()
    if threads != args.threads:
        raise RuntimeError(f"torch ran on {threads} threads, not --threads "
                           f"{args.threads}: something changed its thread count")
    rat = ratios(cpu)
    print_tables(cpu, rat)
    contenders = {name: {k: v for k, v in d.items()
                         if k not in ("step", "executor", "schedule")}
                  for name, d in cpu["contenders"].items()}
    chain = cpu["chain"]
    return {
        "cpu_section_torch_threads": threads,
        "cpu": {
            "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                      "seq": args.seq, "vocab": args.vocab, "batch": args.batch,
                      "params": cpu["n_params"], "stages": chain.n},
            "chain": {"compute_time_s": float(chain.compute_time), "x0_bytes": int(chain.x0),
                      "weight_bytes": int(chain.w.sum()),
                      "xbar_bytes": [int(v) for v in chain.xbar],
                      "x_bytes": [int(v) for v in chain.x], "profile_s": cpu["profile_s"]},
            "segment_counts": cpu["ks"], "repeats": args.repeats,
            "contenders": contenders, "ratios": rat, "optimizer": cpu["optimizer"],
            "predicted_rotor_over_seq_best_curve": cpu["curve"],
        },
    }


def _is_out_path(value: str) -> bool:
    """Whether ``--out VALUE`` is a file path (it ends in ``.json`` or names a
    folder) rather than the older form, a bare result name (``train_gpu``)."""
    return value.lower().endswith(".json") or os.sep in value or "/" in value \
        or os.path.isdir(value)


def _out_value(value: str) -> str:
    """An argparse ``type=`` for ``--out``: a file path (it ends in ``.json`` or
    names a folder: the file written, as the other scripts' ``--out`` takes it,
    checked as they check it), or the older form, a bare result name
    (``train_gpu``: NAME.json under bench/results or $RTMEM_BENCH_RESULTS).
    ``--out x.json`` was refused and ``--out results/x`` wrote
    bench/results/results/x.json, where every other script's --out wrote the
    path given."""
    if _is_out_path(value):
        return output_file(replace=True)(value)
    if not value.strip():
        raise argparse.ArgumentTypeError(
            f"{value!r}: give a file path such as out/train.json, or a result name such "
            f"as train_gpu (written as NAME.json under bench/results)")
    return value


def _out_target(out: str) -> tuple:
    """``(name, path)`` for :func:`write_results` and :class:`PartialResults`
    from ``--out`` (:func:`_out_value`): a path keeps the benchmark's name,
    ``train``; a result name is the name, with the default folder."""
    return ("train", out) if _is_out_path(out) else (out, None)


def main(argv=None):
    """Run the benchmark; returns the exit code: 3 when ``RTMEM_REQUIRE_GPU=1`` and
    the GPU section measured nothing, 130 when interrupted, 1 when the GPU section
    failed after something was measured (in both, what was finished is kept,
    marked partial: :class:`_common.PartialResults`)."""
    ap = CommandParser(description=__doc__.split("\n\n")[0])
    # type=at_least(...): a count of 0 (--layers 0 timed a model of no blocks and
    # wrote it; --repeats 0 was a median of nothing after minutes of profiling)
    ap.add_argument("--layers", type=count(), default=8)
    ap.add_argument("--hidden", type=count(), default=256)
    ap.add_argument("--heads", type=count(), default=8)
    ap.add_argument("--seq", type=count(), default=256)
    ap.add_argument("--vocab", type=count(2), default=1024)
    ap.add_argument("--batch", type=count(), default=4)
    ap.add_argument("--repeats", type=count(high=MAX_REPEATS), default=7)
    ap.add_argument("--opt-repeats", type=count(high=MAX_REPEATS), default=7)
    ap.add_argument("--profile-repeats", type=count(high=MAX_REPEATS), default=3)
    ap.add_argument("--profiles", type=count(high=MAX_REPEATS), default=3,
                    help="profile this many times, keep each stage's least median time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=count(high=MAX_THREADS), default=1,
                    help="torch intra-op threads of the CPU section (see the docstring)")
    ap.add_argument("--skip-gpu", action="store_true")
    ap.add_argument("--skip-cpu", action="store_true",
                    help="GPU section only (write it with --out train_gpu)")
    ap.add_argument("--gpu-hidden", type=count(), default=1024)
    ap.add_argument("--gpu-heads", type=count(), default=16)
    ap.add_argument("--gpu-seq", type=count(), default=1024)
    ap.add_argument("--gpu-vocab", type=count(2), default=50257)
    ap.add_argument("--gpu-batch", type=count(), default=16)
    ap.add_argument("--gpu-start-layers", type=count(), default=8)
    # 128 was reached on an H200 (rtmem trained every depth tried, plain torch
    # stopped at 59): 256 blocks of hidden 1024 are 3.2e9 parameters, whose fp32
    # master weights, moments and staging (about 20 B each) still fit 128 GiB of host
    ap.add_argument("--gpu-max-layers", type=count(), default=256,
                    help="deepest model the GPU depth search tries (blocks)")
    ap.add_argument("--gpu-slots", type=count(), default=200)
    ap.add_argument("--gpu-reserve", type=at_least(0.0, float, 1.0), default=0.06,
                    help="fraction (0..1) of device memory kept out of rtmem's budget for "
                         "allocator fragmentation and library workspaces")
    ap.add_argument("--gpu-repeats", type=count(high=MAX_REPEATS), default=3)
    ap.add_argument("--gpu-time-s", type=at_least(0.0, float), default=360.0,
                    help="seconds after which the GPU depth search stops")
    ap.add_argument("--gpu-deadline-s", type=at_least(0.0, float), default=None,
                    help="seconds after which the GPU section starts no new timed run "
                         "(default: --gpu-time-s + 240)")
    ap.add_argument("--gpu-matmul-precision", default="high",
                    choices=["highest", "high", "medium"])
    ap.add_argument("--out", type=_out_value, default="train",
                    help="JSON output path (ending in .json or with a folder), or a bare "
                         "result name: NAME.json under bench/results or "
                         "$RTMEM_BENCH_RESULTS (default train)")
    args = ap.parse_args(argv)
    if args.gpu_deadline_s is None:
        args.gpu_deadline_s = args.gpu_time_s + 240.0

    t0 = time.perf_counter()
    doc = {"command": command_line("train.py", argv),
           "torch": torch.__version__}
    # a time limit must not take what was measured with it: the GPU section's
    # parts are written as they finish (marked partial)
    name, path = _out_target(args.out)
    partial, during = PartialResults(name, path), "the CPU section"
    try:
        if args.skip_cpu:
            doc["cpu"] = not_measured("skipped (--skip-cpu)")
        else:
            doc.update(cpu_report(args))
            if not args.skip_gpu and torch.cuda.is_available():
                # The GPU section runs for minutes: a stop or a failure in it
                # must not take the finished CPU section with it. (Without a
                # GPU nothing is saved here: under RTMEM_REQUIRE_GPU=1 an
                # earlier GPU result stays, below.)
                partial.save(_jsonable({**doc, "gpu": not_measured(
                    "the GPU section did not finish")}))
        if args.skip_gpu:
            gpu = not_measured("skipped (--skip-gpu)")
        else:
            torch.set_num_threads(os.cpu_count() or 1)   # the GPU section feeds the device
            during = "the GPU section"
            gpu = gpu_section(args, lambda gpu: partial.save(_jsonable({**doc, "gpu": gpu})))
    except KeyboardInterrupt:
        return partial.interrupted(during)
    except Exception as e:
        if partial.doc is None:
            raise                                  # nothing measured to keep
        # A GPU session cannot run the step again: keep what was measured,
        # with the error, and the traceback in the log
        traceback.print_exc()
        path = partial.save(partial.doc, error=f"{during}: {type(e).__name__}: {e}")
        print(f"{name}: {during} failed ({type(e).__name__}: {e}); what was "
              f"measured before is in {path} (marked partial)", file=sys.stderr)
        return 1
    if not gpu["measured"]:
        print(gpu["reason"])
        if not args.skip_gpu and gpu_required():
            # a GPU session's train step: exit 3, and keep the results of an
            # earlier GPU run rather than replace them with "not measured"
            print("RTMEM_REQUIRE_GPU=1: the GPU section measured nothing; nothing written",
                  file=sys.stderr)
            return 3
    doc["gpu"] = gpu
    doc["load_average_at_end"] = list(os.getloadavg())
    doc["total_seconds"] = time.perf_counter() - t0
    path = write_results(name, _jsonable(doc), path)
    print(f"wrote {path} ({doc['total_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
