"""Per-layer cost of on-GPU vs DHA vs copy-then-compute (MemFerry notes §2.2, §9.1 B5).

For the parameterized layers of one GPT-2 block plus the token embedding
(``wte``: 50257 x h, ``ln``: LayerNorm(h), ``attn.c_attn``: h -> 3h,
``attn.c_proj``: h -> h, ``mlp.c_fc``: h -> 4h, ``mlp.c_proj``: 4h -> h; h = 768
for gpt2, 1024 medium, 1280 large, 1600 xl) it times forward and backward on one
GPU with the rtmem.kernels.dha kernels in every mode, so the modes differ only in
where the parameters and gradients live:

===========  ===================================================================
mode         parameters / gradients
===========  ===================================================================
``gpu``      weight in HBM, gradient written to HBM              (T_FP, T_BP = T_CBP)
``copy``     weight copied pinned host -> HBM, then compute (forward);
             backward into HBM, then gradient copied HBM -> pinned host (GFGB,
             serial: T_trans + T_FP and T_BP + grad copy)
``dha``      weight in mapped host memory, gradient to HBM       (T^H_FP, T^H_BP)
``gpu_go``   weight in HBM, gradient written to mapped host      (T_GBP, §5.2)
``dha_go``   weight in mapped host, gradient to mapped host      (DHA + GO-MemFerry)
===========  ===================================================================

Activations (inputs, outputs, saved statistics) are always in HBM. Times are
seconds, medians of ``--repeats`` runs timed with CUDA events on one stream;
the kernels are rtmem's numba kernels (not cuBLAS), so absolute on-GPU GEMM
times are slower than PyTorch's and only the ratios between modes carry over.

Output: ``bench/results/dha_layers.json`` (or ``$RTMEM_BENCH_RESULTS``), format
``rtmem.dha_layers/1``: top level ``device``, ``command`` (what ran, to run it
again), ``model``, ``hidden``, ``tokens``,
``dtype`` ("float32"), ``modes`` (the table above) and ``layers``, a list in
forward order of::

    {"name": "mlp.c_fc", "kind": "linear",            # embedding | layernorm | linear
     "dims": {"in": 768, "out": 3072},                # {"vocab","hidden"} | {"hidden"}
     "tokens": 4096,
     "param_bytes": ..., "grad_bytes": ...,           # bytes (float32)
     "activation_in_bytes": ..., "activation_out_bytes": ...,
     "transfer_s": ...,        # H2D pinned copy of the parameters alone (T_trans)
     "grad_transfer_s": ...,   # D2H pinned copy of the gradients alone
     "forward_s":  {"gpu": ..., "copy": ..., "dha": ...},
     "backward_s": {"gpu": ..., "copy": ..., "dha": ..., "gpu_go": ..., "dha_go": ...},
     "dha_matches_gpu": true,  # forward output bitwise equal with mapped weights (B6)
     "weight_reads": {"forward": 16, "backward": 16}}  # linear only (else null):
                               # the GEMM re-read factor k, by construction

A DHA planner reads T_FP = forward_s.gpu, T_trans = transfer_s, T^H_FP =
forward_s.dha, T_BP = T_CBP = backward_s.gpu, T^H_BP = backward_s.dha and T_GBP =
backward_s.gpu_go (notation of memferry.md §3.2 and §5.2). GPU only: without a
GPU it says so and writes nothing. The JSON is also written after each layer,
marked ``"partial": true`` (with ``"error"`` when a layer failed, then exit 1),
so that a run stopped by SIGINT (bench/gpu_session.sh's time limit) keeps the
layers it finished; it then exits with code 130. A partial document has the
final one's shape, cut short: the layers (or the sweep's ``layers``) finished
so far, without the entries that come later.

Crossover sweep (the size where DHA beats copy-then-compute, per layer type).
Copying costs the same at any batch, DHA's cost grows with the tokens (an
embedding gathers T rows, a linear re-reads its weight k = ceil(T / (32 r))
times, r in 1..8 per shape: ``weight_reads``), so each layer is timed again at
every ``--sweep`` token count (default 64..65536 in powers of 4; at ``--tokens``
the sweep takes the table's figures, and that point says ``"from": "layers"``)
and the JSON gets a ``sweep`` object::

    {"tokens": [64, 256, ...], "compares": {...},     # what is compared, in words
     "layers": [{"name", "kind", "dims",
                 "points": [{"tokens", "transfer_s", "forward_s": {gpu, copy, dha},
                             "backward_s": {gpu, dha}, "weight_reads", "timer"}, ...],
                 "forward":  <crossover>, "backward": <crossover>}, ...],
     "by_kind": {"linear": {"forward": {"verdict", "crossing_tokens": [lo, hi],
                                        "layers": {name: text}}, "backward": ...}}}

A ``<crossover>`` (:func:`crossover`) has ``dha_over_copy`` per point,
``dha_wins_at_tokens``, ``crossings`` (token counts, interpolated, where the
winner changes) and a ``verdict`` ("dha", "copy", "dha below", "dha above",
"mixed"). Forward compares T^H_FP with T_trans + T_FP (``forward_s.copy``);
backward compares T^H_BP with T_trans + T_BP (a layer whose parameters are still
on the host after a DHA forward: DHA again, or copy first, as DFGB does).
MemFerry's finding to check: embedding and LayerNorm win, linear loses.

    python bench/dha_layers.py [--quick] [--model gpt2] [--tokens 4096] [--repeats 5]
                               [--sweep 64,256,1024,4096,16384,65536 | none]
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (MAX_REPEATS, CommandParser, PartialResults, command_line,  # noqa: E402
                     count, write_results)
from pcie import Timer, find_gpu, l2_flusher, no_gpu_exit  # noqa: E402

from rtmem._table import format_table  # noqa: E402

HIDDEN = {"gpt2": 768, "gpt2-medium": 1024, "gpt2-large": 1280, "gpt2-xl": 1600}
VOCAB = 50257
FORWARD_MODES = ("gpu", "copy", "dha")
BACKWARD_MODES = ("gpu", "copy", "dha", "gpu_go", "dha_go")
#: the backward modes the crossover sweep times: T_BP and T^H_BP
SWEEP_BACKWARD_MODES = ("gpu", "dha")

#: What each mode of BACKWARD_MODES (FORWARD_MODES among them) means: the JSON's
#: "modes".
MODE_DESCRIPTIONS = {
    "gpu": "params and grads in HBM",
    "copy": "fwd: H2D copy of the params then compute; bwd: compute then D2H copy "
            "of the grads (serial)",
    "dha": "params in mapped host memory, grads to HBM",
    "gpu_go": "params in HBM, grads written to mapped host memory",
    "dha_go": "params and grads in mapped host memory"}


def layer_specs(h: int) -> list[dict]:
    """The measured layers of a GPT-2 model of hidden size ``h``, forward order."""
    return [{"name": "wte", "kind": "embedding", "dims": {"vocab": VOCAB, "hidden": h}},
            {"name": "ln", "kind": "layernorm", "dims": {"hidden": h}},
            {"name": "attn.c_attn", "kind": "linear", "dims": {"in": h, "out": 3 * h}},
            {"name": "attn.c_proj", "kind": "linear", "dims": {"in": h, "out": h}},
            {"name": "mlp.c_fc", "kind": "linear", "dims": {"in": h, "out": 4 * h}},
            {"name": "mlp.c_proj", "kind": "linear", "dims": {"in": 4 * h, "out": h}}]


class Placement:
    """One layer's parameters (or gradients) in HBM, mapped host and pinned host."""

    def __init__(self, shapes: dict, rng, fill: bool):
        import cupy as cp
        import numpy as np
        from numba import cuda
        self.shapes, self.dev, self.mapped, self.pinned, self._keep = shapes, {}, {}, {}, []
        self.dev_ptr = {}
        for name, shape in shapes.items():
            n = int(np.prod(shape))
            values = (rng.standard_normal(shape).astype(np.float32) if fill
                      else np.zeros(shape, np.float32))
            d = cp.asarray(values)
            m = cuda.mapped_array(shape, dtype=np.float32)
            m[...] = values
            mem = cp.cuda.alloc_pinned_memory(n * 4)
            pin = np.frombuffer(mem, dtype=np.float32, count=n).reshape(shape)
            pin[...] = values
            self._keep += [d, m, mem]
            # The copy's device address, from CuPy: numba's device_ctypes_pointer is
            # a c_void_p, a c_size_t or a CUdeviceptr (no .value) depending on the
            # numba-cuda version and binding.
            self.dev_ptr[name] = d.data.ptr
            self.dev[name] = cuda.as_cuda_array(d)      # numba views: no per-launch cost
            self.mapped[name] = cuda.as_cuda_array(m)
            self.pinned[name] = pin
        self.nbytes = sum(int(np.prod(s)) * 4 for s in shapes.values())

    def copy(self, direction: str, stream):
        """cudaMemcpyAsync of every array, pinned -> HBM ("h2d") or back ("d2h")."""
        import cupy as cp
        rt = cp.cuda.runtime
        for name in self.shapes:
            dev = self.dev_ptr[name]
            host = self.pinned[name].ctypes.data
            n = self.pinned[name].nbytes
            if direction == "h2d":
                rt.memcpyAsync(dev, host, n, rt.memcpyHostToDevice, stream.ptr)
            else:
                rt.memcpyAsync(host, dev, n, rt.memcpyDeviceToHost, stream.ptr)


