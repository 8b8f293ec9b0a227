"""Allocation traces read back and replayed: :func:`load_trace` parses the
JSON lines a :class:`~rtmem.adaptors.TracingAdaptor` writes (its docstring
defines the record format), :func:`replay` runs them against any allocator and
returns a :class:`ReplayResult` (pairs per second, peak live bytes, extent).

Public through :mod:`rtmem.adaptors`, which re-exports all three and is their
home for pickles and ``help()``; this module needs no adaptor (benchmarks
replay a trace against baselines that are not rtmem allocators).
"""

from __future__ import annotations

import io
import json
import os
import time
from dataclasses import dataclass

from .errors import OutOfMemoryError, TraceError

__all__ = ["ReplayResult", "load_trace", "replay"]

_TRACE_OPS = ("alloc", "free", "resize")


def load_trace(source) -> list[tuple]:
    """Read a JSON-lines trace (path, text file, or iterable of dicts/lines) into
    ``(op, id, nbytes, stream)`` tuples; ``oom`` records are skipped. A malformed
    record raises :class:`~rtmem.errors.TraceError` naming its line."""
    if source is None or isinstance(source, (bytes, int, float)):
        raise TypeError(f"load_trace reads a path, a text file or an iterable of "
                        f"records, got {source!r}")
    if isinstance(source, (str, os.PathLike)):
        with open(source, encoding="utf-8") as f:
            try:
                return load_trace(f)
            except UnicodeDecodeError as exc:
                # a binary file is a malformed trace, not a codec traceback
                raise TraceError(f"{os.fspath(source)!r} is not a text trace ({exc}); "
                                 f"pass a JSON-lines file written by TracingAdaptor"
                                 ) from None
    out = []
    for line, rec in enumerate(source, 1):
        if isinstance(rec, str):
            if not rec.strip():
                continue
            try:
                rec = json.loads(rec)
            except (json.JSONDecodeError, RecursionError) as exc:
                # RecursionError: deeply nested brackets ([[[[...) escaped raw
                raise TraceError(f"trace line {line} is not JSON "
                                 f"({getattr(exc, 'msg', 'nested too deeply')}): "
                                 f"{rec.strip()[:80]!r}; a truncated file? Each line must "
                                 f"be one record written by TracingAdaptor",
                                 line=line) from None
        if not isinstance(rec, dict):
            raise TraceError(f"trace record {line} is a {type(rec).__name__}, not an "
                             f"object with op/id/nbytes/stream", line=line)
        op = rec.get("op")
        if op == "oom":
            continue
        if op not in _TRACE_OPS:
            raise TraceError(f"trace record {line} has op {op!r}; expected one of "
                             f"{', '.join(_TRACE_OPS)} or oom", line=line)
        # JSON true is a Python bool, an int: it was taken as id 1 or 1 byte (and
        # the core refused it at replay with a bare TypeError). An alloc or resize
        # with no nbytes is malformed too (it replayed as 0 bytes).
        bid, nbytes, stream = rec.get("id"), rec.get("nbytes", 0 if op == "free" else None), \
            rec.get("stream")
        if not _is_int(bid) or not _is_int(nbytes) or nbytes < 0:
            raise TraceError(f"trace record {line} ({op}) needs an integer id and "
                             f"nbytes >= 0, got id={bid!r} nbytes={nbytes!r}", line=line)
        if stream is not None and not _is_int(stream):
            raise TraceError(f"trace record {line} ({op}) has stream {stream!r}; a stream "
                             f"is an integer (its number in the trace) or null", line=line)
        out.append((op, bid, nbytes, stream))
    return out


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ReplayResult:
    """Outcome of :func:`replay`.

    ``pairs``: alloc+free pairs run; ``seconds``: wall time of the loop (s);
    ``peak_live_bytes``: highest sum of requested bytes live; ``extent_bytes``
    (when measured): highest end offset of any block, summed over slabs - the
    slab size the trace really needed; ``ooms``: allocations refused.
    """

    pairs: int
    seconds: float
    peak_live_bytes: int
    extent_bytes: int | None
    ooms: int

    @property
    def pairs_per_second(self) -> float:
        """Alloc+free pairs per second."""
        return self.pairs / self.seconds if self.seconds > 0 else float("inf")


