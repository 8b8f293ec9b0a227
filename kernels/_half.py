"""16-bit float formats (IEEE fp16 and bfloat16) as raw bits, for numba CPU kernels.

Numba's CPU target has no ``float16`` type and numpy has no ``bfloat16``, so both
formats travel as ``uint16`` arrays holding the bit patterns (``x.view(np.uint16)``
for a numpy float16 array, ``t.view(torch.int16).numpy().view(np.uint16)`` for a
torch bfloat16 tensor). The scalar helpers below convert those bits to and from
float32 with integer shifts and masks only, so they inline into the fused Adam
loop and vectorize; float32 -> 16-bit rounds to nearest, ties to even, like numpy's
``astype(np.float16)`` and torch's ``.to(torch.bfloat16)``.

NOTE [ Bit casts ]
    Reinterpreting a uint32 as a float32 (and back) is a single LLVM ``bitcast``;
    numba has no scalar ``view``, so two tiny intrinsics provide it. Every
    constant below is typed ``np.uint32``/``np.int32`` on purpose: mixing a uint32
    with a Python int literal would widen to int64 and, for uint64, silently to
    float64.

NOTE [ Stale caches ]
    numba's ``cache=True`` keys a cached function on its own source file only.
    The Adam loop in ``adam.py`` inlines the helpers below, so after editing
    this file delete ``kernels/__pycache__/adam.*.nb[ic]`` (or touch adam.py),
    or the old conversions keep running. Installed releases are unaffected:
    every file gets a new timestamp.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from rtmem.errors import OptimizerError

from ._parallel import parallel_kernel

__all__ = ["FLOAT16", "BFLOAT16", "HAVE_F16C", "decode_half", "encode_half"]

#: Format codes used by the kernels for 16-bit data held as uint16 bits.
FLOAT16 = 1
BFLOAT16 = 2

_FORMAT_NAMES = {"float16": FLOAT16, "fp16": FLOAT16, "half": FLOAT16,
                 "bfloat16": BFLOAT16, "bf16": BFLOAT16}


def half_format_code(fmt, argument="fmt") -> int:
    """Map a 16-bit float format to its kernel code: a name (``"float16"``,
    ``"fp16"``, ``"half"``, ``"bfloat16"``, ``"bf16"``), a numpy dtype or scalar
    type (``np.float16``, ``np.dtype("float16")``, ml_dtypes' bfloat16) or a torch
    dtype (``torch.float16``, ``torch.bfloat16``). Raise :class:`OptimizerError`
    otherwise."""
    if isinstance(fmt, str):
        name = fmt
    else:
        try:
            # np.dtype() names numpy scalar types too: the type object np.float16
            # has no usable ``.name`` (and its str() is "<class 'numpy.float16'>").
            name = np.dtype(fmt).name
        except (TypeError, ValueError):
            name = getattr(fmt, "name", None) or str(fmt)    # torch.bfloat16, ...
    name = name.replace("torch.", "")
    code = _FORMAT_NAMES.get(name)
    if code is None:
        raise OptimizerError(
            f"{argument}={fmt!r} is not a 16-bit float format; pass 'float16' or "
            f"'bfloat16'.", argument=argument)
    return code


@intrinsic
def f32_from_bits(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32 (see NOTE [ Bit
    casts ]); numba widens uint32 arithmetic to 64 bits, hence the truncation."""
    if not (isinstance(bits, types.Integer) and bits.bitwidth >= 32):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        if signature.args[0].bitwidth > 32:
            value = builder.trunc(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def bits_from_f32(typingctx, value):
    """Reinterpret a float32 as its uint32 bit pattern (see NOTE [ Bit casts ])."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(value), codegen


@numba.njit(inline="always", cache=True)
def bf16_bits_to_f32(h):
    """bfloat16 bits (uint16) -> float32: bfloat16 is the top half of a float32."""
    return f32_from_bits(np.uint32(h) << np.uint32(16))


@numba.njit(inline="always", cache=True)
def fp16_bits_to_f32_soft(h):
    """IEEE fp16 bits (uint16) -> float32, exact for every pattern (subnormals,
    +-inf, NaN with its payload). Integer arithmetic, any CPU."""
    u = np.uint32(h)
    sign = (u & np.uint32(0x8000)) << np.uint32(16)
    rest = (u & np.uint32(0x7FFF)) << np.uint32(13)   # exponent+mantissa in f32 slots
    exp = u & np.uint32(0x7C00)
    if exp == np.uint32(0x7C00):
        # inf/NaN: all-ones exponent, mantissa kept.
        out = rest | np.uint32(0x7F800000)
    elif exp == np.uint32(0):
        # Zero or subnormal: value = mantissa * 2**-24, exact in float32. Built by
        # subtracting 2**-14 from a float whose low mantissa bits hold the value.
        out = bits_from_f32(f32_from_bits(rest + np.uint32(113 << 23))
                            - f32_from_bits(np.uint32(113 << 23)))
    else:
        out = rest + np.uint32((127 - 15) << 23)      # rebias the exponent
    return f32_from_bits(out | sign)


@numba.njit(inline="always", cache=True)
def f32_to_bf16_bits(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even; NaN stays a
    (quiet) NaN, overflow rounds to inf."""
    u = bits_from_f32(x)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x0040))
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    return np.uint16((u + np.uint32(0x7FFF) + lsb) >> np.uint32(16))


