"""Launch configuration and argument checks shared by the DHA kernels and their CPU twins.

Nothing here launches anything: it sizes grids (from the SM count, with a small
fixed grid under the CUDA simulator), turns user arrays into what numba can launch
on, and checks shapes and dtypes so that a mistake raises
:class:`~rtmem.errors.KernelArgumentError` naming the argument, instead of a numba
typing error or a wild read through a mapped host pointer.

numba.cuda is imported inside the functions that need it, so the CPU twins
(:mod:`rtmem.kernels.dha_cpu`) never load it.
"""

from __future__ import annotations

import math
import operator
import threading

import numpy as np

from rtmem.errors import KernelArgumentError

#: Threads per block of the streaming and row kernels (a power of two: the
#: block reductions halve it). 256 lets 8 blocks be resident per SM on every
#: architecture since Volta (2048 threads/SM), enough loads in flight to cover
#: PCIe latency (~1-2 us) with mapped memory.
THREADS = 256

#: Resident blocks per SM aimed at by :func:`stream_blocks` (2048 / THREADS).
BLOCKS_PER_SM = 8

#: Grid cap under the CUDA simulator: every simulated thread is a Python thread,
#: so a few blocks exercise the grid-stride loops without taking minutes.
SIM_MAX_BLOCKS = 4

_FLOAT = (np.dtype(np.float32),)
_F32_MAX = float(np.finfo(np.float32).max)
_IDS = (np.dtype(np.int32), np.dtype(np.int64))