def param_shapes(spec: dict) -> dict:
    """Shapes of the parameters (and gradients) of a layer of ``layer_specs``."""
    d = spec["dims"]
    if spec["kind"] == "embedding":
        return {"weight": (d["vocab"], d["hidden"])}
    if spec["kind"] == "layernorm":
        return {"gamma": (d["hidden"],), "beta": (d["hidden"],)}
    return {"weight": (d["out"], d["in"]), "bias": (d["out"],)}


def placements(spec: dict, rng) -> tuple:
    """(params, grads): random parameters and zero gradients, each in HBM, mapped
    and pinned host memory; they do not depend on the token count, so a sweep
    makes them once per layer."""
    shapes = param_shapes(spec)
    return Placement(shapes, rng, fill=True), Placement(shapes, rng, fill=False)


def build(spec: dict, tokens: int, rng, stream, placed=None):
    """(params, grads, forward(p), backward(p, g), output, act_in_bytes, act_out_bytes);
    ``placed``: the :func:`placements` to use (default: new ones)."""
    import cupy as cp
    import numpy as np
    from numba import cuda

    from rtmem.kernels import dha
    T, kind, d = tokens, spec["kind"], spec["dims"]

    def act(*shape, ints=None):
        a = (cp.asarray(rng.integers(0, ints, shape).astype(np.int32)) if ints
             else cp.asarray(rng.standard_normal(shape).astype(np.float32)))
        return cuda.as_cuda_array(a), a

    keep = []
    if kind == "embedding":
        V, H = d["vocab"], d["hidden"]
        (ids, k1), (dy, k2), (out, k3) = act(T, ints=V), act(T, H), act(T, H)
        keep += [k1, k2, k3]
        fwd = lambda p: dha.embedding_forward(p["weight"], ids, out, stream=stream,  # noqa: E731
                                              check=False)
        bwd = lambda p, g: dha.embedding_backward(dy, ids, g["weight"], stream=stream,  # noqa: E731
                                                  check=False)
        act_in, act_out = T * 4, T * H * 4
    elif kind == "layernorm":
        H = d["hidden"]
        (x, k1), (dy, k2), (out, k3), (gx, k4) = act(T, H), act(T, H), act(T, H), act(T, H)
        (mean, k5), (rstd, k6) = act(T), act(T)
        keep += [k1, k2, k3, k4, k5, k6]
        fwd = lambda p: dha.layernorm_forward(x, p["gamma"], p["beta"], out, mean, rstd,  # noqa: E731
                                              stream=stream)
        bwd = lambda p, g: dha.layernorm_backward(  # noqa: E731
            dy, x, mean, rstd, p["gamma"], gx, g["gamma"], g["beta"], stream=stream)
        act_in, act_out = T * H * 4, T * H * 4
    else:
        K, N = d["in"], d["out"]
        (x, k1), (dy, k2), (out, k3), (gx, k4) = act(T, K), act(T, N), act(T, N), act(T, K)
        keep += [k1, k2, k3, k4]
        fwd = lambda p: dha.linear_forward(x, p["weight"], p["bias"], out, stream=stream)  # noqa: E731
        bwd = lambda p, g: dha.linear_backward(  # noqa: E731
            dy, x, p["weight"], gx, g["weight"], g["bias"], stream=stream)
        act_in, act_out = T * K * 4, T * N * 4
    params, grads = placed or placements(spec, rng)
    return params, grads, fwd, bwd, (out, keep), act_in, act_out


