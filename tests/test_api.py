"""The public surface: __all__ lists exactly the public names, and importing the
planners pulls in no torch or cupy."""

import subprocess
import sys

import rtmem
import rtmem.kernels
import rtmem.planners
import rtmem.planners.testing

from _subprocess import run_ok


def _public(module):
    """Names a user would take as public: no underscore, not a submodule, not the
    ``annotations`` feature flag of ``from __future__ import annotations``."""
    return {n for n, v in vars(module).items() if not n.startswith("_")
            and not isinstance(v, type(sys)) and n != "annotations"}


def test_all_matches_public_names():
    assert set(rtmem.planners.__all__) == _public(rtmem.planners)
    # rtmem, rtmem.kernels and rtmem.planners.testing (its strategies, which need
    # hypothesis) load some names on first use: every eagerly visible
    # public name is exported, and every exported name resolves
    for module in (rtmem, rtmem.planners, rtmem.planners.testing, rtmem.kernels):
        assert _public(module) <= set(module.__all__), module.__name__
        for name in module.__all__:
            assert getattr(module, name) is not None, name
        assert len(set(module.__all__)) == len(module.__all__)
    # once loaded, the testing API's public names are exactly its __all__
    assert set(rtmem.planners.testing.__all__) == _public(rtmem.planners.testing)


def test_the_strategies_error_is_exported_where_users_catch_it():
    # StrategyArgumentError was raised by every strategy but reachable only as
    # rtmem.planners.testing._arguments.StrategyArgumentError (a private module)
    import pytest
    from rtmem.errors import RtmemError
    from rtmem.planners.testing import StrategyArgumentError, simulation_cases
    assert "StrategyArgumentError" in rtmem.planners.testing.__all__
    assert issubclass(StrategyArgumentError, RtmemError)
    with pytest.raises(StrategyArgumentError, match="simulation_cases"):
        simulation_cases(5, 2)


def test_version():
    assert isinstance(rtmem.__version__, str) and rtmem.__version__.count(".") == 2


