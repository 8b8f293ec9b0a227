"""Revolve: optimal checkpointing of homogeneous adjoint chains (Griewank-Walther).

NOTE [ Revolve DP Opt_0 ]
thesis-remat.md §2.3 (Theorem 1). Unit-size values, m memory slots, in-place
forwards (Table 1.1). Opt_0(l, m) is the least time of ADJCHAIN(l, m): start from
a_0 and delta_{l+1}, end with delta_0 (steps F_1..F_l, B_1..B_{l+1}):

    Opt_0(0, m) = u_B                                       m >= 2
    Opt_0(l, m) = min_{1 <= i <= l} i u_F + Opt_0(l-i, m-1) + Opt_0(i-1, m)
                                                            l >= 1, m >= 3
    Opt_0(l, m) = inf                                       l >= 1, m < 3

The range is 1 <= i <= l (erratum 2 of thesis-remat.md: with i < l,
Opt_0(1, m) would be a min over nothing). The printed base case
Opt_0(l, 3) = l(l+1)/2 u_F + (l+1) u_B is not special-cased: the recurrence
yields it (only i = l keeps Opt_0(l-i, 2) finite), and a test checks that. The
closed form (Griewank-Walther binomial, §2.3) is
Opt_0(l, m) = t(l+1, m-2) u_F + (l+1) u_B with t(l, s) = r l - C(s+r, s+1), r the
least integer with C(s+r, s) >= l, t = 0 for l <= 1.

SINGLE(L, m) (a chain with its loss) = Opt_0(L-1, m) + u_F + u_L.

The schedules use the Chapter 1 vocabulary of :mod:`rtmem.planners.multichain`
(``MultiOp``), and :func:`revolve_schedule` converts them to the Table 2.1 model
(thesis §4, "revolve" baseline): Revolve's F from a duplicated value becomes
F_ck, other F become F_none, each B_k becomes F_all then B (abar is never
stored), and B_{n+1} is the loss. :func:`plan_revolve` picks the slot count whose
converted schedule is fastest within a byte budget.
"""

from __future__ import annotations

import math
from math import comb

import numba
import numpy as np

from rtmem.errors import ChainError, InfeasibleError, RtmemError, ScheduleError

from .baselines import fastest_fitting
from ._validation import (as_scalar, check_chain, check_int, check_time_bound,
                          refuse_no_recompute)
from .chain import Chain
from .plan import Plan
from .rotor import _emit_leaf
from .schedule import Op, Schedule

_F_NONE, _F_CK = int(Op.F_NONE), int(Op.F_CK)

__all__ = ["opt0_table", "revolve_argmins", "binomial_makespan", "revolve_ops", "single_chain_ops",
           "revolve_schedule", "plan_revolve", "max_revolve_stages"]


@numba.njit(cache=True)
def _opt0(u_f, u_b, T, arg):
    """Fill ``T`` ((l_max+1, m_max+1) float64, inf) and ``arg`` (same shape, int64,
    zeros) for :func:`opt0_table`. They come from the caller, not returned: a tuple
    of arrays returned by numba turned a Ctrl-C into a SystemError or a segfault
    (NOTE [ Jitted results and Ctrl-C ] in rotor.py)."""
    l_max, m_max = T.shape[0] - 1, T.shape[1] - 1
    for m in range(2, m_max + 1):
        T[0, m] = u_b
    for m in range(3, m_max + 1):
        for l in range(1, l_max + 1):
            if m > l + 2:
                # l + 2 slots already store every value: each candidate i has the
                # same value with m slots as with l + 2 (by induction on l), so the
                # entry is a copy, bit for bit, not a search (a third of the fill)
                T[l, m], arg[l, m] = T[l, l + 2], arg[l, l + 2]
                continue
            best = np.inf
            bi = 0
            for i in range(1, l + 1):
                v = i * u_f + T[l - i, m - 1] + T[i - 1, m]
                if v < best:
                    best = v
                    bi = i
            T[l, m] = best
            arg[l, m] = bi


