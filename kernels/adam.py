"""Fused CPU Adam / AdamW update: one pass over memory, numba parallel loops.

The update of one element, in float32 throughout (Kingma & Ba, Alg. 1; AdamW's
decoupled weight decay from Loshchilov & Hutter)::

    g  = grad * gmul              gmul = 1/grad_scale, negated for maximize
    g  = g + l2 * p               l2 = weight_decay for Adam, 0 for AdamW
    p  = p * decay                decay = 1 - lr*weight_decay for AdamW, 1 for Adam
    m  = beta1*m + (1-beta1)*g       computed as m - (1-beta1)*m + (1-beta1)*g
    v  = beta2*v + (1-beta2)*g*g     likewise (NOTE [ Decay by 1 - beta ])
    vm = max(vmax, v)             AMSGrad only (vmax <- vm); otherwise vm = v
    p  = p - step_size * m / (sqrt(vm) * inv_bc2_sqrt + eps)

with ``step_size = lr / (1 - beta1**step)`` and ``inv_bc2_sqrt = 1/sqrt(1 -
beta2**step)`` (bias correction, the same algebra as ``torch.optim.Adam``). The
scalars are computed once in float64 on the host and handed to the kernel as a
float32 vector, so no float64 reaches the loop (Python floats would: numba types
them float64 and promotes every product to double).

NOTE [ Memory traffic ]
    Per parameter the loop reads g, p, m, v and writes p, m, v: 28 bytes for fp32
    gradients (7 x 4 B), the same accounting as DeepSpeed's CPU Adam. fp16/bf16
    gradients save 2 B of reads; the fused fp16/bf16 copy of the new parameter
    (the upload buffer) adds 2 B of writes (plus a 2 B write-allocate read on
    most CPUs). AMSGrad adds 8 B (read+write of vmax). Nothing else touches DRAM:
    one pass, so the kernel runs at the memory-bandwidth limit that
    ``bench/adam.py`` measures with a roofline probe.

NOTE [ Finite check ]
    With loss scaling a step must be skipped, leaving every array bit-identical,
    when any gradient is inf/NaN after unscaling. A fused check cannot promise
    that (earlier blocks would already be written when a later block finds an
    inf), so the check is a separate read-only pass over the gradients
    (:func:`grads_finite`, 4 B/param fp32, 2 B/param fp16/bf16), run before the
    update. A chunked caller checks all chunks first, then updates chunk by chunk
    with ``check_finite=False``.
"""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager

import numba
import numpy as np
from numba import types
from numba.extending import overload

from rtmem.errors import OptimizerError

from ._adam_checks import (_check_no_overlap, _check_range, _check_real, _check_state,
                           _flat_operand, _overlap_error)
from ._half import (bf16_bits_to_f32, bits_from_f32, f32_to_bf16_bits, f32_to_fp16_bits,
                    fp16_bits_to_f32)
from ._launch import check_flag
from ._parallel import parallel_kernel

__all__ = ["adam_update", "grads_finite", "adam_coefficients", "prepare_update",
           "PreparedUpdate", "threads", "BLOCK_ELEMENTS"]

#: Elements per parallel work item. 16 Ki float32 = 64 KiB per stream: big enough
#: to amortise scheduling, small enough that 2 threads split a 1M tensor evenly.
BLOCK_ELEMENTS = 1 << 14

# Layout of the coefficient vector (float32) read by the kernel.
_GMUL, _L2, _DECAY, _OMB1, _OMB2, _STEP_SIZE, _INV_BC2_SQRT, _EPS = range(8)
_N_COEFFS = 8


# --------------------------------------------------------------------------- jitted

def _load_grad(g, i):  # pragma: no cover - replaced by the overload in jitted code
    raise NotImplementedError


