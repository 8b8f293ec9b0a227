"""The corrected floating DP (rtmem.planners.floating) against exhaustive search
(thesis-remat.md erratum 16, properties 2-4, 9, 12)."""

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _remat_cases import erratum_16_chain, persistence_counterexample
from rtmem.errors import InfeasibleError, PlatformError, RtmemError
from rtmem.planners import Chain, Platform, simulate, store_all_schedule
from rtmem.planners.floating import plan_floating
from rtmem.planners.plan import Plan
from rtmem.planners.remat import min_feasible_memory, plan_remat
from rtmem.planners.schedule import Op
from rtmem.planners.simulator import check_no_recompute
from rtmem.planners.testing import chains
from rtmem.planners.testing.bruteforce import brute_force_remat

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def least_floating_budget(chain):
    """The least budget (bytes) plan_floating accepts, as its InfeasibleError states."""
    try:
        plan_floating(chain, 1)
        return 1
    except InfeasibleError as e:
        return e.min_feasible


def draw_budget(draw, chain):
    """A budget (bytes) for ``chain``: two times in three from the planner's least
    budget up to just over the store-all peak, else from the chain input and
    weights up to one byte under the least budget, so both branches of the tests
    run. Hypothesis favours the low end of a range: one range from the input and
    weights up left 3-28% of the examples feasible (3 x 60 draws), now ~60%."""
    hi = max(1, int(simulate(chain, store_all_schedule(chain.n), Platform(math.inf)).peak))
    fixed = max(1, int(chain.x0) + int(chain.w.sum()))
    least = least_floating_budget(chain)
    feasible = st.integers(least, max(least, hi) + 2)
    below = st.integers(min(fixed, least - 1), least - 1) if least > 1 else feasible
    return draw(st.one_of(feasible, feasible, below))


@st.composite
def small_case(draw):
    chain = draw(chains(1, 4, small=True))
    return chain, draw_budget(draw, chain)


def makespan_or_inf(planner, chain, budget, **kw):
    try:
        return planner(chain, budget, **kw).makespan
    except InfeasibleError:
        return math.inf


@SETTINGS
@given(small_case())
def test_floating_equals_brute_force(case):
    chain, budget = case
    best, _ = brute_force_remat(chain, budget)
    assert makespan_or_inf(plan_floating, chain, budget) == best


@SETTINGS
@given(small_case())
def test_floating_plan_is_valid_and_no_worse_than_persistent(case):
    chain, budget = case
    try:
        plan = plan_floating(chain, budget)
    except InfeasibleError as e:
        assert budget < min_feasible_memory(chain)        # C_MP infeasible as well
        # the least budget is stated, and it works
        assert budget < e.min_feasible <= min_feasible_memory(chain)
        assert plan_floating(chain, e.min_feasible).peak <= e.min_feasible
        return
    res = simulate(chain, plan.schedule, Platform(budget))
    assert res.peak <= budget and res.makespan == plan.info["dp_makespan"]
    assert plan.makespan <= makespan_or_inf(plan_remat, chain, budget, slots=budget)
    # property 12: F_all at most once per stage, each B after its F_all
    alls = [s for op, s, _ in plan.schedule if op == Op.F_ALL]
    assert len(alls) == len(set(alls))


def test_erratum_16_instance_is_closed():
    chain = erratum_16_chain()
    plan = plan_floating(chain, 20)
    assert plan.makespan == 39 and plan.peak <= 20
    assert plan_remat(chain, 20, slots=20).makespan == 42


@pytest.mark.parametrize("n", [3, 4, 5, 6])
def test_persistence_counterexample_reaches_exhaustive_value(n):
    # property 9: floating DP = exhaustive = min(3n-2, 2n+2) at M = 15
    chain = persistence_counterexample(n)
    assert plan_floating(chain, 15).makespan == min(3 * n - 2, 2 * n + 2)