#: The delay kernel the first Rig's Timer settled on, (delay, kind), for the
#: others: a run builds ~42 Rigs, and each check launches, synchronizes and,
#: without NVVM, prints the same fallback again.
_checked_delay = None


def _timer(cp, repeats: int, stream):
    """A Timer of the Rig's own (its delay length and uncovered runs are per Rig)
    on the delay kernel the first Rig checked (without NVVM a CuPy delay, which
    the "timer" JSON records)."""
    global _checked_delay
    timer = Timer(cp, repeats, delay=_checked_delay)
    if _checked_delay is None:
        timer.check_delay(stream)
        _checked_delay = timer.delay
    return timer


class Rig:
    """One layer built at one token count, on its own stream, with a delay-covered
    event timer and an L2 flush before every timed run; times each mode of the
    module docstring's table."""

    def __init__(self, spec: dict, tokens: int, repeats: int, rng, placed=None):
        import cupy as cp
        self.stream = stream = cp.cuda.Stream(non_blocking=True)
        self.timer = _timer(cp, repeats, stream)
        self._flush, _ = l2_flusher(cp, stream)
        (self.p, self.g, self._fwd, self._bwd, (self.out, self._keep), self.act_in,
         self.act_out) = build(spec, tokens, rng, stream, placed)

    def timed(self, fn) -> float:
        # L2 flushed before each run: layer inputs and weights of GPT-2 sizes fit
        # in L2, so back-to-back runs would time L2, not a training step's memory
        return self.timer.events(fn, self.stream, self._flush)

    def forward_s(self, mode: str) -> float:
        """Device seconds of the forward in ``mode`` (one of FORWARD_MODES)."""
        p, fwd = self.p, self._fwd
        run = {"gpu": lambda: fwd(p.dev),
               "copy": lambda: (p.copy("h2d", self.stream), fwd(p.dev)),
               "dha": lambda: fwd(p.mapped)}[mode]
        return self.timed(run)

    def backward_s(self, mode: str) -> float:
        """Device seconds of the backward in ``mode`` (one of BACKWARD_MODES)."""
        p, g, bwd = self.p, self.g, self._bwd
        run = {"gpu": lambda: bwd(p.dev, g.dev),
               "copy": lambda: (bwd(p.dev, g.dev), g.copy("d2h", self.stream)),
               "dha": lambda: bwd(p.mapped, g.dev),
               "gpu_go": lambda: bwd(p.dev, g.mapped),
               "dha_go": lambda: bwd(p.mapped, g.mapped)}[mode]
        return self.timed(run)

    def transfer_s(self, which: str = "params") -> float:
        """Device seconds of the pinned copy of the parameters to HBM ("params",
        T_trans) or of the gradients back to the host ("grads")."""
        if which == "params":
            return self.timed(lambda: self.p.copy("h2d", self.stream))
        return self.timed(lambda: self.g.copy("d2h", self.stream))

    def dha_matches_gpu(self) -> bool:
        """Whether the forward with mapped parameters is bitwise the on-GPU one (B6)."""
        self._fwd(self.p.dev)
        self.stream.synchronize()
        on_gpu = self.out.copy_to_host()
        self._fwd(self.p.mapped)
        self.stream.synchronize()
        return bool((on_gpu == self.out.copy_to_host()).all())


