"""Schedules of the classical strategies, built directly (no planning).

These are the baselines every planner is compared with (thesis-remat.md §4):
``store_all`` is plain autograd (everything kept), ``sequential`` is PyTorch's
``checkpoint_sequential`` (Chen et al.'s periodic segments).
"""

from __future__ import annotations

import math

import numpy as np

from rtmem.errors import ChainError, InfeasibleError
from rtmem.units import format_bytes

from ._validation import check_chain, check_int
from .chain import Chain
from .plan import Plan, as_budget, planned_info
from .platform import Platform
from .schedule import Op, Schedule
from .simulator import recomputed_flagged, simulate

__all__ = ["store_all_schedule", "sequential_schedule", "segment_bounds",
           "plan_store_all", "plan_sequential", "plan_sqrt", "simulated_plan"]


def _check_n(n) -> int:
    return check_int("the number of stages", n, low=1, error=ChainError, field="n")


def store_all_schedule(n: int) -> Schedule:
    """``F_all 0 .. F_all n-1, L, B n-1 .. B 0``: no recomputation, maximal memory."""
    n = _check_n(n)
    ops = [(Op.F_ALL, i) for i in range(n)] + [(Op.LOSS, 0)]
    ops += [(Op.B, i) for i in reversed(range(n))]
    return Schedule.from_ops(ops)


def _check_segments(n, segments) -> tuple[int, int]:
    """``(n, segments)`` as Python ints: ``n`` checked (see ``_check_n``), then
    ``segments`` checked to fit it."""
    n = _check_n(n)
    return n, check_int("segments", segments, low=1, high=n, error=ChainError,
                        field="segments", hint=f"a chain of {n} stages has 1 to {n} segments")


def segment_bounds(n: int, segments: int) -> list[tuple[int, int]]:
    """Stage ranges ``[start, end)`` that ``torch.utils.checkpoint.checkpoint_sequential``
    uses: ``segments - 1`` segments of ``n // segments`` stages, the rest in the last."""
    n, segments = _check_segments(n, segments)
    size = n // segments
    bounds = [(k * size, (k + 1) * size) for k in range(segments - 1)]
    bounds.append(((segments - 1) * size, n))
    return bounds


def sequential_schedule(n: int, segments: int) -> Schedule:
    """The ``checkpoint_sequential`` schedule with ``segments`` segments.

    Forward: each segment but the last keeps its input (``F_ck``) and runs the rest
    without saving (``F_none``); the last segment runs ``F_all``. Backward: the last
    segment's ``B``s, then for each earlier segment (in reverse) ``F_all`` over it
    from its kept input, then its ``B``s. Example (2.1) of the thesis.
    """
    # Built with numpy, not op by op: plan_sequential builds one schedule per
    # segment count (n of them), which took ~20 s in Python for 2,000 stages.
    n, segments = _check_segments(n, segments)   # not segment_bounds: its list costs O(n)
    size = n // segments                    # every segment but the last
    head = (segments - 1) * size            # stages of the earlier segments
    fwd_op = np.full(head, int(Op.F_NONE), np.int64)
    fwd_op[::size] = int(Op.F_CK)           # each earlier segment keeps its input
    last = np.arange(head, n)
    earlier = np.arange(segments - 2, -1, -1)[:, None] * size   # in reverse order
    recompute = np.concatenate((earlier + np.arange(size), earlier + np.arange(size)[::-1]),
                               axis=1).ravel()
    recompute_op = np.tile(np.repeat([int(Op.F_ALL), int(Op.B)], size), segments - 1)
    op = np.concatenate((fwd_op, np.full(len(last), int(Op.F_ALL)), [int(Op.LOSS)],
                         np.full(len(last), int(Op.B)), recompute_op))
    stage = np.concatenate((np.arange(head), last, [0], last[::-1], recompute))
    return Schedule(op, stage)


# ----------------------------------------------------------------------------
# Baselines as planners: each returns a Plan checked by the simulator.

