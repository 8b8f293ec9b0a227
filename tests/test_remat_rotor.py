"""ROTOR's persistent DP (rtmem.planners.rotor) and plan_remat, against the
simulator, the brute-force oracle and the plain-Python reference table
(thesis-remat.md §7.1)."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _remat_cases import erratum_16_chain, persistence_counterexample
from rtmem.errors import ChainError, InfeasibleError, ScheduleError
from rtmem.planners import Chain, Platform, Schedule, plan_floating, simulate, store_all_schedule
from rtmem.planners.baselines import plan_sequential, plan_store_all
from rtmem.planners.remat import compare_remat, min_feasible_memory, plan_remat
from rtmem.planners.revolve import plan_revolve
from rtmem.planners.rotor import (discretize, min_memory, pair_index, persistent_table,
                                  reference_min_memory, reference_persistent_table,
                                  stage_arrays)
from rtmem.planners.schedule import Op
from rtmem.planners.testing import chains
from rtmem.planners.testing.bruteforce import brute_force_remat

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def store_all_peak(chain):
    return simulate(chain, store_all_schedule(chain.n), Platform(math.inf)).peak


def fixed_bytes(chain):
    return int(chain.x0) + int(chain.w.sum())


@st.composite
def chain_and_budget(draw, max_stages=4, small=True, **kw):
    """A chain and a budget between just under its least feasible memory and just
    over its no-recomputation peak."""
    chain = draw(chains(1, max_stages, small=small, **kw))
    lo, hi = min_feasible_memory(chain), store_all_peak(chain)
    budget = draw(st.integers(max(1, lo - 2), max(lo, hi) + 2))
    return chain, budget


# ------------------------------------------------------------ reference table
@SETTINGS
@given(chains(1, 5, small=True), st.integers(1, 3))
def test_jitted_table_equals_reference_entry_by_entry(chain, slot):
    arrays = discretize(stage_arrays(chain), slot)
    M = (store_all_peak(chain) - fixed_bytes(chain)) // slot + 2
    table = persistent_table(arrays, M)[0]
    ref = reference_persistent_table(arrays, M)
    np.testing.assert_array_equal(table, ref)


def test_reference_table_is_not_trivial():
    # guards the comparison above against two all-inf tables
    chain = Chain(u_f=[1, 2, 3], u_b=[2, 2, 2], x=[2, 3, 1], xbar=[4, 3, 2], x0=1)
    arrays = stage_arrays(chain)
    ref = reference_persistent_table(arrays, 20)
    assert np.isfinite(ref).sum() > 50
    assert ref[pair_index(4)[0, 3], 20] == chain.compute_time


# --------------------------------------------------------- soundness (prop 1)
@SETTINGS
@given(chain_and_budget(max_stages=6, small=True))
def test_plan_is_valid_and_prediction_is_exact_with_integer_data(case):
    chain, budget = case
    try:
        plan = plan_remat(chain, budget, slots=budget)
    except InfeasibleError as e:
        assert budget < e.min_feasible == min_feasible_memory(chain)
        return
    res = simulate(chain, plan.schedule, Platform(budget))
    assert res.peak == plan.peak <= budget
    assert res.makespan == plan.makespan == plan.info["dp_makespan"]
    assert plan.makespan >= chain.compute_time          # property 7
    # property 13: L+1 backward ops in order, each B after its F_all
    backs = [(op, s) for op, s, _ in plan.schedule if op in (Op.B, Op.LOSS)]
    assert backs == [(Op.LOSS, 0)] + [(Op.B, i) for i in reversed(range(chain.n))]


@SETTINGS
@given(chains(2, 12, small=False), st.floats(0.0, 1.0), st.sampled_from([7, 50, 500]))
def test_plan_fits_in_bytes_with_rounding(chain, frac, slots):
    # property 11: slot = floor(M / S), sizes rounded up -> valid in bytes
    lo, hi = min_feasible_memory(chain), store_all_peak(chain)
    budget = max(1, int(lo + frac * (hi - lo)))
    plan = plan_remat(chain, budget, slots=slots)
    res = simulate(chain, plan.schedule, Platform(budget))
    assert res.peak <= budget
    check_winner(plan, res)


def check_winner(plan, res):
    """The plan is the fastest of its candidates, and the DP's prediction is exact
    when the DP's schedule won."""
    assert res.makespan == plan.makespan == plan.info["candidates"][plan.info["method"]]
    assert plan.makespan == min(plan.info["candidates"].values())
    if plan.info["method"] == "dp":
        assert res.makespan == pytest.approx(plan.info["dp_makespan"], rel=1e-9)


# ------------------------------------------------------- optimality (prop 3)
@SETTINGS
@given(chain_and_budget(max_stages=4))
def test_never_better_than_brute_force(case):
    chain, budget = case
    best, sched = brute_force_remat(chain, budget)
    try:
        plan = plan_remat(chain, budget, slots=budget)
    except InfeasibleError:
        assert best == math.inf                         # property 2
        return
    assert sched is not None and simulate(chain, sched, Platform(budget)).makespan == best
    # C_MP is exact among persistent schedules only (erratum 16 of thesis-remat.md)
    assert plan.makespan >= best


@SETTINGS
@given(chains(1, 4, small=True, homogeneous=True), st.data())
def test_equals_brute_force_on_homogeneous_chains(chain, data):
    budget = data.draw(st.integers(max(1, min_feasible_memory(chain) - 1),
                                   store_all_peak(chain) + 1))
    best, _ = brute_force_remat(chain, budget)
    try:
        got = plan_remat(chain, budget, slots=budget).makespan
    except InfeasibleError:
        got = math.inf
    assert got == best


def test_exhaustive_search_drops_a_n_at_the_loss_when_abar_n_is_not_there():
    # One stage, x0 = a1 = 1, abar1 = 10, o_loss = 5. Store-all holds a0 + abar1 +
    # delta1 + o_loss = 17 at the loss: over 13. "F_ck 0, L, F_all 0, B 0" holds 8
    # at the loss, which drops a1 (abar1 is not there); F_all 0 then needs
    # a0 + delta1 + abar1 = 12 and B 0 adds delta0: 13. Makespan 1 + 1 + 1 + 1.
    # Had a1 stayed, B 0 would need 14 and no schedule would fit.
    chain = Chain(u_f=[1], u_b=[1], x=[1], xbar=[10], x0=1, o_loss=5, u_loss=1)
    best, sched = brute_force_remat(chain, 13)
    assert best == 4.0 and str(sched) == "F_ck 0, L, F_all 0, B 0"
    assert simulate(chain, sched, Platform(13)).peak == 13
    assert brute_force_remat(chain, 12) == (math.inf, None)


def test_erratum_16_instance():
    # thesis-remat.md erratum 16: optimum 39 by a non-persistent schedule, C_MP = 42
    chain = erratum_16_chain()
    assert brute_force_remat(chain, 20)[0] == 39
    assert plan_remat(chain, 20, slots=20).makespan == 42


