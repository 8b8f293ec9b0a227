"""``rtmem simulate``: simulate a schedule or a saved plan on a chain, and the
schedule loading it shares (:func:`load_schedule`, re-exported by
:mod:`rtmem.cli`).

Imports only the standard library at module level, as :mod:`rtmem.cli` does:
``rtmem --help`` must not load numba or the planners; everything else is
imported where it is used.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings

from rtmem.errors import RtmemError
from rtmem.units import format_bandwidth, format_bytes, format_seconds

__all__ = ["load_schedule", "load_schedule_and_plan"]


def load_schedule(spec: str, chain):
    """A schedule from a file (text or JSON), ``store-all``, ``sequential:K`` (K
    segments) or literal schedule text."""
    return load_schedule_and_plan(spec, chain)[0]


def load_schedule_and_plan(spec: str, chain):
    """:func:`load_schedule`, and the :class:`~rtmem.planners.Plan` when ``spec``
    is a plan document (else None): its recorded peak tells a plan made for
    another chain of the same length."""
    from rtmem.errors import ScheduleError
    from rtmem.planners import Schedule, sequential_schedule, store_all_schedule
    from rtmem.planners._documents import naming_file, read_text
    from rtmem.planners.schedule import _DIGITS, OP_WORDS
    # a folder named "store-all" or "sequential:2" must not hide the keyword
    keyword = spec == "store-all" or spec.startswith("sequential:")
    if os.path.exists(spec) and not (keyword and os.path.isdir(spec)):
        text = read_text(spec, kind="schedule", error=ScheduleError, reason="parse")
        with naming_file(spec, ScheduleError):
            return _schedule_in_file(text)
    if not spec.strip():
        raise ScheduleError("the schedule is empty; give a path, 'store-all', "
                            "'sequential:K' or schedule text such as 'F_all 0, L, B 0'")
    if spec == "store-all":
        return store_all_schedule(chain.n), None
    if spec.startswith("sequential:"):
        k = spec.partition(":")[2]
        # ASCII digits only: str.isdigit also accepts "²" (int() then raises a raw
        # ValueError) and "٣" (read as 3)
        if not _DIGITS.fullmatch(k):
            raise ScheduleError(f"sequential:K needs an integer K written in digits 0-9, "
                                f"got {spec!r}")
        return sequential_schedule(chain.n, int(k)), None
    if "," in spec or "\n" in spec or spec.split()[0].lower() in OP_WORDS:
        return Schedule.from_text(spec), None
    raise ScheduleError(f"no schedule file {spec!r}; give a path, 'store-all', "
                        "'sequential:K' or schedule text such as 'F_all 0, L, B 0'")


def _schedule_in_file(text: str):
    """The schedule in a file's ``text`` and the plan when it is a plan document
    (else None): a plan document, a schedule document or schedule text."""
    from rtmem.errors import ScheduleError
    from rtmem.planners import Plan, Schedule
    if not text.strip():
        # read as a schedule of no operations: "the schedule ends before the
        # backward pass is complete"
        raise ScheduleError("the file is empty; give a file written by `rtmem plan remat "
                            "--save` or Schedule.save", reason="parse")
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            doc = None                           # Schedule.parse reports it
        if isinstance(doc, dict) and doc.get("format") == "rtmem.plan":
            plan = Plan.from_dict(doc)           # a plan saved by `rtmem plan`
            return plan.schedule, plan
        if isinstance(doc, dict) and doc.get("format") != "rtmem.schedule":
            # "expected 'rtmem.schedule'" sent a user holding `plan remat --json`'s
            # report (no schedule in it) looking for a schedule converter
            raise ScheduleError(
                f"the file is neither a schedule nor a plan document (its format is "
                f"{doc.get('format')!r}); give a file written by `rtmem plan remat "
                f"--save` or Schedule.save (the --json report holds no schedule)",
                reason="parse")
    return Schedule.parse(text), None


def _for_another_chain(error, schedule, chain, plan=None):
    """``error`` (a ScheduleError of simulating ``schedule``, from ``plan`` when
    it is a plan document, on ``chain``) with a hint added when the schedule
    was made for another chain: its forward and backward steps cover another
    number of stages than the chain has (a plan for a shorter chain fails at its
    loss, which "needs a26 ... compute it again or prefetch it first", with
    nothing pointing at the chain), or ``plan`` records the digest of another
    chain of as many stages (an edited or re-profiled one: "exceeds the limit"
    said nothing of it, the note came only after a simulation that succeeds).
    Otherwise ``error`` itself."""
    from rtmem.errors import ScheduleError
    from rtmem.planners import Op
    steps = [stage for op, stage, _ in schedule
             if op in (Op.F_NONE, Op.F_CK, Op.F_ALL, Op.B)]
    stages = max(steps) + 1 if steps else 0
    if stages not in (0, chain.n):
        hint = (f"was the plan made for another chain? its forward and backward steps "
                f"cover {stages} stages, this chain has {chain.n}")
    elif plan is not None and _check_chain_quietly(plan, chain)[0] is False:
        hint = (f"the plan was made for another chain of {chain.n} stages (its "
                f"chain_sha256 is not this chain's): plan again for this chain")
    else:
        return error
    return ScheduleError(f"{error} ({hint})", op_index=error.op_index, reason=error.reason,
                         over_bytes=error.over_bytes)


def _check_chain_quietly(plan, chain):
    """``(answer, message)``: :meth:`Plan.check_chain
    <rtmem.planners.Plan.check_chain>`'s answer and the message of its warning
    (None when it warned nothing), caught: the command reports them itself."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        matches = plan.check_chain(chain)
    return matches, (caught[-1].message if caught else None)


