"""``plan_remat``: the rematerialization planner users call (ROTOR's C_MP).

The DP itself is in :mod:`rtmem.planners.rotor` (NOTE [ Persistent DP C_MP ]);
this module turns a byte budget into slots, runs it, and checks the result in the
simulator. ``compare_remat`` runs it next to every baseline for tables.

Rounding to slots is conservative, so near the least budget the DP can miss
schedules, or find none. plan_remat then retries with finer slots (bounded by
the table size), and returns the fastest of the DP's schedule, the least-memory
schedule (exact in bytes) and the cheap baselines (checkpoint_sequential,
Revolve) that fit: never slower than a baseline at the same budget.

Budget accounting. The simulator counts the chain input a_0 and all weights from
the start, and each weight gradient from its backward on (NOTE [ Simulator
semantics ] Rule 1). The first two are subtracted from the budget before the DP
(exactly); the weight gradients enter the DP's requirements through G (exactly,
see the rotor NOTE). So a schedule the DP finds in slots fits the budget in bytes.
"""

from __future__ import annotations

import math
import time
import warnings

import numpy as np

from rtmem.errors import InfeasibleError, RtmemError
from rtmem.units import format_bytes

from .baselines import plan_sequential, plan_sqrt, plan_store_all, store_all_schedule
from ._validation import check_chain, check_count
from .chain import Chain
from .plan import Plan, as_budget, planned_info
from .platform import Platform
from .rotor import (choices_memory, discretize, min_memory, min_memory_schedule,
                    persistent_schedule, persistent_table, stage_arrays)
from .simulator import simulate

__all__ = ["plan_remat", "min_feasible_memory", "compare_remat", "DEFAULT_SLOTS",
           "MAX_TABLE_BYTES", "REFINE_MAX_FACTOR", "REVOLVE_MAX_STAGES", "SLOW_SOLVE_SECONDS",
           "SlowSolveWarning"]

#: Memory slots of the discretized DP (thesis §3.7: 500 in all experiments).
DEFAULT_SLOTS = 500
#: Largest C_MP table plan_remat allocates, bytes.
MAX_TABLE_BYTES = 2 * 2**30
#: Longest chain on which plan_remat also tries Revolve's schedules: plan_revolve
#: fills an O(n^2 log n) argmin table, then simulates one schedule per slot count,
#: the smallest with ~n^2/2 operations. With every slot count simulated (nothing
#: fits), CPU time on one core of a loaded 2-core machine, median of 3: 0.051 s for
#: resnet1001's 335 stages, 0.060 s for 400, 0.075 s for 500, 0.11 s for 550, 0.12 s
#: for 600, 0.20 s for 800, 0.42 s for 1,200. The limit keeps the cost the old
#: O(n^3) table had at the old limit of 400 stages (0.088 s in the same run;
#: 0.14 s for 500): 500 is the longest measured below it.
REVOLVE_MAX_STAGES = 500
#: plan_remat's retries with finer slots stop at this many times the slots asked
#: (and at MAX_TABLE_BYTES): 32,000 slots by default, enough for exact bytes on
#: small test chains while a 3-stage chain with a 100 MB term cannot ask for a
#: gigabyte table of one-byte slots.
REFINE_MAX_FACTOR = 64
#: plan_remat, compare_remat and min_feasible_memory warn (SlowSolveWarning, a
#: RuntimeWarning) before a solve whose predicted CPU time (see _predicted_seconds)
#: is above this many seconds.
SLOW_SOLVE_SECONDS = 60.0
# Measured seconds per step, CPU time on one core of a loaded 2-core machine,
# medians of 3 (random chains, budget half way between the least and the store-all
# peak): the table fill (N^3 / 6 x (M + 1) steps, N = n + 1): 0.91 ns for 200
# stages x 100 slots, 0.73 for 200 x 500, 1.05 for 400 x 100, 0.67 for 400 x 500
# (3.6 s); and the timed least-memory pass (N^3 / 6 steps, with choices): 2.7 ns
# for 300 stages, 3.1 for 600, 3.8 for 1,000 (0.64 s), 4.5 for 2,000 (6.0 s),
# growing with n as its triangles leave the caches. The largest of each, so the
# prediction stays an upper bound where it decides a warning (long chains).
_TABLE_STEP_SECONDS = 1.05e-9
_LEAST_STEP_SECONDS = 4.5e-9
# each DP retry divides the slot by this: the table grows 4x per retry, so the
# retries together cost at most 4/3 of the last one
_REFINE = 4