@numba.njit(cache=True)
def _opt0_argmins(F, arg):
    """Fill ``F`` ((l_max+1, m_max+1) int64, zeros) with the forward steps of
    Opt_0(l, m) (-1 when infeasible) and ``arg`` (same shape, int64, zeros) with
    the least optimal first checkpoint i: the argmins :func:`_opt0` finds with
    u_F = u_B = 1, in O(l_max m_max log l_max) steps instead of O(l_max^2 m_max).

    Why it may bisect: with u_B counted apart (every candidate i runs l + 1
    backwards), candidate i costs g(i) = i + F[l-i, m-1] + F[i-1, m]. F(., m) is
    convex for m >= 3 (the binomial form t(l+1, m-2) of NOTE [ Revolve DP Opt_0 ]
    is piecewise linear with non-decreasing slopes r), so g is convex in i, its
    differences are non-decreasing, and the least argmin is the least i with
    g(i+1) - g(i) >= 0 (or l). Integers throughout: the same ties as _opt0's
    float64 sums, which are exact for u_F = u_B = 1 below 2^53."""
    l_max, m_max = F.shape[0] - 1, F.shape[1] - 1
    # k is the NOTE's l (renamed for the linter's E741)
    for m in range(0, min(m_max, 2) + 1):
        for k in range(1, l_max + 1):
            F[k, m] = -1
    if m_max < 2:
        F[0, :] = -1
        return
    F[0, 0] = F[0, 1] = -1
    for m in range(3, m_max + 1):
        for k in range(1, l_max + 1):
            if m > k + 2:
                F[k, m], arg[k, m] = F[k, k + 2], arg[k, k + 2]
                continue
            if m == 3:
                # only i = k leaves Opt_0(k - i, 2) finite
                F[k, m], arg[k, m] = k + F[k - 1, m], k
                continue
            lo, hi = 1, k                 # least argmin in [lo, hi]
            while lo < hi:
                i = (lo + hi) // 2
                step = 1 + F[k - i - 1, m - 1] - F[k - i, m - 1] + F[i, m] - F[i - 1, m]
                if step >= 0:
                    hi = i
                else:
                    lo = i + 1
            F[k, m] = lo + F[k - lo, m - 1] + F[lo - 1, m]
            arg[k, m] = lo


def revolve_argmins(l_max: int, m_max: int) -> np.ndarray:
    """The argmin table of :func:`opt0_table` (``opt0_table(l_max, m_max)[1]``,
    equal entry by entry) from an O(l_max m_max log l_max) fill instead of
    O(l_max^2 m_max): what :func:`plan_revolve` and :func:`revolve_schedule`
    walk. 16 (l_max + 1) (m_max + 1) bytes while it runs, 8 (...) returned."""
    l_max, m_max = _check_lm(l_max, m_max, "revolve_argmins:")
    table_bytes = _argmin_cost(l_max, m_max)[0]
    if table_bytes > MAX_OPT0_TABLE_BYTES:
        raise RtmemError(
            f"the Revolve argmin table for l <= {l_max} and m <= {m_max} slots needs "
            f"{table_bytes:,} bytes while it fills (limit {MAX_OPT0_TABLE_BYTES:,}); use "
            "fewer slots (beyond l + 2 they never help) or plan_remat")
    F = np.zeros((l_max + 1, m_max + 1), np.int64)
    arg = np.zeros((l_max + 1, m_max + 1), np.int64)
    _opt0_argmins(F, arg)
    return arg


#: Largest Opt_0 tables (T and arg, bytes) opt0_table allocates, and most bytes
#: plan_revolve takes (its argmin table and longest schedule, _plan_revolve_cost).
MAX_OPT0_TABLE_BYTES = 2 * 2**30
#: Most inner steps of the Opt_0 fill, about (l_max + 1)^2 (m_max + 1) / 2:
#: ~1 ns each, so ~10 s (opt0_table for 2,700 stages); and of plan_revolve, in
#: steps of the same ~1 ns (_plan_revolve_cost: 4,410 stages).
MAX_OPT0_STEPS = 10**10