def weight_reads(spec: dict, tokens: int) -> dict | None:
    """A linear layer's GEMM re-read factor k at ``tokens`` (memferry.md §3.2),
    ``{"forward": k, "backward": k}``: how many times the kernels read the weight,
    by construction (:func:`rtmem.kernels.dha.linear_weight_reads`), not
    measured. None for the other kinds, which read each parameter once."""
    if spec["kind"] != "linear":
        return None
    from rtmem.kernels import dha
    return dha.linear_weight_reads(tokens, spec["dims"]["in"], spec["dims"]["out"])


def measure_layer(spec: dict, tokens: int, repeats: int, rng) -> dict:
    """Every mode of one layer; the JSON entry described in the module docstring."""
    rig = Rig(spec, tokens, repeats, rng)
    forward = {m: rig.forward_s(m) for m in FORWARD_MODES}
    matches = rig.dha_matches_gpu()
    backward = {m: rig.backward_s(m) for m in BACKWARD_MODES}
    return {**spec, "tokens": tokens, "param_bytes": rig.p.nbytes,
            "grad_bytes": rig.g.nbytes, "activation_in_bytes": rig.act_in,
            "activation_out_bytes": rig.act_out, "transfer_s": rig.transfer_s("params"),
            "grad_transfer_s": rig.transfer_s("grads"), "forward_s": forward,
            "backward_s": backward, "dha_matches_gpu": matches,
            "weight_reads": weight_reads(spec, tokens), "timer": rig.timer.summary()}


