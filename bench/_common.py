"""Shared helpers of the benchmark scripts: timing, machine facts, JSON results.

Benchmarks report medians over repeats and ratios against a baseline measured in
the same run; absolute times are only meaningful on the machine that made them.
"""

from __future__ import annotations

import atexit
import copy
import functools
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

#: Where this process wrote results: "writing" the file being written now, if
#: any, "written" the last one written (for the line a stray Ctrl-C prints)
_WRITES = {"writing": None, "written": None}

#: Results files this process wrote (absolute paths): replacing one of them is a
#: run updating its own partial document, not another run's result.
_OWN_FILES: set = set()


def _ctrl_c_line(kind, value, tb, _previous=sys.excepthook):
    """``sys.excepthook`` of a benchmark run as a script: a KeyboardInterrupt
    that no ``except`` caught (Ctrl-C, or bench/gpu_session.sh's time limit,
    during the imports or the final write, outside a script's measuring loop)
    is one line on stderr saying what was written, and exit code 130, as a stop
    a script catches is (:meth:`PartialResults.interrupted`). Anything else
    goes to the previous hook (a traceback)."""
    if not issubclass(kind, KeyboardInterrupt):
        return _previous(kind, value, tb)
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0] or "bench"
    if _WRITES["writing"]:
        what = (f"while writing {_WRITES['writing']}: it holds the earlier document or "
                f"this run's, whole (files are written beside, then renamed over)")
    elif _WRITES["written"]:
        what = f"after writing {_WRITES['written']} (whole)"
    else:
        what = "before any result; nothing written (an earlier result stays)"
    print(f"{name}: interrupted {what}", file=sys.stderr)
    # os._exit below skips what a normal exit runs: run the atexit handlers
    # (logging's flush, a library's trace file) first, once, as Python would.
    try:
        atexit._run_exitfuncs()
    except BaseException:               # a second Ctrl-C, a failing handler
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a reader that went away, a closed stream
            pass
    # After its excepthook Python ends a KeyboardInterrupt by killing itself
    # with SIGINT (status -2 to a parent, 130 in a shell); 130 as an exit code
    # is what every other stop of a benchmark returns. (130 is
    # rtmem.cli.INTERRUPTED_EXIT, not imported yet at the earliest stop.)
    os._exit(130)


# Installed first, before the imports below (rtmem, then the script's own:
# torch takes seconds), and only when a bench/ script is what runs: a test or
# `rtmem bench` importing this module keeps its own handling.
if sys.argv and sys.argv[0] and \
        os.path.dirname(os.path.abspath(sys.argv[0])) == os.path.dirname(RESULTS):
    sys.excepthook = _ctrl_c_line

# the scripts' argparse types and parser, one implementation with the CLI's: -1MiB
# and -inf are values, usage errors are rtmem's
from rtmem.cli import (MAX_REPEATS, MAX_THREADS, CommandParser, at_least,  # noqa: E402,F401
                       count, output_file)
# a benchmark stopped by SIGINT exits as the CLI does (130)
from rtmem.cli import INTERRUPTED_EXIT  # noqa: E402
from rtmem._files import write_text  # noqa: E402  (replaced whole: beside, renamed over)


def gpu_required() -> bool:
    """Whether a GPU benchmark that measured nothing must fail (exit 3): set by
    bench/gpu_session.sh (``RTMEM_REQUIRE_GPU=1``), whose steps report ok/FAILED
    by exit code."""
    return os.environ.get("RTMEM_REQUIRE_GPU") == "1"


def not_measured(reason: str) -> dict:
    """A results section that was not measured, as every benchmark writes it:
    ``{"measured": false, "reason": reason}`` (a measured section carries
    ``"measured": true`` beside its figures). ``reason``: words saying why (no
    GPU, a ``--skip-*`` option, a run stopped before the section finished).

    One spelling for every results file: allocator.json wrote ``{"skipped":
    why}`` where train.json wrote this, so a reader had to know which file it
    held to tell a GPU result from its absence."""
    return {"measured": False, "reason": reason}


