"""``plan_remat``: the rematerialization planner users call (ROTOR's C_MP).

The DP itself is in :mod:`rtmem.planners.rotor` (NOTE [ Persistent DP C_MP ]);
this module turns a byte budget into slots, runs it, and checks the result in the
simulator. ``compare_remat`` runs it next to every baseline for tables.

Budget accounting. The simulator counts the chain input a_0 and all weights from
the start, and each weight gradient from its backward on (NOTE [ Simulator
semantics ] Rule 1). The first two are subtracted from the budget before the DP
(exactly); the weight gradients enter the DP's requirements through G (exactly,
see the rotor NOTE). So a schedule the DP finds in slots fits the budget in bytes.
"""

from __future__ import annotations

import math
import time

import numpy as np

from rtmem.errors import InfeasibleError, RtmemError
from rtmem.units import format_bytes

from .baselines import plan_sequential, plan_sqrt, plan_store_all, store_all_schedule
from ._validation import check_chain, check_count
from .chain import Chain
from .plan import Plan, as_budget
from .platform import Platform
from .rotor import (discretize, min_memory, min_memory_schedule, persistent_schedule,
                    persistent_table, stage_arrays)
from .simulator import simulate

__all__ = ["plan_remat", "min_feasible_memory", "compare_remat", "DEFAULT_SLOTS",
           "MAX_TABLE_BYTES"]

#: Memory slots of the discretized DP (thesis §3.7: 500 in all experiments).
DEFAULT_SLOTS = 500
#: Largest C_MP table plan_remat allocates, bytes.
MAX_TABLE_BYTES = 2 * 2**30


def _fixed_bytes(chain: Chain) -> int:
    """Bytes resident from the start: the chain input and every weight."""
    return int(chain.x0) + int(chain.w.sum())


def min_feasible_memory(chain: Chain) -> int:
    """Least budget (bytes) for which :func:`plan_remat` returns a plan: the
    chain input, the weights, and the least memory of a persistent schedule
    (computed exactly in bytes, no discretization)."""
    check_chain(chain, "min_feasible_memory")
    mm, _ = min_memory(stage_arrays(chain))
    return _fixed_bytes(chain) + mm


def _check_table(n: int, slots: int, fixed_slot_bytes: bool = False) -> int:
    """Bytes of the DP table for ``n`` stages and ``slots`` memory slots; raise
    when over :data:`MAX_TABLE_BYTES`, saying what would fit."""
    cells = (n + 1) * (n + 2) // 2
    table_bytes = cells * (slots + 1) * 8
    if table_bytes <= MAX_TABLE_BYTES:
        return table_bytes
    fits = MAX_TABLE_BYTES // (8 * cells) - 1
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


