"""Plain-text tables for the CLI and the benchmarks (no third-party dependency)."""

from __future__ import annotations

import unicodedata

#: Unicode categories a cell shows as backslash escapes: control characters (a
#: newline or tab split or shifted the row), format characters (zero width,
#: bidirectional overrides), lone surrogates and line/paragraph separators.
_ESCAPED = ("Cc", "Cf", "Cs", "Zl", "Zp")


def _escaped(text: str, encoding: str | None) -> str:
    """``text`` as the table shows it: what does not print as one visible
    character written as Python's backslash escape (``\\n``, ``\\x1b``,
    ``\\u200b``), and, given the ``encoding`` of the stream the table goes to,
    what that encoding cannot write as ``\\uXXXX``, as the CLI's stdout writes it
    (``rtmem.cli._escaping_stdout``), so that the columns are measured on the
    text that is printed."""
    text = "".join(c.encode("unicode_escape").decode("ascii")
                   if unicodedata.category(c) in _ESCAPED else c for c in text)
    if encoding:
        text = text.encode(encoding, "backslashreplace").decode(encoding)
    return text


def _width(text: str) -> int:
    """Terminal columns ``text`` takes: East Asian wide and full-width characters
    take two, combining marks none (an accent written as e + U+0301), others one."""
    return sum(0 if unicodedata.combining(c) or unicodedata.category(c) in ("Mn", "Me")
               else 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1
               for c in text)


def format_table(headers, rows, align=None, encoding: str | None = None) -> str:
    """Render ``rows`` (sequences of cells, converted with ``str``) under ``headers``.

    ``align`` is a string of ``'l'``/``'r'`` per column (default: first column
    left, the others right, which suits name + numbers tables). Columns are
    aligned on the cells' display width (wide characters take two columns);
    control and other invisible characters in a cell are shown as backslash
    escapes, as are, with ``encoding`` (that of the stream the table is written
    to, e.g. ``sys.stdout.encoding``), the characters it cannot write.
    """
    cells = [[_escaped(str(c), encoding) for c in headers]] + \
        [[_escaped(str(c), encoding) for c in row] for row in rows]
    ncol = len(cells[0])
    if any(len(r) != ncol for r in cells):
        raise ValueError("every row needs one cell per header")
    align = align or "l" + "r" * (ncol - 1)
    widths = [max(_width(r[i]) for r in cells) for i in range(ncol)]

    def line(row):
        # str.ljust/rjust count characters, not columns: pad by display width
        return "  ".join(c + " " * (w - _width(c)) if a == "l" else " " * (w - _width(c)) + c
                         for c, w, a in zip(row, widths, align)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])
