"""Argument checks of :mod:`rtmem.kernels.adam`: arrays and scalars in, the
kernels' flat, typed operands out, or an :class:`~rtmem.errors.OptimizerError`
that names the bad argument and says how to fix it.

Plain Python, none of it jitted: kept out of adam.py, which holds the kernels
and the entry points that run them.
"""

import math

import numpy as np

from rtmem.errors import OptimizerError

from ._half import BFLOAT16, FLOAT16, half_format_code


def _check_real(name, value, *, low=None, high=None, low_inclusive=True):
    if isinstance(value, (str, bytes)):
        # float() parses text, but CPUAdam/OffloadedAdam keep a group's value as
        # given: lr="1e-3" (PyYAML reads `lr: 1e-3` as a string) passed, and an lr
        # scheduler's group["lr"] * gamma raised a TypeError far from the cause
        raise OptimizerError(f"{name}={value!r} is not a real number but a string (a "
                             f"value read from a config file?); pass a number, e.g. "
                             f"float({value!r}).", argument=name)
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise OptimizerError(f"{name}={value!r} is not a real number.",
                             argument=name) from None
    ok = math.isfinite(x)
    if ok and low is not None:
        ok = x >= low if low_inclusive else x > low
    if ok and high is not None:
        ok = x < high
    if not ok:
        lo = "" if low is None else ("[" if low_inclusive else "(") + f"{low:g}, "
        hi = "inf)" if high is None else f"{high:g})"
        raise OptimizerError(f"{name}={value!r} is out of range: it must be finite and "
                             f"in {lo}{hi}.", argument=name)
    return x


def _shape_error(name, arr, shape):
    return OptimizerError(
        f"{name} has shape {arr.shape} but param has shape {shape}; every array of "
        f"one update must have the parameter's shape.", argument=name)


def _contiguous_error(name, arr):
    return OptimizerError(
        f"{name} is not C-contiguous (strides {arr.strides}); the fused kernel "
        f"walks flat memory. Pass np.ascontiguousarray({name}) (or "
        f"tensor.contiguous()).", argument=name)


def _check_state(name, arr, shape=None):
    if not isinstance(arr, np.ndarray):
        raise OptimizerError(f"{name} must be a numpy array, got "
                             f"{type(arr).__name__}; use tensor.numpy() for a "
                             f"zero-copy view of a CPU tensor.", argument=name)
    if arr.dtype != np.float32:
        raise OptimizerError(
            f"{name} has dtype {arr.dtype}; master parameters and Adam moments are "
            f"float32. Convert once with {name}.astype(np.float32) and keep it.",
            argument=name)
    if shape is not None and arr.shape != shape:
        raise _shape_error(name, arr, shape)
    if not arr.flags.c_contiguous:
        raise _contiguous_error(name, arr)
    if not arr.flags.writeable:
        raise OptimizerError(f"{name} is read-only; the update writes it in place. "
                             f"Pass a writeable array.", argument=name)
    return arr.reshape(-1)


def _half_view(arr, fmt, name, format_name):
    """(uint16 view, code) of a 16-bit array, or None if ``arr`` is float32."""
    if arr.dtype == np.float32:
        if fmt is not None:
            raise OptimizerError(
                f"{name} is float32 but {format_name}={fmt!r}; drop {format_name} "
                f"(it only describes uint16 bit patterns).", argument=format_name)
        return None
    if arr.dtype == np.float16:
        if fmt is not None and half_format_code(fmt, format_name) != FLOAT16:
            raise OptimizerError(f"{name} is a float16 array but {format_name}="
                                 f"{fmt!r}.", argument=format_name)
        return arr.view(np.uint16), FLOAT16
    if arr.dtype.name == "bfloat16" and arr.dtype.itemsize == 2:   # ml_dtypes
        if fmt is not None and half_format_code(fmt, format_name) != BFLOAT16:
            raise OptimizerError(f"{name} is a bfloat16 array but {format_name}="
                                 f"{fmt!r}.", argument=format_name)
        return arr.view(np.uint16), BFLOAT16
    if arr.dtype == np.uint16:
        if fmt is None:
            raise OptimizerError(
                f"{name} is uint16 but {format_name} is not given; say what the bits "
                f"are with {format_name}='bfloat16' or 'float16'.", argument=format_name)
        return arr, half_format_code(fmt, format_name)
    raise OptimizerError(
        f"{name} has dtype {arr.dtype}; expected float32, float16, or uint16 bits "
        f"of bfloat16/float16 (with {format_name}=).", argument=name)


def _flat_operand(arr, name, fmt, fmt_name, shape, *, writable=False):
    """``arr`` (grad or out) checked and flattened into the kernels' typed view:
    a C-contiguous numpy array of ``shape`` (``None``: any), in format ``fmt``."""
    if not isinstance(arr, np.ndarray):
        raise OptimizerError(f"{name} must be a numpy array, got {type(arr).__name__}.",
                             argument=name)
    if shape is not None and arr.shape != shape:
        raise _shape_error(name, arr, shape)
    if not arr.flags.c_contiguous:
        raise _contiguous_error(name, arr)
    if writable and not arr.flags.writeable:
        raise OptimizerError(f"{name} is read-only; pass a writeable buffer.", argument=name)
    half = _half_view(arr, fmt, name, fmt_name)
    if half is None:
        return arr.reshape(-1)
    return _kernel_bits(*half).reshape(-1)


def _kernel_bits(bits, code):
    """uint16 bits -> the kernels' typed view (NOTE [ Formats are types ] in adam.py)."""
    return bits.view(np.int16) if code == FLOAT16 else bits


def _check_no_overlap(named):
    # Bounds-only test (cheap): aliasing state arrays would make the result depend
    # on the loop order, a silent corruption.
    named = [(n, a) for n, a in named if a is not None]
    for i, (na, a) in enumerate(named):
        for nb, b in named[i + 1:]:
            if np.may_share_memory(a, b):
                raise _overlap_error(na, nb)


def _overlap_error(na, nb):
    return OptimizerError(f"{na} and {nb} overlap in memory; each array of the update "
                          f"needs its own buffer.", argument=nb)


def _check_range(start, stop, size):
    stop = size if stop is None else stop
    for name, value in (("start", start), ("stop", stop)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise OptimizerError(f"{name}={value!r} must be an int element index.",
                                 argument=name)
    if not 0 <= start <= stop <= size:
        raise OptimizerError(
            f"range [start, stop) = [{start}, {stop}) is not inside [0, {size}] "
            f"(the number of elements); need 0 <= start <= stop <= size.",
            argument="start" if not 0 <= start <= size else "stop")
    return int(start), int(stop)
