#!/usr/bin/env bash
# The GPU check in one command, on a machine with no network (docs/runtime.md, "GPU check"): build the patched
# runtime for the GPU present from the bundle tools/gpu_bundle.py made (pruned sdist, the wheels the machine
# lacks), run tests/test_gpu.py, then time the runtime on real model shapes and predict the speed-ups there
# (tools/gpu_costs.py, which takes this script's arguments).
#
#   tools/gpu_check.sh                                          on the GPU machine
#   SPECEE_BACKEND=cpu tools/gpu_check.sh --llama2-layers 2     the rehearsal on a machine with no GPU
#
# Environment: SPECEE_BACKEND (cuda), PYTHON (python3: an interpreter with numpy, rich, typer, scikit-learn,
# scipy, jinja2, pytest, scikit-build-core, cmake and ninja), SPECEE_GPU_BUNDLE (.gpu-bundle),
# SPECEE_GPU_WORK (/tmp/specee-gpu-check: the packages installed, the build), SPECEE_GPU_BUDGET_S (500: the
# cost table skips the shapes it could not time within this many seconds of the start), OUT (if set: the log
# and the tables are copied there).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUNDLE=${SPECEE_GPU_BUNDLE:-.gpu-bundle}
WORK=${SPECEE_GPU_WORK:-/tmp/specee-gpu-check}
export SPECEE_BACKEND=${SPECEE_BACKEND:-cuda} SPECEE_CACHE=$WORK/cache PYTHONUNBUFFERED=1
# the cost table skips the shapes it could not time before this (a one-command limit of 9 minutes, 40 s to spare)
deadline=$(( $(date +%s) + ${SPECEE_GPU_BUDGET_S:-500} ))
if [ -n "${OUT:-}" ]; then
    exec > >(tee "$OUT/gpu_check.log") 2>&1
    trap 'cp "$WORK"/cache/logs/build-*.log "$OUT"/ 2>/dev/null || true' EXIT  # the build's full log, if it ran
fi
step() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

sdist=$(ls "$BUNDLE"/llama_cpp_python-*.tar.gz 2>/dev/null | head -n 1 || true)
if [ -z "$sdist" ]; then
    echo "error: no llama-cpp-python sdist in $BUNDLE: run tools/gpu_bundle.py where there is a network" >&2
    exit 2
fi
step "installing $(ls "$BUNDLE"/wheels/*.whl | xargs -n 1 basename | tr '\n' ' ')into $WORK/site"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$WORK/site" "$BUNDLE"/wheels/*.whl
export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$SPECEE_BACKEND" = cuda ]; then
    if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
    if [ -d /usr/local/cuda/lib64 ]; then export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
    nvcc --version | tail -n 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    # the build is for the GPU present (build_runtime.py asks nvidia-smi), and the package loads the system
    # libstdc++ before a CUDA build's libllama (specee_edge/libstdcxx.py)
else
    export SPECEE_GPU_TESTS_ON_CPU=1  # tests/test_gpu.py's comparisons run with both loads on the CPU
fi
step "building the patched runtime ($SPECEE_BACKEND, ${SPECEE_CMAKE_ARGS:-no extra flags}) on $(nproc) cores"
"$PYTHON" tools/build_runtime.py --sdist "$sdist" --target "$WORK/site"

step "tests/test_gpu.py"
tests=0
"$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py || tests=$?

step "cost table"
"$PYTHON" tools/gpu_costs.py --until "$deadline" ${OUT:+--json "$OUT/gpu_costs.json"} "$@"
step "done (tests exit $tests)"
exit "$tests"
