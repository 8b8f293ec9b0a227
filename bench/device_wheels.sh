#!/usr/bin/env bash
# Fetch, on a machine with the package registry, what the GPU machine lacks for
# the benchmarks' optional baselines into .whl/ (git-ignored): DeepSpeed (an sdist;
# its CPUAdam op is JIT-built there with g++ and ninja, which it has) and its
# Python requirements missing from that image (the device README's KINDS.md lists
# what is preinstalled: torch, numpy, ninja, psutil, py-cpuinfo, msgpack, tqdm,
# einops, packaging are). The device tool then carries .whl with the call:
#   run(carry=[".whl"], command="bash bench/gpu_session.sh allocator adam")
# and bench/gpu_session.sh installs .whl/* into /tmp/site when it is there.
#
#   bash bench/device_wheels.sh          (about 5 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
py=${PYTHON:-python3}
# cp312 manylinux wheels: the device's python3 is 3.12 (x86_64)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    hjson==3.1.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0
"$py" -m pip download -q --no-deps --no-binary=:all: -d .whl deepspeed==0.19.8
ls -l .whl
