"""A CUDA build of the runtime on Linux: the system libstdc++ goes into the global scope before llama.cpp loads.

libggml-cuda (CUDA 13) exports weak instances of libstdc++ templates (the stream and locale machinery nvcc's
host pass instantiated). Loaded as a dependency of libllama, they took precedence over libstdc++'s own for
libllama, whose model loading then crashed in `llama_model::print_info` (docs/runtime.md, GPU check).
Symbols in the global scope are found first, as `LD_PRELOAD=libstdc++.so.6` puts them, which made every GPU
test pass; `specee_edge/__init__.py` does this before anything can import llama_cpp.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import sys
from pathlib import Path

CUDA_LIBRARY = "libggml-cuda*"  # in llama_cpp/lib of a CUDA build


def installed_package_dir() -> Path | None:
    """Locate the installed ``llama_cpp`` package without importing it."""
    importlib.invalidate_caches()
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def needs_libstdcxx_first(platform: str, package_dir: Path | None) -> bool:
    """Whether ``package_dir``'s llama_cpp is a CUDA build on Linux, whose libstdc++ must come first."""
    return platform.startswith("linux") and package_dir is not None and any((package_dir / "lib").glob(CUDA_LIBRARY))


def load_libstdcxx_first() -> None:
    """Load the system libstdc++ into the global scope where the installed runtime is a CUDA build (a no-op
    elsewhere, and where the system has no libstdc++ to find)."""
    if not needs_libstdcxx_first(sys.platform, installed_package_dir()):
        return
    name = ctypes.util.find_library("stdc++")
    if name:
        ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
