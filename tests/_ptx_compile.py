"""Compile every numba.cuda kernel of ``rtmem.kernels.dha`` to PTX, without a GPU.

Run by tests/test_dha_ptx.py in a subprocess with the CUDA simulator off (the
simulator never types a kernel, so a kernel can pass every simulated test and
still fail to compile: the GEMM's shared-array shape did). Needs numba-cuda and
NVVM + NVRTC (the nvidia-nvvm and nvidia-cuda-nvrtc wheels: the ``ptx`` extra);
no driver. Prints one JSON line: {"compiled": [...], "failed": {name: error},
"missing": [kernels without a signature below]}.
"""

import json
import os
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

from numba import cuda  # noqa: E402
from numba import types as t  # noqa: E402
from numba.cuda import dispatcher as _dispatcher  # noqa: E402

CC = (9, 0)   # Hopper, the H200 of the GPU sessions


class _Device:
    """What a device function compiled from inside a kernel asks of the (absent)
    current device: only its compute capability."""
    compute_capability = CC


# numba compiles the device functions a kernel calls (e.g. _block_sum) for the
# current device; there is none here, so answer with the target's capability.
if not hasattr(_dispatcher, "get_current_device"):
    sys.exit("numba-cuda changed: numba.cuda.dispatcher.get_current_device is gone; "
             "update tests/_ptx_compile.py")
_dispatcher.get_current_device = lambda: _Device()

# --without-row-stack: numpy as of 2.5, which removed np.row_stack (numba-cuda's
# array support overloads it when first imported; rtmem.kernels imports it with
# the alias put back for that import only)
import numpy as np  # noqa: E402

if "--without-row-stack" in sys.argv[1:] and hasattr(np, "row_stack"):
    # numba's own array support (numba >= 0.68, the first to import with numpy
    # 2.5) overloads np.row_stack only when numpy's *version* is below 2.5, which
    # deleting the alias from an older numpy does not imitate: imported first,
    # as under a real numpy 2.5 it leaves row_stack alone. numba-cuda's copy of
    # that support has no such check, and is what this mode is about.
    import numba.np.arrayobj  # noqa: F401
    del np.row_stack
    np.__all__ = [name for name in np.__all__ if name != "row_stack"]  # scipy reads it

from rtmem.kernels import dha  # noqa: E402

f32 = t.float32
A1, A2, A3 = (t.Array(f32, nd, "C") for nd in (1, 2, 3))
A2_any = t.Array(f32, 2, "A")            # strided views (a mapped table's rows)
i32, i64 = t.Array(t.int32, 1, "C"), t.Array(t.int64, 1, "C")
u32, u64 = t.Array(t.uint32, 1, "C"), t.Array(t.uint64, 1, "C")
b = t.boolean

# Each kernel with every argument-type combination its launchers use.
SIGNATURES = {
    "_read_kernel": [(u64, u64), (u32, u64)],
    "_delay_kernel": [(t.int64,)],
    "_write_kernel": [(u64, t.uint64), (u32, t.uint32)],
    "_rmw_kernel": [(u64, t.uint64), (u32, t.uint32)],
    "_embedding_fwd_kernel": [(A2, i64, A2), (A2_any, i32, A2)],
    "_count_bad_ids_kernel": [(i64, t.int64, i32), (i32, t.int64, i32)],
    "_fill_int32_kernel": [(i32, t.int64)],
    "_embedding_link_kernel": [(i64, t.int64, i32, i32, i32), (i32, t.int64, i32, i32, i32)],
    "_embedding_grad_kernel": [(A2, i32, i32, A2, b)],
    "_layernorm_fwd_kernel": [(A2, A1, A1, A2, A1, A1, f32, b)],
    "_layernorm_dx_kernel": [(A2, A2, A1, A1, A1, A2, b)],
    "_column_partials_kernel": [(A2, A2, A1, A1, A3, b)],
    "_column_finish_kernel": [(A3, t.int64, A1, b)],
    **{f"_gemm_kernel_{r}": [(A2, A2, A2, A1, b, b, b, b)] for r in dha.GEMM_ROW_TILES},
}

kernels = {name: obj for name, obj in vars(dha).items()
           if isinstance(obj, _dispatcher.CUDADispatcher)
           and not obj.targetoptions.get("device")}
kernels.update({f"_gemm_kernel_{r}": k for r, k in dha._GEMM_KERNELS.items()})
report = {"compiled": [], "failed": {}, "missing": sorted(set(kernels) - set(SIGNATURES))}
for name, sigs in SIGNATURES.items():
    for sig in sigs:
        label = f"{name}{tuple(str(a) for a in sig)}"
        try:
            cuda.compile_ptx(kernels[name].py_func, sig, cc=CC)
            report["compiled"].append(label)
        except Exception as exc:   # reported to the test, which shows the message
            report["failed"][label] = f"{type(exc).__name__}: {exc}"[:2000]
report["row_stack"] = hasattr(np, "row_stack")
print(json.dumps(report))
