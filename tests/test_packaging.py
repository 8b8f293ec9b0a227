"""The distribution ships every package folder, under the one rtmem namespace."""

import os
import shutil
import subprocess
import sys
import tarfile

import pytest

try:
    import tomllib
except ModuleNotFoundError:     # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 reads TOML with tomli")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {"rtmem": "rtmem", "kernels": "rtmem.kernels", "planners": "rtmem.planners"}


def _packages_on_disk():
    found = set()
    for folder, name in FOLDERS.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            if "__init__.py" in files and "__pycache__" not in dirpath:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
                found.add(name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}")
    return found


def test_every_package_folder_is_listed():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setup = tomllib.load(f)["tool"]["setuptools"]
    assert set(setup["packages"]) == _packages_on_disk()
    # no top-level kernels / planners module: they map into rtmem
    assert all(name.startswith("rtmem") for name in setup["packages"])
    assert setup["package-dir"]["rtmem.kernels"] == "kernels"
    assert setup["package-dir"]["rtmem.planners"] == "planners"


def _imported_top_level_modules():
    """The top-level modules the installed packages' code imports (absolute imports)."""
    import ast
    found = set()
    for folder in FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        found |= {a.name.split(".")[0] for a in node.names}
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        found.add(node.module.split(".")[0])
    return found


def test_every_core_dependency_is_imported():
    # scipy was a core dependency nothing imported: every install pulled ~40 MB
    # for nothing (numba does not need it: rtmem jits no np.linalg)
    import re
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    names = {re.match(r"[A-Za-z0-9_.-]+", d).group().lower().replace("-", "_") for d in deps}
    assert names and names <= _imported_top_level_modules()


# The source tree's top-level files an sdist carries (those that exist here).
SDIST_FILES = ("README.md", "LICENSE", "pyproject.toml", "MANIFEST.in", "Makefile",
               "constraints.txt", "constraints-oldest.txt")


def test_the_sdist_ships_the_test_suite_and_the_benchmarks(tmp_path):
    # setuptools on its own put only tests/test*.py in the sdist: no conftest.py, no
    # _threads.py / _fake_cupy.py ..., no bench/; the suite of an unpacked sdist
    # failed to collect ("No module named '_threads'")
    pytest.importorskip("setuptools.build_meta", reason="builds the sdist with setuptools")
    src = tmp_path / "src"         # a copy: building writes rtmem.egg-info into the tree
    skip = shutil.ignore_patterns(".hypothesis")
    for folder in ("rtmem", "kernels", "planners", "tests", "bench"):
        shutil.copytree(os.path.join(ROOT, folder), src / folder, symlinks=True, ignore=skip)
    # bytecode a test run leaves (grafting tests/ took it along)
    (src / "tests" / "__pycache__").mkdir(exist_ok=True)
    (src / "tests" / "__pycache__" / "probe.cpython-311.pyc").write_bytes(b"")
    for name in SDIST_FILES:
        if os.path.exists(os.path.join(ROOT, name)):
            shutil.copy2(os.path.join(ROOT, name), src / name)
    code = ("import sys; out = sys.argv[1]; from setuptools import build_meta; "
            "print(build_meta.build_sdist(out))")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=src,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    with tarfile.open(tmp_path / res.stdout.split()[-1]) as sdist:
        shipped = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    wanted = {f"{folder}/{name}" for folder in ("tests", "bench")
              for name in os.listdir(os.path.join(ROOT, folder)) if name.endswith((".py", ".sh"))}
    wanted |= {name for name in SDIST_FILES if os.path.exists(os.path.join(ROOT, name))}
    assert "tests/conftest.py" in wanted and "bench/_common.py" in wanted
    # pyproject declares Apache-2.0, whose terms ask for the licence text with copies
    assert "LICENSE" in wanted
    assert wanted - shipped == set()
    assert not any("__pycache__" in name or name.endswith(".pyc") for name in shipped)


def _can_build_wheels() -> bool:
    """setuptools >= 70.1 builds wheels itself; older ones need the wheel package."""
    import importlib.util
    return any(importlib.util.find_spec(m) is not None
               for m in ("setuptools.command.bdist_wheel", "wheel"))