@numba.njit(inline="always", cache=True)
def f32_to_fp16_bits_soft(x):
    """float32 -> IEEE fp16 bits (uint16), round to nearest even, with fp16
    subnormals, overflow to inf (at >= 65520) and NaN kept a quiet NaN. Integer
    arithmetic, any CPU."""
    u = bits_from_f32(x)
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x47800000):
        # |x| >= 65536, inf or NaN.
        if a > np.uint32(0x7F800000):
            out = np.uint32(0x7E00) | ((a >> np.uint32(13)) & np.uint32(0x3FF))
        else:
            out = np.uint32(0x7C00)
    elif a < np.uint32(0x38800000):
        # |x| < 2**-14: the result is an fp16 subnormal or zero. Adding 0.5 makes
        # the float32 adder round the value to a multiple of 2**-24 (ties to
        # even) in its low mantissa bits.
        out = bits_from_f32(f32_from_bits(a) + np.float32(0.5)) - np.uint32(0x3F000000)
    else:
        # Normal: rebias the exponent, round the 13 dropped mantissa bits to
        # nearest even. A carry out of the mantissa bumps the exponent, which is
        # also the right answer (and gives inf from 65520 up).
        odd = (a >> np.uint32(13)) & np.uint32(1)
        out = (a - np.uint32((127 - 15) << 23) + np.uint32(0xFFF) + odd) >> np.uint32(13)
    return np.uint16(out | sign)


@intrinsic
def _fpext_half(typingctx, bits):
    """fp16 bits (16-bit int) -> float32 via LLVM ``fpext half`` (vcvtph2ps)."""
    if not (isinstance(bits, types.Integer) and bits.bitwidth == 16):
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _fptrunc_half(typingctx, value):
    """float32 -> fp16 bits (uint16) via LLVM ``fptrunc`` (vcvtps2ph), round to
    nearest even."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(value), codegen


@numba.njit(inline="always", cache=True)
def fp16_bits_to_f32_hw(h):
    """IEEE fp16 bits -> float32 with the CPU's conversion instruction."""
    return _fpext_half(np.uint16(h))


@numba.njit(inline="always", cache=True)
def f32_to_fp16_bits_hw(x):
    """float32 -> IEEE fp16 bits (uint16) with the CPU's conversion instruction."""
    return _fptrunc_half(x)


def _target_has_f16c() -> bool:
    """Whether numba compiles for a CPU with F16C (x86 half<->float instructions).

    Without it LLVM lowers ``fpext/fptrunc half`` to compiler-rt calls that
    numba's JIT cannot link, so the integer versions are used instead. Honours
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES (portable caches target a generic CPU).
    """
    features = numba.config.CPU_FEATURES
    if features:
        return "+f16c" in features.split(",")
    if numba.config.CPU_NAME not in (None, "host"):
        return False
    try:
        from llvmlite import binding
        return bool(binding.get_host_cpu_features().get("f16c", False))
    except Exception:  # feature query unsupported on this platform
        return False


#: True when fp16 conversions compile to F16C instructions (~2x faster in the
#: fp16 Adam paths, which are otherwise bound by integer conversion work).
HAVE_F16C = _target_has_f16c()

