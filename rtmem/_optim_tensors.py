"""The tensor side of :class:`rtmem.optim.CPUAdam`: zero-copy numpy views of
CPU tensors for the fused kernel, rtmem Buffers taken as parameters, per-
parameter arguments (``grads=``, ``copies=``), and the autograd version bumps
the kernel's writes need. Split from :mod:`rtmem._optim_torch` to keep that
module to the optimizer itself; imports torch at the top, as it does."""

from __future__ import annotations

import numpy as np
import torch

from .buffer import Buffer
from .errors import OptimizerError
from .optim import _host_view

__all__ = ["as_numpy", "bump_versions", "per_param", "tensors_of"]


def as_numpy(t, name):
    """(numpy view, 16-bit format or None) of a CPU tensor, zero-copy."""
    if isinstance(t, np.ndarray):
        if t.dtype == np.uint16:
            # The kernel's advice (grad_format=) does not apply here: CPUAdam
            # takes the format from the tensor's dtype.
            raise OptimizerError(
                f"{name} is a numpy uint16 array, whose bits could be bfloat16 or "
                f"float16. Pass bfloat16 as a torch.bfloat16 tensor (zero-copy: "
                f"torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)) and "
                f"float16 as a float16 array or tensor.", argument=name)
        return t, None
    if not isinstance(t, torch.Tensor):
        raise OptimizerError(f"{name} must be a torch.Tensor or numpy array, got "
                             f"{type(t).__name__}.", argument=name)
    if t.device.type != "cpu" or t.layout != torch.strided:
        raise OptimizerError(
            f"{name} is a {t.device.type} {t.layout} tensor; the CPU optimizer needs "
            f"dense CPU tensors (copy with .to('cpu'), or .to_dense()).",
            argument=name)
    if not t.is_contiguous():
        raise OptimizerError(f"{name} is not contiguous (strides {t.stride()}); the "
                             f"fused kernel walks flat memory. Use .contiguous().",
                             argument=name)
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    if t.dtype in (torch.float32, torch.float16):
        return t.numpy(), None
    raise OptimizerError(f"{name} has dtype {t.dtype}; expected float32, float16 or "
                         f"bfloat16.", argument=name)


def tensors_of(params):
    """``params`` with rtmem Buffers replaced by zero-copy CPU tensors over their
    host memory (which pin the buffers while the optimizer holds them)."""
    if isinstance(params, torch.Tensor):
        return params          # torch.optim raises its own clear error for this

    def one(p):
        if not isinstance(p, Buffer):
            return p
        return torch.from_numpy(_host_view(p, "params"))
    out = []
    for item in params:
        if isinstance(item, dict):
            item = {**item, "params": [one(p) for p in (
                [item["params"]] if isinstance(item["params"], (torch.Tensor, Buffer))
                else item["params"])]}
            out.append(item)
        else:
            out.append(one(item))
    return out


def per_param(values, params, name):
    """Map a dict {param: value} or a sequence aligned with params to a dict."""
    if values is None:
        return {}
    if isinstance(values, dict):
        ids = {id(p) for p in params}
        keyed = {_param_id(k, params, name): v for k, v in values.items()}
        if any(k not in ids for k in keyed):
            raise OptimizerError(f"{name} has a key that is not a parameter of this "
                                 f"optimizer; key the dict by the parameters passed "
                                 f"to it", argument=name)
        return keyed
    values = list(values)
    if len(values) != len(params):
        raise OptimizerError(f"{name} has {len(values)} entries for {len(params)} "
                             f"params; pass one per param in param-group order, or a "
                             f"dict {{param: tensor}}.", argument=name)
    return {id(p): v for p, v in zip(params, values)}


def _param_id(key, params, name) -> int | None:
    """``id`` of the parameter a dict ``key`` names: a Buffer passed as a
    parameter is held as a tensor over its host memory, found by address."""
    if not isinstance(key, Buffer):
        return id(key)
    view = _host_view(key, name)
    where = (view.ctypes.data, view.nbytes)
    return next((id(p) for p in params
                 if (p.data_ptr(), p.numel() * p.element_size()) == where), None)


def bump_versions(tensors):
    """Tell autograd the ``tensors`` were modified in place.

    The kernel writes them through numpy views, which autograd cannot see:
    without this, backward through a graph that saved a parameter before the
    step would silently use the new values, where torch.optim.Adam's in-place
    update makes it raise "modified by an inplace operation".
    """
    increment = getattr(torch.autograd.graph, "increment_version", None)
    if increment is not None and _LIST_INCREMENT:
        try:
            increment(tensors)     # one call (~0.4 us a tensor less than one each)
            return
        except TypeError:          # an older torch, which takes one tensor only
            _LIST_INCREMENT.clear()
    for t in tensors:
        if increment is not None:
            increment(t)
        elif not t.is_inference():  # inference tensors have no version counter
            # Any in-place op bumps the (shared) counter, even on no elements.
            with torch.no_grad():
                t.view(-1)[:0].zero_()


#: Non-empty while torch's increment_version is taken to accept a list.
_LIST_INCREMENT = [True]
