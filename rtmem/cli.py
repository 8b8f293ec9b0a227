"""The ``rtmem`` command line: chains, simulate, demo (and plan, profile, doctor, bench).

Subcommands owned by other modules register themselves through a
``register(subparsers)`` function (see ``_PLUGINS``), so this file stays small.
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
import re
import sys
import warnings

from rtmem._table import format_table
from rtmem.demo import MODEL_OPTIONS, missing_folders, remove_empty_folders
from rtmem.errors import RtmemError
from rtmem.units import format_bandwidth, format_bytes, format_seconds

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


def load_schedule(spec: str, chain):
    """A schedule from a file (text or JSON), ``store-all``, ``sequential:K`` (K
    segments) or literal schedule text."""
    return load_schedule_and_plan(spec, chain)[0]


def load_schedule_and_plan(spec: str, chain):
    """:func:`load_schedule`, and the :class:`~rtmem.planners.Plan` when ``spec``
    is a plan document (else None): its recorded peak tells a plan made for
    another chain of the same length."""
    from rtmem.errors import ScheduleError
    from rtmem.planners import Schedule, sequential_schedule, store_all_schedule
    from rtmem.planners._documents import naming_file, read_text
    from rtmem.planners.schedule import _DIGITS, OP_WORDS
    # a folder named "store-all" or "sequential:2" must not hide the keyword
    keyword = spec == "store-all" or spec.startswith("sequential:")
    if os.path.exists(spec) and not (keyword and os.path.isdir(spec)):
        text = read_text(spec, kind="schedule", error=ScheduleError, reason="parse")
        with naming_file(spec, ScheduleError):
            return _schedule_in_file(text)
    if not spec.strip():
        raise ScheduleError("the schedule is empty; give a path, 'store-all', "
                            "'sequential:K' or schedule text such as 'F_all 0, L, B 0'")
    if spec == "store-all":
        return store_all_schedule(chain.n), None
    if spec.startswith("sequential:"):
        k = spec.partition(":")[2]
        # ASCII digits only: str.isdigit also accepts "²" (int() then raises a raw
        # ValueError) and "٣" (read as 3)
        if not _DIGITS.fullmatch(k):
            raise ScheduleError(f"sequential:K needs an integer K written in digits 0-9, "
                                f"got {spec!r}")
        return sequential_schedule(chain.n, int(k)), None
    if "," in spec or "\n" in spec or spec.split()[0].lower() in OP_WORDS:
        return Schedule.from_text(spec), None
    raise ScheduleError(f"no schedule file {spec!r}; give a path, 'store-all', "
                        "'sequential:K' or schedule text such as 'F_all 0, L, B 0'")


def _schedule_in_file(text: str):
    """The schedule in a file's ``text`` and the plan when it is a plan document
    (else None): a plan document, a schedule document or schedule text."""
    from rtmem.errors import ScheduleError
    from rtmem.planners import Plan, Schedule
    if not text.strip():
        # read as a schedule of no operations: "the schedule ends before the
        # backward pass is complete"
        raise ScheduleError("the file is empty; give a file written by `rtmem plan remat "
                            "--save` or Schedule.save", reason="parse")
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            doc = None                           # Schedule.parse reports it
        if isinstance(doc, dict) and doc.get("format") == "rtmem.plan":
            plan = Plan.from_dict(doc)           # a plan saved by `rtmem plan`
            return plan.schedule, plan
        if isinstance(doc, dict) and doc.get("format") != "rtmem.schedule":
            # "expected 'rtmem.schedule'" sent a user holding `plan remat --json`'s
            # report (no schedule in it) looking for a schedule converter
            raise ScheduleError(
                f"the file is neither a schedule nor a plan document (its format is "
                f"{doc.get('format')!r}); give a file written by `rtmem plan remat "
                f"--save` or Schedule.save (the --json report holds no schedule)",
                reason="parse")
    return Schedule.parse(text), None


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


def _for_another_chain(error, schedule, chain):
    """``error`` (a ScheduleError of simulating ``schedule`` on ``chain``) with the
    executor's hint added when the schedule's forward and backward steps cover
    another number of stages than the chain has: a plan for a shorter chain
    fails at its loss, which "needs a26 ... compute it again or prefetch it
    first", with nothing pointing at the chain. Otherwise ``error`` itself."""
    from rtmem.errors import ScheduleError
    from rtmem.planners import Op
    steps = [stage for op, stage, _ in schedule
             if op in (Op.F_NONE, Op.F_CK, Op.F_ALL, Op.B)]
    stages = max(steps) + 1 if steps else 0
    if stages in (0, chain.n):
        return error
    return ScheduleError(f"{error} (was the plan made for another chain? its forward and "
                         f"backward steps cover {stages} stages, this chain has {chain.n})",
                         op_index=error.op_index, reason=error.reason,
                         over_bytes=error.over_bytes)


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


