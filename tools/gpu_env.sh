# What tools/gpu_check.sh and tools/gpu_pc_scenario.sh share, sourced by both from the repository root: their
# environment, the CUDA toolkit on PATH, the bundle's sdist, and the steps that install the bundle's wheels and
# build the patched runtime from it. Environment: SPECEE_BACKEND (cuda), PYTHON (python3), SPECEE_GPU_BUNDLE
# (.gpu-bundle), SPECEE_GPU_WORK (/tmp/specee-gpu-check: the packages installed, the build).
PYTHON=${PYTHON:-python3}
BUNDLE=${SPECEE_GPU_BUNDLE:-.gpu-bundle}
WORK=${SPECEE_GPU_WORK:-/tmp/specee-gpu-check}
export SPECEE_BACKEND=${SPECEE_BACKEND:-cuda} SPECEE_CACHE=$WORK/cache PYTHONUNBUFFERED=1
export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# the CUDA toolkit where the image keeps it; the build is for the GPU present (build_runtime.py asks nvidia-smi),
# and the package loads the system libstdc++ before a CUDA build's libllama (specee_edge/libstdcxx.py)
cuda_env() {
    if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
    if [ -d /usr/local/cuda/lib64 ]; then export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
    nvcc --version | tail -n 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
}

# the llama-cpp-python sdist tools/gpu_bundle.py put in the bundle (exits where there is none)
bundle_sdist() {
    local sdist
    sdist=$(ls "$BUNDLE"/llama_cpp_python-*.tar.gz 2>/dev/null | head -n 1 || true)
    if [ -z "$sdist" ]; then
        echo "error: no llama-cpp-python sdist in $BUNDLE: run tools/gpu_bundle.py where there is a network" >&2
        exit 2
    fi
    echo "$sdist"
}

# the bundle's wheels into $WORK/site, then the patched runtime built from SDIST and installed there
build_runtime() {
    local sdist=$1
    step "installing $(ls "$BUNDLE"/wheels/*.whl | xargs -n 1 basename | tr '\n' ' ')into $WORK/site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$WORK/site" "$BUNDLE"/wheels/*.whl
    step "building the patched runtime ($SPECEE_BACKEND, ${SPECEE_CMAKE_ARGS:-no extra flags}) on $(nproc) cores"
    "$PYTHON" tools/build_runtime.py --sdist "$sdist" --target "$WORK/site"
}

# the models the bundle carries in pieces (tools/gpu_bundle.py --models), joined and checked into the cache's
# models/, where the default model is found (specee_edge/default_model.py); prints their paths
join_models() {
    "$PYTHON" tools/gpu_bundle.py --join "$BUNDLE/models" "$SPECEE_CACHE/models"
}

if [ "$SPECEE_BACKEND" = cuda ]; then cuda_env; fi
