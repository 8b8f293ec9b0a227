"""The ``rtmem`` command line: chains, demo (and simulate, plan, profile, doctor, bench).

Subcommands owned by other modules register themselves through a
``register(subparsers)`` function (see ``_PLUGINS``; ``simulate``, first in
``--help``, through :func:`rtmem.cli_simulate.add_parser`), so this file stays
small. The parser class and the failure JSON live in :mod:`rtmem.cli_parser`.
Every subcommand returns an exit code: 0 success, 1 an rtmem error (message on
stderr), 2 bad usage (argparse), 130 stopped by Ctrl-C (files it was writing are
left as they were: see :mod:`rtmem._files`). A subcommand run with ``--json`` that fails
also prints one JSON object on stdout (see :func:`error_document`), so a script
reading stdout always has JSON to parse; bad usage too, when ``--json`` is on the
command line (exit 2, argparse's message on stderr as without it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import sys

from rtmem._table import format_table
# what moved out of this file, re-exported: its users import it from here
from rtmem.cli_parser import USAGE_ERROR, CommandParser, error_document  # noqa: F401
from rtmem.cli_simulate import add_parser as add_simulate_parser
from rtmem.cli_simulate import load_schedule, load_schedule_and_plan
from rtmem.demo import MODEL_OPTIONS, missing_folders, remove_empty_folders
from rtmem.errors import RtmemError
from rtmem.units import format_bytes, format_seconds

__all__ = ["main", "CommandParser", "add_model_size_args", "at_least", "count", "error_document",
           "load_chain", "load_schedule", "load_schedule_and_plan", "model_sizes_problem",
           "output_file", "platform_value",
           "require_plotting", "save_document", "stdout_table", "torch_device_problem",
           "torch_oom", "writable"]

#: File types a plot can be written as (matplotlib picks the format by suffix).
PLOT_SUFFIXES = ("png", "pdf", "svg", "jpg", "jpeg", "eps")

# modules that add subcommands with register(subparsers)
_PLUGINS = ("rtmem.cli_plan", "rtmem.cli_profile", "rtmem.doctor", "rtmem.cli_bench")


def load_chain(spec: str):
    """A chain from a path to a chain JSON file, a built-in name or a generator spec
    (``gpt2:layers=6``)."""
    from rtmem.errors import ChainError
    from rtmem.planners import Chain, from_spec
    if os.path.isdir(spec):
        # a folder named like a built-in chain (an output folder "resnet50") must
        # not hide it: it said "[Errno 21] Is a directory: 'resnet50'"
        try:
            return from_spec(spec)
        except ChainError:
            pass
    if os.path.exists(spec):
        return Chain.load(spec)
    if spec.lower().endswith(".json"):
        raise ChainError(f"no chain file {spec!r}; give an existing chain JSON file, a "
                         f"built-in name (rtmem chains) or a spec like gpt2:layers=6")
    return from_spec(spec)


def writable(path: str, replace: bool = False) -> str | None:
    """Why ``path`` cannot be written, or None when it can: its missing folders
    are made and the file created, then both removed again (a file that exists
    is only checked with ``os.access``, so it is left as it was). With
    ``replace``, for a file written beside ``path`` and renamed over it, a
    probe file beside it is created and removed instead. A folder cannot be
    written. Checked before the work whose result goes there: ``rtmem plan
    remat --save /proc/x.json`` failed with "[Errno 2]" after the whole solve."""
    parent = os.path.dirname(os.path.abspath(path))
    made = missing_folders(parent)
    for folder in reversed(made):
        if os.path.lexists(folder):
            # makedirs said "[Errno 17] File exists" (or named a folder below it)
            return f"{folder!r} is not a folder"
    try:
        os.makedirs(parent, exist_ok=True)
        if os.path.isdir(path):
            return "it is a folder; give a file name"
        if replace:
            # written beside it, then renamed over it (bench's write_results): the
            # folder must take a new file; the file's own mode does not matter
            probe = f"{path}.{os.getpid()}.probe"
            with open(probe, "x"):
                pass
            os.unlink(probe)
        elif os.path.exists(path):
            if not os.access(path, os.W_OK):
                return "permission denied"
        elif not os.path.lexists(path):      # (a dangling link: its target is made later)
            with open(path, "x"):
                pass
            os.unlink(path)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and e.filename != path else ""
        return f"{(e.strerror or str(e)).lower()}{where}"
    finally:
        # also those above a folder makedirs failed to make (a name too long)
        remove_empty_folders(made)
    return None


def save_document(doc, path: str) -> None:
    """``doc.save(path)`` (a Chain or Plan) after making ``path``'s missing
    folders, which :func:`output_file` accepted: the save failed with "[Errno 2]
    No such file or directory" after the whole solve or profile."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc.save(path)


