"""Allocator benchmark: speed and fragmentation of rtmem's best-fit allocator.

Runs, side by side in one process:

(a) random sizes: a random alloc/free trace (log-uniform 256 B .. 1 MiB, up to
    ~600 live blocks);
(b) a GPT-2 trace: buffer lifetimes of ``gpt2-small`` under
    ``sequential_schedule(n, 4)`` (rtmem.planners.lifetimes), replayed as
    allocations in op order; plus the static layout of the same lifetimes.

Each section also times rtmem's compiled core
(:class:`~rtmem.jit_allocator.JitBestFitAllocator`: the same placements, numba)
against the Python core and the naive floor, and on a GPU against the pools.

On the host backend the baseline is a plain Python best-fit (a linear scan of an
address-ordered free list): the floor every allocator must beat. On a GPU the
same traces also run against CuPy's MemoryPool and torch's caching allocator
(pairs/s, and the bytes each pool reserved to serve the trace over its peak of
live bytes). Then the pinned-arena check: the bytes reserved for a 20.4 GiB
pinned request, and on a GPU what CuPy's PinnedMemoryPool (512-byte units) and
torch's pinned CachingHostAllocator (powers of two) really take for it.

Fairness: rtmem and the naive floor are driven by the same loop,
:func:`rtmem.adaptors.replay`, calling ``allocate``/``deallocate`` directly on
the bare object: rtmem's :class:`~rtmem.allocator.BestFitAllocator` core (no
arena, no adaptor, no backend memory) against ``NaiveBestFit``. Both get a fresh
allocator per replay (construction untimed; only the replay loop is timed), and
rtmem keeps what the floor lacks (lock, statistics, pointer checks, streams).
Within each repeat the two are timed back to back, in alternating order, and a
speedup is the median of the per-repeat ratios, so machine noise (this runs on
shared machines) hits both sides alike.

Usage::

    python bench/allocator.py [--repeats 7] [--quick] [--out PATH]

Prints a table and writes ``bench/results/allocator.json`` (or ``--out``). Rates and ratios
are medians over repeats, measured in the same run; beside each, ``KEY_all``
holds every repeat's figure (the table gives the speedups' range). The JSON is written after
each section too, marked ``"partial": true`` until the run is complete, so a
run stopped early (SIGINT, as bench/gpu_session.sh's time limit sends) keeps
the sections it finished; it then exits with code 130.
"""

from __future__ import annotations

import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (MAX_REPEATS, CommandParser, PartialResults,  # noqa: E402
                     add_out_option, command_line, count, gpu_required, not_measured,
                     write_results)

import numpy as np  # noqa: E402

from rtmem._table import format_table  # noqa: E402
from rtmem.adaptors import replay
from rtmem.allocator import BestFitAllocator, align_up
from rtmem.backends import cuda_available
from rtmem.errors import OutOfMemoryError
from rtmem.jit_allocator import JitBestFitAllocator
from rtmem.layout import plan_layout
from rtmem.planners import builtin, sequential_schedule
from rtmem.planners.lifetimes import lifetimes

GIB = 1 << 30


class _NaiveBlock:
    __slots__ = ("offset", "size", "slab")

    def __init__(self, offset, size):
        self.offset, self.size, self.slab = offset, size, 0


class NaiveBestFit:
    """The floor: best fit by scanning a Python list of free (offset, size) holes
    in address order; coalescing by list neighbours. Same alignment rules."""

    def __init__(self, nbytes, alignment=256):
        self.alignment = alignment
        self.holes = [[0, align_up(nbytes, alignment)]]

    def allocate(self, nbytes, stream=None):
        size = align_up(max(nbytes, 1), self.alignment)
        best = -1
        for i, (_, hsize) in enumerate(self.holes):
            if hsize >= size and (best < 0 or hsize < self.holes[best][1]):
                best = i
        if best < 0:
            raise OutOfMemoryError(f"naive: cannot allocate {nbytes} bytes",
                                   requested=nbytes)
        off, hsize = self.holes[best]
        if hsize == size:
            del self.holes[best]
        else:
            self.holes[best] = [off + size, hsize - size]
        return _NaiveBlock(off, size)

    def deallocate(self, block, stream=None, event=None):
        off, size = block.offset, block.size
        holes = self.holes
        i = 0
        while i < len(holes) and holes[i][0] < off:
            i += 1
        if i > 0 and holes[i - 1][0] + holes[i - 1][1] == off:
            holes[i - 1][1] += size
            if i < len(holes) and off + size == holes[i][0]:
                holes[i - 1][1] += holes[i][1]
                del holes[i]
        elif i < len(holes) and off + size == holes[i][0]:
            holes[i][0] = off
            holes[i][1] += size
        else:
            holes.insert(i, [off, size])


