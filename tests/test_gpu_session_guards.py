"""A GPU session must not report success for a run that measured nothing.

bench/gpu_session.sh exports ``RTMEM_REQUIRE_GPU=1``: then ``pytest -m gpu``
stops with exit code 3 instead of skipping every test, and the GPU benchmarks
exit 3 instead of 0 when they find no GPU. Without the variable, a machine
without a GPU still gets the clean skip / "nothing measured" exit 0.
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pytest_gpu(require: bool):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_ENABLE_CUDASIM", "RTMEM_REQUIRE_GPU", "CUDA_VISIBLE_DEVICES")}
    env["CUDA_VISIBLE_DEVICES"] = ""          # no GPU, even on a machine that has one
    if require:
        env["RTMEM_REQUIRE_GPU"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist",
                           "-p", "no:cacheprovider", "-m", "gpu",
                           "tests/test_dha_gpu.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_pytest_m_gpu_without_a_gpu_skips_or_fails_as_asked():
    plain = _pytest_gpu(require=False)
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-2000:]
    assert "skipped" in plain.stdout and "passed" not in plain.stdout
    required = _pytest_gpu(require=True)
    assert required.returncode == 3, required.stdout[-2000:] + required.stderr[-2000:]
    assert "RTMEM_REQUIRE_GPU=1 but no usable CUDA GPU" in required.stdout + required.stderr


@pytest.mark.parametrize("script", ["pcie", "dha_layers"])
def test_gpu_benchmarks_without_a_gpu_exit_3_only_when_required(script, monkeypatch,
                                                                 capsys):
    # under the suite's simulator, find_gpu() refuses: no GPU
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import importlib
    module = importlib.import_module(script)
    monkeypatch.delenv("RTMEM_REQUIRE_GPU", raising=False)
    assert module.main(["--quick"]) == 0
    monkeypatch.setenv("RTMEM_REQUIRE_GPU", "1")
    assert module.main(["--quick"]) == 3
    assert capsys.readouterr().out.count("nothing measured, nothing written") == 2


def test_train_and_allocator_benchmarks_without_a_gpu_exit_3_only_when_required(
        monkeypatch, capsys, tmp_path):
    # They exited 0 with the GPU section "not measured", so a session step whose
    # torch CUDA did not work reported ok; train also replaced an earlier GPU
    # result with "measured": false
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    import importlib
    train = importlib.import_module("train")
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("RTMEM_REQUIRE_GPU", "1")
    assert train.main(["--skip-cpu", "--out", "train"]) == 3
    assert "nothing written" in capsys.readouterr().out and not list(tmp_path.iterdir())
    monkeypatch.delenv("RTMEM_REQUIRE_GPU")
    assert train.main(["--skip-cpu", "--out", "train"]) == 0
    assert (tmp_path / "train.json").exists()

    allocator = importlib.import_module("allocator")
    monkeypatch.setattr(allocator, "cuda_available", lambda: False)
    # only the exit is under test: the CPU measurements are stubbed out
    monkeypatch.setattr(allocator, "time_pair", lambda *a, **k: (1.0, 1.0, 1.0))
    monkeypatch.setattr(allocator, "pinned_check", lambda nbytes: {"error": "stubbed"})
    monkeypatch.setenv("RTMEM_REQUIRE_GPU", "1")
    assert allocator.main(["--quick"]) == 3
    assert "RTMEM_REQUIRE_GPU=1: no usable CUDA GPU" in capsys.readouterr().out
    monkeypatch.delenv("RTMEM_REQUIRE_GPU")
    assert allocator.main(["--quick"]) == 0
