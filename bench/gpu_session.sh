#!/usr/bin/env bash
# Everything a GPU session has to run (the device machine has no package registry:
# torch, cupy, numba and numba-cuda are preinstalled there).
#
#   bash bench/gpu_session.sh [--quick] [STEP ...]
#
# STEPs, in the order they run (default: all):
#   doctor gpu-tests pcie dha-layers allocator train adam
# --quick: smaller sizes for pcie and dha-layers.
#
# The device tool kills a command after 10 minutes (and then returns only what is
# under $OUT), so a session splits the steps over three calls:
#   bash bench/gpu_session.sh doctor gpu-tests pcie dha-layers
#   bash bench/gpu_session.sh train
#   bash bench/gpu_session.sh allocator adam
# Each call keeps inside a session budget of $RTMEM_SESSION_BUDGET_S seconds
# (default 570), counted from the script's start (the install and imports
# included): a step's time limit is its own (below) or what the budget has left
# after the 15 s a stopped step gets to exit and the time kept for packing,
# whichever is less; a step with less than 10 s left is skipped (and fails).
# The last call carries .whl/ (made here by bench/device_wheels.sh) so that
# bench/adam.py can time DeepSpeed's CPUAdam, JIT-built there (~1-2 min).
# (train runs its GPU section only; the CPU section is `python bench/train.py`, and
# it writes its JSON after each depth search and after each throughput size.)
# allocator and adam write theirs after each section or size: a step stopped by
# its timeout keeps what it finished, marked "partial": true.
# Each call installs rtmem first (offline, --no-deps). Results land in
# bench/results/gpu/ and, when $OUT is set (the device tool, which returns at most 8
# files), they and the logs are packed into $OUT/gpu_results_<steps>.tgz after
# every step (written beside it, then renamed: a kill during the packing leaves
# the previous archive whole), so a call stopped by the tool still returns what
# finished. A failing or timed-out step does not stop the others; the exit code
# says whether any failed.
set -u
cd "$(dirname "$0")/.."
budget=${RTMEM_SESSION_BUDGET_S:-570}   # seconds; $SECONDS counts from the script's start
kill_after=15                            # seconds a step gets to exit after its SIGINT
pack_s=10                                # seconds kept after the last step for packing
min_step=10                              # a step with less time left is skipped
# GPU-machine results go to their own folder, next to (not over) this machine's.
# RTMEM_REQUIRE_GPU: `pytest -m gpu` and the GPU benchmarks fail (exit 3) instead
# of skipping when they find no GPU; the simulator would make them all skip.
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE RTMEM_BACKEND=cuda \
       RTMEM_BENCH_RESULTS=bench/results/gpu RTMEM_REQUIRE_GPU=1
unset NUMBA_ENABLE_CUDASIM
# numba-cuda needs libNVVM; without the nvidia-nvvm wheel it may look under
# CUDA_HOME, but once CUDA_HOME is set it looks nowhere else: set it only to a
# toolkit that has NVVM.
if [ -z "${CUDA_HOME:-}" ]; then
    nvcc=$(command -v nvcc 2>/dev/null) && nvcc=$(readlink -f "$nvcc")
    for home in /usr/local/cuda ${nvcc:+"$(dirname "$(dirname "$nvcc")")"}; do
        if [ -d "$home/nvvm" ]; then export CUDA_HOME=$home; break; fi
    done
fi
all_steps="doctor gpu-tests pcie dha-layers allocator train adam"
q=
steps=
for arg in "$@"; do
    case $arg in
        --quick|QUICK|1) q=--quick ;;          # QUICK / 1: the old positional form
        0) ;;
        *) if [[ " $all_steps " == *" $arg "* ]]; then steps="$steps $arg"
           else echo "unknown step '$arg'; steps are: $all_steps" >&2; exit 2; fi ;;
    esac
done
steps=${steps:-$all_steps}
echo "CUDA_HOME=${CUDA_HOME:-unset}; $(python3 -c 'import numpy, numba, cupy, torch
print("numpy", numpy.__version__, "numba", numba.__version__, "cupy", cupy.__version__,
      "torch", torch.__version__)' 2>&1 | tail -n 1)"