@pytest.mark.parametrize("n", [3, 4, 5, 6])
def test_memory_persistence_counterexample(n):
    # property 9 (Fig. 2.3, M = 15): C_MP = 3n-2, exhaustive = min(3n-2, 2n+2)
    chain = persistence_counterexample(n)
    assert plan_remat(chain, 15, slots=15).makespan == 3 * n - 2
    assert brute_force_remat(chain, 15, max_stages=8)[0] == min(3 * n - 2, 2 * n + 2)


@pytest.mark.parametrize("values,has_partition", [([1, 1, 2], True), ([1, 1, 4], False),
                                                   ([2, 3, 1], True), ([1, 2, 5], False)])
def test_two_partition_gadget(values, has_partition):
    # property 10 (§3.2): C(3V) <= 4V + U_B iff the multiset has a 2-partition
    V = sum(values) // 2 if sum(values) % 2 == 0 else sum(values) / 2
    x, u_f = [], []
    for v in values:
        x += [v, 0]
        u_f += [v, 0]
    x.append(math.ceil(V))
    u_f.append(V)
    u_b = [1] * len(x)
    chain = Chain(u_f=u_f, u_b=u_b, x=x, xbar=x, x0=0)
    budget = int(3 * V)
    try:
        makespan = plan_remat(chain, budget, slots=budget).makespan
    except InfeasibleError:
        makespan = math.inf
    assert (makespan <= 4 * V + sum(u_b)) == has_partition


# -------------------------------------------------------- budgets (props 5, 6)
@SETTINGS
@given(chains(1, 8, small=False))
def test_min_feasible_is_exact(chain):
    lo = max(1, min_feasible_memory(chain))
    plan = plan_remat(chain, lo)
    assert simulate(chain, plan.schedule, Platform(lo)).peak <= lo
    if lo > 1:
        with pytest.raises(InfeasibleError) as err:
            plan_remat(chain, lo - 1)
        assert err.value.min_feasible == lo and err.value.budget == lo - 1
        assert "at least" in str(err.value)