def simulated_plan(chain: Chain, schedule: Schedule, budget, algorithm: str,
                   info: dict | None = None) -> Plan:
    """Simulate ``schedule`` without a memory limit and package it as a :class:`Plan`
    for ``budget`` (bytes); raise :class:`~rtmem.errors.InfeasibleError` (with
    ``min_feasible`` = the schedule's peak) if its peak exceeds the budget."""
    budget = as_budget(budget)
    res = simulate(chain, schedule, Platform(math.inf))
    if res.peak > budget:
        raise InfeasibleError(
            f"{algorithm}: the schedule needs {res.peak:,} bytes ({format_bytes(res.peak)}) "
            f"but the budget is {budget:,} bytes ({format_bytes(budget)}); give at least "
            f"{res.peak:,} bytes or use a planner that recomputes more (plan_remat)",
            budget=budget, min_feasible=res.peak)
    return Plan(schedule=schedule, makespan=res.makespan, peak=res.peak, budget=budget,
                algorithm=algorithm, info=planned_info(chain, info or {}))


def plan_store_all(chain: Chain, memory) -> Plan:
    """No rematerialization (plain autograd): every stage ``F_all``, then every ``B``.

    ``memory``: budget in bytes (int, ``"12GiB"`` or a Platform). Raises
    :class:`~rtmem.errors.InfeasibleError` when the peak (bytes) exceeds it."""
    check_chain(chain, "plan_store_all")
    return simulated_plan(chain, store_all_schedule(chain.n), memory, "store-all")


def fastest_fitting(chain: Chain, budget, candidates, algorithm: str, param: str,
                    what: str, *, first_is_fastest: bool = False) -> Plan:
    """The fastest of ``candidates`` (``(value, schedule)`` pairs, simulated without
    a memory limit) whose peak fits ``budget`` (bytes); ties go to the earlier one.
    The Plan's ``info[param]`` is its value. Raises
    :class:`~rtmem.errors.InfeasibleError` with the least peak over all candidates
    (``what`` names them in the message) when none fits. ``first_is_fastest``:
    no candidate is faster than the first (it recomputes nothing), so when the
    first fits it is the answer and the rest are not built."""
    budget = as_budget(budget)
    best, least = None, None
    for index, (value, sched) in enumerate(candidates):
        if recomputed_flagged(chain, sched) is not None:
            continue        # runs a no_recompute stage twice: not a candidate
        res = simulate(chain, sched, Platform(math.inf))
        least = res.peak if least is None else min(least, res.peak)
        if res.peak <= budget and (best is None or res.makespan < best[0].makespan):
            best = (res, value, sched)
            if first_is_fastest and index == 0:
                break
    if best is None:
        if least is None:
            raise InfeasibleError(
                f"{algorithm}: every {what} recomputes a stage the chain marks no_recompute "
                f"(stages {np.flatnonzero(chain.no_recompute).tolist()}: they modify their "
                f"input in place); use plan_remat, which runs them once",
                budget=budget, min_feasible=None)
        raise _none_fits(algorithm, what, budget, least)
    res, value, sched = best
    return Plan(schedule=sched, makespan=res.makespan, peak=res.peak, budget=budget,
                algorithm=algorithm, info=planned_info(chain, {param: value}))


def _none_fits(algorithm: str, what: str, budget: int, least: int) -> InfeasibleError:
    """The error of :func:`fastest_fitting` when no candidate (``what``) fits in
    ``budget`` bytes; ``least`` is their least peak (bytes)."""
    return InfeasibleError(
        f"{algorithm}: no {what} fits in {budget:,} bytes ({format_bytes(budget)}); "
        f"the least memory it needs is {least:,} bytes. Give more memory or use "
        "plan_remat", budget=budget, min_feasible=least)


def plan_sequential(chain: Chain, memory, segments: int | None = None) -> Plan:
    """PyTorch's ``checkpoint_sequential`` (Chen et al.'s periodic segments).

    With ``segments=None`` every segment count 1..n is simulated and the fastest
    schedule within ``memory`` (bytes) is returned (ties: fewer segments);
    ``info["segments"]`` says which. Raises
    :class:`~rtmem.errors.InfeasibleError` with the least peak over all counts
    when none fits."""
    check_chain(chain, "plan_sequential")
    if segments is not None:
        # a plain int: a numpy integer would reach info and fail the plan's JSON
        segments = _check_segments(chain.n, segments)[1]
    if segments is None:
        return _best_segment_count(chain, memory)
    return _segmented(chain, memory, [segments], "sequential")


