"""ROTOR's persistent dynamic program C_MP for heterogeneous chains.

NOTE [ Persistent DP C_MP ]
thesis-remat.md §3.6 and Appendix A.2 (Theorem 6, Alg. 3-4). Here with 0-based DP
stages k = 0..N-1, N = n+1: stages 0..n-1 are the chain's, stage n is the loss
(the thesis' stage L+1: u_F = u_loss, u_B = 0, a = abar = 0, o_F = 0,
o_B = o_loss). For a DP stage k: ``xin[k]`` is the size of its input a_k,
``xo[k]`` of its output (and of the gradient flowing into it), ``xb[k]`` of abar.

C(s, t, m) is the least time to run B_t, ..., B_s when only a_s (outside m) and
the gradient of stage t's output (size xo[t], 0 for the loss) are stored, leaving
only the gradient of a_s:

    C(t, t, m) = u_F[t] + u_B[t]                               if m >= m_all(t, t)
    C(s, t, m) = min( u_F[s] + C(s+1, t, m - xb[s]) + u_B[s]   if m >= m_all(s, t)
                      min_{s <= s' < t} sum(u_F[s..s']) + C(s'+1, t, m - xo[s'])
                                        + C(s, s', m)          if m >= m_none(s, t) )
    m_all(s, t)  = max(xo[t] + xb[s] + o_F[s] + G[t],
                       xb[s] + xo[s] + xin[s] + o_B[s] + G[s] + w[s])
    m_none(s, t) = xo[t] + G[t] + max(xo[s] + o_F[s],
                                      max_{s < h < t} xin[h] + xo[h] + o_F[h])

The first branch is F^all_s (then B_s), the second F^ck_s, F^none_{s+1..s'}
keeping a_{s'+1}, the tail, then the head with all of m. Errata followed: the
m_none range stops at h = t-1 (erratum 7 of thesis-remat.md); the tail call is
C(s'+1, ...) (erratum 10); the top level is C(0, n, M - a_0) (erratum 10), and
beyond the thesis we also subtract the weights (the simulator counts them from
the start, NOTE [ Simulator semantics ] Rule 1). G[k] = sum_{j>k} w[j] is the
bytes of weight gradients already made while the gradient of stage k's output
is current: it depends on t only, so adding it to each requirement makes the DP
exact for the simulator's memory rules, not a conservative bound. Like the
simulator, the model has no explicit delete (erratum 11), and the gradient of a
stage's output has the size of that output (erratum 13). C_MP is optimal among
persistent schedules only: exhaustive search can do better (erratum 16; about
1 random tiny chain in 1300 here), see floating.py for the exact DP.

Beyond the thesis: stages the chain marks ``no_recompute`` (they modify their
input in place) must run their forward once. The F^ck branch at (s, t, s')
runs s..s' now and again in C(s, s', m); every other branch runs each of its
stages once within the sub-problem, and a head C(s, s', .) contains only
stages the split allowed. So restricting s' to s <= s' < nr[s], where nr[s] is
the first flagged stage at or after s (N when there is none), is exactly the
constraint, optimal among persistent schedules that respect it. Without flags
nr[s] = N > t - 1 and every loop runs as before.

Discretization (thesis §3.7): every size term above is rounded *up* to whole
slots separately, so a schedule feasible in slots is feasible in bytes
(property 11). The table is filled for all m at once per (s, t), with two
prunings that do not change any entry: below the least feasible m of the
sub-problems nothing is computed (stays inf), and at or above
m_full(s, t) = max(m_all(s, t), xb[s] + m_full(s+1, t)) only the F^all branch is
evaluated, since it already reaches the no-recomputation lower bound.

Table memory: one float64 row of M+1 entries per pair s <= t, i.e.
N (N+1) / 2 (M+1) 8 bytes. For L = 400 (N = 401) and M = 500 slots:
80,601 x 501 x 8 = 323,048,808 bytes (308 MiB). plan_remat's first table has
M below 2 S slots (at most 646 MB for S = 500 at 400 stages), but its retries
with finer slots near the least budget go up to REFINE_MAX_FACTOR x S slots
(32,000 for S = 500), so a table may reach MAX_TABLE_BYTES (2 GiB), its only
bound. No back-pointer table: the reconstruction re-evaluates the
O(t - s) candidates of the O(n) sub-problems it visits.

This module holds the C_MP table, its reconstruction and the plain-Python
references. The DP stage arrays (:class:`StageArrays`, :func:`stage_arrays`,
:func:`discretize`, :func:`pair_index`) are in planners/_rotor_arrays.py, the
least-memory pass (:func:`min_memory`, :func:`min_memory_schedule`,
:func:`choices_memory`) in planners/_rotor_min_memory.py; all are imported here.
"""

