"""A GPU session must not report success for a run that measured nothing.

bench/gpu_session.sh exports ``RTMEM_REQUIRE_GPU=1``: then ``pytest -m gpu``
stops with exit code 3 instead of skipping every test, and the GPU benchmarks
exit 3 instead of 0 when they find no GPU. Without the variable, a machine
without a GPU still gets the clean skip / "nothing measured" exit 0.
"""

import json
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


def _not_measured(section) -> bool:
    """Whether a results section is written as bench/_common.not_measured writes
    it: ``{"measured": false, "reason": "words"}`` and nothing else."""
    return (set(section) == {"measured", "reason"} and section["measured"] is False
            and isinstance(section["reason"], str) and section["reason"] != "")


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
    out, err = capsys.readouterr()        # a diagnostic: on stderr, not with results
    assert err.count("nothing measured, nothing written") == 2 and "nothing" not in out


def test_train_benchmark_without_a_gpu_exits_3_only_when_required(monkeypatch, capsys,
                                                                  tmp_path):
    # It exited 0 with the GPU section "not measured", so a session step whose
    # torch CUDA did not work reported ok; it also replaced an earlier GPU result
    # with "measured": false
    pytest.importorskip("torch")        # bench/train.py imports it (an extra)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    import importlib
    train = importlib.import_module("train")
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("RTMEM_REQUIRE_GPU", "1")
    assert train.main(["--skip-cpu", "--out", "train"]) == 3
    assert "nothing written" in capsys.readouterr().err and not list(tmp_path.iterdir())
    monkeypatch.delenv("RTMEM_REQUIRE_GPU")
    assert train.main(["--skip-cpu", "--out", "train"]) == 0
    doc = json.loads((tmp_path / "train.json").read_text())
    assert _not_measured(doc["gpu"]) and _not_measured(doc["cpu"])


def test_allocator_benchmark_without_a_gpu_exits_3_only_when_required(monkeypatch, capsys,
                                                                      tmp_path):
    # It exited 0 with the GPU section "skipped", so a session step whose GPU
    # did not work reported ok (no torch needed: torch's allocators are optional
    # contenders)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    import importlib
    allocator = importlib.import_module("allocator")
    monkeypatch.setattr(allocator, "cuda_available", lambda: False)
    # only the exit is under test: the CPU measurements are stubbed out
    monkeypatch.setattr(allocator, "time_pair", lambda *a, **k: ([1.0], [1.0], [1.0]))
    monkeypatch.setattr(allocator, "pinned_check", lambda nbytes: {"error": "stubbed"})
    monkeypatch.setenv("RTMEM_REQUIRE_GPU", "1")
    # an earlier GPU result stays (allocator replaced it with "skipped", in the
    # partial document after its GPU section and in the final one, then exited 3)
    earlier = {"gpu": {"random": {"rtmem_core_over_cupy": 1.3}}}
    (tmp_path / "allocator.json").write_text(json.dumps(earlier))
    assert allocator.main(["--quick"]) == 3
    assert "RTMEM_REQUIRE_GPU=1: no usable CUDA GPU" in capsys.readouterr().err
    assert json.loads((tmp_path / "allocator.json").read_text()) == earlier
    monkeypatch.delenv("RTMEM_REQUIRE_GPU")
    assert allocator.main(["--quick"]) == 0
    # one spelling of "not measured" in every results file: allocator.json wrote
    # {"skipped": why} where train.json wrote {"measured": false, "reason": why}
    gpu = json.loads((tmp_path / "allocator.json").read_text())["gpu"]
    assert _not_measured(gpu) and gpu["reason"] == allocator.NO_GPU


_FAKE_PYTHON = r"""#!/usr/bin/env bash
# python3 for bench/gpu_session.sh: installs and imports succeed at once; a step
# sleeps FAKE_SLEEP_<step> seconds (default 0) and exits FAKE_RC_<step> (default 0)
case "$*" in
    *"-m pip"*|"-c"*) echo "fake python3"; exit 0 ;;
    *doctor*) s=doctor ;; *pytest*) s=gpu_tests ;; *pcie.py*) s=pcie ;;
    *dha_layers.py*) s=dha_layers ;; *allocator.py*) s=allocator ;; *train.py*) s=train ;;
    *adam.py*) s=adam ;; *) echo "unexpected: $*" >&2; exit 99 ;;
esac
mkdir -p bench/results/gpu && echo "{\"step\": \"$s\"}" > "bench/results/gpu/$s.json"
sleep_var=FAKE_SLEEP_$s rc_var=FAKE_RC_$s
sleep "${!sleep_var:-0}"
exit "${!rc_var:-0}"
"""