def _plan(chain, schedule, budget, info) -> Plan:
    res = simulate(chain, schedule, Platform(budget))
    return Plan(schedule=schedule, makespan=res.makespan, peak=res.peak, budget=budget,
                algorithm="rotor", info=info)


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
        (at least 1) and every size is rounded up to whole slots, so the plan is
        valid in bytes; more slots: closer to optimal, slower (time and table
        memory grow linearly in S).
    slot_bytes:
        Use this slot size (bytes) instead of deriving it from ``slots``; with a
        fixed slot the makespan is non-increasing in the budget.
    progress:
        Optional callable receiving short status strings (for CLIs); if it also
        has an ``update(fraction)`` method, that receives the DP's progress
        (0..1) while the table fills, e.g. :class:`rtmem.cli_plan.ProgressBar`.

    Returns
    -------
    Plan
        ``algorithm="rotor"``; ``makespan`` (s) and ``peak`` (bytes) from the
        simulator; ``info`` holds ``dp_makespan`` (s, the DP's prediction),
        ``slot_bytes``, ``slots`` (M, slots available to the DP),
        ``min_feasible`` (bytes), ``solve_seconds`` and ``method``
        (``"store-all"`` when the budget allows no recomputation, ``"dp"``, or
        ``"min-memory"`` when rounding to slots made the DP infeasible although a
        schedule exists: the least-memory schedule is returned then).

    Raises
    ------
    InfeasibleError
        When the budget is below :func:`min_feasible_memory`; ``min_feasible``
        carries that value in bytes.
    """
    say = progress or (lambda msg: None)
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
                "solve_seconds": time.perf_counter() - t0}
        return Plan(schedule=store_all, makespan=res.makespan, peak=res.peak,
                    budget=budget, algorithm="rotor", info=info)
    if slot_bytes is None:
        # the table has about `slots` columns: refuse an impossible size before the
        # O(n^2)-memory, O(n^3)-time least-memory pass below
        _check_table(chain.n, int(slots))
    arrays = stage_arrays(chain)
    fixed = _fixed_bytes(chain)
    mm, choice = min_memory(arrays)
    min_feasible = fixed + mm
    if budget < min_feasible:
        raise InfeasibleError(
            f"no persistent schedule of {chain.name or 'the chain'} fits in {budget:,} bytes "
            f"({format_bytes(budget)}): it needs at least {min_feasible:,} bytes "
            f"({format_bytes(min_feasible)}) = chain input and weights {fixed:,} + "
            f"activations {mm:,}. Give more memory or a smaller batch",
            budget=budget, min_feasible=min_feasible)
    info = {"min_feasible": min_feasible}
    m_bytes = int(budget) - fixed
    slot = int(slot_bytes) if slot_bytes is not None else max(1, m_bytes // int(slots))
    M = m_bytes // slot
    N = chain.n + 1
    table_bytes = _check_table(chain.n, M, slot_bytes is not None)
    say(f"rotor: {chain.n} stages, {M} slots of {format_bytes(slot)}, "
        f"table {format_bytes(table_bytes)}")
    disc = discretize(arrays, slot)
    table, _, idx, mall, mnone = persistent_table(disc, M,
                                                  progress=getattr(progress, "update", None))
    value = float(table[idx[0, N - 1], M])
    info.update(slot_bytes=slot, slots=M)
    # The least-memory schedule (exact in bytes) is the fallback when rounding to
    # slots makes the DP infeasible, and taking the better of the two keeps the
    # makespan non-increasing in the budget at a fixed slot size.
    fallback = min_memory_schedule(arrays, choice)
    fallback_makespan = simulate(chain, fallback, Platform(budget)).makespan
    if np.isfinite(value) and value <= fallback_makespan:
        schedule = persistent_schedule(disc, table, idx, mall, mnone, M)
        info.update(method="dp", dp_makespan=value)
    else:
        schedule = fallback
        info.update(method="min-memory", dp_makespan=fallback_makespan)
    del table
    info["solve_seconds"] = time.perf_counter() - t0
    say(f"rotor: solved in {info['solve_seconds']:.2f} s")
    return _plan(chain, schedule, budget, info)


def compare_remat(chain: Chain, memory, slots: int = DEFAULT_SLOTS, progress=None) -> dict:
    """Run :func:`plan_remat` and every baseline at the same budget.

    Returns ``{name: Plan or InfeasibleError}`` for ``rotor``, ``store-all``,
    ``sequential`` (best segment count), ``sqrt`` and ``revolve`` (Revolve
    converted with ``F_all`` before each ``B``), in that order.
    """
    check_chain(chain, "compare_remat")
    from .revolve import plan_revolve

    say = progress or (lambda msg: None)
    out = {}
    runs = [("rotor", lambda: plan_remat(chain, memory, slots, progress=progress)),
            ("store-all", lambda: plan_store_all(chain, memory)),
            ("sequential", lambda: plan_sequential(chain, memory)),
            ("sqrt", lambda: plan_sqrt(chain, memory)),
            ("revolve", lambda: plan_revolve(chain, memory))]
    for name, run in runs:
        say(f"planning {name} ...")
        try:
            out[name] = run()
        except InfeasibleError as e:
            out[name] = e
    return out
