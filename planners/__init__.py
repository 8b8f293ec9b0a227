"""rtmem.planners: the chain model, schedules, the simulator and the planners.

Pure algorithms: this package imports only numpy and numba (plus rtmem's
leaf modules ``errors`` and ``units``), never torch or cupy.

- Vocabulary: :class:`Chain`, :class:`Schedule` (:class:`Op`), :class:`Platform`,
  :func:`simulate` (:class:`SimResult`), :class:`Plan`; built-in chains
  (:func:`builtin`, :func:`from_spec`).
- Rematerialization (thesis-remat.md): :func:`plan_remat` (rotor's persistent DP,
  the public entry), :func:`plan_floating` (the exact floating DP, small chains),
  :func:`plan_revolve` / :func:`revolve_schedule` / :func:`opt0_table` /
  :func:`binomial_makespan` (homogeneous chains), the multi-chain DP
  (:func:`multichain_opt`, :func:`multichain_schedule`, :func:`simulate_multichain`),
  and the baselines :func:`plan_store_all`, :func:`plan_sequential`,
  :func:`plan_sqrt` with :func:`compare_remat` to run them side by side.
"""

from rtmem.errors import InfeasibleError, ScheduleError

from .baselines import (plan_sequential, plan_sqrt, plan_store_all, segment_bounds,
                        sequential_schedule, store_all_schedule)
from .chain import Chain
from .floating import plan_floating
from .multichain import (MultiOp, multichain_opt, multichain_schedule, multichain_table,
                         simulate_multichain)
from .multichain import min_slots as multichain_min_slots
from .plan import ChainMismatchWarning, Plan
from .platform import CHANNELS, Platform
from .profiles import builtin, builtin_names, from_spec
from .remat import SlowSolveWarning, compare_remat, min_feasible_memory, plan_remat
from .revolve import binomial_makespan, opt0_table, plan_revolve, revolve_schedule
from .schedule import Op, Schedule
from .simulator import SimResult, simulate

__all__ = [
    "CHANNELS",
    "Chain",
    "ChainMismatchWarning",
    "InfeasibleError",
    "MultiOp",
    "Op",
    "Plan",
    "Platform",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "SlowSolveWarning",
    "binomial_makespan",
    "builtin",
    "builtin_names",
    "compare_remat",
    "from_spec",
    "min_feasible_memory",
    "multichain_min_slots",
    "multichain_opt",
    "multichain_schedule",
    "multichain_table",
    "opt0_table",
    "plan_floating",
    "plan_remat",
    "plan_revolve",
    "plan_sequential",
    "plan_sqrt",
    "plan_store_all",
    "revolve_schedule",
    "segment_bounds",
    "sequential_schedule",
    "simulate",
    "simulate_multichain",
    "store_all_schedule",
]