def _check_slots(m, name: str = "m", field: str | None = None) -> int:
    """A slot count m (>= 0) as a Python int; ``field`` defaults to ``name``."""
    return check_int(name, m, error=ChainError, field=field or name,
                     hint="m counts memory slots, each holding one value")


def _check_lm(steps, slots, what: str) -> tuple[int, int]:
    """Steps l (>= 0) and slots m (>= 0) as Python ints (3.5 slots is refused: it
    used to raise IndexError deep in the reconstruction)."""
    return (check_int(f"{what} l", steps, error=ChainError, field="l"),
            _check_slots(slots, f"{what} m", field="m"))


def _check_times(steps: int, backward: int, **times) -> tuple[float, ...]:
    """Step times (``u_f``, ``u_b``, ``u_loss``) as floats, each finite and >= 0; a
    :class:`~rtmem.errors.ChainError` names the bad one. A negative time gave
    negative makespans (and a DP favouring recomputation), a NaN one ``inf``
    (reported as infeasible, "needs at least 5 slots, got 7").

    ``steps`` forward steps (each ``u_f``) and ``backward`` backward steps (each
    ``u_b``) must also pass the bound :class:`~rtmem.planners.Chain` checks
    (:func:`~rtmem.planners._validation.check_time_bound`): finite but huge times
    (u_f = 1e307 on 30 steps) overflowed the DPs to ``inf``, reported as
    infeasible as well."""
    values = {name: as_scalar(name, value, integral=False) for name, value in times.items()}
    u_f, u_b, u_loss = values["u_f"], values.get("u_b", 0.0), values.get("u_loss", 0.0)
    loss = f", u_loss = {u_loss:.3g}" if "u_loss" in values else ""
    check_time_bound(steps, steps * u_f, backward * u_b, u_loss, what="the step times",
                     formula=f"(l + 1) * l * u_f + {backward} * u_b"
                             + (" + u_loss" if loss else "") + f" for l = {steps} forward steps",
                     values=f"u_f = {u_f:.3g}, u_b = {u_b:.3g}{loss}")
    return tuple(values.values())


def _opt0_cost(l_max: int, m_max: int) -> tuple[int, int]:
    """Bytes of :func:`opt0_table`'s two tables and the steps of its fill."""
    return 16 * (l_max + 1) * (m_max + 1), (l_max + 1) ** 2 * (m_max + 1) // 2


def _table_fits(l_max: int, m_max: int) -> bool:
    """Whether :func:`opt0_table` builds the tables for ``l_max``, ``m_max``."""
    table_bytes, steps = _opt0_cost(l_max, m_max)
    return table_bytes <= MAX_OPT0_TABLE_BYTES and steps <= MAX_OPT0_STEPS


def _argmin_cost(l_max: int, m_max: int) -> tuple[int, int]:
    """Bytes of :func:`revolve_argmins`'s two tables while it fills, and the steps
    of its fill: one bisection (at most bit_length(l_max) + 1 probes) per entry."""
    return 16 * (l_max + 1) * (m_max + 1), \
        (l_max + 1) * (m_max + 1) * (int(l_max).bit_length() + 1)


# plan_revolve on n stages with no slot count fitting (every schedule built and
# simulated; CPU time on one core of a loaded 2-core machine, median of 1): 0.48 s
# and 230 MB peak RSS for 1,200 stages, 3.6 s and 480 MB for 2,700, 6.5 s and
# 810 MB for 4,000, 8.9 s and 1,030 MB for 4,600 (the model below: 10.9 s of
# steps, 1,190 MB). ~0.4-0.5 us x n^2 besides the argmins: n schedules, each with
# O(n) work, and the longest (m = 3) with n (n + 1) / 2 operations at ~80 bytes
# each while simulated. In the ~1 ns steps of MAX_OPT0_STEPS:
_SCHEDULE_STEPS_PER_STAGE2 = 500
_SCHEDULE_BYTES_PER_OP = 80


