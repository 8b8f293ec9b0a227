"""Test configuration shared by every test module.

NOTE [ CUDA simulator in the CPU suite ]
numba.cuda kernels run under the CUDA simulator on machines without a GPU: the
variable NUMBA_ENABLE_CUDASIM must be set before numba.cuda is first imported,
so it is set here, at configure time, unless the run selects the real-GPU tests
(``pytest -m gpu``) or the caller already chose a value.
"""

import os

import pytest


def _wants_real_gpu(config) -> bool:
    expr = (config.getoption("markexpr", default="") or "").replace(" ", "")
    return "gpu" in expr and "notgpu" not in expr


def pytest_configure(config):
    if not _wants_real_gpu(config):
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
        # pytest may have imported numba already (pyproject's filterwarnings names a
        # numba warning class), so make numba re-read its configuration.
        from numba.core import config as numba_config
        numba_config.reload_config()


def gpu_available() -> bool:
    """True when a real CUDA device is usable (never under the simulator)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        from numba import cuda
        return bool(cuda.is_available())
    except Exception:  # noqa: BLE001 - any driver problem means "no GPU"
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
