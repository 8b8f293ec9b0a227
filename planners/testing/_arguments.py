"""Argument checks of the strategies of ``rtmem.planners.testing``, run when a
strategy function is called (not at its first draw), raising
:class:`StrategyArgumentError`."""

from __future__ import annotations

from rtmem._optional import require
from rtmem.errors import RtmemError

from . import _HYPOTHESIS_MISSING

require("hypothesis", _HYPOTHESIS_MISSING)   # before the import that fails bare

from hypothesis.errors import InvalidArgument  # noqa: E402

from .._validation import check_flags as _check_flags  # noqa: E402
from .._validation import is_int  # noqa: E402


class StrategyArgumentError(RtmemError, InvalidArgument, ValueError):
    """A strategy of ``rtmem.planners.testing`` was called with an invalid
    argument. Hypothesis's own ``InvalidArgument``, which Hypothesis users
    expect for strategy arguments, and a ValueError (what these strategies
    raised before, once at the first draw)."""


def check_range(name: str, lo, hi, hint: str = "") -> tuple[int, int]:
    """``(lo, hi)`` as Python ints, for bounds ``1 <= lo <= hi``: ints or numpy
    integers, as every count of the planners (a bool or a float is refused)."""
    if not (is_int(lo) and is_int(hi)) or lo < 1 or hi < lo:
        raise StrategyArgumentError(
            f"{name}: need integers 1 <= min <= max, got {lo!r}, {hi!r}{hint}")
    return int(lo), int(hi)


def check_flags(what: str, **flags) -> None:
    """Each of ``flags`` True or False (None left to the caller)."""
    try:
        _check_flags(what, **flags)
    except ValueError as exc:
        raise StrategyArgumentError(str(exc)) from None


def public_name(name: str):
    """Decorator (under ``st.composite``, which copies the name): name the
    body of the composite strategy that a public strategy function returns
    after its checks ``name``, so that the strategy's repr is ``name(...)``, the
    call its user wrote (with the checked arguments)."""
    def rename(function):
        function.__name__ = function.__qualname__ = name
        return function
    return rename
