"""What :class:`~rtmem.torch.OffloadedAdam` accepts: the checks of its
parameters (tensors it can update element by element, each with memory of its
own), of its param groups and their hyperparameters, and of a gradient before
it is copied into the host buffers. Separate from ``offload.py``, which holds
the optimizer; these only refuse, with :class:`~rtmem.errors.OptimizerError`,
and change nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from rtmem._optim_torch import _check_switches
from rtmem.errors import OptimizerError
from rtmem.optim import _check_group_hyper, _first_overlap


def _overlaps(t) -> bool:
    """True unless the layout of ``t`` provably maps distinct elements to distinct
    memory (checked on the strides: sorted by stride, each dimension must step
    past everything the smaller ones span). Expanded (stride-0) tensors overlap;
    permuted (channels_last, transposed) and sliced ones do not."""
    extent = 0   # largest offset reached by the dimensions seen so far
    for stride, size in sorted((abs(st), sz) for sz, st in zip(t.shape, t.stride())
                               if sz > 1):
        if stride <= extent:
            return True
        extent += (size - 1) * stride
    return False


def _check_own_memory(k: int, p) -> None:
    """OptimizerError if parameter ``k`` has elements sharing memory."""
    if _overlaps(p):
        raise OptimizerError(
            f"parameter {k} (shape {tuple(p.shape)}, strides {p.stride()}) has elements "
            f"sharing memory (e.g. made by expand()), so no update can write it element "
            f"by element; give it its own memory first (p.data = p.data.clone())",
            argument="params")


def _check_disjoint(params) -> None:
    """OptimizerError if two parameters share memory (two Parameters made over one
    tensor's data, or views of one buffer): each has its own master weights, so
    the upload of one would overwrite the other's update (torch.optim.Adam
    applies both; CPUAdam refuses them). Compared by the address range each
    spans, so two interleaved views of one buffer are refused as well."""
    by_device = {}      # address spaces of their own
    for k, p in enumerate(params):
        if p.numel():
            lo = p.data_ptr()
            extent = sum((size - 1) * abs(st) for size, st in zip(p.shape, p.stride()))
            by_device.setdefault(p.device, []).append(
                (lo, lo + (extent + 1) * p.element_size(), k))
    for spans in by_device.values():
        pair = _first_overlap(spans)
        if pair is not None:
            i, j = sorted((pair[0][2], pair[1][2]))
            raise OptimizerError(
                f"parameters {i} and {j} share memory (e.g. two nn.Parameter made over "
                f"one tensor's data); each has its own Adam state here, so one's upload "
                f"would undo the other's update. Tie weights by assigning the same "
                f"Parameter object, or give each its own memory (p.data = p.data.clone())",
                argument="params")


def _check_param(k: int, p) -> None:
    """OptimizerError for what OffloadedAdam cannot update: non-tensors, sparse or
    meta tensors, tensors computed from others."""
    if isinstance(p, dict):
        raise OptimizerError("a param group (dict) among tensors: pass either tensors or "
                             "param groups (dicts with 'params'), not both",
                             argument="params")
    if not isinstance(p, torch.Tensor):
        raise OptimizerError(f"parameter {k} is a {type(p).__name__}, not a torch.Tensor",
                             argument="params")
    why = ("is sparse (use torch.optim.SparseAdam)" if p.layout != torch.strided else
           "is a meta tensor (it has no data to update)" if p.is_meta else
           "is not a leaf tensor (it is computed from others; gradient hooks need leaves)"
           if not p.is_leaf else None)
    if why is not None:
        raise OptimizerError(f"parameter {k} (shape {tuple(p.shape)}) {why}",
                             argument="params")


# Adam options of torch.optim.Adam this optimizer does not implement: refused when
# a group (or a loaded state dict) turns them on, instead of silently ignored.
_UNSUPPORTED = ("amsgrad", "maximize")

# torch.optim.Adam's switches it cannot honour (rtmem.optim.CPUAdam's check):
# refused in a group of the constructor or edited in before a step, and
# differentiable in a loaded state dict too. A loaded capturable=True (a
# checkpoint of a GPU torch.optim.Adam(capturable=True)) is taken as False by
# load_state_dict: the update is the same without it.
_SWITCHES = {
    "capturable": "OffloadedAdam updates its host copy in a numba kernel, outside CUDA "
                  "graphs, so no graph can capture its step",
    "differentiable": "OffloadedAdam's update is not recorded by autograd, so no "
                      "gradient flows through it",
}


def _check_group(where: str, group: dict, loaded: bool = False) -> None:
    """OptimizerError unless ``group`` holds hyperparameters this optimizer runs
    (``loaded``: it comes from a state dict, whose remedies differ)."""
    _check_group_hyper(where, group)
    _check_switches(where, group, loaded, _SWITCHES)
    if not isinstance(group["decoupled_weight_decay"], (bool, np.bool_)):
        raise OptimizerError(f"{where}: decoupled_weight_decay="
                             f"{group['decoupled_weight_decay']!r} must be True or False",
                             argument="decoupled_weight_decay")
    for key in _UNSUPPORTED:
        value = group.get(key)
        if value is not None and not isinstance(value, (bool, np.bool_)):
            # truthy, it was reported as "amsgrad=True" to a caller who passed "no"
            raise OptimizerError(f"{where}: {key}={value!r} is not a bool: pass False "
                                 f"(OffloadedAdam does not implement {key}=True)",
                                 argument=key)
        if value:
            raise OptimizerError(f"{where}: {key}=True is not supported by OffloadedAdam; "
                                 f"use rtmem.optim.CPUAdam (CPU parameters) or "
                                 f"torch.optim.Adam for it", argument=key)


def _param_groups(params, defaults: dict) -> list:
    """``params`` (tensors, ``(name, tensor)`` pairs or param-group dicts) as
    torch-style groups, every parameter and group checked, duplicates within a
    group dropped; OptimizerError for anything OffloadedAdam cannot take."""
    if isinstance(params, torch.Tensor):
        # list() would split it into rows, each refused as "not a leaf tensor"
        raise OptimizerError("params must be an iterable of tensors (e.g. "
                             "model.parameters()), got a single tensor: pass [p]",
                             argument="params")
    items = list(params)
    if not items:
        raise OptimizerError("params is empty; pass the model's parameters",
                             argument="params")
    if not isinstance(items[0], dict):
        items = [{"params": items}]
    groups, seen, k = [], {}, 0
    for gi, item in enumerate(items):
        if not isinstance(item, dict) or "params" not in item:
            raise OptimizerError(f"param group {gi} is a {type(item).__name__}; pass "
                                 f"either tensors or dicts with a 'params' entry, not "
                                 f"both", argument="params")
        ps = item["params"]
        if isinstance(ps, set):
            raise OptimizerError(f"param group {gi}: 'params' is a set, whose order "
                                 f"changes between runs; pass a list",
                                 argument="params")
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        kept = {}
        for entry in ps:
            named = isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
            p = entry[1] if named else entry
            _check_param(k, p)
            k += 1
            if id(p) in seen and seen[id(p)] != gi:
                raise OptimizerError(f"a parameter (shape {tuple(p.shape)}) is in param "
                                     f"groups {seen[id(p)]} and {gi}; each parameter "
                                     f"belongs to one group", argument="params")
            seen[id(p)] = gi
            kept.setdefault(id(p), entry)
        group = {**defaults, **item, "params": list(kept.values())}
        _check_group(f"param group {gi}", group)
        groups.append(group)
    return groups


def _check_grad(k: int, p, size: int) -> None:
    """OptimizerError for a gradient the host buffers cannot take (checked before
    anything is copied: the flush would fail half way, with torch's message)."""
    g = p.grad
    if g.layout != torch.strided:
        raise OptimizerError(
            f"parameter {k} (shape {tuple(p.shape)}) has a {g.layout} gradient (e.g. "
            f"nn.Embedding(sparse=True)); OffloadedAdam updates dense gradients: make "
            f"the layer produce dense ones (sparse=False)", argument="params")
    if g.numel() != size:
        raise OptimizerError(
            f"parameter {k} has a gradient of {g.numel()} elements for {size} parameter "
            f"elements: its data was replaced after construction (make a new "
            f"OffloadedAdam for the changed model), or p.grad was set to a tensor of "
            f"another shape", argument="params")
