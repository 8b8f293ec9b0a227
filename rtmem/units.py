"""Human-readable sizes, bandwidths and durations.

``parse_bytes("12GiB")``, ``parse_bandwidth("12 GB/s")`` and their ``format_*``
counterparts. Decimal prefixes (kB, MB, GB, TB) are powers of 1000 and binary
prefixes (KiB, MiB, GiB, TiB) powers of 1024, as in IEC 80000-13; a bare number is
bytes (or bytes/s, or seconds). Leaf module: imports nothing from rtmem but errors.
"""

from __future__ import annotations

import math
import numbers
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
_INTEGER_RE = re.compile(r"^[+-]?[0-9]+$")
# The same texts read without case, for the suggestion of a refused one: the
# prefix, the space after it and the unit as written.
_SIZE_ANYCASE_RE = re.compile(r"^\s*(" + _NUMBER[1:-1] + r"\s*)([kmgtp]i?)(\s*)(b|bytes?)?\s*$",
                              re.IGNORECASE)
_BW_ANYCASE_RE = re.compile(r"^\s*(" + _NUMBER[1:-1] + r"\s*)([kmgtp]i?)?(\s*)(b/s|bps|bytes?/s)"
                            r"?\s*$", re.IGNORECASE)
_TIME_RE = re.compile(r"^\s*" + _NUMBER + r"\s*(s|ms|us|µs|ns|min|h)?\s*$")
_TIME_UNIT = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9,
              "min": 60.0, "h": 3600.0}
_INF = {"inf", "infinity", "unlimited", "∞"}
# what float() reads as an infinity or a NaN, with our words for infinity: these
# are read values out of range, not unreadable text ("-inf" said "cannot read
# '-inf' as a bandwidth; write it like ... 'inf'", while the float -inf got
# "must be > 0 bytes/s")
_SPECIAL_RE = re.compile(r"^\s*([+-]?)\s*(" + "|".join(sorted(_INF | {"nan"})) + r")\s*$",
                         re.IGNORECASE)


def _special(text: str):
    """The float ``text`` names when it is a signed or unsigned infinity word
    (:data:`_INF`) or NaN, else None."""
    m = _SPECIAL_RE.match(text)
    if m is None:
        return None
    if m.group(2).lower() == "nan":
        return math.nan
    return -math.inf if m.group(1) == "-" else math.inf


def _is_bool(value) -> bool:
    """A Python, numpy or torch bool (``np.True_``, a 0-d bool array or tensor):
    no numbers.Integral is numpy's or torch's, yet ``int()`` takes it."""
    if isinstance(value, bool):
        return True
    dtype = getattr(value, "dtype", None)
    # torch's dtype has no .kind; named so that this module needs no torch
    return getattr(dtype, "kind", None) == "b" or str(dtype) == "torch.bool"


def _is_array(value) -> bool:
    """An array or tensor of one or more dimensions, even of one element: a size
    given as ``np.array([4096])`` or ``torch.tensor([4096])`` is almost surely a
    mistake (0-d arrays and tensors are scalars and pass)."""
    return bool(getattr(value, "ndim", 0))


def is_whole(value) -> bool:
    """An int, numpy integer or whole float (``4.0``), or a 0-d array or tensor
    of one, not a bool (numpy's included); False for what ``int()`` refuses (nan
    and inf raise its bare ValueError / OverflowError) and for arrays of one or
    more dimensions."""
    if _is_array(value):
        # int() takes torch.tensor([8]) (and numpy before 2.x np.array([8])):
        # plan_layout(alignment=torch.tensor([8])) laid out with alignment 8,
        # where np.array([8]) was refused
        return False
    try:
        # numpy's bool passed as 1: plan_layout(alignment=np.True_) laid out with
        # alignment 1 where alignment=True is refused. bool(): a 0-d tensor's ==
        # is a tensor
        return not _is_bool(value) and bool(int(value) == value)
    except (TypeError, ValueError, OverflowError):
        return False


