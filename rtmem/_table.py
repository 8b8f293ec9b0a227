"""Plain-text tables for the CLI and the benchmarks (no third-party dependency)."""

from __future__ import annotations


def format_table(headers, rows, align=None) -> str:
    """Render ``rows`` (sequences of cells, converted with ``str``) under ``headers``.

    ``align`` is a string of ``'l'``/``'r'`` per column (default: first column
    left, the others right, which suits name + numbers tables).
    """
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    ncol = len(cells[0])
    if any(len(r) != ncol for r in cells):
        raise ValueError("every row needs one cell per header")
    align = align or "l" + "r" * (ncol - 1)
    widths = [max(len(r[i]) for r in cells) for i in range(ncol)]

    def line(row):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                         for c, w, a in zip(row, widths, align)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])
