"""PCIe and direct-host-access (DHA) microbenchmarks (MemFerry notes §9.1, B1-B4).

For buffer sizes from 4 KiB to 1 GiB (powers of two) it measures, on one GPU:

* ``h2d_pageable`` / ``d2h_pageable``: cudaMemcpyAsync from/to ordinary (pageable)
  numpy memory (the driver stages it through its own pinned buffer);
* ``h2d_pinned`` / ``d2h_pinned``: cudaMemcpyAsync from/to pinned memory (B1);
* ``bidir_pinned``: an H2D and a D2H copy of the same size at once on two
  streams (bandwidth = both sizes over the time until both are done);
* ``dha_read`` / ``dha_write``: the rtmem.kernels.dha streaming kernels on
  mapped host memory (B2, B3), and ``hbm_read`` as the on-device reference;

then, at one large size, DHA read while an H2D or a D2H copy runs (B4: each
one's throughput alone and together) and the latency of small transfers.

Bandwidths are bytes/s (decimal GB/s in the table), median over ``--repeats``
runs timed with CUDA events, each run queued behind a short GPU delay so that
the events bracket device time, not the Python launch path (pageable copies:
host wall clock around the copy and a stream synchronize, since the driver's
staging happens on the host). The kernel paths flush L2 before each run. Writes
``bench/results/pcie.json`` (or ``$RTMEM_BENCH_RESULTS/pcie.json``) and a plot
with one curve per path; the JSON also after each size, marked ``"partial":
true``, so that a run stopped by SIGINT (bench/gpu_session.sh's time limit)
keeps the sizes it finished (it then exits with code 130). Without a GPU it
says so and writes nothing.

    python bench/pcie.py [--quick] [--max-size 1GiB] [--repeats 5] [--plot PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (MAX_REPEATS, CommandParser, PartialResults, command_line,  # noqa: E402
                     count, gpu_required, median_time, write_results)

from rtmem._files import replace_with  # noqa: E402
from rtmem._table import format_table  # noqa: E402
from rtmem.cli import PLOT_SUFFIXES, output_file  # noqa: E402
from rtmem.errors import UnitError  # noqa: E402
from rtmem.units import format_bytes, parse_bytes  # noqa: E402

#: cudaEventElapsedTime resolves about 0.5 us; shorter intervals can read as 0.0 ms.
EVENT_RESOLUTION_S = 0.5e-6

PATHS = ("h2d_pageable", "d2h_pageable", "h2d_pinned", "d2h_pinned", "bidir_pinned",
         "dha_read", "dha_write", "hbm_read")
LATENCY_SIZES = (4, 64, 512, 4096)
MIN_SIZE = 4096            # smallest swept size; the latency probes need this much too


def find_gpu() -> tuple[str | None, str]:
    """(device name, "") when a real CUDA GPU and CuPy are usable, else (None, why).

    The CUDA simulator does not count: its timings are meaningless.
    """
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return None, "NUMBA_ENABLE_CUDASIM=1: the CUDA simulator has no timings"
    try:
        import cupy
    except ImportError:
        return None, "CuPy is not installed; pip install 'rtmem[cuda12]'"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "the CUDA runtime reports 0 devices"
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    except Exception as e:  # noqa: BLE001 - any runtime failure means no usable GPU
        return None, f"the CUDA runtime failed: {e}"
    return (name.decode() if isinstance(name, bytes) else str(name)), ""


def no_gpu_exit(what: str, why: str) -> int:
    """The exit of a GPU benchmark on a machine without one: code 0 (a clean
    "nothing to do"), or 3 when ``RTMEM_REQUIRE_GPU=1`` (a GPU session, which
    must not report success for a run that measured nothing)."""
    # a diagnostic, not a result: stdout stays for what was measured
    print(f"{what}: no CUDA GPU found ({why}); nothing measured, nothing written.",
          file=sys.stderr)
    return 3 if gpu_required() else 0


def elapsed_s(cp, start, end) -> float:
    """Seconds between two completed CUDA events, at least the timer's resolution:
    an interval below it reads as 0.0 ms, and a bandwidth of n / 0 would end the
    whole run with a ZeroDivisionError."""
    return max(cp.cuda.get_elapsed_time(start, end) * 1e-3, EVENT_RESOLUTION_S)


class Timer:
    """Median device time of a stream-ordered operation, measured with CUDA events.

    Each timed run is queued behind :func:`~rtmem.kernels.dha.gpu_delay` on the
    same stream, so the GPU reaches the start event only once the host has queued
    the start event, the work and the end event: the events bracket device time,
    not the Python launch path (tens of microseconds per numba launch, which
    would swamp short kernels). The delay starts at ``MIN_DELAY_S`` and doubles
    whenever the start event had already passed when the host finished queueing
    (the GPU may then have idled waiting for the launch); that run is repeated.
    """

    MIN_DELAY_S, MAX_DELAY_S = 1e-3, 0.25

    def __init__(self, cupy, repeats: int, delay=None):
        """``delay``: the :attr:`delay` of a Timer that ran :meth:`check_delay`,
        so that timers made later need not check again."""
        self.cp, self.repeats = cupy, repeats
        self.start, self.end = cupy.cuda.Event(), cupy.cuda.Event()
        self.delay_s = self.MIN_DELAY_S
        #: runs whose start event had passed even behind the longest delay
        self.uncovered = 0
        if delay is None:
            from rtmem.kernels.dha import gpu_delay
            delay = gpu_delay, "numba"
        self._delay, self.delay_kind = delay

    @property
    def delay(self):
        """``(delay function, kind)`` this timer queues before each run."""
        return self._delay, self.delay_kind

    def check_delay(self, stream) -> None:
        """Launch the delay once. numba's kernel needs NVVM to compile; without
        it fall back to a CuPy kernel (NVRTC), and without that to no delay
        (events then include the launch path: ``delay_kind`` says so)."""
        try:
            self._delay(self.MIN_DELAY_S, stream=stream)
            stream.synchronize()
            return
        except Exception as e:  # noqa: BLE001 - recorded; the copies are still timed
            print(f"  numba delay kernel unavailable ({type(e).__name__}: {e})", flush=True)
        try:
            self._delay, self.delay_kind = _cupy_delay(self.cp), "cupy"
            self._delay(self.MIN_DELAY_S, stream=stream)
            stream.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"  no delay kernel ({type(e).__name__}: {e}): event timings include "
                  f"the launch path", flush=True)
            self._delay, self.delay_kind = (lambda seconds, *, stream: None), "none"

    def hold(self, stream) -> None:
        """Queue the current delay on ``stream`` (before a start event)."""
        self._delay(self.delay_s, stream=stream)

    def covered(self, start) -> bool:
        """Call right after queueing a run: True when ``start`` has not been
        reached yet (the delay covered the queueing); else lengthens the delay
        and returns False (the caller repeats the run), or, at the longest
        delay, counts the run in ``uncovered`` and returns True."""
        if not start.done:
            return True
        if self.delay_s < self.MAX_DELAY_S:
            self.delay_s = min(2 * self.delay_s, self.MAX_DELAY_S)
            return False
        self.uncovered += 1
        return True

    def events(self, fn, stream, before=None) -> float:
        """Device seconds between events recorded on ``stream`` around ``fn()``;
        ``before()``, when given, is queued ahead of each run, untimed (e.g. an
        L2 flush)."""
        fn()                                                   # warm-up
        stream.synchronize()
        times = []
        while len(times) < self.repeats:
            if before is not None:
                before()
            self.hold(stream)
            self.start.record(stream)
            fn()
            self.end.record(stream)
            ok = self.covered(self.start)
            self.end.synchronize()
            if ok:
                times.append(elapsed_s(self.cp, self.start, self.end))
        return statistics.median(times)

    def wall(self, fn, stream) -> float:
        """Host seconds for ``fn()`` plus a synchronize of ``stream``."""
        return median_time(lambda: (fn(), stream.synchronize()), self.repeats)

    def summary(self) -> dict:
        """The delay the runs ended with and the runs it did not cover (JSON)."""
        return {"final_delay_s": self.delay_s, "uncovered_runs": self.uncovered,
                "delay_kernel": self.delay_kind}


_DELAY_SOURCE = r"""
extern "C" __global__ void rtmem_delay(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""


def _cupy_delay(cp):
    """The delay of :func:`rtmem.kernels.dha.gpu_delay` as a CuPy RawKernel,
    compiled by NVRTC (which CuPy has even where numba finds no NVVM)."""
    import numpy as np
    kernel = cp.RawKernel(_DELAY_SOURCE, "rtmem_delay")

    def delay(seconds, *, stream):
        with stream:            # RawKernel launches on the current stream
            kernel((1,), (1,), (np.uint64(max(1, int(seconds * 1e9))),))
    return delay


#: Sizes from which the issue's bandwidth goals are judged.
GOAL_MIN_BYTES = 64 << 20
_COPY_PATHS = PATHS[:4]              # the one-way cudaMemcpy paths


def goals(doc: dict) -> dict:
    """The issue's goal quantities over the swept sizes >= 64 MiB: pinned H2D
    and D2H as a fraction of the best one-way cudaMemcpy figure of the run
    (goal >= 0.90; the worst size counts), and DHA read as a fraction of pinned
    H2D at the same size (goal >= 0.80, worst size). Ratios of the same run."""
    c = doc["curves"]
    idx = [i for i, n in enumerate(doc["sizes_bytes"]) if n >= GOAL_MIN_BYTES]
    out = {"min_bytes": GOAL_MIN_BYTES, "sizes_counted": len(idx)}
    if not idx:
        return out
    rate = {p: [c[p][i]["bytes_per_s"] for i in idx] for p in _COPY_PATHS}
    best = max(max(v) for v in rate.values())
    out["best_copy_bytes_per_s"] = best
    for p in ("h2d_pinned", "d2h_pinned"):
        out[f"{p}_over_best_copy"] = min(rate[p]) / best
    if "dha_read" in c:
        out["dha_read_over_h2d_pinned"] = min(
            c["dha_read"][i]["bytes_per_s"] / c["h2d_pinned"][i]["bytes_per_s"] for i in idx)
    return out


def l2_flusher(cp, stream):
    """``(flush, l2_bytes)``: ``flush()`` queues on ``stream`` a write of twice the
    GPU's L2 size, to run before each timed kernel. Without it a working set
    smaller than L2 (50 MB on an H100/H200) is read from L2 after the warm-up,
    and a kernel reports L2 speed, not what a training step sees."""
    rt = cp.cuda.runtime
    l2 = int(rt.getDeviceProperties(0).get("l2CacheSize", 0)) or (64 << 20)
    scratch = cp.empty(2 * l2, dtype=cp.uint8)

    def flush():
        rt.memsetAsync(scratch.data.ptr, 0, scratch.nbytes, stream.ptr)
    return flush, l2


def _concurrent_medians(cp, timer, first, second, s1, s2, repeats):
    """:func:`_concurrent` ``repeats`` times after one warm-up run: the median of
    each of its three seconds."""
    runs = [_concurrent(cp, timer, first, second, s1, s2) for _ in range(repeats + 1)][1:]
    return tuple(statistics.median(r[k] for r in runs) for k in range(3))


def _concurrent(cp, timer, first, second, s1, s2):
    """Run ``first`` on s1 and ``second`` on s2 from a common start (both queued
    behind ``timer``'s delay); returns (seconds of first, seconds of second,
    seconds until both finished)."""
    ev = [cp.cuda.Event() for _ in range(4)]
    while True:
        s1.synchronize()
        s2.synchronize()
        timer.hold(s1)
        ev[0].record(s1)
        s2.wait_event(ev[0])
        first()
        ev[1].record(s1)
        second()
        ev[2].record(s2)
        s1.wait_event(ev[2])
        ev[3].record(s1)
        ok = timer.covered(ev[0])
        ev[3].synchronize()
        if ok:
            break
    t = [elapsed_s(cp, ev[0], e) for e in ev[1:]]
    return t[0], t[1], max(t[2], t[0])


#: The paths that run rtmem's DHA kernels (they need numba-cuda and NVVM).
KERNEL_PATHS = ("dha_read", "dha_write", "hbm_read")


def measure(max_size: int, min_size: int, step: int, repeats: int, save=None) -> dict:
    """All measurements; returns the JSON document body (bytes, seconds, bytes/s).

    ``save(body)``, when given, is called with the body of the sizes measured
    so far after each size, so a run stopped by a time limit keeps them. When the DHA kernels cannot
    run (numba-cuda missing or unable to use the driver, no NVVM, a launch
    error) the copy paths are still measured and ``dha_error`` says why the
    kernel paths are missing."""
    import cupy as cp
    import numpy as np

    rt = cp.cuda.runtime
    h2d, d2h = rt.memcpyHostToDevice, rt.memcpyDeviceToHost
    s1 = cp.cuda.Stream(non_blocking=True)
    s2 = cp.cuda.Stream(non_blocking=True)
    timer = Timer(cp, repeats)
    dev_a = cp.empty(max_size, dtype=cp.uint8)
    dev_b = cp.empty(max_size, dtype=cp.uint8)
    dev_a.fill(1)
    dev_b.fill(2)
    pin_a, pin_b = cp.cuda.alloc_pinned_memory(max_size), cp.cuda.alloc_pinned_memory(max_size)
    for p in (pin_a, pin_b):
        np.frombuffer(p, dtype=np.uint8, count=max_size)[:] = 3   # fault the pages in
    pageable = np.full(max_size, 4, dtype=np.uint8)
    flush_l2, l2 = l2_flusher(cp, s1)

    def copy(dst, src, n, kind, stream):
        return lambda: rt.memcpyAsync(dst, src, n, kind, stream.ptr)

    timer.check_delay(s1)
    dha_error = None
    try:
        # The DHA paths go through numba-cuda, which talks to the driver on its
        # own: one that cannot (a driver it does not support) fails here, and
        # the first launch compiles (no NVVM, or a kernel bug, shows there).
        # Either way only the kernel paths are lost, not CuPy's copies.
        from numba import cuda

        from rtmem.kernels import dha
        mapped_host = cuda.mapped_array(max_size, dtype=np.uint8)
        mapped_host[:] = 5
        mapped = cuda.as_cuda_array(mapped_host)        # device view of the same bytes
        hbm = cuda.as_cuda_array(dev_b)
        partials = cuda.device_array(1 << 16, dtype=np.uint64)
        dha.dha_write(mapped[:min_size], 5, stream=s1)
        dha.dha_read(mapped[:min_size], stream=s1, out=partials)
        s1.synchronize()
    except Exception as e:  # noqa: BLE001 - recorded in the JSON; copies still measured
        dha_error = f"{type(e).__name__}: {e}"
        mapped_host = mapped = hbm = partials = None
        print(f"  DHA kernels unavailable, measuring copies only: {dha_error}", flush=True)
    paths = [p for p in PATHS if dha_error is None or p not in KERNEL_PATHS]

    sizes, n = [], min_size
    while n <= max_size:
        sizes.append(n)
        n *= step
    curves = {p: [] for p in paths}
    for i, n in enumerate(sizes):
        # Views made outside the timed closures: less host work per run (the
        # Timer's delay already keeps the launch path out of the events).
        m_n, hbm_n = (None, None) if dha_error else (mapped[:n], hbm[:n])

        def bidir():
            return _concurrent_medians(cp, timer, copy(dev_a.data.ptr, pin_a.ptr, n, h2d, s1),
                                       copy(pin_b.ptr, dev_b.data.ptr, n, d2h, s2), s1, s2,
                                       repeats)[2]
        run = {
            "h2d_pageable": lambda: timer.wall(
                copy(dev_a.data.ptr, pageable.ctypes.data, n, h2d, s1), s1),
            "d2h_pageable": lambda: timer.wall(
                copy(pageable.ctypes.data, dev_a.data.ptr, n, d2h, s1), s1),
            "h2d_pinned": lambda: timer.events(copy(dev_a.data.ptr, pin_a.ptr, n, h2d, s1), s1),
            "d2h_pinned": lambda: timer.events(copy(pin_b.ptr, dev_b.data.ptr, n, d2h, s1), s1),
            "bidir_pinned": bidir,
            "dha_read": lambda: timer.events(
                lambda: dha.dha_read(m_n, stream=s1, out=partials), s1, flush_l2),
            "dha_write": lambda: timer.events(
                lambda: dha.dha_write(m_n, 7, stream=s1), s1, flush_l2),
            "hbm_read": lambda: timer.events(
                lambda: dha.dha_read(hbm_n, stream=s1, out=partials), s1, flush_l2),
        }
        for p in paths:
            seconds = run[p]()
            moved = 2 * n if p == "bidir_pinned" else n
            curves[p].append({"bytes": n, "seconds": seconds, "bytes_per_s": moved / seconds})
        print(f"  {format_bytes(n):>10}: " + "  ".join(
            f"{p} {curves[p][-1]['bytes_per_s'] / 1e9:.1f}" for p in paths), flush=True)
        if save is not None:
            save({"sizes_bytes": sizes[:i + 1], "curves": curves, "dha_error": dha_error})
    contention, dha_probe = None, None
    if dha_error is None:
        contention = _contention(cp, timer, copy, sizes[-1], mapped, partials, flush_l2,
                                 (dev_a, dev_b, pin_a, pin_b), s1, s2, repeats)

        def dha_probe(m_n):
            dha.dha_read(m_n, stream=s1, out=partials)
    latency = _latency(cp, timer, copy, dev_a, pageable, s1, dha_probe, mapped)
    return {"sizes_bytes": sizes, "curves": curves, "dha_error": dha_error,
            "contention": contention, "latency": latency, "l2_bytes": l2,
            "timer": timer.summary()}


def _contention(cp, timer, copy, n, mapped, partials, flush_l2, buffers, s1, s2,
                repeats) -> dict:
    """B4: DHA read of ``n`` bytes on ``s1`` alone and against a pinned copy in
    each direction on ``s2``. ``n`` is the largest swept size, a power of two: a
    --max-size such as 100MB need not be a whole number of the probe's 8-byte words."""
    from rtmem.kernels import dha
    rt = cp.cuda.runtime
    h2d, d2h = rt.memcpyHostToDevice, rt.memcpyDeviceToHost
    dev_a, dev_b, pin_a, pin_b = buffers
    mapped_n = mapped[:n]

    def dha_read():
        dha.dha_read(mapped_n, stream=s1, out=partials)

    alone = {"dha_read": timer.events(dha_read, s1, flush_l2),
             "h2d_pinned": timer.events(copy(dev_a.data.ptr, pin_a.ptr, n, h2d, s2), s2),
             "d2h_pinned": timer.events(copy(pin_b.ptr, dev_b.data.ptr, n, d2h, s2), s2)}
    contention = {"bytes": n, "alone_bytes_per_s": {k: n / v for k, v in alone.items()}}
    for other, src, dst, kind in (("h2d_pinned", pin_a.ptr, dev_a.data.ptr, h2d),
                                  ("d2h_pinned", dev_b.data.ptr, pin_b.ptr, d2h)):
        t_dha, t_copy, t_all = _concurrent_medians(
            cp, timer, dha_read, copy(dst, src, n, kind, s2), s1, s2, repeats)
        contention[f"dha_read+{other}"] = {
            "dha_read_bytes_per_s": n / t_dha, f"{other}_bytes_per_s": n / t_copy,
            "aggregate_bytes_per_s": 2 * n / t_all}
    return contention


def _latency(cp, timer, copy, dev_a, pageable, s1, dha_read=None, mapped=None) -> list:
    """Latency of small transfers on stream ``s1``: issue to completion seen by
    the host (``dha_read_s`` None without the DHA kernels)."""
    rt = cp.cuda.runtime
    h2d, d2h = rt.memcpyHostToDevice, rt.memcpyDeviceToHost
    small = cp.cuda.alloc_pinned_memory(4096)
    latency = []
    for n in LATENCY_SIZES:
        row = {
            "bytes": n,
            "h2d_pinned_s": timer.wall(copy(dev_a.data.ptr, small.ptr, n, h2d, s1), s1),
            "d2h_pinned_s": timer.wall(copy(small.ptr, dev_a.data.ptr, n, d2h, s1), s1),
            "h2d_pageable_s": timer.wall(copy(dev_a.data.ptr, pageable.ctypes.data, n, h2d,
                                              s1), s1),
            "dha_read_s": None}
        if dha_read is not None:
            m_n = mapped[:max(n, 8)]              # the probe reads whole 8-byte words
            row["dha_read_s"] = timer.wall(lambda: dha_read(m_n), s1)
        latency.append(row)
    return latency


def plot(doc: dict, path: str) -> str | None:
    """One curve per path, bandwidth (GB/s) against size; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'rtmem[plot]'): no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in doc["curves"].items():
        ax.plot([p["bytes"] for p in points], [p["bytes_per_s"] / 1e9 for p in points],
                marker="o", ms=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")      # HBM reads (TB/s) and small PCIe copies (MB/s) on one plot
    ax.set_xlabel("transfer size (bytes)")
    ax.set_ylabel("bandwidth (GB/s)")
    ax.set_title(f"PCIe and DHA bandwidth, {doc['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    # --plot in a folder not made yet (the JSON's folder is made by write_results)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        # written beside it and renamed over it, as the JSON is: a failure while
        # writing (a full disk, a time limit's SIGINT) left a truncated image
        replace_with(path, lambda tmp: fig.savefig(tmp, dpi=120))
    finally:
        plt.close(fig)
    return path


def _max_size(text: str) -> int:
    """An argparse ``type=`` for ``--max-size`` (a UnitError escaped as a traceback)."""
    try:
        size = parse_bytes(text)
    except UnitError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size < MIN_SIZE:
        # The sweep starts at 4 KiB and the latency probes copy up to 4 KiB into
        # the max_size buffers: smaller ones would be overrun.
        raise argparse.ArgumentTypeError(f"must be at least {format_bytes(MIN_SIZE)}")
    return size


def main(argv=None, prog=None) -> int:
    """Run the benchmark; returns the exit code (0 also when no GPU is found,
    unless ``RTMEM_REQUIRE_GPU=1``; 130 when interrupted). ``prog``: the command
    named in usage messages (``rtmem bench pcie``; default the script's name)."""
    ap = CommandParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="4 KiB..64 MiB in steps of 4x, 3 repeats (about a minute)")
    ap.add_argument("--max-size", type=_max_size, default=None,
                    help="largest buffer (default 1GiB)")
    ap.add_argument("--repeats", type=count(high=MAX_REPEATS), default=None,
                    help="timed runs per point")
    # checked now: savefig refused a .txt or a folder after the whole sweep
    ap.add_argument("--plot", type=output_file(*PLOT_SUFFIXES), default=None,
                    help="plot path, .png, .pdf or .svg (default next to the JSON: "
                         "bench/results/pcie.png, or $RTMEM_BENCH_RESULTS/pcie.png when set)")
    args = ap.parse_args(argv)
    max_size = args.max_size or parse_bytes("64MiB" if args.quick else "1GiB")
    repeats = (3 if args.quick else 5) if args.repeats is None else args.repeats
    device, why = find_gpu()
    if device is None:
        return no_gpu_exit("bench pcie", why)
    print(f"PCIe/DHA microbenchmarks on {device}: 4 KiB..{format_bytes(max_size)}, "
          f"median of {repeats}, GB/s = 1e9 bytes/s")
    head = {"device": device, "command": command_line("pcie.py", argv, prog),
            "repeats": repeats, "units": {"bytes": "B", "seconds": "s", "bytes_per_s": "B/s"}}
    partial = PartialResults("pcie")
    try:
        doc = measure(max_size, MIN_SIZE, 4 if args.quick else 2, repeats,
                      save=lambda body: partial.save({**head, **body}))
    except KeyboardInterrupt:
        return partial.interrupted("the measurements")
    doc = {**head, **doc, "goals": goals(doc)}
    c = doc["curves"]
    paths = list(c)
    rows = []
    for i, n in enumerate(doc["sizes_bytes"]):
        row = [format_bytes(n)] + [f"{c[p][i]['bytes_per_s'] / 1e9:.2f}" for p in paths]
        if "dha_read" in c:
            row.append(f"{c['dha_read'][i]['bytes_per_s'] / c['h2d_pinned'][i]['bytes_per_s']:.2f}")
        rows.append(row)
    print(format_table(["size"] + paths + (["dha/h2d"] if "dha_read" in c else []), rows))
    con = doc["contention"]
    if con is None:
        print(f"\nno DHA kernels ({doc['dha_error']}): no contention runs, no DHA latency")
    else:
        print(f"\ncontention at {format_bytes(con['bytes'])} (GB/s): alone " + ", ".join(
            f"{k} {v / 1e9:.1f}" for k, v in con["alone_bytes_per_s"].items()))
        for key, val in con.items():
            if "+" in key:
                print(f"  {key}: " + ", ".join(
                    f"{k.removesuffix('_bytes_per_s')} {v / 1e9:.1f}" for k, v in val.items()))
    print("\nlatency (us):\n" + format_table(
        ["bytes", "h2d pinned", "d2h pinned", "h2d pageable", "dha read"],
        [[r["bytes"]] + ["-" if r[k] is None else f"{r[k] * 1e6:.1f}"
                         for k in ("h2d_pinned_s", "d2h_pinned_s", "h2d_pageable_s",
                                   "dha_read_s")]
         for r in doc["latency"]]))
    met = ", ".join(f"{k} {v:.2f}" for k, v in doc["goals"].items()
                    if k.endswith(("_over_best_copy", "_over_h2d_pinned")))
    print(f"\ngoals (issue 6, worst size >= 64 MiB): {met or 'no size >= 64 MiB swept'}")
    path = write_results("pcie", doc)
    image = plot(doc, args.plot or os.path.splitext(path)[0] + ".png")
    print(f"\nwrote {path}" + (f" and {image}" if image else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
