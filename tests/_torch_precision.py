"""Exact float32 matmuls and convolutions (no TF32) for the GPU tests, on every
torch the package supports (2.7.1 .. 2.13).

torch 2.9 added per-operation precision flags (``torch.backends.cuda.matmul.
fp32_precision``, ``torch.backends.cudnn.conv.fp32_precision``, ...) beside the
legacy ``allow_tf32`` flags and ``torch.set_float32_matmul_precision``. Checked
on torch 2.13 (CPU build; pytorch/pytorch#179445, #189955): no setter of either
kind raises or warns, and a legacy setter updates both kinds, so the state stays
consistent; a per-operation setter updates only its own flag, after which the
legacy *getters* raise RuntimeError ("mix of the legacy and new APIs") while the
two disagree, e.g. after ``torch.backends.fp32_precision = "tf32"``, or even
after ``torch.backends.cudnn.conv.fp32_precision = rnn.fp32_precision = "ieee"``
(the legacy cuDNN flag stays True). torch's own code still reads the legacy
getters (torch._dynamo, torch._inductor), so the flags are set through the
legacy API, which every supported torch has; the per-operation flags, whose
getters never raise, are used only when the state found is already mixed."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def exact_fp32(torch):
    """Turn TF32 off for CUDA matmuls and cuDNN convolutions/RNNs in the block,
    then restore the flags found (also when the block raises)."""
    b = torch.backends
    try:
        saved = b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32
    except RuntimeError:
        # torch >= 2.9 with the two APIs already mixed: keep to the per-op flags
        objs = (b.cuda.matmul, b.cudnn.conv, b.cudnn.rnn)
        per_op = [obj.fp32_precision for obj in objs]
        for obj in objs:
            obj.fp32_precision = "ieee"
        try:
            yield
        finally:
            for obj, value in zip(objs, per_op):
                obj.fp32_precision = value
        return
    b.cuda.matmul.allow_tf32 = b.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32 = saved