def _peak_of_chain_only(schedule) -> bool:
    """Whether ``schedule``'s simulated peak depends on the chain alone: no
    transfer in it. An offload frees its bytes when the copy ends, so with
    transfers the peak also depends on the link's bandwidth and on whether the
    memory limit made an operation wait for those frees (NOTE [ Simulator
    semantics ]): a plan simulated on its own chain with another platform
    peaks elsewhere."""
    import numpy as np

    from rtmem.planners.schedule import COMPUTE_OPS, Op
    at_once = COMPUTE_OPS | {Op.DELETE, Op.W_DELETE}
    return bool(np.isin(schedule.op, [int(o) for o in at_once]).all())


def _plan_chain_told(plan, chain, schedule, result) -> bool | None:
    """Print a note on stderr when ``plan`` (None: a plain schedule) was made for
    another chain than ``chain``; return :meth:`Plan.check_chain
    <rtmem.planners.Plan.check_chain>`'s answer (None also without a plan). A
    note, not an error: simulating a plan on a re-profiled or edited chain is a
    fair question, and the numbers printed are this chain's."""
    if plan is None:
        return None
    matches, warning = _check_chain_quietly(plan, chain)
    if matches is False:
        print(f"note: {warning}; the numbers below are this chain's",
              file=sys.stderr)
    elif matches is None and plan.peak != result.peak and _peak_of_chain_only(schedule):
        # A plan saved before plans recorded their chain: its peak, a function of
        # the chain's sizes, tells another chain of the same length. Exact bytes:
        # format_bytes may round two different peaks to the same text.
        print(f"note: the plan records a peak of {plan.peak:,} B; on {chain.name} it "
              f"peaks at {result.peak:,} B: was it made for another chain (or another "
              f"batch size)?", file=sys.stderr)
    return matches


def _cmd_simulate(args) -> int:
    from rtmem.errors import ScheduleError
    from rtmem.planners import simulate
    from rtmem import cli       # (looked up at each call: tests replace load_chain)
    cli.require_plotting(args)
    chain = cli.load_chain(args.chain)
    schedule, plan = load_schedule_and_plan(args.schedule, chain)
    platform = cli._platform(args)
    try:
        r = simulate(chain, schedule, platform)
    except ScheduleError as e:
        hinted = _for_another_chain(e, schedule, chain, plan)
        if hinted is e:
            raise
        raise hinted from e
    if not math.isfinite(r.makespan):
        # Chain bounds the times of planners' schedules; a hand-written one can
        # still repeat operations until the float64 sum overflows
        raise RtmemError(f"the makespan of this schedule overflows a float64 ({len(schedule)} "
                         "operations); express the chain's times in larger units")
    matches = _plan_chain_told(plan, chain, schedule, r)
    doc = {"chain": chain.name, "ops": len(schedule), "makespan_s": r.makespan,
           "peak_bytes": r.peak, "compute_s": r.compute_time, "idle_s": r.idle_time,
           "h2d_bytes": r.h2d_bytes, "d2h_bytes": r.d2h_bytes,
           # null for unlimited, as `plan --json` writes: JSON has no Infinity, and
           # memory_limit's 2**62 stands for unlimited only inside rtmem
           "memory_bytes": None if math.isinf(platform.memory) else platform.memory_limit,
           "bandwidth_Bps": None if math.isinf(platform.bandwidth) else platform.bandwidth,
           "channel": platform.channel,
           # whether the plan was made for this chain: null for a schedule that is
           # not a plan, or a plan saved before plans recorded their chain
           "chain_matches_plan": matches}
    if args.json:
        print(json.dumps(doc, indent=1, allow_nan=False))
    else:
        print(cli.stdout_table(["quantity", "value"], [
            ["chain", f"{chain.name} ({chain.n} stages)"], ["operations", len(schedule)],
            ["makespan", format_seconds(r.makespan)], ["peak memory", format_bytes(r.peak)],
            ["memory limit", format_bytes(platform.memory)],
            ["compute time", format_seconds(r.compute_time)],
            ["idle time", format_seconds(r.idle_time)],
            ["host->device", format_bytes(r.h2d_bytes)],
            ["device->host", format_bytes(r.d2h_bytes)],
            ["link", f"{format_bandwidth(platform.bandwidth)} {platform.channel}"]],
            # measured as printed: the chain's name may hold what stdout escapes
            align="lr"))
    if args.plot:
        from rtmem.plot import plot_schedule
        plot_schedule(chain, schedule, platform, args.plot, result=r)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    """Add ``rtmem simulate`` to the subcommands ``sub`` (called by
    :func:`rtmem.cli.build_parser`, where its place in ``--help`` is)."""
    from rtmem.cli import PLOT_SUFFIXES, _add_platform_args, output_file
    p = sub.add_parser("simulate", help="simulate a schedule: makespan, peak, plots")
    p.add_argument("chain", help="built-in name, generator spec or chain JSON file")
    p.add_argument("schedule", help="schedule file, 'store-all', 'sequential:K' or text")
    _add_platform_args(p)
    p.add_argument("--plot", type=output_file(*PLOT_SUFFIXES),
                   help="write a Gantt chart + memory plot to this file (.png, .pdf, .svg)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_simulate)
