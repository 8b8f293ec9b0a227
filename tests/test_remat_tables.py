"""The planners' public functions that take a table (or StageArrays) a caller can
make by hand: a table no fill makes, or one made for another chain, is refused
with a ScheduleError naming what to pass, never an internal-error message, a
bare IndexError or a crash."""

import numpy as np
import pytest

from rtmem.errors import ScheduleError
from rtmem.planners import Chain
from rtmem.planners.floating import floating_schedule, floating_table
from rtmem.planners.rotor import discretize, stage_arrays
from rtmem.planners.schedule import Op


def test_floating_schedule_refuses_a_table_of_the_right_shape_no_fill_makes():
    # the reconstruction re-evaluates each cell it visits from the table: on made-up
    # values the root's best choice is not its entry, which it reported as "a bug"
    rng = np.random.default_rng()
    arrays = discretize(stage_arrays(Chain.homogeneous(4)), 1)
    F = floating_table(arrays, 20)
    m = int(np.argmax(np.isfinite(F[0, arrays.N - 1, 0])))
    good = floating_schedule(arrays, F, m)
    # every entry below any schedule's time (each stage's u_F + u_B is 2 s here)
    made_up = rng.uniform(0.0, 1.0, F.shape)
    with pytest.raises(ScheduleError, match=r"F\[0, 4, 0, \d+\] = .* not a table "
                                            r"floating_table\(arrays, M\) makes") as err:
        floating_schedule(arrays, made_up, m)
    assert err.value.reason == "bad-floating-table"
    assert floating_schedule(arrays, F, m) == good


def _choices(n=6):
    from rtmem.planners.rotor import min_memory
    arrays = stage_arrays(Chain.homogeneous(n))
    mm, choice = min_memory(arrays)
    return arrays, mm, choice


@pytest.mark.timeout(30)
@pytest.mark.parametrize("entry", [-2, "self", "t", 1000])
def test_choices_memory_refuses_a_choice_min_memory_never_makes(entry):
    # choices_memory walked the table in Python with no check of its own: an entry
    # past N was a bare IndexError, a negative one a KeyError, and s' = t split
    # (s, t) into itself (a loop growing its stack without end)
    from rtmem.planners.rotor import choices_memory
    arrays, mm, choice = _choices()
    t = arrays.N - 1
    s = 1 if choice[0, t] == -1 else int(choice[0, t]) + 1    # an entry the walk reads
    assert 1 <= s < t
    bad = choice.copy()
    bad[s, t] = {"self": s - 1, "t": t}.get(entry, entry)
    with pytest.raises(ScheduleError, match=rf"choices_memory: choice\[{s}, {t}\] = .* is not "
                                            "a choice") as err:
        choices_memory(arrays, bad)
    assert err.value.reason == "bad-choice-table"
    assert choices_memory(arrays, choice) == mm              # the table was not changed


def test_choices_memory_refuses_a_table_of_another_shape():
    from rtmem.planners.rotor import choices_memory
    arrays, mm, choice = _choices()
    for bad in (choice[:-1], choice.astype(np.float64), choice[None], "table"):
        with pytest.raises(ScheduleError, match="integer table min_memory returns") as err:
            choices_memory(arrays, bad)
        assert err.value.reason == "bad-choice-table"


@pytest.mark.parametrize("who", ["min_memory_schedule", "choices_memory"])
def test_choice_tables_of_a_chain_without_the_no_recompute_flag_are_refused(who):
    # a choice table made for another chain of the same length walks as any other:
    # the walks read only N from the arrays. One whose F^ck runs past a stage these
    # arrays mark no_recompute made a schedule recomputing that (in-place) stage
    from rtmem.planners import rotor
    from rtmem.planners.simulator import recomputed_flagged
    rng = np.random.default_rng()
    plain = Chain.homogeneous(6)
    choice = rotor.min_memory(stage_arrays(plain))[1]
    walk = rotor.min_memory_schedule(stage_arrays(plain), choice)
    # a stage the plain table's schedule runs more than once (not the last)
    forwards = np.isin(walk.op, [int(Op.F_NONE), int(Op.F_CK), int(Op.F_ALL)])
    runs = np.bincount(walk.stage[forwards], minlength=6)
    k = int(rng.choice(np.flatnonzero(runs[:5] > 1)))
    flagged = Chain(u_f=plain.u_f, u_b=plain.u_b, x=plain.x, xbar=plain.xbar, x0=plain.x0,
                    no_recompute=np.arange(6) == k)
    arrays = stage_arrays(flagged)
    with pytest.raises(ScheduleError, match=rf"{who}: choice\[\d+, \d+\] = \d+ runs stage "
                                            rf"{k} twice, which these arrays mark "
                                            "no_recompute") as err:
        getattr(rotor, who)(arrays, choice)
    assert err.value.reason == "bad-choice-table"
    own = rotor.min_memory(arrays)[1]
    assert recomputed_flagged(flagged, rotor.min_memory_schedule(arrays, own)) is None
    assert rotor.choices_memory(arrays, own) == rotor.min_memory(arrays)[0]


