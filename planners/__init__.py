"""rtmem.planners: the chain model, schedules, the simulator and the planners.

Pure algorithms: this package imports only numpy, numba and scipy (plus rtmem's
leaf modules ``errors`` and ``units``), never torch or cupy.
"""

from rtmem.errors import InfeasibleError, ScheduleError

from .baselines import segment_bounds, sequential_schedule, store_all_schedule
from .chain import Chain
from .platform import CHANNELS, Platform
from .profiles import builtin, builtin_names, from_spec
from .schedule import Op, Schedule
from .simulator import SimResult, simulate

__all__ = [
    "CHANNELS",
    "Chain",
    "InfeasibleError",
    "Op",
    "Platform",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "builtin",
    "builtin_names",
    "from_spec",
    "segment_bounds",
    "sequential_schedule",
    "simulate",
    "store_all_schedule",
]