# NOTE [ Formats are types ]
#     Inside the kernels a 16-bit format is told apart by the array's integer
#     type: uint16 holds bfloat16 bits, int16 holds fp16 bits
#     (``_adam_checks._kernel_bits`` makes those views). Each format thus gets
#     its own compiled loop; a runtime format code would leave both conversions
#     in the vectorized loop (LLVM if-converts instead of unswitching) and cost ~3x.
@overload(_load_grad, inline="always")
def _load_grad_impl(g, i):
    if isinstance(g, types.Array) and g.dtype == types.float32:
        return lambda g, i: g[i]
    if isinstance(g, types.Array) and g.dtype == types.uint16:
        return lambda g, i: bf16_bits_to_f32(g[i])
    if isinstance(g, types.Array) and g.dtype == types.int16:
        return lambda g, i: fp16_bits_to_f32(np.uint16(g[i]))
    return None


def _store_copy(out, i, x):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_store_copy, inline="always")
def _store_copy_impl(out, i, x):
    if isinstance(out, types.Array) and out.dtype == types.float32:
        def impl(out, i, x):
            out[i] = x
        return impl
    if isinstance(out, types.Array) and out.dtype == types.uint16:
        def impl(out, i, x):
            out[i] = f32_to_bf16_bits(x)
        return impl
    if isinstance(out, types.Array) and out.dtype == types.int16:
        def impl(out, i, x):
            out[i] = np.int16(f32_to_fp16_bits(x))
        return impl
    return None


def _window(a, lo, hi):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_window, inline="always")
def _window_impl(a, lo, hi):
    if a is None or isinstance(a, types.NoneType):
        return lambda a, lo, hi: None
    return lambda a, lo, hi: a[lo:hi]


# error_model="numpy": Python semantics would test every division for zero and
# raise, a branch that keeps LLVM from vectorizing the loop (the denominator is
# >= eps > 0 anyway).
@numba.njit(cache=True, error_model="numpy")
def _adam_loop(p, g, m, v, vmax, out, c):
    """Serial update of whole 1-D windows. ``vmax``/``out`` may be None: numba
    prunes those branches at compile time, so each combination is its own loop."""
    gmul = c[_GMUL]
    l2 = c[_L2]
    decay = c[_DECAY]
    omb1 = c[_OMB1]
    omb2 = c[_OMB2]
    step_size = c[_STEP_SIZE]
    inv_bc2_sqrt = c[_INV_BC2_SQRT]
    eps = c[_EPS]
    for i in range(p.size):
        pi = p[i]
        gi = _load_grad(g, i) * gmul + l2 * pi
        pi = pi * decay
        # NOTE [ Decay by 1 - beta ]: x - (1-beta)*x, not beta*x. float32(beta)
        # and float32(1-beta) need not sum to 1 (0.9995 -> 0.99949998): the
        # average then settled off the float64 one by a fixed factor, e.g.
        # v 4.7e-5 low at beta2=0.9995, 1.3% at 0.999999.
        mi = m[i]
        mi = (mi - omb1 * mi) + omb1 * gi
        # (1-beta2)*g first, then *g, as torch's addcmul_: g*g alone overflows
        # float32 from |g| ~ 1.8e19, and v = inf froze the parameter for good
        # (m / inf = 0 at every later step) where torch and the float64 update move it
        vi = v[i]
        vd = vi - omb2 * vi
        # an inf v (overflow beyond ~5.8e20) stays inf, as beta2*v kept it, not inf - inf
        vi = (vd if vd == vd else vi) + (omb2 * gi) * gi
        m[i] = mi
        v[i] = vi
        if vmax is not None:
            vm = vmax[i]
            # torch.maximum: NaN from either side wins (numba's max(vm, nan) is vm)
            vi = vi if (vi > vm or vi != vi) else vm
            vmax[i] = vi
        pi = pi - step_size * (mi / (np.sqrt(vi) * inv_bc2_sqrt + eps))
        p[i] = pi
        if out is not None:
            _store_copy(out, i, pi)


@numba.njit(cache=True)
def _adam_range(p, g, m, v, vmax, out, c, lo, hi):
    # Windows first, so the loop index starts at 0: numba then knows it is
    # non-negative, drops the negative-index wraparound select, and LLVM can
    # vectorize the loop.
    _adam_loop(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], _window(vmax, lo, hi),
               _window(out, lo, hi), c)