def simulator_active() -> bool:
    """True when numba.cuda is the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    from numba import config
    return bool(config.ENABLE_CUDASIM)


def import_numba_cuda_arrays() -> None:
    """Import numba-cuda's NumPy array support with ``np.row_stack`` present.

    numba-cuda (0.30.4 and earlier) registers an overload of ``np.row_stack``
    when that support is first imported, which is at the first kernel compile;
    numpy 2.5 removed the alias (of ``np.vstack``), so every compile failed with
    "module 'numpy' has no attribute 'row_stack'". The alias exists only during
    the import: numpy is left as it was. Nothing happens under the CUDA
    simulator, with a numpy that has the alias, or without numba-cuda.
    """
    if simulator_active() or hasattr(np, "row_stack"):
        return
    np.row_stack = np.vstack
    try:
        import numba.cuda.np.arrayobj  # noqa: F401  (registers its overloads)
    except ImportError:     # numba's built-in numba.cuda: it has no such module
        pass
    finally:
        del np.row_stack


_SM_COUNT: int | None = None


def sm_count() -> int:
    """Streaming multiprocessors of the current device (1 under the simulator)."""
    global _SM_COUNT
    if simulator_active():
        return 1
    if _SM_COUNT is None:
        from numba import cuda
        _SM_COUNT = int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    return _SM_COUNT


def stream_blocks(n_items: int, threads: int = THREADS,
                  blocks_per_sm: int = BLOCKS_PER_SM) -> int:
    """Blocks for a grid-stride kernel over ``n_items`` work items.

    As many blocks as the work needs, capped at ``blocks_per_sm`` resident blocks
    on every SM: more would only queue, fewer would leave SMs (and therefore
    outstanding PCIe requests) idle. Under the simulator the cap is
    :data:`SIM_MAX_BLOCKS`. Always at least 1.
    """
    need = max(1, math.ceil(n_items / threads))
    cap = SIM_MAX_BLOCKS if simulator_active() else sm_count() * blocks_per_sm
    return max(1, min(need, cap))


def numba_stream(stream):
    """A stream numba can launch on: ``0``/``None`` (default stream), a numba
    stream, or a foreign stream wrapped as a numba external stream: anything with
    a ``ptr`` attribute (a CuPy stream, an rtmem cuda-backend stream) or a
    ``cuda_stream`` attribute (a ``torch.cuda.Stream``).

    numba-cuda launches only on ``0`` or its own ``Stream`` objects (a CuPy or
    torch stream raises TypeError at launch), and ``cuda.external_stream`` wants
    a Python ``int`` handle.
    """
    if stream is None or stream == 0:
        return 0
    if isinstance(stream, bool):
        raise KernelArgumentError(f"stream={stream!r} is not a stream; pass 0, a stream "
                                  f"object or a cudaStream_t handle", argument="stream")
    # A bare int is a cudaStream_t handle (torch's .cuda_stream, CuPy's .ptr).
    ptr = stream if isinstance(stream, (int, np.integer)) else getattr(stream, "ptr", None)
    if ptr is None:
        ptr = getattr(stream, "cuda_stream", None)
    if ptr is not None and not simulator_active():
        if not ptr:                              # CuPy's / torch's null stream
            return 0
        from numba import cuda
        return cuda.external_stream(int(ptr))
    return stream


def synchronize(stream) -> None:
    """Wait for ``stream`` (the default stream when 0) to finish its work."""
    from numba import cuda
    if stream == 0:
        cuda.synchronize()
    else:
        stream.synchronize()


# --------------------------------------------------------------------- conversion

def as_device(obj, name: str):
    """A numba device view (zero-copy) of ``obj`` for a kernel launch.

    Accepts numba device and mapped arrays and anything exposing
    ``__cuda_array_interface__`` (CuPy arrays, rtmem Buffers on a device or
    mapped arena). Under the simulator only simulator arrays exist
    (``cuda.to_device``, ``cuda.mapped_array``, ...).
    """
    from numba import cuda
    if simulator_active():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        if isinstance(obj, FakeCUDAArray):
            return obj
    else:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        if type(obj) is DeviceNDArray:         # fast path: no new view per launch
            return obj
        if cuda.is_cuda_array(obj):
            return cuda.as_cuda_array(obj)
    if isinstance(obj, np.ndarray) or hasattr(obj, "__array_interface__"):
        raise KernelArgumentError(
            f"{name} is host memory the GPU cannot address ({type(obj).__name__}); "
            "allocate it with cuda.mapped_array / HostArena(mapped=True) for direct "
            "host access, copy it with cuda.to_device, or use the CPU twin in "
            "rtmem.kernels.dha_cpu", argument=name)
    if simulator_active() and hasattr(obj, "__cuda_array_interface__"):
        # The simulator has no device memory: a real GPU pointer means nothing here.
        raise KernelArgumentError(
            f"{name} is a real CUDA array ({type(obj).__name__}) but numba's CUDA "
            f"simulator is active (NUMBA_ENABLE_CUDASIM=1); pass simulator arrays "
            f"(cuda.to_device, cuda.mapped_array) or unset NUMBA_ENABLE_CUDASIM",
            argument=name)
    raise KernelArgumentError(
        f"{name} must expose __cuda_array_interface__ (a numba device or mapped "
        f"array, a CuPy array, an rtmem Buffer); got {type(obj).__name__}",
        argument=name)


def as_host(obj, name: str, writable: bool = False) -> np.ndarray:
    """A numpy view (zero-copy) of ``obj`` for a CPU twin.

    Accepts numpy arrays and anything exposing ``__array_interface__`` (rtmem
    Buffers on a host arena, numba mapped/pinned arrays). Device-only arrays are
    refused: the CPU cannot dereference them.
    """
    if not isinstance(obj, np.ndarray):
        if hasattr(obj, "__array_interface__"):
            obj = np.asarray(obj)
        elif hasattr(obj, "__cuda_array_interface__"):
            raise KernelArgumentError(
                f"{name} is device memory ({type(obj).__name__}) and the CPU twins "
                "read host memory; use rtmem.kernels.dha, or copy it to the host "
                "first", argument=name)
        else:
            raise KernelArgumentError(
                f"{name} must be a numpy array or expose __array_interface__; got "
                f"{type(obj).__name__}", argument=name)
    if writable and not obj.flags.writeable:
        raise KernelArgumentError(f"{name} is read-only but the kernel writes it; "
                                  "pass a writable array", argument=name)
    return obj


# ------------------------------------------------------------------------ checks

def is_contiguous(a) -> bool:
    """True when the (numpy, numba or simulator) array ``a`` is C-contiguous."""
    flags = getattr(a, "flags", None)
    if flags is not None:
        try:
            return bool(flags["C_CONTIGUOUS"])
        except (KeyError, TypeError):
            pass
    return bool(a.is_c_contiguous())


def check_array(a, name: str, *, ndim: int, dtypes=_FLOAT, shape=None) -> None:
    """Raise :class:`KernelArgumentError` unless ``a`` is a C-contiguous array of
    ``ndim`` dimensions, one of ``dtypes``, and (where an entry of ``shape`` is
    not None) of that extent."""
    dt = np.dtype(a.dtype)
    if dt not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise KernelArgumentError(
            f"{name} has dtype {dt}; the kernel needs {want} (convert it with "
            f".astype({want.split()[0]}))", argument=name)
    if len(a.shape) != ndim:
        raise KernelArgumentError(
            f"{name} must be {ndim}-D, got shape {tuple(a.shape)}", argument=name)
    if shape is not None:
        for axis, (got, want) in enumerate(zip(a.shape, shape)):
            if want is not None and got != want:
                raise KernelArgumentError(
                    f"{name} has shape {tuple(a.shape)} but axis {axis} must be {want} "
                    f"(expected {tuple('*' if w is None else w for w in shape)})",
                    argument=name)
    if not is_contiguous(a):
        raise KernelArgumentError(
            f"{name} must be C-contiguous (row-major); make a contiguous copy",
            argument=name)
    # A float32/int access at an address that is not a multiple of the item size
    # is a "misaligned address" fault on the GPU, which poisons the whole CUDA
    # context; arenas with alignment < 4 can hand such buffers out.
    check_aligned(a, dt.itemsize, name, f"its {dt.itemsize}-byte items",
                  "allocate it aligned (arenas align to 256 bytes by default)")


def check_aligned(a, multiple: int, name: str, what: str, fix: str) -> None:
    """Raise :class:`KernelArgumentError` (saying ``what`` the address must be a
    multiple of, and the ``fix``) unless ``a``'s first byte, device or host, is
    at a multiple of ``multiple`` bytes; arrays without an interface pass."""
    ptr = _address(a)
    if ptr is not None and ptr % multiple:
        raise KernelArgumentError(f"{name} starts at address {ptr:#x}, not a multiple of "
                                  f"{what}; {fix}", argument=name)


def check_ids(ids) -> None:
    """Token ids ``ids``: a 1-D int32/int64 array (its length fixes T)."""
    check_array(ids, "ids", ndim=1, dtypes=_IDS)


def check_eps(eps: float) -> float:
    """LayerNorm epsilon: a number > 0 that stays finite and > 0 in float32 (it keeps
    1/sqrt(var + eps) finite in the GPU kernels, which compute in float32)."""
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise KernelArgumentError(f"eps must be a number > 0, got {eps!r}",
                                  argument="eps") from None
    # The range first, as a Python float: an eps beyond float32's range is inf in
    # the GPU kernels, and its cast (below) warned about an overflow.
    if not (0.0 < value <= _F32_MAX) or np.float32(value) == 0:
        raise KernelArgumentError(f"eps must be a finite number > 0 in float32's range "
                                  f"(at least about 1e-45, the smallest float32, at most "
                                  f"about 3.4e38), got {eps!r}", argument="eps")
    return value


def check_flag(value, name: str, error=KernelArgumentError) -> bool:
    """A boolean switch (``accumulate``, ``check``; the Adam kernel's, with
    ``error=OptimizerError``): a string such as "no" would otherwise count as
    True."""
    if not isinstance(value, (bool, np.bool_)):
        raise error(f"{name} must be True or False, got {value!r}", argument=name)
    return bool(value)


def _address(a) -> int | None:
    """Address of ``a``'s first byte, or None when it exposes no array interface:
    host addresses for numpy arrays, device addresses for device arrays, the
    wrapped numpy array's for the simulator's."""
    if isinstance(a, np.ndarray):
        # Before the CUDA interface: a numba mapped array is an ndarray that also
        # has one, and the CPU twins compare it with plain numpy views of the same
        # memory, so both must be given in host addresses.
        return a.ctypes.data
    # The simulator's arrays have no CUDA interface; their __getattr__ hands out
    # the wrapped numpy array's __array_interface__.
    for attr in ("__cuda_array_interface__", "__array_interface__"):
        try:
            return int(getattr(a, attr)["data"][0])
        except (AttributeError, KeyError, TypeError):
            continue
    return None


def _span(a) -> tuple[int, int]:
    """[start, end) byte addresses of the (C-contiguous) array ``a`` (see
    :func:`_address`; check_disjoint passes only arrays that have one)."""
    start = _address(a)
    return start, start + int(a.size) * np.dtype(a.dtype).itemsize


def check_disjoint(writes: dict, reads: dict) -> None:
    """Every array the kernel writes (``writes``: name -> array) must not share
    memory with any other argument (``reads`` or another write): the kernels read
    inputs while outputs are written, so an alias gives silently wrong results.
    None entries are skipped."""
    outs = [(n, _span(a)) for n, a in writes.items() if a is not None and a.size]
    spans = outs + [(n, _span(a)) for n, a in reads.items() if a is not None and a.size]
    for i, (name, (s0, e0)) in enumerate(outs):
        for j, (other, (s1, e1)) in enumerate(spans[i + 1:], i + 1):  # outputs, inputs
            if s0 < e1 and s1 < e0:
                how = ("writes both" if j < len(outs) and other not in reads
                       else f"reads {other} while it writes {name}")
                raise KernelArgumentError(
                    f"{name} and {other} overlap in memory; the kernel {how}, so the "
                    f"result would be wrong: pass separate arrays", argument=name)


def word_dtype(width: int) -> np.dtype:
    """Unsigned word type of a streaming probe's access width (4 or 8 bytes)."""
    if width == 4:
        return np.dtype(np.uint32)
    if width == 8:
        return np.dtype(np.uint64)
    raise KernelArgumentError(
        f"width must be 4 or 8 bytes per access, got {width!r} (16-byte vector "
        "loads cannot be expressed on plain arrays in numba.cuda)", argument="width")