# Relative margin by which a segment count's predicted makespan must exceed the
# best simulated one to be skipped: the prediction sums the same step times in
# another order, so it differs from the simulator's by rounding (< n x 2**-52
# relative), far below this.
_PREDICTION_MARGIN = 1e-9


def _best_segment_count(chain: Chain, memory) -> Plan:
    """:func:`plan_sequential` over every segment count 1..n: the same plan as
    simulating each of them (:func:`_segmented`), without simulating those that
    cannot win.

    With ``k`` segments the schedule runs every step once and recomputes the
    forwards of the first (k - 1) * (n // k) stages, so its makespan (without a
    memory limit nothing waits) is known before simulating: the counts are
    simulated in increasing order of it, and once one fits, the counts predicted
    slower than it by more than rounding are not simulated at all. Simulating
    all n schedules of O(n) operations each is O(n^2): 11 s for 1,000 stages
    (wall time, loaded 2-core machine). Half way between the least budget and
    the store-all peak a few counts are simulated; near the least budget, where
    only counts that recompute much fit, most of them still are, and when
    nothing fits all of them (the error gives the least peak over all)."""
    budget = as_budget(memory)
    n = chain.n
    prefix = np.concatenate(([0.0], np.cumsum(chain.u_f, dtype=np.float64)))
    base = float(chain.compute_time)
    counts = np.arange(1, n + 1)
    head = (counts - 1) * (n // counts)          # stages recomputed with k segments
    predicted = base + prefix[head]
    best, least = None, None
    for k, bound in zip(counts[np.argsort(predicted, kind="stable")].tolist(),
                        np.sort(predicted, kind="stable").tolist()):
        if best is not None and bound > best[0].makespan * (1 + _PREDICTION_MARGIN):
            break                                # so are all the counts after it
        sched = sequential_schedule(n, k)
        if recomputed_flagged(chain, sched) is not None:
            continue     # runs a no_recompute stage twice (k = 1, store-all, never does)
        res = simulate(chain, sched, Platform(math.inf))
        least = res.peak if least is None else min(least, res.peak)
        # ties go to fewer segments, as when the counts are tried in order
        if res.peak <= budget and (best is None or (res.makespan, k) < (best[0].makespan,
                                                                          best[1])):
            best = (res, k, sched)
    if best is None:           # every count was simulated: least is over all of them
        raise _none_fits("sequential", _segments_what(range(1, n + 1)), budget, least)
    res, k, sched = best
    return Plan(schedule=sched, makespan=res.makespan, peak=res.peak, budget=budget,
                algorithm="sequential", info=planned_info(chain, {"segments": k}))


def _segmented(chain: Chain, memory, counts, algorithm: str) -> Plan:
    """The fastest of ``checkpoint_sequential``'s schedules with a segment count
    in ``counts`` that fits, as a plan of ``algorithm`` (its name in errors too)."""
    return fastest_fitting(chain, memory,
                           ((k, sequential_schedule(chain.n, k)) for k in counts),
                           algorithm, "segments", _segments_what(counts),
                           first_is_fastest=True)   # 1 segment: store-all


def _segments_what(counts) -> str:
    """How errors name the segment ``counts`` tried."""
    return (f"segment count in {counts[0]}..{counts[-1]}" if len(counts) > 1
            else f"schedule of {counts[0]} segments")


def plan_sqrt(chain: Chain, memory) -> Plan:
    """Chen et al.'s sqrt(n) strategy: ``checkpoint_sequential`` with
    round(sqrt(n)) segments (at least 1). ``memory`` in bytes."""
    check_chain(chain, "plan_sqrt")
    k = max(1, min(chain.n, int(round(math.sqrt(chain.n)))))
    return _segmented(chain, memory, [k], "sqrt")     # its errors say "sqrt:"
