"""CPU Adam benchmark: rtmem's fused kernel against torch.optim.Adam and a roofline.

Run:  python bench/adam.py [--sizes 1e6,1e7,5e7,1e8] [--repeats 3]

For each size (parameters) every contender runs once per round, rounds
interleaved so machine noise hits all of them alike; the table reports the median
over rounds and their spread (``max/min``: slowest over fastest round; the JSON
has every round). Before every timed call a scratch buffer of twice the
last-level cache is rewritten (untimed), so each call starts from cold caches,
as an optimizer step does after backward; otherwise a contender that runs
right after another on the same arrays finds them cached (at 1M params a warm
call was 2.5x faster than a cold one here) and small sizes compare cache luck.
``--warm-cache`` turns the eviction off. Contenders:

- ``rtmem fp32``: :func:`rtmem.kernels.adam_update`, fp32 grads.
- ``rtmem fp32+check``: the same with a loss scale, so the read-only finite pass
  runs first (NOTE [ Finite check ] in kernels/adam.py).
- ``rtmem bf16``: bf16 gradients in, bf16 copy of the new params out (the
  mixed-precision offload path); ``rtmem fp16``: the same with IEEE fp16.
- ``torch for-loop`` / ``torch foreach`` / ``torch fused``: ``torch.optim.Adam``
  on one fp32 CPU tensor with ``foreach=False`` / ``foreach=True`` /
  ``fused=True``.
- ``torch fused+unscale``: GradScaler's path (``_amp_foreach_non_finite_check_and_unscale_``
  then the fused step), the torch twin of ``rtmem fp32+check``.
- ``torch fused bf16 pipe``: bf16 grads upcast into ``p.grad``, fused step, params
  downcast to a bf16 buffer: the torch twin of ``rtmem bf16``.
- ``DeepSpeed CPUAdam``: its JIT-built op when deepspeed is installed (``pip install
  deepspeed``; not a dependency of rtmem), else a note saying why it was skipped.
- ``roofline fp32`` / ``roofline bf16``: numba parallel loops with Adam's memory
  access pattern and trivial arithmetic. No Adam can beat them.

The ``gpt2-shaped`` row steps whole optimizers over GPT-2 small's 148 parameter
tensors, hidden size scaled by ``--gpt2-hidden`` (default 192 when ``--sizes``
is not given; 768 is the real 124M-parameter model, about 10 GB for all the
contenders): 98 of them are biases and LayerNorm vectors of a few thousand
elements, where per-tensor overhead rather than bandwidth decides. Contenders:
``rtmem CPUAdam`` twice (an A/A pair: their ratio is the noise), ``rtmem
NumpyAdam``, ``torch fused`` and ``torch foreach``; reported as params/s and as
speed ratios to torch fused (JSON ``gpt2_shaped``).

Byte accounting (DRAM traffic per parameter, the minimum any one-pass Adam needs):
fp32 path reads g, p, m, v and writes p, m, v = 7 x 4 B = 28 B. bf16 path reads
g (2 B) and p, m, v (12 B), writes p, m, v (12 B) and the bf16 copy (2 B) = 28 B
(plus a 2 B write-allocate read for the copy on most CPUs, not counted). The
finite check adds a grad read (4 B), not counted in its GB/s either, so that row
shows its cost as a lower effective rate. torch's rows use the same 28 B: their
"effective" GB/s is what a one-pass kernel would need for the same time.

Writes bench/results/adam.json (medians in seconds, params/s, GB/s, and the
ratios quoted in the report; absolute times depend on the shared machine), after
each size too, marked ``"partial": true`` until every size is done: a run
stopped early (SIGINT, as bench/gpu_session.sh's time limit sends) keeps the
sizes it finished and exits with code 130.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# torch and numba each run an OpenMP pool whose idle threads busy-wait after a
# parallel region; interleaved on 2 cores, each pool's spinning steals the other's
# cores and the timings become meaningless (10-30x swings). PASSIVE makes idle
# threads sleep at once, for both. Must be set before either library loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# _common first: a stop while numba loads is one line, not a traceback
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (MAX_REPEATS, CommandParser, PartialResults,  # noqa: E402
                     add_out_option, at_least, command_line, count, write_results)

import numba  # noqa: E402
import numpy as np  # noqa: E402

from rtmem.kernels import adam_update, encode_half  # noqa: E402

BYTES_FP32 = 28
BYTES_BF16 = 28


@numba.njit(parallel=True, cache=True)
def roofline_fp32(p, g, m, v):
    """Read g, p, m, v; write p, m, v in place; one multiply-add each."""
    for i in numba.prange(p.size):
        gi = g[i]
        p[i] = p[i] + np.float32(1e-12) * gi
        m[i] = np.float32(0.5) * m[i] + gi
        v[i] = np.float32(0.5) * v[i] + gi


@numba.njit(parallel=True, cache=True)
def roofline_bf16(p, g16, m, v, out16):
    """bf16 twin: read 16-bit g and p, m, v; write p, m, v and a 16-bit copy
    (truncated, not rounded: the probe only has to move the same bytes)."""
    for i in numba.prange(p.size):
        gi = np.float32(g16[i]) * np.float32(1e-6)
        pi = p[i] + np.float32(1e-12) * gi
        p[i] = pi
        m[i] = np.float32(0.5) * m[i] + gi
        v[i] = np.float32(0.5) * v[i] + gi
        out16[i] = np.uint16(np.int32(pi * np.float32(100)) & 0xFFFF)


def last_level_cache_bytes(default=32 << 20):
    """Size of the largest CPU cache in bytes (Linux sysfs), or ``default``."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return max(sizes, default=default)


