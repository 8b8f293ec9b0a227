"""The argument parser of ``rtmem`` and of the ``bench/`` scripts
(:class:`CommandParser`, re-exported by :mod:`rtmem.cli`) and the JSON a
``--json`` command prints when it fails (:func:`error_document`).

Standard library only at module level: ``import rtmem.cli`` and ``rtmem
--help`` must stay fast.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

__all__ = ["USAGE_ERROR", "CommandParser", "error_document"]


#: What argparse must read as a (negative) value rather than as an option: a
#: minus before a digit or ".digit" (``-1MiB``, ``-.5GB/s``), or before inf,
#: infinity or nan, alone (``-inf``; ``-info`` stays an unknown option).
_NEGATIVE_VALUE = re.compile(r"^-(\.?\d|(inf|infinity|nan)$)", re.IGNORECASE)


class _UsageError(SystemExit):
    """argparse's exit on bad usage (an unknown option, a missing argument, a bad
    choice or value): ``code`` is argparse's (2) and ``message`` its message,
    which :meth:`CommandParser.parse_args` also prints as :func:`error_document`
    when ``--json`` was given. A SystemExit, so a caller of ``parse_args`` sees
    what argparse raises."""

    def __init__(self, code, message: str):
        super().__init__(code)
        self.message = message


class CommandParser(argparse.ArgumentParser):
    """The ArgumentParser of ``rtmem`` and of the ``bench/`` scripts (one
    implementation, so both read arguments alike).

    Negative values: a word such as ``-1MiB``, ``-5GB/s`` or ``-inf`` is a value,
    not an option. argparse before Python 3.13 reads only plain negative numbers
    (``-1``, ``-.5``) as values, so ``--memory -1MiB`` failed with "expected one
    argument" instead of rtmem's own "must be > 0 bytes"; :data:`_NEGATIVE_VALUE`
    is the test Python 3.13 uses, plus the words float() reads as a negative
    infinity or a NaN, which Python 3.13 still takes for options (none of the
    options looks like a negative value, which would turn this off; an option of
    that spelling, such as ``-i``, would still win over it).

    Usage errors raise :class:`_UsageError` (a SystemExit with code 2, as
    argparse's), after argparse's usage and message on stderr. When the command
    line asks for ``--json`` and this parser or one of its subcommands has that
    option, :meth:`parse_args` also prints ``{"error": MESSAGE, "kind":
    "UsageError"}`` (:func:`error_document`) on stdout, as every other failure of a ``--json``
    command does: a script reading stdout got nothing to parse. Subcommands'
    parsers are of this class too (``add_subparsers`` makes its parsers of the
    parent's class)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_VALUE

    def error(self, message):
        try:
            super().error(message)      # usage and "PROG: error: MESSAGE" on stderr
        except SystemExit as e:
            raise _UsageError(e.code, message) from None

    def parse_args(self, args=None, namespace=None):
        # (subcommands' parsers are run by parse_known_args: this prints once)
        argv = sys.argv[1:] if args is None else list(args)
        try:
            return super().parse_args(argv, namespace)
        except _UsageError as e:
            if _wants_json(argv) and self._has_json_option():
                print(json.dumps(error_document(e.message), indent=1, allow_nan=False))
            raise

    def _has_json_option(self) -> bool:
        """Whether this parser or a subcommand's takes ``--json`` (a script without
        it names ``--json`` as an unrecognized argument, in words only)."""
        for action in self._actions:
            if "--json" in action.option_strings:
                return True
            if isinstance(action, argparse._SubParsersAction) and any(
                    isinstance(p, CommandParser) and p._has_json_option()
                    for p in action.choices.values()):
                return True
        return False


def _wants_json(argv) -> bool:
    """Whether the command line gives ``--json`` (or an abbreviation argparse
    takes for it, or ``--json=...``) before any ``--``: usage errors are reported
    before the arguments are parsed, so ``args.json`` is not there to ask."""
    for word in argv:
        if word == "--":
            return False
        option = word.partition("=")[0]
        if len(option) > 2 and "--json".startswith(option):
            return True
    return False


#: The ``"kind"`` of :func:`error_document` for bad usage (argparse's errors and
#: a subcommand's own checks of its arguments, exit 2), which raise nothing.
USAGE_ERROR = "UsageError"


def error_document(message: str, error: BaseException | None = None) -> dict:
    """The JSON object a ``--json`` subcommand prints on stdout when it fails:
    ``{"error": message, "kind": KIND}``, KIND the class name of ``error``
    (``"InfeasibleError"``, ``"ScheduleError"``, ``"ChainError"``,
    ``"FileNotFoundError"``, ...), or :data:`USAGE_ERROR` without one (bad
    usage), so a script can tell a budget no plan fits from a mistyped argument
    without matching the message's words; for an :class:`~rtmem.errors.InfeasibleError` also
    ``"infeasible": true``, ``"budget_bytes"`` and ``"min_feasible_bytes"`` (bytes;
    null when unknown or unlimited), the keys of an infeasible plan in ``rtmem
    plan remat --json``'s ``"plans"``; for a :class:`~rtmem.errors.ScheduleError`
    ``"op_index"``, ``"reason"`` and ``"over_bytes"``, as the exception has them."""
    from rtmem.errors import InfeasibleError, ScheduleError

    def finite(value):
        # JSON has no Infinity: an unlimited budget is null, as in `plan --json`
        return None if value is None or not math.isfinite(value) else value
    doc = {"error": message,
           "kind": USAGE_ERROR if error is None else type(error).__name__}
    if isinstance(error, InfeasibleError):
        doc.update(infeasible=True, budget_bytes=finite(error.budget),
                   min_feasible_bytes=finite(error.min_feasible))
    elif isinstance(error, ScheduleError):
        doc.update(op_index=error.op_index, reason=error.reason, over_bytes=error.over_bytes)
    return doc