def results_dir() -> str:
    """Where results go: ``$RTMEM_BENCH_RESULTS`` when set (a folder), else
    bench/results/."""
    return os.environ.get("RTMEM_BENCH_RESULTS") or RESULTS


def timed(fn) -> float:
    """Wall seconds of one call ``fn()`` with the garbage collector off, as
    ``timeit`` keeps it (a collection that falls due meanwhile runs after the
    call). For code whose own collections are not what is measured (copies
    timed on a GPU, a jitted simulator); :func:`round_robin` keeps the
    collector on instead."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        if enabled:
            gc.enable()


def gc_cost(fn, calls: int, before=lambda: None) -> dict:
    """What the garbage collector costs ``fn()`` over ``calls`` calls after a full
    collection, as a training loop would run it (collector on, nothing else in
    between; ``before()`` ahead of each call): ``{"gc_s_per_call",
    "collections_per_call": [gen0, gen1, gen2]}``. :func:`round_robin` leaves
    out the full (generation 2) collections, which come every several calls
    and cost in proportion to every object the process holds; this puts them
    back, amortized."""
    spent, counts, started = [0.0], [0, 0, 0], [0.0]

    def callback(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - started[0]
            counts[info["generation"]] += 1
    gc.collect()
    gc.callbacks.append(callback)
    try:
        for _ in range(calls):
            before()
            fn()
    finally:
        gc.callbacks.remove(callback)
    return {"gc_s_per_call": spent[0] / calls,
            "collections_per_call": [c / calls for c in counts]}


def repeat_times(fn, repeats: int, warmup: int = 1) -> list:
    """Wall seconds of each of ``repeats`` runs of ``fn()`` (:func:`timed`), after
    ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return [timed(fn) for _ in range(repeats)]


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs (:func:`timed`), seconds."""
    return statistics.median(repeat_times(fn, repeats, warmup))


def time_spread(times) -> dict:
    """``{"median_s", "min_s", "max_s", "times_s"}`` of a list of run times
    (seconds): the median a table quotes, with every run beside it (as adam.json's
    rows and allocator.json's ``*_all`` keys keep them), so that two results can be
    compared with their spread, not by medians alone."""
    times = [float(t) for t in times]
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "times_s": times}


def round_robin(runs: dict, repeats: int, before=lambda: None) -> dict:
    """Wall seconds of ``repeats`` timed calls of each function of ``runs`` (name
    -> function), ``{name: [seconds]}``, after one untimed warm-up call each.
    The calls take turns, one round at a time in ``runs``' order, so a drift of
    the machine during the run (clock, caches, other load) falls on every
    contender alike. ``before()`` runs, untimed, ahead of every call, the
    warm-up included.

    A full garbage collection runs, untimed, before each timed call, and the
    collector stays on during it: each call pays for the collections its own
    allocations make due, from the same start. Without that, since every
    round allocates alike, the collections that all contenders' garbage made
    due fell on the same contender round after round and moved its median
    (the executor bench once read 168 ms for a 44 ms step). Full collections
    are thereby left out; :func:`gc_cost` measures them."""
    for fn in runs.values():
        before()
        fn()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            before()
            gc.collect()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def offload_everything(n: int, grads: bool = True, first: int = 1):
    """Activation offload of an ``n``-stage chain as a
    :class:`~rtmem.planners.Schedule`: F_all every stage; for i = ``first`` ..
    n-1, offload abar_i while stage i runs from it, then delete it, and prefetch
    it before B i (abar_1 .. abar_{first-1} stay on the device); with ``grads``,
    flush each stage's weight gradient (``g_offload``) after its B. About 6
    operations per stage with ``first=1``, full activation offload."""
    from rtmem.planners import Op, Schedule
    ops = [(Op.F_ALL, 0)]
    for i in range(1, n):
        if i >= first:
            ops += [(Op.OFFLOAD, i, 1), (Op.F_ALL, i), (Op.DELETE, i, 1)]
        else:
            ops.append((Op.F_ALL, i))
    ops.append((Op.LOSS, 0))
    for i in reversed(range(n)):
        if i >= max(first, 1):
            ops.append((Op.PREFETCH, i, 1))
        ops.append((Op.B, i))
        if grads:
            ops.append((Op.G_OFFLOAD, i))
    return Schedule.from_ops(ops)


#: The checkout (or unpacked sdist) these scripts belong to.
ROOT = os.path.dirname(os.path.dirname(RESULTS))

#: Seconds one git command may take before :func:`source_revision` gives up on
#: it: a results file is written after each section, and git on a slow or
#: network file system must not hold a benchmark up (the answer is cached).
GIT_TIMEOUT_S = 2.0


@functools.lru_cache(maxsize=None)
def source_revision(root: str = ROOT) -> dict:
    """The git commit the code in ``root`` (default: this checkout) was run
    from: ``{"commit": "<40 hex>", "dirty": bool}``, ``dirty`` when tracked
    files differ from that commit (untracked files are not counted), or
    ``{"commit": None, "reason": why}`` when git is not installed, fails or
    takes over :data:`GIT_TIMEOUT_S` seconds, or ``root`` is not the top of a
    git checkout (an unpacked sdist; a folder inside some other repository,
    whose commit says nothing about this code). Never raises; asked once per
    process and root."""
    def git(*args):
        # --no-optional-locks: status must not write the index under a
        # concurrent git command of the user's
        return subprocess.run(["git", "--no-optional-locks", "-C", root, *args],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=GIT_TIMEOUT_S, check=False)
    try:
        head = git("rev-parse", "--show-toplevel", "HEAD")
        lines = head.stdout.splitlines()
        if head.returncode != 0 or len(lines) != 2:
            why = (head.stderr.strip().splitlines() or ["git rev-parse failed"])[0]
            return {"commit": None, "reason": f"not a git checkout with a commit: {why}"}
        top, commit = lines
        if os.path.realpath(top) != os.path.realpath(root):
            return {"commit": None, "reason": f"{root} is inside the git checkout {top}, "
                                              f"not one of its own"}
        status = git("status", "--porcelain", "--untracked-files=no")
        if status.returncode != 0:
            why = (status.stderr.strip().splitlines() or ["git status failed"])[0]
            return {"commit": commit, "dirty": None, "reason": why}
        return {"commit": commit, "dirty": bool(status.stdout.strip())}
    except subprocess.TimeoutExpired:
        return {"commit": None, "reason": f"git took over {GIT_TIMEOUT_S:g} s"}
    except OSError as e:                # FileNotFoundError: no git on PATH
        return {"commit": None, "reason": f"git did not run: {e}"}


def machine() -> dict:
    """Facts that make a result interpretable: CPU count, Python, library versions
    (rtmem's among them: two runs of different rtmem releases compare the code as
    much as the machine), and ``rtmem_git``, the checkout's commit and whether
    its tracked files were changed (:func:`source_revision`): runs between two
    releases differ by commit only."""
    import numba
    import numpy

    import rtmem
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "cpus": os.cpu_count(), "numpy": numpy.__version__, "numba": numba.__version__,
            "numba_threads": numba.get_num_threads(), "rtmem": rtmem.__version__,
            "rtmem_git": source_revision()}


def command_line(script: str, argv=None, prog=None) -> str:
    """The command that ran a benchmark, as it would be typed again: ``prog``
    (``rtmem bench adam``) or ``python bench/SCRIPT``, then the arguments
    (``argv``; None: this process's ``sys.argv[1:]``), quoted for a shell."""
    words = sys.argv[1:] if argv is None else list(argv)
    return " ".join([prog or f"python bench/{script}", *map(shlex.quote, words)])


def add_out_option(parser, name: str) -> None:
    """``--out PATH`` on a benchmark's ``parser``: where ``name``.json goes
    instead of bench/results or $RTMEM_BENCH_RESULTS. Checked when parsed: a
    folder or an unwritable path met the final write, after the whole run."""
    parser.add_argument("--out", type=output_file(replace=True), default=None,
                        help=f"JSON output path (default: {name}.json in bench/results or "
                             f"$RTMEM_BENCH_RESULTS)")


def write_results(name: str, doc: dict, path=None) -> str:
    """Write ``doc`` plus machine facts and a timestamp as JSON to ``path`` (default
    bench/results/NAME.json); a ``"machine"`` dict in ``doc`` adds to the facts.

    The file is replaced whole (written beside it, then renamed): a partial
    document rewritten after each section must not be left cut short, the
    earlier one lost with it, by a stop that lands during a write."""
    doc = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           **doc, "machine": {**machine(), **doc.get("machine", {})}}
    path = os.fspath(path) if path is not None else \
        os.path.join(results_dir(), f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    text = json.dumps(doc, indent=1) + "\n"
    if os.path.abspath(path) not in _OWN_FILES and os.path.exists(path):
        _say_replaced(name, path)
    _WRITES["writing"] = path
    try:
        write_text(path, text)
    except KeyboardInterrupt:
        raise               # still "writing": the line a stray Ctrl-C prints names it
    except BaseException:
        _WRITES["writing"] = None
        raise
    _WRITES.update(writing=None, written=path)
    _OWN_FILES.add(os.path.abspath(path))
    return path


def _say_replaced(name: str, path: str) -> None:
    """One line on stderr before a run replaces a results file it did not write:
    the earlier run's figures are gone (in a checkout, bench/results/ holds the
    committed ones), and the line says which run that was and how to keep both."""
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        what = f"the result of {old.get('command') or 'an earlier run'}" + \
            (f" at {old['when']}" if old.get("when") else "")
    except (OSError, ValueError, AttributeError):   # unreadable, not JSON, not an object
        what = "a file that is not a benchmark result"
    print(f"{name}: replacing {path}, {what}; to keep both, set RTMEM_BENCH_RESULTS to "
          f"another folder (or give --out where the script takes it)", file=sys.stderr)


class PartialResults:
    """A benchmark's JSON document written again after each finished section (or
    size), so that a run stopped before the end keeps what it measured. On the
    GPU machine bench/gpu_session.sh stops a step that runs past its time with
    SIGINT (``timeout --signal=INT``; Python raises KeyboardInterrupt) and kills
    it 15 s later, and a GPU session is too short to measure a section twice.

    A document written here carries ``"partial": true``; the complete one goes
    through :func:`write_results`, as it always did, without it. Each section is
    put into the document whole, once measured, so a partial document holds
    finished sections only.
    """

    def __init__(self, name: str, path=None):
        """``name`` and ``path`` as :func:`write_results` takes them."""
        self.name, self.path = name, path
        #: the document last written (None before the first :meth:`save`)
        self.doc = None

    def save(self, doc: dict, **why) -> str:
        """Write ``doc`` marked ``"partial": true``, with the entries of ``why``
        added (``error=``: why the run ended early); returns the path.

        The document is kept as a deep copy taken now: a script passes its live
        containers (pcie's ``curves``, appended to path by path) and goes on
        filling them, and :meth:`interrupted` must rewrite what was saved, not
        the half-measured size that the interrupt cut short."""
        self.doc = copy.deepcopy({**doc, "partial": True, **why})
        return write_results(self.name, self.doc, self.path)

    def interrupted(self, during: str) -> int:
        """After a KeyboardInterrupt while measuring ``during`` (words, e.g.
        "size 1e8"): rewrite the last saved document with ``"interrupted":
        during``, or, when nothing was saved yet, write nothing (a result of an
        earlier run stays); say which in one line on stderr, instead of a
        traceback; return :data:`INTERRUPTED_EXIT`."""
        if self.doc is None:
            print(f"{self.name}: interrupted during {during}, before any section "
                  f"finished; nothing written", file=sys.stderr)
        else:
            path = self.save(self.doc, interrupted=during)
            print(f"{self.name}: interrupted during {during}; what was measured before "
                  f"is in {path} (marked partial)", file=sys.stderr)
        return INTERRUPTED_EXIT
