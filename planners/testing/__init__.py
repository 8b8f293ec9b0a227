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

try:
    import hypothesis as _hypothesis  # noqa: F401  (only to check that it is there)
except ModuleNotFoundError as e:
    if e.name != "hypothesis":  # hypothesis is there, one of its own imports is not
        raise
    # Raised from strategies.py as a bare "No module named 'hypothesis'", naming no
    # extra; name="hypothesis" as in Python's own error, for code that reads e.name.
    raise ModuleNotFoundError(
        "rtmem.planners.testing needs hypothesis: pip install hypothesis (or "
        "'rtmem[test]', which has it)", name="hypothesis") from e

from .bruteforce import brute_force_multichain, brute_force_remat
from .reference import reference_simulate
from .strategies import chains, platforms, simulation_cases, valid_schedules
from .wandering import wandering_schedules

__all__ = ["chains", "platforms", "valid_schedules", "wandering_schedules", "simulation_cases",
           "reference_simulate", "brute_force_remat", "brute_force_multichain"]
