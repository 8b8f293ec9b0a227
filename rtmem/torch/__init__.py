"""rtmem.torch: run rtmem plans in PyTorch training loops.

Needs torch (``pip install rtmem[torch]``). Importing this package imports torch;
``import rtmem`` alone does not.
"""

from .executor import ExecutionError, ScheduleExecutor
from .profiler import profile_sequential
from .models import gpt2_model, resnet_model

__all__ = ["ExecutionError", "ScheduleExecutor", "gpt2_model", "profile_sequential",
           "resnet_model"]