if HAVE_F16C:
    fp16_bits_to_f32 = fp16_bits_to_f32_hw
    f32_to_fp16_bits = f32_to_fp16_bits_hw
else:
    fp16_bits_to_f32 = fp16_bits_to_f32_soft
    f32_to_fp16_bits = f32_to_fp16_bits_soft

#: Format code of the integer fp16 conversions, for testing them where F16C is used.
_FLOAT16_SOFT = 3


@parallel_kernel
def _decode_into(bits, fmt, out):
    # The format branch is per element here; these helpers are for tests and
    # one-off conversions, the Adam loop specialises on the format instead.
    for i in numba.prange(bits.size):
        if fmt == 2:
            out[i] = bf16_bits_to_f32(bits[i])
        elif fmt == 3:
            out[i] = fp16_bits_to_f32_soft(bits[i])
        else:
            out[i] = fp16_bits_to_f32(bits[i])


@parallel_kernel
def _encode_into(x, fmt, out):
    for i in numba.prange(x.size):
        if fmt == 2:
            out[i] = f32_to_bf16_bits(x[i])
        elif fmt == 3:
            out[i] = f32_to_fp16_bits_soft(x[i])
        else:
            out[i] = f32_to_fp16_bits(x[i])


def decode_half(bits, fmt, *, _soft=False) -> np.ndarray:
    """Convert 16-bit float bits to float32.

    Parameters
    ----------
    bits:
        uint16 array of ``fmt`` bit patterns (any shape, C-contiguous), or a numpy
        float16 array (then ``fmt`` must be a float16 format; anything else raises
        :class:`OptimizerError` rather than reading fp16 bits as bfloat16).
    fmt:
        ``"float16"`` or ``"bfloat16"``, or a numpy/torch dtype of either (see
        :func:`half_format_code`).

    Returns a new float32 array of the same shape (4 bytes per element); the
    conversion is exact for every number, infinity and quiet NaN. A signalling
    fp16 NaN may come back quieted (the CPU's conversion instruction sets the
    quiet bit; its payload is kept).
    """
    code = _code(fmt, _soft)
    bits = np.asarray(bits)
    if bits.dtype == np.float16 and code not in (FLOAT16, _FLOAT16_SOFT):
        raise OptimizerError(
            f"bits is a float16 array but fmt={fmt!r}; its bits are fp16, so pass "
            f"fmt='float16' (or a uint16 array holding {fmt!r} bit patterns).",
            argument="fmt")
    bits = _as_bits(bits, "bits")
    out = np.empty(bits.shape, dtype=np.float32)
    _decode_into(bits.reshape(-1), code, out.reshape(-1))
    return out


def encode_half(x, fmt, *, _soft=False) -> np.ndarray:
    """Round float32 values to a 16-bit float format, nearest even.

    Parameters
    ----------
    x:
        float32 array (any shape, C-contiguous).
    fmt:
        ``"float16"`` or ``"bfloat16"``, or a numpy/torch dtype of either (see
        :func:`half_format_code`).

    Returns a new uint16 array of bit patterns (2 bytes per element); use
    ``.view(np.float16)`` on a float16 result.
    """
    code = _code(fmt, _soft)
    x = np.asarray(x)
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        raise OptimizerError(
            f"x must be a C-contiguous float32 array, got dtype {x.dtype} "
            f"(contiguous={x.flags.c_contiguous}); convert with "
            f"np.ascontiguousarray(x, dtype=np.float32).", argument="x")
    out = np.empty(x.shape, dtype=np.uint16)
    _encode_into(x.reshape(-1), code, out.reshape(-1))
    return out


def _code(fmt, soft):
    # ``_soft`` (tests only) forces the integer fp16 path where F16C is used.
    code = half_format_code(fmt)
    return _FLOAT16_SOFT if soft and code == FLOAT16 else code


def _as_bits(a, argument):
    a = np.asarray(a)
    if a.dtype == np.float16:
        a = a.view(np.uint16)
    if a.dtype != np.uint16 or not a.flags.c_contiguous:
        raise OptimizerError(
            f"{argument} must be a C-contiguous uint16 (or float16) array of 16-bit "
            f"float bits, got dtype {a.dtype} (contiguous={a.flags.c_contiguous}).",
            argument=argument)
    return a