def test_discretized_floating_plan_fits_in_bytes():
    chain = Chain(u_f=[1, 2, 1, 3, 2], u_b=[2, 3, 2, 4, 2], x=[300, 500, 200, 700, 100],
                  xbar=[600, 900, 500, 1200, 300], x0=250, w=[10, 20, 10, 30, 5])
    budget = min_feasible_memory(chain) + 700
    plan = plan_floating(chain, budget, slots=80)
    assert simulate(chain, plan.schedule, Platform(budget)).peak <= budget


def test_refuses_long_chains_and_unlimited_memory():
    with pytest.raises(RtmemError, match="too many"):
        plan_floating(Chain.homogeneous(20), 100)
    with pytest.raises(RtmemError, match="finite"):
        plan_floating(Chain.homogeneous(3), "inf")


def test_rounding_to_slots_retries_in_exact_bytes():
    # audit: with 200 slots (13-byte) the DP has no schedule at the least budget,
    # which 1-byte slots solve (38 s, as brute force and plan_remat find)
    chain = Chain(u_f=[4, 1, 1, 1, 5], u_b=[3, 5, 3, 5, 1], x=[121, 330, 242, 530, 506],
                  xbar=[757, 432, 498, 654, 1038], x0=113)
    plan = plan_floating(chain, 2717, slots=200)
    assert plan.makespan == 38.0 and plan.info["method"] == "exact"
    assert plan.info["slot_bytes"] == 1
    assert simulate(chain, plan.schedule, Platform(2717)).peak <= 2717
    assert plan_floating(chain, 2717).info["method"] == "dp"      # exact from the start


def test_infeasible_budget_states_the_least_budget():
    chain = erratum_16_chain()
    least = min_feasible_memory(chain)
    for budget, slots in ((least - 1, None), (least - 1, 5), (1, None)):
        with pytest.raises(InfeasibleError) as err:
            plan_floating(chain, budget, slots=slots)
        assert err.value.min_feasible == least and err.value.budget == budget
        assert f"{least:,} bytes" in str(err.value)
    assert plan_floating(chain, least).peak <= least


def test_falls_back_to_the_persistent_plan_when_exact_bytes_are_too_many(monkeypatch):
    import rtmem.planners.floating as floating
    chain = Chain(u_f=[4, 1, 1, 1, 5], u_b=[3, 5, 3, 5, 1], x=[121, 330, 242, 530, 506],
                  xbar=[757, 432, 498, 654, 1038], x0=113)
    # the 200-slot table fits, the exact one (2,605 columns) does not
    monkeypatch.setattr(floating, "MAX_FLOATING_TABLE_BYTES", 6 ** 3 * 1000 * 8)
    plan = plan_floating(chain, 2717, slots=200)
    assert plan.info["method"] == "persistent" and plan.algorithm == "floating"
    assert plan.makespan == plan_remat(chain, 2717, slots=200).makespan == 38.0
    assert Plan.from_json(plan.to_json()) == plan
    # the persistent plan is planned with the slots asked: at 2,720 bytes, 200 slots
    # (13 bytes, refined to 3) and the default 500 (5 bytes, refined to 1) differ
    keys = ("slot_bytes", "slots", "refined", "method")
    plan = plan_floating(chain, 2720, slots=200)
    persistent = plan_remat(chain, 2720, slots=200)
    assert plan.info["method"] == "persistent" and plan.schedule == persistent.schedule
    assert [plan.info["persistent"][k] for k in keys] == [persistent.info[k] for k in keys]
    assert plan.info["persistent"]["slot_bytes"] != plan_remat(chain, 2720).info["slot_bytes"]


def test_a_budget_that_leaves_nothing_after_the_stored_activation_is_enough():
    # one stage, a 2-byte stored activation, a 2-byte budget: F_all 0 leaves 0 bytes
    # free and still fits, so nothing is recomputed (8 + 1 s); refusing a remainder
    # of 0 recomputed the forward (17 s)
    chain = Chain(u_f=[8], u_b=[1], x=[0], xbar=[2], x0=0)
    plan = plan_floating(chain, 2)
    assert plan.makespan == 9.0 and plan.peak == 2