_FAKE_TAR = r"""#!/usr/bin/env bash
# tar that, at its FAKE_TAR_CUT_AT-th call, leaves its archive cut short, as a
# kill during the packing does
n=$(( $(cat "$FAKE_TAR_COUNT" 2>/dev/null || echo 0) + 1 )); echo $n > "$FAKE_TAR_COUNT"
if [ "$n" = "${FAKE_TAR_CUT_AT:-0}" ]; then echo "cut short" > "$2"; exit 137; fi
exec "$REAL_TAR" "$@"
"""


def _session(tmp_path, steps, **env):
    """Run a copy of bench/gpu_session.sh in ``tmp_path`` (its results there,
    never in this clone's bench/results) with a fake python3 and tar; returns
    (completed process, $OUT)."""
    import shutil
    (tmp_path / "bench").mkdir()
    shutil.copy(ROOT / "bench" / "gpu_session.sh", tmp_path / "bench")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("python3", _FAKE_PYTHON), ("tar", _FAKE_TAR)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    full = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "OUT": str(out),
            "REAL_TAR": shutil.which("tar"), "FAKE_TAR_COUNT": str(tmp_path / "tars"),
            "CUDA_HOME": "/nonexistent", **{k: str(v) for k, v in env.items()}}
    done = subprocess.run(["bash", str(tmp_path / "bench" / "gpu_session.sh"), *steps],
                          cwd=tmp_path, env=full, capture_output=True, text=True, timeout=120)
    return done, out


def _limits(stdout):
    """{step: its timeout in seconds, or "skipped"} from the script's output."""
    import re
    found = {}
    for name, limit in re.findall(r"^== (\S+) \(timeout (\d+)s\)", stdout, re.M):
        found[name] = int(limit)
    for name in re.findall(r"^== (\S+) SKIPPED", stdout, re.M):
        found[name] = "skipped"
    return found


def test_gpu_session_steps_share_one_budget_from_the_scripts_start(tmp_path):
    # The steps' own limits of the first call (30 + 240 + 120 + 150 s) plus 15 s
    # to exit each, plus the install, passed the device tool's 600 s, which then
    # kills everything: each step now gets at most what the budget has left
    # (here 45 s, less 15 s to exit and 10 s to pack), and one left with less
    # than 10 s is skipped, as a failure.
    import tarfile
    done, out = _session(tmp_path, ["doctor", "gpu-tests", "pcie", "dha-layers"],
                         RTMEM_SESSION_BUDGET_S=45, FAKE_SLEEP_doctor=6,
                         FAKE_SLEEP_gpu_tests=6)
    limits = _limits(done.stdout)
    assert done.returncode == 1, done.stdout + done.stderr
    assert 18 <= limits["doctor"] <= 20, done.stdout
    assert 11 <= limits["gpu-tests"] <= 14, done.stdout
    assert limits["pcie"] == limits["dha-layers"] == "skipped", done.stdout
    with tarfile.open(out / "gpu_results_doctor_gpu-tests_pcie_dha-layers.tgz") as tar:
        names = set(tar.getnames())
    assert {"bench/results/gpu/doctor.json", "bench/results/gpu/gpu_tests.json",
            "bench/results/gpu/logs/pcie.log"} <= names
    # with the default budget (570 s) the steps keep their own limits
    (tmp_path / "default").mkdir()
    done, _ = _session(tmp_path / "default", ["doctor", "pcie"])
    assert done.returncode == 0 and _limits(done.stdout) == {"doctor": 30, "pcie": 120}


def test_gpu_session_packs_in_place_only_a_whole_archive(tmp_path):
    # tar wrote the archive in place: a kill during the last packing left it cut
    # short, and the one packed after the earlier steps was lost with it. A
    # failing step's results are packed too.
    import tarfile
    done, out = _session(tmp_path, ["doctor", "pcie"], FAKE_RC_pcie=124, FAKE_TAR_CUT_AT=3)
    assert done.returncode == 1 and "FAILED rc=124" in done.stdout
    with tarfile.open(out / "gpu_results_doctor_pcie.tgz") as tar:   # the second packing
        names = set(tar.getnames())
    assert {"bench/results/gpu/doctor.json", "bench/results/gpu/pcie.json",
            "bench/results/gpu/logs/pcie.log"} <= names
    assert "failed; the previous archive stays" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["gpu_results_doctor_pcie.tgz"]
