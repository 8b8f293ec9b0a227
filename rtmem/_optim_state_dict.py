"""The checks of a loaded optimizer state dict that :class:`rtmem.optim.NumpyAdam`,
:class:`rtmem.optim.CPUAdam` and :class:`rtmem.torch.OffloadedAdam` share: the
torch layout (``state``, ``param_groups``), the step counts, the moments, the
skip counters (NOTE [ Skipped steps ] in rtmem/optim.py), and the state_dict /
load_state_dict hooks, run as torch runs them. numpy only (no torch), split
from :mod:`rtmem.optim` so that it keeps to the optimizers and their step.
Each of those imports what it uses from here.
"""

from __future__ import annotations

import numpy as np

from .errors import OptimizerError


_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# The end of every optimizer's refusal of a loaded moment that is not real
# floating point. Refused, not cast (as torch.optim.Adam's load casts it to the
# parameter's dtype): no Adam saves such a moment, so the dict is not the
# state it claims to be (and a complex one lost its imaginary part).
_MOMENT_DTYPE_HINT = ("as state_dict() saves it: an integer, bool or complex moment "
                      "is no Adam state (was the dict edited or converted?)")


def _check_state_dict(state_dict) -> None:
    """OptimizerError unless ``state_dict`` has the torch optimizer layout."""
    if not isinstance(state_dict, dict) or \
            not {"state", "param_groups"} <= set(state_dict):
        raise OptimizerError("state_dict must be a dict with 'state' and "
                             "'param_groups', as returned by state_dict()",
                             argument="state_dict")


def _check_torch_layout(state_dict) -> None:
    """OptimizerError unless ``state_dict`` (a dict with ``state`` and
    ``param_groups``) has a torch optimizer's inner layout: ``param_groups`` a
    list of dicts, each with its list of ``params`` (indices), and ``state`` a
    dict of dicts (a malformed one raised a bare AttributeError or KeyError from
    inside torch's load)."""
    groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(groups, (list, tuple)) or \
            not all(isinstance(g, dict) and isinstance(g.get("params"), (list, tuple))
                    for g in groups) or \
            not isinstance(state, dict) or \
            not all(isinstance(st, dict) for st in state.values()):
        raise OptimizerError("state_dict['param_groups'] must be a list of dicts, each "
                             "with its list of 'params', and state_dict['state'] a dict "
                             "of dicts, as returned by state_dict()",
                             argument="state_dict")
    for i, st in state.items():
        for key in ("step", *_STATE_KEYS):
            value = st.get(key, 0)      # absent: another check's to name
            # torch's load turned a string into the text of a generator (named so
            # in the step's error), and a None or string moment raised a bare
            # TypeError / RuntimeError from torch.as_tensor; a None step is
            # _checked_step's to name
            if isinstance(value, (str, bytes)) or (value is None and key != "step"):
                raise OptimizerError(
                    f"the state of parameter {i!r} has {key}={value!r}; expected a "
                    f"tensor{' or an integer' if key == 'step' else ''}, as "
                    f"state_dict() returns", argument="state_dict")


def _check_state_listed(state_dict) -> None:
    """OptimizerError unless every key of ``state_dict['state']`` (of
    :func:`_check_torch_layout`'s layout) is an index its groups list. torch's
    own load keeps the state of another key aside and loads nothing for the
    parameter: a checkpoint whose indices a JSON or YAML round trip had turned
    into strings ("0") restarted every moment and step count, silently. Called
    after the groups' sizes are checked, whose error says more."""
    listed = {i for g in state_dict["param_groups"] for i in g["params"]
              if isinstance(i, (int, np.integer))}
    for i in state_dict["state"]:
        if not isinstance(i, (int, np.integer)) or i not in listed:
            hint = (" (an index turned into a string, by a JSON or YAML round trip?)"
                    if isinstance(i, str) else "")
            raise OptimizerError(
                f"the state dict has state for parameter {i!r}, which none of its "
                f"groups lists{hint}; load the dict state_dict() returned (torch.save "
                f"and torch.load keep it)", argument="state_dict")


def _saved_skips(state_dict) -> tuple:
    """``(skipped_steps, last_step_skipped)`` of a state dict (NOTE [ Skipped
    steps ]): its top-level keys of those names, which every rtmem optimizer's
    ``state_dict()`` writes and torch's loads ignore; 0 and False for a dict
    without them (torch.optim.Adam's, an older rtmem's). OptimizerError unless
    the count is an integer >= 0 and the flag a bool."""
    skipped = _checked_step(state_dict.get("skipped_steps", 0), "the state dict",
                            what="skipped_steps")
    last = state_dict.get("last_step_skipped", False)
    if not isinstance(last, (bool, np.bool_)):
        raise OptimizerError(f"last_step_skipped is {last!r}; expected True or False, "
                             f"as state_dict() saves it.", argument="state_dict")
    return skipped, bool(last)


