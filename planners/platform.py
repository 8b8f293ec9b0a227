"""The machine a schedule runs on, as the simulator and planners model it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rtmem.errors import PlatformError, UnitError
from rtmem.units import (_is_array, _special, format_bandwidth, format_bytes, parse_bandwidth,
                         parse_bytes)

from ._validation import MAX_BYTES, is_int

__all__ = ["Platform", "CHANNELS"]

#: Channel models: ``"shared"`` is one link used by one transfer at a time in
#: either direction (assumption O.1 of thesis-offload.md); ``"duplex"`` has one
#: link per direction, each at the full bandwidth (weight-offloading.md §1.1).
CHANNELS = ("shared", "duplex")

# Said to Python and CLI callers alike ("Platform('12GiB')" read oddly after
# `rtmem plan remat --memory 0`)
_NOT_POSITIVE = ("memory must be > 0 bytes, got {!r}; give the device memory budget, "
                 "e.g. '12GiB'")


def _negative(value) -> bool:
    """A number below 0 (a 0-d array or tensor, a Decimal too) or a string written
    with a minus sign ('-1GiB', '-inf'); False for anything else (an array of
    one or more dimensions, even of one element: its error is parse_bytes' to
    give)."""
    if isinstance(value, str):
        return value.strip().startswith("-")
    if _is_array(value):
        # torch.tensor([-5]) has a truth value, yet parse_bytes' "got an array of
        # shape (1,)" is the error to give (it was "must be > 0 bytes")
        return False
    try:
        return bool(value < 0)
    except (TypeError, ValueError, RuntimeError):   # numpy's and torch's "ambiguous"
        return False

# Budgets from MAX_BYTES up are unlimited (the jitted simulator and planners
# hold byte counts in int64).


@dataclass(frozen=True)
class Platform:
    """Device memory, host link bandwidth and channel model.

    Parameters
    ----------
    memory:
        Device memory available to the schedule, in bytes (> 0; a fraction of a
        byte is rounded down, so at least 1 byte must be given). Everything the
        simulator tracks counts against it: activations, weights, weight
        gradients, temporaries. ``math.inf`` (or anything >= 2**62 bytes) means
        unlimited, as are the strings ``"inf"``, ``"+inf"``, ``"infinity"``,
        ``"unlimited"`` and ``"∞"`` (any case). Strings such as ``"12GiB"`` are accepted.
    bandwidth:
        Host<->device bandwidth in bytes/s (> 0, default ``inf``: transfers take
        no time). Strings such as ``"12 GB/s"`` are accepted.
    channel:
        ``"shared"`` (one transfer at a time, either direction) or ``"duplex"``
        (one transfer per direction at a time).
    """

    memory: float
    bandwidth: float = math.inf
    channel: str = "shared"

    def __post_init__(self):
        mem = self.memory
        # every word the bandwidth reads as infinity ('+inf', 'Infinity', '∞'):
        # only 'inf' and 'unlimited' were, and the others got parse_bytes' "must
        # be finite", which contradicted the 'inf' accepted here
        if isinstance(mem, str) and _special(mem) == math.inf:
            mem = math.inf
        if is_int(mem):
            # exact: parse_bytes goes through float, which rounds above 2**53 bytes,
            # up as well (2**54 + 7 became 2**54 + 8: plans over the budget asked)
            mem = int(mem)
        elif not (isinstance(mem, float) and math.isinf(mem) and mem > 0):
            try:
                mem = parse_bytes(mem, round_down=True)   # a budget: never above it
            except UnitError as e:
                if _negative(mem):
                    # parse_bytes' ">= 0 bytes" read as if 0 were allowed; it is not here
                    raise PlatformError(_NOT_POSITIVE.format(self.memory)) from None
                # e names the value already: "invalid memory: cannot read 'lots' as a size"
                raise PlatformError(f"invalid memory: {e}") from e
        if not (isinstance(mem, float) and math.isinf(mem)):
            if mem == 0 and not is_int(self.memory) and parse_bytes(self.memory) > 0:
                # 0 < memory < 1 byte: "must be > 0 bytes, got 0.9" contradicted itself
                raise PlatformError(f"memory {self.memory!r} rounds down to 0 bytes (a budget "
                                    "counts whole bytes, never more than given); give at "
                                    "least 1 byte, e.g. '12GiB'")
            if mem <= 0:
                raise PlatformError(_NOT_POSITIVE.format(self.memory))
            if mem >= MAX_BYTES:
                mem = math.inf   # 4 EiB and more: no schedule comes near it
        try:
            bw = parse_bandwidth(self.bandwidth)
        except UnitError as e:
            raise PlatformError(f"invalid bandwidth {self.bandwidth!r}: {e}") from e
        if self.channel not in CHANNELS:
            raise PlatformError(f"channel must be one of {CHANNELS}, got {self.channel!r}")
        object.__setattr__(self, "memory", mem)
        object.__setattr__(self, "bandwidth", bw)

    @property
    def memory_limit(self) -> int:
        """Memory limit as an int64-safe integer (``2**62`` stands for unlimited)."""
        return MAX_BYTES if math.isinf(self.memory) else int(self.memory)

    def __str__(self) -> str:
        memory = ("unlimited" if math.isinf(self.memory) else format_bytes(self.memory))
        if math.isinf(self.bandwidth):
            # "inf shared channel" read as a channel model; say what the model means
            link = "instant transfers (infinite bandwidth)"
        else:
            link = f"{format_bandwidth(self.bandwidth)} {self.channel} channel"
        return f"{memory} device memory, {link}"