class CacheEvictor:
    """Rewrites ``nbytes`` of scratch memory: afterwards no benchmark array is
    left in any cache level (the scratch is twice the last-level cache)."""

    def __init__(self, nbytes):
        self.scratch = np.ones(max(nbytes // 4, 1), np.float32)

    def __call__(self):
        self.scratch *= np.float32(1.0)


def _torch_contenders(n, rng_seed):
    try:
        import torch
    except ImportError as e:
        return {}, {"torch": f"not importable: {e}"}
    gen = torch.Generator().manual_seed(rng_seed)
    contenders, notes = {}, {}
    for name, kw in (("torch for-loop", dict(foreach=False)),
                     ("torch foreach", dict(foreach=True)),
                     ("torch fused", dict(fused=True))):
        p = torch.randn(n, generator=gen).requires_grad_()
        p.grad = torch.randn(n, generator=gen)
        try:
            opt = torch.optim.Adam([p], lr=1e-3, **kw)
            opt.step()
        except Exception as e:  # record, e.g. fused=True without a CPU kernel
            notes[name] = f"error: {type(e).__name__}: {e}"
            continue
        contenders[name] = (opt.step, BYTES_FP32)
    if "torch fused" in contenders:
        # rtmem's fused extras done the torch way, to compare whole jobs.
        p = torch.randn(n, generator=gen).requires_grad_()
        p.grad = torch.randn(n, generator=gen)
        opt = torch.optim.Adam([p], lr=1e-3, fused=True)
        found_inf, inv_scale = torch.zeros(1), torch.ones(1)
        g16 = torch.randn(n, generator=gen).to(torch.bfloat16)
        out16 = torch.empty(n, dtype=torch.bfloat16)

        def unscale_then_step():
            # GradScaler's path: unscale + inf check over the grads, then the step.
            torch._amp_foreach_non_finite_check_and_unscale_([p.grad], found_inf, inv_scale)
            opt.step()

        def bf16_pipeline():
            # bf16 grads in, bf16 params out: upcast pass, step, downcast pass.
            p.grad.copy_(g16)
            opt.step()
            out16.copy_(p.detach())

        contenders["torch fused+unscale"] = (unscale_then_step, BYTES_FP32)
        contenders["torch fused bf16 pipe"] = (bf16_pipeline, BYTES_BF16)
    return contenders, notes


def _deepspeed_contenders(n, rng_seed):
    """DeepSpeed's CPUAdam (its JIT-built C++/AVX op) on the same fp32 problem, when
    deepspeed is installed and its op builds; otherwise a note saying why not."""
    try:
        import torch
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return {}, {"DeepSpeed CPUAdam": f"not importable: {type(e).__name__}: {e}"}
    gen = torch.Generator().manual_seed(rng_seed)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    p.grad = torch.randn(n, generator=gen)
    try:
        opt = DeepSpeedCPUAdam([p], lr=1e-3, adamw_mode=False)
        opt.step()
    except Exception as e:  # noqa: BLE001 - e.g. the C++ op fails to build
        return {}, {"DeepSpeed CPUAdam": f"failed: {type(e).__name__}: {e}"}
    return {"deepspeed cpu_adam": (opt.step, BYTES_FP32)}, {}


def _rtmem_contenders(n, rng):
    p = rng.standard_normal(n, dtype=np.float32)
    g = rng.standard_normal(n, dtype=np.float32)
    m = rng.standard_normal(n, dtype=np.float32) * np.float32(0.01)
    v = rng.uniform(1e-4, 1e-2, n).astype(np.float32)
    g16 = encode_half(g, "bfloat16")
    out16 = np.empty(n, np.uint16)
    gh = g.astype(np.float16)
    outh = np.empty(n, np.float16)
    # Separate state for the probes so they never disturb Adam's values.
    rp, rm, rv = p.copy(), m.copy(), v.copy()
    kw = dict(lr=1e-3, step=10)   # plain Adam, as the torch.optim.Adam rows
    return {
        "rtmem fp32": (lambda: adam_update(p, g, m, v, **kw), BYTES_FP32),
        "rtmem fp32+check": (lambda: adam_update(p, g, m, v, grad_scale=1.0, **kw),
                             BYTES_FP32),
        "rtmem bf16": (lambda: adam_update(p, g16, m, v, grad_format="bfloat16", out=out16,
                                           out_format="bfloat16", **kw), BYTES_BF16),
        "rtmem fp16": (lambda: adam_update(p, gh, m, v, out=outh, **kw), BYTES_BF16),
        "roofline fp32": (lambda: roofline_fp32(rp, g, rm, rv), BYTES_FP32),
        "roofline bf16": (lambda: roofline_bf16(rp, g16, rm, rv, out16), BYTES_BF16),
    }


def _time_rounds(contenders, repeats, budget_s, evict=None):
    """Seconds of every call of each contender (name -> (fn, ...)), rounds
    interleaved: at least ``repeats`` rounds, more (up to 50) while they fit in
    ``budget_s`` seconds. ``evict`` (untimed) runs before every timed call.
    Returns (name -> list of seconds, rounds)."""
    evict = evict or (lambda: None)
    for fn, *_ in contenders.values():   # warm-up: compile, page in, allocate state
        fn()
    round_s = 0.0
    for fn, *_ in contenders.values():   # second warm-up round estimates a round's time
        evict()
        t0 = time.perf_counter()
        fn()
        round_s += time.perf_counter() - t0
    rounds = max(repeats, min(50, int(budget_s / max(round_s, 1e-9))))
    times = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, (fn, *_) in contenders.items():
            evict()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times, rounds


def bench_size(n, repeats, seed, budget_s, evict=None):
    """Time every contender at ``n`` parameters: at least ``repeats`` interleaved
    rounds, more (up to 50) while the rounds fit in ``budget_s`` seconds of timed
    calls. ``evict`` (untimed) runs before every timed call."""
    rng = np.random.default_rng(seed)
    contenders = _rtmem_contenders(n, rng)
    torch_contenders, notes = _torch_contenders(n, seed)
    contenders.update(torch_contenders)
    ds_contenders, ds_notes = _deepspeed_contenders(n, seed)
    contenders.update(ds_contenders)
    notes.update(ds_notes)
    times, rounds = _time_rounds(contenders, repeats, budget_s, evict)
    rows = []
    for name, (_, nbytes) in contenders.items():
        row = _timed_row(name, times[name], rounds, n)
        rows.append(dict(size=n, **row, bytes_per_param=nbytes,
                         gb_per_s=nbytes * n / row["median_s"] / 1e9))
    return rows, notes


def _timed_row(name, times, rounds, n) -> dict:
    """A contender's result from its ``times`` (s, one per round) stepping ``n``
    parameters: median, best, every round, and params/s at the median."""
    med = statistics.median(times)
    return dict(impl=name, median_s=med, min_s=min(times), rounds=rounds, times_s=times,
                params_per_s=n / med)


def gpt2_shapes(hidden: int) -> list:
    """Parameter shapes of GPT-2 small (12 blocks, 148 tensors) with the hidden
    size scaled to ``hidden`` (768 is the real model, 124M parameters) and the
    vocabulary and position tables scaled by the same factor, so the mix of
    sizes stays: 98 of the 148 tensors are biases and LayerNorm vectors of
    ``hidden`` to ``4 * hidden`` elements."""
    h = hidden
    scale = h / 768
    shapes = [(max(1, round(50257 * scale)), h), (max(1, round(1024 * scale)), h)]
    block = [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,),     # ln_1, attn, attn proj
             (h,), (h,), (h, 4 * h), (4 * h,), (4 * h, h), (h,)]  # ln_2, mlp fc, mlp proj
    return shapes + block * 12 + [(h,), (h,)]                     # ln_f


def _gpt2_contenders(shapes, seed):
    """Whole optimizer steps over one list of ``shapes``: rtmem's CPUAdam (twice,
    the A/A pair that shows the noise), NumpyAdam, torch.optim.Adam fused and
    foreach; each on its own copy of the same parameters and gradients."""
    from rtmem.optim import NumpyAdam
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    grads = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    nps = [p.copy() for p in params]
    numpy_opt = NumpyAdam(nps, lr=1e-3)
    contenders = {"rtmem NumpyAdam": (lambda: numpy_opt.step(grads),)}
    notes = {}
    try:
        import torch

        from rtmem.optim import CPUAdam
    except ImportError as e:
        return contenders, {"gpt2-shaped torch": f"not importable: {e}"}

    def tensors():
        ts = [torch.from_numpy(p.copy()).requires_grad_() for p in params]
        for t, g in zip(ts, grads):
            t.grad = torch.from_numpy(g.copy())
        return ts
    for name, make in (("rtmem CPUAdam", lambda ts: CPUAdam(ts, lr=1e-3)),
                       ("rtmem CPUAdam (A/A)", lambda ts: CPUAdam(ts, lr=1e-3)),
                       ("torch fused", lambda ts: torch.optim.Adam(ts, lr=1e-3, fused=True)),
                       ("torch foreach",
                        lambda ts: torch.optim.Adam(ts, lr=1e-3, foreach=True))):
        try:
            opt = make(tensors())
            opt.step()
        except Exception as e:  # noqa: BLE001 - record, e.g. fused=True without a CPU kernel
            notes[f"gpt2-shaped {name}"] = f"error: {type(e).__name__}: {e}"
            continue
        contenders[name] = (opt.step,)
    return contenders, notes


def bench_gpt2(hidden, repeats, seed, budget_s, evict=None):
    """Time whole optimizer steps over a GPT-2-small-shaped parameter list
    (:func:`gpt2_shapes`): many small tensors, where per-tensor overhead, not
    memory bandwidth, decides. Returns (section dict, notes): medians in
    seconds, params/s over all tensors, and speed ratios (> 1: the first is
    faster), among them the A/A ratio of two identical CPUAdam contenders."""
    shapes = gpt2_shapes(hidden)
    n = sum(int(np.prod(s)) for s in shapes)
    contenders, notes = _gpt2_contenders(shapes, seed)
    times, rounds = _time_rounds(contenders, repeats, budget_s, evict)
    results = [_timed_row(name, times[name], rounds, n) for name in contenders]
    med = {r["impl"]: r["median_s"] for r in results}

    def ratio(a, b):
        return med[b] / med[a] if a in med and b in med else None
    ratios = {"rtmem_cpuadam_over_torch_fused": ratio("rtmem CPUAdam", "torch fused"),
              "rtmem_numpyadam_over_torch_fused": ratio("rtmem NumpyAdam", "torch fused"),
              "rtmem_cpuadam_over_torch_foreach": ratio("rtmem CPUAdam", "torch foreach"),
              "a_over_a_rtmem_cpuadam": ratio("rtmem CPUAdam", "rtmem CPUAdam (A/A)")}
    return dict(hidden=hidden, tensors=len(shapes), params=n,
                small_tensors=sum(int(np.prod(s)) <= 3072 for s in shapes),
                results=results, ratios=ratios), notes


def _size_key(n: int) -> str:
    """``"5e7"`` for 50,000,000, the exact count when that short form would round
    (1.2e5 and 1e5 shared the key "1e5", so one size's ratios replaced the
    other's)."""
    short = f"{n:.0e}".replace("+0", "").replace("+", "")
    return short if float(short) == n else str(n)


def _ratio(rows, n, a, b, stat="median_s"):
    t = {r["impl"]: r[stat] for r in rows if r["size"] == n}
    if a in t and b in t:
        return t[b] / t[a]    # speed ratio a/b = time b / time a
    return None


def _sizes(text: str) -> list:
    """An argparse ``type=`` for ``--sizes``: distinct parameter counts >= 1 (int(float)
    of 'garbage' was a traceback, and a size of 0 timed nothing and wrote ratios)."""
    try:
        sizes = list(dict.fromkeys(int(float(s)) for s in text.split(",")))
    except (ValueError, OverflowError):     # not a number, nan, inf
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give parameter counts >= 1 separated by commas, e.g. 1e6,1e7")
    return sizes


def _ratios(rows, sizes) -> tuple[dict, dict]:
    """The speed ratios quoted in the report per size key (:func:`_size_key`):
    of the medians, and of the best rounds."""
    ratios = {}
    keys = [_size_key(n) for n in sizes]
    for key, n in zip(keys, sizes):
        ratios[key] = {
            "rtmem_fp32_over_torch_fused": _ratio(rows, n, "rtmem fp32", "torch fused"),
            "rtmem_fp32_over_deepspeed": _ratio(rows, n, "rtmem fp32", "deepspeed cpu_adam"),
            "rtmem_fp32_over_torch_foreach": _ratio(rows, n, "rtmem fp32", "torch foreach"),
            "rtmem_fp32_over_torch_for_loop": _ratio(rows, n, "rtmem fp32", "torch for-loop"),
            "rtmem_fp32_over_roofline": _ratio(rows, n, "rtmem fp32", "roofline fp32"),
            "rtmem_fp32_check_over_no_check": _ratio(rows, n, "rtmem fp32+check",
                                                     "rtmem fp32"),
            "rtmem_fp32_check_over_torch_fused_unscale": _ratio(
                rows, n, "rtmem fp32+check", "torch fused+unscale"),
            "rtmem_bf16_over_torch_fused_bf16_pipe": _ratio(rows, n, "rtmem bf16",
                                                            "torch fused bf16 pipe"),
            "rtmem_bf16_over_roofline_bf16": _ratio(rows, n, "rtmem bf16", "roofline bf16"),
            "rtmem_fp16_over_roofline_bf16": _ratio(rows, n, "rtmem fp16", "roofline bf16"),
            # Ceilings: the roofline does Adam's memory traffic with no arithmetic,
            # so no one-pass Adam beats it, and these bound what any can reach over
            # the baselines (the ratio goals are checked against them).
            "roofline_over_torch_fused": _ratio(rows, n, "roofline fp32", "torch fused"),
            "roofline_over_deepspeed": _ratio(rows, n, "roofline fp32", "deepspeed cpu_adam"),
        }
    # Best-of-rounds ratios too: on a shared machine the minimum is the least
    # disturbed run of each contender.
    ratios_min = {key: {k: _ratio(rows, n, *pair, stat="min_s") for k, pair in (
        ("rtmem_fp32_over_torch_fused", ("rtmem fp32", "torch fused")),
        ("rtmem_fp32_over_roofline", ("rtmem fp32", "roofline fp32")),
        ("roofline_over_torch_fused", ("roofline fp32", "torch fused")),
        ("rtmem_bf16_over_roofline_bf16", ("rtmem bf16", "roofline bf16")))}
        for key, n in zip(keys, sizes)}
    return ratios, ratios_min


#: The issue's goals, all at 50M parameters: (ratio key, goal, key of its
#: ceiling, the most any one-pass Adam can reach on this machine; None when
#: the goal is over the roofline itself).
GOALS = (("rtmem_fp32_over_torch_fused", 1.3, "roofline_over_torch_fused"),
         ("rtmem_fp32_over_deepspeed", 1.1, "roofline_over_deepspeed"),
         ("rtmem_fp32_over_roofline", 0.9, None))
GOAL_SIZE = 50_000_000


def _goals(ratios: dict) -> dict | None:
    """Each goal at :data:`GOAL_SIZE` with what was measured, whether it is met,
    its ceiling and whether the ceiling leaves it reachable at all; None when
    that size was not measured. A ratio or ceiling whose contender did not run
    (DeepSpeed not importable) is None, and so are the flags it decides."""
    at = ratios.get(_size_key(GOAL_SIZE))
    if at is None:
        return None
    out = {}
    for key, goal, ceiling_key in GOALS:
        measured = at.get(key)
        ceiling = 1.0 if ceiling_key is None else at.get(ceiling_key)
        out[key] = dict(goal=goal, measured=measured,
                        met=None if measured is None else measured >= goal,
                        ceiling=ceiling,
                        reachable=None if ceiling is None else ceiling >= goal)
    return out


def _document(args, llc, sizes, rows, notes, t_start, gpt2=None) -> dict:
    """The JSON document of the ``sizes`` measured so far (``rows``, ``notes``)."""
    ratios, ratios_min = _ratios(rows, sizes)
    try:
        import torch
        torch_info = dict(version=torch.__version__, threads=torch.get_num_threads())
    except ImportError:
        torch_info = None
    return dict(
        benchmark="cpu-adam",
        command=args.command,
        machine=dict(cpu=platform.processor() or platform.machine(),
                     omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), torch=torch_info,
                     cpus=os.cpu_count(), numba_threads=numba.get_num_threads(),
                     last_level_cache_bytes=llc),
        caches="warm" if args.warm_cache else f"cold: {2 * llc:,} B rewritten before "
                                                "each timed call",
        byte_accounting={
            "fp32": "28 B/param: read g, p, m, v (16 B), write p, m, v (12 B)",
            "bf16": "28 B/param: read bf16 g (2 B), p, m, v (12 B); write p, m, v "
                    "(12 B) and bf16 param copy (2 B); +2 B write-allocate not counted",
            "fp16": "28 B/param, as bf16 (fp16 grads in, fp16 param copy out)",
            "fp32+check": "28 B/param counted; the finite pass reads g again (+4 B)",
            "torch": "same 28 B/param (effective rate of a one-pass kernel)",
        },
        min_repeats=args.repeats, budget_s_per_size=args.budget, sizes=list(sizes),
        results=list(rows), notes=dict(notes), ratios=ratios,
        ratios_best_of_rounds=ratios_min, goals_at_50m=_goals(ratios), gpt2_shaped=gpt2,
        wall_s=time.perf_counter() - t_start)


