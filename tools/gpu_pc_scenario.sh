#!/usr/bin/env bash
# SpecEE's PC scenario on a GPU machine with no network, in two steps that each fit one device call:
#
#   tools/gpu_pc_scenario.sh build     the patched runtime and llama-server for the GPU present, from the bundle
#                                      (tools/gpu_bundle.py --models, made where there is a network)
#   tools/gpu_pc_scenario.sh measure   for each model the bundle carries (joined from its pieces, checked):
#                                      `specee-edge bench --quality all` against llama-server on the same split,
#                                      greedy and sampled, -t 4, with the model fully on the GPU, then half its
#                                      layers on the GPU llama.cpp's way (the last ones) and SpecEE's way
#                                      (--offload-first: the first ones)
#
# The model pieces travel one per device call while the machine stays warm (carry .gpu-bundle/models/piece-NN);
# `measure` names any that are missing. Environment: as tools/gpu_check.sh (SPECEE_BACKEND, PYTHON,
# SPECEE_GPU_BUNDLE, SPECEE_GPU_WORK, OUT), and SPECEE_BENCH_ARGS (-p 8 -n 64: the prompts and tokens per run).
set -euo pipefail
cd "$(dirname "$0")/.."
step_name=${1:?usage: tools/gpu_pc_scenario.sh build|measure}
PYTHON=${PYTHON:-python3}
BUNDLE=${SPECEE_GPU_BUNDLE:-.gpu-bundle}
WORK=${SPECEE_GPU_WORK:-/tmp/specee-gpu-check}
export SPECEE_BACKEND=${SPECEE_BACKEND:-cuda} SPECEE_CACHE=$WORK/cache PYTHONUNBUFFERED=1
export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${OUT:-}" ]; then exec > >(tee -a "$OUT/gpu_pc_scenario.log") 2>&1; fi
step() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [ "$SPECEE_BACKEND" = cuda ]; then
    if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
    if [ -d /usr/local/cuda/lib64 ]; then export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
    # the builds are for the GPU present (build_runtime.py asks nvidia-smi), and the package loads the system
    # libstdc++ before a CUDA build's libllama (specee_edge/libstdcxx.py)
fi
sdist=$(ls "$BUNDLE"/llama_cpp_python-*.tar.gz 2>/dev/null | head -n 1 || true)
[ -n "$sdist" ] || { echo "error: no sdist in $BUNDLE: run tools/gpu_bundle.py --models where there is a network" >&2; exit 2; }

case "$step_name" in
build)
    step "installing the bundle's wheels into $WORK/site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$WORK/site" "$BUNDLE"/wheels/*.whl
    step "building the patched runtime ($SPECEE_BACKEND) on $(nproc) cores"
    "$PYTHON" tools/build_runtime.py --sdist "$sdist" --target "$WORK/site"
    step "building llama-server from the same tree"
    "$PYTHON" tools/build_llama_server.py --sdist "$sdist" | tail -n 1
    step "built"
    ;;
measure)
    server=$("$PYTHON" tools/build_llama_server.py --print-path) || { echo "error: run the build step first" >&2; exit 2; }
    export SPECEE_LLAMA_SERVER=$server
    models=$("$PYTHON" tools/gpu_bundle.py --join "$BUNDLE/models" "$WORK/models")
    for model in $models; do
        n_layer=$("$PYTHON" - "$model" <<'EOF'
import sys
import gguf
reader = gguf.GGUFReader(sys.argv[1])
arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
print(int(reader.fields[f"{arch}.block_count"].parts[-1][0]))
EOF
)
        half=$(( n_layer / 2 + 1 ))  # -ngl counts the output layer: half the repeating layers and the output
        name=$(basename "$model" .gguf)
        for placement in "all" "$half" "$half --offload-first"; do
            tag=$(echo "$placement" | tr -d ' -')
            step "$name ($n_layer layers): -ngl $placement"
            "$PYTHON" -c 'from specee_edge.cli import main; main()' bench "$model" --quality all -t 4 -ngl $placement ${SPECEE_BENCH_ARGS:--p 8 -n 64} \
                ${OUT:+--json "$OUT/bench-$name-$tag.json"} || step "$name -ngl $placement failed (exit $?)"
        done
    done
    step "measured"
    ;;
*)
    echo "usage: tools/gpu_pc_scenario.sh build|measure" >&2
    exit 2
    ;;
esac