def sweep_point(spec: dict, tokens: int, repeats: int, rng, placed=None) -> dict:
    """What the crossover needs of one layer at one token count (seconds):
    ``transfer_s`` (T_trans), ``forward_s`` in every forward mode, and
    ``backward_s`` on the GPU (T_BP) and by DHA (T^H_BP)."""
    rig = Rig(spec, tokens, repeats, rng, placed)
    return {"tokens": tokens, "transfer_s": rig.transfer_s("params"),
            "forward_s": {m: rig.forward_s(m) for m in FORWARD_MODES},
            "backward_s": {m: rig.backward_s(m) for m in SWEEP_BACKWARD_MODES},
            "weight_reads": weight_reads(spec, tokens), "timer": rig.timer.summary()}


def crossover(tokens, dha_s, copy_s) -> dict:
    """Where DHA stops (or starts) beating copy-then-compute along a token sweep.

    ``tokens`` ascending token counts, ``dha_s`` / ``copy_s`` the seconds of the
    two ways at each. DHA wins a point when ``dha / copy < 1`` (a tie goes to the
    copy, which needs no mapped memory). Between two adjacent points with
    different winners the crossing is interpolated where the ratio is 1, linearly
    in log(tokens) vs log(ratio): the costs grow roughly as powers of the token
    count. Returns ``dha_over_copy`` (per point), ``dha_wins_at_tokens``,
    ``crossings`` (``{"tokens": T, "to": "copy" | "dha"}``: who wins above T),
    ``verdict`` (``"dha"``: wins at every point, ``"copy"``: at none, ``"dha
    below"`` / ``"dha above"``: one crossing, ``"mixed"``) and ``text``.
    """
    tokens, dha_s, copy_s = list(tokens), list(dha_s), list(copy_s)
    if not (len(tokens) == len(dha_s) == len(copy_s)) or not tokens:
        raise ValueError(f"need one dha and one copy time per token count; got "
                         f"{len(tokens)} counts, {len(dha_s)} dha, {len(copy_s)} copy")
    if any(b <= a for a, b in zip(tokens, tokens[1:])) or tokens[0] < 1:
        raise ValueError(f"token counts must be positive and ascending; got {tokens}")
    if not all(t > 0 and math.isfinite(t) for t in dha_s + copy_s):
        raise ValueError("times must be positive and finite (seconds); got "
                         f"dha {dha_s}, copy {copy_s}")
    ratios = [d / c for d, c in zip(dha_s, copy_s)]
    wins = [r < 1 for r in ratios]
    crossings = []
    for i in range(len(tokens) - 1):
        if wins[i] != wins[i + 1]:
            x0, x1 = math.log(tokens[i]), math.log(tokens[i + 1])
            y0, y1 = math.log(ratios[i]), math.log(ratios[i + 1])
            at = math.exp(x0 + (x1 - x0) * (0.0 - y0) / (y1 - y0))
            crossings.append({"tokens": at, "to": "copy" if wins[i] else "dha"})
    won = [t for t, w in zip(tokens, wins) if w]
    lo, hi = tokens[0], tokens[-1]
    if all(wins):
        verdict, text = "dha", f"DHA wins at every size measured ({lo}..{hi} tokens)"
    elif not any(wins):
        verdict, text = "copy", f"copy wins at every size measured ({lo}..{hi} tokens)"
    elif len(crossings) == 1:
        below = crossings[0]["to"] == "copy"
        verdict = "dha below" if below else "dha above"
        text = (f"DHA wins {'below' if below else 'above'} ~{crossings[0]['tokens']:.0f} "
                f"tokens")
    else:
        verdict = "mixed"
        text = "DHA wins at " + ", ".join(map(str, won)) + " tokens"
    return {"dha_over_copy": ratios, "dha_wins_at_tokens": won,
            "crossings": crossings, "verdict": verdict, "text": text}


#: What the sweep's crossovers compare, per direction.
SWEEP_COMPARES = {
    "forward": "DHA forward (T^H_FP, forward_s.dha) vs copy-then-compute, serial "
               "(T_trans + T_FP, forward_s.copy)",
    "backward": "DHA backward of a layer whose parameters are still on the host "
                "(T^H_BP, backward_s.dha) vs copying them first, serial (T_trans + T_BP)"}


