"""The Adam update and finite check of many tensors in one parallel region.

NOTE [ Many tensors, one launch ]
    An optimizer step over a model's parameters (GPT-2 small: 148 tensors, 98 of
    them biases and LayerNorm vectors of a few thousand elements) ran one kernel
    call per tensor: a numba dispatch (~1 us: typing seven arguments) per small
    tensor and, per tensor over :data:`~rtmem.kernels.adam.BLOCK_ELEMENTS`
    elements, a parallel region that woke every worker thread. Here the
    tensors of one *kind* (same gradient format, copy format, AMSGrad or not)
    go to one call: a table with one row per tensor (the addresses of its
    arrays, its size, the row of its coefficient vector) that the kernel turns
    back into arrays with ``numba.carray``. Inside, the work is cut into items
    of at most BLOCK_ELEMENTS elements: a tensor above that size in blocks
    aligned to its start, as the per-tensor kernel cuts it, and the smaller
    tensors packed whole, several per item. One ``prange`` runs the items.

    Every element goes through the same ``_adam_range`` (hence ``_adam_loop``)
    as in the per-tensor path, over the same float32 values in the same order:
    the results are the same bits.

    The addresses are raw: the caller keeps the arrays alive for the call and
    has checked them (dtypes, sizes, overlaps: :func:`prepare_update`); this
    module trusts the table.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic, overload

from .adam import _GMUL, BLOCK_ELEMENTS, _adam_range, _nonfinite_loop
from ._parallel import parallel_kernel

# Columns of the table: addresses (bytes; 0 for an absent vmax or copy), the
# element count, and the row of the tensor's coefficient vector.
_P, _G, _M, _V, _VMAX, _OUT, _SIZE, _COEF = range(8)


@intrinsic
def _pointer_like(typingctx, address, proto):
    """``address`` (an integer) as a pointer to ``proto``'s element type."""
    if not isinstance(address, types.Integer) or not isinstance(proto, types.Array):
        return None
    sig = types.CPointer(proto.dtype)(address, proto)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return sig, codegen


def _view(address, n, proto):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_view, inline="always")
def _view_impl(address, n, proto):
    # None stays None (no AMSGrad / no copy): numba prunes those branches
    if proto is None or isinstance(proto, types.NoneType):
        return lambda address, n, proto: None
    return lambda address, n, proto: numba.carray(_pointer_like(address, proto), n)


@numba.njit(cache=True)
def _work_items(sizes, block):
    """Cut tensors of ``sizes`` elements into work items of at most ``block``
    elements: ``(pieces, starts)``, where ``pieces`` rows are ``(tensor, lo,
    hi)`` and item ``k`` is pieces ``starts[k]:starts[k + 1]``. A tensor larger
    than ``block`` gets items of its own (blocks from its start); the others
    are packed whole, in order, into shared items."""
    n = sizes.size
    npieces = 0
    for t in range(n):
        npieces += (sizes[t] + block - 1) // block if sizes[t] > block else 1
    pieces = np.empty((npieces, 3), np.int64)
    starts = np.empty(npieces + 1, np.int64)
    k = 0
    items = 0
    for t in range(n):
        if sizes[t] > block:
            for lo in range(0, sizes[t], block):
                pieces[k, 0] = t
                pieces[k, 1] = lo
                pieces[k, 2] = min(lo + block, sizes[t])
                starts[items] = k
                items += 1
                k += 1
    filled = block      # elements in the open item of small tensors (none open yet)
    for t in range(n):
        if sizes[t] <= block:
            if filled + sizes[t] > block:
                starts[items] = k
                items += 1
                filled = 0
            pieces[k, 0] = t
            pieces[k, 1] = 0
            pieces[k, 2] = sizes[t]
            filled += sizes[t]
            k += 1
    starts[items] = k
    return pieces, starts[:items + 1]


