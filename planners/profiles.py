"""Built-in chains: analytic GPT-2-style transformers and ResNet-style CNNs.

Sizes are computed in bytes from the architecture (which tensors autograd saves),
times from FLOP counts at a given rate. They are realistic heterogeneous chains for
demos, tests and benchmarks, not measurements: profile your own model with
``rtmem.torch`` for that.

A few configurations are shipped as JSON package data (``profiles/*.json``);
:func:`builtin` loads them by name and :func:`from_spec` builds any other size,
e.g. ``from_spec("gpt2:layers=48,hidden=1600,batch=4")``.
"""

from __future__ import annotations

import json
import math
from importlib import resources

import numpy as np

from rtmem.errors import ChainError

from ._validation import is_int
from .chain import Chain

__all__ = ["gpt2", "resnet", "builtin", "builtin_names", "from_spec"]

#: Default compute rate, FLOP/s: a round figure for a modern GPU in mixed precision.
DEFAULT_FLOPS = 100e12

# name -> (generator, kwargs); the JSON files are written from this table.
SHIPPED = {
    "gpt2-small": ("gpt2", dict(layers=12, hidden=768, heads=12, seq=1024, batch=8)),
    "gpt2-medium": ("gpt2", dict(layers=24, hidden=1024, heads=16, seq=1024, batch=8)),
    "gpt2-large": ("gpt2", dict(layers=36, hidden=1280, heads=20, seq=1024, batch=8)),
    "gpt2-xl": ("gpt2", dict(layers=48, hidden=1600, heads=25, seq=1024, batch=8)),
    "resnet50": ("resnet", dict(depth=50, image=224, batch=64)),
    "resnet101": ("resnet", dict(depth=101, image=1000, batch=8)),
    "resnet152": ("resnet", dict(depth=152, image=500, batch=16)),
    "resnet1001": ("resnet", dict(depth=1001, image=224, batch=8)),
}


def _finite(v) -> bool:
    """A finite real number (not a bool)."""
    return (not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating))
            and math.isfinite(v))


def _check_sizes(family: str, flops, **sizes) -> None:
    """ChainError unless every size is a positive integer and ``flops`` a finite
    positive FLOP/s (finiteness first: ``int(inf)`` and ``int(nan)`` raise)."""
    for key, v in sizes.items():
        # an integer type, not 2.0: a float passed here failed later in range()
        # with "'float' object cannot be interpreted as an integer"
        if not is_int(v) or v < 1:
            raise ChainError(f"{family}: {key} must be a positive integer, got {v!r}",
                             field=key)
    if not (_finite(flops) and flops > 0):
        raise ChainError(f"{family}: flops must be a finite number > 0 FLOP/s, got "
                         f"{flops!r}", field="flops")


def gpt2(layers: int = 12, hidden: int = 768, heads: int = 12, seq: int = 1024,
         batch: int = 8, vocab: int = 50257, act_bytes: int = 2, weight_bytes: int = 2,
         flops: float = DEFAULT_FLOPS, name: str | None = None) -> Chain:
    """A GPT-2-style decoder as a chain: embedding, ``layers`` pre-LN blocks, LM head.

    Per block (s = seq, b = batch, h = hidden, a = heads, p = ``act_bytes``):
    the output is ``s*b*h*p`` bytes; what backward needs (xbar) counts LN outputs,
    Q/K/V, softmax output and its dropout mask, context, residual, the 4h MLP
    tensors and the dropout masks, i.e. ``(16 p + 2) s b h + (2 p + 1) a s^2 b``
    bytes (34 sbh + 5 a s^2 b at p = 2, as in Korthikanti et al. 2022). Forward
    FLOPs are ``24 b s h^2 + 4 b s^2 h``, backward twice that; times are
    FLOPs / ``flops`` (FLOP/s). Weights: ``12 h^2 + 13 h`` parameters of
    ``weight_bytes`` each. The LM head outputs ``b s vocab`` logits, and the loss
    needs a float32 softmax of them as temporary memory.
    """
    _check_sizes("gpt2", flops, layers=layers, hidden=hidden, heads=heads, seq=seq,
                 batch=batch, vocab=vocab, act_bytes=act_bytes, weight_bytes=weight_bytes)
    if hidden % heads:
        raise ChainError(f"gpt2: hidden = {hidden} must be a multiple of heads = {heads}",
                         field="heads")
    s, b, h, a, p, V = seq, batch, hidden, heads, act_bytes, vocab
    sbh = s * b * h
    attn = a * s * s * b
    u_f, u_b, x, xbar, w, o_f, o_b = [], [], [], [], [], [], []

    def stage(fwd_flops, out, saved, weights, tmp_f, tmp_b):
        u_f.append(fwd_flops / flops)
        u_b.append(2 * fwd_flops / flops)
        x.append(out)
        xbar.append(saved)
        w.append(weights)
        o_f.append(tmp_f)
        o_b.append(tmp_b)

    # embedding: token gather + position add + dropout (mask of 1 byte per element)
    stage(2 * sbh, sbh * p, sbh * p + sbh, (V * h + s * h) * weight_bytes, 0, sbh * p)
    for _ in range(layers):
        stage(24 * b * s * h * h + 4 * b * s * s * h, sbh * p,
              (16 * p + 2) * sbh + (2 * p + 1) * attn,
              (12 * h * h + 13 * h) * weight_bytes, attn * p, attn * p + 4 * sbh * p)
    # final LayerNorm + LM head (weights tied to the embedding: not counted twice)
    logits = s * b * V * p
    stage(2 * sbh * V, logits, sbh * p + logits, 2 * h * weight_bytes, 0, sbh * 4)
    return Chain(u_f=u_f, u_b=u_b, x=x, xbar=xbar, w=w, o_f=o_f, o_b=o_b, x0=s * b * 8,
                 u_loss=4 * s * b * V / flops, o_loss=s * b * V * 4,
                 name=name or f"gpt2-L{layers}-h{hidden}-s{seq}-b{batch}")