def output_file(*suffixes, replace: bool = False):
    """An argparse ``type=`` for a file to write: refuses folders, paths that
    cannot be written (:func:`writable`, with ``replace`` for a file written
    beside and renamed over) and, when ``suffixes`` are given, other file
    types, before any work is done."""
    def check(value: str) -> str:
        if not value.strip():
            # --save '' was accepted and then skipped (`if args.save`): exit 0, no file
            raise argparse.ArgumentTypeError("the file name is empty")
        if value.endswith(("/", os.sep)) or os.path.isdir(value):
            raise argparse.ArgumentTypeError(f"{value!r} is a folder; give a file name")
        ext = os.path.splitext(value)[1].lower().lstrip(".")
        if suffixes and ext not in suffixes:
            ends = [f".{s}" for s in suffixes]
            ends = ends[0] if len(ends) == 1 else f"{', '.join(ends[:-1])} or {ends[-1]}"
            raise argparse.ArgumentTypeError(f"{value!r}: the file name must end in {ends}")
        problem = writable(value, replace)
        if problem:
            raise argparse.ArgumentTypeError(f"cannot write {value!r}: {problem}")
        return value
    return check


def at_least(low, kind=int, high=None):
    """An argparse ``type=`` for a finite ``kind`` (int or float) number in
    ``low`` .. ``high``: a count of 0 (a median of nothing), a negative size or
    a NaN is refused as bad usage (exit 2) before any work, not met as a
    traceback after minutes of it. The bench scripts use it too."""
    def check(value: str):
        try:
            x = kind(value)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(
                f"{value!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (math.isfinite(x) and low <= x <= (math.inf if high is None else high)):
            raise argparse.ArgumentTypeError(
                f"must be {'a finite number, ' if kind is float else ''}at least {low}"
                + ("" if high is None else f" and at most {high}") + f", got {value}")
        return x
    return check


#: The largest count an option takes (``--tokens``, ``--ops``): a C int, the size
#: numpy, numba and torch take counts as; beyond it the run raised an
#: OverflowError ("cannot fit 'int' into an index-sized integer") after the work
#: before it.
MAX_COUNT = 2**31 - 1
#: The most timed runs of one point (``--repeats``): a median over more moves by
#: less than the machine drifts meanwhile, and a slip such as 1e20 ran until killed.
MAX_REPEATS = 100_000
#: The most threads ``--threads`` asks torch for: 2**31 - 1 made OpenMP allocate
#: hundreds of GB ("libgomp: Out of memory"), 10**20 overflowed in torch.
MAX_THREADS = 4096


def count(low: int = 1, high: int = MAX_COUNT):
    """An argparse ``type=`` for a count (runs, threads, tokens, operations): an
    integer written in digits, ``low`` .. ``high`` (:data:`MAX_REPEATS` for
    ``--repeats``, :data:`MAX_THREADS` for ``--threads``); anything else is bad
    usage (exit 2) saying "must be at least LOW and at most HIGH, got VALUE" or
    "VALUE is not an integer", before any work. One check for ``rtmem`` and the
    bench scripts, so that every count reads alike: plain ``int`` options took 0
    and negatives to a generic check after parsing, and huge values to a crash
    (or a run without end)."""
    return at_least(low, int, high)


def platform_value(field: str):
    """An argparse ``type=`` for ``--memory`` (``field="memory"``) or ``--bandwidth``:
    the value is read as :class:`~rtmem.planners.Platform` reads it and returned
    as given, so a bad one is bad usage (exit 2) before any work, as ``rtmem demo
    --memory`` and ``rtmem bench pcie --max-size`` are; ``rtmem plan remat`` and
    ``rtmem simulate`` refused it with exit 1, after loading the chain."""
    def check(value: str) -> str:
        from rtmem.errors import PlatformError
        from rtmem.planners import Platform
        try:
            Platform(**({"memory": value} if field == "memory" else
                        {"memory": math.inf, field: value}))
        except PlatformError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value
    return check


def _platform(args):
    from rtmem.planners import Platform
    return Platform(args.memory, args.bandwidth, args.channel)


def _add_platform_args(p):
    p.add_argument("--memory", required=True, type=platform_value("memory"),
                   help="device memory budget, e.g. 12GiB or inf")
    p.add_argument("--bandwidth", default="inf", type=platform_value("bandwidth"),
                   help="host link bandwidth, e.g. '12 GB/s'")
    p.add_argument("--channel", default="shared", choices=("shared", "duplex"),
                   help="one link for both directions (shared) or one per direction")


# ----------------------------------------------------------------- subcommands
def _cmd_chains(args) -> int:
    from rtmem.planners import Platform, builtin, builtin_names, simulate, store_all_schedule
    rows, docs = [], []
    for name in builtin_names():
        c = builtin(name)
        peak = simulate(c, store_all_schedule(c.n), Platform(math.inf)).peak
        rows.append([name, c.n, format_seconds(c.compute_time), format_bytes(c.xbar.sum()),
                     format_bytes(c.w.sum()), format_bytes(peak)])
        docs.append({"name": name, "stages": c.n, "compute_s": c.compute_time,
                     "sum_xbar_bytes": int(c.xbar.sum()), "weight_bytes": int(c.w.sum()),
                     "store_all_peak_bytes": peak})
    if args.json:
        print(json.dumps(docs, indent=1))
    else:
        print(stdout_table(["chain", "stages", "compute", "sum(xbar)", "weights",
                            "no-remat peak"], rows))
        print("\nAny size: gpt2:layers=..,hidden=..,heads=..,seq=..,batch=.. or "
              "resnet:depth=..,image=..,batch=..")
    return 0


def stdout_table(headers, rows, align=None) -> str:
    """:func:`~rtmem._table.format_table` for printing on stdout: its columns
    measured on the text stdout's encoding writes (:func:`_escaping_stdout`
    escapes what it cannot)."""
    return format_table(headers, rows, align=align,
                        encoding=getattr(sys.stdout, "encoding", None))


def require_plotting(args) -> None:
    """Raise plotting's ModuleNotFoundError (it names the ``plot`` extra) when
    ``args.plot`` asks for a plot and matplotlib is missing: called before the work
    whose result is plotted. Checked at the plot, `rtmem plan remat --plot`
    planned (seconds to minutes) and wrote --save, then failed and printed no
    table; `rtmem simulate --plot` printed its table, then exited 1."""
    if args.plot:
        from rtmem.plot import _matplotlib
        _matplotlib()


def _blocks(value: str) -> tuple:
    """An argparse ``type=`` for ``--blocks``: block counts per group, e.g. 2,2,2."""
    try:
        blocks = tuple(int(v) for v in value.split(","))
    except ValueError:
        blocks = ()
    if not blocks or min(blocks) < 1:
        raise argparse.ArgumentTypeError(
            f"{value!r}: give residual blocks per group as positive integers separated "
            f"by commas, e.g. 2,2,2")
    return blocks


def model_sizes_problem(args) -> str | None:
    """What is wrong with ``--model`` and the options that size it (``rtmem demo``,
    ``rtmem profile``), checked before any work, or None. Fills in the chosen
    built-in model's defaults; a model that is not built in (``rtmem profile``'s
    ``MODULE:FUNCTION``) takes none of them."""
    builtin = args.model in MODEL_OPTIONS
    for model, options in MODEL_OPTIONS.items():
        for name, default in options.items():
            if model != args.model and getattr(args, name) is not None:
                fix = (f"with --model {args.model} use "
                       f"{' '.join('--' + o for o in MODEL_OPTIONS[args.model])}"
                       if builtin else
                       f"--model {args.model} builds its own model: size it there")
                return f"--{name} sizes the {model} model; {fix}"
            if model == args.model and getattr(args, name) is None:
                setattr(args, name, default)
    if args.model == "gpt2" and args.hidden % args.heads:
        return f"--hidden {args.hidden} must be a multiple of --heads {args.heads}"
    if args.model == "resnet":
        # every group after the first halves the image (stride 2, rounded up);
        # batch norm in training needs more than one value per channel, which a
        # batch of one 1x1 image lacks (a ValueError traceback from profiling)
        side = args.image
        for _ in args.blocks[1:]:
            side = (side + 1) // 2
        if args.batch * side * side < 2:
            return (f"--batch {args.batch} with --image {args.image}: the last residual "
                    f"group sees {side}x{side} images, and batch norm needs more than one "
                    f"value per channel to train; use --batch 2 or more, or a larger "
                    f"--image")
    return None


def torch_device_problem(args, who: str) -> str | None:
    """What is wrong with running ``who`` ("the demo") on torch and ``--device``,
    or None: torch must be installed, the device a usable cpu or cuda one."""
    if importlib.util.find_spec("torch") is None:
        return f"{who} needs torch: pip install 'rtmem[torch]'"
    if args.device is not None:
        import torch
        try:
            dev = torch.device(args.device)
        except RuntimeError:
            return f"--device {args.device!r} is not a torch device; use cpu or cuda"
        if dev.type not in ("cpu", "cuda"):
            return f"--device {args.device!r}: {who} runs on cpu or cuda"
        if dev.type == "cuda" and not torch.cuda.is_available():
            return "--device cuda: torch sees no CUDA device here; use --device cpu"
    return None


def _demo_problem(args) -> str | None:
    """What is wrong with the demo's arguments, checked before any work, or None.
    Fills in the chosen model's defaults."""
    problem = model_sizes_problem(args)
    if problem:
        return problem
    # run_demo's makedirs said only "[Errno 17] File exists" or "No such file: ''"
    if not args.out.strip() or (os.path.exists(args.out) and not os.path.isdir(args.out)):
        return (f"--out {args.out!r} is not a folder; give a folder for the plots, plan "
                f"and chain")
    # before minutes of profiling: --out /proc failed at the first file written
    problem = writable(os.path.join(args.out, "chain.json"))
    if problem:
        return f"--out {args.out!r}: cannot write there: {problem}"
    if args.memory is not None:     # before minutes of profiling, not after
        from rtmem.planners.plan import as_budget
        try:
            as_budget(args.memory)
        except RtmemError as e:     # it names the value: said once, as `rtmem plan` does
            return f"--memory: {e}"
    if importlib.util.find_spec("matplotlib") is None:
        # both extras at once: without either, this named matplotlib alone, and
        # torch only after `pip install 'rtmem[plot]'`
        if importlib.util.find_spec("torch") is None:
            return "the demo needs torch and matplotlib: pip install 'rtmem[torch,plot]'"
        return "the demo needs matplotlib: pip install 'rtmem[plot]'"
    return torch_device_problem(args, "the demo")


def _cmd_demo(args) -> int:
    """Profile a small GPT-2 (or ResNet), plan under a budget, train with and
    without the plan."""
    from rtmem.demo import run_demo
    problem = _demo_problem(args)
    if problem:
        print(f"rtmem demo: error: {problem}", file=sys.stderr)
        return 2
    sizes = {name: getattr(args, name) for name in MODEL_OPTIONS[args.model]}
    try:
        run_demo(model=args.model, batch=args.batch, steps=args.steps, memory=args.memory,
                 slots=args.slots, out=args.out, device=args.device, **sizes)
    except RuntimeError as e:
        message = torch_oom(e)
        if message is None:
            raise
        print(f"{_prog(args)}: error: {message}; make the model smaller (--batch and the "
              f"sizes of --model {args.model}: "
              f"{' '.join('--' + o for o in MODEL_OPTIONS[args.model])})", file=sys.stderr)
        return 1
    return 0


def torch_oom(error: RuntimeError) -> str | None:
    """"out of host/device memory (torch's first line)" when ``error`` is torch
    running out of memory, else None. torch's allocators raise RuntimeErrors,
    not MemoryError: `rtmem demo --hidden 99999999999` ended in a traceback
    ("DefaultCPUAllocator: can't allocate memory"); CUDA's
    torch.OutOfMemoryError is a RuntimeError too."""
    device = type(error).__name__ == "OutOfMemoryError"
    if not (device or "can't allocate memory" in str(error)):
        return None
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"out of {'device' if device else 'host'} memory ({first})"


def add_model_size_args(p) -> None:
    """The options that size the built-in models (``MODEL_OPTIONS``; None when not
    given: :func:`model_sizes_problem` fills in the chosen model's defaults),
    ``--batch`` and ``--device``: shared by ``rtmem demo`` and ``rtmem profile``."""
    for name, default in MODEL_OPTIONS["gpt2"].items():
        p.add_argument(f"--{name}", type=at_least(2 if name == "vocab" else 1),
                       default=None, help=f"gpt2: default {default}")
    p.add_argument("--blocks", type=_blocks, default=None,
                   help="resnet: residual blocks per group, default 2,2,2")
    for name in ("width", "image"):
        default = MODEL_OPTIONS["resnet"][name]
        p.add_argument(f"--{name}", type=at_least(1), default=None,
                       help=f"resnet: default {default}")
    p.add_argument("--batch", type=at_least(1), default=4, help="batch size, default 4")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if usable)")