# ------------------------------------------------------------------ traces
def random_trace(n_ops, seed=0, max_live=600):
    """Random alloc/free tuples, sizes log-uniform in 256 B .. 1 MiB: fill up to
    ``max_live`` blocks, then a steady state of random frees and allocations
    between ``max_live / 2`` and ``max_live`` live blocks (a long-running pool)."""
    rng = random.Random(seed)
    live, trace, nid = [], [], 0
    filling = True
    for _ in range(n_ops):
        if len(live) >= max_live:
            filling = False
        if not filling and (len(live) >= max_live or
                            (len(live) > max_live // 2 and rng.random() < 0.5)):
            trace.append(("free", live.pop(rng.randrange(len(live))), 0, None))
        else:
            size = int(2 ** rng.uniform(8, 20))
            trace.append(("alloc", nid, size, None))
            live.append(nid)
            nid += 1
    trace += [("free", i, 0, None) for i in live]
    return trace


def gpt2_trace(chain_name="gpt2-small", segments=4):
    """One training iteration of ``chain_name`` as alloc/free tuples, plus its
    lifetimes: at each op, buffers created by it are allocated, then buffers
    released at its end are freed."""
    chain = builtin(chain_name)
    lt = lifetimes(chain, sequential_schedule(chain.n, segments))
    trace = []
    for t in range(-1, lt.n_ops + 1):
        trace += [("alloc", int(i), int(lt.nbytes[i]), None)
                  for i in np.flatnonzero(lt.alloc == t)]
        trace += [("free", int(i), 0, None) for i in np.flatnonzero(lt.free == t)]
    return trace, lt


def peak_live_aligned(trace, alignment=256):
    cur = peak = 0
    sizes = {}
    for op, bid, nbytes, _ in trace:
        if op == "alloc":
            sizes[bid] = align_up(max(nbytes, 1), alignment)
            cur += sizes[bid]
            peak = max(peak, cur)
        elif op == "free":
            cur -= sizes.pop(bid)
    return peak


# ---------------------------------------------------------------- measuring
def max_holes(trace, slab_bytes):
    """Most free holes the naive allocator scans at once on ``trace``: what a
    linear scan costs, and why it is competitive on traces with few holes."""
    naive, live, most = NaiveBestFit(slab_bytes), {}, 0
    for op, bid, nbytes, _ in trace:
        if op == "alloc":
            live[bid] = naive.allocate(nbytes)
        else:
            naive.deallocate(live.pop(bid))
        most = max(most, len(naive.holes))
    return most


def time_replays(make, trace, repeats, loops):
    """``(pairs/s, ooms)``: the median alloc+free pairs per second over
    ``repeats`` (``loops`` replays each), and the allocations refused in all
    of them. replay() skips a refused allocation and goes on, so a rate with
    refusals timed less work (and fewer live blocks) than the trace holds."""
    rates, ooms = [], 0
    for _ in range(repeats):
        pairs, secs = 0, 0.0
        for _ in range(loops):
            res = replay(trace, make())
            pairs += res.pairs
            secs += res.seconds
            ooms += res.ooms
        rates.append(pairs / secs)
    return statistics.median(rates), ooms


def time_pair(make_a, make_b, trace, repeats, loops):
    """Per-repeat pairs/s of ``make_a`` and ``make_b`` allocators and their ratio
    a / b in each repeat, three lists of ``repeats`` floats; each repeat times
    both, alternating which goes first, so slow phases of a noisy machine hit
    both alike. :func:`spread` turns a list into the JSON's fields."""
    rates_a, rates_b = [], []
    for k in range(repeats):
        order = ((make_a, rates_a), (make_b, rates_b))
        for make, rates in (order if k % 2 == 0 else order[::-1]):
            rates.append(time_replays(make, trace, 1, loops)[0])
    ratios = [x / y for x, y in zip(rates_a, rates_b)]
    return rates_a, rates_b, ratios


def spread(key: str, values) -> dict:
    """``{key: median, key_all: values}``: the median the table quotes and every
    repeat's figure (as remat.json's ``fill_s_all``, adam.json's ``times_s``),
    so that two runs can be compared with their spread, not by medians alone."""
    values = list(values)
    return {key: statistics.median(values), f"{key}_all": values}


def sampled_fragmentation(trace, slab_bytes, every=500):
    """Mean and max fragmentation (1 - largest free / free) of rtmem's allocator
    sampled every ``every`` ops, and the extent (bytes) the trace needed."""
    a = BestFitAllocator(slab_bytes)
    live, frags = {}, []
    extent = 0
    for k, (op, bid, nbytes, stream) in enumerate(trace):
        if op == "alloc":
            b = a.allocate(nbytes, stream)
            live[bid] = b
            extent = max(extent, b.offset + b.size)
        else:
            a.deallocate(live.pop(bid))
        if k % every == 0:
            frags.append(a.stats().fragmentation)
    return float(np.mean(frags)), float(np.max(frags)), extent


class ArenaPath:
    """rtmem's whole allocation path: ``DeviceArena.alloc`` / ``free`` (Buffer
    objects, per-kind statistics, backend slabs, stream-ordered frees), the twin
    of a framework pool's ``malloc`` returning a pointer object."""

    def __init__(self, slab_bytes, backend=None):
        from rtmem.arena import DeviceArena
        self.arena = DeviceArena(slab_bytes, backend=backend)

    def allocate(self, nbytes, stream=None):
        return self.arena.alloc(max(nbytes, 1))

    def deallocate(self, buf, stream=None, event=None):
        self.arena.free(buf)


#: rtmem's contenders on the GPU, from the bare core to the whole arena path.
_RTMEM_GPU = ("rtmem_jit_core", "rtmem_core", "rtmem_core_stream_ordered",
              "rtmem_device_arena")


class OrderedCore:
    """The core on the arena's GPU free path, without the arena: frees ordered on
    CuPy's current stream, stamps recorded as real CUDA events (NOTE [
    Stream-ordered frees ]). Between the bare core and ``ArenaPath``, it says
    which layer costs what."""

    def __init__(self, slab_bytes):
        from rtmem.backends import get_backend
        backend = self.backend = get_backend("cuda")
        self.core = BestFitAllocator(
            slab_bytes, event_source=lambda stream: backend.new_event().record(stream))

    def allocate(self, nbytes, stream=None):
        return self.core.allocate(nbytes, self.backend.current_stream())

    def deallocate(self, block, stream=None, event=None):
        self.core.deallocate(block, stream=self.backend.current_stream(), ordered=True)


def gpu_baselines(trace, repeats, loops, slab_bytes, peak_live):
    """Pairs/s on the GPU of rtmem's compiled and Python cores (virtual slabs, as
    on the host), rtmem's DeviceArena path, CuPy's MemoryPool and torch's caching allocator, timed
    round-robin in one process; ratios rtmem / CuPy (goal: >= 1/1.5).

    Each contender is one long-lived allocator warmed by an untimed replay, as in
    a training loop: a fresh pool would time CuPy's cudaMalloc calls while rtmem's
    slab was reserved untimed at construction. ``warmup_ooms`` and
    ``timed_ooms`` count, per contender, the allocations its warm-up and its
    timed replays refused: a nonzero count means its rate timed less work.
    """
    import cupy

    class CupyPool:
        def __init__(self):
            self.pool = cupy.cuda.MemoryPool()

        def allocate(self, nbytes, stream=None):
            return self.pool.malloc(max(nbytes, 1))

        def deallocate(self, mem, stream=None, event=None):
            del mem     # the pool takes the block back when the last reference goes

    contenders = {"rtmem_jit_core": JitBestFitAllocator(slab_bytes),
                  "rtmem_core": BestFitAllocator(slab_bytes),
                  "rtmem_core_stream_ordered": OrderedCore(slab_bytes),
                  "rtmem_device_arena": ArenaPath(slab_bytes),
                  "cupy_memorypool": CupyPool()}
    torch_skipped = None
    try:
        import torch
    except ImportError:
        torch, torch_skipped = None, "torch is not installed"
    if torch is not None and not torch.cuda.is_available():
        torch_skipped = "torch.cuda.is_available() is False (a CPU build of torch?)"
    elif torch is not None:
        class TorchCaching:
            def allocate(self, nbytes, stream=None):
                return torch.cuda.caching_allocator_alloc(max(nbytes, 1))

            def deallocate(self, ptr, stream=None, event=None):
                torch.cuda.caching_allocator_delete(ptr)
        contenders["torch_caching"] = TorchCaching()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch_base = torch.cuda.memory_reserved()
    # Warm-up, untimed. replay() skips an allocation that raises rtmem's
    # OutOfMemoryError and goes on, so a too-small slab would time less work
    # than the pools do: count those refusals and report them, the warm-up's
    # and the timed replays' (a long-lived allocator, stream-ordered frees
    # still pending: the timed replays need not refuse what the warm-up did).
    ooms = {name: replay(trace, obj).ooms for name, obj in contenders.items()}
    timed_ooms = dict.fromkeys(contenders, 0)
    # What each pool reserved to serve the trace once (rtmem's best fit: the
    # host section's extent, same core)
    reserved = {"cupy_memorypool": contenders["cupy_memorypool"].pool.total_bytes()}
    if "torch_caching" in contenders:
        reserved["torch_caching"] = torch.cuda.max_memory_reserved() - torch_base
    rates = {name: [] for name in contenders}
    for k in range(repeats):
        names = list(contenders) if k % 2 == 0 else list(contenders)[::-1]
        for name in names:
            obj = contenders[name]
            rate, refused = time_replays(lambda: obj, trace, 1, loops)
            rates[name].append(rate)
            timed_ooms[name] += refused
    contenders["rtmem_device_arena"].arena.close()
    contenders["cupy_memorypool"].pool.free_all_blocks()
    if "torch_caching" in contenders:
        torch.cuda.empty_cache()
    out = {}
    for name, r in rates.items():
        out.update(spread(f"{name}_pairs_per_s", r))
    for name in _RTMEM_GPU:
        out.update(spread(f"{name}_over_cupy",
                          [a / b for a, b in zip(rates[name], rates["cupy_memorypool"])]))
    out["goal_over_cupy"] = 1 / 1.5
    for name, nbytes in reserved.items():
        out[f"{name}_reserved_bytes"] = nbytes
        out[f"{name}_reserved_over_peak_live"] = nbytes / peak_live
    out["warmup_ooms"] = ooms
    out["timed_ooms"] = timed_ooms
    if torch_skipped:
        out["torch_caching_skipped"] = torch_skipped
    return out


def pinned_check(request_bytes):
    """Bytes a HostArena reserves for ``request_bytes`` (real slab on this backend)."""
    from rtmem.arena import HostArena
    try:
        arena = HostArena(request_bytes, pinned=True)
    except Exception as exc:   # not enough host memory here: report, do not fail
        return {"error": repr(exc)}
    st = arena.stats()
    out = {"backend": arena.backend.name, "requested_bytes": request_bytes,
           "reserved_bytes": st.reserved_bytes,
           "overhead_bytes": st.reserved_bytes - request_bytes,
           "slab_bytes": arena.slabs[0].nbytes}
    arena.close()
    # torch's CachingHostAllocator rounds a request to the next power of two:
    # the figure is computed from that policy here; pinned_pools measures it
    out["power_of_two_pool_bytes"] = 1 << (request_bytes - 1).bit_length()
    out["power_of_two_pool_bytes_is"] = "computed from the rounding policy"
    return out


def pinned_pools(request_bytes):
    """Bytes the pinned pools of CuPy and torch really take for ``request_bytes``
    (GPU only), one at a time, each given back before the next: CuPy's
    PinnedMemoryPool (the allocation's ``mem.size``) and torch's
    CachingHostAllocator behind ``pin_memory=True`` (the growth of
    ``torch.cuda.host_memory_stats()``). A pool that cannot be measured gets an
    ``*_error`` / ``*_skipped`` entry instead."""
    out = {}
    try:
        import cupy
        pool = cupy.cuda.PinnedMemoryPool()
        mem = pool.malloc(request_bytes)
        out["cupy_pinned_pool_bytes"] = int(mem.mem.size)
        del mem
        pool.free_all_blocks()
    except Exception as exc:      # no host memory, no CuPy: report, do not fail
        out["cupy_pinned_pool_error"] = repr(exc)
    try:
        import torch
    except ImportError:
        out["torch_pinned_skipped"] = "torch is not installed"
        return out
    if not torch.cuda.is_available():
        out["torch_pinned_skipped"] = "torch.cuda.is_available() is False"
        return out
    try:
        stats = torch.cuda.host_memory_stats
        # "allocated_bytes" counts the pool's blocks in recent torch, "reserved_bytes"
        # in older releases; either way the rounded size it asked CUDA for
        key = next(k for k in ("allocated_bytes.current", "reserved_bytes.current")
                   if k in stats())
        before = stats()[key]
        t = torch.empty(request_bytes, dtype=torch.uint8, pin_memory=True)
        out["torch_pinned_bytes"] = stats()[key] - before
        del t
        empty = getattr(torch.cuda, "host_empty_cache", None)
        if empty is not None:
            empty()
    except Exception as exc:
        out["torch_pinned_error"] = repr(exc)
    return out


def random_section(trace, repeats) -> dict:
    """(a) The random trace: rtmem's core against the naive floor, fragmentation,
    and the host arena path over the core."""
    slab = 2 * GIB
    rt, nv, speedup = time_pair(lambda: BestFitAllocator(slab), lambda: NaiveBestFit(slab),
                                trace, repeats, 1)
    mean_f, max_f, extent = sampled_fragmentation(trace, slab)
    peak = peak_live_aligned(trace)
    out = {
        "ops": len(trace), "pairs": sum(op == "free" for op, *_ in trace),
        **spread("rtmem_pairs_per_s", rt), **spread("naive_pairs_per_s", nv),
        **spread("speedup_vs_naive", speedup),
        "fragmentation_mean": mean_f, "fragmentation_max": max_f,
        "extent_bytes": extent, "peak_live_bytes": peak,
        "reserved_over_peak_live": extent / peak,
        "naive_max_holes": max_holes(trace, slab)}
    # The arena's own cost over the core's (Buffer objects, accounting), on the
    # host backend: 256 MiB of numpy slab holds the trace's ~100 MB peak.
    ar, co, ratio = time_pair(lambda: ArenaPath(256 << 20, backend="host"),
                              lambda: BestFitAllocator(256 << 20), trace, repeats, 1)
    out.update(**spread("host_arena_pairs_per_s", ar),
               **spread("core_pairs_per_s_same_run", co),
               **spread("host_arena_over_core", ratio))
    out.update(jit_section(trace, slab, repeats, 1))
    return out


def jit_section(trace, slab, repeats, loops) -> dict:
    """The compiled core (:class:`~rtmem.jit_allocator.JitBestFitAllocator`)
    against the Python core and against the naive floor, each pair timed in
    the same repeats; the same placements, so the same fragmentation."""
    jit, core, over_core = time_pair(lambda: JitBestFitAllocator(slab),
                                     lambda: BestFitAllocator(slab), trace, repeats, loops)
    jit2, naive, over_naive = time_pair(lambda: JitBestFitAllocator(slab),
                                        lambda: NaiveBestFit(slab), trace, repeats, loops)
    return {**spread("jit_pairs_per_s", jit), **spread("core_pairs_per_s_vs_jit", core),
            **spread("jit_over_core", over_core),
            **spread("jit_pairs_per_s_vs_naive", jit2),
            **spread("naive_pairs_per_s_vs_jit", naive),
            **spread("jit_over_naive", over_naive)}


def gpt2_section(trace, lt, repeats, loops) -> dict:
    """(b) The GPT-2 trace (``lt``: its lifetimes): rtmem's core against the naive
    floor, fragmentation, and the static layout of the same lifetimes."""
    rt, nv, speedup = time_pair(lambda: BestFitAllocator(64 * GIB),
                                lambda: NaiveBestFit(64 * GIB), trace, repeats, loops)
    mean_f, max_f, extent = sampled_fragmentation(trace, 64 * GIB, every=10)
    peak = peak_live_aligned(trace)
    lay = plan_layout(lt.alloc, lt.free, lt.nbytes)
    lay.verify()
    jit = jit_section(trace, 64 * GIB, repeats, loops)
    return {**jit,
        "chain": "gpt2-small", "schedule": "sequential_schedule(n, 4)",
        "buffers": len(lt), "ops": len(trace),
        **spread("rtmem_pairs_per_s", rt), **spread("naive_pairs_per_s", nv),
        **spread("speedup_vs_naive", speedup),
        "naive_max_holes": max_holes(trace, 64 * GIB),
        "fragmentation_mean": mean_f, "fragmentation_max": max_f,
        "peak_live_bytes": peak, "best_fit_reserved_bytes": extent,
        "best_fit_reserved_over_peak_live": extent / peak,
        "static_layout_reserved_bytes": lay.reserved_bytes,
        "static_layout_reserved_over_peak_live": lay.reserved_bytes / lay.peak_live_bytes,
        "goal_best_fit": 1.05, "goal_static": 1.01}


def _range(section: dict, key: str = "speedup_vs_naive") -> str:
    """The spread of ``key``'s repeats in a section, for the table: "1.80-2.05x
    over 7 repeats"."""
    values = section[f"{key}_all"]
    return f"{min(values):.2f}-{max(values):.2f}x over {len(values)} repeats"


#: Why the GPU section is skipped on a machine without a usable GPU.
NO_GPU = "no usable CUDA GPU here: CuPy MemoryPool and torch caching allocator not measured"


def gpu_section(rtrace, gtrace, repeats, loops, random_peak, gpt2_peak) -> dict:
    """Both traces against CuPy's and torch's pools (:func:`gpu_baselines`),
    ``{"measured": true, "random": ..., "gpt2": ...}``, or
    :func:`_common.not_measured` without a usable GPU. ``*_peak``: each trace's
    peak of live bytes."""
    if not cuda_available():
        return not_measured(NO_GPU)
    return {"measured": True,
            "random": gpu_baselines(rtrace, repeats, 1, 256 << 20, random_peak),
            "gpt2": gpu_baselines(gtrace, repeats, loops,
                                  align_up(gpt2_peak * 5 // 4, 1 << 20), gpt2_peak)}


def pinned_section() -> dict:
    """The pinned-arena check at 20.4 GiB (:func:`pinned_check`), and on a GPU what
    CuPy's and torch's pinned pools take (:func:`pinned_pools`)."""
    out = pinned_check(int(20.4 * GIB))
    if cuda_available():
        out["pools"] = pinned_pools(int(20.4 * GIB))
    return out


def main(argv=None, prog=None) -> int:
    """Run the benchmark; returns the exit code: 3 when ``RTMEM_REQUIRE_GPU=1`` and
    there is no GPU to measure (then nothing is measured or written: an earlier
    result, GPU section included, stays), 130 when interrupted (the sections
    measured before are kept, marked partial: :class:`_common.PartialResults`).
    ``prog``: the command named in usage messages (``rtmem bench allocator``;
    default the script's name)."""
    ap = CommandParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=count(high=MAX_REPEATS), default=None,
                    help="timing repeats (median; default 7, 3 with --quick)")
    ap.add_argument("--quick", action="store_true", help="small traces (smoke run)")
    add_out_option(ap, "allocator")
    args = ap.parse_args(argv)
    # --quick gives the default only: it replaced an explicit --repeats silently
    repeats = args.repeats if args.repeats is not None else 3 if args.quick else 7
    loops = 20 if args.quick else 200
    if gpu_required() and not cuda_available():
        # A GPU session must not report ok for the pool ratios it cannot
        # measure, nor replace an earlier GPU result with "not measured" (the
        # partial document after each section did): fail before measuring.
        print(f"RTMEM_REQUIRE_GPU=1: {NO_GPU}; nothing measured, nothing written",
              file=sys.stderr)
        return 3
    results = {"command": command_line("allocator.py", argv, prog), "repeats": repeats}
    partial, during = PartialResults("allocator", args.out), "making the traces"
    try:
        rtrace = random_trace(4000 if args.quick else 40000)
        gtrace, lt = gpt2_trace()
        sections = {
            "random": lambda: random_section(rtrace, repeats),
            "gpt2": lambda: gpt2_section(gtrace, lt, repeats, loops),
            "gpu": lambda: gpu_section(rtrace, gtrace, repeats, loops,
                                       results["random"]["peak_live_bytes"],
                                       results["gpt2"]["peak_live_bytes"]),
            "pinned": pinned_section}
        for key, measure in sections.items():
            during = f"the {key} section"
            results[key] = measure()
            partial.save(results)
    except KeyboardInterrupt:
        return partial.interrupted(during)

    # ---------------------------------------------------------------- table
    r, g, p = results["random"], results["gpt2"], results["pinned"]
    rows = [
        ("random: rtmem pairs/s", f"{r['rtmem_pairs_per_s']:,.0f}"),
        ("random: naive best-fit pairs/s", f"{r['naive_pairs_per_s']:,.0f}"),
        ("random: speedup vs naive", f"{r['speedup_vs_naive']:.2f}x ({_range(r)}; "
                                     f"naive scans up to {r['naive_max_holes']} holes)"),
        ("random: fragmentation mean / max", f"{r['fragmentation_mean']:.3f} / "
                                             f"{r['fragmentation_max']:.3f}"),
        ("random: reserved / peak live", f"{r['reserved_over_peak_live']:.3f}"),
        ("random: host DeviceArena path pairs/s", f"{r['host_arena_pairs_per_s']:,.0f} "
         f"({r['host_arena_over_core']:.2f}x the core's)"),
        ("random: jit core pairs/s", f"{r['jit_pairs_per_s']:,.0f}"),
        ("random: jit core / Python core", f"{r['jit_over_core']:.2f}x "
                                           f"({_range(r, 'jit_over_core')})"),
        ("gpt2: rtmem pairs/s", f"{g['rtmem_pairs_per_s']:,.0f}"),
        ("gpt2: naive best-fit pairs/s", f"{g['naive_pairs_per_s']:,.0f}"),
        ("gpt2: speedup vs naive", f"{g['speedup_vs_naive']:.2f}x ({_range(g)}; "
                                   f"naive scans up to {g['naive_max_holes']} holes)"),
        ("gpt2: jit core pairs/s", f"{g['jit_pairs_per_s']:,.0f}"),
        ("gpt2: jit core / Python core", f"{g['jit_over_core']:.2f}x "
                                         f"({_range(g, 'jit_over_core')})"),
        ("gpt2: jit core / naive", f"{g['jit_over_naive']:.2f}x "
                                   f"({_range(g, 'jit_over_naive')})"),
        ("gpt2: best-fit reserved / peak live (goal <= 1.05)",
         f"{g['best_fit_reserved_over_peak_live']:.4f}"),
        ("gpt2: static layout reserved / peak live (goal <= 1.01)",
         f"{g['static_layout_reserved_over_peak_live']:.4f}"),
    ]
    if "error" in p:
        rows.append(("pinned 20.4 GiB", p["error"]))
    else:
        rows += [("pinned 20.4 GiB: reserved bytes", f"{p['reserved_bytes']:,} "
                  f"(+{p['overhead_bytes']} B, {p['backend']} backend)"),
                 ("pinned 20.4 GiB: power-of-two pool would take",
                  f"{p['power_of_two_pool_bytes']:,}")]
    for key, value in p.get("pools", {}).items():
        rows.append((f"pinned 20.4 GiB: {key}",
                     f"{value:,}" if isinstance(value, int) else value))
    if not results["gpu"]["measured"]:
        rows.append(("GPU baselines", results["gpu"]["reason"]))
    else:
        for tname in ("random", "gpt2"):
            d = results["gpu"][tname]
            rows += [(f"GPU {tname}: {name} pairs/s", f"{d[name + '_pairs_per_s']:,.0f}")
                     for name in (*_RTMEM_GPU, "cupy_memorypool", "torch_caching")
                     if name + "_pairs_per_s" in d]
            rows += [(f"GPU {tname}: {name} / CuPy pool (goal >= 0.67)",
                      f"{d[name + '_over_cupy']:.2f}")
                     for name in _RTMEM_GPU]
            rows += [(f"GPU {tname}: {name} reserved / peak live",
                      f"{d[name + '_reserved_over_peak_live']:.3f}")
                     for name in ("cupy_memorypool", "torch_caching")
                     if name + "_reserved_over_peak_live" in d]
            if "torch_caching_skipped" in d:
                rows.append((f"GPU {tname}: torch_caching", d["torch_caching_skipped"]))
            for when in ("warmup", "timed"):
                rows += [(f"GPU {tname}: {name} refused allocations (OOM, {when}): "
                          f"timings invalid", f"{n:,}")
                         for name, n in d[f"{when}_ooms"].items() if n]
    print(format_table(["metric", "value"], rows, align="ll"))
    print(f"\nwrote {write_results('allocator', results, path=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