def _plan_revolve_cost(n: int) -> tuple[int, int]:
    """Bytes and ~1 ns steps :func:`plan_revolve` takes on ``n`` stages at most (a
    budget no slot count fits): the argmin table for l <= n, m <= n + 2 and the
    n schedules, the longest with n (n + 1) / 2 forward steps."""
    table_bytes, steps = _argmin_cost(n, n + 2)
    return (table_bytes + _SCHEDULE_BYTES_PER_OP * n * (n + 1) // 2,
            steps + _SCHEDULE_STEPS_PER_STAGE2 * n * n)


def _plan_revolve_fits(n: int) -> bool:
    """Whether :func:`plan_revolve` plans a chain of ``n`` stages."""
    plan_bytes, steps = _plan_revolve_cost(n)
    return plan_bytes <= MAX_OPT0_TABLE_BYTES and steps <= MAX_OPT0_STEPS


def max_revolve_stages() -> int:
    """Longest chain (stages) :func:`plan_revolve` plans: the most ``n`` whose
    argmin table (:func:`revolve_argmins`, l <= n, m <= n + 2 slots) and
    schedules stay within ``MAX_OPT0_TABLE_BYTES`` and ``MAX_OPT0_STEPS``
    (~10 s; 4,410 with the defaults: the cost grows as n^2 log n). It used to be
    the limit of the O(n^3) Opt_0 fill (2,712), which plan_revolve no longer
    runs: it needs the argmins only."""
    lo, hi = 0, 1                 # _plan_revolve_fits(lo) holds, (hi) does not
    while _plan_revolve_fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _plan_revolve_fits(mid) else (lo, mid)
    return lo


def opt0_table(l_max: int, m_max: int, u_f: float = 1.0, u_b: float = 1.0):
    """Opt_0(l, m) for l = 0..l_max, m = 0..m_max (NOTE [ Revolve DP Opt_0 ]).

    Returns ``(T, arg)``: ``T[l, m]`` in the units of ``u_f``/``u_b`` (seconds or
    step counts; ``inf`` when infeasible) and ``arg[l, m]`` the optimal first
    checkpoint position i. Raises :class:`~rtmem.errors.RtmemError` when the
    tables or the fill would exceed ``MAX_OPT0_TABLE_BYTES`` / ``MAX_OPT0_STEPS``
    (use :func:`binomial_makespan` for makespans of long chains), and
    :class:`~rtmem.errors.ChainError` for a negative or non-finite time, or times
    so large that a makespan could overflow a float64 (the bound
    :class:`~rtmem.planners.Chain` checks)."""
    l_max, m_max = _check_lm(l_max, m_max, "opt0_table:")
    u_f, u_b = _check_times(l_max, l_max + 1, u_f=u_f, u_b=u_b)
    if not _table_fits(l_max, m_max):
        table_bytes, steps = _opt0_cost(l_max, m_max)
        raise RtmemError(
            f"the Revolve table for l <= {l_max} and m <= {m_max} slots needs "
            f"{table_bytes:,} bytes and about {steps:.2g} steps (limits "
            f"{MAX_OPT0_TABLE_BYTES:,} bytes, {MAX_OPT0_STEPS:.0e} steps); use "
            "binomial_makespan for the makespan, fewer slots (beyond l + 2 they never "
            "help) or plan_remat")
    T = np.full((l_max + 1, m_max + 1), np.inf)
    arg = np.zeros((l_max + 1, m_max + 1), np.int64)
    _opt0(float(u_f), float(u_b), T, arg)
    return T, arg


def binomial_makespan(l: int, m: int, u_f: float = 1.0, u_b: float = 1.0) -> float:
    """Griewank-Walther closed form of Opt_0(l, m) (thesis §2.3, property 15).

    ``m`` is a number of slots; the makespan is in the units of ``u_f``/``u_b``
    (seconds, or step counts with the defaults); ``inf`` when infeasible. Times
    are checked as by :func:`opt0_table` (:class:`~rtmem.errors.ChainError`)."""
    _check_lm(l, m, "binomial_makespan:")       # ints (numpy ones included) pass as is
    u_f, u_b = _check_times(int(l), int(l) + 1, u_f=u_f, u_b=u_b)
    if l > 0 and m < 3:
        return math.inf
    if l == 0:
        return u_b if m >= 2 else math.inf
    s, steps = m - 2, l + 1
    t = 0
    if steps > 1:
        r = _least_repetitions(s, steps)
        t = r * steps - comb(s + r, s + 1)
    return t * u_f + steps * u_b