def _number(value, what, example):
    if _is_array(value):
        # float() takes torch.tensor([4096]) (numpy 2 refuses np.array([4096])):
        # alloc(torch.tensor([4096])) allocated 4096 bytes where the array was refused
        raise UnitError(f"{what} must be one number or a string like {example!r}, got an "
                        f"array of shape {tuple(value.shape)}: {value!r}; pass a scalar "
                        "(a 0-d array, or x.item())")
    # numpy's bool (np.True_, a 0-d bool array) is no numbers.Integral and went
    # through float(): alloc(np.True_) allocated 1 byte where alloc(True) is refused.
    if _is_bool(value):
        raise UnitError(f"{what} must be a number or a string like {example!r}, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        # An int beyond float's range (10**400) raised a bare OverflowError: it
        # is a finite number too large for a float, so it reads as infinite.
        return math.inf if value > 0 else -math.inf
    except (TypeError, ValueError):
        raise UnitError(f"{what} must be a number or a string like {example!r}, got "
                        f"{value!r}") from None


def _case_hint(text: str, anycase: re.Pattern, strict: re.Pattern, per: str) -> str:
    """For a size or bandwidth refused only for its letters' case (``800mb``,
    ``1.5gib``, ``12 gb/s``): the sentence saying that case matters and the
    spelling it then means (read by ``strict``), else "". Read without case,
    the prefix is one of k, M, G, T, P (Ki, Mi, ... with i) and b is B; ``per``
    is "/s" for a bandwidth, where a lowercase b is said to be read as bytes."""
    m = anycase.match(text)
    if m is None or not (m.group(2) or m.group(4)):
        return ""
    number, prefix, space, unit = m.group(1), m.group(2) or "", m.group(3), m.group(4) or ""
    if prefix:
        prefix = "k" if prefix.lower() == "k" else prefix[0].upper() + prefix[1:].lower()
    if unit.lower().startswith("byte"):
        unit = unit.lower()
    elif unit:
        unit = "B" + unit[1:].lower()
    meant = f"{number}{prefix}{space}{unit}"
    if strict.match(meant) is None:
        return ""
    bits = (" (bytes per second: divide a bit rate by 8)"
            if per and unit and m.group(4)[0] == "b" and not unit.startswith("byte") else "")
    return (f"unit letters are case-sensitive (m would be milli, b bits): did you mean "
            f"{meant!r}{bits}? ")


def parse_bytes(value, *, round_down: bool = False) -> int:
    """Parse a size into bytes (an ``int``).

    Accepts numbers (bytes) and strings such as ``"512"``, ``"4 KiB"``, ``"1.5GB"``,
    ``"12GiB"``. Fractional byte counts are rounded up (what a request needs), or
    down with ``round_down`` (what a budget allows). Raises :class:`UnitError`
    for anything else, including negative or non-finite values.
    """
    special = _special(value) if isinstance(value, str) else None
    if special is not None:
        nbytes = special
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None or (m.group(2) and m.group(2) not in _PREFIX):
            raise UnitError(f"cannot read {value!r} as a size; "
                            + _case_hint(value, _SIZE_ANYCASE_RE, _SIZE_RE, "")
                            + "write it like '4096', '512 MiB' or '12GiB'")
        number, scale = m.group(1), _PREFIX[m.group(2) or ""]
        if _INTEGER_RE.match(number) and len(number) <= 40:
            # exact: through a float, "9007199254740993" became ...992 bytes
            # (longer digit strings go on through float: beyond any memory size)
            nbytes = int(number) * scale
        else:
            nbytes = float(number) * scale
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        # exact, as above: parse_bytes(2**53 + 1) gave 2**53 (and 10**400 an
        # OverflowError instead of a UnitError)
        nbytes = int(value)
    else:
        nbytes = _number(value, "a size", "12GiB")
    if nbytes < 0 or not (isinstance(nbytes, int) or math.isfinite(nbytes)):
        raise UnitError(f"a size must be finite and >= 0 bytes, got {value!r}")
    if isinstance(nbytes, int):
        return nbytes
    return int(math.floor(nbytes) if round_down else math.ceil(nbytes))


def parse_bandwidth(value) -> float:
    """Parse a bandwidth into bytes/s (a ``float``, possibly ``inf``).

    Accepts numbers (bytes/s) and strings such as ``"12 GB/s"``, ``"16GiB/s"``,
    ``"inf"`` (or ``"+inf"``, ``"unlimited"``). Raises :class:`UnitError` for
    anything else, and, naming the range, for values <= 0 or NaN (``"-inf"``,
    ``"nan"`` included).
    """
    special = _special(value) if isinstance(value, str) else None
    if special is not None:
        bw = special
    elif isinstance(value, str):
        m = _BW_RE.match(value)
        if m is None or (m.group(2) and m.group(2) not in _PREFIX):
            raise UnitError(f"cannot read {value!r} as a bandwidth; "
                            + _case_hint(value, _BW_ANYCASE_RE, _BW_RE, "/s")
                            + "write it like '12 GB/s', '16GiB/s' or 'inf'")
        bw = float(m.group(1)) * _PREFIX[m.group(2) or ""]
    else:
        bw = _number(value, "a bandwidth", "12 GB/s")
    if math.isnan(bw) or bw <= 0:
        raise UnitError(f"a bandwidth must be > 0 bytes/s, got {value!r}")
    return bw


def parse_seconds(value) -> float:
    """Parse a duration into seconds: ``"3 ms"``, ``"1.5"``, ``"20us"``."""
    special = _special(value) if isinstance(value, str) else None
    if special is not None:
        secs = special
    elif isinstance(value, str):
        m = _TIME_RE.match(value)
        if m is None:
            raise UnitError(f"cannot read {value!r} as a duration; write it like '3 ms' or '1.5s'")
        secs = float(m.group(1)) * _TIME_UNIT[m.group(2)]
    else:
        secs = _number(value, "a duration", "3 ms")
    if not math.isfinite(secs) or secs < 0:
        raise UnitError(f"a duration must be finite and >= 0 seconds, got {value!r}")
    return secs + 0.0           # "-0" is 0.0, not -0.0 (printed "-0.0 ns")


def format_bytes(nbytes, binary: bool = True) -> str:
    """Format a byte count, e.g. ``12884901888 -> '12.00 GiB'``."""
    nbytes = float(nbytes)
    if not math.isfinite(nbytes):
        return str(nbytes)      # "inf", "-inf", "nan" (-inf said "inf", nan "nan PiB")
    base, units = (1024.0, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]) if binary else \
        (1000.0, ["B", "kB", "MB", "GB", "TB", "PB"])
    value, unit = nbytes, units[0]
    for unit in units:
        # compare what is printed: 1048575 B is 1023.999 KiB, printed "1024.00 KiB"
        if abs(round(value, 2)) < base or unit == units[-1]:
            break
        value /= base
    return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"


def format_bandwidth(bytes_per_s) -> str:
    """Format a bandwidth in decimal units, e.g. ``12e9 -> '12.00 GB/s'``."""
    text = format_bytes(bytes_per_s, binary=False)
    # "inf", "-inf" and "nan" have no unit; the rest ends in B (below 1000 B/s
    # too, where a rounded 999.999 now reads "1.00 kB")
    return text if not math.isfinite(float(bytes_per_s)) else text + "/s"


def format_seconds(secs) -> str:
    """Format a duration with a unit that keeps 3-4 significant digits."""
    secs = float(secs) + 0.0    # -0.0 printed "-0.0 ns"
    if not math.isfinite(secs):
        return str(secs)        # "inf", "-inf", "nan" (-inf said "inf", nan "nan ns")
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        # compare what is printed: 0.9999999 s was "1000.000 ms"
        if abs(round(secs / scale, 3)) >= 1:
            return f"{secs / scale:.3f} {unit}"
    return f"{secs * 1e9:.1f} ns"
