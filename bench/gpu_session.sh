#!/usr/bin/env bash
# Everything a GPU session has to run, in one command (the device machine has no
# package registry: torch, cupy, numba and numba-cuda are preinstalled there).
#
#   bash bench/gpu_session.sh [QUICK]     # QUICK=1: smaller sizes, for a short lease
#
# Runs the GPU tests, then the GPU benchmarks; results land in bench/results/ and,
# when $OUT is set (the device tool, which returns at most 8 files), they and the
# logs are packed into $OUT/gpu_results.tgz. A failing step does not stop the
# others; the exit code says whether any failed.
set -u
cd "$(dirname "$0")/.."
quick=${1:-0}
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE RTMEM_BACKEND=cuda
logs=bench/results/gpu_logs
mkdir -p "$logs"
status=0
step() {   # step NAME COMMAND...: run, log, remember failures
    local name=$1; shift
    echo "== $name: $*"
    if "$@" >"$logs/$name.log" 2>&1; then echo "   ok"; else echo "   FAILED (see $logs/$name.log)"; status=1; fi
    tail -n 25 "$logs/$name.log"
}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$logs/install.log" 2>&1 || status=1
step doctor python3 -m rtmem.cli doctor
step gpu-tests python3 -m pytest -q -m gpu tests
if [ "$quick" = 1 ]; then q=--quick; else q=; fi
step pcie python3 bench/pcie.py $q
step dha-layers python3 bench/dha_layers.py $q
step allocator python3 bench/allocator.py
step train python3 bench/train.py --gpu-time-s 240
step adam python3 bench/adam.py --sizes 1e7,5e7,1e8
if [ -n "${OUT:-}" ]; then tar czf "$OUT/gpu_results.tgz" bench/results; fi
exit $status