def _least_repetitions(s: int, steps: int) -> int:
    """Least r with C(s + r, s) >= ``steps`` (s >= 1 snapshots, steps >= 2).

    C(s + r, s) grows with r, so r is doubled until it is reached, then bisected:
    O(log steps) binomials. Counting r up one at a time took r + 1 of them, and r
    is steps - 1 for s = 1: binomial_makespan(10**7, 3) took 21 s and
    binomial_makespan(10**12, 4) did not return, on the long chains opt0_table
    sends here."""
    lo, hi = 0, 1                        # C(s + 0, s) = 1 < steps
    while comb(s + hi, s) < steps:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:                   # C(s + lo, s) < steps <= C(s + hi, s)
        mid = (lo + hi) // 2
        if comb(s + mid, s) >= steps:
            hi = mid
        else:
            lo = mid
    return hi


def _argmin_table(steps, m, what: str, arg):
    """Check ``steps`` (l), ``m`` (``what`` prefixes the messages) and ``arg`` for
    :func:`revolve_ops`, and return an argmin table covering them (``arg``, or
    a new one when it is None or too small). Raises ``InfeasibleError`` when
    m < 3 (l >= 1) or m < 2."""
    _check_lm(steps, m, what)                   # ints (numpy ones included) pass as is
    if m < (3 if steps > 0 else 2):
        raise InfeasibleError(f"ADJCHAIN({steps}, {m}) needs at least {3 if steps else 2} slots",
                              budget=m, min_feasible=3 if steps else 2)
    if arg is not None and getattr(arg, "ndim", None) != 2:
        # a bare AttributeError ("'str' object has no attribute 'shape'") from below
        raise TypeError(f"arg must be an argmin table (a 2-d array, opt0_table(l, m)[1]) "
                        f"or None, got {type(arg).__name__}")
    if arg is None or arg.shape[0] <= steps or arg.shape[1] <= m:
        arg = revolve_argmins(steps, m)
    return arg


def revolve_ops(l: int, m: int, *, branch: int = 0, offset: int = 0, arg=None) -> list:
    """Optimal ADJCHAIN(l, m) schedule as Chapter 1 operations (``MultiOp``).

    Values are a_offset..a_{offset+l} of ``branch``; it starts with a_offset and
    delta_{offset+l+1} stored, ends with delta_offset. ``arg`` is an argmin table
    of :func:`opt0_table` (computed if not given). Raises ``InfeasibleError`` when
    m < 3 (l >= 1) or m < 2, and :class:`~rtmem.errors.ScheduleError` (reason
    ``"bad-argmin-table"``) for an ``arg`` entry no argmin table holds."""
    from .multichain import MultiOp

    arg = _argmin_table(l, m, "revolve_ops:", arg)
    ops = []
    stack = [(offset, offset + l, m)]
    while stack:
        lo, hi, mm = stack.pop()
        if lo == hi:
            ops.append(MultiOp("B", branch, lo + 1))
            continue
        i = int(arg[hi - lo, mm])
        if mm < 3 or not 1 <= i <= hi - lo:
            _bad_argmin(arg, hi - lo, mm)
        ops.append(MultiOp("S", branch, lo))
        ops += [MultiOp("F", branch, k) for k in range(lo + 1, lo + i + 1)]
        stack += [(lo, lo + i - 1, mm), (lo + i, hi, mm - 1)]
    return ops


