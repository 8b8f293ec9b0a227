"""rtmem.kernels: compute kernels (numba CPU kernels and numba.cuda kernels).

Arrays in, arrays out; no runtime objects.

CPU Adam (:mod:`rtmem.kernels.adam`): :func:`adam_update` is the fused, chunkable
Adam/AdamW step over numpy arrays (fp32 master state; fp32, fp16 or bf16
gradients; optional loss-scale unscale, finite check, AMSGrad and fused fp16/bf16
copy of the new parameters); :func:`grads_finite` is its read-only overflow
check; :func:`encode_half` / :func:`decode_half` convert float32 to and from
16-bit float bits.

Direct Host Access (:mod:`rtmem.kernels.dha`, numba.cuda): bandwidth probes
(:func:`dha_read`, :func:`dha_write`, :func:`dha_rmw`) and the forward/backward of
embedding, LayerNorm and linear layers whose weights (and weight gradients) may
live in mapped host memory. Their CPU twins, with the same signatures, are in
:mod:`rtmem.kernels.dha_cpu`. The DHA names are loaded on first use, so that
``import rtmem.kernels`` does not import numba.cuda.

The CPU kernels may be called from several threads at once, under any of numba's
threading layers: under ``workqueue``, which would abort the process, they take
turns (NOTE [ One parallel region at a time under workqueue ] in ``_parallel``).
They also run in a child fork()ed after they ran (a DataLoader worker), where
numba's GNU OpenMP layer would kill it: there on one thread (NOTE [ Kernels in a
child forked after GNU OpenMP started ]).
"""

from ._half import decode_half, encode_half
from .adam import BLOCK_ELEMENTS, adam_coefficients, adam_update, grads_finite

_DHA = ("GEMM_ROW_TILES", "GEMM_TILE", "dha_read", "dha_rmw", "dha_write",
        "embedding_backward", "embedding_forward", "gemm_row_tiles", "layernorm_backward",
        "layernorm_forward", "linear_backward", "linear_forward", "linear_weight_reads",
        "xor_checksum")

__all__ = [
    "BLOCK_ELEMENTS",
    "adam_coefficients",
    "adam_update",
    "decode_half",
    "encode_half",
    "grads_finite",
    *_DHA,
]


def __getattr__(name):
    if name in _DHA:
        from . import dha
        value = getattr(dha, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rtmem.kernels' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