def _fixed_bytes(chain: Chain) -> int:
    """Bytes resident from the start: the chain input and every weight."""
    return int(chain.x0) + int(chain.w.sum())


def min_feasible_memory(chain: Chain) -> int:
    """Least budget (bytes) for which :func:`plan_remat` returns a plan: the
    chain input, the weights, and the least memory of a persistent schedule
    (computed exactly in bytes, no discretization).

    O(n^3): 1.1 s for 1,000 stages, ~2.5 min for 5,000 (see
    :func:`~rtmem.planners.rotor.min_memory`); warns (:class:`SlowSolveWarning`, a
    ``RuntimeWarning``) when the predicted time is above :data:`SLOW_SOLVE_SECONDS`."""
    check_chain(chain, "min_feasible_memory")
    _warn_if_slow(chain.n, None, "min_feasible_memory", stacklevel=2)
    return _least_budget(stage_arrays(chain), _fixed_bytes(chain))


def _least_budget(arrays, fixed: int) -> int:
    """:func:`min_feasible_memory` from a chain's stage arrays and fixed bytes;
    at least 1: a :class:`Platform` has a positive memory, so a chain of zero
    sizes (whose schedules need 0 bytes) is planned with 1, not 0."""
    return max(1, fixed + min_memory(arrays)[0])


def _predicted_seconds(n: int, slots: int | None) -> float:
    """Predicted CPU seconds of :func:`plan_remat` on ``n`` stages with a table of
    ``slots`` memory slots (M): its least-memory pass in bytes and the table fill,
    at the measured seconds per step above; with ``slots=None``, the least-memory
    pass alone (:func:`min_feasible_memory`). One pass, as plan_remat runs it: a
    pass in slots runs only where _feasible_in_slots's bounds cannot decide (near
    the least budget or with few slots, where the table is small or pruned).
    An upper bound for the fill, whose pruning skips more of it near the least
    and the store-all budgets."""
    steps = _dp_steps(n)
    if slots is None:
        return steps * _LEAST_STEP_SECONDS
    return steps * (_LEAST_STEP_SECONDS + (slots + 1) * _TABLE_STEP_SECONDS)


def _dp_steps(n: int) -> float:
    """Inner-loop steps of one least-memory pass on ``n`` stages, and of the
    table fill per slot: N^3 / 6 with N = n + 1."""
    return float(n + 1) ** 3 / 6


def _slots_within(n: int) -> int:
    """The most slots whose :func:`_predicted_seconds` is within
    :data:`SLOW_SOLVE_SECONDS` (< 1 when the least-memory pass alone is not)."""
    steps = _dp_steps(n)
    fill = SLOW_SOLVE_SECONDS - steps * _LEAST_STEP_SECONDS
    return int(fill / (steps * _TABLE_STEP_SECONDS)) - 1


class SlowSolveWarning(RuntimeWarning):
    """Warned before a :func:`plan_remat`, :func:`compare_remat` or
    :func:`min_feasible_memory` solve predicted to take more than
    :data:`SLOW_SOLVE_SECONDS` of CPU (a ``RuntimeWarning``: filter it by this
    class). ``stages``: the chain's; ``slots``: the DP's memory slots (None for
    :func:`min_feasible_memory`); ``seconds``: the predicted CPU seconds;
    ``slots_within``: the most slots predicted within the limit, or None when
    fewer slots would not get there (then only fewer, coarser stages help)."""

    def __init__(self, message: str, stages: int, slots: int | None, seconds: float,
                 slots_within: int | None):
        super().__init__(message)
        self.stages, self.slots, self.seconds = stages, slots, seconds
        self.slots_within = slots_within


