"""The Hypothesis strategies of rtmem.planners.testing generate what their
docstrings promise: values inside the documented ranges, both ends of each range
and every documented case reachable, and the flags honoured. A strategy that
silently stopped generating a case would leave the property tests built on it
passing while checking less (found by a mutation audit)."""

import math

import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from rtmem.planners import Chain, Op, Platform, Schedule, simulate
from rtmem.planners.testing import (chains, platforms, simulation_cases, valid_schedules,
                                    wandering_schedules)
from rtmem.planners.testing.wandering import _ABAR, _Walk

ACTIVATION_MOVES = (Op.OFFLOAD, Op.DELETE, Op.PREFETCH)
WEIGHT_MOVES = (Op.W_OFFLOAD, Op.W_DELETE, Op.W_PREFETCH, Op.G_OFFLOAD)


def _reach(strategy, condition, max_examples=300):
    """An example satisfying ``condition`` (reproducible, no database, no shrinking:
    only that one exists matters); fails the test if none is found."""
    return find(strategy, condition,
                settings=settings(max_examples=max_examples, database=None, derandomize=True,
                                  phases=[Phase.generate]))


def _never(strategy, condition, max_examples=15):
    """Assert that ``max_examples`` examples of ``strategy`` never satisfy ``condition``."""
    with pytest.raises(NoSuchExample):
        _reach(strategy, condition, max_examples)


def _times(chain):
    return [*chain.u_f.tolist(), *chain.u_b.tolist(), chain.u_loss]


def _sizes(chain):
    """Every drawn size: xbar - x is drawn as one, xbar is not."""
    return [*chain.x.tolist(), *(chain.xbar - chain.x).tolist(), *chain.w.tolist(),
            *chain.o_f.tolist(), *chain.o_b.tolist(), chain.x0, chain.o_loss]


# ------------------------------------------------------------------ chains()
@settings(max_examples=20, database=None)
@given(chains(1, 3))
def test_chain_values_stay_in_their_documented_ranges(chain):
    # sizes 0 or 1 B .. 99 GB (xbar = x + such a size), times 0 or 1 us .. 9.9 s
    for t in _times(chain):
        assert t == 0 or 1e-6 * (1 - 1e-12) <= t <= 9.9 * (1 + 1e-12), t
    for v in _sizes(chain):
        assert 0 <= v <= 99 * 10**9, v


def test_chain_value_ranges_are_reached_at_both_ends():
    _reach(chains(1, 1), lambda c: min(_sizes(c)) == 0 and min(_times(c)) == 0)
    _reach(chains(1, 1), lambda c: max(_sizes(c)) >= 10**10)       # the top decade
    _reach(chains(1, 1), lambda c: max(_times(c)) >= 1.0)          # seconds
    _reach(chains(1, 1), lambda c: c.xbar[0] > c.x[0] > 0)         # xbar above x
    # small: sizes 0..12, xbar = x + 0..12, times 0..10 s
    _reach(chains(1, 1, small=True), lambda c: c.x[0] == 12 and c.xbar[0] == 24)
    _reach(chains(1, 1, small=True), lambda c: min(_times(c)) == 0 and max(_times(c)) == 10)


def test_chain_stage_counts_reach_both_ends():
    _reach(chains(1, 3), lambda c: c.n == 3)
    _reach(chains(2, 3), lambda c: c.n == 2)
    _never(chains(2, 3), lambda c: not 2 <= c.n <= 3)


def test_chain_flags_are_honoured():
    _never(chains(1, 3, weights=False), lambda c: c.w.any())
    _never(chains(1, 3, overheads=False),
           lambda c: c.o_f.any() or c.o_b.any() or c.o_loss != 0)
    _never(chains(2, 3, homogeneous=True),
           lambda c: any(len(set(col.tolist())) > 1
                         for col in (c.u_f, c.u_b, c.x, c.xbar, c.w, c.o_f, c.o_b)))
    _reach(chains(2, 2, homogeneous=False), lambda c: c.x[0] != c.x[1])
    _reach(chains(2, 2), lambda c: c.x[0] != c.x[1])             # None: either


def test_chain_stage_counts_start_at_one():
    with pytest.raises(ValueError, match="chains: need integers 1 <= min <= max"):
        _reach(chains(0, 3), lambda c: True, max_examples=1)


# --------------------------------------------------------------- platforms()
@settings(max_examples=20, database=None)
@given(platforms(5, 10))
def test_platform_values_stay_in_their_documented_ranges(platform):
    assert 5 <= platform.memory <= 10
    bw = platform.bandwidth
    assert bw == math.inf or 1e3 <= bw <= 990e12, bw


def test_platform_ranges_and_channels_are_all_reached():
    _reach(platforms(5, 10), lambda p: p.memory == 10)
    _reach(platforms(5, 10), lambda p: p.memory == 5)
    _reach(platforms(), lambda p: p.bandwidth == math.inf)
    _reach(platforms(), lambda p: p.bandwidth == 1e3)               # 1 kB/s
    for channel in ("duplex", "shared"):
        _reach(platforms(), lambda p: p.channel == channel)