from __future__ import annotations

import numba
import numpy as np

from rtmem.errors import ScheduleError

# The DP stage arrays and the least-memory pass are modules of their own; their
# names are imported here, where floating.py, revolve.py, remat.py and users take
# them from.
from ._rotor_arrays import (_B, _F_ALL, _F_CK, _F_NONE, StageArrays,
                            _bands, _check_stage_arrays, _emit_leaf,
                            _reconstruct_capacity, discretize, pair_index, stage_arrays)
from ._rotor_min_memory import choices_memory, min_memory, min_memory_schedule
from .schedule import Schedule

__all__ = ["StageArrays", "stage_arrays", "discretize", "persistent_table",
           "persistent_schedule", "min_memory", "min_memory_schedule", "choices_memory",
           "reference_persistent_table", "reference_min_memory", "pair_index"]

_INF = np.inf
# Its public home, as before the split: reprs and pickles name rtmem.planners.rotor.
StageArrays.__module__ = __name__


def _requirements(xin, xo, xb, of, ob, G, Gb):
    """m_all(s, t) and m_none(s, t) of NOTE [ Persistent DP C_MP ] (same units as sizes),
    as two (N, N) int64 arrays."""
    N = xo.shape[0]
    mall = np.zeros((N, N), np.int64)
    mnone = np.zeros((N, N), np.int64)
    _fill_requirements(xin, xo, xb, of, ob, G, Gb, mall, mnone)
    return mall, mnone


# NOTE [ Jitted results and Ctrl-C ]
# The jitted functions here (and in _rotor_arrays.py, _rotor_min_memory.py) fill
# arrays their Python caller allocated and return nothing or a number, never a
# tuple of arrays. numba boxes a returned array by
# calling back into Python (numba.core.serialize._numba_unpickle), where a pending
# Ctrl-C is raised; for a tuple of arrays numba then hands back a result with the
# exception set: a SystemError instead of the KeyboardInterrupt, or a segfault
# (`rtmem plan remat` on 1,000 stages, Ctrl-C in the O(n^3) least-memory pass).
@numba.njit(cache=True)
def _fill_requirements(xin, xo, xb, of, ob, G, Gb, mall, mnone):
    """Fill ``mall`` and ``mnone`` ((N, N) int64, zeros) for :func:`_requirements`."""
    N = xo.shape[0]
    for s in range(N):
        back = xb[s] + xo[s] + xin[s] + ob[s] + Gb[s]
        inner = xo[s] + of[s]                 # running max over h in s..t-1
        for t in range(s, N):
            dt = xo[t]
            mall[s, t] = max(dt + xb[s] + of[s] + G[t], back)
            if t > s:
                if t - 1 > s:
                    h = t - 1
                    inner = max(inner, xin[h] + xo[h] + of[h])
                mnone[s, t] = dt + G[t] + inner


@numba.njit(cache=True)
def _fill_rows(C, mf, full, uf, ub, xo, xb, mall, mnone, nr, idx, M, s_hi, s_lo):
    """Fill the C_MP rows of every pair (s, t) with s_lo <= s <= s_hi, s descending;
    rows of larger s must be done. See the NOTE for pruning. ``mf[s, t]`` is the
    least m with a finite entry (M+1 if none); ``full[s, t]`` the memory from which
    F^all first is optimal."""
    N = uf.shape[0]
    P = np.zeros(N + 1)
    for k in range(N):
        P[k + 1] = P[k] + uf[k]
    for s in range(s_hi, s_lo - 1, -1):
        for t in range(s, N):
            row = C[idx[s, t]]
            if s == t:
                full[s, t] = mall[s, s]
                v = uf[s] + ub[s]
                for m in range(mall[s, s], M + 1):
                    row[m] = v
            else:
                full[s, t] = max(mall[s, t], xb[s] + full[s + 1, t])
                sub = C[idx[s + 1, t]]
                a = xb[s]
                for m in range(max(mall[s, t], a + mf[s + 1, t]), M + 1):
                    row[m] = uf[s] + sub[m - a] + ub[s]
                top = min(full[s, t], M + 1)   # at >= full, F^all is already optimal
                for sp in range(s, min(t, nr[s])):
                    a = xo[sp]
                    lo = max(mnone[s, t], mf[s, sp], mf[sp + 1, t] + a)
                    if lo >= top:
                        continue
                    # slices starting at 0 let LLVM vectorize this loop (5x faster
                    # than indexing the rows with m - a and m)
                    tail = C[idx[sp + 1, t]][lo - a:top - a]
                    head = C[idx[s, sp]][lo:top]
                    out = row[lo:top]
                    pre = P[sp + 1] - P[s]
                    for j in range(top - lo):
                        v = pre + tail[j] + head[j]
                        x = out[j]
                        out[j] = v if v < x else x
            for m in range(M + 1):
                if row[m] < _INF:
                    mf[s, t] = m
                    break