def _warn_if_slow(n: int, slots: int | None, caller: str, stacklevel: int) -> None:
    """Warn (``RuntimeWarning``, at the caller ``stacklevel`` frames up) before a
    solve whose :func:`_predicted_seconds` is above :data:`SLOW_SOLVE_SECONDS`,
    saying how to make it faster. ``slots=None``: :func:`min_feasible_memory`."""
    seconds = _predicted_seconds(n, slots)
    if seconds <= SLOW_SOLVE_SECONDS:
        return
    head = f"{caller}: {n:,} stages, "
    cost = f": predicted ~{seconds / 60:.1f} min of CPU. "
    within = None
    if slots is None:
        message = (head + "its least-memory pass is O(n^3)" + cost + "For a faster "
                   "answer describe the model with fewer, coarser stages (time is cubic "
                   "in them)")
    else:
        fits = _slots_within(n)
        within = fits if 0 < fits < slots else None
        fewer = (f"pass fewer slots (time is linear in them: slots={fits} is predicted "
                 f"within {SLOW_SOLVE_SECONDS:.0f} s), " if within is not None else "")
        message = (head + f"with {slots} memory slots its DP is O(n^3 x slots)" + cost
                   + f"For a faster plan {fewer}describe the model with fewer, coarser "
                   "stages (time is cubic in them), or plan with plan_sequential; pass "
                   "progress= (e.g. rtmem.cli_plan.ProgressBar()) to follow it")
    warnings.warn(SlowSolveWarning(message, n, slots, seconds, within),
                  stacklevel=stacklevel + 1)


