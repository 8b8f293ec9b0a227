"""Revolve (Opt_0) and the multi-chain DP (eq. 1.4) against closed forms, the
Chapter 1 validator and exhaustive search (thesis-remat.md §7.2)."""

import itertools
import math

import numpy as np

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtmem.errors import ChainError, InfeasibleError, ScheduleError
from rtmem.planners import Chain, Platform, plan_remat, plan_revolve, simulate
from rtmem.planners.multichain import (MultiOp, min_slots, multichain_opt,
                                       multichain_schedule, multichain_table,
                                       simulate_multichain)
from rtmem.planners.revolve import (binomial_makespan, opt0_table, revolve_argmins,
                                    revolve_ops, revolve_schedule, single_chain_ops)
from rtmem.planners.schedule import Op, Schedule
from rtmem.planners.testing import chains
from rtmem.planners.testing.bruteforce import brute_force_multichain

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ Revolve
def test_opt0_equals_binomial_closed_form():
    # property 15, with non-unit costs so u_F and u_B cannot be confused
    T, _ = opt0_table(59, 9, u_f=3.0, u_b=5.0)
    for l in range(60):
        for m in range(10):
            assert T[l, m] == binomial_makespan(l, m, 3.0, 5.0), (l, m)


def test_binomial_makespan_long_chains_take_few_binomials(monkeypatch):
    # opt0_table sends long chains here; the least r with C(s + r, s) >= l + 1
    # was found by counting r up (r = l for m = 3): 10**6 binomials for l = 10**6,
    # 10**12 never returned. Now O(log l) binomials, same values.
    from math import comb

    import rtmem.planners.revolve as rev
    calls = []

    def counting_comb(n, k):
        calls.append(1)
        return comb(n, k)

    monkeypatch.setattr(rev, "comb", counting_comb)
    for length in (10**6, 10**8):
        calls.clear()
        assert binomial_makespan(length, 3, 1.0, 0.0) == length * (length + 1) // 2  # Opt_0
        assert len(calls) < 200, (length, len(calls))
    calls.clear()
    assert binomial_makespan(10**12, 4, 0.0, 1.0) == 10**12 + 1
    assert math.isfinite(binomial_makespan(10**12, 4)) and len(calls) < 200
    # the least r agrees with counting it up, on every l, m of a grid
    for length in range(1, 400):
        for m in range(3, 9):
            s, steps, r = m - 2, length + 1, 0
            while comb(s + r, s) < steps:
                r += 1
            assert binomial_makespan(length, m, 1.0, 0.0) == r * steps - comb(s + r, s + 1)


def test_opt0_special_cases():
    T, _ = opt0_table(30, 40, u_f=2.0, u_b=7.0)
    for l in range(1, 31):
        assert T[l, 3] == l * (l + 1) / 2 * 2.0 + (l + 1) * 7.0
        assert T[l, l + 2] == l * 2.0 + (l + 1) * 7.0
        assert math.isinf(T[l, 2]) and math.isinf(T[l, 0])
    assert T[0, 2] == 7.0 and math.isinf(T[0, 1])


@pytest.mark.parametrize("L,m", [(1, 3), (2, 3), (7, 3), (7, 4), (12, 5), (20, 6), (9, 11)])
def test_single_chain_schedule_is_valid_and_optimal(L, m):
    T, arg = opt0_table(L, m, u_f=2.0, u_b=3.0)
    ops = single_chain_ops(L, m, arg=arg)
    makespan, peak = simulate_multichain(ops, (L,), m, b=(1,), u_f=2.0, u_b=3.0, u_loss=5.0)
    assert peak <= m
    assert makespan == T[L - 1, m] + 2.0 + 5.0          # SINGLE = Opt_0(L-1, m) + u_F + u_L


