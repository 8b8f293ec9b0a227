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
"""

from __future__ import annotations

import numba
import numpy as np

from rtmem.errors import ChainError, ScheduleError

from .chain import Chain
from .schedule import Op, Schedule

__all__ = ["StageArrays", "stage_arrays", "discretize", "persistent_table",
           "persistent_schedule", "min_memory", "min_memory_schedule", "choices_memory",
           "reference_persistent_table", "reference_min_memory", "pair_index"]

_F_NONE, _F_CK, _F_ALL, _LOSS, _B = (int(Op.F_NONE), int(Op.F_CK), int(Op.F_ALL),
                                     int(Op.LOSS), int(Op.B))
_INF = np.inf


@numba.njit(cache=True)
def _emit_leaf(ops, stages, n_ops, s, last):
    """Write the operations of the one-stage interval (s, s) of the jitted schedule
    walks at position ``n_ops`` of ``ops`` / ``stages``: the loss when ``s`` is
    ``last`` (the loss's DP stage), else F_all s then B s. Returns the new count."""
    if s == last:
        ops[n_ops], stages[n_ops] = _LOSS, 0
        return n_ops + 1
    ops[n_ops], stages[n_ops] = _F_ALL, s
    ops[n_ops + 1], stages[n_ops + 1] = _B, s
    return n_ops + 2


class StageArrays:
    """Per-DP-stage arrays (N = n+1 entries, the loss last), as NOTE
    [ Persistent DP C_MP ] names them.

    Times ``uf``, ``ub`` in seconds (float64); sizes ``xin``, ``xo``, ``xb``,
    ``of``, ``ob``, ``w``, ``G`` in bytes or in slots (int64), depending on
    whether it came from :func:`stage_arrays` or :func:`discretize`.
    ``Gb[k]`` = G[k] + w[k] (weight gradients present while B_k runs).
    ``nr[k]`` (int64): the first stage >= k that must not be recomputed (N: none).
    The DP passes check these (``_check_stage_arrays``: N entries each, integer
    sizes >= 0) before their jitted loops index them, and raise ChainError.
    """

    __slots__ = ("uf", "ub", "xin", "xo", "xb", "of", "ob", "G", "Gb", "nr")

    def __init__(self, uf, ub, xin, xo, xb, of, ob, G, Gb, nr=None):
        self.uf, self.ub = uf, ub
        self.xin, self.xo, self.xb, self.of, self.ob, self.G, self.Gb = \
            xin, xo, xb, of, ob, G, Gb
        # nr[s]: the first DP stage >= s the chain marks no_recompute, N if none
        N = uf.shape[0]
        self.nr = np.full(N, N, np.int64) if nr is None else nr

    @property
    def N(self) -> int:
        return int(self.uf.shape[0])


_TIMES = ("uf", "ub")
_SIZES = ("xin", "xo", "xb", "of", "ob", "G", "Gb")


def _check_stage_arrays(arrays: StageArrays, who: str) -> None:
    """Raise :class:`~rtmem.errors.ChainError` unless ``arrays`` has what the jitted
    passes index blindly: every field a 1-D array of N entries, the times real,
    the sizes and ``nr`` integers, the sizes non-negative (a negative one moves a
    memory index past the table), ``nr`` the first-flagged-stage index
    :func:`stage_arrays` makes. O(N); ``who`` names the caller in the message.
    :func:`stage_arrays` and :func:`discretize` of a valid Chain always pass."""
    N = arrays.N if getattr(arrays.uf, "ndim", 0) == 1 else None
    for name in _TIMES + _SIZES + ("nr",):
        arr = getattr(arrays, name)
        kinds = "f" if name in _TIMES else "iu"
        if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in kinds \
                or (N is not None and arr.shape[0] != N) or N == 0:
            got = (f"{arr.dtype} of shape {arr.shape}" if isinstance(arr, np.ndarray)
                   else type(arr).__name__)
            raise ChainError(
                f"{who}: StageArrays.{name} must be a 1-D {'float' if kinds == 'f' else 'integer'}"
                f" array of N = {N} >= 1 entries (as uf), got {got}; build the arrays with "
                "stage_arrays(chain) or discretize()")
    for name in _SIZES:
        arr = getattr(arrays, name)
        if arr.min() < 0:
            k = int(np.argmax(arr < 0))
            raise ChainError(f"{who}: StageArrays.{name}[{k}] = {int(arr[k])} is negative; "
                             "sizes are bytes or slots, >= 0")
    # nr[k] is the first no_recompute stage at or after k (N if none): k itself or
    # nr[k + 1]. Out of range it cannot index past anything (the passes only take
    # min(t, nr[s])), but it silently hides the flag, and a flagged stage would be
    # planned to run twice.
    nr, ks = arrays.nr, np.arange(arrays.N)
    ok = (nr == ks) | (nr == np.append(nr[1:], arrays.N))
    ok[-1] = nr[-1] == arrays.N        # the loss (stage N - 1) is never flagged
    if not ok.all():
        k = int(np.argmin(ok))
        raise ChainError(f"{who}: StageArrays.nr[{k}] = {int(nr[k])} is not the first "
                         f"no_recompute stage at or after {k} (it must be {k} or nr[{k + 1}], "
                         f"and nr[{arrays.N - 1}] = N = {arrays.N}); build the arrays with "
                         "stage_arrays(chain) or discretize()")


def stage_arrays(chain: Chain) -> StageArrays:
    """Byte-level DP arrays of ``chain`` (loss appended as DP stage n)."""
    i64 = np.int64
    uf = np.append(chain.u_f, chain.u_loss).astype(np.float64)
    ub = np.append(chain.u_b, 0.0).astype(np.float64)
    xo = np.append(chain.x, 0).astype(i64)
    xb = np.append(chain.xbar, 0).astype(i64)
    xin = np.concatenate(([chain.x0], chain.x)).astype(i64)
    of = np.append(chain.o_f, 0).astype(i64)
    ob = np.append(chain.o_b, chain.o_loss).astype(i64)
    w = np.append(chain.w, 0).astype(i64)
    suffix = np.concatenate((np.cumsum(w[::-1])[::-1], [0])).astype(i64)
    G = suffix[1:]                     # sum_{j > k} w[j]
    Gb = suffix[:-1]                   # sum_{j >= k} w[j]
    N = uf.shape[0]
    nr = np.full(N, N, i64)
    for k in range(N - 2, -1, -1):     # the loss (N - 1) is never flagged
        nr[k] = k if chain.no_recompute[k] else nr[k + 1]
    return StageArrays(uf, ub, xin, xo, xb, of, ob, G, Gb, nr)


def discretize(arrays: StageArrays, slot: int) -> StageArrays:
    """Every size rounded up to whole slots of ``slot`` bytes (thesis §3.7)."""
    slot = int(slot)

    def up(v):
        return -(-v // slot)
    return StageArrays(arrays.uf, arrays.ub, up(arrays.xin), up(arrays.xo), up(arrays.xb),
                       up(arrays.of), up(arrays.ob), up(arrays.G), up(arrays.Gb), arrays.nr)


def pair_index(N: int) -> np.ndarray:
    """``idx[s, t]`` = row of pair (s, t), s <= t, in a persistent table (-1 if s > t)."""
    # column-major: the rows (s', t) for one t are adjacent, so the fill's reads of
    # the tails C(s'+1, t, .) for s' = s..t-1 stream through memory
    idx = np.full((N, N), -1, np.int64)
    k = 0
    for t in range(N):
        for s in range(t + 1):
            idx[s, t] = k
            k += 1
    return idx


def _requirements(xin, xo, xb, of, ob, G, Gb):
    """m_all(s, t) and m_none(s, t) of NOTE [ Persistent DP C_MP ] (same units as sizes),
    as two (N, N) int64 arrays."""
    N = xo.shape[0]
    mall = np.zeros((N, N), np.int64)
    mnone = np.zeros((N, N), np.int64)
    _fill_requirements(xin, xo, xb, of, ob, G, Gb, mall, mnone)
    return mall, mnone


# NOTE [ Jitted results and Ctrl-C ]
# The jitted functions here fill arrays their Python caller allocated and return
# nothing or a number, never a tuple of arrays. numba boxes a returned array by
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


def _reconstruct_capacity(N: int) -> int:
    """Most operations :func:`_reconstruct` writes for N DP stages."""
    return N * (N + 1) // 2 + 2 * N + 2


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


def _bands(N: int):
    """Bands ``(s_hi, s_lo, fraction done after it)`` of rows s, descending, of
    about equal work (row s of an O(N^3) fill costs ~ (N - s)^2): ~50 of them, for
    progress reports between jitted calls."""
    total = float(N) ** 3 / 3
    done, s_hi, band = 0.0, N - 1, total / 50
    while s_hi >= 0:
        s_lo, work = s_hi, 0.0
        while s_lo > 0 and work < band:
            work += float(N - s_lo) ** 2
            s_lo -= 1
        done += sum(float(N - s) ** 2 for s in range(s_lo, s_hi + 1))
        yield s_hi, s_lo, min(1.0, done / total)
        s_hi = s_lo - 1


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


# --------------------------------------------------------------- minimum memory
@numba.njit(cache=True)
def _min_memory_table(uf, ub, xin, xo, xb, of, ob, G, Gb, nr, mmT, tmT, ch, timed, s_hi,
                      s_lo):
    """Fill rows s_hi down to s_lo (rows of larger s must be done) of the least
    memory (same units as the sizes) at which C(s, t, .) is finite, ``mmT``; with
    ``timed``, also of the time (seconds) of the schedule reaching it, ``tmT``, and
    of its first choice ``ch[s, t]`` ((N, N), -1: F^all, s' >= s: F^ck keeping
    a_{s'+1}). ``mmT`` and ``tmT`` hold the lower triangle of the transposed
    tables, row t after row t-1: entry (t, s), s <= t, at t (t + 1) / 2 + s.
    Without ``timed`` only ``mmT`` is filled (``tmT`` and ``ch`` are not read).

    Among the choices reaching the least memory the fastest is kept: ``tm[s, t]``
    (seconds) is the time of the schedule the choices describe, so ties are not
    left to the loop order. That schedule is what plan_remat falls back to near
    the least budget, where an arbitrary tie once cost 34 % (51 s against 38 s on
    the chain of tests/test_remat_rotor.py::test_least_budget_matches_brute_force).
    It is the fastest least-memory schedule only greedily: a sub-problem is solved
    at its own least memory, not with all the memory its parent has. Ties do not
    change the least memory, so the untimed pass gives the same ``mm``.

    Cost: (N^3) / 6 steps of the inner loop over s'. It reads the tails
    mm[s'+1, t] and tm[s'+1, t] for s' = s..t-1, a column of a row-major table:
    with mm and tm stored by row each read was a cache miss (60 ns a step, 10 s
    on 1,000 stages, ~50 min estimated on 5,000). Both are kept transposed, so the
    tails are contiguous, and the heads mm[s, s'], tm[s, s'] of the row being
    filled sit in two row buffers. m_all(s, t) and m_none(s, t) are computed along
    the row (as _fill_requirements does) rather than read from two more (N, N)
    tables: together with the triangles that is 4x less memory than five full
    (N, N) 8-byte tables (10x without ``timed``).
    """
    N = xo.shape[0]
    P = np.zeros(N + 1)
    for k in range(N):
        P[k + 1] = P[k] + uf[k]
    head = np.zeros(N, np.int64)         # mm[s, .] of the row s being filled
    head_t = np.zeros(N)                 # tm[s, .]
    for s in range(s_hi, s_lo - 1, -1):
        back = xb[s] + xo[s] + xin[s] + ob[s] + Gb[s]
        inner = xo[s] + of[s]            # running max over h in s..t-1 of m_none
        head[s] = max(xo[s] + xb[s] + of[s] + G[s], back)          # m_all(s, s)
        head_t[s] = uf[s] + ub[s]
        diag = s * (s + 1) // 2 + s
        mmT[diag] = head[s]
        if timed:
            tmT[diag] = head_t[s]
        for t in range(s + 1, N):
            row = t * (t + 1) // 2
            mcol = mmT[row:row + t + 1]  # mm[., t]
            if t - 1 > s:
                h = t - 1
                inner = max(inner, xin[h] + xo[h] + of[h])
            mall = max(xo[t] + xb[s] + of[s] + G[t], back)
            mn = xo[t] + G[t] + inner
            best = max(mall, xb[s] + mcol[s + 1])
            if timed:
                tcol = tmT[row:row + t + 1]      # tm[., t]
                best_t = uf[s] + tcol[s + 1] + ub[s]
                arg = -1
                # every F^ck candidate needs at least m_none: when F^all needs less,
                # none of them can reach (or tie) its memory
                for sp in range(s, min(t, nr[s]) if mn <= best else s):
                    v = max(mn, max(xo[sp] + mcol[sp + 1], head[sp]))
                    if v > best:
                        continue
                    vt = (P[sp + 1] - P[s]) + tcol[sp + 1] + head_t[sp]
                    if v < best or vt < best_t:
                        best, best_t, arg = v, vt, sp
                head_t[t] = best_t
                tmT[row + s] = best_t
                ch[s, t] = arg
            else:
                for sp in range(s, min(t, nr[s]) if mn <= best else s):
                    v = max(mn, max(xo[sp] + mcol[sp + 1], head[sp]))
                    if v < best:
                        best = v
            head[t] = best
            mmT[row + s] = best


def _choice_dtype(N: int):
    """Narrowest signed integer dtype holding the choices -1..N-1."""
    return np.int16 if N <= np.iinfo(np.int16).max else np.int32


def min_memory(arrays: StageArrays, progress=None, choices: bool = True):
    """Least memory for which a persistent schedule exists, in the units of
    ``arrays`` (bytes from :func:`stage_arrays`): activations, temporaries and
    weight gradients (through G), not a_0 nor the weights themselves. Returns
    ``(mm[0, n], choice_table)`` for :func:`min_memory_schedule`, whose schedule
    is the fastest of the least-memory choices (see ``_min_memory_table``);
    ``choice_table[s, t]`` is -1 (F^all) or s' (F^ck keeping a_{s'+1}), an
    (N, N) int16 array (int32 above 32,766 stages). With ``choices=False`` the
    choices are not kept (``choice_table`` is None) and no time is tracked: the
    least memory alone, in less memory.

    ``progress``: optional callable receiving the fraction done (0..1) after each
    of ~50 bands of rows, as for :func:`persistent_table`.

    O(N^3) time (N = n + 1 DP stages, ~N^3 / 6 steps). Memory: two triangles of
    N (N + 1) / 2 8-byte entries and the (N, N) choices, ~10 N^2 bytes (4 N^2
    with ``choices=False``; five full (N, N) 8-byte tables, 40 N^2 bytes, before).
    Measured (CPU time, one core of a loaded 2-core machine): 1.1 s for 1,000
    stages (4.2 s before its tables were transposed); growing as n^3, ~30 s for
    3,000 and ~2.5 min (and 250 MB) for 5,000."""
    a = arrays
    _check_stage_arrays(a, "min_memory")
    N = a.N
    mmT = np.zeros(N * (N + 1) // 2, np.int64)
    if choices:
        tmT = np.zeros(N * (N + 1) // 2)
        ch = np.full((N, N), -1, _choice_dtype(N))
    else:
        tmT, ch = np.zeros(1), np.zeros((1, 1), np.int16)
    for s_hi, s_lo, done in _bands(N) if progress is not None else [(N - 1, 0, 1.0)]:
        _min_memory_table(a.uf, a.ub, a.xin, a.xo, a.xb, a.of, a.ob, a.G, a.Gb, a.nr,
                          mmT, tmT, ch, choices, s_hi, s_lo)
        if progress is not None:
            progress(done)
    return int(mmT[(N - 1) * N // 2]), (ch if choices else None)


def min_memory_schedule(arrays: StageArrays, choice) -> Schedule:
    """The schedule that needs the least memory (from :func:`min_memory`'s choices).

    Contract: ``choice`` must be what :func:`min_memory` returned for these
    ``arrays`` (or for the same chain in other units). The walk reads only the
    choices, ``N`` and the no_recompute stages (``arrays.nr``): any table of
    choices -1 or s <= s' < t describes a valid persistent schedule of every
    chain of N - 1 stages, so a table made for another chain of the same length
    gives a schedule of this one that is not its least-memory schedule, and
    this cannot tell (that would take min_memory's O(N^3) pass; compare
    :func:`choices_memory` ``(arrays, choice)`` with ``min_memory(arrays)[0]``
    to check). Raises :class:`~rtmem.errors.ScheduleError` (reason
    ``"bad-choice-table"``) for a table of another shape, an entry it reads
    outside -1 and ``[s, t)``, or an F^ck that would run a stage these arrays
    mark no_recompute twice (a table made for a chain without that flag).

    Walked in jitted code writing the operation arrays, as :func:`persistent_schedule`
    is: near the least budget the schedule has up to ~n^2/2 operations (a
    homogeneous chain: 321,201 for 800 stages), and building them as Python tuples
    was half of plan_remat's time there (1.3 s of 2.5 on 800 stages; 9.9 s on
    3,000, 0.57 s jitted)."""
    _check_stage_arrays(arrays, "min_memory_schedule")
    N = arrays.N
    table = _choice_table(N, choice, "min_memory_schedule")
    cap = _reconstruct_capacity(N)
    op, stage = np.empty(cap, np.int64), np.empty(cap, np.int64)
    count = _min_memory_ops(table, N, arrays.nr, op, stage)
    if count < 0:
        # the jitted walk writes without bounds checks of its own; an entry out of
        # range would make it loop or write past its arrays, so it stops there
        raise _bad_choice("min_memory_schedule", table, *divmod(-1 - count, N), arrays.nr)
    return Schedule(op[:count], stage[:count])


def _choice_table(N: int, choice, who: str) -> np.ndarray:
    """``choice`` as an array, or :class:`~rtmem.errors.ScheduleError` (reason
    ``"bad-choice-table"``) unless it is an (N, N) integer table as :func:`min_memory`
    returns; ``who`` names the caller. Its entries are checked where the walks read
    them (:func:`_bad_choice`)."""
    table = np.asarray(choice)
    if table.shape != (N, N) or table.dtype.kind not in "iu":
        raise ScheduleError(
            f"{who}: choice must be the ({N}, {N}) integer table min_memory returns for "
            f"these arrays, got {table.dtype} of shape {table.shape}",
            reason="bad-choice-table")
    return table


def _bad_choice(who: str, table, s: int, t: int, nr) -> ScheduleError:
    """The error for an entry ``table[s, t]`` outside -1 and ``[s, min(t, nr[s]))``:
    walking it would loop (s' < s, or s' = t splits (s, t) into itself), index past
    the table, or run a stage ``nr`` flags no_recompute twice (F^ck at s reruns
    s..s' later)."""
    sp = int(table[s, t])
    if s <= sp < t:
        return ScheduleError(
            f"{who}: choice[{s}, {t}] = {sp} runs stage {int(nr[s])} twice, which these "
            f"arrays mark no_recompute (F^ck {s} keeping a_{sp + 1} runs stages {s}..{sp} "
            "again later): the table was made for another chain; pass the one "
            "min_memory returned for these arrays", reason="bad-choice-table")
    return ScheduleError(
        f"{who}: choice[{s}, {t}] = {table[s, t]} is not a choice min_memory makes (-1, or "
        f"s' with {s} <= s' < {t}); pass the table min_memory returned for these arrays",
        reason="bad-choice-table")


@numba.njit(cache=True)
def _min_memory_ops(choice, N, nr, ops, stages):
    """Write :func:`min_memory_schedule`'s operations and stages to ``ops`` and
    ``stages`` (int64, :func:`_reconstruct_capacity` long) and return their number.
    Task stack as in :func:`_reconstruct` (kind 0: the interval (s, t); kind 1:
    emit B s); the later-pushed task is run first. Returns ``-1 - (s N + t)`` for
    the first entry ``choice[s, t]`` it meets that is neither -1 nor in ``[s, t)``
    (each interval then splits into strictly smaller ones, so the walk ends and its
    stack and op counts stay within their bounds), or in ``[nr[s], t)`` (an F^ck
    that would run a stage flagged no_recompute twice)."""
    kind = np.empty(4 * N + 4, np.int64)
    ts = np.empty(4 * N + 4, np.int64)
    tt = np.empty(4 * N + 4, np.int64)
    kind[0], ts[0], tt[0] = 0, 0, N - 1
    top, n_ops = 1, 0
    while top > 0:
        top -= 1
        k, s, t = kind[top], ts[top], tt[top]
        if k == 1:
            ops[n_ops], stages[n_ops] = _B, s
            n_ops += 1
        elif s == t:
            n_ops = _emit_leaf(ops, stages, n_ops, s, N - 1)
        elif choice[s, t] == -1:
            ops[n_ops], stages[n_ops] = _F_ALL, s
            n_ops += 1
            kind[top], ts[top] = 1, s
            kind[top + 1], ts[top + 1], tt[top + 1] = 0, s + 1, t
            top += 2
        else:
            sp = np.int64(choice[s, t])
            if sp < s or sp >= t or sp >= nr[s]:
                return -1 - (s * N + t)
            ops[n_ops], stages[n_ops] = _F_CK, s
            n_ops += 1
            for h in range(s + 1, sp + 1):
                ops[n_ops], stages[n_ops] = _F_NONE, h
                n_ops += 1
            kind[top], ts[top], tt[top] = 0, s, sp
            kind[top + 1], ts[top + 1], tt[top + 1] = 0, sp + 1, t
            top += 2
    return n_ops


def choices_memory(arrays: StageArrays, choice) -> int:
    """Memory (in the units of ``arrays``) that the schedule of ``choice`` (as
    :func:`min_memory` returns it, possibly computed on other units) needs by the
    recurrence of ``_min_memory_table``: at a node (s, t), F^all needs
    max(m_all(s, t), xb[s] + its tail's), F^ck keeping a_{s'+1}
    max(m_none(s, t), xo[s'] + its tail's, its head's). So :func:`min_memory`
    of ``arrays`` is at most this, and equal to it for its own choices.

    Raises :class:`~rtmem.errors.ScheduleError` (reason ``"bad-choice-table"``),
    as :func:`min_memory_schedule` does, for a table of another shape or an entry
    it reads that min_memory never makes for these arrays (outside -1 and
    ``[s, t)``, or an F^ck rerunning a stage they mark no_recompute).

    The tree has fewer than 2 N nodes; each takes an O(t - s) numpy max."""
    a = arrays
    _check_stage_arrays(a, "choices_memory")
    N = a.N
    choice = _choice_table(N, choice, "choices_memory")
    inner = a.xin + a.xo + a.of          # m_none's terms for s < h < t
    order, stack = [], [(0, N - 1)]
    while stack:                         # preorder: children after their parent
        s, t = stack.pop()
        order.append((s, t))
        if s < t:
            sp = int(choice[s, t])
            if sp != -1 and not s <= sp < min(t, a.nr[s]):
                raise _bad_choice("choices_memory", choice, s, t, a.nr)
            stack += [(s + 1, t)] if sp == -1 else [(s, sp), (sp + 1, t)]
    mem = {}
    for s, t in reversed(order):
        m_all = max(int(a.xo[t] + a.xb[s] + a.of[s] + a.G[t]),
                    int(a.xb[s] + a.xo[s] + a.xin[s] + a.ob[s] + a.Gb[s]))
        if s == t:
            mem[s, t] = m_all
            continue
        sp = int(choice[s, t])
        if sp == -1:
            mem[s, t] = max(m_all, int(a.xb[s]) + mem[s + 1, t])
            continue
        top = int(a.xo[s] + a.of[s])
        if t - s > 1:
            top = max(top, int(inner[s + 1:t].max()))
        m_none = int(a.xo[t] + a.G[t]) + top
        mem[s, t] = max(m_none, int(a.xo[sp]) + mem[sp + 1, t], mem[s, sp])
    return mem[0, N - 1]


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