def word_value(value: int, width: int):
    """``value`` as a ``width``-byte unsigned word (its low 8 * width bits): the
    fill value / XOR mask of the write and read-modify-write probes."""
    try:
        value = operator.index(value)
    except TypeError:
        raise KernelArgumentError(f"the fill value / mask must be an integer, got "
                                  f"{value!r}", argument="value") from None
    return word_dtype(width).type(value & ((1 << (8 * width)) - 1))


def check_words(nbytes: int, width: int, name: str) -> int:
    """Number of ``width``-byte words in a buffer of ``nbytes`` bytes; the buffer
    must be a non-empty whole number of words."""
    if nbytes == 0 or nbytes % width:
        raise KernelArgumentError(
            f"{name} holds {nbytes} bytes, not a positive multiple of the access "
            f"width {width} B; pad it or pass width=4", argument=name)
    return nbytes // width


# ---------------------------------------------------------------- launch helpers

def device_words(buf, width: int, name: str):
    """(word view, word count) of a C-contiguous device/mapped array, viewed as
    ``width``-byte unsigned words for the streaming probes."""
    dev = as_device(buf, name)
    if not is_contiguous(dev):
        raise KernelArgumentError(f"{name} must be C-contiguous to be streamed as words",
                                  argument=name)
    wdt = word_dtype(width)
    n = check_words(int(dev.size) * np.dtype(dev.dtype).itemsize, width, name)
    check_word_alignment(dev, width, name)
    flat = dev.reshape(dev.size) if len(dev.shape) != 1 else dev
    return flat.view(wdt), n


