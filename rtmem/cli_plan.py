"""``rtmem plan remat``: plan rematerialization for a chain and compare baselines.

Registered by ``rtmem.cli`` through :func:`register`. Example::

    rtmem plan remat resnet1001 --memory 8GiB --slots 500 --plot out.png

prints, for ROTOR's DP and every baseline (store-all, checkpoint_sequential with
the best segment count, sqrt(n) segments, Revolve), the simulated makespan, the
peak memory and the overhead against training without rematerialization.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import warnings

from rtmem.cli import PLOT_SUFFIXES, at_least, output_file, platform_value, save_document

__all__ = ["COMPARISON_HEADERS", "ProgressBar", "comparison_rows", "register"]


class ProgressBar:
    """Status lines and a progress bar on stderr for long solves.

    Called with a message, it prints ``[  1.23 s] message``; ``update(fraction)``
    (0..1: of the DP table, of the stages profiled) redraws ``label
    [####......]  40%`` in place when stderr is a terminal (in logs it stays
    quiet rather than print 50 lines).
    """

    def __init__(self, quiet: bool = False, stream=None, width: int = 30,
                 label: str = "DP table"):
        self.quiet = quiet
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.start = time.perf_counter()
        self._drawn = False

    def _elapsed(self) -> str:
        return f"[{time.perf_counter() - self.start:7.2f} s]"

    def __call__(self, msg: str) -> None:
        if self.quiet:
            return
        self._end_bar()
        print(f"{self._elapsed()} {msg}", file=self.stream, flush=True)

    def update(self, fraction: float) -> None:
        if self.quiet or not getattr(self.stream, "isatty", lambda: False)():
            return
        filled = int(round(self.width * min(max(fraction, 0.0), 1.0)))
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self._elapsed()} {self.label} [{bar}] {fraction:4.0%}")
        self.stream.flush()
        self._drawn = True

    def warn(self, msg: str) -> None:
        """Print ``msg`` as a warning line, also with ``quiet`` (which silences
        progress, not what the user must know)."""
        self._end_bar()
        print(f"{self._elapsed()} warning: {msg}", file=self.stream, flush=True)

    def _end_bar(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self._drawn = False


#: Column headers of :func:`comparison_rows`' table.
COMPARISON_HEADERS = ["planner", "makespan", "peak", "overhead", "notes"]


def comparison_rows(results: dict, reference: float) -> tuple[list, list]:
    """Table rows and JSON records for ``compare_remat``'s ``{name: Plan or
    InfeasibleError}``; overheads are against ``reference`` (seconds, the
    no-rematerialization makespan). An InfeasibleError's row says the least
    budget it needs, or, when that is unknown (``min_feasible`` None: a planner
    compare_remat did not attempt), its message; its JSON record has
    ``infeasible``, ``min_feasible_bytes`` (None then) and ``message``."""
    from rtmem.planners.plan import Plan
    from rtmem.units import format_bytes, format_seconds
    rows, docs = [], []
    for name, res in results.items():
        if isinstance(res, Plan):
            note = ", ".join(f"{k}={v}" for k, v in res.info.items()
                             if k in ("segments", "slots", "method"))
            # a store-all plan sums the stage times in another order than the
            # reference: -1e-16 printed as "-0.0%", faster than no rematerialization
            overhead = f"{res.overhead(reference):+.1%}".replace("-0.0%", "+0.0%")
            rows.append([name, format_seconds(res.makespan), format_bytes(res.peak),
                         overhead, note])
            docs.append({"planner": name, "makespan_s": res.makespan, "peak_bytes": res.peak,
                         "overhead": res.overhead(reference), "info": res.info})
        else:
            need = res.min_feasible
            # no least budget: more memory is not the remedy, the message says what is
            # ("not attempted: 4,500 stages, plan_revolve plans at most 4,410")
            rows.append([name, "-", "-", "-", f"infeasible: needs {format_bytes(need)}"
                         if need is not None else str(res)])
            docs.append({"planner": name, "infeasible": True, "min_feasible_bytes": need,
                         "message": str(res)})
    return rows, docs


@contextlib.contextmanager
def _slow_solve_told(say: ProgressBar):
    """Within the block, a :class:`~rtmem.planners.SlowSolveWarning` is told on
    ``say``'s stream at once, in the command line's words (``--slots``), where
    Python's own display named a line of this module and advised
    ``progress=`` (the bar is already drawn). Other warnings show as before."""
    from rtmem.planners.remat import SLOW_SOLVE_SECONDS, SlowSolveWarning
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if not isinstance(message, SlowSolveWarning):
                return shown(message, category, filename, lineno, file, line)
            slots = "" if message.slots is None else f" with {message.slots} memory slots"
            fewer = ("" if message.slots_within is None else
                     f"--slots {message.slots_within} is predicted within "
                     f"{SLOW_SOLVE_SECONDS:.0f} s; ")
            say.warn(f"{message.stages:,} stages{slots}: rotor's DP is predicted to take "
                     f"~{message.seconds / 60:.1f} min of CPU. {fewer}fewer, coarser "
                     f"stages help most (time is cubic in them)")
        warnings.showwarning = show
        yield


def _cmd_remat(args) -> int:
    from rtmem.planners.plan import as_budget
    from rtmem.planners.platform import Platform
    from rtmem.planners.remat import compare_remat
    from rtmem.units import format_bytes, format_seconds

    from rtmem.cli import load_chain, require_plotting, stdout_table
    require_plotting(args)      # before the planning, not after it
    chain = load_chain(args.chain)
    budget = as_budget(args.memory)
    say = ProgressBar(args.quiet)
    say(f"{chain.name or args.chain}: {chain.n} stages, budget {format_bytes(budget)}")
    # an infeasible budget is raised (main() prints it, exit 1) before the baselines
    # are planned: none of them fits then, and the table is never printed. The
    # whole comparison was planned first (seconds, Revolve's O(n^3) table), for nothing
    with _slow_solve_told(say):
        results = compare_remat(chain, budget, slots=args.slots, progress=say,
                                raise_infeasible=True)
    rotor = results["rotor"]
    reference = chain.compute_time       # makespan without rematerialization
    rows, docs = comparison_rows(results, reference)
    if args.save:
        save_document(rotor, args.save)
        say(f"wrote the rotor plan to {args.save}")
    if args.plot:
        from rtmem.plot import plot_schedule
        plot_schedule(chain, rotor.schedule, Platform(budget), args.plot,
                      title=f"rotor on {chain.name or args.chain}, {format_bytes(budget)}")
        say(f"wrote {args.plot}")
    if args.json:
        print(json.dumps({"chain": chain.name, "stages": chain.n,
                          "budget_bytes": None if math.isinf(budget) else budget,
                          "no_remat_makespan_s": reference, "plans": docs}, indent=1,
                         allow_nan=False))     # JSON has no Infinity (Chain bounds times)
    else:
        print(f"{chain.name or args.chain}: {chain.n} stages, budget {format_bytes(budget)}, "
              f"no-remat makespan {format_seconds(reference)}")
        print(stdout_table(COMPARISON_HEADERS, rows, align="lrrrl"))
    return 0


def register(subparsers) -> None:
    """Add ``plan`` (with ``remat``) to the ``rtmem`` command's subparsers."""
    plan = subparsers.add_parser("plan", help="plan schedules (rematerialization, ...)")
    sub = plan.add_subparsers(dest="planner", metavar="PLANNER")
    p = sub.add_parser("remat", help="rematerialization: ROTOR's DP vs the baselines",
                       description="Plan rematerialization (ROTOR's persistent DP) within a "
                       "memory budget and compare it with store-all, checkpoint_sequential, "
                       "sqrt(n) and Revolve.")
    p.add_argument("chain", metavar="CHAIN",
                   help="built-in name (rtmem chains), generator spec such as "
                   "'gpt2:layers=24' or a chain JSON file")
    p.add_argument("--memory", required=True, type=platform_value("memory"),
                   help="device memory budget including weights, e.g. 8GiB")
    # at_least: --slots 0 is bad usage (exit 2), as `rtmem demo --slots 0` (it was
    # exit 1, refused by plan_remat after the chain had been loaded)
    p.add_argument("--slots", type=at_least(1), default=500,
                   help="memory slots of the DP (default 500; more: closer to optimal, slower)")
    p.add_argument("--plot", type=output_file(*PLOT_SUFFIXES),
                   help="write a Gantt chart + memory plot of the rotor plan here (.png, "
                        ".pdf, .svg)")
    p.add_argument("--save", type=output_file(replace=True),
                   help="write the rotor plan as JSON here (rtmem simulate reads it)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_cmd_remat)

    def _no_planner(args) -> int:
        plan.print_help()
        return 2
    plan.set_defaults(func=_no_planner)
