"""Error codes of the jitted simulator core and their messages.

The core cannot raise rich exceptions, so it stops with (code, op index, a, b) in
an array and :func:`raise_error` turns that into a ScheduleError whose message
says what was wrong and what to do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rtmem.errors import ScheduleError
from rtmem.units import format_bytes

from .schedule import Op

if TYPE_CHECKING:
    from .chain import Chain
    from .platform import Platform
    from .schedule import Schedule

# Error codes returned by the jitted core; raise_error() turns them into messages.
OK = 0
_E_MISSING_INPUT = 1      # a: activation index, b: 1 if a plain copy was required
_E_BACKWARD_ORDER = 2     # a: stage given (-1: loss), b: expected (-1: loss, -2: none)
_E_MISSING_ABAR = 3       # a: activation index
_E_MEMORY = 4             # a: bytes over the limit, b: bytes needed by the op
_E_INCOMPLETE = 5         # a: next expected backward stage (-1: loss)
_E_NOT_RESIDENT = 6       # a: activation index, b: kind
_E_ALREADY_RESIDENT = 7   # a: activation index, b: kind
_E_NO_HOST_COPY = 8       # a: activation index, b: kind
_E_HOST_COPY_EXISTS = 9   # a: activation index, b: kind
_E_WEIGHT_MISSING = 10    # a: stage
_E_WEIGHT_STATE = 11      # a: stage, b: 1 if the weights were expected on the device
_E_GRAD_MISSING = 12      # a: stage
_E_INITIAL_MEMORY = 13    # a: bytes over the limit

_REASONS = {
    _E_MISSING_INPUT: "missing-input", _E_BACKWARD_ORDER: "backward-order",
    _E_MISSING_ABAR: "missing-input", _E_MEMORY: "memory-limit",
    _E_INCOMPLETE: "incomplete", _E_NOT_RESIDENT: "not-resident",
    _E_ALREADY_RESIDENT: "already-resident", _E_NO_HOST_COPY: "no-host-copy",
    _E_HOST_COPY_EXISTS: "host-copy-exists", _E_WEIGHT_MISSING: "missing-weights",
    _E_WEIGHT_STATE: "weight-state", _E_GRAD_MISSING: "missing-gradient",
    _E_INITIAL_MEMORY: "memory-limit",
}


def _act(k: int, kind: int) -> str:
    return f"{'abar' if kind else 'a'}{k}"


def _bytes(n: int) -> str:
    """A byte count as words: "1 byte", "1,024 bytes"."""
    return "1 byte" if n == 1 else f"{n:,} bytes"


def raise_error(err, schedule: Schedule, chain: Chain, platform: Platform) -> None:
    code, j, a, b = (int(v) for v in err)
    where = f"op {j} ({schedule.op_text(j)})" if j >= 0 else "after the last op"
    if code == _E_MISSING_INPUT:
        if b == 1:
            what = (f"needs the plain activation a{a} on the device, but it is not there"
                    + (f" (only abar{a} is; F_none cannot read abar, use F_ck or F_all)"
                       if a > 0 else ""))
        else:
            what = (f"needs a{a} or abar{a} on the device, but neither is there; compute "
                    "it again or prefetch it first")
    elif code == _E_BACKWARD_ORDER:
        given = "the loss" if a == -1 else f"B {a}"
        if b == -2:     # the loss and every B ran already
            what = (f"runs {given} after B 0 completed the backward pass; backward "
                    "steps run once each, in the order L, B n-1, ..., B 0")
        else:
            expected = "the loss (L)" if b == -1 else f"B {b}"
            what = (f"runs {given} but the next backward step must be {expected}; "
                    "backward steps run once each, in the order L, B n-1, ..., B 0")
    elif code == _E_MISSING_ABAR:
        what = (f"needs abar{a} (made by F_all {a - 1}) on the device, but it is not "
                f"there; run F_all {a - 1} (or prefetch abar{a}) before it")
    elif code == _E_MEMORY:
        what = (f"needs {_bytes(b)} more but memory would exceed the limit of "
                f"{platform.memory_limit:,} bytes ({format_bytes(platform.memory_limit)}) "
                f"by {_bytes(a)} even after every pending free; give more memory or "
                "keep less data")
    elif code == _E_INITIAL_MEMORY:
        what = (f"the chain input and weights alone exceed the memory limit of "
                f"{platform.memory_limit:,} bytes by {_bytes(a)}")
        where = "before the first op"
    elif code == _E_INCOMPLETE:
        missing = "the loss (L)" if a == -1 else f"B {a}"
        what = (f"the schedule ends before the backward pass is complete: {missing} and "
                "the backward steps after it never run")
    elif code == _E_NOT_RESIDENT:
        what = (f"{_act(a, b)} is not on the device (never made, deleted, or consumed by "
                f"F_none/L/B); compute it again or prefetch it before "
                f"{'offloading' if schedule.op[j] == Op.OFFLOAD else 'deleting'} it, or drop "
                "this op")
    elif code == _E_ALREADY_RESIDENT:
        what = f"{_act(a, b)} is already on the device; prefetch only what was deleted"
    elif code == _E_NO_HOST_COPY:
        what = f"{_act(a, b)} has no host copy; offload it before prefetching it"
    elif code == _E_HOST_COPY_EXISTS:
        what = (f"{_act(a, b)} already has a host copy (each activation is offloaded at "
                "most once); delete the device copy instead")
    elif code == _E_WEIGHT_MISSING:
        what = (f"needs the weights of stage {a} on the device, but they were offloaded "
                f"or deleted (w_offload/w_delete); w_prefetch {a} first")
    elif code == _E_WEIGHT_STATE:
        what = (f"the weights of stage {a} are not on the device (already offloaded or "
                f"deleted); w_prefetch {a} first, or drop this op" if b == 1 else
                f"the weights of stage {a} are already on the device; w_prefetch only "
                f"weights that w_offload or w_delete moved off it")
    elif code == _E_GRAD_MISSING:
        what = f"stage {a} has no weight gradient on the device (B {a} makes it)"
    else:  # pragma: no cover - a new code without a message is a bug
        what = f"internal error code {code}"
    raise ScheduleError(f"{where}: {what}", op_index=j if j >= 0 else None,
                        reason=_REASONS.get(code, "internal"),
                        over_bytes=a if code in (_E_MEMORY, _E_INITIAL_MEMORY) else None)


