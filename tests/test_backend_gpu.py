"""The cuda backend on a real GPU (``pytest -m gpu``), plus the CPU-side checks of
backend selection, ``rtmem doctor`` and the integrations' missing-extra errors."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

from rtmem import transfers as T
from rtmem.arena import DeviceArena, HostArena
from rtmem.backends import cuda_available
from rtmem.errors import ResidencyError

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU (CuPy)")
HAS_CUPY = importlib.util.find_spec("cupy") is not None


# ------------------------------------------------------------- CPU checks
def _doctor_args(*argv):
    """``rtmem doctor ARGV`` parsed: ``args.func(args)`` runs it and returns its
    exit code."""
    from rtmem import doctor
    ap = argparse.ArgumentParser()
    doctor.register(ap.add_subparsers())
    return ap.parse_args(["doctor", *argv])


def test_doctor_reports_and_exit_code(capsys, monkeypatch):
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    args = _doctor_args()
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "backend          host" in out and "pinned limit" in out and "numba" in out
    args = _doctor_args("--json")
    assert args.func(args) == 0
    assert '"backend": "host"' in capsys.readouterr().out
    if not cuda_available():
        monkeypatch.setenv("RTMEM_BACKEND", "cuda")
        assert args.func(args) == 1


def test_doctor_says_why_nvvm_is_missing(monkeypatch):
    # numba's nvvm.is_available() is a bare bool: the doctor reports the load
    # error and CUDA_HOME, which decides where numba-cuda looks.
    from rtmem import doctor
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    monkeypatch.setenv("CUDA_HOME", "/opt/no-toolkit")
    from numba.cuda.cudadrv import nvvm

    def missing():
        raise RuntimeError("libNVVM cannot be found")
    monkeypatch.setattr(nvvm, "is_available", lambda: False)
    monkeypatch.setattr(nvvm, "NVVM", missing)
    import numba
    monkeypatch.setattr(numba.config, "ENABLE_CUDASIM", False, raising=False)
    report = doctor.collect()
    assert report["CUDA_HOME"] == "/opt/no-toolkit" and report["numba_cuda_nvvm"] is False
    assert report["numba_cuda_nvvm_error"] == "RuntimeError: libNVVM cannot be found"
    text = "\n".join(doctor._lines(report))
    assert "CUDA_HOME=/opt/no-toolkit" in text and "NVVM: no" in text
    assert "! RuntimeError: libNVVM cannot be found (set CUDA_HOME" in text


def test_doctor_names_the_cuda_simulator(monkeypatch):
    # Under NUMBA_ENABLE_CUDASIM=1 it said "usable: yes; NVVM: no" with no GPU.
    import numba

    from rtmem import doctor
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    monkeypatch.setattr(numba.config, "ENABLE_CUDASIM", True, raising=False)
    report = doctor.collect()
    assert report["numba_cuda_simulator"] is True
    line = next(x for x in doctor._lines(report) if x.startswith("numba-cuda"))
    assert "CUDA simulator" in line and "usable" not in line


def test_doctor_says_why_an_installed_numba_does_not_import(monkeypatch, tmp_path):
    # numba refuses a numpy newer than it supports with an ImportError ("Numba
    # needs NumPy 2.4 or less"): the report said "numba  not installed".
    from importlib.metadata import version

    from rtmem import doctor
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    (tmp_path / "numba").mkdir()        # a numba whose version check fails, first on the path
    (tmp_path / "numba" / "__init__.py").write_text(
        'raise ImportError("Numba needs NumPy 2.4 or less. Got NumPy 2.5.")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "numba")       # put back after the test
    report = doctor.collect()
    assert report["numba"] is None and report["numba_installed"] == version("numba")
    assert report["numba_error"] == "ImportError: Numba needs NumPy 2.4 or less. Got NumPy 2.5."
    text = "\n".join(doctor._lines(report))
    assert "not installed\n" not in text and "numba-cuda" not in text
    assert f"numba            {version('numba')} is installed but does not import" in text
    assert f"  ! {report['numba_error']} (install a numba release" in text
    assert "pinned limit" in text


def _report(**changes):
    report = {"RTMEM_BACKEND": None, "backend": "host", "backends": ["host", "cuda"],
              "gpu_usable": False, "numba": "0.61.0", "numba_cuda": None,
              "numba_cuda_simulator": False, "numba_cuda_available": False,
              "numba_cuda_nvvm": True, "CUDA_HOME": None,
              "cuda": {"cupy": None, "memlock_limit_bytes": None,
                       "host_available_bytes": 64 * 2**30}}
    report.update(changes)
    return report


def test_doctor_lines_show_devices_limits_and_errors():
    from rtmem import doctor
    text = "\n".join(doctor._lines(_report()))
    assert "backend          host  (automatic: cuda if a GPU is usable" in text
    assert "memlock rlimit unlimited (mlock" in text and "host available 64.00 GiB" in text
    assert "gpu              none found" in text and "  ! " not in text
    # a CuPy error is shown only when CuPy is there (without it: "not installed")
    assert "  ! no device" not in "\n".join(doctor._lines(_report(
        cuda={"cupy": None, "error": "no device", "memlock_limit_bytes": 65536})))
    cuda = {"cupy": "13.0.0", "error": "no device", "memlock_limit_bytes": 65536,
            "driver_version": 12080, "runtime_version": 12060,
            "devices": [{"id": 0, "name": "H200", "total_bytes": 141 * 2**30,
                         "compute_capability": "9.0", "can_map_host_memory": False}]}
    lines = doctor._lines(_report(RTMEM_BACKEND="cuda", backend="cuda", cuda=cuda))
    text = "\n".join(lines)
    assert lines[0] == "backend          cuda  (RTMEM_BACKEND=cuda)"
    assert "  ! no device" in lines
    assert "H200, 141.00 GiB, sm 9.0, map host memory: no" in text
    assert "memlock rlimit 64.00 KiB (mlock" in text and "host available unknown" in text


def test_doctor_exit_1_and_the_reason_for_an_invalid_backend(capsys, monkeypatch):
    monkeypatch.setenv("RTMEM_BACKEND", "bogus")
    args = _doctor_args()
    assert args.func(args) == 1
    out = capsys.readouterr().out
    first, second = out.splitlines()[:2]
    assert first == "backend          invalid  (RTMEM_BACKEND=bogus)"
    assert second.startswith("  ! ") and "bogus" in second


@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed")
def test_missing_cupy_names_the_extra():
    from rtmem.backends import get_backend
    from rtmem.integrations import cupy as rtcupy
    from rtmem.errors import BackendError
    with pytest.raises(ModuleNotFoundError, match=r"rtmem\[cuda12\]"):
        get_backend("cuda")
    with pytest.raises(ModuleNotFoundError, match=r"rtmem\[cuda12\]"):
        rtcupy.install(None)
    # BackendError documents a missing CuPy among its causes: a caller falling
    # back to the host backend with `except BackendError` got a ModuleNotFoundError
    with pytest.raises(BackendError, match=r"rtmem\[cuda12\]"):
        get_backend("cuda")
    with pytest.raises(BackendError, match=r"rtmem\[cuda12\]"):
        DeviceArena(4096, backend="cuda")


def test_numba_emm_class_is_a_versioned_plugin():
    pytest.importorskip("numba.cuda")
    from numba import config
    from rtmem.integrations import numba_emm
    if config.ENABLE_CUDASIM:
        with pytest.raises(RuntimeError, match="simulator"):
            numba_emm.manager_class()
        return
    from numba.cuda.cudadrv.driver import HostOnlyCUDAMemoryManager
    cls = numba_emm.manager_class()
    assert issubclass(cls, HostOnlyCUDAMemoryManager)
    assert numba_emm._numba_memory_manager is cls
    assert cls.interface_version.fget(None) == 1
    assert not cls.__abstractmethods__          # numba can instantiate it


# ------------------------------------------------------------- GPU checks
@pytest.fixture
def cp():
    import cupy
    return cupy


@gpu
@needs_gpu
def test_device_buffer_is_cupy_zero_copy(cp):
    d = DeviceArena("64MiB", backend="cuda")
    b = d.alloc(shape=(1000,), dtype=np.float32)
    arr = cp.asarray(b)
    assert arr.data.ptr == d.slabs[0].ptr + b.offset
    arr[:] = 3
    assert float(b.to_numpy().sum()) == 3000.0
    assert b.__dlpack_device__()[0] == 2
    assert float(cp.from_dlpack(b).sum()) == 3000.0
    with pytest.raises(ResidencyError, match="not host-addressable"):
        b.numpy()
    assert not hasattr(b, "__array_interface__")   # consumers fall back to CAI
    del arr
    b.free()
    d._check_invariants()


@gpu
@needs_gpu
def test_cuda_offload_prefetch_checksums_and_no_leaks(cp):
    d = DeviceArena("64MiB", backend="cuda")
    h = HostArena("64MiB", backend="cuda")
    rng = cp.random.default_rng(0)
    bufs, sums = [], []
    for i in range(16):
        b = d.alloc(shape=(1000 + 37 * i,), dtype=np.float32)
        cp.asarray(b)[:] = rng.standard_normal(b.shape, dtype=cp.float32)
        bufs.append(b)
        sums.append(zlib.crc32(b.to_numpy().tobytes()))
    for _ in range(50):
        for b in bufs:
            T.offload(b, arena=h)
        for b in bufs:
            T.evict(b)
        for b in reversed(bufs):
            T.prefetch(b)
        for b in bufs:
            T.synchronize(b)
            T.drop_host(b)
    for b, s in zip(bufs, sums):
        assert zlib.crc32(b.to_numpy().tobytes()) == s
        b.free()
    T.get_engine("cuda").synchronize()
    assert d.stats().allocated_bytes == 0 and h.stats().allocated_bytes == 0
    assert T.get_engine("cuda").in_flight == 0
    d._check_invariants()
    h._check_invariants()


_EVENTS_ORDER_COPIES = """
import threading, time
import cupy as cp
from rtmem import transfers as T
from rtmem.arena import DeviceArena, HostArena
d = DeviceArena("16MiB", backend="cuda")
h = HostArena("16MiB", backend="cuda")
eng = T.get_engine("cuda")
b = d.alloc(1 << 20)
cp.asarray(b)[:] = 1
gate = threading.Event()
timer = threading.Timer(60, gate.set)      # never leave the driver thread blocked
timer.daemon = True
timer.start()
eng.d2h.launch_host_func(gate.wait)
ev = T.offload(b, arena=h)
assert not ev.query() and b.residency == "in-flight"
gate.set()
deadline = time.monotonic() + 60
while not ev.query():              # poll: the host func needs the GIL to return
    assert time.monotonic() < deadline, "copy never ran after the gate opened"
    time.sleep(0.001)
