"""The least-memory pass of rotor's persistent DP: :func:`min_memory` (the
least memory at which C(0, n, .) of NOTE [ Persistent DP C_MP ] in
planners/rotor.py is finite, and its choices), :func:`min_memory_schedule` (the
schedule of those choices) and :func:`choices_memory` (the memory a table of
choices needs). planners/rotor.py re-exports them; split from it so that the
time table and this pass each read on their own. The jitted functions here
follow NOTE [ Jitted results and Ctrl-C ] in planners/rotor.py.
"""

from __future__ import annotations

import numba
import numpy as np

from rtmem.errors import ScheduleError

from ._rotor_arrays import (_B, _F_ALL, _F_CK, _F_NONE, StageArrays, _bands,
                            _check_stage_arrays, _emit_leaf, _reconstruct_capacity)
from .schedule import Schedule


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
    the row (as rotor.py's _fill_requirements does) rather than read from two more (N, N)
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
    of ~50 bands of rows, as for rotor.py's :func:`persistent_table`.

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
    Task stack as in rotor.py's :func:`_reconstruct` (kind 0: the interval (s, t); kind 1:
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
