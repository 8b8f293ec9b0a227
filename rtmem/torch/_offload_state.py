"""The state of :class:`~rtmem.torch.OffloadedAdam` in torch's terms: the fp32
master weights read from the parameters and following what is written to them
in place, ``state[p]`` as ``torch.optim.Adam`` keeps it (live views of the host
arena), and ``state_dict`` / ``load_state_dict`` with each parameter's
``master`` and ``master_step``. Separate from ``offload.py``, which holds the
optimizer and its host buffers; the step that changes the state is
:mod:`._offload_update`'s.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import torch

from rtmem.errors import OptimizerError
from rtmem._optim_state_dict import (_check_adam_keys, _check_moment, _check_state_dict,
                                    _check_state_listed, _check_torch_layout,
                                    _checked_step, _loaded, _post_hooked, _pre_hooked,
                                    _saved_skips, _saved_step)

from ._offload_checks import _check_group


class _StateDict:
    """Mixin of :class:`~rtmem.torch.OffloadedAdam`, which provides ``params``,
    ``param_groups``, ``state``, ``dtype``, the host arrays (``master``,
    ``exp_avg``, ``exp_avg_sq`` and their ``_bufs``), the counters (``steps``,
    ``step_count``, ``skipped_steps``, ``last_step_skipped``), the version
    counters ``_versions`` and ``_state_synced``, and :meth:`_span`,
    :meth:`_check_open` and :meth:`_check_not_replaced`."""

    def _read_param(self, k: int) -> None:
        """Parameter k's values into its master weights, which now agree with it."""
        p = self.params[k]
        lo, hi = self._span(k)
        self.master[lo:hi] = p.detach().reshape(-1).float().cpu().numpy()
        self._versions[k] = p._version

    def _adopt_changes(self) -> None:
        """Take what was written to a parameter in place since the master weights
        last agreed with it (``model.load_state_dict``, ``nn.init``, a broadcast:
        its version counter moved) into the master weights, which the next upload
        would otherwise write back over it. Only the elements that differ from the
        master rounded to the parameter's dtype: a bf16 model reloaded after
        :meth:`load_state_dict` keeps the saved fp32 master. (Writes through
        ``p.data`` move no version counter and are not seen; this optimizer's own
        uploads go that way.)"""
        for k, p in enumerate(self.params):
            version = p._version
            if version == self._versions[k]:
                continue
            lo, hi = self._span(k)
            if p.dtype != self.dtype or p.numel() != hi - lo:
                continue    # its data was replaced: step() refuses it by name
            now = p.detach().reshape(-1).cpu()
            master = torch.from_numpy(self.master[lo:hi])
            if self.dtype == torch.float32:
                master.copy_(now)
            else:
                changed = now.view(torch.int16) != master.to(self.dtype).view(torch.int16)
                master[changed] = now[changed].float()
            self._versions[k] = version

    def _sync_state(self, ks=None) -> None:
        """``state[p]`` as ``torch.optim.Adam`` keeps it, for every parameter that
        has stepped: ``step`` and live views of its ``exp_avg``, ``exp_avg_sq``
        and ``master`` in the host arena (pinned views: a free waits for any
        still held). Code that takes an empty ``state`` for an optimizer never
        stepped sees the truth (torch.distributed.checkpoint "initializes" one
        by stepping it with zero gradients). ``ks``: the parameters whose step
        changed (default: all). A pass cut short (an exception, an interrupt)
        leaves ``_state_synced`` False: the next step or state_dict() redoes all."""
        if not self._state_synced:
            ks = None
        for k in range(len(self.params)) if ks is None else ks:
            p = self.params[k]
            if not self.steps[k]:
                self.state.pop(p, None)
                continue
            st = self.state.get(p)
            if st is None or "step" not in st:
                lo, hi = self._span(k)
                st = {key: torch.from_numpy(buf.numpy(pin=True)[lo:hi]).view(p.shape)
                      for key, buf in zip(("master", "exp_avg", "exp_avg_sq"), self._bufs)}
                st["step"] = torch.zeros((), dtype=torch.float32)
                self.state[p] = st     # whole: an entry without "step" broke every step
            st["step"].fill_(float(self.steps[k]))
        self._state_synced = True

    def state_dict(self) -> dict:
        """The state in ``torch.optim.Adam``'s layout (``state``: per parameter
        index that was ever updated, ``step``, ``exp_avg``, ``exp_avg_sq`` shaped
        like the parameter, plus its fp32 ``master`` weights and ``master_step``,
        the int step they are the weights of; ``param_groups``: the
        hyperparameters and parameter indices), and ``step_count``,
        ``skipped_steps`` and ``last_step_skipped``. Tensors are CPU float32
        copies, never views of the host arena. The flushed gradients are not
        part of it."""
        self._check_open("state_dict")
        if not self._state_synced:      # a step's state update was cut short
            self._sync_state()
        self._adopt_changes()           # the master weights saved are the model's
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state, groups, index = {}, [], 0
        for group in self.param_groups:
            packed = {key: value for key, value in group.items() if key != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(packed)
        for k, p in enumerate(self.params):
            if p in self.state:                  # as torch: no state before a step
                state[k] = {key: t.clone() for key, t in self.state[p].items()}
                # A Python int: torch.optim.Adam and CPUAdam carry it through their
                # load, state_dict and steps unchanged (a tensor would be cast to
                # the parameter's dtype), while their steps move "step" on.
                state[k]["master_step"] = int(self.steps[k])
        state_dict = {"state": state, "param_groups": groups,
                      "step_count": self.step_count, "skipped_steps": self.skipped_steps,
                      "last_step_skipped": self.last_step_skipped}
        return _post_hooked(self, state_dict)

    def load_state_dict(self, state_dict) -> None:
        """Load a state dict of this class or of ``torch.optim.Adam``/``AdamW``
        (same groups, same parameter counts and shapes). Parameters without a
        saved state start over (step 0, zero moments). A saved ``master`` is of
        record (a bf16 model's weights, loaded before or after, do not replace
        it; elements written in place that differ from it rounded to the
        parameter's dtype, before or after the load, do, as with plain torch)
        unless its ``master_step`` differs from the saved ``step``: then
        another optimizer (``torch.optim.Adam``, CPUAdam, which keep unknown
        keys) trained the parameter after this class saved it, and the master is
        stale. A stale master, or none (a torch dict), is read from the
        parameter, so load the model's weights first. A ``master`` without a
        ``master_step`` (a dict of an older rtmem) is of record. A master cast
        below float32 (``torch.optim.Adam``'s load casts its state to a bf16
        parameter's dtype) is read from the parameter, with a RuntimeWarning
        that its extra precision was lost. An ``exp_avg_sq`` with a negative
        element is refused (its next step made the parameter NaN, silently, as
        torch.optim.Adam's does); inf or NaN moments, which steps on non-finite
        gradients write, load as they are. A parameter
        whose data was replaced since construction (another dtype or size) is
        refused, as :meth:`step` refuses it. Everything is checked before
        anything changes; a refused load leaves the optimizer as it was.
        ``step_count``, ``skipped_steps`` and ``last_step_skipped`` are
        restored (from a torch dict, without them: the largest saved step, 0
        and False). Flushed gradients are kept. A group with
        ``differentiable=True`` is refused (set it to False in the dict); one
        with ``capturable=True`` (``torch.optim.Adam(capturable=True)``'s, whose
        ``step`` values are tensors on the parameters' device) is loaded with
        ``capturable=False``, which :meth:`state_dict` then saves: the update
        is the same, and each step is kept as this class keeps steps (an int
        in :attr:`steps`, a CPU float32 ``state[p]["step"]``)."""
        self._check_open("load_state_dict")
        state_dict = _pre_hooked(self, state_dict)
        _check_state_dict(state_dict)
        _check_torch_layout(state_dict)
        # deep-copied as torch does: a tensor lr (which schedulers fill_ in place)
        # must not stay shared with the dict or the optimizer it came from
        saved_groups = copy.deepcopy(list(state_dict["param_groups"]))
        if len(saved_groups) != len(self.param_groups) or any(
                len(s.get("params", ())) != len(g["params"])
                for s, g in zip(saved_groups, self.param_groups)):
            raise OptimizerError(
                f"the state dict has groups of "
                f"{[len(s.get('params', ())) for s in saved_groups]} parameters, this "
                f"optimizer {[len(g['params']) for g in self.param_groups]}: it belongs "
                f"to another model or grouping", argument="state_dict")
        _check_state_listed(state_dict)
        groups = []
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            merged = {**group, **{key: value for key, value in saved.items()
                                  if key not in ("params", "param_names")}}
            if merged.get("capturable"):
                # torch.optim.Adam(capturable=True)'s checkpoint: the same update
                # without it (its device step tensors are read as ints below)
                merged["capturable"] = False
            _check_adam_keys(gi, saved)
            _check_group(f"group {gi} of the state dict", merged, loaded=True)
            groups.append(merged)
        # Before the state's shapes are held to the parameters' (a replaced one
        # would be blamed on the dict) and before anything changes: loading into
        # its span raised numpy's ValueError half-way, the earlier parameters
        # already overwritten.
        for k, p in enumerate(self.params):
            self._check_not_replaced(k, p)
        # saved index -> this optimizer's parameter (the same order, group by group)
        index = {i: k for k, i in enumerate(
            i for saved in saved_groups for i in saved.get("params", ()))}
        arrays, cast = {}, []
        for i, st in state_dict["state"].items():
            k = index[i]                # _check_state_listed: every i is listed
            where = f"parameter {k}"
            if st.get("max_exp_avg_sq") is not None:
                raise OptimizerError(f"{where}: the state has max_exp_avg_sq (amsgrad), "
                                     f"which OffloadedAdam does not run",
                                     argument="state_dict")
            # steps is int64, and a step adds one to it
            step = _saved_step(st, where, np.iinfo(np.int64).max - 1)
            arrays[k] = [step]
            # the master's step, when saved: another optimizer's steps moved the
            # parameter and "step" on, and carried the master along unchanged
            stale = "master_step" in st and _checked_step(
                st["master_step"], f"{where}: master_step") != step
            for key in ("exp_avg", "exp_avg_sq", "master"):
                if key == "master" and (key not in st or stale):
                    arrays[k].append(None)       # read from the parameter
                    continue
                if key not in st:
                    raise OptimizerError(f"{where}: the state has no {key}",
                                         argument="state_dict")
                t = torch.as_tensor(st[key])
                if tuple(t.shape) != tuple(self.params[k].shape):
                    raise OptimizerError(
                        f"{where}: state {key} is {t.dtype} of shape {tuple(t.shape)}, "
                        f"the parameter has shape {tuple(self.params[k].shape)}; the "
                        f"state dict belongs to another model", argument="state_dict")
                if not t.is_floating_point():
                    # the shape fits: "another model" (as the two were once
                    # reported together) sent the user looking in the wrong place
                    raise OptimizerError(
                        f"{where}: state {key} has dtype {t.dtype}; expected floating "
                        f"point, as state_dict() saves it: the dict was edited or "
                        f"converted since", argument="state_dict")
                if key == "master" and t.element_size() < 4:
                    # torch.optim.Adam's load casts its state to the parameter's
                    # dtype, master included, and keeps master_step: a trip through
                    # it (a conversion, no step) rounded the master unnoticed
                    cast.append((k, t.dtype))
                    arrays[k].append(None)       # read from the parameter
                    continue
                held = t.detach().reshape(-1).to("cpu", torch.float32).numpy()
                if key != "master":     # weights may be anything; moments may not
                    _check_moment(where, key, held.reshape(tuple(t.shape)))
                arrays[k].append(held)
        counts = (_checked_step(state_dict.get("step_count", max(
                      [a[0] for a in arrays.values()], default=0)), "step_count"),
                  *_saved_skips(state_dict))
        if cast:
            warnings.warn(
                f"the saved fp32 master weights of parameter(s) "
                f"{', '.join(str(k) for k, _ in cast)} were cast to {cast[0][1]} (by "
                f"another optimizer's load_state_dict, e.g. torch.optim.Adam's): they are "
                f"read from the parameters, and their precision beyond the parameters' "
                f"dtype is lost", RuntimeWarning, stacklevel=2)
        # checked: now change things
        for k, p in enumerate(self.params):
            lo, hi = self._span(k)
            step, m, v, master = arrays.get(k, (0, None, None, None))
            if master is None:
                self._read_param(k)
            else:
                # The loaded master is of record, except where the parameter was
                # written in place since the master last agreed with it (its
                # version moved): _adopt_changes takes those elements at the next
                # step or state_dict(), as for writes after the load. Declaring
                # them agreed here dropped a re-initialised head (nn.init before
                # the load) and the next step wrote the old weights back.
                self.master[lo:hi] = master
            self.exp_avg[lo:hi] = 0 if m is None else m
            self.exp_avg_sq[lo:hi] = 0 if v is None else v
            self.steps[k] = step
        for group, merged in zip(self.param_groups, groups):
            group.clear()
            group.update(merged)
        self.step_count, self.skipped_steps, self.last_step_skipped = counts
        self._sync_state()
        _loaded(self)
