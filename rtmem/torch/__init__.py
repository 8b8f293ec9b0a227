"""rtmem.torch: run rtmem plans in PyTorch training loops.

Needs torch (``pip install rtmem[torch]``). Importing this package imports torch;
``import rtmem`` alone does not.
"""

try:
    import torch as _torch  # noqa: F401  (only to check that it is there)
except ModuleNotFoundError as e:
    if e.name != "torch":       # torch is there, but one of its own imports is not
        raise
    # Raised from bridge.py as a bare "No module named 'torch'", naming no extra;
    # name="torch" as in Python's own error, for code that reads e.name.
    raise ModuleNotFoundError("rtmem.torch needs PyTorch: pip install 'rtmem[torch]'",
                              name="torch") from e

from .bridge import ModulePlacement, as_tensor, from_tensor, on_torch_stream, place_parameters
from .executor import ExecutionError, ScheduleExecutor
from .profiler import profile_sequential
from .models import gpt2_model, resnet_model
from .offload import OffloadedAdam

__all__ = ["ExecutionError", "ModulePlacement", "OffloadedAdam", "ScheduleExecutor",
           "as_tensor", "from_tensor", "gpt2_model", "on_torch_stream", "place_parameters",
           "profile_sequential", "resnet_model"]
