"""rtmem: a memory runtime for training DNNs that do not fit in GPU memory.

The runtime (arenas, buffers, transfers) is imported eagerly: it needs only numpy.
The planning vocabulary (:class:`Chain`, :class:`Schedule`, :class:`Platform`,
:func:`simulate`, :func:`plan_remat`) and the CPU optimizers (:class:`CPUAdam`, ...)
are loaded on first use, so that ``import rtmem`` imports neither numba nor torch.
Errors live in :mod:`rtmem.errors`; the torch bridge in :mod:`rtmem.torch`.
"""

from __future__ import annotations

import importlib

from . import adaptors, errors, layout, transfers
from ._optional import installed as _installed
from ._version import __version__
from .allocator import AllocatorStats, BestFitAllocator
from .arena import UNORDERED, ArenaStats, DeviceArena, HostArena
from .backends import get_backend
from .buffer import KINDS, Buffer
from .errors import (BackendError, ChainError, DoubleFreeError, InfeasibleError,
                     InvalidPointerError, KernelArgumentError, LayoutError, LossScaleError,
                     NonFiniteGradientError, OptimizerError, OutOfMemoryError, PlatformError,
                     ResidencyError, RtmemError, ScheduleError, TraceError, UnitError,
                     UseAfterFreeError)
from .jit_allocator import JitBestFitAllocator, JitBlock
from .loss_scale import LossScaler
from .transfers import drop_host, evict, offload, prefetch, synchronize, wait

# name -> module that defines it, imported on first access
_LAZY = {
    "Chain": "rtmem.planners", "Op": "rtmem.planners", "Platform": "rtmem.planners",
    "Schedule": "rtmem.planners", "SimResult": "rtmem.planners",
    "simulate": "rtmem.planners", "plan_remat": "rtmem.planners", "Plan": "rtmem.planners",
    "CPUAdam": "rtmem.optim", "CPUAdamW": "rtmem.optim", "NumpyAdam": "rtmem.optim",
    "NumpyAdamW": "rtmem.optim",
}
# Names that need torch (the torch extra) when first accessed.
_TORCH_NAMES = ("CPUAdam", "CPUAdamW")

__all__ = [
    "__version__",
    # runtime
    "AllocatorStats", "ArenaStats", "BestFitAllocator", "Buffer", "DeviceArena",
    "HostArena", "JitBestFitAllocator", "JitBlock", "KINDS", "LossScaler", "UNORDERED",
    "get_backend",
    "drop_host", "evict", "offload", "prefetch", "synchronize", "wait",
    "adaptors", "errors", "layout", "transfers",
    # errors
    "BackendError", "ChainError", "DoubleFreeError", "InfeasibleError",
    "InvalidPointerError", "KernelArgumentError", "LayoutError", "LossScaleError",
    "NonFiniteGradientError",
    "OptimizerError",
    "OutOfMemoryError", "PlatformError", "ResidencyError", "RtmemError", "ScheduleError",
    "TraceError", "UnitError", "UseAfterFreeError",
    # loaded on first use; without torch, CPUAdam/CPUAdamW stay out of __all__ (and
    # dir()): `from rtmem import *` and help(rtmem) resolve every name listed, and
    # failed on a core install with CPUAdam's ImportError. rtmem.CPUAdam still
    # raises it, naming the extra to install.
    *(name for name in _LAZY if name not in _TORCH_NAMES or _installed("torch")),
]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rtmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
