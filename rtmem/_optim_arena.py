"""CPUAdam's moments in a host arena (``CPUAdam(..., state_arena=arena)``).

NOTE [ Optimizer state in an arena ]
Each moment (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) of a parameter is
a zero-copy CPU tensor over its own ``kind="optimizer-state"`` buffer of the
arena (float32, 4 bytes per element, each buffer rounded up to the arena's
alignment), made by :func:`rtmem.optim._zeros_states`, the helper NumpyAdam
uses: the buffer is freed at once and its free waits for the last view (NOTE
[ Pinned views ] in rtmem/buffer.py). So the arena gets the bytes back when
the optimizer drops the tensor *and* every tensor derived from it is gone (a
``state_dict()`` the caller keeps holds the live tensors, as torch's does):
no view ever reads memory the arena has handed out again.

Rules:
1. A parameter's missing moments are allocated together before any is
   installed (:func:`arena_zeros`; NumpyAdam's constructor: every
   parameter's at once): an arena too small raises OutOfMemoryError, installs
   none of them and holds none (those made are given back before it raises).
2. A load copies the checked values into the arena, reusing the buffers of
   moments already there (same parameter, key and shape), so the state stays
   in the arena and a load needs no second copy of it there; buffers are
   allocated for the rest before anything is written, so a refused load
   writes nothing.
3. ``step`` (a float32 scalar tensor, as in torch.optim.Adam) is not in the
   arena: 4 bytes would take a whole aligned block per parameter.
"""

from __future__ import annotations

import torch

from ._optim_state_dict import _STATE_KEYS
from .optim import _zeros_states


def arena_zeros(shapes, arena) -> list:
    """Zeroed float32 CPU tensors of ``shapes`` over buffers of the host
    ``arena`` (NOTE [ Optimizer state in an arena ]), all or none: when one
    allocation fails (OutOfMemoryError) the ones made are dropped before the
    error propagates, so their bytes go back at once rather than when the
    traceback dies."""
    return [torch.from_numpy(a) for a in _zeros_states(shapes, arena)]


def in_arena(t, arena) -> bool:
    """True if CPU tensor ``t``'s memory lies inside one of ``arena``'s slabs."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    for slab in arena.slabs:
        host = slab.host_array
        if host is None:
            continue
        lo = host.__array_interface__["data"][0]
        if lo <= start and end <= lo + host.nbytes:
            return True
    return False


def load_into_arena(state, old_state, arena) -> None:
    """Replace the moments of ``state`` (param -> dict, the loaded and checked
    float32 tensors) by arena tensors holding the same values (Rule 2 of the
    NOTE): those of ``old_state`` (the state before the load) where the
    parameter had the moment in the arena with that shape, new buffers for the
    rest. Raises (OutOfMemoryError) before writing anything when the new
    buffers do not fit; ``state`` is then unchanged."""
    plan, shapes = [], []
    for p, st in state.items():
        old = old_state.get(p, {})
        for key in _STATE_KEYS:
            if key not in st:
                continue
            dst = old.get(key)
            if not (torch.is_tensor(dst) and dst.shape == st[key].shape
                    and in_arena(dst, arena)):
                dst = None
                shapes.append(st[key].shape)
            plan.append((st, key, dst))
    fresh = iter(arena_zeros(shapes, arena))
    for st, key, dst in plan:
        if dst is None:
            dst = next(fresh)
        dst.copy_(st[key])
        st[key] = dst