@pytest.mark.parametrize("n,m", [(1, 3), (5, 3), (8, 4), (10, 5), (6, 8)])
def test_revolve_converted_to_table_2_1_is_valid(n, m):
    chain = Chain.homogeneous(n, u_f=1.0, u_b=1.0, x=1)
    sched = revolve_schedule(n, m)
    res = simulate(chain, sched, Platform(math.inf))
    # Revolve's forwards, plus one F_all per B (abar is never kept across phases)
    forwards = binomial_makespan(n, m, 1.0, 0.0)
    assert sched.count(Op.F_CK) + sched.count(Op.F_NONE) == forwards
    assert sched.count(Op.F_ALL) == n
    assert res.makespan == forwards + n + n
    ops = list(sched)
    for j, (op, s, _) in enumerate(ops):
        if op == Op.F_ALL:
            assert ops[j + 1][:2] == (Op.B, s)


def _converted(n, m):
    """revolve_schedule as it was built before: revolve_ops' MultiOps converted one
    by one in Python (an S makes the next F an F_ck, B_{n+1} is the loss)."""
    ops, stored = [], False
    for op in revolve_ops(n, m):
        if op.kind == "S":
            stored = True
        elif op.kind == "F":
            ops.append((Op.F_CK if stored else Op.F_NONE, op.index - 1))
            stored = False
        elif op.index == n + 1:
            ops.append((Op.LOSS, 0))
        else:
            ops += [(Op.F_ALL, op.index - 1), (Op.B, op.index - 1)]
    return Schedule.from_ops(ops)


def test_revolve_schedule_builds_no_python_operations_and_matches_revolve_ops(monkeypatch):
    # plan_revolve builds one schedule per slot count, up to n^2/2 operations each:
    # building them as MultiOp objects was nearly all its time (10 s for 200 stages
    # on a tight budget). They are now written by jitted code: same schedules
    import rtmem.planners.multichain as multichain
    expected = {(n, m): _converted(n, m) for n in range(1, 16) for m in range(3, n + 4)}
    made = []

    class Counting(multichain.MultiOp):
        def __new__(cls, *args):
            made.append(args)
            return super().__new__(cls, *args)

    monkeypatch.setattr(multichain, "MultiOp", Counting)
    arg = opt0_table(15, 18)[1]
    for (n, m), sched in expected.items():
        assert revolve_schedule(n, m) == sched == revolve_schedule(n, m, arg), (n, m)
    assert made == []


def test_opt0_fill_copies_the_entries_with_more_slots_than_values():
    # entries with m > l + 2 are copied from m = l + 2, not searched: the same values
    # and argmins, bit for bit, as the recurrence computed in full (plain Python)
    rng = np.random.default_rng()
    u_f, u_b = rng.uniform(0.1, 3.0, 2)
    l_max, m_max = 25, 31
    T = np.full((l_max + 1, m_max + 1), np.inf)
    arg = np.zeros((l_max + 1, m_max + 1), np.int64)
    T[0, 2:] = u_b
    for m in range(3, m_max + 1):
        for j in range(1, l_max + 1):
            for i in range(1, j + 1):
                v = i * u_f + T[j - i, m - 1] + T[i - 1, m]
                if v < T[j, m]:
                    T[j, m], arg[j, m] = v, i
    got_T, got_arg = opt0_table(l_max, m_max, u_f, u_b)
    np.testing.assert_array_equal(got_T, T)
    np.testing.assert_array_equal(got_arg, arg)


