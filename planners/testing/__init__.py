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
                          orders of magnitude (or small integers for oracles),
                          optionally with stages flagged ``no_recompute``
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

The strategies require ``hypothesis`` (``pip install rtmem[test]``); the oracles
do not: ``from rtmem.planners.testing import brute_force_remat`` works without it.

Each strategy checks its arguments when called, not at the first draw: a bad
one (``simulation_cases(5, 2)``, a non-integer size) raises
:class:`StrategyArgumentError` at the call, which is hypothesis's
``InvalidArgument``, a ``ValueError`` and an :class:`rtmem.errors.RtmemError`
(it lives here, not in :mod:`rtmem.errors`, because it subclasses a hypothesis
type: as ``rtmem.torch.ExecutionError`` lives with the extra it needs).

Time to a failing example: each drawn case costs tens of milliseconds, and
after shrinking hypothesis's *explain* phase replays variations of the minimal
case. Measured on a planted failure of ``simulation_cases(1, 8)`` (median of 3,
``max_examples=200``): 61 s to the report with the default phases, 1.9 s
without explain. While iterating on a failure, leave it out::

    from hypothesis import Phase, settings
    @settings(deadline=None, phases=[p for p in Phase if p is not Phase.explain])
"""

# What the strategies say when hypothesis is missing (strategies.py and
# wandering.py raise it on import): their own bare "No module named
# 'hypothesis'" named no extra.
_HYPOTHESIS_MISSING = ("rtmem.planners.testing's strategies need hypothesis: pip install "
                      "hypothesis (or 'rtmem[test]', which has it)")

from .bruteforce import brute_force_multichain, brute_force_remat  # noqa: E402
from .reference import reference_simulate  # noqa: E402

__all__ = ["chains", "platforms", "valid_schedules", "wandering_schedules", "simulation_cases",
           "StrategyArgumentError", "reference_simulate", "brute_force_remat",
           "brute_force_multichain"]

#: The strategies and their error, imported on first use (PEP 562): the oracles
#: need no hypothesis, and importing the package needed it for them all.
_STRATEGIES = {"chains": "strategies", "platforms": "strategies",
               "valid_schedules": "strategies", "simulation_cases": "strategies",
               "wandering_schedules": "wandering", "StrategyArgumentError": "_arguments"}


def __getattr__(name):
    if name in _STRATEGIES:
        import importlib
        value = getattr(importlib.import_module(f".{_STRATEGIES[name]}", __name__), name)
        globals()[name] = value         # once: later lookups skip __getattr__
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
