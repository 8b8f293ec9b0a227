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