def _pre_hooked(optimizer, state_dict):
    """``state_dict`` after ``optimizer``'s load_state_dict pre-hooks, run as
    torch runs them (on a shallow copy; a hook's non-None result replaces it),
    before the checks: a hook may adapt the dict (unwrap a checkpoint, rename
    keys). A non-dict is left to the checks to refuse."""
    if isinstance(state_dict, dict):
        state_dict = state_dict.copy()
        for pre_hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(optimizer, state_dict)
            if result is not None:
                state_dict = result
    return state_dict


def _post_hooked(optimizer, state_dict, hooks=None):
    """``state_dict`` after ``optimizer``'s state_dict post-hooks (or ``hooks``,
    a dict of them), run as torch runs them: a hook's non-None result replaces
    the dict. For the optimizers that add keys of their own to the dict (the
    skip counters), so that the hooks see them."""
    for post_hook in (optimizer._optimizer_state_dict_post_hooks
                      if hooks is None else hooks).values():
        result = post_hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def _loaded(optimizer) -> None:
    """Run ``optimizer``'s load_state_dict post-hooks, once a load is accepted."""
    for post_hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        post_hook(optimizer)


def _check_adam_keys(gi: int, group: dict) -> None:
    """OptimizerError unless group ``gi`` of a loaded state dict has Adam's
    hyperparameters (an SGD dict has no betas: a bare KeyError otherwise)."""
    missing = [k for k in ("lr", "betas", "eps", "weight_decay") if k not in group]
    if missing:
        raise OptimizerError(
            f"group {gi} of the state dict has no {', '.join(missing)}: it is not an "
            f"Adam state dict; load one saved by CPUAdam, CPUAdamW, OffloadedAdam or "
            f"torch.optim.Adam/AdamW", argument="state_dict")


def _checked_step(step, where, limit=None, what="step") -> int:
    """A saved step count as an int; raise OptimizerError naming ``where`` (the
    parameter) unless it is an integer >= 0 (a Python/numpy number or a
    one-element tensor; -3, NaN and 2.5 are refused) and, with ``limit``, at
    most ``limit`` (the largest count the optimizer's step counter holds)."""
    try:
        count = int(step)
        ok = bool(count == step) and count >= 0
    except (TypeError, ValueError, OverflowError, RuntimeError):
        ok = False
    if not ok:
        raise OptimizerError(f"{where}: {what} is {step!r}; expected an integer >= 0.",
                             argument="state_dict")
    if limit is not None and count > limit:
        # refused here, before anything changes: stored, it became inf (a float32
        # counter: every later step raised OverflowError) or raised half-way
        # through a load (an int64 counter)
        raise OptimizerError(f"{where}: step is {step!r}, more than the {limit} this "
                             f"optimizer's step counter holds.", argument="state_dict")
    return count


def _saved_step(st, where, limit=None) -> int:
    """The step count of a loaded parameter state ``st`` (a dict with its
    moments), checked by :func:`_checked_step`. OptimizerError when it has
    none: read as 0, the next step was a first step again, whose bias
    correction divides the saved moments by ``1 - beta1`` (about 10x the
    update), silently (``torch.optim.Adam``'s step raises KeyError on it)."""
    if "step" not in st:
        raise OptimizerError(
            f"{where}: the state has {', '.join(map(str, st)) or 'nothing'} but no "
            f"step, the count its moments were made at (read as 0, the next step "
            f"would over-correct their bias); load the dict state_dict() returned, "
            f"which saves it", argument="state_dict")
    return _checked_step(st["step"], where, limit)


def _check_moment(where, key, values) -> None:
    """OptimizerError naming ``where`` (the parameter) and ``key`` when a loaded
    second moment (``exp_avg_sq``, ``max_exp_avg_sq``: running means of squared
    gradients; ``values`` as the float32 numpy array the optimizer will hold)
    has a negative element: the update divides by its square root, so that
    parameter element became NaN at the next step, silently (torch.optim.Adam
    loads such a state as it is). No step writes a negative second moment, so
    such a state is corrupt.

    Non-finite moments (inf/NaN) load as they are, as torch's do: a step on
    non-finite gradients writes them, and a save/load round trip must give the
    state back as it was (the loss scaler's overflow check is what keeps them
    out of a training run)."""
    if key == "exp_avg":
        return
    bad = np.asarray(values) < 0        # NaN compares False: loaded as it is
    if not bad.any():
        return
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise OptimizerError(
        f"{where}: {key} has {int(bad.sum())} negative element(s), the first "
        f"{float(np.asarray(values)[first])!r} at index {first}; a second moment is a "
        f"mean of squared gradients (>= 0), and the next step would make the "
        f"parameter NaN. The state dict is corrupt: load a checkpoint saved before "
        f"it went bad.", argument="state_dict")
