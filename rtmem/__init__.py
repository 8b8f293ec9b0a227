"""rtmem: a memory runtime for training DNNs that do not fit in GPU memory.

The planning vocabulary (:class:`Chain`, :class:`Schedule`, :class:`Platform`,
:func:`simulate`) is re-exported here from :mod:`rtmem.planners`, loaded on first
use so that ``import rtmem`` stays cheap. Errors live in :mod:`rtmem.errors`.
"""

from __future__ import annotations

from . import errors
from ._version import __version__
from .errors import (ChainError, InfeasibleError, OutOfMemoryError, PlatformError,
                     RtmemError, ScheduleError, UnitError)

_FROM_PLANNERS = ("Chain", "Op", "Platform", "Schedule", "SimResult", "simulate")

__all__ = [
    "__version__",
    "errors",
    "ChainError",
    "InfeasibleError",
    "OutOfMemoryError",
    "PlatformError",
    "RtmemError",
    "ScheduleError",
    "UnitError",
    *_FROM_PLANNERS,
]


def __getattr__(name):
    # Lazy re-export: numba is imported only when a planner name is first used.
    if name in _FROM_PLANNERS:
        from . import planners
        value = getattr(planners, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rtmem' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