def single_chain_ops(L: int, m: int, *, branch: int = 0, arg=None) -> list:
    """SINGLE(L, m): chain of length L >= 1 with its loss, Chapter 1 operations.

    ADJCHAIN(L-1, m) where its last backward B_L is expanded into
    ``S a_{L-1}, F_L, Loss, B_L`` (thesis §2.3: SINGLE = Opt_0(L-1, m) + u_F + u_L)."""
    from .multichain import MultiOp

    L = check_int("single_chain_ops: L", L, low=1, error=ChainError, field="L")
    out = []
    for op in revolve_ops(L - 1, m, branch=branch, arg=arg):
        if op.kind == "B" and op.index == L:
            out += [MultiOp("S", branch, L - 1), MultiOp("F", branch, L), MultiOp("L", -1, 0),
                    MultiOp("B", branch, L)]
        else:
            out.append(op)
    return out


def revolve_schedule(n: int, m: int, arg=None) -> Schedule:
    """Revolve with ``m`` slots converted to Table 2.1 operations for a chain of ``n``
    stages (the thesis' "revolve" baseline, §4): ADJCHAIN(n, m) whose B_{n+1} is
    the loss; each other B_k is preceded by F_all of its stage. A Revolve F from a
    value just stored (S) becomes F_ck, any other F_none.

    Walks the argmin table as :func:`revolve_ops` does, but in jitted code writing
    the operation arrays: :func:`plan_revolve` builds one schedule per slot count,
    up to ~n^2/2 operations each, and building them as Python objects was nearly
    all of its time (10 s of 10 for 200 stages on a tight budget)."""
    n = check_int("n", n, low=1, error=ChainError, field="n",
                  hint="a chain has at least one stage")
    arg = _argmin_table(n, m, "revolve_ops:", arg)
    cap = n * (n + 1) // 2 + 2 * n + 1        # F steps of ADJCHAIN(n, 3), 2 per B, L
    op, stage = np.empty(cap, np.int64), np.empty(cap, np.int64)
    # as int64 (no copy when it is, as opt0_table makes it): one compiled version
    count = _revolve_arrays(n, int(m), np.asarray(arg, np.int64), op, stage)
    if count < 0:
        _bad_argmin(arg, *divmod(-1 - count, int(m) + 1))
    return Schedule(op[:count], stage[:count])


def _bad_argmin(arg, steps: int, m: int):
    """Raise for an entry ``arg[steps, m]`` no argmin table holds (a Revolve step from
    a stored value advances 1..steps stages): walking it would loop or, in the jitted
    walk (no bounds checks), write past its arrays."""
    if m < 3:
        raise ScheduleError(
            f"arg leads Revolve to ADJCHAIN({steps}, {m}), which needs 3 slots: it is not an "
            "argmin table; pass revolve_argmins(l, m) or opt0_table(l, m)[1], or None to "
            "compute it", reason="bad-argmin-table")
    raise ScheduleError(
        f"arg[{steps}, {m}] = {arg[steps, m]} is not a Revolve argmin (1 <= i <= {steps}); "
        "pass revolve_argmins(l, m) or opt0_table(l, m)[1], or None to compute it",
        reason="bad-argmin-table")


@numba.njit(cache=True)
def _revolve_arrays(n, m, arg, op, stage):
    """Write :func:`revolve_schedule`'s operations for ADJCHAIN(n, m) to ``op`` and
    ``stage`` (int64, long enough) and return their number: the conversion of
    :func:`revolve_ops` (same stack order) without its Python objects. Returns
    ``-1 - (l (m + 1) + mm)`` for the first entry ``arg[l, mm]`` it meets outside
    ``1..l``, or for an interval of ``l`` stages that ``arg`` leads to with
    ``mm < 3`` slots; with both checked every interval splits into strictly
    shorter ones, and the stack and op counts stay within their bounds."""
    s_lo = np.empty(n + 2, np.int64)        # stacked intervals are disjoint in 0..n
    s_hi = np.empty(n + 2, np.int64)
    s_m = np.empty(n + 2, np.int64)
    s_lo[0], s_hi[0], s_m[0] = 0, n, m
    top, count = 1, 0
    while top > 0:
        top -= 1
        lo, hi, mm = s_lo[top], s_hi[top], s_m[top]
        if lo == hi:                        # B_{lo+1}: the loss for B_{n+1}
            count = _emit_leaf(op, stage, count, lo, n)
            continue
        if mm < 3:                          # only a bad table leads here
            return -1 - ((hi - lo) * (m + 1) + mm)
        i = arg[hi - lo, mm]
        if i < 1 or i > hi - lo:
            return -1 - ((hi - lo) * (m + 1) + mm)
        # S a_lo then F_{lo+1} .. F_{lo+i}: the first from the stored value
        op[count], stage[count] = _F_CK, lo
        count += 1
        for k in range(lo + 2, lo + i + 1):
            op[count], stage[count] = _F_NONE, k - 1
            count += 1
        s_lo[top], s_hi[top], s_m[top] = lo, lo + i - 1, mm
        s_lo[top + 1], s_hi[top + 1], s_m[top + 1] = lo + i, hi, mm - 1
        top += 2
    return count


