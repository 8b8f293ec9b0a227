"""The floating-activation DP C_FL for small heterogeneous chains, corrected.

NOTE [ Floating DP C_FL ]
thesis-remat.md §3.4-3.5 (Theorem 5, Alg. 1-2), with the correction of
erratum 16. Same 0-based DP stages and arrays as NOTE [ Persistent DP C_MP ]
(rotor.py); D[t] = xo[t] + G[t] is the gradient of stage t's output plus the
weight gradients present while it is current.

F(s, t, l, m), s <= l <= t: least time to run B_t, ..., B_l when the *floating*
activation a_s (outside m) and the gradient of stage t's output are stored,
ending with only the gradient of a_l; the floating activation may move right by
F_none (Corollary 1: only to a larger activation, so the memory left,
m + a_s - a_r, never grows) and is consumed by B_l.

    adv(s, e)  = max_{s <= h < e} [ (a_h - a_s if h > s else 0) + xo[h] + o_F[h] + D[t] ]
                 (memory to move the floating activation from a_s to a_e by F_none)
    Case A (F_all at l, after moving to a_l; the thesis' C1 has only l = s):
        m >= adv(s, l), m_l = m + a_s - a_l,
        m_l >= xb[l] + o_F[l] + D[t],  m_l >= xb[l] + xo[l] + a_l + o_B[l] + G[l] + w[l]
        value = sum(u_F[s..l]) + F(l+1, t, l+1, m_l - xb[l]) + u_B[l]   (no F(...) if l = t)
    Case B (t > l; eq. 2.7): r in s..l (a_r >= a_s), s' in r..t-1, t' in max(l, s')+1..t:
        m >= adv(s, r), m_r = m + a_s - a_r, F_ck r and F_none r+1..s' fit in m_r,
        value = sum(u_F[s..s']) + F(s'+1, t, t', m_r - xo[s']) + F(r, t'-1, l, m_r)
    answer F(0, n, 0, M - a_0 - weights)

Errata followed (thesis-remat.md §8): 7 (m_none up to t-1: here each F_none is
checked where it runs, exactly), 8 (the second call gets m - a_{r-1} + a_{s-1}
= m_r), 9 (domain r <= l, s' < t', l < t' <= t, a_r >= a_s), 12 (F_none never
reads abar: a sub-problem entered after F_all has l = s, so it cannot move its
input), and 16: the printed recurrence lacks Case A with l > s (move the floating
activation by F_none, then F_all), so C_FL(s, t, t) = inf for s < t and the
erratum's instance gets 42 instead of 39. With Case A generalised as above the
DP matches exhaustive search (:func:`rtmem.planners.testing.brute_force_remat`):
tests/test_remat_floating.py checks it on 60 ``chains(1, 4, small=True)`` per
run, and a one-off run on 3,800 uniformly random chains of 1-5 stages (sizes
0-12 B, times 0-10 s, budgets up to the no-remat peak) and 1,700 drawn by
``chains(1, 4)`` found no miss (2026-11-21; an earlier note here had brute force
ahead on about 1 chain in 150, which no longer reproduces). It is not proven
optimal over all schedules: the recurrence never runs one stage twice in a row
(F_all s, then F_none s), which exhaustive search may. The requirement
checks are those of the simulator, op by op, so no gate such as m >= m_none is
needed.

Beyond the thesis: stages the chain marks ``no_recompute`` (they modify their
input in place) must run their forward once. Every stage's B needs its abar,
which only F_all makes, so a flagged stage may never run F_ck or F_none: Case A
needs no flag among s..l-1 (l <= nr[s]), Case B none among s..s' (s' < nr[s]),
where nr[s] is the first flagged stage at or after s (N when none; rotor.py's
StageArrays.nr). Each sub-problem's own F_ck / F_none are then checked where
they are chosen, so this is exactly the constraint on the DP's schedules; without
flags nr[s] = N and the loops run as before (tables compared cell by cell on 300
random chains, 2026-11-23). Plans are checked against exhaustive search under the
same rule in tests/test_remat_floating.py.

Cost O(M N^6) time, N^3 (M+1) float64 memory: small chains only (N <= ~12).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from rtmem.errors import InfeasibleError, RtmemError, ScheduleError
from rtmem.units import format_bytes

from ._validation import check_chain, check_count
from .chain import Chain
from .plan import Plan, as_budget, planned_info
from .platform import Platform
from .remat import _fixed_bytes, _least_budget, plan_remat
from .rotor import StageArrays, _check_stage_arrays, discretize, stage_arrays
from .schedule import Op, Schedule
from .simulator import simulate

__all__ = ["floating_table", "floating_schedule", "plan_floating", "MAX_FLOATING_STAGES",
           "MAX_FLOATING_TABLE_BYTES"]

#: Longest chain plan_floating accepts (the DP is O(M N^6)).
MAX_FLOATING_STAGES = 12


@numba.njit(cache=True)
def _adv(s, t, xin, xo, of, D):
    """adv[e - s] = memory to move the floating activation from a_s to a_e."""
    out = np.zeros(t - s + 1, np.int64)
    cur = 0
    for e in range(s + 1, t + 1):
        h = e - 1
        need = (xin[h] - xin[s] if h > s else 0) + xo[h] + of[h] + D[t]
        cur = max(cur, need)
        out[e - s] = cur
    return out


# Cases of F(s, t, l, m), as _cells reports them in arg[0]
_NONE, _CASE_A, _CASE_B = 0, 1, 2


@numba.njit(cache=True)
def _cells(F, s, t, l0, l1, m0, m1, adv, P, ub, xin, xo, xb, of, ob, Gb, D, nr, arg, store):
    """F(s, t, l, m) for l0 <= l < l1, m0 <= m < m1 from the cells of shorter
    ranges already in ``F``: the one case analysis of NOTE [ Floating DP C_FL ],
    shared by the fill (whole ranges, ``store``: written into ``F``) and the
    reconstruction (one cell, ``F`` left alone) so the two cannot disagree.
    Returns the value of the last cell (seconds, ``inf`` if infeasible); ``arg``
    receives its argmin.

    ``arg`` = (case, r, sp, tp, mt, mr). Case A: F_none s..r-1, F_all r (r = l),
    then the range r+1..t in mt slots (mt = -1: the leaf, r = t). Case B: F_none
    s..r-1, F_ck r, F_none r+1..sp, then F(sp+1, t, tp, mt) and F(r, tp-1, l, mr).
    ``nr[s]``: the first flagged stage >= s (NOTE [ Floating DP C_FL ], no_recompute).
    """
    first_flag = nr[s]
    best = np.inf
    for l in range(l0, l1):
        for m in range(m0, m1):
            best, case, r_b, sp_b, mt_b, mr_b = np.inf, _NONE, -1, -1, -1, -1
            # Case A: move to a_l, F_all l, solve l+1..t, B l
            if m >= adv[l - s] and (l == s or xin[l] >= xin[s]) and l <= first_flag:
                ml = m + xin[s] - xin[l]
                if (ml >= xb[l] + of[l] + D[t]
                        and ml >= xb[l] + xo[l] + xin[l] + ob[l] + Gb[l]):
                    if l == t:
                        best, case, r_b = (P[l + 1] - P[s]) + ub[l], _CASE_A, l
                    elif ml - xb[l] >= 0:
                        best = (P[l + 1] - P[s]) + F[l + 1, t, l + 1, ml - xb[l]] + ub[l]
                        case, r_b, mt_b = _CASE_A, l, ml - xb[l]
            # Case B: move to a_r, F_ck r, F_none to s', keep a_{s'+1}
            if t > l:
                for r in range(s, min(l + 1, first_flag)):
                    if (r > s and xin[r] < xin[s]) or m < adv[r - s]:
                        continue
                    mr = m + xin[s] - xin[r]
                    if mr < xo[r] + of[r] + D[t]:
                        continue
                    fwd = 0                 # F_none r+1..s' requirement so far
                    for sp in range(r, min(t, first_flag)):
                        if sp > r:
                            fwd = max(fwd, xin[sp] + xo[sp] + of[sp] + D[t])
                        if mr < fwd:
                            break
                        mt = mr - xo[sp]
                        if mt < 0:
                            continue
                        pre = P[sp + 1] - P[s]
                        for tp in range(max(l, sp) + 1, t + 1):
                            v = pre + F[sp + 1, t, tp, mt] + F[r, tp - 1, l, mr]
                            if v < best:
                                best, case, r_b, sp_b, mt_b, mr_b = v, _CASE_B, r, sp, mt, mr
                                arg[3] = tp
            if store:
                F[s, t, l, m] = best
            arg[0], arg[1], arg[2], arg[4], arg[5] = case, r_b, sp_b, mt_b, mr_b
    return best


@numba.njit(cache=True)
def _fill(ub, xin, xo, xb, of, ob, G, Gb, nr, P, M):
    N = ub.shape[0]
    F = np.full((N, N, N, M + 1), np.inf)
    D = xo + G
    arg = np.empty(6, np.int64)
    for d in range(N):
        for s in range(N - d):
            t = s + d
            adv = _adv(s, t, xin, xo, of, D)
            _cells(F, s, t, s, t + 1, 0, M + 1, adv, P, ub, xin, xo, xb, of, ob,
                   Gb, D, nr, arg, True)
    return F


def _check_stages(n: int) -> None:
    if n > MAX_FLOATING_STAGES:
        raise RtmemError(f"the floating DP is O(M N^6): {n} stages is too many "
                         f"(max {MAX_FLOATING_STAGES}); use plan_remat (C_MP)")


def floating_table(arrays: StageArrays, M: int):
    """Fill F(s, t, l, m) for m = 0..M (sizes of ``arrays`` in slots). Returns the
    table, ``F[s, t, l, m]`` in seconds (``inf``: infeasible)."""
    a = arrays
    _check_stage_arrays(a, "floating_table")
    _check_stages(a.N - 1)
    P = np.concatenate(([0.0], np.cumsum(a.uf)))
    return _fill(a.ub, a.xin, a.xo, a.xb, a.of, a.ob, a.G, a.Gb, a.nr, P, int(M))


def floating_schedule(arrays: StageArrays, F, m: int) -> Schedule:
    """Reconstruct the schedule of F(0, n, 0, m) (Alg. 2, with Case A generalised)
    from ``F`` as :func:`floating_table` returned it for ``arrays``; ``m`` in slots,
    0..M. Raises :class:`~rtmem.errors.ScheduleError` (reason
    ``"bad-floating-table"``) for an ``F`` of another shape or an ``m`` outside it
    (the jitted cells read ``F`` without bounds checks), and for an entry the walk
    visits that its own choices do not reach (a table no fill made for these
    arrays, e.g. one made for another chain or by hand)."""
    a = arrays
    _check_stage_arrays(a, "floating_schedule")
    N = a.N
    F = np.asarray(F)
    if F.ndim != 4 or F.shape[:3] != (N, N, N) or F.dtype.kind != "f":
        raise ScheduleError(
            f"floating_schedule: F must be the ({N}, {N}, {N}, M + 1) float table "
            f"floating_table returns for these arrays, got {F.dtype} of shape {F.shape}",
            reason="bad-floating-table")
    if isinstance(m, (bool, np.bool_)) or not isinstance(m, (int, np.integer)) \
            or not 0 <= m < F.shape[3]:
        raise ScheduleError(f"floating_schedule: m = {m!r} is not a memory of F (an integer "
                            f"0..{F.shape[3] - 1}, in slots)", reason="bad-floating-table")
    if not np.isfinite(F[0, N - 1, 0, m]):
        raise ScheduleError(f"floating_schedule: no floating schedule fits in m = {m} "
                            f"(F[0, {N - 1}, 0, {m}] is {F[0, N - 1, 0, m]}); pass an m with a "
                            "finite entry", reason="bad-floating-table")
    D = a.xo + a.G
    P = np.concatenate(([0.0], np.cumsum(a.uf)))
    ops = []
    arg = np.empty(6, np.int64)
    stack = [("solve", 0, N - 1, 0, int(m))]
    while stack:
        item = stack.pop()
        if item[0] == "emit":
            ops.append(item[1])
            continue
        _, s, t, l, m = item
        adv = _adv(s, t, a.xin, a.xo, a.of, D)
        best = _cells(F, s, t, l, l + 1, m, m + 1, adv, P, a.ub, a.xin, a.xo,
                      a.xb, a.of, a.ob, a.Gb, D, a.nr, arg, False)
        case, r, sp, tp, mt, mr = (int(v) for v in arg)
        if case == _NONE or not best <= F[s, t, l, m]:
            # the fill stores exactly what _cells computes here, so only a table
            # floating_table did not make (for these arrays) reaches this
            got = "no choice is feasible" if case == _NONE else f"its best choice takes {best}"
            raise ScheduleError(
                f"floating_schedule: F[{s}, {t}, {l}, {m}] = {F[s, t, l, m]} but {got} by the "
                "table's other entries: F is not a table floating_table(arrays, M) makes for "
                "these arrays; pass the one it returned", reason="bad-floating-table")
        ops += [(Op.F_NONE, h) for h in range(s, r)]
        if case == _CASE_A:
            if mt < 0:     # the leaf: r == t
                ops += [(Op.LOSS, 0)] if r == N - 1 else [(Op.F_ALL, r), (Op.B, r)]
            else:
                ops.append((Op.F_ALL, r))
                stack += [("emit", (Op.B, r)), ("solve", r + 1, t, r + 1, mt)]
        else:
            ops.append((Op.F_CK, r))
            ops += [(Op.F_NONE, h) for h in range(r + 1, sp + 1)]
            stack += [("solve", r, tp - 1, l, mr), ("solve", sp + 1, t, tp, mt)]
    return Schedule.from_ops(ops)


#: Largest floating table plan_floating allocates, bytes (N^3 (M+1) float64).
MAX_FLOATING_TABLE_BYTES = 2**30


def _table_bytes(N: int, M: int) -> int:
    return N ** 3 * (M + 1) * 8


def _least_floating_budget(arrays: StageArrays, fixed: int) -> int:
    """Least budget (bytes) at which :func:`plan_floating` returns a plan: the
    least m with a finite F(0, n, 0, m) in exact bytes, searched up to
    :func:`~rtmem.planners.min_feasible_memory` (the floating DP has every
    persistent schedule, so it is feasible there, and plan_floating falls back
    to the persistent plan from there on). When that exact table is too large,
    the persistent bound itself."""
    lo = _least_budget(arrays, fixed)
    N = arrays.N
    if _table_bytes(N, lo - fixed) > MAX_FLOATING_TABLE_BYTES:
        return lo
    F = floating_table(arrays, lo - fixed)
    finite = np.flatnonzero(np.isfinite(F[0, N - 1, 0]))
    return fixed + int(finite[0]) if finite.size else lo


def plan_floating(chain: Chain, memory, slots: int | None = None) -> Plan:
    """Optimal schedule of a small chain (<= ``MAX_FLOATING_STAGES`` stages) with
    the corrected floating DP.

    ``memory`` in bytes (int, string or Platform). ``slots=None`` uses one-byte
    slots (exact; the table has memory+1 columns, so keep budgets small),
    otherwise slot = floor(activation budget / slots) with sizes rounded up, as
    in :func:`~rtmem.planners.plan_remat`. When rounding leaves the DP no
    schedule, it is retried in exact bytes if that table fits
    :data:`MAX_FLOATING_TABLE_BYTES`, else the persistent plan
    (:func:`~rtmem.planners.plan_remat`) is returned; ``info["method"]`` says
    which (``"dp"``, ``"exact"`` or ``"persistent"``). Raises
    :class:`~rtmem.errors.InfeasibleError` when no schedule fits, with
    ``min_feasible`` the least budget (bytes) at which this returns a plan.
    Stages the chain marks ``no_recompute`` run their forward once, as ``F_all``
    (NOTE [ Floating DP C_FL ]), which may cost time or memory at tight budgets."""
    check_chain(chain, "plan_floating")
    budget = as_budget(memory)
    if slots is not None:
        slots = check_count("slots", slots)
    if math.isinf(budget):
        raise RtmemError("plan_floating needs a finite budget; use plan_store_all for "
                         "unlimited memory")
    fixed = _fixed_bytes(chain)
    m_bytes = int(budget) - fixed
    N = chain.n + 1
    _check_stages(chain.n)             # before the least-budget pass below
    arrays = stage_arrays(chain)

    def infeasible(what):
        least = _least_floating_budget(arrays, fixed)
        return InfeasibleError(f"{what}; it needs at least {least:,} bytes "
                               f"({format_bytes(least)}). Give more memory",
                               budget=budget, min_feasible=least)

    if m_bytes < 0:
        raise infeasible(f"the chain input and weights alone need {fixed:,} bytes, "
                         f"more than the budget {budget:,}")
    slot = 1 if slots is None else max(1, m_bytes // slots)
    M = m_bytes // slot
    if _table_bytes(N, M) > MAX_FLOATING_TABLE_BYTES:
        raise RtmemError(f"the floating table would need {format_bytes(_table_bytes(N, M))}; "
                         "pass slots= (e.g. 200) to discretize the budget")
    disc = discretize(arrays, slot)
    F = floating_table(disc, M)
    value = float(F[0, N - 1, 0, M])
    method = "dp"
    if not math.isfinite(value) and slot > 1:
        # rounding every size up to slots can leave no schedule although one
        # exists (thesis §3.7): retry in exact bytes when that table is allowed,
        # else return the persistent plan, which refines its own slots
        if _table_bytes(N, m_bytes) <= MAX_FLOATING_TABLE_BYTES:
            slot, M, disc = 1, m_bytes, arrays
            F = floating_table(disc, M)
            value = float(F[0, N - 1, 0, M])
            method = "exact"
        elif budget >= _least_budget(arrays, fixed):
            plan = plan_remat(chain, budget, slots=slots)
            return Plan(schedule=plan.schedule, makespan=plan.makespan, peak=plan.peak,
                        budget=budget, algorithm="floating",
                        info=planned_info(chain, {
                            "method": "persistent", "dp_makespan": None, "slot_bytes": slot,
                            "slots": M, "persistent": plan.info}))
    if not math.isfinite(value):
        raise infeasible(f"no schedule of {chain.name or 'the chain'} fits in {budget:,} "
                         f"bytes ({format_bytes(budget)}) for the floating DP")
    schedule = floating_schedule(disc, F, M)
    res = simulate(chain, schedule, Platform(budget))
    return Plan(schedule=schedule, makespan=res.makespan, peak=res.peak, budget=budget,
                algorithm="floating", info=planned_info(chain, {
                    "method": method, "dp_makespan": value, "slot_bytes": slot, "slots": M}))