# ---------------------------------------------------------- valid_schedules()
def _last_weight_move_stays(schedule):
    """True if some stage's weights are moved off the device and never brought back."""
    ops = list(schedule)
    return any(op in (Op.W_OFFLOAD, Op.W_DELETE)
               and (Op.W_PREFETCH, s, 0) not in ops[i + 1:]
               for i, (op, s, _) in enumerate(ops))


def test_valid_schedules_reach_every_documented_move():
    chain = Chain.homogeneous(3)
    # C2 with the longest F_none run: a_0 kept, then F_none up to the last stage
    _reach(valid_schedules(chain, transfers=False),
           lambda s: str(s).startswith("F_ck 0, F_none 1, F_none 2, L"))
    _reach(valid_schedules(chain), lambda s: s.count(Op.W_DELETE) > 0)
    _reach(valid_schedules(chain), lambda s: s.count(Op.W_OFFLOAD) > 0)
    _reach(valid_schedules(chain), lambda s: s.count(Op.G_OFFLOAD) > 0)
    _reach(valid_schedules(chain), lambda s: s.count(Op.PREFETCH) > 0)
    # a weight move after the last use of its stage (nothing brings it back)
    _reach(valid_schedules(chain), _last_weight_move_stays)


def test_simulation_cases_honour_their_flags():
    _never(simulation_cases(1, 2, transfers=False, wander=True),
           lambda c: any(c[1].count(op) for op in ACTIVATION_MOVES + WEIGHT_MOVES))
    _never(simulation_cases(1, 2, small=True), lambda c: max(_sizes(c[0])) > 12,
           max_examples=5)


# ------------------------------------------------------- wandering_schedules()
def _f_all_over_a_resident_abar(schedule):
    abar = set()                   # k of every resident abar_k
    for op, s, aux in schedule:
        if op == Op.F_ALL:
            if s + 1 in abar:
                return True
            abar.add(s + 1)
        elif op == Op.B or (op == Op.DELETE and aux == _ABAR):
            abar.discard(s + 1 if op == Op.B else s)
        elif op == Op.PREFETCH and aux == _ABAR:
            abar.add(s)
    return False


def test_wandering_schedules_reach_what_the_module_docstring_lists():
    _reach(wandering_schedules(2), _f_all_over_a_resident_abar)    # made again
    # a_0 dropped once a host copy of it exists
    _reach(wandering_schedules(2), lambda s: "delete a0" in str(s))
    _reach(wandering_schedules(3), lambda s: s.count(Op.G_OFFLOAD) > 0)
    _reach(wandering_schedules(2), lambda s: s.count(Op.W_DELETE) > 0)
    # moves after B 0: none was ever drawn (the walk stopped there)
    _reach(wandering_schedules(2), lambda s: list(s)[-1][0] != Op.B)


def test_a_wandering_failure_needing_a_gradient_move_shrinks_to_the_shortest_chain():
    # The docstring promises failures shrink toward the shortest schedule. The
    # least schedule with a g_offload is F_ck 0, L, F_all 0, B 0, g_offload 0 (one
    # stage; before moves were drawn after B 0 it was 8 ops on 2 stages). With
    # g_offload listed after the 2 n weight moves its choice index depended on n,
    # and this shrank to 5 stages and 17 ops.
    strategy = st.integers(1, 6).flatmap(lambda n: st.tuples(st.just(n),
                                                             wandering_schedules(n)))
    n, schedule = find(strategy, lambda case: case[1].count(Op.G_OFFLOAD) > 0,
                       settings=settings(max_examples=1000, database=None,
                                         derandomize=True))
    assert (n, len(schedule)) == (1, 5), str(schedule)


def test_wandering_schedules_honour_their_flags():
    _never(wandering_schedules(3, transfers=False),
           lambda s: any(s.count(op) for op in ACTIVATION_MOVES))
    _never(wandering_schedules(3, weights=False),
           lambda s: any(s.count(op) for op in WEIGHT_MOVES))


def _finish(walk, ops):
    """Apply ``ops`` to ``walk``, then return its greedy finish as text-like tuples."""
    for op in ops:
        walk.apply(op)
    out = []
    while (op := walk.progress()) is not None:
        walk.apply(op)
        out.append(op)
    return out


def test_the_greedy_finish_prefetches_a_host_copy_of_abar_rather_than_recomputing():
    # one stage: abar_1 offloaded and deleted before the loss; B 0 then needs it
    walk = _Walk(1)
    tail = _finish(walk, [(Op.F_CK, 0, 0), (Op.F_ALL, 0, 0), (Op.OFFLOAD, 1, _ABAR),
                          (Op.DELETE, 1, _ABAR)])
    # the loss reads a_1 (consuming it: abar_1 is not resident), then abar_1 comes back
    assert tail == [(Op.LOSS, 0, 0), (Op.PREFETCH, 1, _ABAR), (Op.B, 0, 0)]


