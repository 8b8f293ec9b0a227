"""Simulator throughput: the jitted simulator vs the pure-Python reference.

Both run the same ~100k-operation schedule (full activation offload with
prefetches, gradient flushes) in the same process; the figure of merit is the
ratio of their operations per second: medians over ``--repeats`` runs of the
jitted simulator and over half as many (at least one) of the much slower
reference; the JSON gives each median's run count as ``"repeats"`` and every
run's seconds (``"times_s"``, with ``"min_s"`` and ``"max_s"``). Target: the
jitted simulator at >= 1 million ops/s. The results are written at the end: a
run stopped by Ctrl-C (SIGINT) writes nothing, says so in one line and exits
with code 130.

    python bench/simulate.py [--ops 100000] [--repeats 5] [--out PATH]

Writes ``bench/results/simulate.json`` (or ``--out``).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (MAX_REPEATS, CommandParser, PartialResults,  # noqa: E402
                     add_out_option, command_line, count, offload_everything, repeat_times,
                     time_spread, write_results)

from rtmem._table import format_table  # noqa: E402
from rtmem.planners import Chain, Platform, simulate  # noqa: E402
from rtmem.planners.testing import reference_simulate  # noqa: E402


def main(argv=None) -> int:
    ap = CommandParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=count(), default=100_000)
    ap.add_argument("--repeats", type=count(high=MAX_REPEATS), default=5)
    add_out_option(ap, "simulate")
    args = ap.parse_args(argv)
    n = max(2, args.ops // 6)
    chain = Chain.homogeneous(n, u_f=1e-3, u_b=2e-3, x=2**20, xbar=3 * 2**20, w=2**16,
                              name=f"homogeneous-{n}")
    sched = offload_everything(n)
    platform = Platform("1TiB", "12 GB/s", "duplex")
    # one section, written at the end: a stop before it keeps an earlier result whole
    try:
        jit_r = simulate(chain, sched, platform)           # compiles (or loads the cache)
        ref_r = reference_simulate(chain, sched, platform)
        assert jit_r.peak == ref_r["peak"], "the two simulators disagree"
        jit = time_spread(repeat_times(lambda: simulate(chain, sched, platform),
                                       args.repeats))
        # the reference is ~100x slower: half the runs (no warm-up: nothing to compile)
        ref_repeats = max(1, args.repeats // 2)
        ref = time_spread(repeat_times(lambda: reference_simulate(chain, sched, platform),
                                       ref_repeats, warmup=0))
        t_jit, t_ref = jit["median_s"], ref["median_s"]
    except KeyboardInterrupt:
        return PartialResults("simulate", args.out).interrupted("the measurements")
    ops = len(sched)
    rows = [["jitted (rtmem.planners.simulate)", f"{ops / t_jit:,.0f}", f"{t_jit * 1e3:.1f}"],
            ["pure Python (testing.reference_simulate)", f"{ops / t_ref:,.0f}",
             f"{t_ref * 1e3:.1f}"]]
    print(f"schedule: {ops:,} ops on {n:,} stages, makespan {jit_r.makespan:.3f} s, "
          f"peak {jit_r.peak:,} B\n")
    print(format_table(["simulator", "ops/s", "median ms"], rows))
    print(f"\nspeed-up jitted / pure Python: {t_ref / t_jit:.1f}x")
    path = write_results("simulate", path=args.out, doc={
        "command": command_line("simulate.py", argv),
        "ops": ops, "stages": n, "repeats": args.repeats,
        "jitted": {**jit, "ops_per_s": ops / t_jit, "repeats": args.repeats},
        "pure_python": {**ref, "ops_per_s": ops / t_ref, "repeats": ref_repeats},
        "ratio_jitted_over_python": t_ref / t_jit,
        "target_ops_per_s": 1e6, "target_met": ops / t_jit >= 1e6})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
