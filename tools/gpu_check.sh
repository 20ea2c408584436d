#!/usr/bin/env bash
# Build the patched runtime with CUDA and run the GPU tests (full and partial offload).
# Needs an NVIDIA GPU and the CUDA toolkit; uses its own venv so the CPU build stays untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
export SPECEE_BACKEND=cuda
export SPECEE_CMAKE_ARGS="${SPECEE_CMAKE_ARGS:-} -DCMAKE_CUDA_ARCHITECTURES=native"
make setup VENV=.venv-cuda
.venv-cuda/bin/python -m pytest -q -m gpu tests "$@"
