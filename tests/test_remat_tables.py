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