def test_revolve_argmins_equal_the_opt0_argmins_for_every_length_up_to_60():
    # the O(l m log l) bisecting fill (convexity of Opt_0 in l) against the O(l^2 m)
    # search, entry by entry: same least argmins, so the same schedules
    for n in range(61):
        for m in sorted({0, 1, 2, 3, 4, n // 2 + 3, n + 2, n + 5}):
            np.testing.assert_array_equal(revolve_argmins(n, m), opt0_table(n, m)[1])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(61, 400), st.data())
def test_revolve_argmins_equal_the_opt0_argmins_on_longer_chains(n, data):
    m = data.draw(st.integers(3, n + 2))
    arg = revolve_argmins(n, m)
    np.testing.assert_array_equal(arg, opt0_table(n, m)[1])
    # and the schedule walked from it is the simulator-valid Revolve schedule
    rng = np.random.default_rng()
    x = rng.integers(1, 100, n)
    chain = Chain(u_f=rng.uniform(0.5, 2, n), u_b=rng.uniform(0.5, 2, n), x=x,
                  xbar=x + rng.integers(0, 100, n), x0=int(x[0]))
    schedule = revolve_schedule(n, m)
    assert schedule == revolve_schedule(n, m, opt0_table(n, m)[1])
    simulate(chain, schedule, Platform(math.inf))


def test_plan_revolve_fills_no_cubic_table(monkeypatch):
    # plan_revolve filled opt0_table(n, n + 2), O(n^3) steps (10 s on 2,700
    # stages), for its argmins alone; revolve_argmins gives them in O(n^2 log n)
    from rtmem.planners import plan_revolve, revolve

    def cubic(*args, **kwargs):
        raise AssertionError("opt0_table called")

    rng = np.random.default_rng()
    x = rng.integers(1, 100, 30)
    chain = Chain(u_f=rng.uniform(0.5, 2, 30), u_b=rng.uniform(0.5, 2, 30), x=x,
                  xbar=x + rng.integers(0, 100, 30), x0=int(x[0]))
    expected = plan_revolve(chain, 10**9)
    monkeypatch.setattr(revolve, "opt0_table", cubic)
    plan = plan_revolve(chain, 10**9)
    assert plan.schedule == expected.schedule and plan.info == expected.info
    assert revolve_schedule(30, 5) == revolve_schedule(30, 5, revolve_argmins(30, 5))


@SETTINGS
@given(chains(1, 8, homogeneous=True, small=True, no_recompute=True), st.integers(1, 300))
def test_plan_revolve_refuses_flagged_chains_and_names_the_stages(chain, budget):
    # Revolve recomputes every stage but the last, so it cannot honour
    # no_recompute: a flagged chain gets the refusal naming its stages and
    # plan_remat (whose plans run them once), never an InfeasibleError or a
    # schedule the simulator would refuse for a second forward
    flagged = np.flatnonzero(chain.no_recompute).tolist()
    try:
        plan = plan_revolve(chain, budget)
    except InfeasibleError:
        assert not flagged
        return
    except ChainError as e:
        assert (e.field, e.index) == ("no_recompute", flagged[0])
        assert flagged and str(e).startswith(
            f"plan_revolve: the chain marks stages {flagged} no_recompute")
        assert "plan it with plan_remat" in str(e)
        try:
            plan = plan_remat(chain, budget)        # the remedy the message names
        except InfeasibleError:
            return
    assert simulate(chain, plan.schedule, Platform(budget)).peak <= budget


def test_revolve_needs_three_slots():
    with pytest.raises(InfeasibleError):
        single_chain_ops(4, 2)


# -------------------------------------------------------------- multi-chain
def test_toy_instance_values():
    # property 22 (erratum 5: values, not the thesis' claimed argmin)
    T = multichain_table((4, 10, 12), 29)
    assert [T.opt((4, 10, 12), m) for m in range(7, 13)] == [88, 81, 74, 72, 71, 70]
    # "decreasing by 1 per slot down to 53 = 2*26+1 at m = 29 = sum(L_i + 1)"
    assert [T.opt((4, 10, 12), m) for m in range(12, 30)] == list(range(70, 52, -1))
    assert math.isinf(T.opt((4, 10, 12), 6))
    assert T.opt((4, 10, 3), 8, (0, 0, 1)) == 48
    assert T.opt((4, 3, 3), 7, (0, 1, 1)) == 27


def test_k1_equals_revolve():
    # property 17
    T0, _ = opt0_table(20, 12)
    for L in range(2, 21):
        T = multichain_table((L,), 12)
        for m in range(3, 13):
            for b in ((0,), (1,)):
                assert T.opt((L,), m, b) == T0[L - 1, m] + 1 + 1


@pytest.mark.parametrize("L", [5, 10])
def test_cross_modal_full_memory_thresholds(L):
    # property 20: CM (L, 5L) reaches 12L+1 exactly at m = 6L+2
    T = multichain_table((L, 5 * L), 6 * L + 2)
    assert T.opt((L, 5 * L), 6 * L + 2) == 12 * L + 1
    assert T.opt((L, 5 * L), 6 * L + 1) == 12 * L + 2


def test_siamese_threshold_and_half_memory_ratio():
    L = 5
    T = multichain_table((2 * L, 2 * L, 2 * L), 6 * L + 3)
    assert T.opt((10, 10, 10), 6 * L + 3) == 12 * L + 1
    assert T.opt((10, 10, 10), 6 * L + 2) > 12 * L + 1
    # property 23 (loose): halving memory costs 20-30 %
    ratio = T.opt((10, 10, 10), (6 * L + 3) // 2) / (12 * L + 1)
    assert 1.2 <= ratio <= 1.3


@st.composite
def instances(draw, max_k=3, max_len=3):
    K = draw(st.integers(1, max_k))
    L = tuple(draw(st.lists(st.integers(0, max_len), min_size=K, max_size=K)))
    b = tuple(draw(st.lists(st.integers(0, 1), min_size=K, max_size=K)))
    m = draw(st.integers(0, sum(L) + K + 2))
    return L, b, m


@SETTINGS
@given(instances())
def test_multichain_equals_exhaustive_search(case):
    # properties 16 and 18
    L, b, m = case
    dp = multichain_table(L, m).opt(L, m, b)
    assert dp == brute_force_multichain(L, m, b)
    assert math.isfinite(dp) == (m >= min_slots(L, b))


@SETTINGS
@given(instances(max_k=4, max_len=4), st.floats(0.5, 3.0), st.floats(0.5, 3.0))
def test_multichain_schedule_is_valid_and_optimal(case, u_f, u_b):
    L, b, m = case
    opt = multichain_table(L, m, u_f, u_b, 2.0).opt(L, m, b)
    if not math.isfinite(opt):
        with pytest.raises(InfeasibleError):
            multichain_schedule(L, m, b, u_f, u_b, 2.0)
        return
    value, ops = multichain_schedule(L, m, b, u_f, u_b, 2.0)
    makespan, peak = simulate_multichain(ops, L, m, b, u_f, u_b, 2.0)
    assert makespan == pytest.approx(value) and value == opt
    assert peak <= m
    assert opt >= sum(L) * (u_f + u_b) + 2.0 - 1e-9     # property 21


@SETTINGS
@given(instances(max_k=3, max_len=4))
def test_symmetry_and_monotonicity(case):
    # property 19
    L, b, m = case
    T = multichain_table(L, m + 1)
    base = T.opt(L, m, b)
    assert T.opt(L, m + 1, b) <= base
    for j in range(len(L)):
        if b[j] == 0:
            assert T.opt(L, m, b[:j] + (1,) + b[j + 1:]) >= base
    perm = list(reversed(range(len(L))))
    Lp, bp = tuple(L[i] for i in perm), tuple(b[i] for i in perm)
    assert multichain_table(Lp, m).opt(Lp, m, bp) == base


def test_four_chains_at_thesis_sizes():
    L = (5, 10, 5, 10)
    T = multichain_table(L, 34)
    spans = [T.opt(L, m) for m in range(min_slots(L), 35)]
    assert all(a >= b for a, b in zip(spans, spans[1:]))
    assert spans[-1] == 2 * sum(L) + 1                  # m >= sum(L_i + 1)
    value, ops = multichain_schedule(L, min_slots(L) + 2)
    assert simulate_multichain(ops, L, min_slots(L) + 2)[0] == value


def test_validator_rejects_bad_schedules():
    good = [MultiOp("S", 0, 0), MultiOp("F", 0, 1), MultiOp("L", -1, 0), MultiOp("B", 0, 1)]
    assert simulate_multichain(good, (1,), 2, b=(1,)) == (3.0, 2)
    with pytest.raises(ScheduleError, match="slots"):
        simulate_multichain(good, (1,), 1, b=(1,))
    with pytest.raises(ScheduleError, match="needs a_0"):
        simulate_multichain([MultiOp("F", 0, 1), MultiOp("L", -1, 0), MultiOp("B", 0, 1)],
                            (1,), 3, b=(1,))
    with pytest.raises(ScheduleError, match="expected nothing"):
        simulate_multichain(good, (1,), 2, b=(0,))
    # an op that is no triple, or whose branch or index is no integer, was a bare
    # ValueError / TypeError from inside the loop
    for bad, match in (("F", r"op 0 \(F\): an op is a \(kind, branch, index\) triple"),
                       (("F", 0, "1"), "branch 0 and index '1' must be integers"),
                       (("Q", 0, 1), "unknown operation kind 'Q'")):
        with pytest.raises(ScheduleError, match=match):
            simulate_multichain([bad, *good], (1,), 3, b=(1,))
    assert list(itertools.islice(map(str, good), 2)) == ["S^0_0", "F^0_1"]


def test_revolve_refuses_impossible_sizes():
    from rtmem.planners.revolve import binomial_makespan, revolve_schedule
    with pytest.raises(ValueError, match=">= 0"):
        binomial_makespan(-1, -1)
    with pytest.raises(ValueError, match="at least one stage"):
        revolve_schedule(0, 1)
    with pytest.raises(TypeError, match="arg must be an argmin table"):   # AttributeError
        revolve_schedule(5, 4, arg="x")


@pytest.mark.parametrize("call, fragment", [
    # were truncated to (2, 3), read as "2", "3", or b truncated to (0, 1)
    (lambda: multichain_opt([2.5, 3], 6), r"lengths\[0\] must be an integer >= 0"),
    (lambda: multichain_opt("23", 6), "lengths must be a non-empty sequence"),
    (lambda: multichain_opt([], 6), "lengths must be a non-empty sequence"),
    (lambda: multichain_opt([True, 3], 6), r"lengths\[0\]"),
    (lambda: multichain_opt([2, 3], 6, b=[0.5, 1]), r"b\[0\] must be an integer in 0..1"),
    (lambda: multichain_opt([2, 3], 6, b=[0, 2]), r"b\[1\] must be an integer in 0..1"),
    (lambda: multichain_opt([2, 3], 6, b="01"), "one 0/1 flag per branch"),
    (lambda: multichain_opt([2, 3], 6, b=[0]), "one 0/1 flag per branch"),
    (lambda: multichain_opt([2, 3], 6.5), "m must be an integer >= 0, got 6.5"),
    (lambda: multichain_opt([2, 3], -1), "m must be an integer >= 0"),
    (lambda: min_slots([1.5]), r"lengths\[0\]"),
    (lambda: simulate_multichain([], [1], 2.5), "m must be an integer"),
    (lambda: revolve_schedule(3, 3.5), "m must be an integer >= 0, got 3.5"),  # IndexError
    (lambda: revolve_schedule(2.0, 4), "n must be an integer >= 1"),
    (lambda: opt0_table(3.5, 4), "l must be an integer"),
    (lambda: binomial_makespan(3, "4"), "m must be an integer"),
])
def test_counts_must_be_true_integers(call, fragment):
    from rtmem.errors import ChainError
    with pytest.raises(ChainError, match=fragment):
        call()


@pytest.mark.parametrize("call", [
    lambda: multichain_opt([2**40], 4),          # MemoryError from numba
    lambda: multichain_opt([10**6], 5),          # minutes of filling
    lambda: multichain_opt([3] * 40, 90),        # 2^40 flag combinations
    lambda: multichain_opt([2, 3], 10**12),
    lambda: opt0_table(10**6, 10),
    lambda: opt0_table(10, 10**10),
])
def test_oversized_instances_are_refused_up_front(call):
    from rtmem.errors import RtmemError
    with pytest.raises(RtmemError, match="limits") as err:
        call()
    assert "steps" in str(err.value) and "bytes" in str(err.value)


def test_numpy_integers_are_counts():
    import numpy as np
    assert multichain_opt(np.array([2, 3]), np.int64(6)) == multichain_opt([2, 3], 6)
    assert revolve_schedule(np.int32(3), np.int64(4)) == revolve_schedule(3, 4)


@pytest.mark.parametrize("call, fragment", [
    # the exhaustive oracle checks its instance as the DP does: it answered
    # inf for b=[0, 1] on one branch (zip dropped the flag), 5 for lengths [2.5]
    # (truncated), 5 for b=[2], 0 for no branch, and "negative shift count"
    (lambda: brute_force_multichain([2], 3, [0, 1]), "one 0/1 flag per branch"),
    (lambda: brute_force_multichain([2.5], 4), r"lengths\[0\] must be an integer"),
    (lambda: brute_force_multichain([-1], 4), r"lengths\[0\] must be an integer >= 0"),
    (lambda: brute_force_multichain([2], 3, [2]), r"b\[0\] must be an integer in 0..1"),
    (lambda: brute_force_multichain([], 3), "non-empty sequence"),
    (lambda: brute_force_multichain([2], -1), "m must be an integer >= 0"),
    # the oracle checks what the DP checks: a negative time ran Dijkstra forever,
    # a NaN one reported a feasible instance infeasible
    (lambda: brute_force_multichain([2], 3, u_f=-1.0), "u_f = -1.0 must be finite and >= 0"),
    (lambda: brute_force_multichain([2], 3, u_b=math.nan), "u_b = nan must be finite"),
])
def test_exhaustive_multichain_oracle_checks_its_instance(call, fragment):
    from rtmem.errors import ChainError
    with pytest.raises(ChainError, match=fragment):
        call()


def test_exhaustive_multichain_oracle_refuses_what_would_take_minutes():
    # the docstring's "L_j <= ~5, K <= 3" ran for minutes ([5, 5, 5]: 2 min)
    from rtmem.errors import RtmemError
    with pytest.raises(RtmemError, match="134,217,728 states, too many"):
        brute_force_multichain([5, 5, 5], 8)
    with pytest.raises(RtmemError, match="max_states"):
        brute_force_multichain([3, 3, 3], 8, max_states=1000)
    # the default admits three branches of 3 stages. With 5 slots (2 fewer than
    # min_slots) the search proves infeasibility in well under a second; a
    # feasible [3, 3, 3] took 13-100 s, and test_multichain_equals_exhaustive_search
    # compares feasible instances already
    assert brute_force_multichain([3, 3, 3], 5) == multichain_opt([3, 3, 3], 5) == math.inf


@pytest.mark.parametrize("call, fragment", [
    # negative times gave negative makespans (multichain_opt([3, 2], 7, u_f=-1)
    # was -3.0), a NaN time inf: multichain_schedule then raised "needs at least
    # 5 slots, got 7" for an instance that has a schedule
    (lambda: opt0_table(3, 5, u_f=-1.0), r"u_f = -1.0 must be finite and >= 0"),
    (lambda: opt0_table(3, 5, u_b=math.inf), r"u_b = inf must be finite"),
    (lambda: binomial_makespan(3, 3, u_f=-2.0), r"u_f = -2.0 must be finite"),
    (lambda: binomial_makespan(3, 3, u_b=math.nan), r"u_b = nan must be finite"),
    (lambda: multichain_opt([3, 2], 7, u_f=-1.0), r"u_f = -1.0 must be finite"),
    (lambda: multichain_opt([3, 2], 7, u_loss=math.inf), r"u_loss = inf must be finite"),
    (lambda: multichain_schedule([3, 2], 7, u_f=math.nan), r"u_f = nan must be finite"),
    (lambda: simulate_multichain(single_chain_ops(3, 3), [3], 3, [1], u_b=-5.0),
     r"u_b = -5.0 must be finite"),
])
def test_step_times_must_be_finite_and_non_negative(call, fragment):
    from rtmem.errors import ChainError
    with pytest.raises(ChainError, match=fragment):
        call()


@pytest.mark.parametrize("call, field", [
    # finite but huge times overflowed the tables to inf, read as infeasible:
    # multichain_opt and binomial_makespan answered inf, and multichain_schedule
    # raised "multi-chain (30,) with b=(0,) needs at least 3 slots, got 5"
    (lambda: multichain_opt((30,), 5, u_f=1e307), "u_f"),
    (lambda: multichain_schedule((30,), 5, u_f=1e307), "u_f"),
    (lambda: multichain_schedule((10, 20), 6, u_b=1e307), "u_b"),
    (lambda: binomial_makespan(30, 5, u_f=1e307), "u_f"),
    (lambda: opt0_table(30, 5, u_f=1e307), "u_f"),
    (lambda: simulate_multichain(single_chain_ops(30, 5), [30], 5, u_f=1e307), "u_f"),
])
def test_step_times_whose_makespan_overflows_are_refused(call, field):
    from rtmem.errors import ChainError
    with pytest.raises(ChainError, match="too large.*express times in larger units") as err:
        call()
    assert err.value.field == field


def test_huge_but_bounded_step_times_give_finite_makespans():
    # the bound is Chain's, (l + 1) l u_f + ...: 1e305 s steps on 30 stages pass
    makespan, ops = multichain_schedule((30,), 5, u_f=1e305)
    assert math.isfinite(makespan) and makespan == multichain_opt((30,), 5, u_f=1e305)
    assert math.isfinite(binomial_makespan(30, 5, u_f=1e305))
    assert math.isfinite(opt0_table(30, 5, u_f=1e305)[0][30, 5])


@pytest.mark.parametrize("L, b, m_min", [
    # Lemma 2 by hand: K~ = K + #{L_i != 0}, plus one unless some L_i = 1 or some
    # empty branch has b_i = 0 (its delta_0 can be dropped at once)
    ((0, 2), (0, 0), 3), ((0, 2), (0, 1), 3), ((0, 2), (1, 0), 4), ((0, 2), (1, 1), 4),
    ((2, 0, 2), (0, 0, 0), 5), ((2, 0, 2), (1, 1, 1), 6), ((0, 1), (1, 1), 3),
    # no forward step at all: K~ = K, and the loss alone fits in K slots
    ((0,), (1,), 1), ((0, 0), (1, 1), 2), ((0, 0), (0, 1), 2)])
def test_empty_branches_set_the_least_slots(L, b, m_min):
    # random instances rarely hit m = m_min exactly with an empty branch: an
    # inverted b test in min_slots or in the DP's fill survived them
    assert min_slots(L, b) == m_min
    for m in (m_min - 1, m_min, m_min + 1):
        dp = multichain_opt(L, m, b)
        assert dp == brute_force_multichain(L, m, b), (L, b, m)
        assert math.isfinite(dp) == (m >= m_min), (L, b, m)
    # the schedule drops an empty branch's delta_0 at the loss when b = 0 (one
    # slot freed at once); the validator requires it gone at the end
    value, ops = multichain_schedule(L, m_min, b)
    assert simulate_multichain(ops, L, m_min, b) == (value, m_min)


def test_validator_rejects_what_the_end_check_alone_would_miss_or_misname():
    S, F, D, B = (lambda i: MultiOp("S", 0, i)), (lambda i: MultiOp("F", 0, i)), \
        (lambda i: MultiOp("D", 0, i)), (lambda i: MultiOp("B", 0, i))
    loss, dbar = MultiOp("L", -1, 0), MultiOp("Dbar", 0, 0)
    # a branch with b = 1 keeps delta_0: its Dbar is the wrong op, named there
    with pytest.raises(ScheduleError, match="must keep delta_0") as e:
        simulate_multichain([S(0), F(1), loss, B(1), dbar], (1,), 2, b=(1,))
    assert e.value.op_index == 4
    # a second copy of a_0 left over at the end
    with pytest.raises(ScheduleError, match="ends with") as e:
        simulate_multichain([S(0), S(0), F(1), loss, B(1)], (1,), 3, b=(1,))
    assert e.value.reason == "incomplete"
    # the loss runs once, even when a second copy of a_L could feed it
    with pytest.raises(ScheduleError, match="the loss runs once") as e:
        simulate_multichain([S(0), F(1), S(1), loss, loss, B(1)], (1,), 3, b=(1,))
    assert e.value.op_index == 4
    # a forward step past the branch's last value (its output dropped again)
    with pytest.raises(ScheduleError, match="step 2 outside 1..1") as e:
        simulate_multichain([S(0), F(1), S(1), F(2), D(2), loss, B(1)], (1,), 3, b=(1,))
    assert e.value.op_index == 3


def test_validator_refuses_a_dbar_before_the_loss_and_a_loss_without_its_input():
    S, F, B = (lambda i: MultiOp("S", 0, i)), (lambda i: MultiOp("F", 0, i)), \
        (lambda i: MultiOp("B", 0, i))
    loss, dbar = MultiOp("L", -1, 0), MultiOp("Dbar", 0, 0)
    assert simulate_multichain([S(0), F(1), loss, B(1), dbar], (1,), 2) == (3.0, 2)
    # dropping delta_0 before the branch has one freed a slot for nothing
    with pytest.raises(ScheduleError, match="not finished") as e:
        simulate_multichain([S(0), F(1), dbar, loss, B(1), dbar], (1,), 2)
    assert e.value.op_index == 2
    # the loss reads a_L of every branch: a_2 was never computed here
    with pytest.raises(ScheduleError, match="needs a_2 of branch 0") as e:
        simulate_multichain([S(0), F(1), loss, B(1)], (2,), 3, b=(1,))
    assert e.value.op_index == 2


def test_table_refuses_lengths_beyond_the_instance_it_was_built_for():
    from rtmem.errors import RtmemError
    T = multichain_table((2, 3), 8)
    assert T.opt((2, 3), 8) == 2 * 5 + 1          # m >= sum(L_i + 1): no recomputation
    # (3, 2) indexes the cell of (0, 3) and (3, 3) one past the table
    for L in ((3, 2), (3, 3), (2, 4)):
        with pytest.raises(RtmemError, match="outside the table"):
            T.opt(L, 8)


def test_revolve_ops_with_a_smaller_argmin_table_builds_its_own():
    from rtmem.planners.revolve import revolve_ops
    small = opt0_table(3, 3)[1]
    for steps, m in ((5, 3), (3, 5), (6, 4)):
        assert revolve_ops(steps, m, arg=small) == revolve_ops(steps, m), (steps, m)


def test_single_stage_chain_with_its_loss_needs_two_slots():
    # SINGLE(1, m) is ADJCHAIN(0, m), which needs a_0 and delta_1: m_min((1,)) = 2
    # (Lemma 2: K~ = 2, and L_1 = 1)
    from rtmem.planners.revolve import revolve_ops
    assert min_slots((1,)) == 2
    assert revolve_ops(0, 2) == [MultiOp("B", 0, 1)]
    ops = single_chain_ops(1, 2)
    assert [str(op) for op in ops] == ["S^0_0", "F^0_1", "Loss", "B^0_1"]
    assert simulate_multichain(ops, (1,), 2, b=(1,)) == (3.0, 2)
    with pytest.raises(InfeasibleError):
        revolve_ops(0, 1)


@pytest.mark.parametrize("entry", [0, -3, 99])
def test_revolve_walks_refuse_an_entry_no_argmin_table_holds(entry):
    # revolve_schedule's jitted walk writes its op arrays without bounds checks: an
    # entry outside 1..l made it write past them (a crash) and revolve_ops loop
    n, m = 9, 4
    good = revolve_argmins(n, m)
    bad = good.copy()
    bad[n, m] = entry                      # the first entry both walks read
    for walk in (lambda: revolve_schedule(n, m, arg=bad), lambda: revolve_ops(n, m, arg=bad)):
        with pytest.raises(ScheduleError, match=rf"arg\[{n}, {m}\] = {entry} is not a "
                                                rf"Revolve argmin \(1 <= i <= {n}\)") as err:
            walk()
        assert err.value.reason == "bad-argmin-table"
    assert revolve_schedule(n, m, arg=good) == revolve_schedule(n, m)


def test_revolve_walks_refuse_a_table_that_runs_out_of_slots():
    # every step keeps one value and gives the rest of the interval one slot less:
    # with m = 3, a first step of i = 1 leaves ADJCHAIN(n - 1, 2), which needs 3
    n, m = 6, 3
    bad = revolve_argmins(n, m).copy()
    bad[n, m] = 1
    for walk in (lambda: revolve_schedule(n, m, arg=bad), lambda: revolve_ops(n, m, arg=bad)):
        with pytest.raises(ScheduleError, match=rf"ADJCHAIN\({n - 1}, 2\), which needs 3"):
            walk()