def check_word_alignment(a, width: int, name: str) -> None:
    """The streaming probes' check (GPU and CPU twin): ``a`` starts at a
    multiple of the ``width``-byte access width."""
    check_aligned(a, width, name, f"the {width}-byte access width",
                  "pass width=4 or an aligned buffer")


def grid_size(blocks, n_items: int) -> int:
    """``blocks`` checked (>= 1), or :func:`stream_blocks` of ``n_items`` when None."""
    if blocks is None:
        return stream_blocks(n_items)
    return check_blocks(blocks)


def check_count(value, name: str) -> int:
    """An integer argument >= 1 as a Python int (a bool or a float is refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or value < 1:
        raise KernelArgumentError(f"{name} must be an integer >= 1, got {value!r}",
                                  argument=name)
    return int(value)


def check_blocks(blocks) -> int | None:
    """A probe's ``blocks`` argument: None or an integer >= 1 (the CPU twins
    check it too, so a call that fails on the GPU fails on the CPU)."""
    return None if blocks is None else check_count(blocks, "blocks")


def row_threads(h: int) -> int:
    """Threads for a row kernel: a power of two covering ``h`` (32..THREADS)."""
    t = 32
    while t < h and t < THREADS:
        t *= 2
    return t


# ------------------------------------------------------------------ scratch

_SCRATCH: dict = {}
_SCRATCH_LOCK = threading.Lock()
_SCRATCH_MAX = 64          # entries kept; the oldest is dropped beyond that


def scratch(tag: str, shape, dtype, stream):
    """A device array for temporary use by one launch sequence on ``stream``.

    Reused by later calls with the same (tag, shape, dtype, stream) from the same
    host thread: work on one stream runs in order, so the previous user has
    finished before the next kernel touches it. Saves a cudaMalloc per call
    (tens of microseconds, and a possible device synchronization) in the layer
    wrappers. Never share the result across streams.
    """
    from numba import cuda
    handle = getattr(stream, "handle", None)
    if handle is None:                           # the default stream, or the simulator's
        skey = id(stream)
    else:                                        # ctypes handle, or a cuda-python CUstream
        skey = handle.value if hasattr(handle, "value") else int(handle)
    # Per host thread too: a wrapper's kernels share the scratch through a sequence
    # of launches, which two threads on one stream would interleave; and the
    # per-thread default stream has one handle for many real streams.
    key = (tag, tuple(int(d) for d in np.atleast_1d(shape)), np.dtype(dtype).str,
           skey if stream != 0 else 0, threading.get_ident())
    with _SCRATCH_LOCK:
        arr = _SCRATCH.pop(key, None)
        if arr is None:
            arr = cuda.device_array(key[1], dtype=dtype)
        _SCRATCH[key] = arr                       # most recent last
        while len(_SCRATCH) > _SCRATCH_MAX:
            _SCRATCH.pop(next(iter(_SCRATCH)))
    return arr


def _check_hidden(h: int) -> None:
    if h < 1:
        raise KernelArgumentError("x has 0 features (shape [T, 0]); LayerNorm needs at "
                                  "least one to normalize over", argument="x")


def check_layernorm_forward(x, gamma, beta, out, mean, rstd) -> tuple[int, int]:
    """Shapes of a LayerNorm forward: x, out [T, H]; gamma, beta [H]; mean, rstd [T].
    Returns (T, H); raises KernelArgumentError naming the first bad array."""
    check_array(x, "x", ndim=2)
    T, H = x.shape
    _check_hidden(H)
    for a, n in ((gamma, "gamma"), (beta, "beta")):
        check_array(a, n, ndim=1, shape=(H,))
    check_array(out, "out", ndim=2, shape=(T, H))
    for a, n in ((mean, "mean"), (rstd, "rstd")):
        check_array(a, n, ndim=1, shape=(T,))
    return T, H


def check_embedding(table, ids, rows, table_name: str, rows_name: str):
    """Shapes of an embedding op: ``table`` [V, H] (the weight or its gradient),
    ``ids`` [T] int32/int64, ``rows`` [T, H] (the output or its gradient).
    Returns (V, H, T)."""
    check_array(table, table_name, ndim=2)
    V, H = table.shape
    check_ids(ids)
    T = ids.shape[0]
    check_array(rows, rows_name, ndim=2, shape=(T, H))
    return V, H, T


def check_linear(x, weight, y, y_name: str):
    """Shapes of a linear op: ``x`` [T, K], ``weight`` [N, K], ``y`` [T, N] (the
    output or its gradient). Returns (T, K, N)."""
    check_array(x, "x", ndim=2)
    T, K = x.shape
    check_array(weight, "weight", ndim=2, shape=(None, K))
    N = weight.shape[0]
    check_array(y, y_name, ndim=2, shape=(T, N))
    return T, K, N


def check_layernorm_backward(grad_out, x, mean, rstd, gamma, grad_gamma, grad_beta):
    """Shapes of a LayerNorm backward: grad_out, x [T, H]; mean, rstd [T]; gamma,
    grad_gamma, grad_beta [H]. Returns (T, H)."""
    check_array(x, "x", ndim=2)
    T, H = x.shape
    _check_hidden(H)
    check_array(grad_out, "grad_out", ndim=2, shape=(T, H))
    for a, n in ((mean, "mean"), (rstd, "rstd")):
        check_array(a, n, ndim=1, shape=(T,))
    for a, n in ((gamma, "gamma"), (grad_gamma, "grad_gamma"), (grad_beta, "grad_beta")):
        check_array(a, n, ndim=1, shape=(H,))
    return T, H