def _peak_of_chain_only(schedule) -> bool:
    """Whether ``schedule``'s simulated peak depends on the chain alone: no
    transfer in it. An offload frees its bytes when the copy ends, so with
    transfers the peak also depends on the link's bandwidth and on whether the
    memory limit made an operation wait for those frees (NOTE [ Simulator
    semantics ]): a plan simulated on its own chain with another platform
    peaks elsewhere."""
    import numpy as np

    from rtmem.planners.schedule import COMPUTE_OPS, Op
    at_once = COMPUTE_OPS | {Op.DELETE, Op.W_DELETE}
    return bool(np.isin(schedule.op, [int(o) for o in at_once]).all())


def _plan_chain_told(plan, chain, schedule, result) -> bool | None:
    """Print a note on stderr when ``plan`` (None: a plain schedule) was made for
    another chain than ``chain``; return :meth:`Plan.check_chain
    <rtmem.planners.Plan.check_chain>`'s answer (None also without a plan). A
    note, not an error: simulating a plan on a re-profiled or edited chain is a
    fair question, and the numbers printed are this chain's."""
    if plan is None:
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        matches = plan.check_chain(chain)
    if matches is False:
        print(f"note: {caught[-1].message}; the numbers below are this chain's",
              file=sys.stderr)
    elif matches is None and plan.peak != result.peak and _peak_of_chain_only(schedule):
        # A plan saved before plans recorded their chain: its peak, a function of
        # the chain's sizes, tells another chain of the same length. Exact bytes:
        # format_bytes may round two different peaks to the same text.
        print(f"note: the plan records a peak of {plan.peak:,} B; on {chain.name} it "
              f"peaks at {result.peak:,} B: was it made for another chain (or another "
              f"batch size)?", file=sys.stderr)
    return matches


def _cmd_simulate(args) -> int:
    from rtmem.errors import ScheduleError
    from rtmem.planners import simulate
    require_plotting(args)
    chain = load_chain(args.chain)
    schedule, plan = load_schedule_and_plan(args.schedule, chain)
    platform = _platform(args)
    try:
        r = simulate(chain, schedule, platform)
    except ScheduleError as e:
        hinted = _for_another_chain(e, schedule, chain)
        if hinted is e:
            raise
        raise hinted from e
    if not math.isfinite(r.makespan):
        # Chain bounds the times of planners' schedules; a hand-written one can
        # still repeat operations until the float64 sum overflows
        raise RtmemError(f"the makespan of this schedule overflows a float64 ({len(schedule)} "
                         "operations); express the chain's times in larger units")
    matches = _plan_chain_told(plan, chain, schedule, r)
    doc = {"chain": chain.name, "ops": len(schedule), "makespan_s": r.makespan,
           "peak_bytes": r.peak, "compute_s": r.compute_time, "idle_s": r.idle_time,
           "h2d_bytes": r.h2d_bytes, "d2h_bytes": r.d2h_bytes,
           # null for unlimited, as `plan --json` writes: JSON has no Infinity, and
           # memory_limit's 2**62 stands for unlimited only inside rtmem
           "memory_bytes": None if math.isinf(platform.memory) else platform.memory_limit,
           "bandwidth_Bps": None if math.isinf(platform.bandwidth) else platform.bandwidth,
           "channel": platform.channel,
           # whether the plan was made for this chain: null for a schedule that is
           # not a plan, or a plan saved before plans recorded their chain
           "chain_matches_plan": matches}
    if args.json:
        print(json.dumps(doc, indent=1, allow_nan=False))
    else:
        print(stdout_table(["quantity", "value"], [
            ["chain", f"{chain.name} ({chain.n} stages)"], ["operations", len(schedule)],
            ["makespan", format_seconds(r.makespan)], ["peak memory", format_bytes(r.peak)],
            ["memory limit", format_bytes(platform.memory)],
            ["compute time", format_seconds(r.compute_time)],
            ["idle time", format_seconds(r.idle_time)],
            ["host->device", format_bytes(r.h2d_bytes)],
            ["device->host", format_bytes(r.d2h_bytes)],
            ["link", f"{format_bandwidth(platform.bandwidth)} {platform.channel}"]],
            # measured as printed: the chain's name may hold what stdout escapes
            align="lr"))
    if args.plot:
        from rtmem.plot import plot_schedule
        plot_schedule(chain, schedule, platform, args.plot, result=r)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


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


#: What argparse must read as a (negative) value rather than as an option: a
#: minus before a digit or ".digit" (``-1MiB``, ``-.5GB/s``), or before inf,
#: infinity or nan, alone (``-inf``; ``-info`` stays an unknown option).
_NEGATIVE_VALUE = re.compile(r"^-(\.?\d|(inf|infinity|nan)$)", re.IGNORECASE)


class _UsageError(SystemExit):
    """argparse's exit on bad usage (an unknown option, a missing argument, a bad
    choice or value): ``code`` is argparse's (2) and ``message`` its message,
    which :meth:`CommandParser.parse_args` also prints as :func:`error_document`
    when ``--json`` was given. A SystemExit, so a caller of ``parse_args`` sees
    what argparse raises."""

    def __init__(self, code, message: str):
        super().__init__(code)
        self.message = message