_RESNET_LAYOUT = {
    18: ("basic", [2, 2, 2, 2]), 34: ("basic", [3, 4, 6, 3]),
    50: ("bottleneck", [3, 4, 6, 3]), 101: ("bottleneck", [3, 4, 23, 3]),
    152: ("bottleneck", [3, 8, 36, 3]), 200: ("bottleneck", [3, 24, 36, 3]),
    # He et al. 2016 ("Identity mappings"): 3 groups of 111 bottlenecks
    1001: ("bottleneck", [111, 111, 111]),
}


def resnet(depth: int = 50, image: int = 224, batch: int = 32, classes: int = 1000,
           act_bytes: int = 4, weight_bytes: int = 4, flops: float = DEFAULT_FLOPS / 4,
           name: str | None = None) -> Chain:
    """A ResNet-style CNN as a chain: stem, one stage per residual block, head.

    ``depth`` is one of 18, 34, 50, 101, 152, 200 (ImageNet layouts) or 1001 (three
    groups of 111 bottleneck blocks). Per block, xbar counts every conv and BN
    output (ReLU in place), the projection shortcut when present, and the block
    output; sizes in bytes at ``act_bytes`` per element. Times are conv FLOPs /
    ``flops`` (FLOP/s), backward twice the forward.
    """
    # 50.0 matched the key 50 and named the chain "resnet50.0"
    if not is_int(depth) or depth not in _RESNET_LAYOUT:
        raise ChainError(f"resnet: depth must be one of {sorted(_RESNET_LAYOUT)}, got "
                         f"{depth!r}", field="depth")
    _check_sizes("resnet", flops, image=image, batch=batch, classes=classes,
                 act_bytes=act_bytes, weight_bytes=weight_bytes)
    if image < 32:
        raise ChainError(f"resnet: image must be >= 32 pixels, got {image}", field="image")
    kind, blocks = _RESNET_LAYOUT[depth]
    b, p = batch, act_bytes
    u_f, u_b, x, xbar, w = [], [], [], [], []

    def stage(fwd_flops, out_elems, saved_elems, params):
        u_f.append(fwd_flops / flops)
        u_b.append(2 * fwd_flops / flops)
        x.append(out_elems * b * p)
        xbar.append(saved_elems * b * p)
        w.append(params * weight_bytes)

    hw = (image // 2) ** 2                      # stem conv 7x7 stride 2
    stem_out = 64 * (image // 4) ** 2           # after 3x3 max-pool stride 2
    stage(2 * b * hw * 3 * 64 * 49, stem_out, 2 * 64 * hw + stem_out, 3 * 64 * 49 + 128)
    size = image // 4
    c_in = 64
    widths = [64, 128, 256, 512][:len(blocks)]
    for g, (n_blocks, m) in enumerate(zip(blocks, widths)):
        for k in range(n_blocks):
            stride = 2 if (k == 0 and g > 0) else 1
            out_size = (size + stride - 1) // stride
            hw_in, hw_out = size * size, out_size * out_size
            if kind == "bottleneck":
                c_out = 4 * m
                fl = 2 * b * (hw_in * c_in * m + hw_out * 9 * m * m + hw_out * m * c_out)
                saved = 2 * m * hw_in + 2 * m * hw_out + 2 * c_out * hw_out + c_out * hw_out
                params = c_in * m + 9 * m * m + m * c_out + 2 * (2 * m + c_out)
            else:
                c_out = m
                fl = 2 * b * hw_out * 9 * (c_in * m + m * m)
                saved = 4 * m * hw_out + c_out * hw_out
                params = 9 * (c_in * m + m * m) + 4 * m
            if stride != 1 or c_in != c_out:     # projection shortcut
                fl += 2 * b * hw_out * c_in * c_out
                saved += 2 * c_out * hw_out
                params += c_in * c_out + 2 * c_out
            stage(fl, c_out * hw_out, saved, params)
            c_in, size = c_out, out_size
    stage(2 * b * c_in * classes + b * c_in * size * size, classes, c_in + classes,
          c_in * classes + classes)
    return Chain(u_f=u_f, u_b=u_b, x=x, xbar=xbar, w=w, x0=3 * image * image * b * p,
                 u_loss=10 * b * classes / flops, o_loss=b * classes * 4,
                 name=name or f"resnet{depth}-{image}px-b{batch}")


_GENERATORS = {"gpt2": gpt2, "resnet": resnet}


def builtin_names() -> list[str]:
    """Names of the chains shipped as package data."""
    return sorted(SHIPPED)


def builtin(name: str) -> Chain:
    """Load a shipped chain by name (see :func:`builtin_names`)."""
    if name not in SHIPPED:
        raise ChainError(f"unknown built-in chain {name!r}; available: "
                         f"{', '.join(builtin_names())} (or a spec such as "
                         "'gpt2:layers=6,batch=2', or a path to a chain JSON file)")
    text = resources.files("rtmem.planners").joinpath("profiles", f"{name}.json").read_text()
    return Chain.from_json(text)


def from_spec(spec: str) -> Chain:
    """Build a chain from ``"gpt2"``, ``"gpt2-small"`` or ``"gpt2:layers=6,seq=512"``.

    A shipped name loads its JSON; ``family:key=value,...`` calls the generator
    with those keyword arguments (integers, or floats such as ``flops=50e12``).
    """
    if spec in SHIPPED:
        return builtin(spec)
    family, _, args = spec.partition(":")
    if family not in _GENERATORS:
        raise ChainError(f"unknown chain {spec!r}: expected a built-in name "
                         f"({', '.join(builtin_names())}) or a spec starting with "
                         f"{' / '.join(sorted(_GENERATORS))}, e.g. 'gpt2:layers=6'")
    kwargs, typed = {}, {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ChainError(f"cannot read {item!r} in {spec!r}; write key=value")
        if key.strip() in kwargs:
            raise ChainError(f"{key.strip()} is given twice in {spec!r}")
        try:
            num = float(value)
        except ValueError as e:
            raise ChainError(f"{key} = {value!r} in {spec!r} is not a number") from e
        kwargs[key.strip()] = int(num) if num.is_integer() and "e" not in value.lower() \
            and "." not in value else num
        typed[key.strip()] = value.strip()
    try:
        return _GENERATORS[family](**kwargs)
    except TypeError as e:
        raise ChainError(f"bad arguments in {spec!r}: {e}") from e
    except ChainError as e:
        # the generators name the number they were given: layers=1e3 (a float, so
        # not a count) was reported as "got 1000.0", which the user never wrote
        key = e.field
        if key in typed and typed[key] != repr(kwargs[key]):
            got = f"got {kwargs[key]!r}"
            message = (str(e).replace(got, f"got {typed[key]!r} (read as {kwargs[key]!r})")
                       if got in str(e) else f"{e} ({key}={typed[key]} in {spec!r})")
            raise ChainError(message, field=e.field, index=e.index) from e
        raise


def _write_shipped(directory) -> None:
    """Regenerate the shipped JSON files (run by the maintainers, not at import)."""
    import pathlib
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name, (family, kwargs) in SHIPPED.items():
        chain = _GENERATORS[family](**kwargs, name=name)
        (out / f"{name}.json").write_text(json.dumps(chain.to_dict()) + "\n")


if __name__ == "__main__":  # python -m rtmem.planners.profiles DIR
    import sys
    _write_shipped(sys.argv[1] if len(sys.argv) > 1 else "planners/profiles")
