"""``rtmem profile``: measure a model on this machine into a chain the planners read.

The command-line face of :func:`rtmem.torch.profile_sequential`: it builds a
model, profiles one batch, prints the per-stage table and writes the
:class:`~rtmem.planners.Chain` as JSON, which ``rtmem plan remat FILE`` and
``rtmem simulate FILE ...`` take. So a user plans from their own model's
measured times and sizes, not from a built-in analytic profile.

The model is one of the demo's (``--model gpt2`` or ``resnet``, sized by the
same options as ``rtmem demo``) or the user's own, named ``MODULE:FUNCTION``
(an importable module, the current folder included, as ``python -m`` finds
it) or ``PATH.py:FUNCTION``. ``FUNCTION()`` returns ``(model, loss_fn,
make_batch)`` as :func:`rtmem.torch.gpt2_model` does: an ``nn.Sequential`` (or a
list of modules), ``loss_fn(output, target)`` and ``make_batch(batch,
generator)`` returning ``(inputs, target)`` on the CPU (an input tensor; the
target's tensors may nest in tuples, lists and dicts); the command moves them
and the model to ``--device``. With ``--json`` the chain is alone on stdout:
what the user's code prints goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import math
import os
import re
import shlex
import sys
import sysconfig
import traceback

__all__ = ["load_factory", "register"]


class FactoryError(ValueError):
    """A ``MODULE:FUNCTION`` that names no usable model factory (bad usage)."""


def load_factory(spec: str):
    """The function ``spec`` names: ``package.module:function`` (the current
    folder is searched first, as ``python -m`` does) or ``path/to/file.py:function``
    (its folder is searched for the file's own imports, as ``python file.py``
    does). Raises :class:`FactoryError` naming what is missing; an error raised
    while the module itself runs propagates as it is (a bug in the user's file)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr.isidentifier():
        raise FactoryError(f"--model {spec!r}: give gpt2, resnet, MODULE:FUNCTION or "
                           f"PATH.py:FUNCTION (a function returning (model, loss_fn, "
                           f"make_batch))")
    if module_name.endswith(".py"):
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise FactoryError(f"--model {spec!r}: no file {module_name!r}")
        folder = os.path.dirname(path)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        # one identifier: a dot ("model.v2.py") made a submodule name of a package
        # that does not exist, which pickle could not import its classes from
        stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        name = f"_rtmem_profile_{stem}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module      # dataclasses and pickling look modules up there
        try:
            loader_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    else:
        if module_name.startswith("."):
            # importlib's TypeError ("the 'package' argument is required to perform
            # a relative import") was a traceback for --model ./model:build
            raise FactoryError(f"--model {spec!r}: {module_name!r} is a relative module "
                               f"name; give the module as python -m takes it "
                               f"(package.module) or the file: path/to/file.py:{attr}")
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # only the module named: a dependency it lacks is the user's error,
            # raised as it is
            if e.name is None or not (module_name == e.name
                                      or module_name.startswith(e.name + ".")):
                raise
            raise FactoryError(f"--model {spec!r}: no module named {e.name!r} (run from the "
                               f"folder that holds it, or give the file: "
                               f"path/to/file.py:{attr})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        # the module of that name imported first is the one found: a ./profile.py
        # got the standard library's profile, reported only as "profile has no
        # 'build'"; say which file it is when it is not under the current folder
        where = getattr(module, "__file__", None)
        found = (f" (found {where}; for a file of yours of that name give its path: "
                 f"path/to/file.py:{attr})"
                 if where and not module_name.endswith(".py") and not os.path.abspath(
                     where).startswith(os.path.join(os.getcwd(), "")) else "")
        raise FactoryError(f"--model {spec!r}: {module_name} has no {attr!r}{found}")
    if not callable(fn):
        raise FactoryError(f"--model {spec!r}: {module_name}.{attr} is a "
                           f"{type(fn).__name__}, not a function")
    _check_call(fn, (), f"--model {spec!r}: {attr}() is called with no arguments")
    return fn


def _check_call(fn, args: tuple, what: str) -> None:
    """Raise :class:`FactoryError` when ``fn`` cannot take ``args``: the TypeError
    of calling it was a traceback through this module (``--model json:dumps``,
    a ``make_batch(batch)`` without the generator), not the user's bug. ``what``
    names the call, as the user wrote it."""
    import inspect
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):     # none to read (some builtins): called as it is
        return
    try:
        signature.bind(*args)
    except TypeError as e:
        raise FactoryError(f"{what}: {e}") from None


def _returned(made, count: int, who: str, expected: str):
    """``made``, what ``who`` returned, if it is a tuple or list of ``count``
    items; else :class:`FactoryError` saying it should be ``expected``."""
    if not (isinstance(made, (tuple, list)) and len(made) == count):
        raise FactoryError(f"{who} returned {type(made).__name__}, not {expected}")
    return made


def _built(spec: str, made):
    """``made`` (what the factory returned) checked: (model, loss_fn, make_batch)."""
    model, loss_fn, make_batch = _returned(made, 3, f"{spec}()", "(model, loss_fn, "
                                           "make_batch) as rtmem.torch.gpt2_model returns")
    for what, value in (("loss_fn", loss_fn), ("make_batch", make_batch)):
        if not callable(value):
            raise FactoryError(f"{spec}() returned a {type(value).__name__} as {what}; it "
                               f"must be callable")
    return model, loss_fn, make_batch


def _batch(spec: str, make_batch, batch: int, generator):
    """``make_batch(batch, generator)`` checked: (inputs, target)."""
    from rtmem.torch._stages import raised_in
    who = f"the make_batch of {spec}"
    _check_call(make_batch, (batch, generator),
                f"{who} is called as make_batch(batch, generator)")
    with raised_in(who):
        made = make_batch(batch, generator)
    return _returned(made, 2, who, "(inputs, target)")


def _to_device(obj, device, spec: str = "the factory"):
    """``obj`` with its tensors on ``device``, nested in tuples (named ones
    included), lists and dicts as ``make_batch`` returned them: a target of
    ``(labels, mask)`` stayed on the CPU while the model ran on --device.
    :class:`FactoryError` for a tensor on the meta device (shapes, no data),
    which ended in torch's "Cannot copy out of meta tensor" traceback (``spec``
    names the factory in it)."""
    import torch
    if isinstance(obj, torch.Tensor):
        if obj.is_meta:
            raise FactoryError(f"the make_batch of {spec} returned tensors on the meta "
                               f"device (shapes, no data); return real tensors")
        return obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):     # a namedtuple
        return type(obj)(*(_to_device(item, device, spec) for item in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_device(item, device, spec) for item in obj)
    if isinstance(obj, dict):
        return type(obj)((key, _to_device(item, device, spec)) for key, item in obj.items())
    return obj


def _model_to_device(model, device, spec: str):
    """``model`` (a module, or a list of blocks) on ``device``; anything else is
    profile_sequential's to refuse, by name. :class:`FactoryError` for a module
    on the meta device (as :func:`_to_device` says)."""
    import torch

    def moved(block):
        if not isinstance(block, torch.nn.Module):
            return block
        if any(t.is_meta for t in (*block.parameters(), *block.buffers())):
            raise FactoryError(f"{spec}() returned a model on the meta device (shapes, no "
                               f"data), which cannot run; build it on a real device, or "
                               f"model.to_empty(device='cpu') and initialize its weights")
        return block.to(device)

    return [moved(m) for m in model] if isinstance(model, (list, tuple)) else moved(model)


def _user_frame(tb) -> str | None:
    """``file:line`` of the last frame of traceback ``tb`` in the user's code:
    not rtmem's (by module name), not Python's or an installed package's (by
    folder); None when there is none (the error came from torch's own
    modules, ``nn.Linear`` on a wrong shape)."""
    libraries = {os.path.join(os.path.abspath(path), "") for key, path in
                 sysconfig.get_paths().items() if key in ("stdlib", "platstdlib", "purelib",
                                                         "platlib")}
    found = None
    while tb is not None:
        frame, line = tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
        module = str(frame.f_globals.get("__name__", ""))
        path = frame.f_code.co_filename
        if module == "rtmem" or module.startswith("rtmem.") or path.startswith("<"):
            continue
        path = os.path.abspath(path)
        if any(path.startswith(folder) for folder in libraries):
            continue
        found = path, line
    if found is None:
        return None
    path, line = found
    here = os.path.join(os.getcwd(), "")
    return f"{os.path.relpath(path) if path.startswith(here) else path}:{line}"


def _user_error(error: Exception, where: str, hint: bool) -> str:
    """One line for an exception the user's code raised in ``where`` (a stage's
    forward or backward, the loss, the factory): its class, the first line of
    its message and the place in the user's file, in place of the traceback
    (torch's frames and rtmem's, around one line of the user's). ``hint``
    adds how to see the whole traceback."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    if len(lines) > 1:
        text += " ..."
    at = _user_frame(error.__traceback__)
    return (f"{where} raised {text}" + (f" (at {at})" if at else "")
            + ("; rerun with --traceback for the full traceback" if hint else ""))


def _table(chain) -> str:
    from rtmem.cli import stdout_table
    from rtmem.units import format_bytes, format_seconds
    rows = [[str(i), format_seconds(chain.u_f[i]), format_seconds(chain.u_b[i]),
             format_bytes(chain.x[i]), format_bytes(chain.xbar[i]), format_bytes(chain.w[i])]
            for i in range(chain.n)]
    rows.append(["loss", format_seconds(chain.u_loss), "", "", "", ""])
    return stdout_table(["stage", "forward", "backward", "x (output)", "xbar (saved)",
                         "weights"], rows)


def _measure(args, device):
    """Build the model ``args`` names, profile one batch of it on ``device``;
    the :class:`~rtmem.planners.Chain`."""
    import torch

    from rtmem.cli_plan import ProgressBar
    from rtmem.demo import MODEL_OPTIONS, build_model
    from rtmem.torch import profile_sequential
    from rtmem.torch._stages import raised_in
    torch.manual_seed(0)
    if args.model in MODEL_OPTIONS:
        sizes = {name: getattr(args, name) for name in MODEL_OPTIONS[args.model]}
        model, loss_fn, make_batch, name = build_model(args.model, batch=args.batch,
                                                       **sizes)
    else:
        with raised_in(f"the import of {args.model.rpartition(':')[0]}"):
            factory = load_factory(args.model)
        with raised_in(f"the model factory {args.model}"):
            made = factory()
        model, loss_fn, make_batch = _built(args.model, made)
        # a functools.partial or an object with __call__ has no __name__ (an
        # AttributeError from here): the FUNCTION the spec names then
        name = getattr(factory, "__name__", args.model.rpartition(":")[2])
        name = f"{name}-b{args.batch}"
    inputs, target = _batch(args.model, make_batch, args.batch,
                            torch.Generator().manual_seed(1))
    model = _model_to_device(model, device, args.model)
    inputs, target = _to_device((inputs, target), device, args.model)
    name = args.name or name
    bar = ProgressBar(quiet=args.quiet, label="stages")
    bar(f"profiling {name} on {device.type}, {args.repeats} timed runs per pass ...")
    chain = profile_sequential(model, inputs, target, loss_fn, repeats=args.repeats,
                               name=name,
                               progress=lambda done, total: bar.update(done / total))
    bar(f"measured {chain.n} stages and the loss")
    return chain


def _cmd_profile(args) -> int:
    from rtmem.cli import (model_sizes_problem, report_error, save_document,
                           torch_device_problem, torch_oom)
    problem = model_sizes_problem(args) or torch_device_problem(args, "profiling")
    if problem:
        report_error(args, problem)
        return 2
    import torch

    from rtmem.demo import default_budget
    from rtmem.planners import min_feasible_memory, plan_store_all
    from rtmem.units import format_bytes, format_seconds
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        # with --json stdout is the chain's alone: what the user's module, model
        # or loss prints goes to stderr (it came before the JSON, which then
        # did not parse)
        with (contextlib.redirect_stdout(sys.stderr) if args.json
              else contextlib.nullcontext()):
            chain = _measure(args, device)
    except FactoryError as e:
        report_error(args, str(e), e)
        return 2
    except Exception as e:
        from rtmem.torch._stages import RAISED_IN
        where = getattr(e, RAISED_IN, None)
        message = torch_oom(e) if isinstance(e, RuntimeError) else None
        if message is not None:
            at = f" in {where}" if where else ""
            report_error(args, f"{message}{at}; make the model or --batch smaller", e)
            return 1
        if where is None:       # rtmem's own errors: main reports them
            raise
        if args.traceback:
            traceback.print_exception(e)
        report_error(args, _user_error(e, where, hint=not args.traceback), e)
        return 1
    if args.save:
        save_document(chain, args.save)
    if args.json:
        print(chain.to_json(indent=1))
        if args.save:
            print(f"wrote {args.save}", file=sys.stderr)
        return 0
    peak, least = plan_store_all(chain, math.inf).peak, min_feasible_memory(chain)
    print(_table(chain))
    print(f"\n{chain.name} on {device.type}: {chain.n} stages, input "
          f"{format_bytes(chain.x0)}, weights {format_bytes(int(chain.w.sum()))}, compute "
          f"{format_seconds(chain.compute_time)} per step; no-remat peak "
          f"{format_bytes(peak)}, least feasible {format_bytes(least)} (simulated)")
    if args.save:
        budget, why = default_budget(least, peak)
        print(f"wrote {args.save}; plan it with: rtmem plan remat {shlex.quote(args.save)} "
              f"--memory {budget}   ({format_bytes(budget)}: {why})")
    else:
        print("add --save FILE.json to plan it: rtmem plan remat FILE.json --memory ...")
    return 0


def _chain_name(value: str) -> str:
    """argparse ``type=`` of ``--name``: a blank name was taken for no name, and
    the chain got the model's (``--name ""`` from an unset shell variable)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("the chain name is empty; give a name or "
                                         "leave out --name for the model's")
    return value


