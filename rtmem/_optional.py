"""Optional dependencies (the pip extras): whether one is there, and importing one
with an error that names what to install. Imports nothing heavy itself:
``import rtmem`` stays free of torch."""

from __future__ import annotations

import importlib
import importlib.util
import sys


def installed(name: str) -> bool:
    """Whether ``import name`` can find the module, without importing it."""
    if name in sys.modules:         # imported already, or blocked (None)
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


def require(name: str, message: str):
    """``import name`` and return it; when it is missing, ModuleNotFoundError with
    ``message`` (which says what to install) and ``name`` as Python's own error
    has it. A module that is there but fails on an import of its own raises its
    own error: the bare "No module named 'torch'" from deep inside a package
    named no extra."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        raise ModuleNotFoundError(message, name=name) from e