assert b.residency == "both" and (b.numpy("host") == 1).all()
timer.cancel()
b.free()
print("ok")
"""


@gpu
@needs_gpu
def test_cuda_events_order_copies():
    # A host function that blocks the driver's callback thread until the host
    # sets a flag: run in a child process with a timeout, so that a driver that
    # serializes API calls behind it costs this test, not the whole GPU session.
    out = subprocess.run([sys.executable, "-c", _EVENTS_ORDER_COPIES],
                         env=dict(os.environ, RTMEM_BACKEND="cuda"), capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@gpu
@needs_gpu
def test_mapped_buffer_written_by_gpu_is_visible_on_host(cp):
    h = HostArena("1MiB", mapped=True, backend="cuda")
    b = h.alloc(shape=(256,), dtype=np.int32)
    b.numpy()[:] = 0
    cai = b.__cuda_array_interface__
    assert cai["data"][0] == h.slabs[0].device_ptr + b.offset
    arr = cp.asarray(b)                # the device alias of host memory
    arr += 5                           # a GPU kernel writes host memory
    cp.cuda.get_current_stream().synchronize()
    assert (b.numpy() == 5).all()
    b.free()


@gpu
@needs_gpu
def test_numba_kernel_on_device_and_mapped_buffers(cp):
    from numba import cuda
    if not cuda.is_available():
        pytest.skip("numba.cuda cannot see the GPU")
    from rtmem.kernels._launch import import_numba_cuda_arrays
    import_numba_cuda_arrays()      # this kernel may be the process's first (numpy 2.5)

    @cuda.jit
    def add_one(x):
        i = cuda.grid(1)
        if i < x.size:
            x[i] += 1

    d = DeviceArena("16MiB", backend="cuda")
    b = d.alloc(shape=(1024,), dtype=np.float32)
    cp.asarray(b)[:] = 1
    add_one[4, 256](b)
    cuda.synchronize()
    assert float(b.to_numpy().sum()) == 2048.0
    h = HostArena("1MiB", mapped=True, backend="cuda")
    m = h.alloc(shape=(1024,), dtype=np.float32)
    m.numpy()[:] = 10
    # numba types an argument by __dlpack__ before __cuda_array_interface__, and a
    # mapped buffer's DLPack capsule is the host one: go through the CUDA array
    # interface explicitly to run on the device alias (the DHA path)
    alias = cuda.as_cuda_array(m)
    assert alias.__cuda_array_interface__["data"][0] == m.__cuda_array_interface__["data"][0]
    add_one[4, 256](alias)
    cuda.synchronize()
    assert (m.numpy() == 11).all()
    add_one[4, 256](m)          # passed as is: still lands in the same memory
    cuda.synchronize()
    assert (m.numpy() == 12).all()
    b.free()
    m.free()


@gpu
@needs_gpu
def test_pinned_arena_reserves_exact_request():
    request = int(100.4 * (1 << 20)) + 5
    h = HostArena(request, backend="cuda")
    assert h.stats().reserved_bytes == -(-request // 256) * 256
    assert h.slabs[0].pinned
    h.close()


@gpu
@needs_gpu
def test_debug_mode_detects_gpu_write_after_free(cp):
    from rtmem.errors import UseAfterFreeError
    d = DeviceArena("1MiB", backend="cuda", debug=True)
    b = d.alloc(4096)
    stale = cp.asarray(b)
    b.free()
    stale[3] = 1
    cp.cuda.get_current_stream().synchronize()
    with pytest.raises(UseAfterFreeError):
        d.alloc(4096)


@gpu
@needs_gpu
def test_cupy_allocator_hook(cp):
    from rtmem.integrations import cupy as rtcupy
    d = DeviceArena("64MiB", backend="cuda")
    with rtcupy.using(d):
        x = cp.arange(1000, dtype=cp.float64)
        assert d.stats().count_by_kind["workspace"] >= 1
        assert int(x.sum()) == 499500
    del x
    gc.collect()
    cp.cuda.get_current_stream().synchronize()
    assert d.stats().count_by_kind["workspace"] == 0


@gpu
@needs_gpu
def test_numba_emm_plugin_in_subprocess():
    code = ("from numba import cuda\n"
            "import numpy as np\n"
            "from rtmem.integrations import numba_emm\n"
            "x = cuda.to_device(np.arange(1000, dtype=np.float32))\n"
            "a = numba_emm._arena\n"
            "assert a.stats().count_by_kind['workspace'] == 1, a.stats()\n"
            "assert float(x.copy_to_host().sum()) == 499500.0\n"
            "free, total = cuda.current_context().get_memory_info()\n"
            "assert total == max(a.core.max_bytes, a.stats().reserved_bytes)\n"
            "print('ok')\n")
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="rtmem.integrations.numba_emm",
               RTMEM_NUMBA_ARENA_BYTES="64MiB")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_doctor_gives_no_nvvm_advice_under_the_cuda_simulator(monkeypatch):
    # The simulator's nvvm stub is "not available": the doctor printed
    # "! NvvmSupportError: NVVM not supported in the simulator (set CUDA_HOME to a
    # CUDA toolkit ...)", advice the simulator never reads.
    import numba
    from numba.cuda.cudadrv import nvvm

    from rtmem import doctor

    def stub():
        raise RuntimeError("NVVM not supported in the simulator")
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    monkeypatch.setattr(numba.config, "ENABLE_CUDASIM", True, raising=False)
    monkeypatch.setattr(nvvm, "is_available", lambda: False)
    monkeypatch.setattr(nvvm, "NVVM", stub)
    report = doctor.collect()
    assert report["numba_cuda_nvvm"] is None and "numba_cuda_nvvm_error" not in report
    text = "\n".join(doctor._lines(report))
    assert "CUDA_HOME" not in text and "CUDA simulator" in text
