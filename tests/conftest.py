"""Test configuration shared by every test module.

NOTE [ CUDA simulator in the CPU suite ]
numba.cuda kernels run under the CUDA simulator on machines without a GPU: the
variable NUMBA_ENABLE_CUDASIM must be set before numba.cuda is first imported,
so it is set here, at configure time, unless the run selects the real-GPU tests
(``pytest -m gpu``) or the caller already chose a value.
"""

import os
import secrets

import pytest


def _wants_real_gpu(config) -> bool:
    expr = (config.getoption("markexpr", default="") or "").replace(" ", "")
    return "gpu" in expr and "notgpu" not in expr


def pytest_configure(config):
    # Every ScheduleExecutor step in the suite checks its running byte count
    # against a full recount after each operation (rtmem/torch/executor.py).
    os.environ.setdefault("RTMEM_CHECK_ACCOUNTING", "1")
    # NOTE [ Idle OpenMP threads sleep in the suite ]: torch's OpenMP pool (one
    # thread per core) busy-waits after each parallel op by default. With
    # `pytest -n 2` on two cores, every worker's idle threads spun on the cores
    # the other worker needed: the torch tests burned about twice their CPU time
    # (test_loss_curves_match_torch_adam: 33 s user+sys, 15 s with PASSIVE).
    # PASSIVE only changes how an idle thread waits, not how many threads run
    # or what they compute. Set before torch is imported (libgomp reads it
    # when loaded), and inherited by the suite's subprocesses.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # No timing assertions, hypothesis's per-example deadline (200 ms) included:
    # a test's first example may compile numba functions (673 ms, and the test
    # failed when run alone, where another test had not compiled them first).
    # Registered before the test modules build their settings, which take the
    # loaded profile's values for what they leave out; --hypothesis-profile
    # still chooses another.
    from hypothesis import settings
    settings.register_profile("rtmem", deadline=None)
    settings.load_profile("rtmem")
    if not _wants_real_gpu(config):
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
        # pytest may have imported numba already (pyproject's filterwarnings names a
        # numba warning class), so make numba re-read its configuration.
        from numba.core import config as numba_config
        numba_config.reload_config()


def gpu_status() -> tuple[bool, str]:
    """(True, "") when a real CUDA device is usable (never under the simulator),
    else (False, why)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False, "NUMBA_ENABLE_CUDASIM=1 (the CUDA simulator)"
    try:
        from numba import cuda
        if cuda.is_available():
            return True, ""
        why = "numba.cuda.is_available() is False"
    except Exception as e:  # noqa: BLE001 - any driver problem means "no GPU"
        why = f"numba.cuda failed: {type(e).__name__}: {e}"
    # A numba-cuda problem must not cost the CuPy and torch GPU tests: the GPU is
    # usable when CuPy finds it, and only the numba tests fail (saying why).
    from rtmem.backends import cuda_available
    if cuda_available():
        return True, ""
    return False, why + "; CuPy finds no usable GPU either"


def pytest_collection_modifyitems(config, items):
    ok, why = gpu_status()
    if ok:
        return
    if os.environ.get("RTMEM_REQUIRE_GPU") == "1" and _wants_real_gpu(config):
        # A GPU session (bench/gpu_session.sh) must not pass by skipping everything.
        pytest.exit(f"RTMEM_REQUIRE_GPU=1 but no usable CUDA GPU: {why}", returncode=3)
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU ({why}; run `pytest -m gpu` on a "
                                   "GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def arena(monkeypatch):
    """A 4 MiB host arena on the host backend, checked for consistency after the
    test (once the collection has run the frees of dropped tensor views)."""
    import gc

    import rtmem
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    a = rtmem.HostArena(1 << 22)
    yield a
    gc.collect()
    a._check_invariants()


@pytest.fixture
def host_backend(monkeypatch):
    """RTMEM_BACKEND=host for the test: state-machine tests (hypothesis TestCase
    classes, which take no fixture arguments) use it as
    ``@pytest.mark.usefixtures("host_backend")``; transfers.synchronize() and
    wait() act on the current backend's streams."""
    monkeypatch.setenv("RTMEM_BACKEND", "host")


@pytest.fixture
def fresh_seed() -> int:
    """A new random seed at every run, so reference checks see fresh inputs, not
    the same few forever. Printed (pytest shows it with a failure); replay a
    failure with RTMEM_TEST_SEED=<seed>."""
    seed = int(os.environ.get("RTMEM_TEST_SEED") or secrets.randbits(32))
    print(f"fresh_seed = {seed} (replay: RTMEM_TEST_SEED={seed})")
    return seed