def replay(trace, allocator, *, measure_extent: bool = False,
           free_leftovers: bool = True) -> ReplayResult:
    """Run a trace (from :func:`load_trace`, a path, or tuples) against ``allocator``.

    Any object with ``allocate(nbytes, stream)`` and ``deallocate(block)`` works
    (the naive baseline of ``bench/allocator.py`` too). Streams are replayed as
    their integer ids. ``measure_extent`` tracks block ends (needs ``offset``,
    ``size`` and ``slab`` on blocks; slows the loop). Leftover live blocks are
    freed at the end unless ``free_leftovers`` is False, and always when the
    replay raises. A refused allocation or resize counts in ``ooms`` (a refused
    resize leaves its block as it was); an allocator without ``resize`` replays
    one as allocate-then-free.
    """
    if isinstance(trace, (str, os.PathLike, io.IOBase)):
        trace = load_trace(trace)
    live = {}
    alloc, dealloc = allocator.allocate, allocator.deallocate
    resize = getattr(allocator, "resize", None)
    if resize is None:
        def resize(block, nbytes, stream):
            new = alloc(nbytes, stream)
            dealloc(block)
            return new
    ends = {}
    try:
        t0 = time.perf_counter()
        pairs, ooms, peak = _replay_loop(trace, live, alloc, dealloc, resize, ends,
                                         measure_extent)
        seconds = time.perf_counter() - t0
    except BaseException:
        free_leftovers = True       # a failed replay never leaks its blocks
        raise
    finally:
        if free_leftovers:
            for block, _ in live.values():
                dealloc(block)
    return ReplayResult(pairs, seconds, peak,
                        sum(ends.values()) if measure_extent else None, ooms)


def _replay_loop(trace, live, alloc, dealloc, resize, ends, measure_extent):
    """The timed loop of :func:`replay`; returns (pairs, ooms, peak live bytes)."""
    pairs = ooms = cur = peak = 0
    for k, rec in enumerate(trace, 1):
        try:
            op, bid, nbytes, stream = rec
        except (TypeError, ValueError):
            raise TraceError(f"trace record {k} is {repr(rec)[:80]}, not an (op, id, nbytes, "
                             f"stream) tuple; read trace files and JSON records with "
                             f"load_trace", line=k) from None
        if op == "alloc":
            if bid in live:
                # Overwriting the entry lost its block for good: never freed, even
                # by free_leftovers, and counted twice in the live bytes.
                raise TraceError(f"trace record {k} allocates id {bid!r}, which is still "
                                 f"live (no free since its alloc); ids of live blocks "
                                 f"must be unique", line=k)
            try:
                block = alloc(nbytes, stream)
            except OutOfMemoryError:
                ooms += 1
                continue
            live[bid] = (block, nbytes)
            cur += nbytes
            if cur > peak:
                peak = cur
            if measure_extent:
                end = block.offset + block.size
                if end > ends.get(block.slab, 0):
                    ends[block.slab] = end
        elif op == "free":
            entry = live.pop(bid, None)
            if entry is not None:
                dealloc(entry[0])
                cur -= entry[1]
                pairs += 1
                # drop the loop's own references too: a pool that reclaims a
                # block when its last reference goes (CuPy's) must get it now
                entry = block = None
        elif op == "resize":
            if bid not in live:
                continue
            block, old = live[bid]
            try:
                block = resize(block, nbytes, stream)
            except OutOfMemoryError:
                ooms += 1
                continue
            live[bid] = (block, nbytes)
            cur += nbytes - old
            peak = max(peak, cur)
            if measure_extent:
                ends[block.slab] = max(ends.get(block.slab, 0), block.offset + block.size)
        elif op != "oom":
            # e.g. a dict record, which unpacked into its keys: a silent no-op
            raise TraceError(f"trace record {k} has op {op!r}; expected one of "
                             f"{', '.join(_TRACE_OPS)} (read trace files and JSON records "
                             f"with load_trace)", line=k)
    return pairs, ooms, peak
