"""rtmem.torch: run rtmem plans in PyTorch training loops.

Needs torch (``pip install rtmem[torch]``). Importing this package imports torch;
``import rtmem`` alone does not.
"""

from .bridge import ModulePlacement, as_tensor, from_tensor, on_torch_stream, place_parameters
from .executor import ExecutionError, ScheduleExecutor
from .profiler import profile_sequential
from .models import gpt2_model, resnet_model
from .offload import OffloadedAdam

__all__ = ["ExecutionError", "ModulePlacement", "OffloadedAdam", "ScheduleExecutor",
           "as_tensor", "from_tensor", "gpt2_model", "on_torch_stream", "place_parameters",
           "profile_sequential", "resnet_model"]
