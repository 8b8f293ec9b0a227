"""rtmem.planners.testing: hypothesis strategies and oracles for schedules.

Users import this to property-test their own schedules and planners::

    from hypothesis import given, settings
    from rtmem.planners import simulate
    from rtmem.planners.testing import simulation_cases

    @settings(deadline=None)    # the first call loads the JIT cache (seconds)
    @given(simulation_cases())
    def test_my_invariant(case):
        chain, schedule, platform = case
        result = simulate(chain, schedule, platform)
        ...

Strategies
----------
:func:`chains`            heterogeneous or homogeneous chains, sizes over many
                          orders of magnitude (or small integers for oracles)
:func:`platforms`         memory / bandwidth / channel triples
:func:`valid_schedules`   random *valid* schedules of a given chain (rematerialization,
                          offload/prefetch/delete, weight and gradient moves)
:func:`wandering_schedules` random walks over every operation the simulator
                          allows (recompute over resident tensors, discards, late
                          prefetches...), finished greedily: schedules no planner
                          emits, for executors to survive
:func:`simulation_cases`  (chain, schedule, platform) triples that simulate cleanly

Oracles
-------
:func:`reference_simulate`     a plain-Python simulator, independent of the jitted one
:func:`brute_force_remat`      exact optimal rematerialization of small chains
                               (Dijkstra over Table 2.1 states, the simulator's rules)
:func:`brute_force_multichain` exhaustive search for the multi-chain problem

Requires ``hypothesis`` (``pip install rtmem[test]``).
"""

from rtmem._optional import require as _require

# first: the submodules' own import of hypothesis failed bare, naming no extra
_require("hypothesis", "rtmem.planners.testing needs hypothesis: pip install hypothesis "
         "(or 'rtmem[test]', which has it)")

from .bruteforce import brute_force_multichain, brute_force_remat  # noqa: E402
from .reference import reference_simulate  # noqa: E402
from .strategies import chains, platforms, simulation_cases, valid_schedules  # noqa: E402
from .wandering import wandering_schedules  # noqa: E402

__all__ = ["chains", "platforms", "valid_schedules", "wandering_schedules", "simulation_cases",
           "reference_simulate", "brute_force_remat", "brute_force_multichain"]