@SETTINGS
@given(chains(1, 8, small=False), st.integers(8, 60))
def test_makespan_non_increasing_in_budget_at_fixed_slot(chain, parts):
    lo = max(1, min_feasible_memory(chain))
    hi = max(lo, store_all_peak(chain))
    slot = max(1, (hi - fixed_bytes(chain)) // parts)
    budgets = sorted({lo + (hi - lo) * k // 12 for k in range(13)})
    spans = [plan_remat(chain, b, slot_bytes=slot).makespan for b in budgets]
    # equal-cost schedules may sum their float times in another order: 1 ulp slack
    assert all(a >= b * (1 - 1e-12) for a, b in zip(spans, spans[1:])), spans


@SETTINGS
@given(chains(1, 6, small=True))
def test_dp_reaches_no_remat_makespan_at_its_peak(chain):
    # property 5, on the table itself (plan_remat short-cuts this budget)
    arrays = stage_arrays(chain)
    M = store_all_peak(chain) - fixed_bytes(chain)
    table, _, idx, _, _ = persistent_table(arrays, M)
    assert table[idx[0, chain.n], M] == chain.compute_time
    assert plan_remat(chain, "inf").makespan == chain.compute_time
    assert plan_remat(chain, max(1, M + fixed_bytes(chain))).makespan == chain.compute_time


def test_dp_value_is_monotone_in_m_on_the_table():
    chain = Chain(u_f=[1, 3, 2, 5], u_b=[2, 4, 1, 3], x=[3, 5, 2, 4], xbar=[6, 7, 3, 8],
                  x0=2, w=[1, 2, 1, 1], o_f=[1, 0, 2, 0], o_b=[0, 1, 1, 2])
    table = persistent_table(stage_arrays(chain), 80)[0]
    finite = np.where(np.isfinite(table), table, 1e300)
    assert (np.diff(finite, axis=1) <= 0).all()


# ------------------------------------------------------ baselines (prop 8)
@SETTINGS
@given(chains(1, 5, small=True), st.data())
def test_rotor_no_worse_than_baselines_at_their_peak(chain, data):
    k = data.draw(st.integers(1, chain.n))
    for plan in (plan_sequential(chain, math.inf, segments=k), plan_store_all(chain, math.inf),
                 plan_revolve(chain, math.inf)):
        budget = max(1, plan.peak)
        rotor = plan_remat(chain, budget, slots=budget)
        assert rotor.makespan <= plan.makespan, (plan.algorithm, str(plan.schedule))


def test_builtin_profile_beats_sequential_at_equal_memory():
    from rtmem.planners import builtin
    chain = builtin("gpt2-small")
    seq = plan_sequential(chain, math.inf, segments=4)
    # at exactly the baseline's peak, rounding 14 stages to 500 slots loses the
    # sequential schedule itself (each size rounds up by < 1 slot); 5000 do not
    rotor = plan_remat(chain, seq.peak, slots=5000)
    assert rotor.peak <= seq.peak
    assert rotor.makespan <= seq.makespan * (1 + 1e-9)
    assert rotor.info["method"] == "dp"


@pytest.mark.parametrize("name", ["gpt2-small", "resnet50", "resnet152"])
@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.4, 0.9])
def test_builtin_profiles_fit_their_budget(name, fraction):
    from rtmem.planners import builtin
    chain = builtin(name)
    lo, hi = min_feasible_memory(chain), store_all_peak(chain)
    budget = int(lo + fraction * (hi - lo))
    plan = plan_remat(chain, budget)
    res = simulate(chain, plan.schedule, Platform(budget))     # raises if invalid
    assert res.peak <= budget and res.makespan == plan.makespan
    assert plan.info["method"] in ("dp", "min-memory", "sequential", "revolve")
    check_winner(plan, res)


def test_table_filled_in_bands_equals_one_pass():
    # the banded fill behind the CLI's progress bar computes the same table
    from rtmem.planners import builtin
    chain = builtin("resnet50")
    budget = store_all_peak(chain) // 2
    arrays = discretize(stage_arrays(chain), max(1, (budget - fixed_bytes(chain)) // 200))
    fractions = []
    banded = persistent_table(arrays, 200, progress=fractions.append)
    whole = persistent_table(arrays, 200)
    np.testing.assert_array_equal(banded[0], whole[0])
    np.testing.assert_array_equal(banded[1], whole[1])
    assert fractions == sorted(fractions) and fractions[-1] == 1.0 and len(fractions) > 3


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(1, 5, small=True), st.integers(1, 3))
def test_least_memory_is_the_first_finite_entry_of_the_reference_table(chain, slot):
    # the least-memory pass (its tables transposed for speed) against the recurrence
    # as printed: C(0, n, m) is finite from m = mm on, not below
    from rtmem.planners.rotor import min_memory
    arrays = discretize(stage_arrays(chain), slot)
    mm, _ = min_memory(arrays)
    row = reference_persistent_table(arrays, mm + 2)[pair_index(arrays.N)[0, chain.n]]
    assert np.isfinite(row[mm]) and (mm == 0 or np.isinf(row[mm - 1]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(chains(1, 12, small=True), chains(1, 12), chains(1, 30, homogeneous=True)),
       st.integers(1, 5))
def test_least_memory_pass_equals_the_plain_python_one(chain, slot):
    # the jitted pass keeps triangles and computes m_all / m_none along its rows;
    # the reference keeps full tables and the requirements as printed: same least
    # memory and same choices (ties to the faster), in bytes and in slots, with
    # and without the choices kept
    from rtmem.planners.rotor import min_memory, reference_min_memory
    for arrays in (stage_arrays(chain), discretize(stage_arrays(chain), slot)):
        mm, choice = reference_min_memory(arrays)
        got, got_choice = min_memory(arrays)
        assert got == mm == min_memory(arrays, choices=False)[0]
        np.testing.assert_array_equal(got_choice, choice)
    # and in bytes the simulator agrees: the choices' schedule peaks at that memory
    from rtmem.planners.rotor import min_memory_schedule
    mm, choice = min_memory(stage_arrays(chain))
    res = simulate(chain, min_memory_schedule(stage_arrays(chain), choice), Platform(math.inf))
    assert res.peak == fixed_bytes(chain) + mm


def test_least_memory_pass_keeps_no_full_8_byte_tables():
    # it held five (N, N) 8-byte tables (40 N^2 bytes: 1 GB at 5,000 stages) and
    # plan_remat ran it twice; now two triangles and (N, N) int16 choices, ~10 N^2
    # bytes, and ~4 N^2 when only the least memory is wanted (the slot pass)
    import tracemalloc

    from rtmem.planners.rotor import min_memory
    chain = _random_chain(300, overheads=True)
    arrays = stage_arrays(chain)
    N = arrays.N
    min_memory(arrays), min_memory(arrays, choices=False)        # compiled first
    for choices, most in ((True, 10.5 * N * N), (False, 4.5 * N * N)):
        tracemalloc.start()
        try:
            min_memory(arrays, choices=choices)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= most, (choices, peak / N**2)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(chains(1, 12, small=True), chains(1, 12)), st.integers(1, 2**40))
def test_least_memory_in_slots_lies_between_the_bounds_plan_remat_uses(chain, slot):
    # plan_remat decides whether a slot size is feasible from the least memory in
    # bytes and its choices when M is outside [ceil(mm / slot), what those choices
    # need in slots]; the least memory in slots is always in that range, and the
    # byte-level choices need exactly the least memory in bytes
    from rtmem.planners.rotor import choices_memory, min_memory
    arrays = stage_arrays(chain)
    mm, choice = min_memory(arrays)
    assert choices_memory(arrays, choice) == mm
    slot = min(slot, max(1, mm))
    disc = discretize(arrays, slot)
    assert -(-mm // slot) <= min_memory(disc, choices=False)[0] <= choices_memory(disc, choice)


def test_plan_remat_runs_the_least_memory_pass_once_away_from_the_least_budget(monkeypatch):
    # it ran the O(n^3) pass twice, in bytes and again in slots, only to compare
    # the second with M; the bounds from the first decide it away from the least
    # budget (same plan)
    from rtmem.planners import remat
    chain = _random_chain(40, overheads=True)
    calls = []
    real = remat.min_memory

    def min_memory(*args, **kwargs):
        calls.append(kwargs.get("choices", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(remat, "min_memory", min_memory)
    lo = min_feasible_memory(chain)
    calls.clear()
    plan = plan_remat(chain, (lo + store_all_peak(chain)) // 2)
    assert calls == [True] and plan.info["method"] in ("dp", "min-memory", "sequential")


def _random_chain(n: int, overheads: bool = False) -> Chain:
    """A chain of ``n`` stages with fresh random times and byte sizes (and
    weights and overheads when ``overheads``)."""
    rng = np.random.default_rng()
    x = rng.integers(1, 1000, n)
    extra = dict(w=rng.integers(0, 50, n), o_f=rng.integers(0, 50, n),
                 o_b=rng.integers(0, 50, n)) if overheads else {}
    return Chain(u_f=rng.uniform(0.5, 2, n), u_b=rng.uniform(0.5, 2, n), x=x,
                 xbar=x + rng.integers(0, 1000, n), x0=int(x[0]), **extra)


def test_least_memory_pass_reports_progress_and_gives_the_same_result():
    # the O(n^3) least-memory pass took minutes on thousands of stages with nothing
    # on screen; it now runs in bands and reports its fraction done like the table
    from rtmem.planners.rotor import min_memory
    chain = _random_chain(60, overheads=True)
    arrays = stage_arrays(chain)
    fractions = []
    banded = min_memory(arrays, progress=fractions.append)
    whole = min_memory(arrays)
    assert banded[0] == whole[0]
    np.testing.assert_array_equal(banded[1], whole[1])
    assert fractions == sorted(fractions) and fractions[-1] == 1.0 and len(fractions) > 3

    seen = []

    class Progress:
        # falsy, as an empty list subclass is: still used (`progress or ...` dropped it)
        def __len__(self):
            return 0

        def __call__(self, msg):
            seen.append(msg)

        def update(self, fraction):
            seen.append(fraction)

    budget = (min_feasible_memory(chain) + store_all_peak(chain)) // 2
    assert plan_remat(chain, budget, 50, progress=Progress()).schedule == \
        plan_remat(chain, budget, 50).schedule
    progress = seen
    # announced, then updates of the pass, all before the DP table's line
    first = progress.index("rotor: least memory of 60 stages")
    table = next(i for i, m in enumerate(progress) if str(m).startswith("rotor: 60 stages"))
    assert 1.0 in progress[first:table] and isinstance(progress[first + 1], float)


def test_a_solve_predicted_to_be_slow_warns_up_front_with_advice(monkeypatch):
    # the DP took ~10 min on 1,000 stages with 500 slots, and its least-memory pass
    # an estimated ~50 min on 5,000 stages, with nothing said. Now a solve predicted
    # above SLOW_SOLVE_SECONDS warns before any O(n^3) pass, saying what helps
    import warnings

    from rtmem.planners import remat
    n = 12
    chain = _random_chain(n)
    budget = (min_feasible_memory(chain) + store_all_peak(chain)) // 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # the defaults: no warning at this size
        expected = plan_remat(chain, budget, 500).schedule

    real_min_memory = remat.min_memory
    before_pass = []

    def min_memory(*args, **kwargs):
        before_pass.append(len(caught))
        return real_min_memory(*args, **kwargs)

    predicted = remat._predicted_seconds(n, 500)
    monkeypatch.setattr(remat, "min_memory", min_memory)
    monkeypatch.setattr(remat, "SLOW_SOLVE_SECONDS", predicted / 4)
    with pytest.warns(RuntimeWarning, match="fewer slots") as caught:
        assert plan_remat(chain, budget, 500).schedule == expected   # same plan
    assert before_pass[0] == 1 and caught[0].filename == __file__
    message = str(caught[0].message)
    assert "12 stages" in message and "coarser stages" in message
    # the slots it suggests are predicted within the limit
    slots = int(message.split("slots=")[1].split()[0])
    assert remat._predicted_seconds(n, slots) <= predicted / 4 < \
        remat._predicted_seconds(n, slots + 1)
    # and what it says is there to read, for callers that word it themselves
    told = caught[0].message
    assert isinstance(told, remat.SlowSolveWarning)
    assert (told.stages, told.slots_within) == (n, slots) and told.slots > slots
    assert told.seconds > remat.SLOW_SOLVE_SECONDS
    monkeypatch.setattr(remat, "SLOW_SOLVE_SECONDS", remat._predicted_seconds(n, None) / 2)
    with pytest.warns(RuntimeWarning, match="least-memory pass is O") as caught:
        min_feasible_memory(chain)
    assert caught[0].filename == __file__


def test_the_predicted_solve_counts_the_least_memory_passes_plan_remat_runs(monkeypatch):
    # _predicted_seconds (the slow-solve warning, the slots it suggests) counted
    # two least-memory passes per solve after plan_remat had stopped running the
    # one in slots wherever the byte pass's bounds decide: at a budget half way
    # to the store-all peak it runs one, so a solve is one pass plus the fill
    from rtmem.planners import remat
    n, slots = 40, 500
    chain = _random_chain(n)
    budget = (min_feasible_memory(chain) + store_all_peak(chain)) // 2
    passes = []
    real_min_memory = remat.min_memory

    def min_memory(*args, **kwargs):
        passes.append(1)
        return real_min_memory(*args, **kwargs)

    monkeypatch.setattr(remat, "min_memory", min_memory)
    plan = plan_remat(chain, budget, slots)
    M = plan.info["slots"]
    one_pass = remat._predicted_seconds(n, None)
    per_slot = remat._predicted_seconds(n, M + 1) - remat._predicted_seconds(n, M)
    # what is left of the prediction once the M + 1 columns of the fill are taken out
    passes_predicted = (remat._predicted_seconds(n, M) - (M + 1) * per_slot) / one_pass
    assert len(passes) == 1 and passes_predicted == pytest.approx(len(passes))


def test_planner_arguments_are_checked():
    import math as _math

    from rtmem.errors import RtmemError
    from rtmem.planners import (Chain, min_feasible_memory, plan_floating, plan_remat,
                                plan_revolve, plan_sequential, plan_store_all)
    ch = Chain.homogeneous(3)
    for planner in (plan_remat, plan_store_all, plan_revolve, plan_floating):
        with pytest.raises(TypeError, match="plans a Chain"):
            planner(None, 100)
    with pytest.raises(TypeError, match="plans a Chain"):
        min_feasible_memory("gpt2")
    for call in (lambda: plan_floating(ch, 38, 0), lambda: plan_floating(ch, 38, 1.5),
                 lambda: plan_remat(ch, 100, slots=_math.inf),
                 lambda: plan_remat(ch, 100, slot_bytes=True)):
        with pytest.raises(RtmemError, match="integer >= 1"):
            call()
    with pytest.raises(RtmemError, match="segments"):
        plan_sequential(ch, 100, segments=float("nan"))


def test_budgets_round_down_and_unlimited_budgets_skip_the_dp():
    from rtmem.errors import InfeasibleError
    from rtmem.planners import Chain, plan_remat, plan_store_all
    ch = Chain(u_f=[1], u_b=[1], x=[1], xbar=[100])
    with pytest.raises(InfeasibleError):
        plan_store_all(ch, 100.5)                 # 100.5 bytes allow 100, not 101
    # a chain whose DP table would be too large still plans when memory is unlimited
    plan = plan_remat(Chain.homogeneous(1500), "inf")
    assert plan.info["method"] == "store-all"


# ------------------------------------- near the least budget (audit, item 1)
def least_budget_chain():
    # rounding 2,604 activation bytes to 500 slots of 5 bytes leaves the DP no
    # schedule at the least budget; the least-memory fallback took 51 s
    return Chain(u_f=[4, 1, 1, 1, 5], u_b=[3, 5, 3, 5, 1], x=[121, 330, 242, 530, 506],
                 xbar=[757, 432, 498, 654, 1038], x0=113)


def test_least_budget_matches_brute_force():
    chain = least_budget_chain()
    budget = min_feasible_memory(chain)
    assert budget == 2717
    plan = plan_remat(chain, budget)
    assert plan.makespan == 38.0 == brute_force_remat(chain, budget)[0]
    # found by retrying with finer slots (here: exact bytes), not by the fallback
    assert plan.info["method"] == "dp" and plan.info["refined"]
    assert plan.info["slot_bytes"] == 1 and plan.info["dp_makespan"] == 38.0
    assert simulate(chain, plan.schedule, Platform(budget)).peak <= budget
    # a fixed slot is never refined: the asked rounding is kept
    fixed = plan_remat(chain, budget, slot_bytes=5)
    assert fixed.info["method"] == "min-memory" and not fixed.info["refined"]


def test_a_chain_of_zero_sizes_plans_at_its_least_budget():
    # its schedules need 0 bytes, but a Platform needs a positive memory: the
    # least budget said 0, and planning with it raised PlatformError
    from rtmem.planners import plan_floating
    chain = Chain(u_f=[1, 2], u_b=[2, 1], x=[0, 0], xbar=[0, 0], x0=0)
    least = min_feasible_memory(chain)
    assert least == 1
    for plan in (plan_remat(chain, least), plan_floating(chain, least)):
        assert plan.makespan == 6.0
        assert simulate(chain, plan.schedule, Platform(least)).peak == 0


def test_least_memory_schedule_breaks_ties_by_time():
    from rtmem.planners.rotor import min_memory, min_memory_schedule
    # several choices reach the least memory here; the first found in loop order
    # gave a 37 s schedule
    chain = Chain(u_f=[2, 4, 4, 2], u_b=[3, 3, 0, 5], x=[2, 3, 2, 1], xbar=[4, 6, 2, 4], x0=2)
    arrays = stage_arrays(chain)
    mm, choice = min_memory(arrays)
    res = simulate(chain, min_memory_schedule(arrays, choice), Platform(math.inf))
    assert res.peak == fixed_bytes(chain) + mm == min_feasible_memory(chain)
    assert res.makespan == 31.0


def _least_memory_walk(N, choice):
    """min_memory_schedule's walk of the choices as plain Python (Op, stage) pairs:
    the order it had before it was jitted, kept as the oracle."""
    out, stack = [], [(0, 0, N - 1)]
    while stack:
        kind, s, t = stack.pop()
        if kind == 1:
            out.append((Op.B, s))
        elif s == t:
            out += [(Op.LOSS, 0)] if s == N - 1 else [(Op.F_ALL, s), (Op.B, s)]
        elif choice[s, t] == -1:
            out.append((Op.F_ALL, s))
            stack += [(1, s, s), (0, s + 1, t)]
        else:
            sp = int(choice[s, t])
            out += [(Op.F_CK, s)] + [(Op.F_NONE, h) for h in range(s + 1, sp + 1)]
            stack += [(0, s, sp), (0, sp + 1, t)]
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(max_stages=25))
def test_least_memory_schedule_walks_the_choices_in_their_order(chain):
    from rtmem.planners.rotor import min_memory_schedule
    arrays = stage_arrays(chain)
    choice = min_memory(arrays)[1]
    ops = _least_memory_walk(arrays.N, choice)
    got = min_memory_schedule(arrays, choice)
    assert got.op.tolist() == [int(o) for o, _ in ops]
    assert got.stage.tolist() == [k for _, k in ops] and not got.aux.any()


def test_least_memory_schedule_is_built_as_arrays(monkeypatch):
    # near the least budget the least-memory schedule has ~n^2/2 operations (a
    # homogeneous chain: 321,201 for 800 stages): built as Python (Op, stage)
    # tuples through Schedule.from_ops it was half of plan_remat's time there
    # (1.3 s of 2.5 s; ~10 s on 3,000 stages, 0.6 s jitted)
    from rtmem.planners.rotor import min_memory_schedule
    chain = Chain.homogeneous(60, x=1000, xbar=3000)
    arrays = stage_arrays(chain)
    choice = min_memory(arrays)[1]
    expected = _least_memory_walk(arrays.N, choice)
    assert len(expected) > 60 ** 2 / 4            # the quadratic case
    monkeypatch.setattr(Schedule, "from_ops", classmethod(lambda cls, ops: pytest.fail(
        "min_memory_schedule built the schedule op by op")))
    got = min_memory_schedule(arrays, choice)
    assert list(zip(got.op.tolist(), got.stage.tolist())) == \
        [(int(o), k) for o, k in expected]


def test_ctrl_c_while_a_table_is_handed_back_is_a_keyboard_interrupt(monkeypatch):
    # numba boxes a returned array through numba.core.serialize._numba_unpickle, where
    # Python raises a pending Ctrl-C. Making that lookup raise KeyboardInterrupt plays
    # a Ctrl-C that lands during a jitted fill, deterministically. The O(n^3)
    # least-memory pass returned a tuple of arrays: Ctrl-C in it (rtmem plan remat on
    # 1,000 stages) gave SystemError "returned a result with an exception set", or
    # a segfault; opt0_table's fill did the same
    import numba.core.serialize as serialize
    from rtmem.planners.revolve import opt0_table

    rng = np.random.default_rng(7)
    x = rng.integers(1, 100, 8)
    chain = Chain(u_f=rng.uniform(0.5, 2, 8), u_b=rng.uniform(0.5, 2, 8), x=x,
                  xbar=x + rng.integers(0, 100, 8), w=rng.integers(0, 20, 8), x0=int(x[0]))
    budget = (min_feasible_memory(chain) + store_all_peak(chain)) // 2
    calls = {"min_feasible_memory": lambda: min_feasible_memory(chain),
             "plan_remat": lambda: plan_remat(chain, budget).schedule,
             "plan_revolve": lambda: plan_revolve(chain, budget).schedule,
             "opt0_table": lambda: opt0_table(9, 6, 1.5, 2.0)[0]}
    expected = {name: call() for name, call in calls.items()}    # also loads the JIT

    class Interrupting(dict):
        def __getitem__(self, key):
            raise KeyboardInterrupt

    assert hasattr(serialize, "_unpickled_memo")
    monkeypatch.setattr(serialize, "_unpickled_memo", Interrupting(serialize._unpickled_memo))
    for name, call in calls.items():
        try:
            got = call()
        except KeyboardInterrupt:    # what a Ctrl-C must give (SystemError fails the test)
            continue
        assert np.array_equal(got, expected[name]) if name == "opt0_table" \
            else got == expected[name], name


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(1, 6, small=False), st.floats(0.0, 1.0), st.sampled_from([10, 50, 500]))
def test_never_slower_than_the_baselines_that_fit(chain, frac, slots):
    lo, hi = min_feasible_memory(chain), store_all_peak(chain)
    budget = max(1, int(lo + frac ** 2 * (hi - lo)))    # most budgets near the least
    plan = plan_remat(chain, budget, slots=slots)
    assert simulate(chain, plan.schedule, Platform(budget)).peak <= budget
    for baseline in (plan_sequential, plan_revolve):
        try:
            other = baseline(chain, budget)
        except InfeasibleError:
            continue
        # equal makespans summed in another order differ in the last bit
        # (7.799999999999999e-05 against revolve's 7.799999999999997e-05)
        assert plan.makespan <= other.makespan * (1 + 1e-12), (other.algorithm, plan.info)


def test_a_baseline_that_wins_is_recorded():
    from rtmem.planners import Plan
    # with 50 slots of 115 KB the DP's rounding costs 5 s; two segments do not
    chain = Chain(u_f=[5, 4, 5, 3, 3], u_b=[5, 1, 2, 5, 1],
                  x=[943405, 947050, 483407, 367815, 595282],
                  xbar=[1862687, 1899094, 1129692, 648977, 1405814], x0=955649)
    plan = plan_remat(chain, 6694745, slots=50)
    assert plan.algorithm == "rotor" and plan.info["method"] == "sequential"
    assert plan.info["segments"] == 2 and plan.makespan == 43.0
    assert plan.info["candidates"] == {"dp": 48.0, "min-memory": 55.0, "sequential": 43.0}
    assert Plan.from_json(plan.to_json()) == plan
    # compare_remat hands its baselines to the rotor planner: the same winner
    rotor = compare_remat(chain, 6694745, slots=50)["rotor"]
    assert rotor.schedule == plan.schedule and rotor.info["method"] == "sequential"


def test_finer_slots_stay_bounded():
    # a 100 MB loss temporary and 1-byte activations: no rounding short of 1-byte
    # slots is exact, and those would need a 100M-column table
    chain = Chain(u_f=[0, 0], u_b=[0, 0], x=[0, 0], xbar=[0, 1], o_loss=10**8)
    budget = min_feasible_memory(chain)
    plan = plan_remat(chain, budget, slots=7)
    assert plan.info["slots"] <= 64 * 7
    assert simulate(chain, plan.schedule, Platform(budget)).peak <= budget


def test_finer_slots_stop_at_refine_max_factor_times_the_slots_asked():
    # 2,604 activation bytes at the least budget. 21 slots may be refined up to
    # 64 x 21 = 1,344 slots: 2-byte slots (1,302 of them) are allowed, and the DP
    # finds a schedule there. 20 slots stop at 1,280, i.e. at 3-byte slots (868;
    # 130 -> 32 -> 8 -> 3 bytes), where it finds none: the least-memory schedule
    chain = least_budget_chain()
    plan = plan_remat(chain, 2717, slots=21)
    assert (plan.info["method"], plan.info["slot_bytes"], plan.info["slots"]) == ("dp", 2, 1302)
    plan = plan_remat(chain, 2717, slots=20)
    assert plan.info["method"] == "min-memory" and plan.info["dp_makespan"] is None
    assert (plan.info["slot_bytes"], plan.info["slots"], plan.info["refined"]) == (130, 20, False)


def test_slots_within_the_table_limit_are_never_refused(monkeypatch):
    # slot = floor(50 / 20) = 2 bytes gave 25 slots, beyond the 20 the table allows:
    # the DP was refused with "use at most 20 slots" although 20 were asked
    import rtmem.planners.remat as remat
    monkeypatch.setattr(remat, "MAX_TABLE_BYTES", 10 * 8 * 21)    # 3 stages, 20 slots
    assert remat._max_slots(3) == 20
    chain = Chain(u_f=[1, 2, 1], u_b=[1, 1, 1], x=[10, 10, 10], xbar=[20, 20, 20])
    for budget in (50, 70):
        plan = plan_remat(chain, budget, slots=20)
        assert plan.info["slots"] <= 20
        assert simulate(chain, plan.schedule, Platform(budget)).peak <= budget


def test_slots_above_the_activation_budget_are_one_byte_slots():
    # the table was checked for `slots` columns although the DP uses at most one per
    # activation byte: slots=10**8 on a 115-byte budget was refused as a 7.45 GiB table
    chain = Chain(u_f=[1., 2., 3.], u_b=[1., 2., 3.], x=[10, 20, 30], xbar=[15, 25, 35],
                  x0=5)
    exact = plan_remat(chain, 120, slots=115)
    for slots in (1000, 10**8, 2**62):
        plan = plan_remat(chain, 120, slots=slots)
        assert (plan.info["slots"], plan.info["slot_bytes"]) == (115, 1)
        assert plan.schedule == exact.schedule and plan.makespan == exact.makespan
    # an activation budget of more bytes than the table takes is still refused
    from rtmem.errors import RtmemError
    big = Chain(u_f=[1., 2., 3.], u_b=[1., 2., 3.], x=[2**40] * 3, xbar=[2**41] * 3)
    with pytest.raises(RtmemError, match=r"100000000 slots.*use at most 26843544 slots"):
        plan_remat(big, min_feasible_memory(big), slots=10**8)


def test_info_keys_are_those_documented_for_each_path():
    # the docstring listed min_feasible, slot_bytes, slots and refined for every
    # plan, but the store-all shortcut (no DP run) has none of them: a KeyError
    chain = Chain(u_f=[1., 2., 3.], u_b=[1., 2., 3.], x=[10, 20, 30], xbar=[15, 25, 35],
                  x0=5)
    always = {"method", "candidates", "dp_makespan", "solve_seconds", "chain_sha256",
              "input_bytes"}
    dp_only = {"min_feasible", "slot_bytes", "slots", "refined"}
    doc = " ".join(plan_remat.__doc__.split())
    assert "always holds ``method``" in doc and "``input_bytes``" in doc
    assert "``chain_sha256``" in doc[:doc.index("Only when the DP ran")]
    dp_sentence = doc[doc.index("Only when the DP ran"):]
    dp_sentence = dp_sentence[:dp_sentence.index("(bytes)")]
    assert all(f"``{key}``" in dp_sentence for key in dp_only)
    # from exactly the no-recomputation peak on, the DP is skipped
    peak = store_all_peak(chain)
    for budget in (peak, 10**6):
        store_all = plan_remat(chain, budget)
        assert store_all.info["method"] == "store-all" and set(store_all.info) == always
    assert plan_remat(chain, peak - 1).info["method"] != "store-all"
    dp = plan_remat(chain, 120)
    assert dp.info["method"] != "store-all" and always | dp_only <= set(dp.info)
    assert dp.info["min_feasible"] == min_feasible_memory(chain)


def test_m_none_of_adjacent_stages_leaves_out_the_stored_input():
    # NOTE [ Persistent DP C_MP ]: m_none(s, t) maxes over s < h < t, so for
    # t = s + 1 over no h: a_s is stored outside m. Counting it (h = s) made the DP
    # call budget 25 infeasible on this chain, where exhaustive search finds 33 s.
    chain = Chain(u_f=[1.0, 4.0, 1.0, 2.0], u_b=[2.0, 4.0, 3.0, 4.0], x=[2, 5, 1, 5],
                  xbar=[4, 7, 3, 8], w=[0, 0, 2, 1], x0=3, o_f=[7, 1, 3, 1],
                  o_b=[3, 0, 2, 3])
    assert min_feasible_memory(chain) == 25
    for budget in range(24, store_all_peak(chain) + 1):
        best, _ = brute_force_remat(chain, budget)
        try:
            plan = plan_remat(chain, budget, slots=budget)
        except InfeasibleError:
            assert best == math.inf, budget
            continue
        assert plan.makespan == best, budget
        assert simulate(chain, plan.schedule, Platform(budget)).makespan == best


def test_a_fixed_slot_table_over_the_limit_is_refused_with_slot_bytes_advice(monkeypatch):
    # 3 stages: (3+1)(3+2)/2 = 10 cells of M+1 float64 each; a limit of 26 columns
    # takes M = 25 slots (50 bytes in 2-byte slots) and refuses M = 26 (52 bytes)
    import rtmem.planners.remat as remat
    from rtmem.errors import RtmemError
    monkeypatch.setattr(remat, "MAX_TABLE_BYTES", 10 * 8 * 26)
    chain = Chain(u_f=[0, 0, 0], u_b=[1, 2, 3], x=[10, 10, 10], xbar=[20, 20, 20])
    assert plan_remat(chain, 50, slot_bytes=2).info["slots"] == 25
    with pytest.raises(RtmemError, match=r"2,160 bytes .*for 3 stages and 26 slots.*"
                                         r"use a slot_bytes giving at most 25 slots"):
        plan_remat(chain, 52, slot_bytes=2)


def test_candidates_tie_to_the_dp_and_revolve_is_skipped_when_it_cannot_win():
    # no forward time: every schedule takes sum(u_b) = 6 s, so the DP and the
    # least-memory schedule tie (the DP is taken) and Revolve, whose bound
    # 2 sum(u_f) + sum(u_b) = 6 s is no faster, is not planned
    chain = Chain(u_f=[0, 0, 0], u_b=[1, 2, 3], x=[10, 10, 10], xbar=[20, 20, 20])
    for budget in (50, 70):
        plan = plan_remat(chain, budget)
        assert plan.info["method"] == "dp" and "revolve" not in plan.info["candidates"]
        assert plan.info["candidates"]["min-memory"] == plan.makespan == 6.0
    assert plan_revolve(chain, 70).makespan == 6.0          # it would have fitted


def test_revolve_is_tried_on_chains_of_up_to_revolve_max_stages(monkeypatch):
    import rtmem.planners.remat as remat
    chain = Chain.homogeneous(8)
    monkeypatch.setattr(remat, "REVOLVE_MAX_STAGES", 8)
    # at 6 bytes Revolve fits and its bound 24 s is below the DP's 26 s
    assert plan_remat(chain, 6).info["candidates"]["revolve"] == plan_revolve(chain, 6).makespan
    monkeypatch.setattr(remat, "REVOLVE_MAX_STAGES", 7)
    assert "revolve" not in plan_remat(chain, 6).info["candidates"]


def test_compare_remat_warns_of_a_slow_solve_at_its_callers_line(monkeypatch):
    # compare_remat (what `rtmem plan remat` runs) reached plan_remat's warning
    # through a lambda: it said "plan_remat:" and pointed at a line of remat.py,
    # not at the code that asked for the comparison
    from rtmem.planners import Plan, remat
    n = 10
    chain = _random_chain(n)
    budget = (min_feasible_memory(chain) + store_all_peak(chain)) // 2
    monkeypatch.setattr(remat, "SLOW_SOLVE_SECONDS", remat._predicted_seconds(n, 50) / 4)
    with pytest.warns(RuntimeWarning, match="fewer slots") as caught:
        plans = compare_remat(chain, budget, 50)
    assert isinstance(plans["rotor"], Plan)
    slow = [w for w in caught if "predicted ~" in str(w.message)]
    assert len(slow) == 1 and slow[0].filename == __file__
    assert str(slow[0].message).startswith("compare_remat: 10 stages")


def test_derived_slots_make_the_makespan_non_monotone_as_documented():
    # plan_remat's docstring (slots) states that one byte more can give a slower
    # plan with derived slots, on this chain, and that a fixed slot_bytes does not
    chain = Chain(u_f=[5, 4, 1], u_b=[1, 5, 2], x=[1797, 1094, 2239],
                  xbar=[3130, 1963, 2443], x0=1704)
    fine, coarse = plan_remat(chain, 9703), plan_remat(chain, 9704)
    assert (fine.info["slot_bytes"], coarse.info["slot_bytes"]) == (15, 16)
    assert coarse.makespan > fine.makespan
    assert plan_remat(chain, 9720).makespan == fine.makespan
    for budget in (9703, 9704):
        res = simulate(chain, plan_remat(chain, budget, slot_bytes=15).schedule,
                       Platform(budget))
        assert res.makespan == fine.makespan


# ------------------------------------------------------------ no_recompute stages
def _forward_counts(schedule, n: int) -> list:
    return [sum(1 for op, s, _ in schedule if s == i and op in (Op.F_CK, Op.F_NONE, Op.F_ALL))
            for i in range(n)]


def _run_once(chain, schedule) -> bool:
    counts = _forward_counts(schedule, chain.n)
    return all(counts[i] == 1 for i in np.flatnonzero(chain.no_recompute))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(2, 5, small=True, no_recompute=True).filter(lambda c: c.no_recompute.any()),
       st.integers(1, 3), st.data())
def test_no_recompute_stages_are_run_once_by_an_optimal_persistent_dp(chain, slot, data):
    # A stage that modifies its input in place (profile_sequential flags it) must
    # not be recomputed. The DP restricts its F^ck splits; checked entry by entry
    # against the recurrence as printed with the constraint written out, and its
    # plans against exhaustive search under the same constraint (never faster).
    # Drawn chains: integer times, so the jitted table's prefix sums and the
    # reference's sums agree to the bit
    arrays = discretize(stage_arrays(chain), slot)
    peak = store_all_peak(chain)
    M = (peak - fixed_bytes(chain)) // slot + 2
    np.testing.assert_array_equal(persistent_table(arrays, M)[0],
                                  reference_persistent_table(arrays, M))
    least, choice = min_memory(arrays)
    ref_least, ref_choice = reference_min_memory(arrays)
    assert least == ref_least
    np.testing.assert_array_equal(choice, ref_choice)
    least = min_feasible_memory(chain)
    if least > 1:              # the flags' least budget is where plans start
        with pytest.raises(InfeasibleError) as err:
            plan_remat(chain, least - 1)
        assert err.value.min_feasible == least
    budget = data.draw(st.integers(least, max(least, peak)), label="budget")
    plan = plan_remat(chain, budget)
    assert _run_once(chain, plan.schedule)
    assert simulate(chain, plan.schedule, Platform(budget)).peak <= budget
    best, sched = brute_force_remat(chain, budget)
    assert plan.makespan >= best
    assert _run_once(chain, sched)


def test_simulator_refuses_a_second_forward_of_a_no_recompute_stage():
    chain = Chain.homogeneous(3)
    sched = Schedule.from_text("F_all 0, F_ck 1, F_all 2, L, B 2, F_all 1, B 1, B 0")
    simulate(chain, sched, Platform(math.inf))                  # fine without the flag
    flagged = Chain(**{k: getattr(chain, k) for k in ("u_f", "u_b", "x", "xbar")},
                    x0=chain.x0, no_recompute=[False, True, False])
    with pytest.raises(ScheduleError, match=r"op 5 \(F_all 1\) runs stage 1 a second time"):
        simulate(flagged, sched, Platform(math.inf))


def test_no_recompute_round_trips_and_planners_that_cannot_honour_it_refuse():
    chain = Chain(u_f=[1, 1, 1], u_b=[1, 1, 1], x=[4, 4, 4], xbar=[8, 8, 8], x0=4,
                  no_recompute=[False, True, False])
    assert Chain.from_json(chain.to_json()) == chain
    assert "no_recompute" not in Chain.homogeneous(3).to_dict()   # old documents unchanged
    assert chain != Chain(u_f=[1, 1, 1], u_b=[1, 1, 1], x=[4, 4, 4], xbar=[8, 8, 8], x0=4)
    with pytest.raises(ChainError, match=r"no_recompute\[1\] = 2"):
        Chain(u_f=[1, 1], u_b=[1, 1], x=[4, 4], xbar=[8, 8], no_recompute=[0, 2])
    with pytest.raises(ChainError, match="one entry per stage"):
        Chain(u_f=[1, 1], u_b=[1, 1], x=[4, 4], xbar=[8, 8], no_recompute=[True])
    with pytest.raises(ChainError, match="plan_revolve: the chain marks stages \\[1\\]"):
        plan_revolve(chain, 10**6)
    # the floating DP honours the flag (tests/test_remat_floating.py checks it
    # against exhaustive search)
    assert _forward_counts(plan_floating(chain, 10**3).schedule, 3)[1] == 1
    # checkpoint_sequential's counts that recompute stage 1 are skipped
    plan = plan_sequential(chain, 10**6)
    assert _forward_counts(plan.schedule, 3)[1] == 1
    with pytest.raises(InfeasibleError, match="recomputes a stage the chain marks"):
        plan_sequential(chain, 10**6, segments=3)


@pytest.mark.parametrize("entry", [-2, "self", "t", 1000])
def test_least_memory_schedule_refuses_a_choice_min_memory_never_makes(entry):
    # the jitted walk writes its op arrays without bounds checks: an entry outside
    # -1 or [s, t) made it loop (s' < s) or write past its arrays (s' >= t)
    from rtmem.planners.rotor import min_memory, min_memory_schedule
    arrays = stage_arrays(Chain.homogeneous(6))
    _mm, choice = min_memory(arrays)
    good = min_memory_schedule(arrays, choice)
    # an entry the walk reads: the interval the root's choice leaves to the right
    t = arrays.N - 1
    s = 1 if choice[0, t] == -1 else int(choice[0, t]) + 1
    assert 1 <= s < t
    bad = choice.copy()
    bad[s, t] = {"self": s - 1, "t": t}.get(entry, entry)
    with pytest.raises(ScheduleError, match=rf"choice\[{s}, {t}\] = .* is not a choice") as err:
        min_memory_schedule(arrays, bad)
    assert err.value.reason == "bad-choice-table"
    assert min_memory_schedule(arrays, choice) == good   # the table was not changed


def test_least_memory_schedule_refuses_a_table_of_another_shape():
    from rtmem.planners.rotor import min_memory, min_memory_schedule
    arrays = stage_arrays(Chain.homogeneous(6))
    _mm, choice = min_memory(arrays)
    for bad in (choice[:-1], choice.astype(np.float64), choice[None]):
        with pytest.raises(ScheduleError, match="integer table min_memory returns"):
            min_memory_schedule(arrays, bad)


def _persistent_args(n=6, M=200):
    from rtmem.planners.rotor import persistent_schedule
    arrays = discretize(stage_arrays(Chain.homogeneous(n)), 1)
    table, mf, idx, mall, mnone = persistent_table(arrays, M)
    m = int(mf[0, arrays.N - 1])
    good = persistent_schedule(arrays, table, idx, mall, mnone, m)
    return persistent_schedule, arrays, [table, idx, mall, mnone, m], good


@pytest.mark.parametrize("m, match", [
    (10**6, r"m = 1000000 is not a column of table \(0\.\.200\)"),
    (-5, r"m = -5 is not a column of table"),
    ("least-1", r"no persistent schedule fits in m = \d+ \(table\[idx\[0, 6\], \d+\] is inf"),
    (2.0, r"m must be an integer")])
def test_persistent_schedule_refuses_an_m_outside_or_infeasible_in_the_table(m, match):
    # the jitted walk reads table columns without bounds checks: an m past M or
    # below 0, or one with an infeasible root (no choice to follow) made it read
    # and write past its arrays (a segmentation fault)
    walk, arrays, args, good = _persistent_args()
    args[4] = args[4] - 1 if m == "least-1" else m
    with pytest.raises(ScheduleError, match=match) as err:
        walk(arrays, *args)
    assert err.value.reason == "bad-persistent-table"
    args[4] = _persistent_args()[2][4]
    assert walk(arrays, *args) == good          # nothing was changed


def test_persistent_schedule_refuses_tables_of_another_shape_or_chain():
    walk, arrays, args, good = _persistent_args()
    table, idx, mall, mnone, m = args
    other = persistent_table(discretize(stage_arrays(Chain.homogeneous(3)), 1), 200)
    bad_idx = idx.copy()
    bad_idx[1, arrays.N - 1] = 10**6
    for bad, match in [((other[0], other[2], other[3], other[4], m), r"\(28, M \+ 1\) float"),
                       ((table, other[2], mall, mnone, m), r"idx must be an \(7, 7\) integer"),
                       ((table, idx, mall[:2], mnone, m), r"mall must be an \(7, 7\)"),
                       ((table, bad_idx, mall, mnone, m), r"idx\[1, 6\] = 1000000 is not a row"),
                       ((np.zeros(table.shape, np.int64), idx, mall, mnone, m), r"float array")]:
        with pytest.raises(ScheduleError, match=match):
            walk(arrays, *bad)
    assert walk(arrays, *args) == good


def test_persistent_schedule_refuses_a_table_no_fill_makes():
    # finite where the walk enters but every choice infinite below: the walk had no
    # choice to follow (-2) and wrote from a negative interval on
    walk, arrays, args, good = _persistent_args()
    table, idx, mall, mnone, m = args
    bad = table.copy()
    bad[idx[1:, arrays.N - 1]] = np.inf        # every tail (s', n) the root could keep
    bad[idx[0, :arrays.N - 1]] = np.inf        # every head (0, s')
    with pytest.raises(ScheduleError, match=rf"table\[idx\[0, 6\], {m}\] = .* is finite but "
                                            "none of its choices is") as err:
        walk(arrays, bad, idx, mall, mnone, m)
    assert err.value.reason == "bad-persistent-table"
    assert walk(arrays, *args) == good


def _with(arrays, **fields):
    from rtmem.planners.rotor import StageArrays
    kw = {k: getattr(arrays, k) for k in StageArrays.__slots__}
    kw.update(fields)
    return StageArrays(**kw)


@pytest.mark.parametrize("field, value, match", [
    ("xb", "negative", r"StageArrays\.xb\[0\] = -100 is negative"),
    ("xo", "short", r"StageArrays\.xo must be a 1-D integer array of N = 7"),
    ("xin", "short", r"StageArrays\.xin must be"),
    ("nr", "short", r"StageArrays\.nr must be"),
    ("nr", "hidden flag", r"StageArrays\.nr\[1\] = 2 is not the first no_recompute stage at "
                          r"or after 1 \(it must be 1 or nr\[2\]"),
    ("nr", "past N", r"StageArrays\.nr\[6\] = 9 is not the first"),
    ("of", "float", r"StageArrays\.of must be a 1-D integer array"),
    ("uf", "2-D", r"StageArrays\.uf must be a 1-D float array")])
def test_dp_passes_refuse_stage_arrays_they_would_index_past(field, value, match):
    # the jitted passes index every field up to N = len(uf) and use sizes as memory
    # indices: a short field was read past its end (a result from garbage) and a
    # negative size wrote past the table (heap corruption, 'double free', abort)
    arrays = discretize(stage_arrays(Chain.homogeneous(6)), 1)
    good = getattr(arrays, field)
    bad = {"negative": np.where(np.arange(good.size) == 0, -100, good),
           "short": good[:2], "float": good.astype(np.float64),
           "2-D": good[None],
           # stage 2 flagged (nr = [2, 2, 2, 7, ...]) with its own entry wiped
           # (nr = [2, 2, 7, ...]): the flag would be lost
           "hidden flag": np.where(np.arange(good.size) < 2, 2, good),
           "past N": np.full_like(good, 9)}[value]
    bad_arrays = _with(arrays, **{field: bad})
    for who, call in [("persistent_table", lambda a: persistent_table(a, 50)),
                      ("min_memory", min_memory)]:
        with pytest.raises(ChainError, match=rf"{who}: {match}"):
            call(bad_arrays)
    mm, _ = min_memory(arrays)
    assert mm == min_memory(_with(arrays))[0]   # the arrays were not changed


def test_floating_schedule_refuses_a_table_or_memory_it_would_read_past():
    # floating_schedule's jitted cells read F[.., m'] with m' <= m without bounds
    # checks: an m past M or F of another chain read past the table
    from rtmem.planners.floating import floating_schedule, floating_table
    arrays = discretize(stage_arrays(Chain.homogeneous(4)), 1)
    F = floating_table(arrays, 20)
    m = int(np.argmax(np.isfinite(F[0, arrays.N - 1, 0])))
    good = floating_schedule(arrays, F, m)
    other = floating_table(discretize(stage_arrays(Chain.homogeneous(2)), 1), 20)
    for table, mm, match in [(F, 10**5, r"m = 100000 is not a memory of F \(an integer 0\.\.20"),
                             (F, -3, "m = -3 is not a memory"),
                             (F, m - 1, rf"no floating schedule fits in m = {m - 1}"),
                             (other, m, r"F must be the \(5, 5, 5, M \+ 1\) float table")]:
        with pytest.raises(ScheduleError, match=match) as err:
            floating_schedule(arrays, table, mm)
        assert err.value.reason == "bad-floating-table"
    with pytest.raises(ChainError, match=r"floating_table: StageArrays\.xb\[0\] = -100"):
        floating_table(_with(arrays, xb=np.where(np.arange(arrays.N) == 0, -100, arrays.xb)),
                       20)
    assert floating_schedule(arrays, F, m) == good