def test_planners_import_without_torch_or_cupy():
    code = ("import sys, rtmem, rtmem.planners, rtmem.planners.testing, rtmem.kernels; "
            "bad = [m for m in ('torch', 'cupy', 'numba.cuda') if m in sys.modules]; "
            "sys.exit(bad and 1 or 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_import_rtmem_loads_neither_numba_nor_torch_nor_the_planners():
    # rtmem's docstring and the project's rules: the runtime (arenas, buffers,
    # transfers on the host backend) needs numpy alone; numba (seconds to import),
    # torch and the planners load on first use. Nothing checked it, and one eager
    # import in rtmem/__init__.py would have put seconds on every `import rtmem`.
    code = """
        import sys
        import rtmem
        arena = rtmem.HostArena("1MiB", backend="host")
        buf = arena.alloc(64, kind="weight")
        dev = rtmem.DeviceArena("1MiB", backend="host")
        rtmem.wait(rtmem.prefetch(buf, arena=dev))
        buf.free()
        heavy = ("numba", "torch", "scipy", "cupy", "llvmlite", "rtmem.planners",
                 "rtmem.kernels", "rtmem.torch", "rtmem.optim")
        loaded = [h for h in heavy
                  if any(m == h or m.startswith(h + ".") for m in sys.modules)]
        assert not loaded, loaded
        rtmem.Chain      # the lazy names still load on first use
        assert "rtmem.planners" in sys.modules and "numba" in sys.modules
        print("ok")
    """
    run_ok(code)


def test_star_import_and_help_work_without_torch():
    # A core install (no torch extra): every name in __all__ must resolve, as
    # `from rtmem import *` and help() resolve them all; CPUAdam's ImportError broke both.
    code = """
        import sys
        sys.modules["torch"] = None
        import pydoc
        import rtmem
        import rtmem.optim
        for module in (rtmem, rtmem.optim):
            exec(f"from {module.__name__} import *", {})
            assert "NumpyAdam" in pydoc.render_doc(module)
            assert "CPUAdam" not in module.__all__ and "CPUAdam" not in dir(module)
        try:
            rtmem.CPUAdam
        except ImportError as e:
            assert "rtmem[torch]" in str(e), e
        else:
            raise AssertionError("CPUAdam resolved without torch")
        print("ok")
    """
    run_ok(code)


def test_optional_subpackages_name_what_to_install():
    # Without torch / hypothesis, importing rtmem.torch (or any of its modules) and
    # rtmem.planners.testing raised a bare "No module named 'torch'" from deep inside.
    code = """
        import sys
        sys.modules["torch"] = sys.modules["hypothesis"] = None
        for module, missing, hint in [
                ("rtmem.torch", "torch", "pip install 'rtmem[torch]'"),
                ("rtmem.torch.offload", "torch", "pip install 'rtmem[torch]'"),
                ("rtmem.planners.testing.strategies", "hypothesis",
                 "pip install hypothesis"),
                ("rtmem.planners.testing.wandering", "hypothesis",
                 "pip install hypothesis")]:
            try:
                __import__(module)
            except ModuleNotFoundError as e:
                assert hint in str(e) and e.name == missing, (module, e, e.name)
            else:
                raise AssertionError(f"{module} imported without {missing}")
        print("ok")
    """
    run_ok(code)


def test_the_oracles_import_without_hypothesis():
    # rtmem.planners.testing refused to import without hypothesis, though only its
    # strategies use it: the oracles (bench/simulate.py's reference_simulate) too
    code = """
        import sys
        sys.modules["hypothesis"] = None
        import numpy as np
        from rtmem.planners import Chain, Platform, simulate, store_all_schedule
        from rtmem.planners.testing import (brute_force_multichain, brute_force_remat,
                                            reference_simulate)
        rng = np.random.default_rng()
        chain = Chain(u_f=rng.uniform(1, 2, 3), u_b=rng.uniform(1, 2, 3),
                      x=rng.integers(1, 9, 3), xbar=rng.integers(9, 20, 3))
        schedule, platform = store_all_schedule(chain.n), Platform(float("inf"))
        assert reference_simulate(chain, schedule, platform)["peak"] == \\
            simulate(chain, schedule, platform).peak
        assert callable(brute_force_remat) and callable(brute_force_multichain)
        for name in ("simulation_cases", "chains", "wandering_schedules",
                     "StrategyArgumentError"):
            try:
                exec(f"from rtmem.planners.testing import {name}")
            except ModuleNotFoundError as e:
                assert "pip install hypothesis" in str(e) and e.name == "hypothesis", e
            else:
                raise AssertionError(f"{name} imported without hypothesis")
        print("ok")
    """
    run_ok(code)


def test_lazy_reexports():
    assert rtmem.Chain is rtmem.planners.Chain
    assert rtmem.simulate is rtmem.planners.simulate
    assert "Chain" in dir(rtmem)


def test_errors_module_exports_every_exception():
    import rtmem.errors as errors
    classes = {n for n, v in vars(errors).items()
               if isinstance(v, type) and issubclass(v, Exception) and not n.startswith("_")}
    assert classes == set(errors.__all__)
    assert all(issubclass(getattr(errors, n), errors.RtmemError) for n in errors.__all__)


def test_errors_pickle_with_their_attributes():
    import inspect
    import pickle

    import rtmem.errors as errors
    e = errors.ScheduleError("m", op_index=3, reason="memory-limit", over_bytes=7)
    back = pickle.loads(pickle.dumps(e))
    assert (back.op_index, back.reason, back.over_bytes, str(back)) == (3, "memory-limit", 7, "m")
    oom = pickle.loads(pickle.dumps(errors.OutOfMemoryError("x", requested=5)))
    assert oom.requested == 5 and isinstance(oom, MemoryError)
    # every error class, every attribute: a distinct value per keyword comes back
    for name in errors.__all__:
        cls = getattr(errors, name)
        # the nearest rtmem class's __init__; those without one take only a message
        init = next((vars(c)["__init__"] for c in cls.__mro__
                     if c.__module__ == errors.__name__ and "__init__" in vars(c)), None)
        keywords = [] if init is None else [
            p.name for p in inspect.signature(init).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY]
        err = cls("what went wrong", **{k: (k, i) for i, k in enumerate(keywords)})
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is cls and str(again) == "what went wrong"
        assert vars(again) == vars(err) == {k: (k, i) for i, k in enumerate(keywords)}


def _public_callables():
    """(qualified name, object) of every class and function a user reaches from
    the exported modules' ``__all__`` (enums and exceptions aside)."""
    import enum
    import inspect

    import rtmem.errors
    import rtmem.optim
    modules = [rtmem, rtmem.planners, rtmem.planners.testing, rtmem.kernels, rtmem.optim,
               rtmem.errors]
    for module in modules:
        for name in module.__all__:
            obj = getattr(module, name)
            if (inspect.isclass(obj) and issubclass(obj, (enum.Enum, BaseException))) \
                    or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            yield f"{module.__name__}.{name}", obj


def test_every_public_signature_names_its_parameters():
    # help(rtmem.DeviceArena) showed "DeviceArena(*args, **kwargs)": its
    # __init__ forwarded everything, so the reference hid every parameter, which
    # of them are keyword-only, and the defaults its docstring states. A name
    # whose parameters help() can show must show them.
    import inspect
    vague = []
    for qualname, obj in _public_callables():
        try:
            params = inspect.signature(obj).parameters.values()
        except (TypeError, ValueError):
            continue
        kinds = {p.kind for p in params}
        if kinds and kinds <= {inspect.Parameter.VAR_POSITIONAL,
                               inspect.Parameter.VAR_KEYWORD}:
            vague.append(qualname)
    assert not vague, f"help() shows only (*args, **kwargs) for {vague}"


def test_arena_signatures_show_the_documented_defaults():
    import inspect

    from rtmem.allocator import DEFAULT_ALIGNMENT
    for cls in (rtmem.DeviceArena, rtmem.HostArena):
        params = inspect.signature(cls).parameters
        assert list(params)[0] == "nbytes", cls
        # the DeviceArena docstring's defaults; HostArena takes the same ones
        expected = {"backend": None, "alignment": DEFAULT_ALIGNMENT, "max_bytes": None,
                    "growth_bytes": None, "adaptors": (), "debug": False}
        for name, default in expected.items():
            assert params[name].default == default, (cls.__name__, name)
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (cls.__name__, name)
    arena = rtmem.HostArena(1024, backend="host", alignment=512, debug=True)
    assert arena.core.alignment == 512 and arena.debug
    assert rtmem.DeviceArena(1024, backend="host", max_bytes=4096).core.max_bytes == 4096