def register(subparsers) -> None:
    """Add ``profile`` to an argparse ``subparsers`` object; ``func(args)``
    returns the exit code."""
    from rtmem.cli import MAX_REPEATS, add_model_size_args, count, output_file
    p = subparsers.add_parser(
        "profile", help="measure a model (the demo's or yours) into a chain JSON for "
        "rtmem plan / simulate", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--model", default="gpt2",
                   help="gpt2 (sized by --layers --hidden --heads --seq --vocab), resnet "
                   "(--blocks --width --image), or your own: MODULE:FUNCTION or "
                   "PATH.py:FUNCTION, a function returning (model, loss_fn, make_batch) "
                   "as rtmem.torch.gpt2_model does; default gpt2")
    add_model_size_args(p)
    p.add_argument("--repeats", type=count(high=MAX_REPEATS), default=3,
                   help="timed runs per stage, median kept (default 3)")
    p.add_argument("--name", default=None, type=_chain_name,
                   help="the chain's name (default: from the model)")
    p.add_argument("--save", type=output_file(replace=True),
                   help="write the chain as JSON here (rtmem plan remat / simulate read it)")
    p.add_argument("--json", action="store_true",
                   help="print the chain's JSON instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--traceback", action="store_true",
                   help="when your model, loss or factory raises, print the full Python "
                   "traceback too (by default one line: where, the error and its place in "
                   "your file)")
    p.set_defaults(func=_cmd_profile)