logs=bench/results/gpu/logs
mkdir -p "$logs"
status=0
step() {   # step NAME SECONDS COMMAND...: run under a timeout, log, remember failures
    local name=$1 limit=$2; shift 2
    [[ " $steps " == *" $name "* ]] || return 0
    # what is left of the budget once this step, stopped at its limit, has had
    # its kill_after to exit, and the last pack its pack_s
    local left=$((budget - SECONDS - kill_after - pack_s))
    if [ $left -lt $min_step ]; then
        echo "== $name SKIPPED: ${left}s left of the ${budget}s session budget" \
            | tee "$logs/$name.log"
        status=1
        pack
        return 0
    fi
    if [ $left -lt "$limit" ]; then limit=$left; fi
    echo "== $name (timeout ${limit}s): $*"
    local t0=$SECONDS rc=0
    timeout --signal=INT --kill-after=$kill_after "$limit" "$@" >"$logs/$name.log" 2>&1 || rc=$?
    if [ $rc = 0 ]; then echo "   ok in $((SECONDS - t0)) s"
    else echo "   FAILED rc=$rc in $((SECONDS - t0)) s (124 = timed out; see $logs/$name.log)"
         status=1; fi
    tail -n 25 "$logs/$name.log"
    pack
}
pack() {   # results and logs so far into $OUT (replaced after every step)
    [ -n "${OUT:-}" ] || return 0
    local archive
    archive="$OUT/gpu_results_$(echo $steps | tr ' ' '_').tgz"
    # written beside it, then renamed: a kill during tar must not leave the
    # archive cut short and the previous one lost with it
    if tar czf "$archive.tmp" bench/results/gpu; then mv -f "$archive.tmp" "$archive"
    else echo "packing $archive failed; the previous archive stays"; rm -f "$archive.tmp"; fi
}
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$logs/install.log" 2>&1
then
    # No usable setuptools there: assemble the package layout of pyproject.toml
    # (kernels/ and planners/ are rtmem.kernels and rtmem.planners) from links.
    echo "pip install failed (see $logs/install.log); using a linked source tree"
    tree=/tmp/rtmem_src
    rm -rf "$tree" && mkdir -p "$tree/rtmem"
    for f in rtmem/*; do ln -s "$PWD/$f" "$tree/rtmem/"; done
    ln -s "$PWD/kernels" "$tree/rtmem/kernels"
    ln -s "$PWD/planners" "$tree/rtmem/planners"
    # PYTHONSAFEPATH: `python3 -m pytest` must not put ./rtmem (no kernels/) first.
    export PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1
    python3 -c "import rtmem.kernels, rtmem.planners" || status=1
fi
# Optional baselines the image lacks (DeepSpeed for bench/adam.py), carried as
# .whl/ (bench/device_wheels.sh); without them those rows say why they are missing.
if compgen -G ".whl/*" >/dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/* >"$logs/wheels.log" 2>&1; then
        # A carried package the image already has at least as new (typing_extensions,
        # which torch imports too) must not shadow the image's copy.
        python3 - <<'PY'
import importlib.metadata as md, pathlib, shutil
site = pathlib.Path("/tmp/site")
for info in site.glob("*.dist-info"):
    dist = md.PathDistribution(info)
    name, carried = dist.metadata["Name"], dist.version
    try:
        mine = md.version(name)                 # the image's (no /tmp/site on the path)
    except md.PackageNotFoundError:
        continue
    key = lambda v: tuple(int(p) if p.isdigit() else 0 for p in v.split(".")[:3])
    if key(mine) >= key(carried):
        paths = [site / f for f in (dist.files or ())]
        for path in paths:
            if path.is_file():
                path.unlink()
        for folder in sorted({p.parent for p in paths}, key=lambda p: -len(p.parts)):
            if folder != site and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()                  # deepest first: emptied folders go
        shutil.rmtree(info, ignore_errors=True)
        print(f"kept the image's {name} {mine} (not the carried {carried})")
PY
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
        echo "installed .whl/ into /tmp/site"
    else
        echo "installing .whl/ failed (see $logs/wheels.log); optional baselines skipped"
    fi
fi
step doctor 30 python3 -m rtmem.cli doctor
step gpu-tests 240 python3 -m pytest -q -rs -m gpu tests
step pcie 120 python3 bench/pcie.py $q
step dha-layers 150 python3 bench/dha_layers.py $q
step allocator 90 python3 bench/allocator.py
step train 540 python3 bench/train.py --skip-cpu --gpu-start-layers 32 --gpu-time-s 240 \
    --gpu-deadline-s 420
step adam 300 python3 bench/adam.py --sizes 1e7,5e7,1e8 --budget 6
pack
exit $status