# ------------------------------------------------------------------- the sweep
# Every public planner function that takes a table, StageArrays or operations a
# caller can make by hand, fed random ones of the right shape: it returns a
# result its contract promises or raises an rtmem error (RtmemError and its
# subclasses), never another exception or a crash. Most walk their input in
# jitted code without bounds checks, so each case runs in a fresh interpreter:
# a segmentation fault there fails the test instead of ending the run.

def _random_chain(rng, n, flags=True):
    x = rng.integers(0, 6, n)
    return Chain(u_f=rng.uniform(0, 3, n), u_b=rng.uniform(0, 3, n), x=x,
                 xbar=x + rng.integers(0, 6, n), x0=int(rng.integers(0, 6)),
                 no_recompute=(rng.random(n) < 0.2) if flags else None)


def _ints(rng, shape, lo, hi, real=None):
    """Random integers in lo..hi, or (half the time, when given) ``real`` with a
    few entries changed: a table that is nearly one a fill makes."""
    if real is None or rng.random() < 0.5:
        return rng.integers(lo, hi + 1, shape)
    out = np.array(real, np.int64)
    hit = rng.random(out.shape) < 0.1
    out[hit] = rng.integers(lo, hi + 1, int(hit.sum()))
    return out


def _floats(rng, shape, real=None):
    """Random times (s), a fifth of them inf, or ``real`` with a few changed."""
    out = rng.uniform(0, 50, shape) if real is None or rng.random() < 0.5 else real.copy()
    hit = rng.random(shape) < (0.2 if real is None else 0.1)
    out[hit] = np.where(rng.random(int(hit.sum())) < 0.5, np.inf, rng.uniform(0, 50))
    return out


def _valid(chain, schedule):
    """A returned schedule is one the simulator accepts (with unlimited memory)."""
    import math

    from rtmem.planners import Platform, simulate
    simulate(chain, schedule, Platform(math.inf))


def _case_persistent_schedule(rng):
    from rtmem.planners.rotor import persistent_schedule, persistent_table
    chain = _random_chain(rng, int(rng.integers(1, 6)))
    arrays = discretize(stage_arrays(chain), 1)
    M = int(rng.integers(0, 40))
    table, _mf, idx, mall, mnone = persistent_table(arrays, M)
    N, rows = arrays.N, table.shape[0]
    args = (_floats(rng, table.shape, table), _ints(rng, (N, N), -2, rows + 1, idx),
            _ints(rng, (N, N), -3, M + 3, mall), _ints(rng, (N, N), -3, M + 3, mnone),
            int(rng.integers(-2, M + 3)))
    return chain, lambda: persistent_schedule(arrays, *args)


def _random_choices(rng, N):
    if rng.random() < 0.5:
        return _ints(rng, (N, N), -3, N + 2)
    # entries min_memory could make, with a few out of range
    out = np.full((N, N), -1, np.int64)
    for t in range(N):
        for s in range(t):
            out[s, t] = rng.integers(s - 1, t) if rng.random() < 0.95 else rng.integers(-5, N + 5)
    return out.astype(rng.choice([np.int16, np.int32, np.int64]))


def _case_min_memory_schedule(rng):
    from rtmem.planners.rotor import min_memory_schedule
    chain = _random_chain(rng, int(rng.integers(1, 7)))
    arrays = stage_arrays(chain)
    choice = _random_choices(rng, arrays.N)
    return chain, lambda: min_memory_schedule(arrays, choice)


def _case_choices_memory(rng):
    from rtmem.planners.rotor import choices_memory, min_memory
    chain = _random_chain(rng, int(rng.integers(1, 7)))
    arrays = stage_arrays(chain)
    choice = _random_choices(rng, arrays.N)

    def call():
        got = choices_memory(arrays, choice)
        # the docstring's promise: min_memory is at most the memory of any choices
        assert got >= min_memory(arrays)[0], (got, choice)
    return None, call


def _case_floating_schedule(rng):
    chain = _random_chain(rng, int(rng.integers(1, 5)))
    arrays = discretize(stage_arrays(chain), 1)
    M = int(rng.integers(0, 25))
    F = floating_table(arrays, M)
    made = _floats(rng, F.shape, F)
    m = int(rng.integers(-2, M + 3))
    return chain, lambda: floating_schedule(arrays, made, m)


