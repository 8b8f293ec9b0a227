"""Shared helpers of the benchmark scripts: timing, machine facts, JSON results.

Benchmarks report medians over repeats and ratios against a baseline measured in
the same run; absolute times are only meaningful on the machine that made them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def results_dir() -> str:
    """Where results go: ``$RTMEM_BENCH_RESULTS`` when set (a folder), else
    bench/results/."""
    return os.environ.get("RTMEM_BENCH_RESULTS") or RESULTS


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def round_robin(runs: dict, repeats: int, before=lambda: None) -> dict:
    """Wall seconds of ``repeats`` timed calls of each function of ``runs`` (name
    -> function), ``{name: [seconds]}``, after one untimed warm-up call each.
    The calls take turns, one round at a time in ``runs``' order, so a drift of
    the machine during the run (clock, caches, other load) falls on every
    contender alike. ``before()`` runs, untimed, ahead of every call, the
    warm-up included."""
    for fn in runs.values():
        before()
        fn()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            before()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def machine() -> dict:
    """Facts that make a result interpretable: CPU count, Python, library versions."""
    import numba
    import numpy
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "cpus": os.cpu_count(), "numpy": numpy.__version__, "numba": numba.__version__,
            "numba_threads": numba.get_num_threads()}


def write_results(name: str, doc: dict, path=None) -> str:
    """Write ``doc`` plus machine facts and a timestamp as JSON to ``path`` (default
    bench/results/NAME.json); a ``"machine"`` dict in ``doc`` adds to the facts."""
    doc = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           **doc, "machine": {**machine(), **doc.get("machine", {})}}
    path = os.fspath(path) if path is not None else \
        os.path.join(results_dir(), f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return path
