"""Benchmark of ROTOR's persistent DP (rtmem.planners.rotor): solve time against
chain length L and slot count S, side by side with the plain-Python
implementation of the same recurrence in the same process.

    .venv/bin/python bench/remat.py [--repeats 3] [--python-budget 3e7] [--out PATH]

Chains are GPT-2 profiles with L - 2 blocks (L stages) from
``rtmem.planners.profiles.gpt2``, plus the built-in ``resnet1001`` (335 stages,
the thesis' longest chain). The budget is ``--fraction`` (default 0.4) of the way
from the least feasible memory to the no-recomputation peak. Reported per case:
median fill time of the jitted table over ``--repeats`` runs (compile excluded),
full ``plan_remat`` time (table + reconstruction + simulation), the Python time
(one run, only where the estimated M * N^3 / 6 steps are under
``--python-budget``; nothing is extrapolated), their ratio, and the table memory.
Writes a table to stdout and JSON to ``bench/results/remat.json`` (or ``--out``),
also after each case, marked ``"partial": true``, so that a run stopped by Ctrl-C
(SIGINT) keeps the cases it finished; it then exits with code 130.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (MAX_REPEATS, CommandParser, PartialResults, at_least,  # noqa: E402
                     command_line, count, write_results)

import numpy as np  # noqa: E402

from rtmem.cli import output_file
from rtmem.planners import Platform, simulate, store_all_schedule
from rtmem.planners.profiles import builtin, gpt2
from rtmem.planners.remat import min_feasible_memory, plan_remat
from rtmem.planners.rotor import (discretize, persistent_table,
                                  reference_persistent_table, stage_arrays)

LENGTHS = (20, 50, 100, 200, 400)
SLOTS = (100, 500)


def budget_for(chain, fraction):
    lo = min_feasible_memory(chain)
    hi = simulate(chain, store_all_schedule(chain.n), Platform(math.inf)).peak
    return int(lo + fraction * (hi - lo))


def discretized(chain, budget, slots):
    fixed = int(chain.x0) + int(chain.w.sum())
    m_bytes = budget - fixed
    slot = max(1, m_bytes // slots)
    return discretize(stage_arrays(chain), slot), m_bytes // slot


def run_case(chain, slots, fraction, repeats, python_budget):
    budget = budget_for(chain, fraction)
    arrays, M = discretized(chain, budget, slots)
    N = arrays.N
    fills = []
    for _ in range(repeats):
        t = time.perf_counter()
        table = persistent_table(arrays, M)[0]
        fills.append(time.perf_counter() - t)
        del table
    t = time.perf_counter()
    plan = plan_remat(chain, budget, slots)
    plan_s = time.perf_counter() - t
    est_steps = M * N ** 3 / 6
    py_s = None
    if est_steps <= python_budget:
        t = time.perf_counter()
        ref = reference_persistent_table(arrays, M)
        py_s = time.perf_counter() - t
        jit = persistent_table(arrays, M)[0]
        assert np.array_equal(np.isfinite(ref), np.isfinite(jit)), "reference disagrees"
        both = np.isfinite(ref)
        assert np.allclose(ref[both], jit[both], rtol=1e-12), "reference disagrees"
    fill = statistics.median(fills)
    return {
        "chain": chain.name, "L": chain.n, "S": slots, "M": int(M), "budget_bytes": budget,
        "fill_s_median": fill, "fill_s_all": fills, "plan_remat_s": plan_s,
        "python_s": py_s, "speedup_vs_python": (py_s / fill) if py_s else None,
        "table_bytes": N * (N + 1) // 2 * (M + 1) * 8,
        "overhead_vs_no_remat": plan.makespan / chain.compute_time - 1,
        "method": plan.info["method"],
    }


def growth(rows, key, fixed_key):
    """Log-log slope of fill time against ``key`` at each value of ``fixed_key``."""
    out = {}
    for v in sorted({r[fixed_key] for r in rows}):
        pts = sorted((r[key], r["fill_s_median"]) for r in rows
                     if r[fixed_key] == v and r["fill_s_median"] > 0)
        if len(pts) >= 2:
            x = np.log([p[0] for p in pts])
            y = np.log([p[1] for p in pts])
            out[str(v)] = float(np.polyfit(x, y, 1)[0])
    return out


def main(argv=None):
    ap = CommandParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=count(high=MAX_REPEATS), default=3)
    # of the way from the least feasible memory to store-all's (outside: infeasible)
    ap.add_argument("--fraction", type=at_least(0.0, float, 1.0), default=0.4)
    ap.add_argument("--python-budget", type=at_least(0.0, float), default=3e7,
                    help="run the Python DP only below this many estimated steps")
    # checked now: a folder was met by open() after every case had been solved
    ap.add_argument("--out", type=output_file(replace=True), default=None,
                    help="results file (default: remat.json under $RTMEM_BENCH_RESULTS "
                         "or bench/results)")
    args = ap.parse_args(argv)
    # the full run takes minutes: a stop keeps the cases solved before it
    partial = PartialResults("remat", path=args.out)

    t = time.perf_counter()
    try:            # compiling the DP (without numba's cache) takes seconds
        warm = gpt2(layers=2)
        persistent_table(*discretized(warm, budget_for(warm, 0.5), 10))
        assert plan_remat(warm, budget_for(warm, 0.5), 500).info["method"] == "dp"
    except KeyboardInterrupt:
        return partial.interrupted("the warm-up (compiling the DP)")
    compile_s = time.perf_counter() - t

    rows = []
    cases = [(gpt2(layers=L - 2, name=f"gpt2-L{L}"), S) for L in LENGTHS for S in SLOTS]
    cases += [(builtin("resnet1001"), S) for S in SLOTS]
    header = (f"{'chain':>12} {'L':>4} {'S':>4} {'M':>4} {'fill (s)':>9} {'plan (s)':>9} "
              f"{'python (s)':>10} {'speedup':>8} {'table':>10} {'overhead':>8}")
    print(header)
    print("-" * len(header))
    # one document: saved (partial) after each case, completed after the last
    result = {"benchmark": "rotor persistent DP (C_MP) fill time",
              "command": command_line("remat.py", argv),
              "budget_fraction": args.fraction, "repeats": args.repeats,
              "compile_and_first_call_s": compile_s, "rows": rows}
    for chain, S in cases:
        try:
            r = run_case(chain, S, args.fraction, args.repeats, args.python_budget)
        except KeyboardInterrupt:
            return partial.interrupted(f"{chain.name} with {S} slots")
        rows.append(r)
        partial.save(result)
        py = f"{r['python_s']:.3f}" if r["python_s"] else "not run"
        sp = f"{r['speedup_vs_python']:.0f}x" if r["speedup_vs_python"] else "-"
        print(f"{r['chain']:>12} {r['L']:>4} {r['S']:>4} {r['M']:>4} {r['fill_s_median']:>9.4f} "
              f"{r['plan_remat_s']:>9.4f} {py:>10} {sp:>8} "
              f"{r['table_bytes'] / 2**20:>8.1f}Mi {r['overhead_vs_no_remat']:>8.1%}",
              flush=True)
    gpt_rows = [r for r in rows if r["chain"].startswith("gpt2")]
    result.update({
        "machine": {"numba_threads": "1 (no parallel code)",
                    "load_average_at_end": os.getloadavg()},
        "growth_exponent_in_L_at_S": growth(gpt_rows, "L", "S"),
        "growth_exponent_in_S_at_L": growth(gpt_rows, "S", "L"),
        "table_bytes_L400_S500_formula": 401 * 402 // 2 * 501 * 8,
    })
    print(f"\ncompile + first call: {compile_s:.2f} s")
    print(f"growth exponent of fill time in L (per S): {result['growth_exponent_in_L_at_S']}")
    print(f"growth exponent of fill time in S (per L): {result['growth_exponent_in_S_at_L']}")
    print(f"wrote {write_results('remat', result, path=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
