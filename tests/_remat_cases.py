"""Chains from the rematerialization papers that more than one test uses."""

from __future__ import annotations

from rtmem.planners import Chain


def erratum_16_chain() -> Chain:
    """thesis-remat.md erratum 16: at M = 20 the optimum is 39, reached only by a
    non-persistent schedule; the memory-persistent DP (C_MP) gives 42."""
    return Chain(u_f=[3, 5, 1, 0], u_b=[2, 6, 4, 2], x=[3, 4, 4, 3], xbar=[3, 6, 6, 5],
                 x0=1, u_loss=2)


def persistence_counterexample(n: int) -> Chain:
    """Property 9 (thesis Fig. 2.3) at M = 15: C_MP = 3n-2, while the exhaustive
    optimum is min(3n-2, 2n+2)."""
    length = n + 2
    x = [1] + [3] * (length - 2) + [4]
    return Chain(u_f=[n - 2, 2] + [0] * (length - 2), u_b=[0] * length, x=x, xbar=x, x0=0)


# Offloads abar1 while w1 is prefetched: the two transfers want the link at once
# (test_simulator's channel models, test_cli's simulate --json and memory curve).
OVERLAPPING_TRANSFERS = ("w_delete 1, F_all 0, offload abar1, w_prefetch 1, F_all 1, L, "
                         "B 1, B 0")


def two_stage_chain(w=(0, 0), x=(10, 10)) -> Chain:
    """Two stages of 1 s forward and 1 s backward, no input, xbar = x (bytes)."""
    return Chain(u_f=[1, 1], u_b=[1, 1], x=list(x), xbar=list(x), w=list(w), x0=0)
