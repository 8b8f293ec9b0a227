"""Exact rematerialization by exhaustive search, for small chains (n <= ~6).

Dijkstra over states (A, Abar, g) of thesis-remat.md Appendix A.4: A is the set of
plain activations a_k on the device, Abar the set of abar_k, g the index of the
current gradient delta_g (n+1 before the loss). Moves are the compute operations
of the simulator with exactly its memory rules (NOTE [ Simulator semantics ] in
``rtmem.planners.simulator``): an op needs everything resident + its output + its
overhead <= memory; resident counts a_0 and weights from the start, delta_g, and
the weight gradient of every stage whose B has run. No explicit deletes
(erratum 11 of thesis-remat.md). Edge weights are op times; the target is g = 0.
A chain with ``no_recompute`` stages adds R to the state, the set of those
stages already run, and a flagged stage in R is not run again (R stays empty
without flags, so their search is the same).

This is the oracle the DPs are tested against: it searches every schedule, not
only persistent ones, so C_MP can be strictly worse (erratum 16).
"""

from __future__ import annotations

import heapq
import itertools
import math

from rtmem.errors import RtmemError

from .._validation import check_chain, check_int
from ..chain import Chain
from ..multichain import _check_lengths
from ..plan import as_budget
from ..revolve import _check_slots, _check_times
from ..schedule import Op, Schedule

__all__ = ["brute_force_remat", "brute_force_multichain"]


def brute_force_remat(chain: Chain, memory, *, max_stages: int = 7):
    """Optimal makespan and schedule of ``chain`` within ``memory`` (bytes).

    ``memory`` is read as every planner reads it (an int, a string such as
    ``"12GiB"``, ``"inf"`` or a :class:`~rtmem.planners.Platform`): a fraction of
    a byte rounds down, and a budget under 1 byte raises
    :class:`~rtmem.errors.PlatformError`.

    Returns ``(makespan_seconds, Schedule)``, or ``(math.inf, None)`` when no
    valid schedule exists (one that runs each ``chain.no_recompute`` stage
    once). Refuses chains longer than ``max_stages`` (the state
    space is 2^(2n+1) (n+2)).
    """
    check_chain(chain, "brute_force_remat")     # a TypeError, not an AttributeError
    max_stages = check_int("brute_force_remat: max_stages", max_stages, low=1)
    n = chain.n
    if n > max_stages:
        raise RtmemError(f"brute_force_remat: {n} stages is too many for exhaustive "
                         f"search (max_stages={max_stages}); use a shorter chain")
    limit = as_budget(memory)
    a = [int(chain.x0)] + [int(v) for v in chain.x]
    abar = [int(chain.x0)] + [int(v) for v in chain.xbar]
    w = [int(v) for v in chain.w]
    of, ob = [int(v) for v in chain.o_f], [int(v) for v in chain.o_b]
    uf, ub = [float(v) for v in chain.u_f], [float(v) for v in chain.u_b]
    base = sum(w)
    # grads[g]: weight-gradient bytes once B g..B n-1 have run
    grads = [sum(w[g:]) for g in range(n)] + [0, 0]

    def resident(A, Ab, g):
        total = base + grads[g] + (a[g] if g <= n else 0)
        for k in range(n + 1):
            if A >> k & 1:
                total += a[k]
            if Ab >> k & 1:
                total += abar[k]
        return total

    flagged = [bool(v) for v in chain.no_recompute]

    def moves(A, Ab, g, R):
        mem = resident(A, Ab, g)
        have = A | Ab
        for k in range(n):
            if flagged[k] and R >> k & 1:
                continue                              # run once already
            nR = R | 1 << k if flagged[k] else R
            if have >> k & 1:
                for code, out_bit, size in ((Op.F_CK, 0, a[k + 1]), (Op.F_ALL, 1, abar[k + 1])):
                    target = Ab if out_bit else A
                    if target >> (k + 1) & 1:
                        continue                      # output already there: a no-op
                    if mem + size + of[k] <= limit:
                        if out_bit:
                            yield code, k, uf[k], (A, Ab | 1 << (k + 1), g, nR)
                        else:
                            yield code, k, uf[k], (A | 1 << (k + 1), Ab, g, nR)
            if A >> k & 1 and mem + a[k + 1] + of[k] <= limit:
                nA = (A & ~(1 << k)) | 1 << (k + 1)
                yield Op.F_NONE, k, uf[k], (nA, Ab, g, nR)
        if g == n + 1 and have >> n & 1 and mem + a[n] + chain.o_loss <= limit:
            nA = A & ~(1 << n) if not Ab >> n & 1 else A
            yield Op.LOSS, 0, float(chain.u_loss), (nA, Ab, n, R)
        if g <= n and g >= 1:
            k = g - 1
            if Ab >> g & 1 and have >> k & 1 and mem + a[k] + ob[k] + w[k] <= limit:
                nAb = Ab & ~(1 << g)
                nA = A & ~(1 << k) if not nAb >> k & 1 else A
                yield Op.B, k, ub[k], (nA, nAb, k, R)

    start = (1, 0, n + 1, 0)
    if resident(*start[:3]) > limit:
        return math.inf, None
    dist = {start: 0.0}
    prev = {}
    tie = itertools.count()
    heap = [(0.0, next(tie), start)]
    while heap:
        d, _, state = heapq.heappop(heap)
        if d > dist[state]:
            continue
        if state[2] == 0:
            ops = []
            while state != start:
                state, op = prev[state]
                ops.append(op)
            return d, Schedule.from_ops(reversed(ops))
        for code, k, cost, nxt in moves(*state):
            nd = d + cost
            if nd < dist.get(nxt, math.inf):
                dist[nxt] = nd
                prev[nxt] = (state, (code, k))
                heapq.heappush(heap, (nd, next(tie), nxt))
    return math.inf, None


