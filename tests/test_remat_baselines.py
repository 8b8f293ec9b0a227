"""Baseline planners (store-all, checkpoint_sequential, sqrt(n), Revolve) and the
Plan value type."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtmem.errors import InfeasibleError, ScheduleError
from rtmem.planners import Chain, Platform, Schedule, builtin, sequential_schedule, simulate
from rtmem.planners.baselines import plan_sequential, plan_sqrt, plan_store_all, segment_bounds
from rtmem.planners.plan import Plan, as_budget
from rtmem.planners.remat import compare_remat, plan_remat
from rtmem.planners.revolve import plan_revolve
from rtmem.planners.schedule import Op
from rtmem.planners.testing import chains

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(chains(1, 10))
def test_store_all_is_the_no_remat_makespan(chain):
    plan = plan_store_all(chain, math.inf)
    assert plan.makespan == pytest.approx(chain.compute_time, rel=1e-12)
    if plan.peak > 1:
        with pytest.raises(InfeasibleError) as err:
            plan_store_all(chain, plan.peak - 1)
        assert err.value.min_feasible == plan.peak


@SETTINGS
@given(chains(1, 10), st.floats(0, 1))
def test_sequential_picks_the_fastest_fitting_segment_count(chain, frac):
    runs = [simulate(chain, sequential_schedule(chain.n, k), Platform(math.inf))
            for k in range(1, chain.n + 1)]
    least = min(r.peak for r in runs)
    budget = max(1, int(least + frac * (max(r.peak for r in runs) - least)))
    plan = plan_sequential(chain, budget)
    fitting = [r.makespan for r in runs if r.peak <= budget]
    assert plan.peak <= budget
    assert plan.makespan == min(fitting)
    assert plan.schedule == sequential_schedule(chain.n, plan.info["segments"])
    if least > 1:
        with pytest.raises(InfeasibleError) as err:
            plan_sequential(chain, least - 1)
        assert err.value.min_feasible == least


def test_sqrt_uses_round_sqrt_n_segments():
    chain = builtin("resnet50")
    plan = plan_sqrt(chain, math.inf)
    assert plan.info["segments"] == round(math.sqrt(chain.n))
    assert plan.algorithm == "sqrt"
    # its refusal names it (it said "sequential: no segment count in 4..4 fits")
    with pytest.raises(InfeasibleError, match=r"^sqrt: no schedule of 4 segments fits") as err:
        plan_sqrt(chain, plan.peak - 1)
    assert err.value.min_feasible == plan.peak


@SETTINGS
@given(chains(1, 9))
def test_revolve_baseline_is_valid_and_never_keeps_abar(chain):
    plan = plan_revolve(chain, math.inf)
    res = simulate(chain, plan.schedule, Platform(max(1, plan.peak)))
    assert res.makespan == plan.makespan
    ops = list(plan.schedule)
    for j, (op, s, _) in enumerate(ops):
        if op == Op.F_ALL:
            assert ops[j + 1][:2] == (Op.B, s)


def test_revolve_uses_less_memory_with_fewer_slots():
    chain = builtin("resnet50")
    full = plan_revolve(chain, math.inf)
    with pytest.raises(InfeasibleError) as err:
        plan_revolve(chain, 1)
    least = err.value.min_feasible
    assert plan_revolve(chain, least).peak == least
    budget = (least + full.peak) // 2
    tight = plan_revolve(chain, budget)
    assert tight.peak <= budget and tight.makespan > full.makespan
    assert tight.info["slots"] < full.info["slots"]


def test_plan_json_round_trip(tmp_path):
    plan = plan_remat(builtin("gpt2-small"), "6GiB")
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.info == plan.info
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan
    unlimited = plan_store_all(builtin("gpt2-small"), "inf")
    assert Plan.from_json(unlimited.to_json()).budget == math.inf
    with pytest.raises(ScheduleError):
        Plan.from_json('{"format": "something else"}')
    assert plan.overhead(unlimited.makespan) >= 0


def test_as_budget_accepts_bytes_strings_and_platforms():
    assert as_budget(1024) == 1024
    assert as_budget("1 KiB") == 1024
    assert as_budget(Platform("2KiB")) == 2048
    assert as_budget("inf") == math.inf


@pytest.mark.parametrize("planner", [plan_remat, plan_store_all, plan_sequential, plan_sqrt,
                                     plan_revolve, "plan_floating"])
def test_every_planner_takes_a_platform_as_its_budget(planner, fresh_seed):
    # DESIGN §4: planners are plan_xxx(chain, platform, ...): the platform a user
    # simulates with is a budget every planner takes, planning as its memory limit
    # alone would (rematerialization moves no data, so bandwidth and channel
    # change nothing), and refusing the same budgets
    import numpy as np

    from rtmem.planners import plan_floating
    planner = plan_floating if planner == "plan_floating" else planner
    rng = np.random.default_rng(fresh_seed)
    n = 5
    chain = Chain(u_f=rng.uniform(1, 3, n), u_b=rng.uniform(2, 6, n),
                  x=rng.integers(100, 1000, n), xbar=rng.integers(1000, 5000, n),
                  w=rng.integers(0, 500, n))
    with pytest.raises(InfeasibleError) as refused:
        planner(chain, Platform(1, "12 GB/s"))
    least, top = refused.value.min_feasible, plan_store_all(chain, math.inf).peak
    assert refused.value.budget == 1 and least > 1
    for budget in (least, (least + 2 * top) // 3, 2 * top):
        platform = Platform(budget, "12 GB/s", "duplex")
        by_bytes, by_platform = planner(chain, budget), planner(chain, platform)
        assert by_platform.schedule == by_bytes.schedule, budget
        assert (by_platform.makespan, by_platform.peak) == (by_bytes.makespan, by_bytes.peak)
        assert by_platform.peak <= budget
        assert simulate(chain, by_platform.schedule, platform).peak == by_platform.peak


def test_compare_remat_reports_every_planner():
    chain = builtin("gpt2-small")
    peak = plan_store_all(chain, math.inf).peak
    # enough slots that rounding sizes up costs little (each size loses < 1 slot)
    results = compare_remat(chain, int(peak * 0.6), slots=5000)
    assert list(results) == ["rotor", "store-all", "sequential", "sqrt", "revolve"]
    assert isinstance(results["store-all"], InfeasibleError)
    rotor = results["rotor"]
    for name in ("sequential", "revolve"):
        other = results[name]
        if isinstance(other, Plan):
            assert rotor.makespan <= other.makespan * 1.001, name


def test_compare_remat_raises_an_infeasible_rotor_plan_first_when_asked(monkeypatch):
    # raise_infeasible (rtmem plan remat): rotor's InfeasibleError, with no
    # baseline planned; by default every entry is still there
    from rtmem.planners import remat
    chain = builtin("resnet50")
    least = remat.min_feasible_memory(chain)
    out = compare_remat(chain, least - 1)
    assert all(isinstance(v, InfeasibleError) for v in out.values())
    monkeypatch.setattr(remat, "plan_store_all", lambda *a: pytest.fail("planned"))
    with pytest.raises(InfeasibleError) as err:
        compare_remat(chain, least - 1, raise_infeasible=True)
    assert err.value.min_feasible == least
    assert str(err.value) == str(out["rotor"])


def _sequential_by_ops(n, segments):
    """The checkpoint_sequential schedule op by op (the definition the numpy
    construction of sequential_schedule must reproduce)."""
    bounds = segment_bounds(n, segments)
    ops = []
    for s, e in bounds[:-1]:
        ops += [(Op.F_CK, s)] + [(Op.F_NONE, i) for i in range(s + 1, e)]
    s, e = bounds[-1]
    ops += [(Op.F_ALL, i) for i in range(s, e)] + [(Op.LOSS, 0)]
    ops += [(Op.B, i) for i in reversed(range(s, e))]
    for s, e in reversed(bounds[:-1]):
        ops += [(Op.F_ALL, i) for i in range(s, e)] + [(Op.B, i) for i in reversed(range(s, e))]
    return Schedule.from_ops(ops)


def test_sequential_schedule_matches_its_definition():
    for n in range(1, 14):
        for k in range(1, n + 1):
            assert sequential_schedule(n, k) == _sequential_by_ops(n, k), (n, k)


@settings(max_examples=40, deadline=None)
@given(chains(1, 7))
def test_early_exit_returns_what_a_full_scan_returns(chain):
    # plan_sequential / plan_revolve stop at their first candidate when it fits
    # (it recomputes nothing); a scan of every candidate must agree.
    from rtmem.planners.baselines import fastest_fitting
    from rtmem.planners.revolve import opt0_table, revolve_schedule
    n = chain.n
    arg = opt0_table(n, n + 2)[1]
    families = {
        "sequential": (plan_sequential, [(k, sequential_schedule(n, k)) for k in range(1, n + 1)]),
        "revolve": (plan_revolve, [(m, revolve_schedule(n, m, arg))
                                   for m in range(n + 2, 2, -1)]),
    }
    for name, (planner, candidates) in families.items():
        peaks = [simulate(chain, s, Platform(math.inf)).peak for _, s in candidates]
        for budget in sorted(set(peaks) - {0}):      # a budget is > 0 bytes
            fast = planner(chain, budget)
            full = fastest_fitting(chain, budget, candidates, name, "x", "candidate")
            assert fast.schedule == full.schedule and fast.makespan == full.makespan


def test_sequential_simulates_only_the_segment_counts_that_can_win(monkeypatch):
    # plan_sequential simulated all n segment counts, O(n) operations each: O(n^2),
    # 11 s for 1,000 stages. Their makespans are known before simulating (each
    # count recomputes a known prefix of forwards), so counts predicted slower than
    # the best fitting one are skipped: the same plan as the full scan
    import numpy as np

    import rtmem.planners.baselines as baselines
    from rtmem.planners.baselines import _segmented
    rng = np.random.default_rng()
    n = 120
    x = rng.integers(1, 1000, n)
    chain = Chain(u_f=rng.uniform(0.5, 2, n), u_b=rng.uniform(0.5, 2, n), x=x,
                  xbar=x + rng.integers(0, 1000, n), w=rng.integers(0, 50, n),
                  o_f=rng.integers(0, 50, n), x0=int(x[0]))
    peaks = [simulate(chain, sequential_schedule(n, k), Platform(math.inf)).peak
             for k in range(1, n + 1)]
    budgets = [min(peaks), plan_sqrt(chain, math.inf).peak, (min(peaks) + max(peaks)) // 2]
    full = {b: _segmented(chain, b, range(1, n + 1), "sequential") for b in budgets}
    simulated = []
    real_simulate = baselines.simulate

    def counting(*args):
        simulated.append(1)
        return real_simulate(*args)

    monkeypatch.setattr(baselines, "simulate", counting)
    counts = []
    for budget in budgets:
        simulated.clear()
        plan = plan_sequential(chain, budget)
        assert plan == full[budget] and plan.info == full[budget].info, budget
        counts.append(len(simulated))
    # near the least budget only counts that recompute much fit and most counts are
    # still simulated; half way to the store-all peak a count recomputing little
    # fits and ends the scan early (all n were simulated before)
    assert counts[2] < n // 10, counts
    simulated.clear()
    with pytest.raises(InfeasibleError) as err:      # nothing fits: every count is tried
        plan_sequential(chain, min(peaks) - 1)
    assert err.value.min_feasible == min(peaks) and len(simulated) == n


def test_compare_remat_leaves_out_only_revolve_on_chains_too_long_for_it(monkeypatch):
    # plan_revolve's Opt_0 table is refused beyond 2,712 stages (RtmemError), and
    # compare_remat did not catch it: the whole comparison failed although every
    # other planner had a plan. The refusal also told the user to pass fewer slots
    # (plan_revolve takes none) or to use plan_remat (compare_remat's own planner).
    from rtmem.errors import RtmemError
    from rtmem.planners import revolve
    # 25 stages at most (500 x 25^2 schedule steps + the argmins'): fast
    monkeypatch.setattr(revolve, "MAX_OPT0_STEPS", 320_000)
    chain = Chain.homogeneous(30)
    out = compare_remat(chain, math.inf)
    assert list(out) == ["rotor", "store-all", "sequential", "sqrt", "revolve"]
    assert all(isinstance(out[k], Plan) for k in list(out)[:-1])
    skipped = out["revolve"]
    assert isinstance(skipped, InfeasibleError) and skipped.min_feasible is None
    assert str(skipped) == "not attempted: 30 stages, plan_revolve plans at most 25"
    assert skipped.budget == math.inf
    with pytest.raises(RtmemError, match="has 30 stages, more than the 25 it plans") as err:
        plan_revolve(chain, math.inf)
    assert "plan_remat or plan_sequential" in str(err.value)
    # it names the limit it applies; it quoted the bytes and steps of an Opt_0
    # table that plan_revolve no longer fills (it walks revolve_argmins' table)
    assert "max_revolve_stages()" in str(err.value)
    assert "takes" not in str(err.value)
    assert "slots" not in str(err.value) and "binomial_makespan" not in str(err.value)
    assert plan_revolve(Chain.homogeneous(25), math.inf).peak > 0
    assert not revolve._plan_revolve_fits(26)
    monkeypatch.undo()
    assert revolve.max_revolve_stages() == 4410          # with the default limits


def test_plan_revolve_s_limit_comes_from_the_argmins_it_fills_not_the_opt0_fill():
    # plan_revolve fills only the O(n^2 log n) argmin table (revolve_argmins), but
    # its limit was opt0_table's O(n^3) fill's: 2,712 stages. Now it is its own
    # cost, argmins and schedules within the same bytes and ~10 s of steps
    from rtmem.planners import revolve
    longest = revolve.max_revolve_stages()
    assert revolve._plan_revolve_fits(longest) and not revolve._plan_revolve_fits(longest + 1)
    assert not revolve._table_fits(longest, longest + 2)     # the Opt_0 fill would not
    table_bytes = revolve._argmin_cost(longest, longest + 2)[0]
    assert table_bytes <= revolve._plan_revolve_cost(longest)[0] <= revolve.MAX_OPT0_TABLE_BYTES
    assert longest > 2712


def test_compare_remat_checks_revolve_s_chain_length_once(monkeypatch):
    # compare_remat compared the chain with max_revolve_stages() and plan_revolve
    # compared it again: one check (revolve._too_long) now serves both, and each
    # entry point keeps its answer to a chain too long (the test above)
    from rtmem.planners import revolve
    calls = []
    longest = revolve.max_revolve_stages
    monkeypatch.setattr(revolve, "max_revolve_stages", lambda: calls.append(1) or longest())
    out = compare_remat(Chain.homogeneous(10), math.inf)   # rotor plans no baseline here
    assert isinstance(out["revolve"], Plan) and len(calls) == 1
    plan_revolve(Chain.homogeneous(10), math.inf)
    assert len(calls) == 2


def test_numpy_segment_count_gives_a_json_plan():
    import json

    import numpy as np
    chain = builtin("resnet50")
    plan = plan_sequential(chain, math.inf, segments=np.int64(2))
    assert type(plan.info["segments"]) is int
    assert json.loads(plan.to_json())["info"]["segments"] == 2
    assert Plan.from_json(plan.to_json()) == plan
    assert plan_sqrt(chain, math.inf).to_json()


def test_plan_keeps_integer_peaks_and_budgets_exact():
    # int(float(peak)) rounded anything above 2**53 bytes
    s = Schedule.from_text("F_all 0, L, B 0")
    plan = Plan(s, 1.0, 2**60 + 1, 2**61 + 3, "test")
    assert plan.peak == 2**60 + 1 and plan.budget == 2**61 + 3
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.peak == 2**60 + 1
    import numpy as np
    assert Plan(s, 1.0, np.int64(2**55 + 1), 2**56, "test").peak == 2**55 + 1
    assert Plan(s, 1.0, 12.0, 100.5, "test").peak == 12           # budgets round down
    with pytest.raises(ScheduleError, match="whole number"):
        Plan(s, 1.0, 12.5, 100, "test")


def test_plan_accepts_a_peak_just_below_2_62_and_names_the_bound_that_failed():
    # Plan compared float(peak) < 2**62 and float(2**62 - 1) == 2**62: every planner
    # refused a valid chain peaking within ~256 bytes of 2**62, saying "must be >= 0"
    chain = Chain(u_f=[1.0], u_b=[1.0], x=[0], xbar=[0], x0=2**61 - 1, o_b=[1])
    for planner in (plan_store_all, plan_remat, plan_sequential):
        assert planner(chain, math.inf).peak == 2**62 - 1
    s = Schedule.from_text("F_all 0, L, B 0")
    with pytest.raises(ScheduleError, match=r"peak 4611686018427387904 bytes must be below "
                                            r"2\*\*62") as err:
        Plan(s, 1.0, 2**62, math.inf, "test")
    assert "makespan" not in str(err.value) and "budget" not in str(err.value)
    with pytest.raises(ScheduleError, match=r"peak -1 bytes must be >= 0") as err:
        Plan(s, 1.0, -1, 10, "test")
    assert "below 2" not in str(err.value)
    with pytest.raises(ScheduleError, match=r"plan: budget 0 bytes must be > 0; [a-z]"):
        Plan(s, 1.0, 1, 0, "test")
    with pytest.raises(ScheduleError,
                       match=r"plan: makespan -1.0 s must be finite and >= 0; [a-z]"):
        Plan(s, -1.0, 1, 10, "test")


def test_integer_budgets_and_sizes_above_2_53_stay_exact():
    # through float64, the budget 2**54 + 7 became 2**54 + 8 (the plans below
    # came back with peak 2**54 + 8 > the budget asked) and the size 2**54 + 2
    # became 2**54 (the chain held less memory than given)
    import numpy as np
    assert Platform(2**54 + 7).memory == 2**54 + 7
    assert Platform(np.int64(2**55 + 1)).memory == 2**55 + 1
    chain = Chain(u_f=[1], u_b=[1], x=[4], xbar=[2**54 + 4])       # store-all peak 2**54 + 8
    for planner in (plan_store_all, plan_remat, plan_sequential):
        with pytest.raises(InfeasibleError):
            planner(chain, 2**54 + 7)
    exact = Chain(u_f=[1], u_b=[1], x=[2**54 + 2], xbar=np.array([2**54 + 3]), x0=2**54 + 1,
                  w=[2**53 + 1])
    assert (exact.x[0], exact.xbar[0], exact.x0, exact.w[0]) == \
        (2**54 + 2, 2**54 + 3, 2**54 + 1, 2**53 + 1)
    assert Chain.from_json(exact.to_json()) == exact


def test_a_budget_equal_to_the_peak_fits():
    # store-all on this chain peaks at 130 bytes (hand-computed in
    # test_simulator.test_store_all_exact_values): 130 fits, 129 does not
    chain = Chain(u_f=[1, 2, 3], u_b=[2, 3, 4], x=[10, 20, 30], xbar=[15, 25, 35], x0=5,
                  u_loss=1)
    assert plan_store_all(chain, 130).peak == 130
    with pytest.raises(InfeasibleError) as err:
        plan_store_all(chain, 129)
    assert err.value.min_feasible == 130


def test_sequential_ties_go_to_fewer_segments():
    # 7 unit stages: 2 segments recompute stages 0..2, 4 segments stages 0..2 too
    # (3 segments of one stage), so both take 7 + 7 + 3 = 17 s; 3 segments
    # recompute 4 stages. With store-all (1 segment) out of budget, the tie goes
    # to 2 segments, as documented.
    chain = Chain.homogeneous(7, x=1, xbar=2)
    peaks = {k: simulate(chain, sequential_schedule(7, k), Platform(math.inf)).peak
             for k in (1, 2, 4)}
    budget = max(peaks[2], peaks[4])
    assert peaks[1] > budget
    plan = plan_sequential(chain, budget)
    assert plan.makespan == 17.0 and plan.info["segments"] == 2


@pytest.mark.parametrize("n, segments", [(3, 2), (7, 3)])
def test_sqrt_rounds_sqrt_n_to_the_nearest(n, segments):
    # round(sqrt(3)) = round(1.73) = 2 and round(sqrt(7)) = round(2.65) = 3
    # (truncation would give 1 and 2)
    plan = plan_sqrt(Chain.homogeneous(n), math.inf)
    assert plan.info["segments"] == segments


def test_plan_overhead_is_the_relative_slowdown():
    s = Schedule.from_text("F_all 0, L, B 0")
    plan = Plan(s, 3.0, 10, 100, "test")
    assert plan.overhead(2.0) == 0.5 and plan.overhead(3.0) == 0.0
    # a zero reference: no slowdown for a zero makespan, an unbounded one otherwise
    assert plan.overhead(0.0) == math.inf
    assert Plan(s, 0.0, 10, 100, "test").overhead(0.0) == 0.0


def test_plans_that_differ_in_any_field_are_not_equal():
    s = Schedule.from_text("F_all 0, L, B 0")
    base = dict(schedule=s, makespan=3.0, peak=10, budget=100, algorithm="test",
                info={"slots": 3})
    assert Plan(**base) == Plan(**base)
    for key, value in (("schedule", Schedule.from_text("F_ck 0, F_all 0, L, B 0")),
                       ("makespan", 4.0), ("peak", 11), ("budget", math.inf),
                       ("algorithm", "other"), ("info", {"slots": 4})):
        assert Plan(**base) != Plan(**{**base, key: value}), key


def test_fastest_fitting_scans_past_a_first_candidate_that_does_not_fit():
    # first_is_fastest lets the scan stop at the first candidate only when that
    # one fits; here store-all (first) does not, and the fastest fitting
    # candidate is the last one given: 2 segments recompute stage 0 only
    # (3 forwards, 3 backwards, no loss time, 1 recomputation: 7 s), 3 segments
    # stages 0 and 1 (8 s)
    from rtmem.planners.baselines import fastest_fitting
    chain = Chain.homogeneous(3, x=1, xbar=2)
    candidates = [(k, sequential_schedule(3, k)) for k in (1, 3, 2)]
    runs = {k: simulate(chain, s, Platform(math.inf)) for k, s in candidates}
    assert (runs[3].makespan, runs[2].makespan) == (8.0, 7.0)
    budget = max(runs[2].peak, runs[3].peak)
    assert runs[1].peak > budget
    plan = fastest_fitting(chain, budget, candidates, "sequential", "segments", "count",
                           first_is_fastest=True)
    assert plan.info["segments"] == 2 and plan.makespan == 7.0
