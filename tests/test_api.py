"""The public surface: __all__ lists exactly the public names, and importing the
planners pulls in no torch or cupy."""

import subprocess
import sys

import rtmem
import rtmem.kernels
import rtmem.planners
import rtmem.planners.testing


def _public(module):
    """Names a user would take as public: no underscore, not a submodule, not the
    ``annotations`` feature flag of ``from __future__ import annotations``."""
    return {n for n, v in vars(module).items() if not n.startswith("_")
            and not isinstance(v, type(sys)) and n != "annotations"}


def test_all_matches_public_names():
    for module in (rtmem.planners, rtmem.planners.testing, rtmem.kernels):
        assert set(module.__all__) == _public(module), module.__name__
        for name in module.__all__:
            assert hasattr(module, name)
    for name in rtmem.__all__:
        assert hasattr(rtmem, name), name


def test_version():
    assert isinstance(rtmem.__version__, str) and rtmem.__version__.count(".") == 2


def test_planners_import_without_torch_or_cupy():
    code = ("import sys, rtmem.planners, rtmem.planners.testing; "
            "bad = [m for m in ('torch', 'cupy', 'numba.cuda') if m in sys.modules]; "
            "sys.exit(bad and 1 or 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_lazy_reexports():
    assert rtmem.Chain is rtmem.planners.Chain
    assert rtmem.simulate is rtmem.planners.simulate
    assert "Chain" in dir(rtmem)