@numba.njit(cache=True)
def _reconstruct(C, idx, uf, ub, xo, xb, mall, mnone, nr, s0, t0, m0, n_loss, ops, stages):
    """Walk the table from (s0, t0, m0); write the schedule's operations and stages
    to ``ops`` and ``stages`` (int64, at least :func:`_reconstruct_capacity` long)
    and return their number, or ``-1 - ((s N + t) (M + 1) + m)`` at the first
    finite entry (s, t, m) none of whose choices is finite (not a C_MP table).
    With non-negative sizes and 0 <= m0 <= M, m stays in 0..M and every interval
    splits into strictly smaller ones, so the stack and op counts stay in bounds."""
    N = uf.shape[0]
    P = np.zeros(N + 1)
    for k in range(N):
        P[k + 1] = P[k] + uf[k]
    n_ops = 0
    # task stack: kind 0 = solve(s, t, m); kind 1 = emit B s
    kind = np.empty(4 * N + 4, np.int64)
    ts = np.empty(4 * N + 4, np.int64)
    tt = np.empty(4 * N + 4, np.int64)
    tm = np.empty(4 * N + 4, np.int64)
    top = 0
    kind[0], ts[0], tt[0], tm[0] = 0, s0, t0, m0
    top = 1
    while top > 0:
        top -= 1
        k, s, t, m = kind[top], ts[top], tt[top], tm[top]
        if k == 1:
            ops[n_ops], stages[n_ops] = _B, s
            n_ops += 1
            continue
        if s == t:
            n_ops = _emit_leaf(ops, stages, n_ops, s, n_loss)
            continue
        best = _INF
        choice = -2
        if m >= mall[s, t] and m - xb[s] >= 0:
            v = uf[s] + C[idx[s + 1, t], m - xb[s]] + ub[s]
            if v < best:                    # an infinite F^all is no choice either
                best = v
                choice = -1
        if m >= mnone[s, t]:
            for sp in range(s, min(t, nr[s])):
                if m - xo[sp] < 0:
                    continue
                v = (P[sp + 1] - P[s]) + C[idx[sp + 1, t], m - xo[sp]] + C[idx[s, sp], m]
                if v < best:
                    best = v
                    choice = sp
        if choice == -2:
            # only a table no C_MP fill makes leads here (callers descend into finite
            # entries, whose best choice is finite): stop before writing past the arrays
            return -1 - ((s * N + t) * C.shape[1] + m)
        if choice == -1:
            ops[n_ops], stages[n_ops] = _F_ALL, s
            n_ops += 1
            kind[top], ts[top] = 1, s
            top += 1
            kind[top], ts[top], tt[top], tm[top] = 0, s + 1, t, m - xb[s]
            top += 1
        else:
            sp = choice
            ops[n_ops], stages[n_ops] = _F_CK, s
            n_ops += 1
            for h in range(s + 1, sp + 1):
                ops[n_ops], stages[n_ops] = _F_NONE, h
                n_ops += 1
            kind[top], ts[top], tt[top], tm[top] = 0, s, sp, m
            top += 1
            kind[top], ts[top], tt[top], tm[top] = 0, sp + 1, t, m - xo[sp]
            top += 1
    return n_ops