def main(argv=None, prog=None) -> int:
    """Run the benchmark; returns the exit code, 130 when interrupted, 1 when a
    size does not fit in host memory (either way the sizes measured before are
    kept, marked partial: :class:`_common.PartialResults`). ``prog``: the command
    named in usage messages (``rtmem bench adam``; default the script's name)."""
    ap = CommandParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=_sizes, default=None,
                    help="comma-separated parameter counts (default 1e6,1e7,5e7,1e8)")
    ap.add_argument("--repeats", type=count(high=MAX_REPEATS), default=5,
                    help="minimum timed rounds per size (default 5)")
    ap.add_argument("--budget", type=at_least(0.0, float), default=12.0,
                    help="seconds of timed rounds per size; small sizes get more "
                         "rounds, up to 50 (default 12)")
    ap.add_argument("--gpt2-hidden", type=at_least(0, int), default=None,
                    help="hidden size of the GPT-2-shaped row (148 tensors of GPT-2 "
                         "small, scaled; 768 is the real 124M-parameter model), 0 to "
                         "skip it (default 192 without --sizes, else 0)")
    ap.add_argument("--warm-cache", action="store_true",
                    help="do not evict caches before each timed call")
    add_out_option(ap, "adam")
    args = ap.parse_args(argv)
    # what ran, to run it again: `rtmem bench adam ...` was recorded as bench/adam.py
    args.command = command_line("adam.py", argv, prog)
    args.sizes_given = args.sizes is not None
    sizes = args.sizes if args.sizes_given else _sizes("1e6,1e7,5e7,1e8")
    llc = last_level_cache_bytes()
    evict = None if args.warm_cache else CacheEvictor(2 * llc)
    t_start = time.perf_counter()
    rows, notes = [], {}
    # written after each size, so that a run stopped by a time limit keeps them
    partial = PartialResults("adam", args.out)
    for k, n in enumerate(sizes):
        try:
            r, nt = bench_size(n, args.repeats, seed=k, budget_s=args.budget, evict=evict)
            rows += r
            notes.update(nt)
            partial.save(_document(args, llc, sizes[:k + 1], rows, notes, t_start))
        except KeyboardInterrupt:
            return partial.interrupted(f"size {n:,d}")
        except MemoryError as e:
            # --sizes 1e13 ended in numpy's "Unable to allocate 36.4 TiB" traceback
            why = f"size {n:,d}: out of host memory ({e or 'MemoryError'})"
            where = "nothing written"
            if partial.doc is not None:
                where = f"the sizes measured before are in {partial.save(partial.doc, error=why)}"
            print(f"adam: {why}; give smaller --sizes; {where}", file=sys.stderr)
            return 1
        print(f"size {n:>12,d}: done ({time.perf_counter() - t_start:.0f} s elapsed)",
              file=sys.stderr)

    gpt2_hidden = args.gpt2_hidden
    if gpt2_hidden is None:
        gpt2_hidden = 0 if args.sizes_given else 192
    gpt2 = None
    if gpt2_hidden:
        try:
            gpt2, nt = bench_gpt2(gpt2_hidden, args.repeats, seed=len(sizes),
                                  budget_s=args.budget, evict=evict)
            notes.update(nt)
            partial.save(_document(args, llc, sizes, rows, notes, t_start, gpt2))
        except KeyboardInterrupt:
            return partial.interrupted("the gpt2-shaped row")
        print(f"gpt2-shaped row: done ({time.perf_counter() - t_start:.0f} s elapsed)",
              file=sys.stderr)

    # max/min: the spread of the rounds behind each median (1.00: every round
    # alike; a noisy machine shows here before it shows in the ratios)
    print(f"\n{'params':>12} {'implementation':<22} {'Mparams/s':>10} {'GB/s':>7}"
          f" {'vs roofline':>11} {'max/min':>7}")
    for r in rows:
        half = ("bf16" in r["impl"] or "fp16" in r["impl"]) and "torch" not in r["impl"]
        roof = "roofline bf16" if half else "roofline fp32"
        rr = _ratio(rows, r["size"], r["impl"], roof)
        print(f"{r['size']:>12,d} {r['impl']:<22} {r['params_per_s'] / 1e6:>10.1f}"
              f" {r['gb_per_s']:>7.1f} {rr:>11.2f} {max(r['times_s']) / r['min_s']:>7.2f}")
    for name, note in notes.items():
        print(f"{name}: {note}")

    if gpt2 is not None:
        print(f"\ngpt2-shaped: {gpt2['tensors']} tensors ({gpt2['small_tensors']} of <= "
              f"3072 elements), {gpt2['params']:,} params, hidden {gpt2['hidden']}")
        print(f"{'':>12} {'implementation':<22} {'Mparams/s':>10} {'vs torch fused':>14}")
        speed = {r["impl"]: r for r in gpt2["results"]}
        for name, r in speed.items():
            vs = (f" {speed['torch fused']['median_s'] / r['median_s']:>14.2f}"
                  if "torch fused" in speed else "")
            print(f"{'':>12} {name:<22} {r['params_per_s'] / 1e6:>10.1f}{vs}")
    result = _document(args, llc, sizes, rows, notes, t_start, gpt2)
    print("\nratios (speed, >1 = first is faster):")
    for key, rs in [*result["ratios"].items(),
                    *([("gpt2-shaped", gpt2["ratios"])] if gpt2 else [])]:
        print(f"  {key}: " + ", ".join(f"{k}={v:.2f}" for k, v in rs.items()
                                       if v is not None))
    for key, g in (result["goals_at_50m"] or {}).items():
        if g["measured"] is not None:
            print(f"goal {key} >= {g['goal']}: {g['measured']:.2f} "
                  f"({'met' if g['met'] else 'not met'}; the roofline allows "
                  + ("?" if g["ceiling"] is None else f"{g['ceiling']:.2f}") + ")")
    print(f"\nwrote {write_results('adam', result, path=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
