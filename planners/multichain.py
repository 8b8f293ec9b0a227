"""Multi-chain rematerialization (K chains joined at the loss), homogeneous costs.

NOTE [ Multi-chain DP ]
thesis-remat.md §2.1-2.6 (Chapter 1, Theorem 3, eq. 1.4). K branches of lengths
L = (L_1..L_K); every value occupies one slot; F is in place, B consumes delta_i
and a_{i-1} (Table 1.1). b_j = 1 means delta_0 of branch j must be kept at the
end, b_j = 0 that it is discarded once branch j is done (MULTI-b).

    m_min(L, b) = K~ if (some L_i = 1) or (some L_i = 0 with b_i = 0) or L = 0
                  K~ + 1 otherwise,          K~ = K + #{i: L_i != 0}   (Lemma 2)
    Opt(L, m, b) = inf                              m < m_min(L, b)
    Opt(0, m, b) = u_L                              m >= K
    Opt(e_i, m, b) = u_F + u_L + u_B                m >= K + 1
    Opt(L, m, b) = min_{k, 1 <= i <= L_k} i u_F + Opt(L[k <- L_k - i], m - 1, b[k <- 1])
                                          + Opt_0(i - 1, m - sum_{j != k} b_j)

Branch k is the one finishing its backward last, a_i its first checkpoint after
a_0; Opt_0 is Revolve (NOTE [ Revolve DP Opt_0 ]). Errata followed: the cost list
is u_F, u_B, u_L (erratum 1), branch j has steps 1..L_j (erratum 3), m_min
depends on b (erratum 4), and the toy example's claimed argmin is not used as an
oracle, only makespans (erratum 5 of thesis-remat.md).

Schedules are lists of :class:`MultiOp` (Table 1.1): ``S`` duplicates a_i,
``F`` computes a_i from a_{i-1} in place, ``B`` turns (delta_i, a_{i-1}) into
delta_{i-1}, ``L`` is the loss (all a_{L_j} -> delta_{L_j}), ``D`` drops a copy of
a_i, ``Dbar`` drops delta_0 of a finished branch. :func:`simulate_multichain` is
their validator; ``rtmem.planners.testing.brute_force_multichain`` the oracle.

Table memory: prod(L_j + 1) 2^K (m+1) float64, e.g. 31^3 * 8 * 94 * 8 bytes
= 179 MB for the thesis' largest Siamese instance (L = (30, 30, 30), m = 93).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np

from rtmem.errors import ChainError, InfeasibleError, RtmemError, ScheduleError

from ._validation import check_int
from .revolve import _check_slots, _check_times, _opt0_cost, opt0_table, revolve_ops

#: Largest tables (bytes) the multi-chain DP allocates (its own and Revolve's).
MAX_MULTICHAIN_TABLE_BYTES = 2 * 2**30
#: Most inner steps the multi-chain DP may take: ~1.3 ns each, so ~15 s.
MAX_MULTICHAIN_STEPS = 10**10

__all__ = ["MultiOp", "min_slots", "MultiChainTable", "multichain_table",
           "multichain_opt", "multichain_schedule", "simulate_multichain"]


class MultiOp(NamedTuple):
    """One Chapter 1 operation: ``kind`` in S, F, B, L, D, Dbar; ``branch`` 0-based
    (-1 for the loss); ``index`` the value index (1-based steps, a_0 is the input)."""

    kind: str
    branch: int
    index: int

    def __str__(self) -> str:
        if self.kind == "L":
            return "Loss"
        if self.kind == "Dbar":
            return f"Dbar^{self.branch}"
        return f"{self.kind}^{self.branch}_{self.index}"


def _check_lengths(lengths, b):
    """``(L, b)`` as tuples of Python ints: one length >= 0 and one 0/1 flag per
    branch, each a true integer (2.5 or "3" is refused, not truncated)."""
    def lengths_error(got):
        return ChainError(f"lengths must be a non-empty sequence of integers >= 0 (one per "
                          f"branch), got {got}", field="lengths")

    def flags_error():
        return ChainError(f"b must hold one 0/1 flag per branch ({len(L)}), got {b!r}",
                          field="b")
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise lengths_error(repr(lengths))
    L = tuple(check_int(f"lengths[{j}]", v, error=ChainError, field="lengths")
              for j, v in enumerate(lengths))
    if not L:
        raise lengths_error("an empty one")
    if b is None:
        return L, (0,) * len(L)
    if isinstance(b, (str, bytes)) or not hasattr(b, "__iter__"):
        raise flags_error()
    b = tuple(check_int(f"b[{j}]", v, high=1, error=ChainError, field="b")
              for j, v in enumerate(b))
    if len(b) != len(L):
        raise flags_error()
    return L, b


def _check_size(L, m_max: int) -> None:
    """Refuse an instance whose table (prod(L_j + 1) 2^K (m+1) float64) or fill
    (about half the cells times sum(L) steps, plus Revolve's (l+1)^2 m / 2) is
    beyond :data:`MAX_MULTICHAIN_TABLE_BYTES` / :data:`MAX_MULTICHAIN_STEPS`,
    before numpy or numba try (a MemoryError, or minutes of filling)."""
    cells = math.prod(v + 1 for v in L) * 2 ** len(L) * (m_max + 1)
    revolve_bytes, revolve_steps = _opt0_cost(max(max(L), 1), m_max)
    table_bytes = cells * 8 + revolve_bytes
    steps = cells * sum(L) // 2 + revolve_steps
    if table_bytes > MAX_MULTICHAIN_TABLE_BYTES or steps > MAX_MULTICHAIN_STEPS:
        raise RtmemError(
            f"the multi-chain DP for lengths {L} and {m_max} slots needs {table_bytes:,} "
            f"bytes of tables and about {steps:.2g} steps (limits "
            f"{MAX_MULTICHAIN_TABLE_BYTES:,} bytes, {MAX_MULTICHAIN_STEPS:.0e} steps); "
            "use shorter branches or fewer slots (slots beyond sum(L) + 2K never help), "
            "or plan a single chain with plan_remat")


def min_slots(lengths, b=None) -> int:
    """m_min(L, b) of Lemma 2: the least number of slots for which Opt is finite."""
    L, b = _check_lengths(lengths, b)
    K = len(L)
    kt = K + sum(1 for v in L if v)
    easy = any(v == 1 for v in L) or any(v == 0 and f == 0 for v, f in zip(L, b)) \
        or not any(L)
    return kt if easy else kt + 1


@numba.njit(cache=True)
def _split(T, L, li, bb, m0, m1, stride, uf, opt0, arg, store):
    """The recurrence of eq. 1.4 for Opt(L, m, b), m0 <= m < m1 (sum(L) >= 2), from
    the cells of smaller instances in ``T``: the fill (``store``: written into
    ``T``) and the reconstruction (one cell) both call it, so they cannot disagree.
    Returns the value of the last cell (``inf`` if no split fits) and writes its
    argmin (branch k, first checkpoint i, slots left to Opt_0) to ``arg``."""
    K = L.shape[0]
    kept = 0                    # delta_0 slots held by finished branches
    for j in range(K):
        kept += (bb >> j) & 1
    best = np.inf
    for m in range(m0, m1):
        best = np.inf
        arg[0] = -1
        for k in range(K):
            if L[k] == 0:
                continue
            # the slots Opt_0 of branch k gets: the other branches keep their delta_0
            mh = m - (kept - ((bb >> k) & 1))
            if mh < 0:
                continue
            nbb = bb | (1 << k)
            for i in range(1, L[k] + 1):
                v = i * uf + T[li - i * stride[k], nbb, m - 1] + opt0[i - 1, mh]
                if v < best:
                    best = v
                    arg[0], arg[1], arg[2] = k, i, mh
        if store:
            T[li, bb, m] = best
    return best


@numba.njit(cache=True)
def _fill(Lmax, m_max, uf, ub, ul, opt0):
    K = Lmax.shape[0]
    stride = np.ones(K, np.int64)
    for j in range(1, K):
        stride[j] = stride[j - 1] * (Lmax[j - 1] + 1)
    nL = stride[K - 1] * (Lmax[K - 1] + 1)
    nb = 1 << K
    T = np.full((nL, nb, m_max + 1), np.inf)
    L = np.zeros(K, np.int64)
    arg = np.empty(3, np.int64)
    for li in range(nL):
        rest = li
        for j in range(K):
            L[j] = rest % (Lmax[j] + 1)
            rest //= Lmax[j] + 1
        total = 0
        nonzero = 0
        has_one = False
        for j in range(K):
            total += L[j]
            if L[j] != 0:
                nonzero += 1
            if L[j] == 1:
                has_one = True
        for bb in range(nb):
            easy = has_one or total == 0
            for j in range(K):
                if L[j] == 0 and (bb >> j) & 1 == 0:
                    easy = True
            mmin = K + nonzero + (0 if easy else 1)
            if total == 0:
                T[li, bb, mmin:] = ul
            elif total == 1:
                T[li, bb, mmin:] = uf + ul + ub
            else:
                _split(T, L, li, bb, mmin, m_max + 1, stride, uf, opt0, arg, True)
    return T


class MultiChainTable:
    """Opt(L', m', b') for every L' <= L componentwise, m' <= m_max, every b'.

    Build with :func:`multichain_table`. Times in the units of u_f/u_b/u_loss."""

    def __init__(self, lengths, m_max, u_f, u_b, u_loss):
        self.lengths, _ = _check_lengths(lengths, None)
        self.m_max = _check_slots(m_max, "m_max")
        _check_size(self.lengths, self.m_max)
        # sum(L) forward steps and as many backward ones: huge times are refused
        # here, not left to overflow the tables to inf, which reads as infeasible
        steps = sum(self.lengths)
        self.u_f, self.u_b, self.u_loss = _check_times(steps, steps, u_f=u_f, u_b=u_b,
                                                       u_loss=u_loss)
        lmax = max(self.lengths)
        self.opt0, self.arg0 = opt0_table(max(lmax, 1), self.m_max, u_f, u_b)
        Lmax = np.array(self.lengths, np.int64)
        self.T = _fill(Lmax, self.m_max, self.u_f, self.u_b, self.u_loss, self.opt0)
        self._stride = np.concatenate(([1], np.cumprod(Lmax[:-1] + 1))).astype(np.int64)

    def _index(self, L, b):
        li = int(sum(v * s for v, s in zip(L, self._stride)))
        bb = sum(f << j for j, f in enumerate(b))
        return li, bb

    def opt(self, lengths, m, b=None) -> float:
        """Opt(L, m, b) (``inf`` when infeasible)."""
        L, b = _check_lengths(lengths, b)
        m = _check_slots(m)
        if len(L) != len(self.lengths) or any(v > w for v, w in zip(L, self.lengths)):
            raise RtmemError(f"lengths {L} are outside the table built for {self.lengths}; "
                             "build a table for the larger instance")
        if m > self.m_max:
            raise RtmemError(f"m = {m} > m_max = {self.m_max} of this table; build it with "
                             f"m_max >= {m}")
        li, bb = self._index(L, b)
        return float(self.T[li, bb, m])

    def schedule(self, m, b=None) -> list:
        """Optimal schedule of the full instance with m slots (§2.6 reconstruction)."""
        L, b = _check_lengths(self.lengths, b)
        m = _check_slots(m)
        if not math.isfinite(self.opt(L, m, b)):
            need = min_slots(L, b)
            raise InfeasibleError(f"multi-chain {L} with b={b} needs at least {need} slots, "
                                  f"got {m}", budget=m, min_feasible=need)
        ops = []
        self._rec(list(L), m, list(b), [0] * len(L), ops)
        return ops

    def _rec(self, L, m, b, off, ops):
        K = len(L)
        total = sum(L)
        if total <= 1:
            if total == 1:
                k = L.index(1)
                ops += [MultiOp("S", k, off[k]), MultiOp("F", k, off[k] + 1)]
            ops.append(MultiOp("L", -1, 0))
            # a finished branch with b = 0 drops delta_0 at once: it frees a slot
            ops += [MultiOp("Dbar", j, 0) for j in range(K) if L[j] == 0 and not b[j]]
            if total == 1:
                ops.append(MultiOp("B", k, off[k] + 1))
                if not b[k]:
                    ops.append(MultiOp("Dbar", k, 0))
            return
        li, bb = self._index(L, b)
        arg = np.empty(3, np.int64)
        best = _split(self.T, np.array(L, np.int64), li, bb, m, m + 1, self._stride,
                      self.u_f, self.opt0, arg, False)
        if arg[0] < 0 or not best <= self.T[li, bb, m]:
            raise RtmemError(f"multi-chain reconstruction failed at L={L}, m={m}, b={b}; "
                             "this is a bug")
        k, i, mh = (int(v) for v in arg)
        nb = b[:k] + [1] + b[k + 1:]
        ops.append(MultiOp("S", k, off[k]))
        ops += [MultiOp("F", k, off[k] + j) for j in range(1, i + 1)]
        self._rec(L[:k] + [L[k] - i] + L[k + 1:], m - 1, nb,
                  off[:k] + [off[k] + i] + off[k + 1:], ops)
        ops += revolve_ops(i - 1, mh, branch=k, offset=off[k], arg=self.arg0)
        if not b[k]:
            ops.append(MultiOp("Dbar", k, 0))


def multichain_table(lengths, m_max, u_f=1.0, u_b=1.0, u_loss=1.0) -> MultiChainTable:
    """Fill eq. 1.4 for all sub-instances of ``lengths`` up to ``m_max`` slots
    (makespans in the units of ``u_f``/``u_b``/``u_loss``: seconds, or step
    counts with the defaults)."""
    return MultiChainTable(lengths, m_max, u_f, u_b, u_loss)


def multichain_opt(lengths, m, b=None, u_f=1.0, u_b=1.0, u_loss=1.0) -> float:
    """Opt(L, m, b) of eq. 1.4, a makespan in the units of ``u_f``/``u_b``/``u_loss``
    (``inf`` if m < m_min). ``lengths``: one integer
    >= 0 per branch; ``m``: slots, an integer >= 0; ``b``: 0/1 flags. Raises
    :class:`~rtmem.errors.RtmemError` when the tables would be too large or slow
    (see ``MAX_MULTICHAIN_TABLE_BYTES``, ``MAX_MULTICHAIN_STEPS``), and
    :class:`~rtmem.errors.ChainError` for a negative or non-finite time, or times
    so large that a makespan could overflow a float64 (the bound
    :class:`~rtmem.planners.Chain` checks, on sum(lengths) steps)."""
    return multichain_table(lengths, _check_slots(m), u_f, u_b, u_loss).opt(lengths, m, b)


def multichain_schedule(lengths, m, b=None, u_f=1.0, u_b=1.0, u_loss=1.0):
    """``(makespan, ops)``: an optimal MULTI-b schedule with m slots (makespan in
    the units of ``u_f``/``u_b``/``u_loss``). Raises
    :class:`~rtmem.errors.InfeasibleError` (``budget``, ``min_feasible`` in slots)
    when m < m_min, and the errors of :func:`multichain_opt`."""
    table = multichain_table(lengths, m, u_f, u_b, u_loss)
    return table.opt(lengths, m, b), table.schedule(m, b)


def simulate_multichain(ops, lengths, m, b=None, u_f=1.0, u_b=1.0, u_loss=1.0):
    """Validate ``ops`` under Table 1.1 with m slots; return ``(makespan, peak)``:
    the makespan in the units of ``u_f``/``u_b``/``u_loss``, the peak in slots.

    Raises :class:`~rtmem.errors.ScheduleError` naming the op index and what was
    missing. At the end every branch must hold exactly its delta_0 if b_j = 1 and
    nothing if b_j = 0."""
    L, b = _check_lengths(lengths, b)
    m = _check_slots(m)
    u_f, u_b, u_loss = _check_times(sum(L), sum(L), u_f=u_f, u_b=u_b, u_loss=u_loss)
    K = len(L)
    counts = [dict({0: 1}) for _ in range(K)]
    delta = [None] * K            # index of the branch's current delta, or "gone"
    used = K
    peak, time_ = used, 0.0
    loss_done = False

    def fail(j, msg):
        raise ScheduleError(f"op {j} ({ops[j]}): {msg}", op_index=j, reason="multichain")

    for j, op in enumerate(ops):
        try:
            kind, k, i = op
        except (TypeError, ValueError):
            # a string op ("F") unpacked into "too many values" from inside
            fail(j, "an op is a (kind, branch, index) triple, e.g. MultiOp('F', 0, 1)")
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                   for v in (k, i)):
            fail(j, f"branch {k!r} and index {i!r} must be integers")
        if kind != "L" and not 0 <= k < K:
            fail(j, f"branch {k} does not exist (K = {K})")
        c = counts[k] if kind != "L" else None
        if kind in ("S", "F", "D") and c.get(i - (kind == "F"), 0) < 1:
            fail(j, f"needs a_{i - (kind == 'F')} of branch {k}, which is not stored")
        if kind == "S":
            c[i] += 1
            used += 1
        elif kind == "F":
            if not 1 <= i <= L[k]:
                fail(j, f"step {i} outside 1..{L[k]}")
            c[i - 1] -= 1
            c[i] = c.get(i, 0) + 1
            time_ += u_f
        elif kind == "D":
            c[i] -= 1
            used -= 1
        elif kind == "L":
            if loss_done:
                fail(j, "the loss runs once")
            for q in range(K):
                if counts[q].get(L[q], 0) < 1:
                    fail(j, f"needs a_{L[q]} of branch {q}")
                counts[q][L[q]] -= 1
                delta[q] = L[q]
            loss_done = True
            time_ += u_loss
        elif kind == "B":
            if delta[k] != i:
                fail(j, f"needs delta_{i} of branch {k}, current is {delta[k]}")
            if c.get(i - 1, 0) < 1:
                fail(j, f"needs a_{i - 1} of branch {k}")
            c[i - 1] -= 1
            delta[k] = i - 1
            used -= 1
            time_ += u_b
        elif kind == "Dbar":
            if delta[k] != 0 or b[k]:
                fail(j, f"branch {k} is not finished or must keep delta_0 (b = {b[k]})")
            delta[k] = "gone"
            used -= 1
        else:
            fail(j, f"unknown operation kind {kind!r}")
        if used > m:
            fail(j, f"{used} slots in use, more than m = {m}")
        peak = max(peak, used)
    for q in range(K):
        want = 0 if b[q] else "gone"
        if delta[q] != want or any(v for v in counts[q].values()):
            raise ScheduleError(f"branch {q} ends with delta at {delta[q]!r} and values "
                                f"{ {a: v for a, v in counts[q].items() if v} }; expected "
                                f"{'delta_0 only' if b[q] else 'nothing'}",
                                reason="incomplete")
    return time_, peak