def brute_force_multichain(lengths, m: int, b=None, u_f: float = 1.0, u_b: float = 1.0,
                           u_loss: float = 1.0, *, max_states: int = 1 << 20) -> float:
    """Optimal MULTI-b makespan by Dijkstra (thesis-remat.md Appendix A.5).

    State per branch: the set of stored a-indices and the position of its delta
    (-1 before the loss, -2 once delta_0 is discarded). Moves: F with or without
    keeping its input (keeping needs a free slot: S then F), B with or without
    keeping a_{i-1}, the loss when every a_{L_j} is stored, discarding any a, and
    discarding delta_0 when b_j = 0. Memory = number of stored items <= m. Returns
    ``math.inf`` when no schedule exists. Small instances only: refuses those
    whose state space, prod_j 2^(L_j+1) (L_j+3), exceeds ``max_states`` (the
    default admits three branches of 3 stages or two of 5, seconds at most;
    three of 4 took minutes).
    Step times are checked as by the DP (a negative one made Dijkstra run forever).
    """
    # the DP's own checks: int() truncated 2.5 branches to 2, a negative length
    # raised "negative shift count", and a b of the wrong length (zip stops at the
    # shorter) or b_j = 2 gave a silent answer for another instance
    L, b = _check_lengths(lengths, b)
    m = _check_slots(m)
    u_f, u_b, u_loss = _check_times(sum(L), sum(L), u_f=u_f, u_b=u_b, u_loss=u_loss)
    max_states = check_int("brute_force_multichain: max_states", max_states, low=1)
    states = math.prod((1 << (n + 1)) * (n + 3) for n in L)
    if states > max_states:
        raise RtmemError(f"brute_force_multichain: lengths {list(L)} give up to {states:,} "
                         f"states, too many for exhaustive search (max_states="
                         f"{max_states:,}); use shorter or fewer branches")
    K = len(L)

    def used(state):
        return sum(bin(s).count("1") + (d >= 0) for s, d in state)

    def moves(state):
        cnt = used(state)
        for j, (s, d) in enumerate(state):
            def put(ns, nd):
                return state[:j] + ((ns, nd),) + state[j + 1:]
            for i in range(1, L[j] + 1):
                if s >> (i - 1) & 1:
                    if not s >> i & 1 and cnt + 1 <= m:
                        yield u_f, put(s | 1 << i, d)
                    yield u_f, put((s & ~(1 << (i - 1))) | 1 << i, d)
            if d >= 1 and s >> (d - 1) & 1:
                yield u_b, put(s & ~(1 << (d - 1)), d - 1)
                if cnt + 1 <= m:
                    yield u_b, put(s, d - 1)
            for i in range(L[j] + 1):
                if s >> i & 1:
                    yield 0.0, put(s & ~(1 << i), d)
            if d == 0 and not b[j]:
                yield 0.0, put(s, -2)
        if all(d == -1 for _, d in state) and all(s >> L[j] & 1 for j, (s, _) in
                                                    enumerate(state)):
            yield u_loss, tuple((s & ~(1 << L[j]), L[j]) for j, (s, _) in enumerate(state))

    start = tuple((1, -1) for _ in range(K))
    if K > m:
        return math.inf
    target_d = tuple(0 if f else -2 for f in b)
    dist = {start: 0.0}
    heap = [(0.0, 0, start)]
    tie = itertools.count(1)
    while heap:
        d0, _, state = heapq.heappop(heap)
        if d0 > dist[state]:
            continue
        if tuple(d for _, d in state) == target_d:
            return d0
        for cost, nxt in moves(state):
            nd = d0 + cost
            if nd < dist.get(nxt, math.inf):
                dist[nxt] = nd
                heapq.heappush(heap, (nd, next(tie), nxt))
    return math.inf
