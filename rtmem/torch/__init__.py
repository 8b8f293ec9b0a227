"""rtmem.torch: run rtmem plans in PyTorch training loops.

Needs torch (``pip install rtmem[torch]``). Importing this package imports torch;
``import rtmem`` alone does not.
"""

from rtmem._optional import require as _require

# first: the submodules' own import of torch failed bare, naming no extra
_require("torch", "rtmem.torch needs PyTorch: pip install 'rtmem[torch]'")

from .bridge import ModulePlacement, as_tensor, from_tensor, on_torch_stream, place_parameters  # noqa: E402
from .executor import ExecutionError, ScheduleExecutor  # noqa: E402
from .profiler import profile_sequential  # noqa: E402
from .models import gpt2_model, resnet_model  # noqa: E402
from .offload import OffloadedAdam  # noqa: E402

__all__ = ["ExecutionError", "ModulePlacement", "OffloadedAdam", "ScheduleExecutor",
           "as_tensor", "from_tensor", "gpt2_model", "on_torch_stream", "place_parameters",
           "profile_sequential", "resnet_model"]
