"""The distribution ships every package folder, under the one rtmem namespace."""

import os

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