def _slot_for(m_bytes: int, slots: int, n: int) -> int:
    """Slot size (bytes) for an activation budget of ``m_bytes`` split into
    ``slots``: floor(m_bytes / slots) gives up to 2 slots - 1 slots, so it is
    coarsened just enough for the table to fit (slots itself passed
    _check_table); otherwise the DP was refused with "use at most K slots" for
    slots <= K."""
    return max(1, m_bytes // slots, -(-(m_bytes + 1) // (_max_slots(n) + 1)))


def _check_table(n: int, slots: int, fixed_slot_bytes: bool = False) -> int:
    """Bytes of the DP table for ``n`` stages and ``slots`` memory slots; raise
    when over :data:`MAX_TABLE_BYTES`, saying what would fit."""
    cells = (n + 1) * (n + 2) // 2
    table_bytes = cells * (slots + 1) * 8
    if table_bytes <= MAX_TABLE_BYTES:
        return table_bytes
    fits = _max_slots(n)
    if fits < 1:
        advice = ("no slot count fits: describe the model with fewer, coarser stages "
                  "(group layers), or plan with the sequential or revolve baselines")
    elif fixed_slot_bytes:
        advice = f"use a slot_bytes giving at most {fits} slots"
    else:
        advice = f"use at most {fits} slots"
    raise RtmemError(
        f"the DP table would take {table_bytes:,} bytes ({format_bytes(table_bytes)}) "
        f"for {n} stages and {slots} slots, more than {format_bytes(MAX_TABLE_BYTES)}; "
        f"{advice}")


def _max_slots(n: int) -> int:
    """Most memory slots M whose DP table for ``n`` stages stays within
    :data:`MAX_TABLE_BYTES` (0 when even one slot is too many)."""
    cells = (n + 1) * (n + 2) // 2
    return max(0, MAX_TABLE_BYTES // (8 * cells) - 1)


def _finer_slots(n: int, m_bytes: int, slot: int, slots: int):
    """Slot sizes (bytes) finer than ``slot`` to retry the DP with, coarsest first:
    each a quarter of the previous one, ending at the finest whose table has at
    most :data:`REFINE_MAX_FACTOR` x ``slots`` slots and fits
    :data:`MAX_TABLE_BYTES` (one byte, i.e. exact, for small budgets)."""
    most = min(_max_slots(n), REFINE_MAX_FACTOR * slots)
    finest = m_bytes // (most + 1) + 1               # m_bytes // finest <= most
    while slot > finest:
        slot = max(finest, slot // _REFINE)
        yield slot


def _least_memory(chain, arrays, progress, say, units: str = "", choices: bool = True):
    """:func:`min_memory` of ``arrays`` (in bytes, or in slots: ``units`` says which
    on the status line), with ``progress`` as :func:`plan_remat` takes it: the
    O(n^3) pass takes minutes on thousands of stages (~2.5 min for 5,000), so it
    is announced and reports its fraction done. ``choices``: as for min_memory."""
    say(f"rotor: least memory of {chain.n} stages{units}")
    return min_memory(arrays, progress=getattr(progress, "update", None), choices=choices)


def _feasible_in_slots(chain, least, disc, M, slot, progress, say) -> bool:
    """Whether a persistent schedule fits M slots (sizes ``disc``): the least
    memory in slots is at most M. ``least``: ``(least memory in bytes, its
    choices)`` from :func:`min_memory` on the byte arrays.

    Rounding every term up to whole slots gives each choice tree at least its
    bytes / slot, so the least memory in slots is at least ceil(least bytes /
    slot); and at most what the byte-level least-memory choices need in slots
    (:func:`choices_memory`, O(n) nodes). M outside these bounds is decided
    without a second O(n^3) least-memory pass (it ran on every plan_remat);
    only in between, near the least budget, does the pass run."""
    mm_bytes, choice = least
    if -(-mm_bytes // slot) > M:
        return False
    if choices_memory(disc, choice) <= M:
        return True
    units = f" in slots of {format_bytes(slot)}"
    # only the value is used here, so the pass keeps no choices (4 N^2 bytes)
    return _least_memory(chain, disc, progress, say, units, choices=False)[0] <= M


def _dp(chain, arrays, least, m_bytes, slot, progress, say, fixed_slot_bytes=True):
    """Run C_MP with slots of ``slot`` bytes on an activation budget of ``m_bytes``;
    return ``(value, schedule or None, M)``: the DP's makespan (s, inf when
    infeasible at this rounding) and its schedule. ``least``: as for
    :func:`_feasible_in_slots`."""
    M = m_bytes // slot
    table_bytes = _check_table(chain.n, M, fixed_slot_bytes)
    disc = discretize(arrays, slot)
    if not _feasible_in_slots(chain, least, disc, M, slot, progress, say):
        # the least-memory pass follows the same recurrence in O(n^3), no table:
        # near the least budget it saves filling a table that has no schedule
        return math.inf, None, M
    say(f"rotor: {chain.n} stages, {M} slots of {format_bytes(slot)}, "
        f"table {format_bytes(table_bytes)}")
    table, _, idx, mall, mnone = persistent_table(disc, M,
                                                  progress=getattr(progress, "update", None))
    value = float(table[idx[0, chain.n], M])
    schedule = persistent_schedule(disc, table, idx, mall, mnone, M) \
        if np.isfinite(value) else None
    return value, schedule, M


def _refine(chain, arrays, least, m_bytes, slot, slots, progress, say):
    """The DP with the coarsest finer slot (see :func:`_finer_slots`) at which it
    is feasible, as :func:`_dp` returns it plus that slot (bytes), or None. _dp
    checks feasibility before filling a table, so at exactly the least budget of
    a long chain, where no rounding is fine enough, no table is filled."""
    for fine in _finer_slots(chain.n, m_bytes, slot, slots):
        value, schedule, M = _dp(chain, arrays, least, m_bytes, fine, progress, say)
        if schedule is not None:
            say(f"rotor: no schedule in slots of {format_bytes(slot)}; "
                f"found one in slots of {format_bytes(fine)}")
            return value, schedule, M, fine
    return None


def _baseline_plans(chain: Chain, budget: int, best: float, plans: dict) -> None:
    """Fill ``plans`` (``{name: Plan or InfeasibleError}``, entries already there are
    kept) with the cheap baselines at ``budget`` (bytes): the best
    ``checkpoint_sequential`` segment count and, on chains of at most
    :data:`REVOLVE_MAX_STAGES` stages whose Revolve could still beat ``best``
    (seconds) and the sequential plan, Revolve. Each simulates its schedules;
    :func:`compare_remat` reuses them for its table."""
    from .revolve import plan_revolve

    def run(name, planner):
        if name not in plans:
            try:
                plans[name] = planner(chain, budget)
            except InfeasibleError as e:
                plans[name] = e
        return plans[name]

    seq = run("sequential", plan_sequential)
    if isinstance(seq, Plan):
        best = min(best, seq.makespan)
    # Revolve runs every stage's forward at least twice (F then F_all before B):
    # when that bound is no faster than the best so far it cannot win, and its
    # O(n^2)-op schedules are not built
    revolve_bound = float(2 * chain.u_f.sum() + chain.u_b.sum() + chain.u_loss)
    # Revolve recomputes every stage: never a candidate for no_recompute stages
    if chain.n <= REVOLVE_MAX_STAGES and revolve_bound < best and chain.recomputable:
        run("revolve", plan_revolve)


def plan_remat(chain: Chain, memory, slots: int = DEFAULT_SLOTS, *,
               slot_bytes: int | None = None, progress=None) -> Plan:
    """Fastest persistent rematerialization schedule of ``chain`` within ``memory``.

    Parameters
    ----------
    chain:
        The network (:class:`~rtmem.planners.Chain`).
    memory:
        Device memory budget in bytes: an int, a string such as ``"12GiB"``, or a
        :class:`~rtmem.planners.Platform`. It covers everything the simulator
        counts: the chain input, weights, weight gradients, activations and
        temporaries.
    slots:
        Number S of memory slots the activation budget is split into (default
        500, thesis §3.7). The slot is ``floor(activation budget / S)`` bytes
        (at least 1: an S above the activation budget in bytes gives one-byte,
        exact slots) and every size is rounded up to whole slots, so the plan is
        valid in bytes; more slots: closer to optimal, slower (time and table
        memory grow linearly in S). When rounding leaves the DP no schedule
        (near the least budget), it is retried with slots a quarter the size,
        and so on, up to :data:`REFINE_MAX_FACTOR` x S slots and a table of
        :data:`MAX_TABLE_BYTES`.

        Because the slot grows with the budget, the makespan is *not*
        non-increasing in the budget: one byte more can give a coarser slot,
        every size rounds up further, and the DP loses the schedule it had.
        Example, with the default 500 slots: ``Chain(u_f=[5, 4, 1],
        u_b=[1, 5, 2], x=[1797, 1094, 2239], xbar=[3130, 1963, 2443],
        x0=1704)`` plans in 27 s with 9,703 bytes (slots of 15 bytes) but in
        32 s with 9,704 (slots of 16 bytes: 8,000 activation bytes / 500),
        and in 27 s again from 9,720 (501 slots of 16 bytes). The cheap
        candidates (least-memory schedule, baselines) do not close such gaps,
        and a grid that nests does not either (a coarser slot rounds each of
        the summed terms up, so it can exclude what a finer one found).
        Where monotonicity matters (a budget sweep), pass ``slot_bytes``.
    slot_bytes:
        Use this slot size (bytes) instead of deriving it from ``slots``, and
        never retry with finer ones; with a fixed slot the makespan is
        non-increasing in the budget (in the example above, slot_bytes=15 gives
        27 s at both budgets).
    progress:
        Optional callable receiving short status strings (for CLIs); if it also
        has an ``update(fraction)`` method, that receives the DP's progress
        (0..1) while the table fills, e.g. :class:`rtmem.cli_plan.ProgressBar`.

    Returns
    -------
    Plan
        ``algorithm="rotor"``; ``makespan`` (s) and ``peak`` (bytes) from the
        simulator. The plan is the fastest of these candidates that fit:
        the DP's schedule, the least-memory schedule (exact in bytes), the best
        ``checkpoint_sequential`` segment count and Revolve (on chains of at most
        :data:`REVOLVE_MAX_STAGES` stages); rounding to slots can make the DP
        miss schedules these find. ``info`` always holds ``method`` (the winner:
        ``"store-all"`` when the budget allows no recomputation, ``"dp"``,
        ``"min-memory"``, ``"sequential"`` or ``"revolve"``), ``candidates``
        (``{method: makespan in s}`` of every candidate that was run and fit;
        Revolve is not run when its lower bound, every forward twice, is no
        faster than the best so far, so it cannot win),
        ``dp_makespan`` (s, the DP's prediction; ``None`` when the DP found no
        schedule at any slot size tried; the no-recomputation makespan for
        ``"store-all"``), ``solve_seconds``, ``chain_sha256`` (the chain's
        digest, see :meth:`Plan.check_chain`) and, when the chain gives its input's
        size (``x0`` > 0), ``input_bytes`` (the batch the plan holds for, see
        :class:`Plan`). Only when the DP ran (``method``
        other than ``"store-all"``) does it also hold ``slot_bytes`` and
        ``slots`` (M, slots available to the DP) of the last DP run,
        ``refined`` (whether that run used finer slots than asked) and
        ``min_feasible`` (bytes): the store-all shortcut skips the O(n^3) pass
        that computes it (call :func:`min_feasible_memory`). ``segments`` or
        ``revolve_slots`` are there when a baseline won.

    Raises
    ------
    InfeasibleError
        When the budget is below :func:`min_feasible_memory`; ``min_feasible``
        carries that value in bytes.
    RtmemError
        When ``slots`` or ``slot_bytes`` is not an integer >= 1, or the DP table
        would exceed :data:`MAX_TABLE_BYTES` (the message gives the most slots
        that fit).

    Warns
    -----
    SlowSolveWarning
        (a ``RuntimeWarning``) Up front, when the solve is predicted to take more than
        :data:`SLOW_SOLVE_SECONDS` (60 s), with what would make it faster. The
        cost is inherent to the DP: O(n^3) for the least-memory passes and
        O(n^3 M) for the table (M slots, about ``slots``). Measured (CPU time, one
        core of a loaded 2-core machine) at a budget half way between the least
        and the store-all peak: 0.4 s for 200 stages and 4.4 s for 400 with 500
        slots, so ~1.5 min for 1,000 stages with 500 slots and ~9 min for 5,000
        stages (at most 20 slots fit :data:`MAX_TABLE_BYTES`).
    """
    return _plan_remat(chain, memory, slots, slot_bytes, progress, {})


def _plan_remat(chain, memory, slots, slot_bytes, progress, baselines,
                caller: str = "plan_remat", stacklevel: int = 3) -> Plan:
    """:func:`plan_remat`; ``baselines``: a dict (``{name: Plan or
    InfeasibleError}``, possibly empty) in which the baseline plans it needs are looked up and the
    ones it computes are left (:func:`compare_remat` shows them). ``caller`` and
    ``stacklevel``: the public function the slow-solve warning names and the
    frames up to its caller, at whose line the warning points."""
    say = progress if progress is not None else (lambda msg: None)
    check_chain(chain, "plan_remat")
    budget = as_budget(memory)
    slots = check_count("slots", slots)
    if slot_bytes is not None:
        slot_bytes = check_count("slot_bytes", slot_bytes)
    t0 = time.perf_counter()
    store_all = store_all_schedule(chain.n)
    res = simulate(chain, store_all, Platform(math.inf))
    if budget >= res.peak:
        # every budget from here on reaches the no-recomputation makespan
        # (no min_feasible here: its O(n^3) pass is what this shortcut avoids);
        # within the budget it never waits for memory, so this run is the plan's
        info = {"method": "store-all", "dp_makespan": float(chain.compute_time),
                "candidates": {"store-all": float(res.makespan)},
                "solve_seconds": time.perf_counter() - t0}
        return Plan(schedule=store_all, makespan=res.makespan, peak=res.peak,
                    budget=budget, algorithm="rotor", info=planned_info(chain, info))
    fixed = _fixed_bytes(chain)
    if slot_bytes is None:
        # the table has about `slots` columns: refuse an impossible size before the
        # O(n^2)-memory, O(n^3)-time least-memory pass below. With more slots than
        # activation bytes the slot is 1 byte and the columns are the bytes: checking
        # `slots` itself refused slots=10**8 on a 115-byte budget ("7.45 GiB table")
        _check_table(chain.n, min(slots, max(1, int(budget) - fixed)))
    # up front, before the O(n^3) least-memory pass: the slots the DP will have
    # (finer retries near the least budget can add to it)
    m_bytes = max(0, int(budget) - fixed)
    slot = slot_bytes if slot_bytes is not None else _slot_for(m_bytes, slots, chain.n)
    _warn_if_slow(chain.n, m_bytes // slot, caller, stacklevel=stacklevel)
    arrays = stage_arrays(chain)
    mm, choice = _least_memory(chain, arrays, progress, say)
    min_feasible = fixed + mm
    if budget < min_feasible:
        raise InfeasibleError(
            f"no persistent schedule of {chain.name or 'the chain'} fits in {budget:,} bytes "
            f"({format_bytes(budget)}): it needs at least {min_feasible:,} bytes "
            f"({format_bytes(min_feasible)}) = chain input and weights {fixed:,} + "
            f"activations {mm:,}. Give more memory or a smaller batch",
            budget=budget, min_feasible=min_feasible)
    value, schedule, M = _dp(chain, arrays, (mm, choice), m_bytes, slot, progress, say,
                             slot_bytes is not None)
    refined = False
    if schedule is None and slot_bytes is None:
        retry = _refine(chain, arrays, (mm, choice), m_bytes, slot, slots, progress, say)
        if retry is not None:
            value, schedule, M, slot = retry
            refined = True
    # Candidates, each simulated: with a fixed slot each is non-increasing in the
    # budget, so their minimum is too. Ties go to the earlier (the DP first).
    runs = [(name, s, simulate(chain, s, Platform(budget)), {})
            for name, s in (("dp", schedule), ("min-memory", min_memory_schedule(arrays, choice)))
            if s is not None]
    best = min(r.makespan for _, _, r, _ in runs)
    _baseline_plans(chain, budget, best, baselines)
    for name, param, key in (("sequential", "segments", "segments"),
                             ("revolve", "slots", "revolve_slots")):
        plan = baselines.get(name)
        if isinstance(plan, Plan):          # baselines only return plans that fit
            runs.append((name, plan.schedule, plan, {key: plan.info[param]}))
    name, schedule, res, extra = min(runs, key=lambda r: r[2].makespan)   # first of ties
    info = {"method": name, "min_feasible": min_feasible,
            "dp_makespan": value if np.isfinite(value) else None,
            "slot_bytes": slot, "slots": M, "refined": refined,
            "candidates": {n: float(r.makespan) for n, _, r, _ in runs}, **extra}
    info["solve_seconds"] = time.perf_counter() - t0
    say(f"rotor: solved in {info['solve_seconds']:.2f} s ({name})")
    return Plan(schedule=schedule, makespan=res.makespan, peak=res.peak, budget=budget,
                algorithm="rotor", info=planned_info(chain, info))


def compare_remat(chain: Chain, memory, slots: int = DEFAULT_SLOTS, progress=None, *,
                  raise_infeasible: bool = False) -> dict:
    """Run :func:`plan_remat` and every baseline at the same budget.

    ``memory``: the budget in bytes (an int, a string such as ``"12GiB"`` or a
    :class:`~rtmem.planners.Platform`), as in :func:`plan_remat`.

    Returns ``{name: Plan or InfeasibleError}`` for ``rotor``, ``store-all``,
    ``sequential`` (best segment count), ``sqrt`` and ``revolve`` (Revolve
    converted with ``F_all`` before each ``B``), in that order. The rotor plan is
    never slower than a baseline that fits (it takes the fastest, see
    :func:`plan_remat`), and the baselines it planned are shown, not planned again.

    A baseline that was not attempted has an :class:`~rtmem.errors.InfeasibleError`
    with ``min_feasible=None`` whose message starts with ``"not attempted:"`` and
    says why: ``revolve`` on a chain longer than
    :func:`~rtmem.planners.revolve.max_revolve_stages` (4,410 stages), whose argmin
    table and schedules :func:`~rtmem.planners.plan_revolve` refuses. The other entries are
    still planned. An error of the rotor plan itself (a DP table over
    :data:`MAX_TABLE_BYTES`) is raised, as by :func:`plan_remat`.

    With ``raise_infeasible``, the rotor plan's
    :class:`~rtmem.errors.InfeasibleError` (budget below
    :func:`min_feasible_memory`) is raised too, before any baseline is planned:
    every baseline is a persistent schedule, so none of them would fit either
    (what ``rtmem plan remat`` reports).

    Warns (:class:`SlowSolveWarning`, at the caller's line) before a rotor solve
    predicted to take more than :data:`SLOW_SOLVE_SECONDS`, as :func:`plan_remat`.
    """
    check_chain(chain, "compare_remat")
    from .revolve import _plan_revolve, _too_long

    def revolve():
        longest = _too_long(chain)
        if longest is not None:
            # plan_revolve would refuse the table (RtmemError): that entry alone is
            # left out, the other plans of the comparison stand
            return InfeasibleError(f"not attempted: {chain.n:,} stages, plan_revolve "
                                   f"plans at most {longest:,}", budget=as_budget(memory),
                                   min_feasible=None)
        return _plan_revolve(chain, memory)      # checked just above, once

    say = progress if progress is not None else (lambda msg: None)
    out = {}
    # rotor first: it refuses a too-large DP table before any baseline's
    # O(n^2) schedules (or Revolve's O(n^3) table) are built
    planned = {}

    # the slow-solve warning names compare_remat and points at its caller: frames
    # _plan_remat -> the lambda -> compare_remat -> caller
    runs = [("rotor", lambda: _plan_remat(chain, memory, slots, None, progress, planned,
                                          "compare_remat", stacklevel=4)),
            ("store-all", lambda: plan_store_all(chain, memory)),
            ("sequential", lambda: plan_sequential(chain, memory)),
            ("sqrt", lambda: plan_sqrt(chain, memory)),
            ("revolve", revolve)]
    for name, run in runs:
        say(f"planning {name} ...")
        if name in planned:
            out[name] = planned[name]
            continue
        try:
            out[name] = run()
        except InfeasibleError as e:
            if raise_infeasible and name == "rotor":
                raise
            out[name] = e
    return out
