#!/usr/bin/env bash
# The GPU check in one command, on a machine with no network (docs/runtime.md, "GPU check"): build the patched
# runtime for the GPU present from the bundle tools/gpu_bundle.py made (pruned sdist, the wheels the machine
# lacks; tools/gpu_env.sh, shared with tools/gpu_pc_scenario.sh), run tests/test_gpu.py and tests/test_offload.py,
# then time the runtime on real model shapes and predict the speed-ups there (tools/gpu_costs.py, which takes this
# script's arguments).
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
# the cost table skips the shapes it could not time before this (a one-command limit of 9 minutes, 40 s to spare)
deadline=$(( $(date +%s) + ${SPECEE_GPU_BUDGET_S:-500} ))
if [ -n "${OUT:-}" ]; then
    exec > >(tee "$OUT/gpu_check.log") 2>&1
    trap 'cp "${WORK:-/nonexistent}"/cache/logs/build-*.log "$OUT"/ 2>/dev/null || true' EXIT  # the build's full log, if it ran
fi
source tools/gpu_env.sh
sdist=$(bundle_sdist)
if [ "$SPECEE_BACKEND" != cuda ]; then
    export SPECEE_GPU_TESTS_ON_CPU=1  # the GPU tests' comparisons run with both loads on the CPU
fi
build_runtime "$sdist"

# tests/test_offload.py runs the default model: installed, or carried in pieces (tools/gpu_bundle.py --models)
gpu_tests=(tests/test_gpu.py tests/test_offload.py)
if ! "$PYTHON" -c 'from specee_edge.default_model import default_model_path; default_model_path()' 2>/dev/null \
        && ! { [ -f "$BUNDLE/models/manifest.json" ] && join_models >/dev/null; }; then
    step "no default model here: tests/test_offload.py left out (tools/gpu_bundle.py --models carries it)"
    gpu_tests=(tests/test_gpu.py)
fi
step "${gpu_tests[*]}"
tests=0
"$PYTHON" -m pytest -q -m gpu -p no:cacheprovider "${gpu_tests[@]}" || tests=$?

step "cost table"
"$PYTHON" tools/gpu_costs.py --until "$deadline" ${OUT:+--json "$OUT/gpu_costs.json"} "$@"
step "done (tests exit $tests)"
exit "$tests"
