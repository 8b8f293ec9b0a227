"""``rtmem bench pcie|dha|adam|allocator``: rtmem's benchmarks.

Thin front ends over the scripts of ``bench/``: ``pcie.py`` (PCIe copy and DHA
bandwidth, contention, small-transfer latency; GPU) and ``dha_layers.py``
(per-layer cost of on-GPU vs DHA vs copy-then-compute, the JSON a DHA planner
consumes; GPU), ``adam.py`` (the fused CPU Adam against torch and a memory
roofline; CPU) and ``allocator.py`` (the best-fit allocator against a naive
best fit, on the host backend without a GPU; with one, against CuPy's and
torch's pools too). Each takes the script's options, writes the script's JSON
and returns its exit code. The scripts live in the source tree, not in the
installed package, so these commands run from a checkout. ``pcie`` and ``dha``
return 0 also when no GPU is found (nothing is measured or written then, and
the message says so).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys

__all__ = ["register", "bench_dir"]

#: Files that make a folder rtmem's own ``bench/``: a ``bench`` folder beside an
#: installed rtmem (``site-packages/bench``) may be another distribution's.
_BENCH_MARKERS = ("_common.py", "gpu_session.sh")


def _names_rtmem(pyproject: str) -> bool:
    """Whether the file ``pyproject`` declares the project ``rtmem`` (a line
    ``name = "rtmem"``; read as text: tomllib is Python >= 3.11 only)."""
    try:
        with open(pyproject, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return False
    return re.search(r"""^name\s*=\s*["']rtmem["']\s*(#.*)?$""", text, re.M) is not None


def bench_dir() -> str:
    """The ``bench/`` folder of the checkout (or unpacked sdist) this rtmem was
    imported from.

    Raises FileNotFoundError when rtmem was not imported from one: an installed
    rtmem sits in ``site-packages``, where a ``bench`` folder would belong to some
    other distribution, whose scripts ``rtmem bench`` must not run. The folder is
    rtmem's when its parent has a pyproject.toml naming rtmem and it holds
    bench/_common.py and bench/gpu_session.sh.
    """
    package = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(package)
    bench = os.path.join(root, "bench")
    if _names_rtmem(os.path.join(root, "pyproject.toml")) and \
            all(os.path.isfile(os.path.join(bench, m)) for m in _BENCH_MARKERS):
        return bench
    raise FileNotFoundError(f"this rtmem ({package}) is not in a checkout of rtmem: {root} "
                            f"has no pyproject.toml naming rtmem beside a bench/ folder "
                            f"with {' and '.join(_BENCH_MARKERS)}; the benchmarks ship "
                            f"with the source tree, not the installed package: run this "
                            f"from a checkout or the unpacked sdist (pip install -e .), or "
                            f"run the script there directly")


def _load(script: str):
    """bench/SCRIPT as the module its stem names (``adam``), in ``sys.modules``
    with bench/ on ``sys.path``, as ``python bench/SCRIPT`` and the tests import
    it; None when the file is missing.

    The name matters to numba's cache: a ``cache=True`` function records its
    module's name, and a later process loading the cache imports that name. A
    module outside ``sys.modules`` was recorded as ``<dynamic>``, which no
    process can import: after one ``rtmem bench adam`` every later run of the
    benchmark (by rtmem or as a script) failed with ModuleNotFoundError."""
    path = os.path.join(bench_dir(), script)
    if not os.path.isfile(path):
        return None
    name = os.path.splitext(script)[0]
    here = sys.modules.get(name)
    if here is not None and os.path.realpath(getattr(here, "__file__", None) or "") == \
            os.path.realpath(path):
        return here                      # already imported (a test, another command)
    if os.path.dirname(path) not in sys.path:
        sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _run(script: str, argv: list[str], prog: str) -> int:
    module = _load(script)
    if module is None:
        print(f"rtmem bench: {os.path.join(bench_dir(), script)} not found; the benchmarks "
              "ship with the source tree, so run this from a checkout of rtmem "
              "(or run the script directly)", file=sys.stderr)
        return 1
    # prog: the script's usage messages said "usage: rtmem [-h] [--quick] ..."
    return int(module.main(argv, prog=prog) or 0)


def _flags(args, names, switches=("quick",)) -> list[str]:
    """The script's command line for ``args``: each of ``switches`` given, then
    each option of ``names`` given a value, as ``--name=value``."""
    argv = [f"--{name}" for name in switches if getattr(args, name.replace("-", "_"))]
    for name in names:
        value = getattr(args, name.replace("-", "_"))
        if value is not None:
            # one token: a value starting with '-' (a plot named -run1.png) was read
            # by the script's parser as an option ("expected one argument")
            argv.append(f"--{name}={value}")
    return argv


def _cmd_pcie(args) -> int:
    return _run("pcie.py", _flags(args, ("max-size", "repeats", "plot")), "rtmem bench pcie")


def _cmd_dha(args) -> int:
    return _run("dha_layers.py", _flags(args, ("model", "tokens", "repeats", "sweep")),
                "rtmem bench dha")


def _cmd_adam(args) -> int:
    return _run("adam.py", _flags(args, ("sizes", "repeats", "budget", "gpt2-hidden", "out"),
                                  switches=("warm-cache",)), "rtmem bench adam")


def _cmd_allocator(args) -> int:
    return _run("allocator.py", _flags(args, ("repeats", "out")), "rtmem bench allocator")


def register(subparsers) -> None:
    """Add ``bench`` (with ``pcie``, ``dha``, ``adam`` and ``allocator``) to an
    argparse ``subparsers`` object; each ``func(args)`` returns the exit code."""
    # the scripts check these too; checked here as well so that `rtmem bench`'s own
    # usage names them (a plain int said "invalid int value" for 2.5)
    from rtmem.cli import MAX_REPEATS, at_least, count, output_file
    p = subparsers.add_parser("bench", help="benchmarks: PCIe/DHA bandwidth and per-layer "
                              "DHA cost (GPU), CPU Adam, allocator",
                              description=__doc__.splitlines()[0].replace("``", ""))
    sub = p.add_subparsers(dest="bench", metavar="BENCH")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    q = sub.add_parser("pcie", help="copy (pageable, pinned, both ways) and DHA bandwidth "
                       "from 4 KiB to 1 GiB, contention, latency; JSON + plot")
    q.add_argument("--quick", action="store_true", help="up to 64 MiB, 3 repeats")
    q.add_argument("--max-size", default=None, help="largest buffer, e.g. 256MiB (default 1GiB)")
    q.add_argument("--repeats", type=count(high=MAX_REPEATS), default=None,
                   help="timed runs per point")
    # the script puts the plot next to its JSON, in $RTMEM_BENCH_RESULTS when set
    q.add_argument("--plot", default=None,
                   help="plot file, .png, .pdf or .svg (default next to the JSON: "
                        "bench/results/pcie.png, or $RTMEM_BENCH_RESULTS/pcie.png when set)")
    q.set_defaults(func=_cmd_pcie)
    q = sub.add_parser("dha", help="per-layer forward/backward time on-GPU vs DHA vs "
                       "copy-then-compute (GPT-2 layers); JSON for the DHA planner")
    q.add_argument("--quick", action="store_true",
                   help="1024 tokens, 3 repeats, sweep 64,512,4096")
    q.add_argument("--model", default=None,
                   help="gpt2, gpt2-medium, gpt2-large or gpt2-xl (default gpt2)")
    q.add_argument("--tokens", type=count(), default=None, help="tokens per batch (default 4096)")
    q.add_argument("--repeats", type=count(high=MAX_REPEATS), default=None,
                   help="timed runs per mode")
    q.add_argument("--sweep", default=None,
                   help="token counts of the DHA-vs-copy crossover sweep, comma-separated, "
                        "or none (default 64,256,1024,4096,16384,65536)")
    q.set_defaults(func=_cmd_dha)
    q = sub.add_parser("adam", help="fused CPU Adam (fp32, bf16, fp16 grads) vs torch.optim.Adam "
                       "(and DeepSpeed when installed) vs a memory roofline; CPU; JSON")
    # --sizes is read by the script (its usage then names `rtmem bench adam`)
    q.add_argument("--sizes", default=None,
                   help="comma-separated parameter counts (default 1e6,1e7,5e7,1e8)")
    q.add_argument("--repeats", type=count(high=MAX_REPEATS), default=None,
                   help="minimum timed rounds per size (default 5)")
    q.add_argument("--budget", type=at_least(0.0, float), default=None,
                   help="seconds of timed rounds per size; small sizes get more rounds, "
                        "up to 50 (default 12)")
    q.add_argument("--gpt2-hidden", type=at_least(0), default=None,
                   help="hidden size of the GPT-2-shaped row (148 tensors, many small; "
                        "768 is GPT-2 small), 0 to skip it (default 192 without --sizes)")
    q.add_argument("--warm-cache", action="store_true",
                   help="do not evict caches before each timed call")
    q.add_argument("--out", type=output_file(replace=True), default=None,
                   help="JSON output path (default: adam.json in bench/results or "
                        "$RTMEM_BENCH_RESULTS)")
    q.set_defaults(func=_cmd_adam)
    q = sub.add_parser("allocator", help="best-fit allocator vs a naive best fit (random and "
                       "GPT-2 traces, fragmentation, static layout, pinned overhead) on the "
                       "host backend; on a GPU vs CuPy's and torch's pools too; JSON")
    q.add_argument("--quick", action="store_true", help="small traces (smoke run)")
    q.add_argument("--repeats", type=count(high=MAX_REPEATS), default=None,
                   help="timing repeats (median; default 7, 3 with --quick)")
    q.add_argument("--out", type=output_file(replace=True), default=None,
                   help="JSON output path (default: allocator.json in bench/results or "
                        "$RTMEM_BENCH_RESULTS)")
    q.set_defaults(func=_cmd_allocator)