def test_the_greedy_finish_recomputes_checkpoints_with_f_ck():
    # two stages, a_1 lost after the loss: B 1 needs abar_2, made by F_all 1 from a_1,
    # which is recomputed from a_0 by F_ck 0 (keeping only a_1), not by F_all 0
    walk = _Walk(2)
    tail = _finish(walk, [(Op.F_CK, 0, 0), (Op.F_CK, 1, 0), (Op.LOSS, 0, 0),
                          (Op.DELETE, 1, 0)])
    assert tail == [(Op.F_CK, 0, 0), (Op.F_ALL, 1, 0), (Op.B, 1, 0), (Op.F_ALL, 0, 0),
                    (Op.B, 0, 0)]


def test_the_walk_keeps_a_plain_input_that_has_an_abar_beside_it():
    # NOTE [ Simulator semantics ]: the loss (and B k) consumes a plain a_k only when
    # abar_k is not resident; the walk's model must keep a_1 here, as the simulator
    # does, or it would offer a prefetch of a_1 over its resident copy
    walk = _Walk(1)
    for op in [(Op.F_CK, 0, 0), (Op.F_ALL, 0, 0), (Op.LOSS, 0, 0)]:
        walk.apply(op)
    assert (1, 0) in walk.dev and (Op.DELETE, 1, 0) in walk.legal()[1]
    simulate(Chain.homogeneous(1), Schedule.from_text("F_ck 0, F_all 0, L, delete a1, B 0"),
             Platform(math.inf))                       # raises if a_1 were gone


# ------------------------------------------------------------- no_recompute
def _flagged_chains():
    """Chains of 1..5 stages, each stage flagged no_recompute or not."""
    return chains(1, 5, small=True, no_recompute=True)


def test_chains_draw_no_recompute_flags_only_when_asked():
    # chains() drew no flag at all: simulation_cases never covered flagged chains
    # and every test built them by hand
    _never(chains(1, 4), lambda c: c.no_recompute.any())
    _never(chains(1, 4, homogeneous=True), lambda c: c.no_recompute.any())
    _reach(chains(3, 3, no_recompute=True), lambda c: c.no_recompute.tolist() == [True] * 3)
    _reach(chains(3, 3, no_recompute=True), lambda c: c.no_recompute.tolist() == [False] * 3)
    # per stage in a homogeneous chain too: its costs are shared, its flags not
    _reach(chains(3, 3, homogeneous=True, no_recompute=True),
           lambda c: c.no_recompute.tolist() == [False, True, False])
    _reach(simulation_cases(2, 2, no_recompute=True), lambda c: c[0].no_recompute.all())
    _reach(simulation_cases(2, 2, wander=True, no_recompute=True),
           lambda c: c[0].no_recompute.all())
    for make in (lambda: chains(no_recompute="some"),
                 lambda: simulation_cases(no_recompute=0.5)):
        with pytest.raises(ValueError, match="no_recompute must be True or False"):
            make()


def test_flagged_chains_shrink_to_the_flags_a_failure_needs():
    # a flag shrinks to False and goes with its stage: the least chain whose
    # third stage is flagged has three stages and that one flag
    shrinking = settings(max_examples=1000, database=None, derandomize=True,
                         phases=[p for p in Phase if p is not Phase.explain])
    chain = find(chains(1, 8, no_recompute=True), lambda c: c.n >= 3 and c.no_recompute[2],
                 settings=shrinking)
    assert chain.no_recompute.tolist() == [False, False, True], chain
    assert not (chain.x.any() or chain.u_f.any() or chain.x0)
    chain, schedule, _ = find(simulation_cases(no_recompute=True),
                              lambda c: c[0].no_recompute.any(), settings=shrinking)
    assert chain.no_recompute.tolist() == [True], chain
    assert str(schedule) == "F_all 0, L, B 0", str(schedule)


@settings(max_examples=40, deadline=None, database=None)
@given(_flagged_chains().flatmap(lambda c: st.tuples(st.just(c), valid_schedules(c))))
def test_valid_schedules_run_flagged_stages_once(case):
    # "valid with enough memory": a stage the chain flags no_recompute ran twice
    # (F_ck, then F_all on the way back), which simulate refuses
    chain, schedule = case
    simulate(chain, schedule, Platform(math.inf))


@settings(max_examples=60, deadline=None, database=None)
@given(_flagged_chains().flatmap(lambda c: st.tuples(st.just(c), wandering_schedules(c))))
def test_wandering_schedules_run_flagged_stages_once(case):
    # "accepted with enough memory": the walk ran any forward over a resident input,
    # a flagged stage too, and discarded the abar its one run had to keep
    chain, schedule = case
    simulate(chain, schedule, Platform(math.inf))


def test_wandering_schedules_still_wander_around_flagged_stages():
    chain = Chain.from_dict({**Chain.homogeneous(3).to_dict(),
                             "no_recompute": [False, True, False]})
    # an unflagged stage recomputed, and the flagged one's abar parked on the host
    _reach(wandering_schedules(chain), lambda s: s.count(Op.F_CK) + s.count(Op.F_ALL) > 3)
    _reach(wandering_schedules(chain), lambda s: "delete abar2" in str(s))
