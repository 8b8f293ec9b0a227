"""The versioned JSON documents of chains, schedules and plans: one header check.

Every document is a JSON object with ``format`` (e.g. ``"rtmem.chain"``) and
``version``; readers refuse other formats and versions with their own error type
and a message naming what was found and what is read.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import os

import numpy as np

from rtmem._files import write_text


def is_json_number(value) -> bool:
    """A JSON number as the documents hold it: an int or float (numpy's too); a
    bool, which Python counts as an int, is not one."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_document(d, *, kind: str, fmt: str, version: int, error, required=(),
                   optional=None, lenient: bool = False, **error_kw) -> dict:
    """Validate a decoded document header; return ``d``.

    ``kind`` names the document in messages (``"chain"``), ``error`` is the
    exception type (extra keyword arguments go to it), ``required`` lists keys that
    must be present; with ``optional`` (keys that may be present), any other
    key but ``format`` and ``version`` is refused (a typo). ``lenient=True``
    accepts a missing ``format``/``version`` (hand-written chain files).
    """
    if not isinstance(d, dict):
        raise error(f"a {kind} document must be a JSON object, got {type(d).__name__}",
                    **error_kw)
    if d.get("format", fmt if lenient else None) != fmt:
        raise error(f"not a {kind} document: format is {d.get('format')!r}, expected "
                    f"{fmt!r}", **error_kw)
    found = d.get("version", version if lenient else None)
    # an int: true and 1.0 equal 1 but are no version number
    bad_version = type(found) is not int or found != version

    def refuse_version():
        newer = ("; it was written by a newer rtmem: read it with that one"
                 if type(found) is int and found > version else "")
        raise error(f"{kind} document version {d.get('version')!r} is not supported "
                    f"(this rtmem reads version {version}){newer}", **error_kw)
    # another version number first: that version may name its fields otherwise,
    # and "it lacks the field(s)" sent the user to edit a file this rtmem cannot read
    if bad_version and type(found) is int:
        refuse_version()
    if optional is not None:
        # a typo of an optional key ("inf0") dropped what it held without a word
        known = {"format", "version", *required, *optional}
        unknown = sorted(set(d) - known)
        if unknown:
            raise error(f"unknown {kind} field(s) {unknown}; known fields are "
                        f"{sorted(known)}", **error_kw)
    missing = [k for k in required if k not in d]
    if missing:
        raise error(f"not a {kind} document: it lacks the field(s) {missing}", **error_kw)
    if bad_version:
        refuse_version()
    return d


def parse_document(text, *, kind: str, error, **kwargs) -> dict:
    """``json.loads`` + :func:`check_document`; malformed JSON raises ``error`` too."""
    error_kw = {k: kwargs[k] for k in kwargs if k not in
                ("fmt", "version", "required", "optional", "lenient")}
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise error(f"malformed {kind} JSON: {e}", **error_kw) from e
    except RecursionError:
        # json.loads recurses once per nesting level: "[[[[..." escaped as a traceback
        raise error(f"malformed {kind} JSON: nested too deeply", **error_kw) from None
    return check_document(d, kind=kind, error=error, **kwargs)


def read_text(path, *, kind: str, error, **error_kw) -> str:
    """The UTF-8 text of the ``kind`` document at ``path``; a file that is not
    UTF-8 text raises ``error`` (a missing file raises the usual OSError). A
    leading byte order mark (Windows editors write one) is dropped: it was read
    as part of the first token ("unknown operation '\\ufeffF_all'", a JSON
    schedule parsed as text, "Unexpected UTF-8 BOM" for a chain)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise error(f"{os.fspath(path)!r} is not a {kind} document (not UTF-8 text: "
                    f"{e.reason} at byte {e.start})", **error_kw) from e


@contextlib.contextmanager
def naming_file(path, error):
    """Within the block, an ``error`` raised (a ChainError, a ScheduleError) has
    ``path`` put in front of its message, its type and fields kept: "x[2] = -5
    is negative" did not say which of a command's files holds it."""
    try:
        yield
    except error as e:
        prefix = f"{os.fspath(path)}: "
        if e.args and isinstance(e.args[0], str) and not e.args[0].startswith(prefix):
            e.args = (prefix + e.args[0],) + e.args[1:]
        raise


class JsonFile:
    """``save(path)`` / ``load(path)`` for a document class with ``to_json(indent=)``
    and ``from_json(text)`` (chains and plans). Subclasses name their document
    kind and error class in ``_DOCUMENT``."""

    __slots__ = ()
    _DOCUMENT = ("document", ValueError)

    def save(self, path: str | os.PathLike) -> None:
        """Write the document as JSON to ``path``."""
        write_text(path, self.to_json(indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike):
        """Read a document written by :meth:`save`; an error in it (the
        document's error type, with its fields) names ``path`` first."""
        kind, error = cls._DOCUMENT
        text = read_text(path, kind=kind, error=error)
        with naming_file(path, error):
            return cls.from_json(text)