@parallel_kernel
def _adam_many_kernel(table, pieces, starts, coefs, f32, g_proto, vmax_proto, out_proto):
    for item in numba.prange(starts.size - 1):
        for k in range(starts[item], starts[item + 1]):
            row = table[pieces[k, 0]]
            n = row[_SIZE]
            _adam_range(_view(row[_P], n, f32), _view(row[_G], n, g_proto),
                        _view(row[_M], n, f32), _view(row[_V], n, f32),
                        _view(row[_VMAX], n, vmax_proto), _view(row[_OUT], n, out_proto),
                        coefs[row[_COEF]], pieces[k, 1], pieces[k, 2])


@parallel_kernel
def _nonfinite_many_kernel(table, pieces, starts, coefs, g_proto):
    bad = 0
    for item in numba.prange(starts.size - 1):
        for k in range(starts[item], starts[item + 1]):
            row = table[pieces[k, 0]]
            g = _view(row[_G], row[_SIZE], g_proto)
            bad += _nonfinite_loop(g[pieces[k, 1]:pieces[k, 2]], coefs[row[_COEF], _GMUL])
    return bad


# --------------------------------------------------------------------------- host side

_PROTOS: dict = {}


def _proto(a):
    """An empty array of ``a``'s dtype (None for None): tells the kernel, at
    compile time, what the addresses of that column point to."""
    if a is None:
        return None
    proto = _PROTOS.get(a.dtype)
    if proto is None:
        proto = _PROTOS[a.dtype] = np.empty(0, a.dtype)
    return proto


class ManyUpdates:
    """The :class:`~rtmem.kernels.adam.PreparedUpdate` s of one step, with their
    coefficient vectors, grouped into kinds for :func:`_adam_many_kernel`
    (NOTE [ Many tensors, one launch ]).

    ``items`` holds ``(update, coefficients)``. Empty updates are left out
    (they have nothing to update or check). The caller keeps the updates'
    arrays alive while this object is used.
    """

    __slots__ = ("kinds",)

    def __init__(self, items):
        coefs, rows_of, kinds = [], {}, {}
        for u, c in items:
            size = u.p.size
            if not size:
                continue
            row = rows_of.get(id(c))
            if row is None:
                row = rows_of[id(c)] = len(coefs)
                coefs.append(c)
            # a non-empty update's arrays are all non-empty: None is an absent one
            # (spelled out: a comprehension here cost as much as the rest)
            p, g, m, v, vmax, out = u._spans()
            key = (u.g.dtype, vmax is None, None if out is None else u.out.dtype)
            kind = kinds.get(key)
            if kind is None:
                kind = kinds[key] = (u, [])
            kind[1].append((p[0], g[0], m[0], v[0], 0 if vmax is None else vmax[0],
                            0 if out is None else out[0], size, row))
        coefs = np.array(coefs, np.float32) if coefs else None
        self.kinds = []
        for u, rows in kinds.values():
            table = np.array(rows, np.int64)
            self.kinds.append((table, *_work_items(table[:, _SIZE], BLOCK_ELEMENTS),
                               coefs, u))

    def count_nonfinite(self) -> int:
        """Number of gradient elements that are inf/NaN once unscaled (times their
        coefficient vector's multiplier), over every update."""
        return sum(_nonfinite_many_kernel(table, pieces, starts, coefs, _proto(u.g))
                   for table, pieces, starts, coefs, u in self.kinds)

    def apply(self) -> None:
        """Run every update over all its elements (no finite check)."""
        for table, pieces, starts, coefs, u in self.kinds:
            _adam_many_kernel(table, pieces, starts, coefs, _proto(u.p), _proto(u.g),
                              _proto(u.vmax), _proto(u.out))


_F32 = np.empty(0, np.float32)


@numba.njit(cache=True)
def _add_one(addresses, f32):
    for a in addresses:
        count = numba.carray(_pointer_like(a, f32), 1)
        count[0] = count[0] + np.float32(1)


def add_one(addresses) -> None:
    """Add 1 to the float32 at each of ``addresses`` (an int64 array of byte
    addresses the caller vouches for), as ``x += 1`` in float32 does: the
    optimizers' per-parameter step counts, in one call."""
    _add_one(addresses, _F32)
