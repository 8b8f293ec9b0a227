"""``rtmem bench pcie`` and ``rtmem bench dha``: the GPU microbenchmarks.

Thin front ends over the scripts ``bench/pcie.py`` (PCIe copy and DHA bandwidth,
contention, small-transfer latency) and ``bench/dha_layers.py`` (per-layer cost
of on-GPU vs DHA vs copy-then-compute, the JSON a DHA planner consumes). The
scripts live in the source tree, not in the installed package, so these commands
run from a checkout. Each returns the script's exit code: 0 also when no GPU is
found (nothing is measured or written then, and the message says so).
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
    path = os.path.join(bench_dir(), script)
    if not os.path.isfile(path):
        return None
    name = f"_rtmem_bench_{os.path.splitext(script)[0]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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


def _flags(args, names) -> list[str]:
    argv = ["--quick"] if args.quick else []
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


def register(subparsers) -> None:
    """Add ``bench`` (with ``pcie`` and ``dha``) to an argparse ``subparsers``
    object; each ``func(args)`` returns the exit code."""
    # the scripts check these too; checked here as well so that `rtmem bench`'s own
    # usage names them (a plain int said "invalid int value" for 2.5)
    from rtmem.cli import MAX_REPEATS, count
    p = subparsers.add_parser("bench", help="GPU microbenchmarks: PCIe/DHA bandwidth, "
                              "per-layer DHA cost",
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