def persistent_table(arrays: StageArrays, M: int, progress=None):
    """Fill the C_MP table for memory 0..M (sizes in ``arrays`` in slots).

    ``progress``: optional callable receiving the fraction done (0..1) after each
    of ~50 bands of rows, for progress bars on long solves.

    Returns ``(table, mf, idx, mall, mnone)``: ``table[idx[s, t], m]`` is C(s, t, m)
    in seconds (``inf`` when infeasible), ``mf[s, t]`` the least feasible m.
    """
    a = arrays
    _check_stage_arrays(a, "persistent_table")
    mall, mnone = _requirements(a.xin, a.xo, a.xb, a.of, a.ob, a.G, a.Gb)
    idx = pair_index(a.N)
    N, M = a.N, int(M)
    table = np.full((N * (N + 1) // 2, M + 1), _INF)
    mf = np.full((N, N), M + 1, np.int64)
    full = np.zeros((N, N), np.int64)
    if progress is None:
        _fill_rows(table, mf, full, a.uf, a.ub, a.xo, a.xb, mall, mnone, a.nr, idx, M,
                   N - 1, 0)
        return table, mf, idx, mall, mnone
    for s_hi, s_lo, done in _bands(N):
        _fill_rows(table, mf, full, a.uf, a.ub, a.xo, a.xb, mall, mnone, a.nr, idx, M,
                   s_hi, s_lo)
        progress(done)
    return table, mf, idx, mall, mnone



def persistent_schedule(arrays: StageArrays, table, idx, mall, mnone, m: int) -> Schedule:
    """Reconstruct the optimal persistent schedule of the whole chain at memory m
    (Alg. 4, OptRecP), from what :func:`persistent_table` returned for ``arrays``.
    ``m`` (in the units of ``arrays``, slots from :func:`discretize`) must be a
    column of ``table`` with ``table[idx[0, n], m]`` finite.

    Raises :class:`~rtmem.errors.ScheduleError` (reason ``"bad-persistent-table"``)
    for tables of other shapes, an ``idx`` entry outside the table, an ``m`` outside
    0..M or infeasible there, or a table whose entries no C_MP fill makes: the
    jitted walk has no bounds checks of its own, and these made it write past its
    arrays (a segmentation fault)."""
    a = arrays
    _check_stage_arrays(a, "persistent_schedule")
    N = a.N
    table, idx, mall, mnone, m = _check_persistent_args(N, table, idx, mall, mnone, m)
    cap = _reconstruct_capacity(N)
    op, stage = np.empty(cap, np.int64), np.empty(cap, np.int64)
    n_ops = _reconstruct(table, idx, a.uf, a.ub, a.xo, a.xb, mall, mnone, a.nr, 0, N - 1,
                         m, N - 1, op, stage)
    if n_ops < 0:
        s, rest = divmod(-1 - n_ops, N * table.shape[1])
        t, mm = divmod(rest, table.shape[1])
        raise ScheduleError(
            f"persistent_schedule: table[idx[{s}, {t}], {mm}] = {table[idx[s, t], mm]} is "
            "finite but none of its choices is: it is not a C_MP table of these arrays; "
            "pass what persistent_table(arrays, M) returned", reason="bad-persistent-table")
    return Schedule(op[:n_ops], stage[:n_ops])


def _check_persistent_args(N: int, table, idx, mall, mnone, m):
    """:func:`persistent_schedule`'s table arguments as the jitted walk needs them
    (float64 table, int64 (N, N) tables, int ``m``), or ScheduleError naming the
    first that is not. O(N^2): the walk itself is O(N^2) too."""
    def bad(what):
        return ScheduleError(f"persistent_schedule: {what}; pass what "
                             "persistent_table(arrays, M) returned for these arrays",
                             reason="bad-persistent-table")
    table = np.asarray(table)
    rows = N * (N + 1) // 2
    if table.ndim != 2 or table.shape[0] != rows or table.dtype.kind != "f":
        raise bad(f"table must be a ({rows}, M + 1) float array for {N} DP stages, got "
                  f"{table.dtype} of shape {table.shape}")
    tabs = []
    for name, arr in (("idx", idx), ("mall", mall), ("mnone", mnone)):
        arr = np.asarray(arr)
        if arr.shape != (N, N) or arr.dtype.kind not in "iu":
            raise bad(f"{name} must be an ({N}, {N}) integer array, got {arr.dtype} of "
                      f"shape {arr.shape}")
        tabs.append(arr.astype(np.int64, copy=False))
    idx = tabs[0]
    # the walk reads idx[s, t] for s <= t only
    upper = idx[np.triu_indices(N)]
    if upper.size and (upper.min() < 0 or upper.max() >= rows):
        s, t = (int(v[0]) for v in np.nonzero(np.triu((idx < 0) | (idx >= rows))))
        raise bad(f"idx[{s}, {t}] = {int(idx[s, t])} is not a row of table (0..{rows - 1})")
    if isinstance(m, (bool, np.bool_)) or not isinstance(m, (int, np.integer)):
        raise bad(f"m must be an integer, got {m!r}")
    m = int(m)
    M = table.shape[1] - 1
    if not 0 <= m <= M:
        raise bad(f"m = {m} is not a column of table (0..{M})")
    if not np.isfinite(table[idx[0, N - 1], m]):
        raise ScheduleError(
            f"persistent_schedule: no persistent schedule fits in m = {m} (table[idx[0, "
            f"{N - 1}], {m}] is {table[idx[0, N - 1], m]}); pass an m with a finite entry, "
            f"at least mf[0, {N - 1}] of persistent_table", reason="bad-persistent-table")
    return table, idx, tabs[1], tabs[2], m


# ------------------------------------------------------- plain-Python reference
def _as_printed(a: StageArrays):
    """The oracles' Python lists of ``a``: times (float), sizes (int), and
    ``flagged[k]``, whether stage k is no_recompute (from ``nr``)."""
    ints = [[int(v) for v in arr] for arr in (a.xin, a.xo, a.xb, a.of, a.ob, a.G, a.Gb)]
    return ([float(v) for v in a.uf], [float(v) for v in a.ub], *ints,
            [int(a.nr[k]) == k for k in range(a.N)])


def reference_min_memory(arrays: StageArrays) -> tuple[int, np.ndarray]:
    """:func:`min_memory` in plain Python from m_all and m_none as printed in
    NOTE [ Persistent DP C_MP ], with full (N, N) tables: the oracle the jitted
    pass (triangles, requirements along the row) is compared with, choices and
    ties included. O(N^3) Python steps: small chains only."""
    N = arrays.N
    uf, ub, xin, xo, xb, of, ob, G, Gb, flagged = _as_printed(arrays)
    P = [0.0]
    for v in uf:
        P.append(P[-1] + v)

    def m_all(s, t):
        return max(xo[t] + xb[s] + of[s] + G[t], xb[s] + xo[s] + xin[s] + ob[s] + Gb[s])

    def m_none(s, t):
        return xo[t] + G[t] + max([xo[s] + of[s]] + [xin[h] + xo[h] + of[h]
                                                     for h in range(s + 1, t)])

    mm, tm = {}, {}
    ch = np.full((N, N), -1, np.int64)
    for s in range(N - 1, -1, -1):
        mm[s, s], tm[s, s] = m_all(s, s), uf[s] + ub[s]
        for t in range(s + 1, N):
            best = max(m_all(s, t), xb[s] + mm[s + 1, t])
            best_t = uf[s] + tm[s + 1, t] + ub[s]
            for sp in range(s, t):
                if any(flagged[s:sp + 1]):   # F^ck would run a flagged stage twice
                    continue
                v = max(m_none(s, t), xo[sp] + mm[sp + 1, t], mm[s, sp])
                vt = (P[sp + 1] - P[s]) + tm[sp + 1, t] + tm[s, sp]
                if v < best or (v == best and vt < best_t):
                    best, best_t, ch[s, t] = v, vt, sp
            mm[s, t], tm[s, t] = best, best_t
    return mm[0, N - 1], ch


def reference_persistent_table(arrays: StageArrays, M: int) -> np.ndarray:
    """The C_MP table by the recurrence as printed (Appendix A.2), in plain
    Python, without pruning: the oracle the jitted table is compared with entry by
    entry (STYLE.md §5), and the baseline of ``bench/remat.py``. O(M N^3) Python
    steps: small chains only. Same layout as :func:`persistent_table`."""
    N = arrays.N
    uf, ub, xin, xo, xb, of, ob, G, Gb, flagged = _as_printed(arrays)
    inf = float("inf")
    C = {}

    def m_all(s, t):
        return max(xo[t] + xb[s] + of[s] + G[t], xb[s] + xo[s] + xin[s] + ob[s] + Gb[s])

    def m_none(s, t):
        terms = [xo[t] + xo[s] + of[s]] + [xo[t] + xin[h] + xo[h] + of[h]
                                           for h in range(s + 1, t)]
        return max(terms) + G[t]

    def get(s, t, m):
        return inf if m < 0 else C[s, t][m]

    for d in range(N):
        for s in range(N - d):
            t = s + d
            ma = m_all(s, t)
            row = []
            for m in range(M + 1):
                if s == t:
                    row.append(uf[s] + ub[s] if m >= ma else inf)
                    continue
                best = inf
                if m >= ma:
                    best = uf[s] + get(s + 1, t, m - xb[s]) + ub[s]
                if m >= m_none(s, t):
                    for sp in range(s, t):
                        if any(flagged[s:sp + 1]):   # F^ck would run a flagged stage twice
                            continue
                        v = sum(uf[s:sp + 1]) + get(sp + 1, t, m - xo[sp]) + get(s, sp, m)
                        best = min(best, v)
                row.append(best)
            C[s, t] = row
    idx = pair_index(N)
    out = np.full((N * (N + 1) // 2, M + 1), inf)
    for (s, t), row in C.items():
        out[idx[s, t]] = row
    return out
