"""The GPU code paths of the benchmark scripts, end to end on CPU.

``bench/pcie.py``, ``bench/dha_layers.py``, ``bench/allocator.py`` (its GPU
section) and ``rtmem bench pcie|dha`` run only on a GPU machine, where a
Python-level slip (a wrong attribute, argument order or dict key) costs scarce
GPU time. Here they run in-process against the fake CuPy of tests/_fake_cupy.py
and numba's CUDA simulator, which the suite runs under (tests/conftest.py):

- the fake CuPy is installed in ``sys.modules`` with fresh rtmem backend and
  transfer-engine caches, and ``numba.cuda.as_cuda_array`` (missing from the
  simulator) is played by :meth:`_fake_cupy.FakeCupy.simulator_array`, all with
  ``monkeypatch``; the bench modules are imported fresh and dropped afterwards;
- ``find_gpu`` refuses the simulator (its timings mean nothing; the fake's are
  meaningless too, which does not matter here), so the scripts' own
  ``find_gpu`` runs with ``NUMBA_ENABLE_CUDASIM`` hidden from it alone;
- the DHA kernels are replaced by recorders that check each launch as the
  simulator would take it (grid/block dimensions, simulator arrays or scalars):
  simulated, one layer's launches take seconds (a LayerNorm over 32 tokens,
  ~10 s) and the kernels have their own tests (test_dha_kernels.py). The
  wrappers around them (conversions, shape and dtype checks) run for real, and
  :func:`test_simulated_kernels_use_fake_cupy_memory` runs two real simulated
  kernels on the fake's memory.

Timings from the fake are meaningless; what is checked is that every line of
the GPU branches runs and the JSON (and plot) have what the scripts promise.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import pathlib
import statistics
import sys
import time

import numpy as np
import pytest

import _fake_cupy
from _plots import fail_saves_half_way
from test_bench_keys import bench_module

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
#: Top-level modules the bench scripts import each other as.
BENCH_MODULES = ("_common", "pcie", "dha_layers", "allocator")


class Bench:
    """What a test gets from the ``bench`` fixture."""

    def __init__(self, fake, results, monkeypatch):
        self.fake, self.results, self._mp = fake, results, monkeypatch
        self.launches = None

    def load(self, name):
        """Import bench/NAME.py as the scripts import each other, seeing the fake GPU."""
        module = importlib.import_module(name)
        self.see_the_fake(module)
        return module

    def see_the_fake(self, module):
        """Make ``module.find_gpu`` (pcie's, imported by the others) ignore the
        simulator, and shrink dha_layers' model to something tiny."""
        mp = self._mp
        if hasattr(module, "find_gpu"):
            original = getattr(module.find_gpu, "__wrapped__", module.find_gpu)

            def find_gpu():
                with mp.context() as m:
                    m.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
                    return original()
            find_gpu.__wrapped__ = original
            mp.setattr(module, "find_gpu", find_gpu)
        if hasattr(module, "VOCAB"):                  # dha_layers
            mp.setattr(module, "VOCAB", 96)
            mp.setitem(module.HIDDEN, "tiny", 48)

    def stub_kernels(self):
        """Replace every kernel of rtmem.kernels.dha by a launch recorder; returns
        the list of kernel names launched (in order)."""
        from numba.cuda.errors import normalize_kernel_dimensions
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        from numba.cuda.simulator.kernel import FakeCUDAKernel

        from rtmem.kernels import dha
        launches = self.launches = []

        class Recorder:
            def __init__(self, name):
                self.name = name

            def __getitem__(self, config):
                assert 2 <= len(config) <= 4, (self.name, config)
                normalize_kernel_dimensions(*config[:2])   # what a launch checks first

                def launch(*args):
                    for i, a in enumerate(args):
                        assert isinstance(a, (FakeCUDAArray, bool, int, float, np.generic)), \
                            f"{self.name} argument {i} is a {type(a).__name__}"
                    launches.append(self.name)
                return launch
        for name, obj in list(vars(dha).items()):
            if isinstance(obj, FakeCUDAKernel) and not obj._device:
                self._mp.setattr(dha, name, Recorder(name))
        for r in dha._GEMM_KERNELS:                   # one GEMM per tile height
            self._mp.setitem(dha._GEMM_KERNELS, r, Recorder(f"_gemm_kernel_{r}"))
        # gpu_delay is a no-op under the simulator; here it really holds the
        # fake stream, so the Timer's "start event not reached yet" check works
        delays = self.delays = []

        def gpu_delay(seconds, *, stream=0):
            delays.append(seconds)
            stream._enqueue(lambda: time.sleep(seconds))
        self._mp.setattr(dha, "gpu_delay", gpu_delay)
        return launches

    def without_nvvm(self, *names):
        """Make the ``names`` of rtmem.kernels.dha raise as a first launch does when
        numba finds no NVVM to compile with."""
        from rtmem.kernels import dha

        def no_nvvm(*args, **kwargs):
            raise RuntimeError("libNVVM cannot be found")
        for name in names:
            self._mp.setattr(dha, name, no_nvvm)

    def json(self, name):
        return json.loads((self.results / f"{name}.json").read_text())


@pytest.fixture
def bench(monkeypatch, tmp_path):
    import rtmem.backends as backends
    from rtmem import transfers
    from rtmem.kernels import _launch
    if not _launch.simulator_active():
        pytest.skip("needs numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    from numba import cuda
    # gpt2's allocator trace wants an 8 GiB arena and ~6.5 GB of CuPy pool: the
    # fake's memory is numpy's, reserved but never touched, so it costs no RAM.
    fake = _fake_cupy.build(device_bytes=64 << 30)
    for name, module in fake.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(backends, "_instances", {})
    monkeypatch.setattr(backends, "_cuda_ok", None)
    monkeypatch.setattr(transfers, "_engines", {})
    monkeypatch.setattr(_launch, "_SCRATCH", {})
    monkeypatch.delenv("RTMEM_BACKEND", raising=False)
    monkeypatch.setattr(cuda, "as_cuda_array", fake.simulator_array, raising=False)
    monkeypatch.setattr(cuda, "is_cuda_array",
                        lambda obj: hasattr(obj, "__cuda_array_interface__"), raising=False)
    if importlib.util.find_spec("torch") is not None:
        # The GPU here is the fake. A CUDA build of torch on a GPU machine would
        # have bench/allocator.py measure torch's allocators on the real device
        # beside it (and pin the 20 GiB of its pinned check, rounded to 32): its
        # documents then held torch entries these tests, written for a CPU build,
        # did not expect. torch sees no CUDA, as a CPU build does.
        import torch
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    results = tmp_path / "results"
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(results))
    monkeypatch.syspath_prepend(str(BENCH))
    saved = {n: sys.modules.pop(n) for n in BENCH_MODULES if n in sys.modules}
    try:
        yield Bench(fake, results, monkeypatch)
        fake.synchronize_all()
        assert not fake.async_errors, fake.async_errors
    finally:
        for n in BENCH_MODULES:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
        fake.shutdown()


def _torch_skipped() -> str:
    """What the allocator benchmark says of torch's allocators here: torch is an
    extra (the test extra does not bring it), and the ``bench`` fixture hides a
    CUDA build's GPU from it (a CPU build has none)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed"
    return "is_available() is False"


def _rate_ok(x):
    return isinstance(x, float) and x > 0 and math.isfinite(x)


# ------------------------------------------------------------------- the fake
def test_fake_events_time_and_pinned_memory_is_a_buffer(bench):
    cp = sys.modules["cupy"]
    rt = cp.cuda.runtime
    s = cp.cuda.Stream(non_blocking=True)
    a, b, untimed = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event(disable_timing=True)
    with pytest.raises(rt.CUDARuntimeError, match="InvalidResourceHandle"):
        cp.cuda.get_elapsed_time(a, b)                 # never recorded
    a.record(s)
    b.record(s)
    untimed.record(s)
    b.synchronize()
    untimed.synchronize()
    assert cp.cuda.get_elapsed_time(a, b) >= 0.0
    with pytest.raises(rt.CUDARuntimeError, match="InvalidResourceHandle"):
        cp.cuda.get_elapsed_time(a, untimed)
    pin = cp.cuda.alloc_pinned_memory(1000)
    assert pin.size() == 1024 and int(pin) == pin.ptr == pin.mem.ptr
    assert bench.fake.calls_named("hostAlloc")[-1] == (1024, rt.hostAllocPortable)
    view = np.frombuffer(pin, dtype=np.uint8, count=1000)
    view[:] = 9
    assert (bench.fake.host_view(pin.ptr, 1000) == 9).all()
    del view, pin
    assert bench.fake.calls_named("freeHost")          # freed with its last reference
    pool = cp.cuda.MemoryPool()
    p = pool.malloc(1000)
    ptr = p.ptr
    assert pool.used_bytes() == pool.total_bytes() == 1024
    del p
    assert pool.used_bytes() == 0 and pool.n_free_blocks() == 1
    assert pool.malloc(700).ptr == ptr                 # the freed block is reused
    pool.free_all_blocks()
    assert pool.total_bytes() == 0 and ptr not in bench.fake.live


def test_simulated_kernels_use_fake_cupy_memory(bench):
    # Real (simulated) kernels on the fake's device memory, through the stand-in
    # for numba.cuda.as_cuda_array, and on numba's mapped memory.
    from numba import cuda

    from rtmem.kernels import dha
    cp = sys.modules["cupy"]
    host = np.arange(256, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    dev = cp.asarray(host)
    assert dev.data.ptr >= _fake_cupy.DEVICE_BASE
    view = cuda.as_cuda_array(dev)
    assert dha.xor_checksum(dha.dha_read(view, blocks=1)) == \
        int(np.bitwise_xor.reduce(host))
    dha.dha_write(view[:128], 7, blocks=1)
    got = dev.get()
    assert (got[:128] == 7).all() and (got[128:] == host[128:]).all()
    mapped = cuda.mapped_array(256, dtype=np.uint64)
    mapped[:] = host
    assert dha.xor_checksum(dha.dha_read(cuda.as_cuda_array(mapped), blocks=1)) == \
        int(np.bitwise_xor.reduce(host))


# ---------------------------------------------------------------- the scripts
def test_pcie_gpu_path(bench, capsys):
    pytest.importorskip("matplotlib")   # it plots its curves (an extra: rtmem[plot])
    pcie = bench.load("pcie")
    assert pcie.find_gpu() == ("Fake H200", "")
    launches = bench.stub_kernels()
    plot = bench.results / "sweep.png"
    assert pcie.main(["--quick", "--max-size", "16KiB", "--repeats", "1",
                      "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    doc = bench.json("pcie")
    assert doc["benchmark"] == "pcie" and doc["device"] == "Fake H200"
    # what ran, to run it again on another machine (it recorded no command)
    assert doc["command"] == (f"python bench/pcie.py --quick --max-size 16KiB --repeats 1 "
                              f"--plot {plot}")
    assert doc["sizes_bytes"] == [4096, 16384] and doc["repeats"] == 1
    assert set(doc["curves"]) == set(pcie.PATHS)
    for path, points in doc["curves"].items():
        assert [p["bytes"] for p in points] == [4096, 16384]
        assert all(_rate_ok(p["bytes_per_s"]) and p["seconds"] > 0 for p in points)
        # bidirectional: both copies' bytes over the time until both are done
        moved = 2 if path == "bidir_pinned" else 1
        assert all(p["bytes_per_s"] == pytest.approx(moved * p["bytes"] / p["seconds"])
                   for p in points)
    con = doc["contention"]
    assert con["bytes"] == 16384
    assert set(con["alone_bytes_per_s"]) == {"dha_read", "h2d_pinned", "d2h_pinned"}
    for other in ("h2d_pinned", "d2h_pinned"):
        entry = con[f"dha_read+{other}"]
        assert set(entry) == {"dha_read_bytes_per_s", f"{other}_bytes_per_s",
                              "aggregate_bytes_per_s"}
        assert all(_rate_ok(v) for v in entry.values())
    assert [r["bytes"] for r in doc["latency"]] == list(pcie.LATENCY_SIZES)
    assert all(set(r) == {"bytes", "h2d_pinned_s", "d2h_pinned_s", "h2d_pageable_s",
                          "dha_read_s"} for r in doc["latency"])
    assert plot.stat().st_size > 0 and f"wrote {bench.results / 'pcie.json'}" in out
    assert "dha/h2d" in out and "latency (us):" in out
    assert doc["goals"] == {"min_bytes": 64 << 20, "sizes_counted": 0}   # sizes too small
    assert "no size >= 64 MiB swept" in out
    assert set(launches) == {"_read_kernel", "_write_kernel"}
    # every event-timed run sat behind a delay that outlasted its queueing
    assert bench.delays and doc["timer"]["uncovered_runs"] == 0
    assert doc["l2_bytes"] > 0
    rt = bench.fake.modules["cupy.cuda.runtime"]
    copies = bench.fake.calls_named("memcpyAsync")
    assert {c[3] for c in copies} == {rt.memcpyHostToDevice, rt.memcpyDeviceToHost}
    assert 0 not in {c[4] for c in copies}             # on the benchmark's own streams


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"),
                                     KeyboardInterrupt()])
def test_a_pcie_plot_that_fails_while_written_leaves_the_previous_one(bench, monkeypatch,
                                                                      failure):
    # savefig wrote straight into --plot's file: a full disk or a time limit's
    # SIGINT half-way left a truncated image in place of the previous sweep's plot
    pytest.importorskip("matplotlib")
    pcie = bench.load("pcie")
    doc = {"device": "Fake H200",
           "curves": {"h2d_pinned": [{"bytes": 4096, "bytes_per_s": 1e9},
                                     {"bytes": 16384, "bytes_per_s": 3e9}]}}
    path = bench.results / "sweep.png"
    assert pcie.plot(doc, str(path)) == str(path)
    previous = path.read_bytes()
    fail_saves_half_way(monkeypatch, failure)
    doc["curves"]["h2d_pinned"][1]["bytes_per_s"] = 5e9
    with pytest.raises(type(failure)):
        pcie.plot(doc, str(path))
    assert path.read_bytes() == previous
    assert [p.name for p in bench.results.iterdir() if p.name.startswith(".")] == []


def test_pcie_without_dha_kernels_measures_copies_and_saves_each_size(bench, monkeypatch,
                                                                      capsys):
    # No NVVM (or a kernel failure) must not cost the copy measurements, and a
    # run stopped mid-sweep (a time limit's SIGINT) keeps the sizes it finished.
    pcie = bench.load("pcie")
    bench.stub_kernels()
    bench.without_nvvm("dha_write")
    assert pcie.main(["--quick", "--max-size", "16KiB", "--repeats", "1"]) == 0
    doc = bench.json("pcie")
    assert doc["dha_error"] == "RuntimeError: libNVVM cannot be found"
    assert set(doc["curves"]) == set(pcie.PATHS) - set(pcie.KERNEL_PATHS)
    assert doc["contention"] is None and "partial" not in doc
    assert all(r["dha_read_s"] is None and r["h2d_pinned_s"] > 0 for r in doc["latency"])
    assert "no DHA kernels (RuntimeError: libNVVM" in capsys.readouterr().out

    sweeps = []
    real_wall = pcie.Timer.wall

    def stop_at_second_size(self, fn, stream):
        sweeps.append(1)
        if len(sweeps) > 2:                  # two pageable paths per size
            raise KeyboardInterrupt
        return real_wall(self, fn, stream)
    monkeypatch.setattr(pcie.Timer, "wall", stop_at_second_size)
    assert pcie.main(["--quick", "--max-size", "16KiB", "--repeats", "1"]) == 130
    doc = bench.json("pcie")
    assert doc["partial"] is True and doc["sizes_bytes"] == [4096]
    assert doc["interrupted"] == "the measurements"
    assert all(len(points) == 1 for points in doc["curves"].values())
    err = capsys.readouterr().err
    assert "pcie: interrupted during the measurements" in err and "Traceback" not in err


def test_pcie_measures_copies_when_numba_cannot_use_the_driver(bench, monkeypatch, capsys):
    # numba-cuda talks to the driver on its own: one it cannot use failed at
    # the DHA paths' mapped_array, before their try, and the CuPy copies were
    # lost with them in a traceback
    from numba.cuda.cudadrv.error import CudaSupportError
    pcie = bench.load("pcie")
    bench.stub_kernels()

    def no_driver(*args, **kwargs):
        raise CudaSupportError("Error at driver init: CUDA driver version is insufficient")
    monkeypatch.setattr(sys.modules["numba"].cuda, "mapped_array", no_driver)
    assert pcie.main(["--quick", "--max-size", "16KiB", "--repeats", "1"]) == 0
    doc = bench.json("pcie")
    assert doc["dha_error"] == ("CudaSupportError: Error at driver init: CUDA driver "
                                "version is insufficient")
    assert set(doc["curves"]) == set(pcie.PATHS) - set(pcie.KERNEL_PATHS)
    for points in doc["curves"].values():
        assert [p["bytes"] for p in points] == [4096, 16384]
        assert all(_rate_ok(p["bytes_per_s"]) for p in points)
    assert doc["contention"] is None and all(r["dha_read_s"] is None for r in doc["latency"])
    assert "no DHA kernels (CudaSupportError" in capsys.readouterr().out


def test_pcie_interrupted_mid_size_keeps_only_the_finished_sizes(bench, monkeypatch):
    # The partial document once kept the live curves, which the sweep went on
    # filling: a SIGINT at a later path of a later size wrote that size's
    # first paths beside the finished sizes (curves longer than sizes_bytes).
    pcie = bench.load("pcie")
    bench.stub_kernels()
    bench.without_nvvm("dha_write")          # copies only: two wall-timed paths per size
    walls = []
    real_wall = pcie.Timer.wall

    def stop_in_the_third_size(self, fn, stream):
        walls.append(1)
        if len(walls) == 6:                  # d2h_pageable of the third size
            raise KeyboardInterrupt
        return real_wall(self, fn, stream)
    monkeypatch.setattr(pcie.Timer, "wall", stop_in_the_third_size)
    assert pcie.main(["--quick", "--max-size", "64KiB", "--repeats", "1"]) == 130
    doc = bench.json("pcie")
    assert doc["partial"] is True and doc["sizes_bytes"] == [4096, 16384]
    for points in doc["curves"].values():
        assert [p["bytes"] for p in points] == [4096, 16384]


@pytest.mark.parametrize("nvrtc", [True, False])
def test_pcie_times_copies_when_numba_cannot_compile_the_delay(bench, nvrtc):
    # Without NVVM numba compiles no kernel, the Timer's delay included: the
    # copies are then timed behind a CuPy (NVRTC) delay, or, without NVRTC
    # too, behind none.
    pcie = bench.load("pcie")
    bench.stub_kernels()
    bench.without_nvvm("gpu_delay", "dha_write")
    bench.fake.raw_kernels = nvrtc
    assert pcie.main(["--quick", "--max-size", "16KiB", "--repeats", "1"]) == 0
    doc = bench.json("pcie")
    assert doc["timer"]["delay_kernel"] == ("cupy" if nvrtc else "none")
    assert set(doc["curves"]) == set(pcie.PATHS) - set(pcie.KERNEL_PATHS)
    for points in doc["curves"].values():
        assert all(_rate_ok(p["bytes_per_s"]) for p in points)
    naps = bench.fake.calls_named("RawKernel")        # (name, grid, block, args)
    assert bool(naps) == nvrtc and all(args[0] > 0 for _, _, _, args in naps)
    if nvrtc:
        assert doc["timer"]["uncovered_runs"] == 0


def test_dha_layers_reports_a_kernel_failure_with_what_it_measured(bench, capsys):
    dl = bench.load("dha_layers")
    bench.stub_kernels()
    bench.without_nvvm("layernorm_forward")
    assert dl.main(["--quick", "--model", "tiny", "--tokens", "40", "--repeats", "1",
                    "--sweep", "none"]) == 1
    doc = bench.json("dha_layers")
    assert doc["partial"] is True and [layer["name"] for layer in doc["layers"]] == ["wte"]
    assert doc["error"] == "ln: RuntimeError: libNVVM cannot be found"
    # what ran, also in a partial document (it recorded no command)
    assert doc["command"] == ("python bench/dha_layers.py --quick --model tiny --tokens 40 "
                              "--repeats 1 --sweep none")
    assert "rtmem doctor" in capsys.readouterr().err


@pytest.mark.parametrize("sweep", [False, True])
def test_dha_layers_keeps_the_layers_it_finished_when_interrupted(bench, monkeypatch, capsys,
                                                                  sweep):
    # the layers were written at the end (or on a failure) only: a SIGINT from
    # gpu_session.sh's time limit kept none of those measured, in a traceback
    dl = bench.load("dha_layers")
    bench.stub_kernels()
    name = "sweep_point" if sweep else "measure_layer"
    real, started = getattr(dl, name), []

    def interrupted_at_the_second_layer(spec, *args):
        started.append(spec["name"])
        if len(started) > 1:
            raise KeyboardInterrupt
        return real(spec, *args)
    monkeypatch.setattr(dl, name, interrupted_at_the_second_layer)
    assert dl.main(["--model", "tiny", "--tokens", "8", "--repeats", "1",
                    "--sweep", "4,8" if sweep else "none"]) == 130
    doc = bench.json("dha_layers")
    # the final document's shape, cut short (it was another one, under the
    # same "format": no dtype, repeats or modes; the sweep's layers at the top)
    done = doc["sweep"]["layers"] if sweep else doc["layers"]
    assert doc["partial"] is True and [layer["name"] for layer in done] == ["wte"]
    assert doc["interrupted"] == ("the crossover sweep" if sweep
                                  else "the per-layer measurements")
    assert len(doc["layers"]) == (6 if sweep else 1) and "error" not in doc
    assert (doc["format"], doc["dtype"], doc["repeats"]) == ("rtmem.dha_layers/1",
                                                             "float32", 1)
    assert set(doc["modes"]) == set(dl.BACKWARD_MODES)
    assert "sweep_layers" not in doc and ("sweep" in doc) == sweep
    if sweep:
        assert set(doc["sweep"]) == {"tokens", "compares", "layers"}    # by_kind at the end
    assert "Traceback" not in capsys.readouterr().err


def test_dha_layers_keeps_the_table_when_the_sweep_fails(bench, monkeypatch, capsys):
    dl = bench.load("dha_layers")
    bench.stub_kernels()
    point = dl.sweep_point

    def fails_on_layernorm(spec, tokens, repeats, rng, *placed):
        if spec["kind"] == "layernorm":
            raise RuntimeError("out of memory")
        return point(spec, tokens, repeats, rng, *placed)
    monkeypatch.setattr(dl, "sweep_point", fails_on_layernorm)
    assert dl.main(["--model", "tiny", "--tokens", "8", "--repeats", "1",
                    "--sweep", "4,8"]) == 1
    doc = bench.json("dha_layers")
    assert doc["partial"] is True and doc["error"] == "ln: RuntimeError: out of memory"
    assert len(doc["layers"]) == 6                         # the main table survives
    assert [layer["name"] for layer in doc["sweep"]["layers"]] == ["wte"]
    assert "swept ln failed" in capsys.readouterr().err


def test_dha_layers_sweep_reuses_the_tables_point(bench, monkeypatch):
    # The sweep's point at --tokens is the main table's (measured once), the
    # others are timed by sweep_point.
    dl = bench.load("dha_layers")
    bench.stub_kernels()
    point, timed = dl.sweep_point, []

    def counted(spec, tokens, repeats, rng, *placed):
        timed.append((spec["name"], tokens))
        return point(spec, tokens, repeats, rng, *placed)
    monkeypatch.setattr(dl, "sweep_point", counted)
    assert dl.main(["--model", "tiny", "--tokens", "8", "--repeats", "1",
                    "--sweep", "4,8,16"]) == 0
    doc = bench.json("dha_layers")
    names = [layer["name"] for layer in doc["layers"]]
    assert sorted(timed) == sorted((name, t) for name in names for t in (4, 16))
    for table, swept in zip(doc["layers"], doc["sweep"]["layers"]):
        at8 = [p for p in swept["points"] if p["tokens"] == 8]
        assert len(at8) == 1 and at8[0]["from"] == "layers"
        assert at8[0]["forward_s"] == table["forward_s"]
        assert at8[0]["backward_s"] == {m: table["backward_s"][m] for m in ("gpu", "dha")}
        assert at8[0]["transfer_s"] == table["transfer_s"]
        assert [p["tokens"] for p in swept["points"]] == [4, 8, 16]


def test_dha_layers_refuses_a_bad_sweep_before_looking_for_a_gpu(bench, capsys):
    dl = bench.load("dha_layers")
    with pytest.raises(SystemExit):
        dl.main(["--sweep", "1024,64"])
    assert "ascending" in capsys.readouterr().err
    assert not (bench.results / "dha_layers.json").exists()


def test_pcie_refuses_sizes_the_latency_probes_would_overrun(bench):
    pcie = bench.load("pcie")
    with pytest.raises(SystemExit):
        pcie.main(["--max-size", "1KiB"])
    with pytest.raises(SystemExit):
        pcie.main(["--repeats", "-1"])


def test_dha_layers_gpu_path(bench, capsys):
    dl = bench.load("dha_layers")
    launches = bench.stub_kernels()
    assert dl.main(["--quick", "--model", "tiny", "--tokens", "40", "--repeats", "1",
                    "--sweep", "8,16,32"]) == 0
    out = capsys.readouterr().out
    doc = bench.json("dha_layers")
    assert "partial" not in doc                   # written after each layer until the end
    h, v = 48, 96
    assert (doc["format"], doc["device"], doc["model"], doc["hidden"], doc["tokens"],
            doc["dtype"], doc["repeats"]) == ("rtmem.dha_layers/1", "Fake H200", "tiny",
                                              h, 40, "float32", 1)
    assert set(doc["modes"]) == set(dl.BACKWARD_MODES)
    params = {"wte": v * h, "ln": 2 * h, "attn.c_attn": 3 * h * h + 3 * h,
              "attn.c_proj": h * h + h, "mlp.c_fc": 4 * h * h + 4 * h,
              "mlp.c_proj": 4 * h * h + h}
    assert [layer["name"] for layer in doc["layers"]] == list(params)
    for layer in doc["layers"]:
        assert layer["param_bytes"] == layer["grad_bytes"] == 4 * params[layer["name"]]
        assert set(layer["forward_s"]) == set(dl.FORWARD_MODES)
        assert set(layer["backward_s"]) == set(dl.BACKWARD_MODES)
        times = [layer["transfer_s"], layer["grad_transfer_s"],
                 *layer["forward_s"].values(), *layer["backward_s"].values()]
        assert all(_rate_ok(t) for t in times)
        assert layer["dha_matches_gpu"] is True
        assert layer["tokens"] == 40 and layer["activation_in_bytes"] > 0
        # one SM under the simulator: the 256-row tile, one read of the weight
        reads = {"forward": 1, "backward": 1} if layer["kind"] == "linear" else None
        assert layer["weight_reads"] == reads
    assert "mlp.c_proj" in out and "bitwise" in out and "wrote" in out
    # the crossover sweep: every layer at every token count, and a verdict each way
    sweep = doc["sweep"]
    assert sweep["tokens"] == [8, 16, 32] and set(sweep["compares"]) == {"forward", "backward"}
    assert [layer["name"] for layer in sweep["layers"]] == list(params)
    for layer in sweep["layers"]:
        assert [p["tokens"] for p in layer["points"]] == [8, 16, 32]
        for p in layer["points"]:
            assert set(p["forward_s"]) == set(dl.FORWARD_MODES)
            assert set(p["backward_s"]) == {"gpu", "dha"}
            assert (p["weight_reads"] is None) == (layer["kind"] != "linear")
            assert all(_rate_ok(t) for t in [p["transfer_s"], *p["forward_s"].values(),
                                             *p["backward_s"].values()])
        for direction in ("forward", "backward"):
            c = layer[direction]
            assert len(c["dha_over_copy"]) == 3 and c["verdict"] in \
                {"dha", "copy", "dha below", "dha above", "mixed"}
    assert set(sweep["by_kind"]) == {"embedding", "layernorm", "linear"}
    assert set(sweep["by_kind"]["linear"]["forward"]["layers"]) == \
        {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}
    assert "fwd dha/copy @32" in out and "swept mlp.c_proj" in out
    assert {"_embedding_fwd_kernel", "_embedding_grad_kernel", "_layernorm_fwd_kernel",
            "_layernorm_dx_kernel", "_column_finish_kernel"} <= set(launches)
    assert any(name.startswith("_gemm_kernel_") for name in launches)
    # the copy mode's cudaMemcpyAsync calls go between pinned host and device memory
    rt = bench.fake.modules["cupy.cuda.runtime"]
    kinds = {c[3] for c in bench.fake.calls_named("memcpyAsync")}
    assert kinds == {rt.memcpyHostToDevice, rt.memcpyDeviceToHost}


def test_allocator_gpu_section(bench, capsys):
    al = bench.load("allocator")
    assert al.main(["--quick"]) == 0
    out = capsys.readouterr().out
    doc = bench.json("allocator")
    assert doc["gpu"]["measured"] is True and "partial" not in doc    # the complete document
    names = al._RTMEM_GPU + ("cupy_memorypool",)
    assert "rtmem_core_stream_ordered" in names
    for trace in ("random", "gpt2"):
        d = doc["gpu"][trace]
        assert all(_rate_ok(d[f"{n}_pairs_per_s"]) for n in names)
        assert all(_rate_ok(d[f"{n}_over_cupy"]) for n in al._RTMEM_GPU)
        # every repeat's rate and ratio, not the medians alone (--quick: 3 repeats)
        for n in al._RTMEM_GPU:
            rates, cupy = d[f"{n}_pairs_per_s_all"], d["cupy_memorypool_pairs_per_s_all"]
            assert len(rates) == len(cupy) == doc["repeats"] == 3
            assert d[f"{n}_over_cupy_all"] == [a / b for a, b in zip(rates, cupy)]
            assert d[f"{n}_pairs_per_s"] == statistics.median(rates)
        assert d["warmup_ooms"] == d["timed_ooms"] == dict.fromkeys(names, 0)
        assert "torch_caching_pairs_per_s" not in d            # torch sees no CUDA
        assert _torch_skipped() in d["torch_caching_skipped"]
        assert f"GPU {trace}: rtmem_device_arena / CuPy pool" in out
        # the pool reserved at least the trace's peak of live bytes, in 512 B units
        assert d["cupy_memorypool_reserved_bytes"] % 512 == 0
        assert d["cupy_memorypool_reserved_over_peak_live"] >= 1.0
        assert d["cupy_memorypool_reserved_over_peak_live"] == \
            d["cupy_memorypool_reserved_bytes"] / doc[trace]["peak_live_bytes"]
    # the pinned check went to the cuda backend (and the fake's 1 GiB of host memory)
    assert "cudaHostAlloc" in doc["pinned"]["error"]
    pools = doc["pinned"]["pools"]
    assert "CUDARuntimeError" in pools["cupy_pinned_pool_error"]
    assert _torch_skipped() in pools["torch_pinned_skipped"]
    assert "pinned 20.4 GiB: cupy_pinned_pool_error" in out
    assert not [a for a in bench.fake.live.values() if a.kind == "device"], \
        "the GPU section leaves device memory behind"


def test_allocator_gpu_section_reports_allocations_refused_while_timed(bench, monkeypatch,
                                                                       capsys):
    # Only the warm-up's refusals were reported: time_replays dropped those of
    # the timed replays, so a contender faster for serving less of the trace
    # (its stream-ordered frees still pending, say) passed unnoticed
    import dataclasses
    al = bench.load("allocator")
    real, replays = al.replay, []

    def replay(trace, allocator, **kwargs):
        result = real(trace, allocator, **kwargs)
        replays.append(type(allocator).__name__)
        if type(allocator).__name__ == "OrderedCore" and replays.count("OrderedCore") > 1:
            return dataclasses.replace(result, ooms=3)        # not in its warm-up
        return result
    monkeypatch.setattr(al, "replay", replay)
    monkeypatch.setattr(al, "time_pair", lambda *a, **k: ([1.0], [1.0], [1.0]))  # host sections
    monkeypatch.setattr(al, "sampled_fragmentation", lambda *a, **k: (0.0, 0.0, 1 << 20))
    assert al.main(["--quick", "--repeats", "2"]) == 0
    d = bench.json("allocator")["gpu"]["random"]
    assert d["warmup_ooms"]["rtmem_core_stream_ordered"] == 0
    assert d["timed_ooms"] == {"rtmem_jit_core": 0, "rtmem_core": 0,
                               "rtmem_core_stream_ordered": 6,
                               "rtmem_device_arena": 0, "cupy_memorypool": 0}
    out = capsys.readouterr().out
    assert ("GPU random: rtmem_core_stream_ordered refused allocations (OOM, timed): "
            "timings invalid") in out


def test_pinned_pools_measure_what_cupys_pool_takes(bench):
    al = bench.load("allocator")
    for request, taken in ((64 << 20, 64 << 20), ((64 << 20) + 1, (64 << 20) + 512)):
        out = al.pinned_pools(request)
        assert out["cupy_pinned_pool_bytes"] == taken
        assert _torch_skipped() in out["torch_pinned_skipped"]
    assert bench.fake.host_used == 0            # given back before returning


def test_cli_bench_pcie_and_dha(bench, monkeypatch, capsys):
    pytest.importorskip("matplotlib")   # pcie plots its curves (an extra: rtmem[plot])
    from rtmem import cli, cli_bench
    bench.load("pcie")                                  # dha_layers imports it
    launches = bench.stub_kernels()
    load = cli_bench._load

    def load_seeing_the_fake(script):
        module = load(script)
        bench.see_the_fake(module)
        return module
    monkeypatch.setattr(cli_bench, "_load", load_seeing_the_fake)
    assert cli.main(["bench", "pcie", "--quick", "--max-size", "4KiB", "--repeats", "1"]) == 0
    assert bench.json("pcie")["sizes_bytes"] == [4096]
    assert (bench.results / "pcie.png").stat().st_size > 0     # default: next to the JSON
    assert cli.main(["bench", "dha", "--quick", "--model", "tiny", "--tokens", "8",
                     "--repeats", "1", "--sweep", "4,8"]) == 0
    doc = bench.json("dha_layers")
    assert doc["sweep"]["tokens"] == [4, 8]
    assert (doc["model"], doc["tokens"], doc["repeats"], len(doc["layers"])) == \
        ("tiny", 8, 1, 6)
    assert launches and "no CUDA GPU" not in capsys.readouterr().out
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"     # hidden from find_gpu only


def test_cli_bench_pcie_help_names_where_the_plot_goes(capsys):
    # it named bench/results/pcie.png, where the plot goes only without
    # $RTMEM_BENCH_RESULTS (next to the JSON: test_cli_bench_pcie_and_dha)
    from rtmem import cli
    with pytest.raises(SystemExit):
        cli.main(["bench", "pcie", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default next to the JSON: bench/results/pcie.png, or " \
        "$RTMEM_BENCH_RESULTS/pcie.png when set)" in text


def test_pcie_goals_take_the_worst_size_of_at_least_64_mib(monkeypatch):
    # the goal quantities were only printed per size, never recorded
    pcie = bench_module(monkeypatch, "pcie")
    mib = 1 << 20
    sizes = [16 * mib, 64 * mib, 256 * mib]
    rates = {"h2d_pageable": [5, 6, 7], "d2h_pageable": [5, 6, 6], "h2d_pinned": [30, 50, 52],
             "d2h_pinned": [30, 45, 48], "dha_read": [1, 40, 50]}
    doc = {"sizes_bytes": sizes,
           "curves": {p: [{"bytes": n, "bytes_per_s": r * 1e9} for n, r in zip(sizes, v)]
                      for p, v in rates.items()}}
    g = pcie.goals(doc)
    assert g["sizes_counted"] == 2 and g["best_copy_bytes_per_s"] == 52e9
    assert g["h2d_pinned_over_best_copy"] == pytest.approx(50 / 52)
    assert g["d2h_pinned_over_best_copy"] == pytest.approx(45 / 52)
    assert g["dha_read_over_h2d_pinned"] == pytest.approx(40 / 50)