def plan_revolve(chain: Chain, memory) -> Plan:
    """Revolve applied to a heterogeneous chain: the fastest (simulated) converted
    schedule over slot counts m = 3..n+2 whose peak fits ``memory`` (bytes).

    ``info["slots"]`` is the chosen m. Revolve never keeps abar across a phase, so
    it cannot use memory beyond m = n+2. Raises
    :class:`~rtmem.errors.InfeasibleError` with the least peak over all m, and
    :class:`~rtmem.errors.RtmemError` for a chain longer than
    :func:`max_revolve_stages` (4,410 stages: its argmin table and schedules)
    and for a chain with ``no_recompute`` stages (Revolve recomputes every stage).

    Cost: the argmin table (:func:`revolve_argmins`, O(n^2 log n); the O(n^3)
    Opt_0 fill before), then one schedule (up to ~n^2/2 operations) built
    and simulated per slot count until the first one (n + 2 slots) fits; on a tight
    budget all n of them. Measured (CPU time, one core of a loaded 2-core machine,
    median of 3) with no slot count fitting: 0.060 s for 400 stages, 0.42 s for
    1,200 and 2.5 s for 2,700 (0.088 s, 1.2 s and ~13 s with the O(n^3) fill;
    earlier, 0.42 s for 400 with Schedule's np.isin checks, 3.8 s when the
    schedules were built as Python objects)."""
    check_chain(chain, "plan_revolve")
    longest = _too_long(chain)
    if longest is not None:
        # said here, not by opt0_table: its advice (fewer slots, binomial_makespan)
        # names arguments and results plan_revolve does not have
        plan_bytes, steps = _plan_revolve_cost(chain.n)
        raise RtmemError(
            f"plan_revolve: {chain.name or 'the chain'} has {chain.n:,} stages, more than "
            f"the {longest:,} it plans (max_revolve_stages()): Revolve's argmin table and "
            f"schedules for them take {plan_bytes:,} bytes and {steps:,} steps (limits "
            f"{MAX_OPT0_TABLE_BYTES:,} bytes, {MAX_OPT0_STEPS:,} steps). Plan it with plan_remat "
            "or plan_sequential, or describe the model with fewer, coarser stages (group layers)")
    refuse_no_recompute(chain, "plan_revolve", "Revolve runs every stage's forward at least "
                        "twice")
    return _plan_revolve(chain, memory)


def _too_long(chain: Chain) -> int | None:
    """:func:`max_revolve_stages` when ``chain`` has more stages than that (plan_revolve
    refuses it), else None. The one length check: plan_revolve raises on it,
    compare_remat leaves Revolve out of its table, then plans with
    :func:`_plan_revolve`."""
    longest = max_revolve_stages()
    return longest if chain.n > longest else None


def _plan_revolve(chain: Chain, memory) -> Plan:
    """:func:`plan_revolve` on a chain that :func:`_too_long` accepts."""
    n = chain.n
    arg = revolve_argmins(n, n + 2)
    # most slots first: ties go to the schedule that recomputes least
    return fastest_fitting(chain, memory,
                           ((m, revolve_schedule(n, m, arg)) for m in range(n + 2, 2, -1)),
                           "revolve", "slots", "slot count",
                           # n+2 slots: each stage runs once forward, once in F_all
                           first_is_fastest=True)