def test_a_budget_of_just_the_chain_input_says_no_schedule_fits():
    # 3 bytes of input leave 0 for activations: not "the chain input and weights
    # alone need 3 bytes, more than the budget 3"
    chain = Chain(u_f=[1, 2], u_b=[1, 1], x=[0, 0], xbar=[0, 0], x0=3)
    with pytest.raises(InfeasibleError, match="no schedule of the chain fits in 3 bytes"):
        plan_floating(chain, 3)


@st.composite
def flagged_case(draw):
    chain = draw(chains(1, 4, small=True, no_recompute=True))
    return chain, draw_budget(draw, chain)        # the least budget of the flagged chain


@SETTINGS
@given(flagged_case())
def test_flagged_stages_run_once_and_match_exhaustive_search(case):
    # plan_floating refused chains with no_recompute stages; its DP now never
    # runs F_ck / F_none on one (their B needs the F_all, so that would be a
    # second forward). Exhaustive search under the same rule is the oracle
    chain, budget = case
    best, _ = brute_force_remat(chain, budget)
    try:
        plan = plan_floating(chain, budget)
    except InfeasibleError as e:
        assert budget < e.min_feasible
        plan = plan_floating(chain, e.min_feasible)          # the least budget stated works
        check_no_recompute(chain, plan.schedule)
        assert simulate(chain, plan.schedule, Platform(e.min_feasible)).peak <= e.min_feasible
        assert math.isinf(best)
        return
    check_no_recompute(chain, plan.schedule)
    res = simulate(chain, plan.schedule, Platform(budget))   # refuses a second forward too
    assert res.peak <= budget and res.makespan == plan.makespan
    assert plan.makespan >= best
    assert plan.makespan == best         # as without flags: no miss on random chains
    assert plan.makespan <= makespan_or_inf(plan_remat, chain, budget, slots=budget)


def test_a_flag_costs_the_memory_of_the_recomputation_it_forbids():
    # erratum 16's chain: at 20 bytes the optimum (39 s) runs stage 1 three times;
    # with stage 1 flagged no schedule fits below 26 bytes (exhaustive search
    # agrees), and the least budget the error states is where a plan starts
    chain = erratum_16_chain()
    forwards = [op for op, s, _ in plan_floating(chain, 20).schedule if s == 1 and op != Op.B]
    assert len(forwards) == 3
    flagged = dataclasses.replace(chain, no_recompute=[False, True, False, False])
    with pytest.raises(InfeasibleError) as err:
        plan_floating(flagged, 20)
    assert err.value.min_feasible == 26
    assert math.isinf(brute_force_remat(flagged, 25)[0])
    plan = plan_floating(flagged, 26)
    check_no_recompute(flagged, plan.schedule)
    assert plan.makespan == brute_force_remat(flagged, 26)[0] == 26


@settings(max_examples=20, deadline=None)
@given(chains(1, 4, small=True, no_recompute=True), st.integers(1, 200))
def test_exhaustive_search_reads_a_budget_as_the_planners_do(chain, budget):
    # brute_force_remat(chain, 1.5) was accepted while 0 and -1 were refused: as
    # every planner (and Platform) does, a fraction of a byte rounds down (a
    # budget is never exceeded), so the oracle and the DP it checks answer for
    # the same whole-byte budget, and below 1 byte both refuse alike
    fraction = budget + 0.5
    best, schedule = brute_force_remat(chain, fraction)
    assert (best, schedule) == brute_force_remat(chain, budget)
    assert makespan_or_inf(plan_floating, chain, fraction) == best
    for bad in (0.5, 0, -1, "-1GiB"):
        with pytest.raises(PlatformError) as oracle:
            brute_force_remat(chain, bad)
        with pytest.raises(PlatformError) as planner:
            plan_floating(chain, bad)
        assert str(oracle.value) == str(planner.value)