def _as_sweep_point(measured: dict) -> dict:
    """The :func:`sweep_point` fields of a :func:`measure_layer` entry, which
    measures all of them (and more) at its token count."""
    return {"tokens": measured["tokens"], "transfer_s": measured["transfer_s"],
            "forward_s": dict(measured["forward_s"]),
            "backward_s": {m: measured["backward_s"][m] for m in SWEEP_BACKWARD_MODES},
            "weight_reads": measured["weight_reads"], "timer": measured["timer"],
            "from": "layers"}


def sweep_layer(spec: dict, tokens_list, repeats: int, rng, measured=None) -> dict:
    """Per token count :func:`sweep_point`, and the forward and backward crossover.
    ``measured``: this layer's :func:`measure_layer` entry, if any; the sweep
    takes its point at that token count (marked ``"from": "layers"``) instead of
    timing it a second time."""
    placed = placements(spec, rng)
    known = measured["tokens"] if measured is not None else None
    points = [_as_sweep_point(measured) if t == known else
              sweep_point(spec, t, repeats, rng, placed) for t in tokens_list]
    fwd = crossover(tokens_list, [p["forward_s"]["dha"] for p in points],
                    [p["forward_s"]["copy"] for p in points])
    bwd = crossover(tokens_list, [p["backward_s"]["dha"] for p in points],
                    [p["transfer_s"] + p["backward_s"]["gpu"] for p in points])
    return {**spec, "points": points, "forward": fwd, "backward": bwd}


def by_kind(layers: list[dict]) -> dict:
    """Per layer type and direction: the verdict its layers agree on (else
    "mixed") and the range of their crossing token counts (None without one)."""
    out = {}
    for kind in dict.fromkeys(layer["kind"] for layer in layers):
        mine = [layer for layer in layers if layer["kind"] == kind]
        out[kind] = {}
        for direction in ("forward", "backward"):
            verdicts = {layer[direction]["verdict"] for layer in mine}
            at = [c["tokens"] for layer in mine for c in layer[direction]["crossings"]]
            out[kind][direction] = {
                "verdict": verdicts.pop() if len(verdicts) == 1 else "mixed",
                "crossing_tokens": [min(at), max(at)] if at else None,
                "layers": {layer["name"]: layer[direction]["text"] for layer in mine}}
    return out


def parse_tokens(text: str) -> list[int]:
    """``"64,256,1024"`` -> [64, 256, 1024] (ascending, distinct, >= 1); ``"none"``
    -> []. Raises ValueError saying what was wrong."""
    if text.strip().lower() == "none":
        return []
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--sweep takes comma-separated token counts such as "
                         f"64,256,1024 (or none); got {text!r}") from None
    if any(v < 1 for v in values) or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"--sweep token counts must be ascending, distinct and >= 1; "
                         f"got {text!r}")
    if len(values) < 2:
        raise ValueError(f"--sweep needs at least two token counts to find a crossover "
                         f"(or none to skip it); got {text!r}")
    return values


#: Default token sweeps (batch x sequence), full and --quick.
SWEEP_TOKENS, SWEEP_TOKENS_QUICK = "64,256,1024,4096,16384,65536", "64,512,4096"


def _measure_all(what: str, specs, measure, document, partial: PartialResults) -> list | None:
    """``measure(spec)`` for every spec, in order, writing ``document(done)``
    (the document with the list measured so far in its place) partial after
    each, so that a run stopped by a time limit keeps it; on a failure writes
    it with the error and returns None."""
    done = []
    for spec in specs:
        try:
            done.append(measure(spec))
        except Exception as e:  # noqa: BLE001 - reported with what was measured
            # The first kernel launch compiles: a missing NVVM shows here.
            error = f"{type(e).__name__}: {e}"
            path = partial.save(document(done), error=f"{spec['name']}: {error}")
            print(f"{what} {spec['name']} failed: {error}\n(`rtmem doctor` says whether "
                  f"numba-cuda finds NVVM; see CUDA_HOME there); wrote {path}",
                  file=sys.stderr)
            return None
        partial.save(document(done))
        print(f"  {what} {spec['name']}", flush=True)
    return done


