"""Python overhead of :class:`~rtmem.torch.ScheduleExecutor` against chain depth,
next to plain torch in the same process.

    .venv/bin/python bench/executor.py [--depths 25,100,400] [--repeats 7] [--threads 1]
        [--out PATH]

The model is ``depth`` thin stages (``Linear(64, 64)`` + ReLU, batch 8, CPU), so
a stage's compute is tens of microseconds and the executor's per-operation work
shows. Contenders, each a whole training step (forward, loss, backward; gradients
zeroed outside the timed region), round-robin over ``--repeats`` rounds after a
warm-up step each, median kept:

- ``torch plain``: ``loss_fn(model(x), y).backward()``, the baseline;
- ``exec store-all`` / ``exec seq`` / ``exec offload`` / ``exec offload-late``:
  ``store_all_schedule``, ``sequential_schedule(n, round(sqrt(n)))``, full
  activation offload (``_common.offload_everything``: every abar but the last
  offloaded, deleted and prefetched; host copies are CPU tensors here) and the
  same for the second half of the chain only (each delete then happens while
  n/2 abar are resident, the case where finding the storages a delete must
  keep by walking the stored tensors cost O(n) per delete), replayed by the
  executor, with
  ``track_memory=True`` (the default: resident bytes recorded after every
  operation, kept by the executor's ledger) and ``False``;
- ``exec ... recount``: the same with the byte count taken by walking every
  stored tensor after each operation (the executor's ``_recount``, which is how
  it counted before the ledger), to show what the ledger saves. Its ratio over
  the ledger's grows with depth (O(n^2) per step against O(n)).

The round-robin runs a full garbage collection before each timed step
(``_common.round_robin``), so a step pays only for the young-generation
collections its own allocations trigger. The executor's Python objects per
stage (stored tensors, packed saved tensors, ledger entries) live until the
backward, get promoted and so make full collections come sooner, while plain
torch allocates almost nothing the collector tracks. That cost is measured
apart: ``gc`` gives each contender's collector seconds per step (``gc_s``,
full collections amortized over ``max(10, 20000 // depth)`` untimed steps in
a row, as a training loop runs them) and collections per step by generation;
``with_gc_over_torch`` adds ``gc_s`` to both sides of the ratio.

Ratios are over ``torch plain`` at the same depth; ``times_s`` keeps every
round's seconds of each contender beside its median (``median_s``), so two runs
can be compared with their spread. Writes a table to stdout and
JSON to ``bench/results/executor.json`` or ``--out`` (times in seconds; quote
the ratios), also after each depth, marked ``"partial": true``, so that a run stopped by
Ctrl-C (SIGINT) keeps the depths it finished; it then exits with code 130.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (MAX_REPEATS, MAX_THREADS, CommandParser,  # noqa: E402
                     PartialResults, add_out_option, command_line, count, gc_cost,
                     offload_everything, round_robin, write_results)

# (a stop while torch loads, seconds, is one line: _common's excepthook)
import torch  # noqa: E402
from torch import nn  # noqa: E402

from rtmem._table import format_table  # noqa: E402
from rtmem.planners import sequential_schedule, store_all_schedule  # noqa: E402
from rtmem.torch import ScheduleExecutor  # noqa: E402

WIDTH, BATCH = 64, 8


def _recounting(ex: ScheduleExecutor) -> ScheduleExecutor:
    """``ex`` also walking every stored tensor after every operation (the full
    recount it did before the ledger; the ledger's figure, equal, is recorded)."""
    account = ex._account

    def recounting():
        ex._recount()
        account()
    ex._account = recounting
    return ex


def measure(depth: int, repeats: int) -> dict:
    """Median step seconds of every contender at ``depth`` stages (``median_s``),
    every round's (``times_s``), and the ratios and GC costs built on them."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())
                            for _ in range(depth)])
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    loss_fn = nn.functional.mse_loss
    schedules = {"store-all": store_all_schedule(depth),
                 "seq": sequential_schedule(depth, max(1, round(math.sqrt(depth)))),
                 "offload": offload_everything(depth, grads=False),
                 "offload-late": offload_everything(depth, grads=False, first=depth // 2)}
    steps = {"torch plain": lambda: loss_fn(model(x), y).backward()}
    for name, sched in schedules.items():
        for label, track, recount in (("", True, False), (" untracked", False, False),
                                      (" recount", True, True)):
            ex = ScheduleExecutor(model, sched, loss_fn, track_memory=track)
            if recount:
                _recounting(ex)
            steps[f"exec {name}{label}"] = (lambda e: lambda: e.step(x, y))(ex)
    zero = lambda: model.zero_grad(set_to_none=True)  # noqa: E731
    times = round_robin(steps, repeats, before=zero)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = med["torch plain"]
    calls = max(10, 20000 // depth)
    gc_by = {name: gc_cost(fn, calls, before=zero) for name, fn in steps.items()
             if name == "torch plain" or not name.endswith(("untracked", "recount"))}
    base_gc = base + gc_by["torch plain"]["gc_s_per_call"]
    return {"depth": depth, "median_s": med, "times_s": times,
            "over_torch": {name: t / base for name, t in med.items()},
            "gc": {name: {"gc_s": g["gc_s_per_call"],
                          "collections_per_step": g["collections_per_call"]}
                   for name, g in gc_by.items()},
            "gc_steps": calls,
            "with_gc_over_torch": {name: (med[name] + g["gc_s_per_call"]) / base_gc
                                   for name, g in gc_by.items()},
            "recount_over_ledger": {name: med[f"exec {name} recount"] / med[f"exec {name}"]
                                    for name in schedules}}


def main(argv=None) -> int:
    ap = CommandParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="25,100,400",
                    help="stage counts, comma-separated (default 25,100,400)")
    ap.add_argument("--repeats", type=count(high=MAX_REPEATS), default=7,
                    help="timed rounds (default 7)")
    ap.add_argument("--threads", type=count(high=MAX_THREADS), default=1,
                    help="torch intra-op threads")
    add_out_option(ap, "executor")
    args = ap.parse_args(argv)
    try:
        depths = [int(d) for d in args.depths.split(",")]
    except ValueError:
        ap.error(f"--depths takes comma-separated stage counts, got {args.depths!r}")
    if any(d < 1 for d in depths):
        ap.error(f"--depths: stage counts must be at least 1, got {args.depths!r}")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows, results = [], []
    doc = {"command": command_line("executor.py", argv),
           "torch": torch.__version__, "threads": args.threads, "width": WIDTH,
           "batch": BATCH, "repeats": args.repeats, "results": results}
    # the default depths take minutes: a stop keeps the depths measured before it
    partial = PartialResults("executor", args.out)
    for depth in depths:
        try:
            r = measure(depth, args.repeats)
        except KeyboardInterrupt:
            return partial.interrupted(f"depth {depth}")
        results.append(r)
        partial.save(doc)
        for name, ratio in r["over_torch"].items():
            g = r["gc"].get(name)
            rows.append([str(depth), name, f"{r['median_s'][name] * 1e3:.2f}", f"{ratio:.2f}",
                         "-" if g is None else f"{g['gc_s'] * 1e3:.2f}",
                         "-" if g is None else f"{r['with_gc_over_torch'][name]:.2f}"])
        print(f"  depth {depth}: recount / ledger "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["recount_over_ledger"].items()),
              flush=True)
    print(format_table(["stages", "contender", "median ms", "t/torch", "gc ms/step",
                        "with gc /torch"], rows, align="llrrrr"))
    doc["total_seconds"] = time.perf_counter() - t0
    print(f"wrote {write_results('executor', doc, path=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