def test_the_wheel_ships_the_profiles_without_a_packaging_warning(tmp_path):
    # setuptools warned "Package 'rtmem.planners.profiles' is absent from the
    # `packages` configuration ... Package would be ignored": include-package-data
    # swept the manifest's planners/profiles/*.json in and took their folder for an
    # importable package. The built-in chains must still be in the wheel.
    pytest.importorskip("setuptools.build_meta", reason="builds the wheel with setuptools")
    if not _can_build_wheels():
        pytest.skip("this setuptools needs the wheel package to build wheels")
    import json
    import zipfile
    src = tmp_path / "src"         # a copy: building writes build/ and rtmem.egg-info
    skip = shutil.ignore_patterns(".hypothesis", "__pycache__")
    for folder in FOLDERS:
        shutil.copytree(os.path.join(ROOT, folder), src / folder, symlinks=True, ignore=skip)
    for name in ("README.md", "LICENSE", "pyproject.toml", "MANIFEST.in"):
        if os.path.exists(os.path.join(ROOT, name)):
            shutil.copy2(os.path.join(ROOT, name), src / name)
    (tmp_path / "wheel").mkdir()
    # every warning the build emits, as [category, message]
    code = ("import json, sys, warnings; from setuptools import build_meta\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    name = build_meta.build_wheel(sys.argv[1])\n"
            "print(json.dumps([name, [[type(w.message).__name__, str(w.message)] "
            "for w in seen]]))")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "wheel")], cwd=src,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    name, seen = json.loads(res.stdout.strip().splitlines()[-1])
    ours = [w for w in seen if "rtmem" in w[1]]
    assert ours == [], ours
    with zipfile.ZipFile(tmp_path / "wheel" / name) as wheel:
        shipped = set(wheel.namelist())
    profiles = {f"rtmem/planners/profiles/{f}"
                for f in os.listdir(os.path.join(ROOT, "planners", "profiles"))
                if f.endswith(".json")}
    assert len(profiles) >= 8 and profiles <= shipped
    # a data folder, not a package: nothing but the JSON files under it
    assert {f for f in shipped if f.startswith("rtmem/planners/profiles/")} == profiles


def _absolute_imports(folder):
    """``(file, line, module)`` for every import in ``folder``'s code (function
    bodies included), relative imports resolved against the installed name
    (``kernels/x.py``'s ``from ..errors`` is ``rtmem.errors``)."""
    import ast
    package = FOLDERS[folder]
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
        rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
        here = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        yield path, node.lineno, alias.name
                elif isinstance(node, ast.ImportFrom):
                    base = here.split(".")
                    if node.level:
                        base = base[:len(base) - node.level + 1]
                        module = ".".join(base + ([node.module] if node.module else []))
                    else:
                        module = node.module
                    # "from . import x" / "from rtmem import x" import submodules too
                    for alias in node.names:
                        yield path, node.lineno, f"{module}.{alias.name}"


# rtmem's leaf modules (stdlib and numpy only) that planners and kernels may use
RTMEM_LEAVES = ("rtmem.errors", "rtmem.units", "rtmem._files", "rtmem._optional")


def _within(module, prefixes):
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("folder, allowed, banned", [
    # DESIGN §1: planners <- kernels <- rtmem, never the other way; planners are
    # pure algorithms (no GPU, no torch) that run with numpy/numba/scipy alone
    ("planners", ("rtmem.planners",) + RTMEM_LEAVES, ("torch", "cupy", "numba.cuda")),
    ("kernels", ("rtmem.kernels", "rtmem.planners") + RTMEM_LEAVES, ("torch",)),
])
def test_planners_and_kernels_import_nothing_above_them(folder, allowed, banned):
    wrong = [f"{os.path.relpath(path, ROOT)}:{line} imports {module}"
             for path, line, module in _absolute_imports(folder)
             if (_within(module, ("rtmem",)) and not _within(module, allowed))
             or _within(module, banned)]
    assert not wrong, "\n".join(wrong)


def test_every_numba_cpu_function_is_cached():
    # DESIGN §6: numba functions use cache=True, so a fresh process (every CLI
    # call, every test worker) loads the compiled code instead of compiling again
    import ast
    uncached, seen = [], 0
    for folder in FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in (f for f in files if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                bare = {id(d) for n in ast.walk(tree)
                        for d in getattr(n, "decorator_list", ())}
                for node in ast.walk(tree):
                    # numba.njit(...) / njit(...) / numba.jit(...), called or as a bare
                    # decorator; numba.cuda's jit is out of scope (no cache under
                    # the CUDA simulator)
                    call = node if isinstance(node, ast.Call) else None
                    func = call.func if call else node
                    if call is None and id(node) not in bare:
                        continue
                    called = func.attr if isinstance(func, ast.Attribute) else \
                        getattr(func, "id", None)
                    owner = getattr(getattr(func, "value", None), "id", "numba")
                    if called not in ("njit", "jit") or owner != "numba":
                        continue
                    seen += 1
                    cache = [k for k in call.keywords if k.arg == "cache"] if call else []
                    if not (cache and isinstance(cache[0].value, ast.Constant)
                            and cache[0].value.value is True):
                        uncached.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert seen >= 20, f"found only {seen} numba functions: the scan is broken"
    assert not uncached, "numba functions without cache=True: " + ", ".join(uncached)
