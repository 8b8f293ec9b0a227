"""Human-readable sizes, bandwidths and durations.

``parse_bytes("12GiB")``, ``parse_bandwidth("12 GB/s")`` and their ``format_*``
counterparts. Decimal prefixes (kB, MB, GB, TB) are powers of 1000 and binary
prefixes (KiB, MiB, GiB, TiB) powers of 1024, as in IEC 80000-13; a bare number is
bytes (or bytes/s, or seconds). Leaf module: imports nothing from rtmem but errors.
"""

from __future__ import annotations

import math
import re

from rtmem.errors import UnitError

__all__ = ["parse_bytes", "parse_bandwidth", "parse_seconds",
           "format_bytes", "format_bandwidth", "format_seconds"]

_PREFIX = {
    "": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "Ki": 2**10, "KI": 2**10, "ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
}
# A sign is read so that "-5GiB" is refused for being negative, not as unreadable.
_NUMBER = r"([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_SIZE_RE = re.compile(r"^\s*" + _NUMBER + r"\s*([kKMGTP]i?)?\s*(B|bytes?)?\s*$")
_BW_RE = re.compile(r"^\s*" + _NUMBER + r"\s*([kKMGTP]i?)?\s*(B/s|Bps|bytes?/s)?\s*$")
_TIME_RE = re.compile(r"^\s*" + _NUMBER + r"\s*(s|ms|us|µs|ns|min|h)?\s*$")
_TIME_UNIT = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9,
              "min": 60.0, "h": 3600.0}
_INF = {"inf", "infinity", "unlimited", "∞"}


def _number(value, what):
    if isinstance(value, bool):
        raise UnitError(f"{what} must be a number or a string like '12GiB', got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UnitError(f"{what} must be a number or a string like '12GiB', got "
                        f"{value!r}") from None


def parse_bytes(value, *, round_down: bool = False) -> int:
    """Parse a size into bytes (an ``int``).

    Accepts numbers (bytes) and strings such as ``"512"``, ``"4 KiB"``, ``"1.5GB"``,
    ``"12GiB"``. Fractional byte counts are rounded up (what a request needs), or
    down with ``round_down`` (what a budget allows). Raises :class:`UnitError`
    for anything else, including negative or non-finite values.
    """
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None or (m.group(2) and m.group(2) not in _PREFIX):
            raise UnitError(
                f"cannot read {value!r} as a size; write it like '4096', '512 MiB' or '12GiB'")
        nbytes = float(m.group(1)) * _PREFIX[m.group(2) or ""]
    else:
        nbytes = _number(value, "a size")
    if not math.isfinite(nbytes) or nbytes < 0:
        raise UnitError(f"a size must be finite and >= 0 bytes, got {value!r}")
    return int(math.floor(nbytes) if round_down else math.ceil(nbytes))


def parse_bandwidth(value) -> float:
    """Parse a bandwidth into bytes/s (a ``float``, possibly ``inf``).

    Accepts numbers (bytes/s) and strings such as ``"12 GB/s"``, ``"16GiB/s"``,
    ``"inf"``. Raises :class:`UnitError` for anything else or for values <= 0.
    """
    if isinstance(value, str):
        if value.strip().lower() in _INF:
            return math.inf
        m = _BW_RE.match(value)
        if m is None or (m.group(2) and m.group(2) not in _PREFIX):
            raise UnitError(
                f"cannot read {value!r} as a bandwidth; write it like '12 GB/s', "
                "'16GiB/s' or 'inf'")
        bw = float(m.group(1)) * _PREFIX[m.group(2) or ""]
    else:
        bw = _number(value, "a bandwidth")
    if math.isnan(bw) or bw <= 0:
        raise UnitError(f"a bandwidth must be > 0 bytes/s, got {value!r}")
    return bw


def parse_seconds(value) -> float:
    """Parse a duration into seconds: ``"3 ms"``, ``"1.5"``, ``"20us"``."""
    if isinstance(value, str):
        m = _TIME_RE.match(value)
        if m is None:
            raise UnitError(f"cannot read {value!r} as a duration; write it like '3 ms' or '1.5s'")
        secs = float(m.group(1)) * _TIME_UNIT[m.group(2)]
    else:
        secs = _number(value, "a duration")
    if not math.isfinite(secs) or secs < 0:
        raise UnitError(f"a duration must be finite and >= 0 seconds, got {value!r}")
    return secs


def format_bytes(nbytes, binary: bool = True) -> str:
    """Format a byte count, e.g. ``12884901888 -> '12.00 GiB'``."""
    nbytes = float(nbytes)
    if math.isinf(nbytes):
        return "inf"
    base, units = (1024.0, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]) if binary else \
        (1000.0, ["B", "kB", "MB", "GB", "TB", "PB"])
    value, unit = nbytes, units[0]
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            break
        value /= base
    return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"


def format_bandwidth(bytes_per_s) -> str:
    """Format a bandwidth in decimal units, e.g. ``12e9 -> '12.00 GB/s'``."""
    if math.isinf(bytes_per_s):
        return "inf"
    return format_bytes(bytes_per_s, binary=False).replace(" B", " B/s", 1) \
        if bytes_per_s < 1000 else format_bytes(bytes_per_s, binary=False) + "/s"


def format_seconds(secs) -> str:
    """Format a duration with a unit that keeps 3-4 significant digits."""
    secs = float(secs)
    if math.isinf(secs):
        return "inf"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(secs) >= scale:
            return f"{secs / scale:.3f} {unit}"
    return f"{secs * 1e9:.1f} ns"
