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
``rtmem.dha_layers/1``: top level ``device``, ``model``, ``hidden``, ``tokens``,
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
     "dha_matches_gpu": true}  # forward output bitwise equal with mapped weights (B6)

A DHA planner reads T_FP = forward_s.gpu, T_trans = transfer_s, T^H_FP =
forward_s.dha, T_BP = T_CBP = backward_s.gpu, T^H_BP = backward_s.dha and T_GBP =
backward_s.gpu_go (notation of memferry.md §3.2 and §5.2). GPU only: without a
GPU it says so and writes nothing.

    python bench/dha_layers.py [--quick] [--model gpt2] [--tokens 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import write_results  # noqa: E402
from pcie import Timer, find_gpu, l2_flusher, no_gpu_exit  # noqa: E402

from rtmem._table import format_table  # noqa: E402

HIDDEN = {"gpt2": 768, "gpt2-medium": 1024, "gpt2-large": 1280, "gpt2-xl": 1600}
VOCAB = 50257
FORWARD_MODES = ("gpu", "copy", "dha")
BACKWARD_MODES = ("gpu", "copy", "dha", "gpu_go", "dha_go")


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


def build(spec: dict, tokens: int, rng, stream):
    """(params, grads, forward(p), backward(p, g), output, act_in_bytes, act_out_bytes)."""
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
        shapes = {"weight": (V, H)}
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
        shapes = {"gamma": (H,), "beta": (H,)}
        fwd = lambda p: dha.layernorm_forward(x, p["gamma"], p["beta"], out, mean, rstd,  # noqa: E731
                                              stream=stream)
        bwd = lambda p, g: dha.layernorm_backward(  # noqa: E731
            dy, x, mean, rstd, p["gamma"], gx, g["gamma"], g["beta"], stream=stream)
        act_in, act_out = T * H * 4, T * H * 4
    else:
        K, N = d["in"], d["out"]
        (x, k1), (dy, k2), (out, k3), (gx, k4) = act(T, K), act(T, N), act(T, N), act(T, K)
        keep += [k1, k2, k3, k4]
        shapes = {"weight": (N, K), "bias": (N,)}
        fwd = lambda p: dha.linear_forward(x, p["weight"], p["bias"], out, stream=stream)  # noqa: E731
        bwd = lambda p, g: dha.linear_backward(  # noqa: E731
            dy, x, p["weight"], gx, g["weight"], g["bias"], stream=stream)
        act_in, act_out = T * K * 4, T * N * 4
    params, grads = Placement(shapes, rng, fill=True), Placement(shapes, rng, fill=False)
    return params, grads, fwd, bwd, (out, keep), act_in, act_out


def measure_layer(spec: dict, tokens: int, repeats: int, rng) -> dict:
    """Every mode of one layer; the JSON entry described in the module docstring."""
    import cupy as cp
    stream = cp.cuda.Stream(non_blocking=True)
    timer = Timer(cp, repeats)
    timer.check_delay(stream)       # no NVVM: a CuPy delay, recorded in "timer"
    flush, _ = l2_flusher(cp, stream)
    p, g, fwd, bwd, (out, _keep), act_in, act_out = build(spec, tokens, rng, stream)

    def timed(fn):
        # L2 flushed before each run: layer inputs and weights of GPT-2 sizes fit
        # in L2, so back-to-back runs would time L2, not a training step's memory
        return timer.events(fn, stream, flush)

    def copy_fwd():
        p.copy("h2d", stream)
        fwd(p.dev)

    def copy_bwd():
        bwd(p.dev, g.dev)
        g.copy("d2h", stream)

    forward = {"gpu": timed(lambda: fwd(p.dev)),
               "copy": timed(copy_fwd),
               "dha": timed(lambda: fwd(p.mapped))}
    fwd(p.dev)
    stream.synchronize()
    on_gpu = out.copy_to_host()
    fwd(p.mapped)
    stream.synchronize()
    matches = bool((on_gpu == out.copy_to_host()).all())
    backward = {"gpu": timed(lambda: bwd(p.dev, g.dev)),
                "copy": timed(copy_bwd),
                "dha": timed(lambda: bwd(p.mapped, g.dev)),
                "gpu_go": timed(lambda: bwd(p.dev, g.mapped)),
                "dha_go": timed(lambda: bwd(p.mapped, g.mapped))}
    return {**spec, "tokens": tokens, "param_bytes": p.nbytes, "grad_bytes": g.nbytes,
            "activation_in_bytes": act_in, "activation_out_bytes": act_out,
            "transfer_s": timed(lambda: p.copy("h2d", stream)),
            "grad_transfer_s": timed(lambda: g.copy("d2h", stream)),
            "forward_s": forward, "backward_s": backward, "dha_matches_gpu": matches,
            "timer": timer.summary()}


def main(argv=None) -> int:
    """Run the benchmark; returns the exit code (0 also when no GPU is found)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1024 tokens, 3 repeats")
    ap.add_argument("--model", choices=sorted(HIDDEN), default="gpt2")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per batch, batch x sequence (default 4096)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per mode")
    args = ap.parse_args(argv)
    tokens = (1024 if args.quick else 4096) if args.tokens is None else args.tokens
    repeats = (3 if args.quick else 5) if args.repeats is None else args.repeats
    if tokens < 1 or repeats < 1:
        ap.error("--tokens and --repeats must be at least 1")   # nothing to time
    device, why = find_gpu()
    if device is None:
        return no_gpu_exit("bench dha", why)
    import numpy as np
    h = HIDDEN[args.model]
    rng = np.random.default_rng(0)
    print(f"per-layer cost on {device}: {args.model} (h={h}), {tokens} tokens, "
          f"median of {repeats}, times in ms")
    doc = {"format": "rtmem.dha_layers/1", "device": device, "model": args.model,
           "hidden": h, "tokens": tokens}
    layers = []
    for spec in layer_specs(h):
        try:
            layers.append(measure_layer(spec, tokens, repeats, rng))
        except Exception as e:  # noqa: BLE001 - reported with what was measured
            # The first kernel launch compiles: a missing NVVM shows here.
            error = f"{type(e).__name__}: {e}"
            path = write_results("dha_layers", {**doc, "layers": layers, "partial": True,
                                                "error": f"{spec['name']}: {error}"})
            print(f"measuring {spec['name']} failed: {error}\n(`rtmem doctor` says whether "
                  f"numba-cuda finds NVVM; see CUDA_HOME there); wrote {path}",
                  file=sys.stderr)
            return 1
        print(f"  measured {spec['name']}", flush=True)
    rows = [[r["name"], r["kind"], f"{r['param_bytes'] / 2**20:.2f}",
             f"{r['transfer_s'] * 1e3:.3f}"]
            + [f"{r['forward_s'][m] * 1e3:.3f}" for m in FORWARD_MODES]
            + [f"{r['backward_s'][m] * 1e3:.3f}" for m in BACKWARD_MODES]
            + [f"{r['forward_s']['dha'] / r['forward_s']['copy']:.2f}",
               "yes" if r["dha_matches_gpu"] else "NO"] for r in layers]
    print(format_table(["layer", "kind", "MiB", "T_trans"]
                       + [f"fwd {m}" for m in FORWARD_MODES]
                       + [f"bwd {m}" for m in BACKWARD_MODES] + ["dha/copy fwd", "bitwise"],
                       rows, align="ll" + "r" * (len(rows[0]) - 2)))
    doc.update(dtype="float32", repeats=repeats, layers=layers, modes={
        "gpu": "params and grads in HBM",
        "copy": "fwd: H2D copy of the params then compute; bwd: compute then D2H copy "
                "of the grads (serial)",
        "dha": "params in mapped host memory, grads to HBM",
        "gpu_go": "params in HBM, grads written to mapped host memory",
        "dha_go": "params and grads in mapped host memory"})
    print(f"\nwrote {write_results('dha_layers', doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
