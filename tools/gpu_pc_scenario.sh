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
# SPECEE_GPU_BUNDLE, SPECEE_GPU_WORK: tools/gpu_env.sh, which both source; OUT), and SPECEE_BENCH_ARGS (-p 8 -n 64:
# the prompts and tokens per run).
set -euo pipefail
cd "$(dirname "$0")/.."
step_name=${1:?usage: tools/gpu_pc_scenario.sh build|measure}
if [ -n "${OUT:-}" ]; then exec > >(tee -a "$OUT/gpu_pc_scenario.log") 2>&1; fi
source tools/gpu_env.sh
sdist=$(bundle_sdist)

case "$step_name" in
build)
    build_runtime "$sdist"
    step "building llama-server from the same tree"
    "$PYTHON" tools/build_llama_server.py --sdist "$sdist" | tail -n 1
    step "built"
    ;;
measure)
    server=$("$PYTHON" tools/build_llama_server.py --print-path) || { echo "error: run the build step first" >&2; exit 2; }
    export SPECEE_LLAMA_SERVER=$server
    models=$(join_models)
    for model in $models; do
        n_layer=$("$PYTHON" -c 'import sys; from specee_edge.gguf_index import GGUFIndex; g = GGUFIndex(sys.argv[1])
print(g.value(g.value("general.architecture") + ".block_count"))' "$model")
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