class CommandParser(argparse.ArgumentParser):
    """The ArgumentParser of ``rtmem`` and of the ``bench/`` scripts (one
    implementation, so both read arguments alike).

    Negative values: a word such as ``-1MiB``, ``-5GB/s`` or ``-inf`` is a value,
    not an option. argparse before Python 3.13 reads only plain negative numbers
    (``-1``, ``-.5``) as values, so ``--memory -1MiB`` failed with "expected one
    argument" instead of rtmem's own "must be > 0 bytes"; :data:`_NEGATIVE_VALUE`
    is the test Python 3.13 uses, plus the words float() reads as a negative
    infinity or a NaN, which Python 3.13 still takes for options (none of the
    options looks like a negative value, which would turn this off; an option of
    that spelling, such as ``-i``, would still win over it).

    Usage errors raise :class:`_UsageError` (a SystemExit with code 2, as
    argparse's), after argparse's usage and message on stderr. When the command
    line asks for ``--json`` and this parser or one of its subcommands has that
    option, :meth:`parse_args` also prints ``{"error": MESSAGE, "kind":
    "UsageError"}`` (:func:`error_document`) on stdout, as every other failure of a ``--json``
    command does: a script reading stdout got nothing to parse. Subcommands'
    parsers are of this class too (``add_subparsers`` makes its parsers of the
    parent's class)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_VALUE

    def error(self, message):
        try:
            super().error(message)      # usage and "PROG: error: MESSAGE" on stderr
        except SystemExit as e:
            raise _UsageError(e.code, message) from None

    def parse_args(self, args=None, namespace=None):
        # (subcommands' parsers are run by parse_known_args: this prints once)
        argv = sys.argv[1:] if args is None else list(args)
        try:
            return super().parse_args(argv, namespace)
        except _UsageError as e:
            if _wants_json(argv) and self._has_json_option():
                print(json.dumps(error_document(e.message), indent=1, allow_nan=False))
            raise

    def _has_json_option(self) -> bool:
        """Whether this parser or a subcommand's takes ``--json`` (a script without
        it names ``--json`` as an unrecognized argument, in words only)."""
        for action in self._actions:
            if "--json" in action.option_strings:
                return True
            if isinstance(action, argparse._SubParsersAction) and any(
                    isinstance(p, CommandParser) and p._has_json_option()
                    for p in action.choices.values()):
                return True
        return False


def _wants_json(argv) -> bool:
    """Whether the command line gives ``--json`` (or an abbreviation argparse
    takes for it, or ``--json=...``) before any ``--``: usage errors are reported
    before the arguments are parsed, so ``args.json`` is not there to ask."""
    for word in argv:
        if word == "--":
            return False
        option = word.partition("=")[0]
        if len(option) > 2 and "--json".startswith(option):
            return True
    return False


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
    p = sub.add_parser("simulate", help="simulate a schedule: makespan, peak, plots")
    p.add_argument("chain", help="built-in name, generator spec or chain JSON file")
    p.add_argument("schedule", help="schedule file, 'store-all', 'sequential:K' or text")
    _add_platform_args(p)
    p.add_argument("--plot", type=output_file(*PLOT_SUFFIXES),
                   help="write a Gantt chart + memory plot to this file (.png, .pdf, .svg)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_simulate)
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


#: The ``"kind"`` of :func:`error_document` for bad usage (argparse's errors and
#: a subcommand's own checks of its arguments, exit 2), which raise nothing.
USAGE_ERROR = "UsageError"


def error_document(message: str, error: BaseException | None = None) -> dict:
    """The JSON object a ``--json`` subcommand prints on stdout when it fails:
    ``{"error": message, "kind": KIND}``, KIND the class name of ``error``
    (``"InfeasibleError"``, ``"ScheduleError"``, ``"ChainError"``,
    ``"FileNotFoundError"``, ...), or :data:`USAGE_ERROR` without one (bad
    usage), so a script can tell a budget no plan fits from a mistyped argument
    without matching the message's words; for an :class:`~rtmem.errors.InfeasibleError` also
    ``"infeasible": true``, ``"budget_bytes"`` and ``"min_feasible_bytes"`` (bytes;
    null when unknown or unlimited), the keys of an infeasible plan in ``rtmem
    plan remat --json``'s ``"plans"``; for a :class:`~rtmem.errors.ScheduleError`
    ``"op_index"``, ``"reason"`` and ``"over_bytes"``, as the exception has them."""
    from rtmem.errors import InfeasibleError, ScheduleError

    def finite(value):
        # JSON has no Infinity: an unlimited budget is null, as in `plan --json`
        return None if value is None or not math.isfinite(value) else value
    doc = {"error": message,
           "kind": USAGE_ERROR if error is None else type(error).__name__}
    if isinstance(error, InfeasibleError):
        doc.update(infeasible=True, budget_bytes=finite(error.budget),
                   min_feasible_bytes=finite(error.min_feasible))
    elif isinstance(error, ScheduleError):
        doc.update(op_index=error.op_index, reason=error.reason, over_bytes=error.over_bytes)
    return doc


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