@parallel_kernel
def _adam_kernel(p, g, m, v, vmax, out, c, start, stop, block):
    nblocks = (stop - start + block - 1) // block
    for b in numba.prange(nblocks):
        lo = start + b * block
        _adam_range(p, g, m, v, vmax, out, c, lo, min(lo + block, stop))


@numba.njit(cache=True, error_model="numpy")
def _nonfinite_loop(g, gmul):
    # Count rather than break: a branch-free loop vectorizes, and an early exit
    # only helps on the rare overflow step.
    bad = 0
    for i in range(g.size):
        x = bits_from_f32(_load_grad(g, i) * gmul)
        bad += (x & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    return bad


@parallel_kernel
def _nonfinite_kernel(g, gmul, start, stop, block):
    nblocks = (stop - start + block - 1) // block
    bad = 0
    for b in numba.prange(nblocks):
        lo = start + b * block
        bad += _nonfinite_loop(g[lo:min(lo + block, stop)], gmul)
    return bad


@numba.njit(cache=True)
def _jit_address(a):
    return a.ctypes.data


def _data_address(a) -> int:
    """Address of numpy array ``a``'s first element (bytes), as
    ``a.__array_interface__["data"][0]`` gives it.

    The optimizers' overlap checks take four to six per tensor per step; the
    array interface builds a dict each time (~3 us), a jitted read of the
    pointer costs a tenth of that. Arrays numba cannot type (a byte-swapped or
    ml_dtypes dtype) take the interface.
    """
    if a.dtype not in _INTERFACE_ONLY:
        try:
            return _jit_address(a)
        except Exception:   # noqa: BLE001 - numba's TypingError: untyped dtype
            # numba does not remember a failed typing: each call would try a
            # compile again (~270 us, the interface's ~3 us a hundred times over)
            _INTERFACE_ONLY.add(a.dtype)
    return a.__array_interface__["data"][0]


#: dtypes numba cannot type, found by :func:`_data_address`.
_INTERFACE_ONLY: set = set()


# --------------------------------------------------------------------------- host side

def adam_coefficients(*, lr, step, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                      decoupled_weight_decay=False, grad_scale=None, maximize=False,
                      bias_correction=True) -> np.ndarray:
    """Validate Adam hyperparameters and fold them into the kernel's scalars.

    Parameters
    ----------
    lr:
        Learning rate, >= 0 (parameter units per normalised gradient unit).
    step:
        1-based index of the step being taken (int >= 1), for bias correction.
    beta1, beta2:
        Moment decay rates, each in [0, 1).
    eps:
        Denominator term, > 0.
    weight_decay:
        >= 0. L2 penalty added to the gradient (Adam) or, with
        ``decoupled_weight_decay=True``, decay ``p *= 1 - lr*weight_decay`` (AdamW).
    grad_scale:
        Loss scale the gradients were multiplied by (finite, > 0), or None. The
        kernel multiplies gradients by ``1/grad_scale``.
    maximize:
        Ascend instead of descend (negates the gradient).
    bias_correction:
        Divide by ``1 - beta**step`` as in the Adam paper (default True).

    Returns the float32 coefficient vector consumed by the kernels. Raises
    :class:`~rtmem.errors.OptimizerError` naming the bad hyperparameter.
    """
    lr = _check_real("lr", lr, low=0.0)
    beta1 = _check_real("beta1", beta1, low=0.0, high=1.0)
    beta2 = _check_real("beta2", beta2, low=0.0, high=1.0)
    eps = _check_real("eps", eps, low=0.0, low_inclusive=False)
    weight_decay = _check_real("weight_decay", weight_decay, low=0.0)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        raise OptimizerError(
            f"step={step!r} must be an int >= 1 (the 1-based index of the step being "
            f"taken); bias correction divides by 1 - beta**step.", argument="step")
    # switches are bools: truthiness took maximize="no" as True (and ascended)
    maximize, decoupled_weight_decay, bias_correction = (
        check_flag(value, name, OptimizerError) for name, value in (
            ("maximize", maximize), ("decoupled_weight_decay", decoupled_weight_decay),
            ("bias_correction", bias_correction)))
    gmul = _unscale_factor(grad_scale, maximize)
    if bias_correction:
        bc1 = 1.0 - _power(beta1, int(step))
        bc2 = 1.0 - _power(beta2, int(step))
    else:
        bc1 = bc2 = 1.0
    c = np.empty(_N_COEFFS, dtype=np.float32)
    with np.errstate(over="ignore", under="ignore"):   # checked right below
        c[_GMUL] = gmul
        c[_L2] = 0.0 if decoupled_weight_decay else weight_decay
        c[_DECAY] = 1.0 - lr * weight_decay if decoupled_weight_decay else 1.0
        # the moments decay as x - (1 - beta)*x: beta itself is not needed
        c[_OMB1] = 1.0 - beta1
        c[_OMB2] = 1.0 - beta2
        # beta1 == 0 and step 1 keeps bc1 = 1; bc1 > 0 always since beta1 < 1.
        c[_STEP_SIZE] = lr / bc1
        c[_INV_BC2_SQRT] = 1.0 / math.sqrt(bc2)
        c[_EPS] = eps
    # Valid in float64 is not enough: the kernel computes in float32, where e.g.
    # eps=1e-46 is 0 (0/0 on a zero gradient) and lr/bc1 > 3.4e38 is inf.
    for what, argument, ok in (
            ("eps", "eps", c[_EPS] > 0),
            ("weight_decay", "weight_decay", np.isfinite(c[_L2])),
            ("lr * weight_decay", "lr", np.isfinite(c[_DECAY])),
            ("lr / (1 - beta1**step)", "lr", np.isfinite(c[_STEP_SIZE]))):
        if not ok:
            raise OptimizerError(
                f"{what} is not representable in float32 (the kernel's precision) for "
                f"lr={lr!r}, eps={eps!r}, grad_scale={grad_scale!r}, weight_decay="
                f"{weight_decay!r}; use values within float32 range", argument=argument)
    return c


# float64 magnitudes a cast to float32 rounds to 0 (at most 2**-150, half the
# smallest subnormal; the tie goes to even, 0) or to inf (from float32's largest
# finite value plus half an ulp; the tie goes to even, inf).
_F32_ROUNDS_TO_ZERO = 2.0 ** -150
_F32_ROUNDS_TO_INF = 2.0 ** 128 * (1.0 - 2.0 ** -25)


def _unscale_factor(grad_scale, maximize=False) -> np.float32:
    """The kernels' gradient multiplier ``1/grad_scale`` (1 without a loss scale),
    negated for ``maximize``, as a float32 (dimensionless).

    One place for :func:`adam_coefficients` and :func:`grads_finite`: a scale
    that is valid in float64 can still give an inf or 0 multiplier in float32
    (grad_scale=1e-40), which would make every gradient look non-finite (or
    zero); that is refused here instead.
    """
    gmul = 1.0
    if grad_scale is not None:
        grad_scale = _check_real("grad_scale", grad_scale, low=0.0, low_inclusive=False)
        gmul = 1.0 / grad_scale
        # Compared as Python floats, before the cast: cheaper than np.errstate
        # around it (this runs once per tensor per step).
        if not _F32_ROUNDS_TO_ZERO < gmul < _F32_ROUNDS_TO_INF:
            raise OptimizerError(
                f"1/grad_scale is not representable in float32 (the kernel's precision) "
                f"for grad_scale={grad_scale!r}; use a loss scale of about 3e-38 to "
                f"1e45 (above 8.5e37 the reciprocal is a float32 subnormal and loses "
                f"precision; GradScaler's scales are far inside).", argument="grad_scale")
    return np.float32(-gmul if maximize else gmul)


def _check_finite_switch(check_finite):
    """A step's ``check_finite``: None (the default, ``grad_scale is not None``)
    or a bool (np.bool_ too), in :func:`adam_update` and the optimizers'
    ``step``. Taken by truthiness, "no" (or "False" from a command line) checked,
    and 0.0 under a loss scale turned the check off, so an inf/NaN gradient was
    applied and the parameters became NaN. OptimizerError otherwise."""
    if check_finite is None:
        return None
    return check_flag(check_finite, "check_finite", OptimizerError)


def _power(beta: float, step: int) -> float:
    """beta ** step for beta in [0, 1): 0.0 when step is too large for a float
    (the power underflowed long before)."""
    try:
        return beta ** step
    except OverflowError:
        return 0.0


def _check_coefficients(c) -> None:
    if not (isinstance(c, np.ndarray) and c.dtype == np.float32 and c.shape == (_N_COEFFS,)
            and c.flags.c_contiguous):
        raise OptimizerError(f"coefficients must be the float32 vector of "
                             f"{_N_COEFFS} returned by adam_coefficients, got "
                             f"{getattr(c, 'dtype', type(c).__name__)} "
                             f"{getattr(c, 'shape', '')}", argument="coefficients")


def adam_update(param, grad, exp_avg, exp_avg_sq, *, lr, step, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False,
                max_exp_avg_sq=None, grad_scale=None, check_finite=None, maximize=False,
                bias_correction=True, grad_format=None, out=None, out_format=None,
                start=0, stop=None, num_threads=None) -> bool:
    """One fused Adam/AdamW step on elements ``[start, stop)`` of flat arrays, in place.

    Parameters
    ----------
    param, exp_avg, exp_avg_sq:
        float32 master parameters and first/second moments, C-contiguous,
        writeable, one shape. Updated in place.
    grad:
        Gradients, same shape: float32, numpy float16, ml_dtypes' bfloat16, or
        uint16 bit patterns with ``grad_format="float16"|"bfloat16"`` (how a torch
        bfloat16 tensor arrives as numpy).
    lr, step, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize,
    bias_correction, grad_scale:
        See :func:`adam_coefficients` (``decoupled_weight_decay=True`` is AdamW).
    max_exp_avg_sq:
        float32 array for AMSGrad (the running max of ``exp_avg_sq``), or None for
        plain Adam.
    check_finite:
        Run the read-only finite pass first (NOTE [ Finite check ]) and skip the
        step if any unscaled gradient in ``[start, stop)`` is inf/NaN. Defaults to
        True when ``grad_scale`` is given, else False.
    out, out_format:
        Optional array (same shape) that receives a copy of the updated
        parameters in the same pass: float32, numpy float16, ml_dtypes'
        bfloat16, or uint16 with ``out_format="float16"|"bfloat16"``. Rounded to
        nearest even. An fp16 copy overflows to +-inf where an updated master
        value has magnitude >= 65520 (fp16's largest finite value is 65504): the
        float32 master stays finite, and the step still counts as applied (the
        finite check covers gradients, not the copy). Use bfloat16 copies for
        parameters that large.
    start, stop:
        Element range to update (default: all). Lets a caller update chunk k
        while chunk k-1 is being copied.
    num_threads:
        Threads for this call (1..numba.config.NUMBA_NUM_THREADS); default: the
        current ``numba.get_num_threads()``.

    Returns True if the step was applied, False if it was skipped because a
    gradient was not finite (then no array was written). Invalid arrays or
    hyperparameters raise :class:`~rtmem.errors.OptimizerError`.
    """
    check_finite = _check_finite_switch(check_finite)
    c = adam_coefficients(lr=lr, step=step, beta1=beta1, beta2=beta2, eps=eps,
                          weight_decay=weight_decay,
                          decoupled_weight_decay=decoupled_weight_decay,
                          grad_scale=grad_scale, maximize=maximize,
                          bias_correction=bias_correction)
    update = prepare_update(param, grad, exp_avg, exp_avg_sq,
                            max_exp_avg_sq=max_exp_avg_sq, grad_format=grad_format,
                            out=out, out_format=out_format)
    start, stop = _check_range(start, stop, update.size)
    if check_finite is None:
        check_finite = grad_scale is not None
    with threads(num_threads):    # c and the range are checked: the unchecked halves
        if check_finite and not update._grads_finite(c, start, stop):
            return False
        update._apply(c, start, stop)
    return True


class PreparedUpdate:
    """Validated, flattened arrays of one Adam update (see :func:`prepare_update`).

    Lets a caller validate every tensor of a multi-tensor step before writing any
    of them, then run the finite check and the update per tensor or per chunk.
    """

    __slots__ = ("p", "g", "m", "v", "vmax", "out", "_known_spans")

    def __init__(self, p, g, m, v, vmax, out, spans=None):
        self.p, self.g, self.m, self.v, self.vmax, self.out = p, g, m, v, vmax, out
        self._known_spans = spans

    def _spans(self) -> tuple:
        """:func:`_bounds` of ``(p, g, m, v, vmax, out)``, None for an absent or
        empty array: made once (a caller that knows them passes them in), for
        the step's cross-tensor overlap check and the many-tensor kernel."""
        if self._known_spans is None:
            self._known_spans = tuple(None if a is None else _bounds(a) for a in (
                self.p, self.g, self.m, self.v, self.vmax, self.out))
        return self._known_spans

    @property
    def size(self) -> int:
        """Number of parameters (elements)."""
        return self.p.size

    def grads_finite(self, coefficients, start=0, stop=None) -> bool:
        """True if every gradient in [start, stop) times the unscale factor held
        in ``coefficients`` (from :func:`adam_coefficients`) is finite."""
        _check_coefficients(coefficients)
        return self._grads_finite(coefficients, *_check_range(start, stop, self.size))

    def _grads_finite(self, coefficients, start: int, stop: int) -> bool:
        # grads_finite() without its checks, for callers that made them
        return not _count_nonfinite(self.g, coefficients[_GMUL], start, stop)

    def apply(self, coefficients, start=0, stop=None) -> None:
        """Run the fused update on elements [start, stop) (no finite check)."""
        _check_coefficients(coefficients)
        self._apply(coefficients, *_check_range(start, stop, self.size))

    def _apply(self, coefficients, start: int, stop: int) -> None:
        # apply() without its checks, for callers that made them
        if stop - start > BLOCK_ELEMENTS:
            _adam_kernel(self.p, self.g, self.m, self.v, self.vmax, self.out, coefficients,
                         start, stop, BLOCK_ELEMENTS)
        elif stop > start:
            # One block of work: waking the thread pool would cost more than the
            # update itself (biases, norms: many small tensors per step).
            _adam_range(self.p, self.g, self.m, self.v, self.vmax, self.out, coefficients,
                        start, stop)


def _count_nonfinite(g, gmul, start, stop):
    if stop - start > BLOCK_ELEMENTS:
        return _nonfinite_kernel(g, gmul, start, stop, BLOCK_ELEMENTS)
    return _nonfinite_loop(g[start:stop], gmul)


def prepare_update(param, grad, exp_avg, exp_avg_sq, *, max_exp_avg_sq=None,
                   grad_format=None, out=None, out_format=None) -> PreparedUpdate:
    """Validate the arrays of one update (as for :func:`adam_update`) without
    touching them. Raises :class:`~rtmem.errors.OptimizerError` on any problem."""
    p = _check_state("param", param)
    shape = param.shape
    g = _flat_operand(grad, "grad", grad_format, "grad_format", shape)
    m = _check_state("exp_avg", exp_avg, shape)
    v = _check_state("exp_avg_sq", exp_avg_sq, shape)
    vmax = None if max_exp_avg_sq is None else _check_state("max_exp_avg_sq",
                                                            max_exp_avg_sq, shape)
    o = None if out is None else _flat_operand(out, "out", out_format, "out_format",
                                              shape, writable=True)
    _check_no_overlap(list(zip(_OPERANDS, (p, g, m, v, vmax, o))))
    return PreparedUpdate(p, g, m, v, vmax, o)


def _bounds(a):
    """``(first, end)`` byte addresses of C-contiguous array ``a``, None if it is
    empty: what np.may_share_memory compares (it never finds an empty array
    overlapping)."""
    if not a.size:
        return None
    lo = _data_address(a)
    return lo, lo + a.nbytes


def _state_bounds(prepared):
    """:func:`_bounds` of the state arrays (param, exp_avg, exp_avg_sq,
    max_exp_avg_sq or None) of a :class:`PreparedUpdate`, for :func:`_prepare_again`."""
    return tuple(None if a is None else _bounds(a)
                 for a in (prepared.p, prepared.m, prepared.v, prepared.vmax))


def _prepare_again(state, bounds, shape, grad, *, grad_format=None, out=None,
                   out_format=None) -> PreparedUpdate:
    """:func:`prepare_update` with the flat state arrays ``(p, m, v, vmax)`` of
    an earlier :class:`PreparedUpdate` of a parameter of ``shape`` (and their
    :func:`_state_bounds`), and a new ``grad`` and ``out``: the caller vouches
    that those arrays have not changed since (same memory, shape and dtype), so
    their own checks, and the overlaps among them, are not repeated. The
    gradient and copy are checked in full, their overlaps by the bounds
    np.may_share_memory compares: the same errors as prepare_update's, in
    the same order."""
    g = _flat_operand(grad, "grad", grad_format, "grad_format", shape)
    o = None if out is None else _flat_operand(out, "out", out_format, "out_format",
                                              shape, writable=True)
    gb = _bounds(g)
    ob = None if o is None else _bounds(o)
    pb, mb, vb, vmaxb = bounds
    spans = (pb, gb, mb, vb, vmaxb, ob)
    if gb is not None or ob is not None:
        for i, j in _FRESH_PAIRS:
            a, b = spans[i], spans[j]
            if a is not None and b is not None and a[0] < b[1] and b[0] < a[1]:
                raise _overlap_error(_OPERANDS[i], _OPERANDS[j])
    p, m, v, vmax = state
    return PreparedUpdate(p, g, m, v, vmax, o, spans)


#: prepare_update's operands in its overlap-check order, and the pairs of them
#: :func:`_prepare_again` checks (those with the grad or the copy: the state
#: arrays' pairs were checked when their views were made), in that order.
_OPERANDS = ("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "out")
_FRESH_PAIRS = tuple((i, j) for i in range(len(_OPERANDS)) for j in range(i + 1, len(_OPERANDS))
                     if {_OPERANDS[i], _OPERANDS[j]} & {"grad", "out"})


def grads_finite(grad, *, grad_scale=None, grad_format=None, start=0, stop=None,
                 num_threads=None) -> bool:
    """True if every gradient in ``[start, stop)``, unscaled (times the float32
    ``1/grad_scale``, as in the update), is finite. A read-only pass (4 B/param
    fp32, 2 B/param fp16/bf16).

    ``grad`` and ``grad_format`` are as in :func:`adam_update`; ``grad_scale`` is
    the loss scale (finite, > 0) or None.
    """
    g = _flat_operand(grad, "grad", grad_format, "grad_format", None)
    gmul = _unscale_factor(grad_scale)       # the same float32 factor as adam_update's
    start, stop = _check_range(start, stop, g.size)
    with threads(num_threads):
        return not _count_nonfinite(g, gmul, start, stop)


@contextmanager
def threads(num_threads):
    """Run the enclosed kernels on ``num_threads`` numba threads, then restore the
    previous count. None leaves the count alone."""
    if num_threads is None:
        yield
        return
    limit = numba.config.NUMBA_NUM_THREADS
    if (isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer))
            or not 1 <= num_threads <= limit):
        raise OptimizerError(
            f"num_threads={num_threads!r} must be an int in [1, {limit}] (numba's "
            f"thread pool size; raise it with the NUMBA_NUM_THREADS environment "
            f"variable before numba starts).", argument="num_threads")
    # numba's OpenMP layer, started by a first set_num_threads, resets torch's
    # intra-op thread count (OpenMP's global one) to numba's pool size: a caller
    # that had set torch to 1 thread ran its next forward on all of them
    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    previous = numba.get_num_threads()
    numba.set_num_threads(int(num_threads))
    try:
        yield
    finally:
        numba.set_num_threads(previous)
        if torch_threads is not None and torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