def main(argv=None, prog=None) -> int:
    """Run the benchmark; returns the exit code (0 also when no GPU is found; 1
    when a layer failed, 130 when interrupted: what was measured is kept).
    ``prog``: the command named in usage messages (``rtmem bench dha``; default
    the script's name)."""
    ap = CommandParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"1024 tokens, 3 repeats, sweep {SWEEP_TOKENS_QUICK}")
    ap.add_argument("--model", choices=sorted(HIDDEN), default="gpt2")
    ap.add_argument("--tokens", type=count(), default=None,
                    help="tokens per batch, batch x sequence (default 4096)")
    ap.add_argument("--repeats", type=count(high=MAX_REPEATS), default=None,
                    help="timed runs per mode")
    ap.add_argument("--sweep", default=None,
                    help=f"token counts of the crossover sweep, comma-separated, or none "
                         f"(default {SWEEP_TOKENS})")
    args = ap.parse_args(argv)
    tokens = (1024 if args.quick else 4096) if args.tokens is None else args.tokens
    repeats = (3 if args.quick else 5) if args.repeats is None else args.repeats
    try:
        sweep = parse_tokens(args.sweep if args.sweep is not None else
                             SWEEP_TOKENS_QUICK if args.quick else SWEEP_TOKENS)
    except ValueError as e:
        ap.error(str(e))
    device, why = find_gpu()
    if device is None:
        return no_gpu_exit("bench dha", why)
    import numpy as np
    h = HIDDEN[args.model]
    rng = np.random.default_rng(0)
    print(f"per-layer cost on {device}: {args.model} (h={h}), {tokens} tokens, "
          f"median of {repeats}, times in ms")
    # Everything known before measuring goes in now, so that a partial document
    # is the final one cut short (one "format", one shape)
    doc = {"format": "rtmem.dha_layers/1", "device": device,
           "command": command_line("dha_layers.py", argv, prog), "model": args.model,
           "hidden": h, "tokens": tokens, "dtype": "float32", "repeats": repeats,
           "modes": MODE_DESCRIPTIONS}
    specs = layer_specs(h)
    partial = PartialResults("dha_layers")
    try:
        layers = _measure_all("measured", specs,
                              lambda spec: measure_layer(spec, tokens, repeats, rng),
                              lambda done: {**doc, "layers": done}, partial)
    except KeyboardInterrupt:
        return partial.interrupted("the per-layer measurements")
    if layers is None:
        return 1
    rows = [[r["name"], r["kind"], f"{r['param_bytes'] / 2**20:.2f}",
             "-" if r["weight_reads"] is None else str(r["weight_reads"]["forward"]),
             f"{r['transfer_s'] * 1e3:.3f}"]
            + [f"{r['forward_s'][m] * 1e3:.3f}" for m in FORWARD_MODES]
            + [f"{r['backward_s'][m] * 1e3:.3f}" for m in BACKWARD_MODES]
            + [f"{r['forward_s']['dha'] / r['forward_s']['copy']:.2f}",
               "yes" if r["dha_matches_gpu"] else "NO"] for r in layers]
    print(format_table(["layer", "kind", "MiB", "k fwd", "T_trans"]
                       + [f"fwd {m}" for m in FORWARD_MODES]
                       + [f"bwd {m}" for m in BACKWARD_MODES] + ["dha/copy fwd", "bitwise"],
                       rows, align="ll" + "r" * (len(rows[0]) - 2)))
    doc["layers"] = layers
    if sweep:
        print(f"\ncrossover sweep over {','.join(map(str, sweep))} tokens", flush=True)
        doc["sweep"] = {"tokens": sweep, "compares": SWEEP_COMPARES}
        by_name = {layer["name"]: layer for layer in layers}
        try:
            swept = _measure_all("swept", specs,
                                 lambda spec: sweep_layer(spec, sweep, repeats, rng,
                                                          by_name.get(spec["name"])),
                                 lambda done: {**doc, "sweep": {**doc["sweep"],
                                                                "layers": done}},
                                 partial)
        except KeyboardInterrupt:
            return partial.interrupted("the crossover sweep")
        if swept is None:
            return 1
        doc["sweep"].update(layers=swept, by_kind=by_kind(swept))
        rows = [[r["name"], r["kind"]]
                + [f"{x:.2f}" for x in r["forward"]["dha_over_copy"]]
                + [r["forward"]["text"], r["backward"]["text"]] for r in swept]
        print(format_table(["layer", "kind"] + [f"fwd dha/copy @{t}" for t in sweep]
                           + ["forward", "backward"], rows,
                           align="ll" + "r" * len(sweep) + "ll"))
    print(f"\nwrote {write_results('dha_layers', doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