def build_parser() -> argparse.ArgumentParser:
    from rtmem import __version__
    parser = CommandParser(
        prog="rtmem", description="Memory runtime and planners for training DNNs larger "
        "than GPU memory.")
    parser.add_argument("--version", action="version", version=f"rtmem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("chains", help="list the built-in chains")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_chains)
    add_simulate_parser(sub)
    p = sub.add_parser("demo", help="the README's main job: profile, plan and train a "
                       "small GPT-2 (or ResNet) under a memory budget, with and without "
                       "rtmem")
    p.add_argument("--model", choices=sorted(MODEL_OPTIONS), default="gpt2",
                   help="gpt2 (sized by --layers --hidden --heads --seq --vocab) or resnet "
                   "(--blocks --width --image); default gpt2")
    add_model_size_args(p)
    for name, default in (("steps", 5), ("slots", 500)):
        p.add_argument(f"--{name}", type=at_least(1), default=default,
                       help=f"default {default}")
    p.add_argument("--memory", default=None,
                   help="device budget, e.g. 40MiB (default: half the no-remat peak)")
    p.add_argument("--out", default="out/demo",
                   help="folder for plots, plan and chain (default out/demo)")
    p.set_defaults(func=_cmd_demo)
    for name in _PLUGINS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:      # a plugin that exists but fails to import is a bug
                raise
            continue
        module.register(sub)
    return parser


def _prog(args) -> str:
    """The command as typed, subcommand included ("rtmem plan remat", "rtmem
    bench pcie"), as argparse names it in its own errors."""
    words = [args.command] + [w for w in (getattr(args, "planner", None),
                                          getattr(args, "bench", None)) if w]
    return "rtmem " + " ".join(words)


def report_error(args, message: str, error: BaseException | None = None) -> None:
    """Print ``PROG: error: MESSAGE`` on stderr and, when ``args`` asked for
    ``--json``, :func:`error_document` on stdout: with only the stderr line a
    script piping the JSON (``rtmem plan remat ... --json | jq``) got nothing to
    parse. The caller returns the exit code."""
    print(f"{_prog(args)}: error: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps(error_document(message, error), indent=1, allow_nan=False))


@contextlib.contextmanager
def _escaping_stdout():
    """Within the block, what stdout's encoding cannot write is printed as
    ``\\uXXXX`` escapes, as Python prints it on stderr: a chain or file name
    outside that encoding (``PYTHONIOENCODING=ascii``, a Windows code page on
    a redirected stdout) ended the table in a UnicodeEncodeError traceback,
    where the progress lines on stderr had printed it. The previous error
    handler is back afterwards (``main`` may run inside a caller's process)."""
    stream = sys.stdout
    changed = False
    # only a strict text stream of its own (not a StringIO, not one already lenient)
    if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
        try:
            stream.reconfigure(errors="backslashreplace")
            changed = True
        except (OSError, ValueError):   # closed, or a reader that went away
            pass
    try:
        yield
    finally:
        if changed:
            try:
                stream.reconfigure(errors="strict")
            except (OSError, ValueError):
                pass


#: The exit code of a command stopped by Ctrl-C (SIGINT): what a shell reports
#: for a command that SIGINT ended (128 + 2), as bench's scripts exit.
INTERRUPTED_EXIT = 130


def _interrupted() -> int:
    # files are written whole or not at all (rtmem._files): an interrupted save
    # left the previous file as it was
    print("rtmem: interrupted", file=sys.stderr)
    return INTERRUPTED_EXIT


def main(argv=None) -> int:
    """Entry point of the ``rtmem`` console script; returns the exit code."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)      # bad usage: exit 2, JSON too with --json
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with _escaping_stdout():
            return int(args.func(args) or 0)
    except BrokenPipeError:
        # The reader went away (rtmem chains --json | head -1): nothing to report
        # (it printed "error: [Errno 32] Broken pipe"). stdout goes to devnull so
        # that the interpreter's last flush does not raise again.
        try:
            fd = sys.stdout.fileno()
        except (OSError, ValueError):   # not a real file (captured output)
            return 1
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
        return 1
    # OSError: a file that cannot be read or written; ModuleNotFoundError: an
    # optional extra (torch, matplotlib) is not installed
    except (RtmemError, OSError, ModuleNotFoundError) as e:
        report_error(args, str(e), e)
        return 1
    except KeyboardInterrupt:
        return _interrupted()
    except SystemError as e:
        # Ctrl-C landing inside a jitted planner: numba's dispatcher returns with
        # the KeyboardInterrupt pending, and Python reports "CPUDispatcher(...)
        # returned a result with an exception set", an internal-looking crash
        if isinstance(e.__cause__ or e.__context__, KeyboardInterrupt):
            return _interrupted()
        raise
    except MemoryError as e:
        # numpy's "Unable to allocate 7.45 GiB for an array ..." for a problem
        # too large for this machine (gpt2:layers=999999999) was a traceback
        report_error(args, f"out of host memory ({str(e) or 'MemoryError'}); the problem "
                     f"is too large for this machine: make it smaller", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