def _case_revolve_schedule(rng):
    from rtmem.planners import revolve_schedule
    from rtmem.planners.revolve import revolve_argmins
    n, m = int(rng.integers(1, 8)), int(rng.integers(2, 7))
    shape = (n + 1 + int(rng.integers(0, 2)), m + 1 + int(rng.integers(0, 2)))
    real = revolve_argmins(shape[0] - 1, shape[1] - 1) if m >= 3 else None
    arg = _ints(rng, shape, -2, n + 2, real)
    return Chain.homogeneous(n), lambda: revolve_schedule(n, m, arg)


def _case_single_chain_ops(rng):
    from rtmem.planners.revolve import revolve_ops, single_chain_ops
    L, m = int(rng.integers(1, 8)), int(rng.integers(2, 7))
    arg = _ints(rng, (L + 1, m + 1), -2, L + 2)
    walk = revolve_ops if rng.random() < 0.5 else single_chain_ops
    return None, lambda: walk(L, m, arg=arg)


def _case_simulate_multichain(rng):
    from rtmem.planners import simulate_multichain
    from rtmem.planners.multichain import MultiOp
    K = int(rng.integers(1, 4))
    lengths = [int(v) for v in rng.integers(0, 4, K)]
    m = int(rng.integers(0, 8))
    b = [int(v) for v in rng.integers(0, 2, K)]
    kinds = ["S", "F", "D", "L", "B", "Dbar"]
    ops = [MultiOp(kinds[int(rng.integers(0, 6))], int(rng.integers(-1, K + 1)),
                   int(rng.integers(-1, 5))) for _ in range(int(rng.integers(0, 25)))]

    def call():
        makespan, peak = simulate_multichain(ops, lengths, m, b)
        assert peak <= m and np.isfinite(makespan)
    return None, call


def _case_simulate(rng):
    from rtmem.planners import Platform, Schedule, simulate
    chain = _random_chain(rng, int(rng.integers(1, 6)))
    k = int(rng.integers(0, 30))
    op = rng.integers(0, 5, k) if rng.random() < 0.7 else rng.integers(-1, 14, k)
    stage = rng.integers(-1, chain.n + 2, k)
    budget = int(rng.integers(0, 200))
    return None, lambda: simulate(chain, Schedule(op, stage), Platform(budget))


def _case_stage_arrays(rng):
    # hand-made StageArrays into the three DP fills
    from rtmem.planners.rotor import StageArrays, min_memory, persistent_table
    arrays = discretize(stage_arrays(_random_chain(rng, int(rng.integers(1, 5)))), 1)
    fields = {k: getattr(arrays, k) for k in StageArrays.__slots__}
    for k in rng.choice(list(fields), int(rng.integers(1, 4)), replace=False):
        v = fields[k]
        fields[k] = [np.where(rng.random(v.shape) < 0.3, -1, v), v[:-1],
                     v.astype(np.float64), v[None], np.append(v, 0)][int(rng.integers(0, 5))]
    bad = StageArrays(**fields)
    fill = [lambda: persistent_table(bad, 20), lambda: min_memory(bad),
            lambda: floating_table(bad, 10)][int(rng.integers(0, 3))]
    return None, fill


_CASES = {name[len("_case_"):]: f for name, f in globals().items() if name.startswith("_case_")}


def _sweep(name: str, seed: int, tables: int) -> None:
    """Run ``tables`` random instances of case ``name`` (in the subprocess)."""
    from rtmem.errors import RtmemError
    rng = np.random.default_rng(seed)
    for _ in range(tables):
        chain, call = _CASES[name](rng)
        try:
            out = call()
        except RtmemError:
            continue
        if chain is not None:
            _valid(chain, out)


@pytest.mark.parametrize("name", sorted(_CASES))
def test_random_tables_of_the_right_shape_raise_only_rtmem_errors(name):
    import os
    import subprocess

    from _subprocess import run_ok
    seed = int(np.random.default_rng().integers(2**31))
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        run_ok(f"""
            import sys
            sys.path.insert(0, {here!r})
            from test_remat_tables import _sweep
            _sweep({name!r}, {seed}, 150)
            print("ok")
            """, timeout=180)
    except (AssertionError, subprocess.TimeoutExpired) as e:     # a walk that loops
        raise AssertionError(f"{name} with seed {seed} (rerun: _sweep({name!r}, {seed}, 150) "
                             f"in tests/test_remat_tables.py): {e}") from None
