"""Build llama.cpp's own ``llama-server`` from the llama.cpp the runtime vendors, cached like the runtime.

The bench's baseline and peer lanes (specee_edge/bench/llama_server.py) run this program. It comes from the
same tree the runtime wheel is built from: llama-cpp-python's sdist with our sources and ``patches/`` applied
(specee_edge/build_runtime.py). Every hook stays idle in a program that never calls the specee API, and the patched
library then behaves like stock llama.cpp. It is built with the runtime's CMake flags (the same backend, and on
x86 -march=native without AMX), then the server's: the common library, tools and server on, no web UI (no
download), no OpenSSL; static, so the one file runs from the cache. Only the llama-server target is built.

The binary is cached under ``SPECEE_CACHE`` (default ~/.cache/specee-edge) in ``llama-server/KEY/``, KEY a hash
of the version, the flags, the machine and its CPU's instruction sets, and of the one patch that changes what the
server does (SERVER_PATCHES: SpecEE's placement, which the bench's lanes ask for with --override-kv). Not of our
other sources and patches: with every hook idle the patched llama.cpp is stock llama.cpp, so a change to them (a
rebuild of the wheel, 5 minutes) does not rebuild the server (20-40 minutes on 2 cores).

Usage: ``python tools/build_llama_server.py [--print-path | --force] [--sdist SDIST]``; the last line printed is the
binary.
``--print-path`` prints where the binary is or will be, and exits 1 when it is not built yet.
"""

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run before the package is installed, as make does

from specee_edge.build_runtime import (  # noqa: E402
    cache_root,
    cmake_flags,
    compute_key,
    console,
    die,
    patch_files,
    patched_source,
    print_log_tail,
    stream_build,
)

BINARY = "llama-server"
# the GGUF key --offload-first sets, which the bench's llama-server lanes pass as --override-kv
SERVER_PATCHES = ("0013-model-offload-first-layers.patch",)
SERVER_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the build downloads the web UI's assets
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained file in the cache
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
)


def server_flags() -> list[str]:
    """The runtime's CMake flags, then the server's (CMake keeps the last value of a flag given twice)."""
    return [*shlex.split(cmake_flags()), *SERVER_CMAKE_FLAGS]


def server_key(flags: list[str]) -> str:
    return "server-" + compute_key(shlex.join(flags), server_patches(), python=False, ours=False)[:16]


def server_patches() -> list[Path]:
    """The patches that change what llama-server does (its key covers them): those a program reaches without
    calling the specee API. Every other hook stays idle in llama-server, so a change to it (a rebuild of the
    wheel, 5 minutes) does not rebuild the server (20-40 minutes on 2 cores)."""
    return [patch for patch in patch_files() if patch.name in SERVER_PATCHES]


def binary_path(cache: Path, key: str) -> Path:
    return cache / BINARY / key / BINARY


def tool(name: str, required: bool = True) -> str | None:
    """A build tool: the one beside this interpreter (make setup installs cmake and ninja there), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None and required:
        die(f"building {BINARY} needs {name} (make setup installs it in .venv)")
    return found


def build(cache: Path, key: str, flags: list[str], sdist: Path | None = None) -> Path:
    """Patch the vendored llama.cpp (of `sdist`, else the cached download), configure and build the llama-server
    target; store the binary in the cache."""
    source_root = cache / "src" / key
    build_dir = cache / "build" / key
    log_path = cache / "logs" / f"{key}.log"
    source = patched_source(cache, source_root, patch_files(), sdist)
    generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={tool('ninja')}"] if tool("ninja", required=False) else []
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    started = time.perf_counter()
    cmake = tool("cmake")
    steps = [
        [cmake, "-S", str(source / "vendor" / "llama.cpp"), "-B", str(build_dir), *generator, *flags],
        [cmake, "--build", str(build_dir), "--target", BINARY],
    ]
    for i, cmd in enumerate(steps):
        if stream_build(cmd, env, log_path, what=BINARY, append=i > 0) != 0:
            print_log_tail(log_path)
            die(f"building {BINARY} failed; full log: {log_path}")
    built = build_dir / "bin" / BINARY
    if not built.is_file():
        die(f"the build produced no {built}; full log: {log_path}")
    target = binary_path(cache, key)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{BINARY}.", suffix=".partial")
    os.close(fd)
    shutil.copy2(built, partial)
    os.replace(partial, target)
    shutil.rmtree(source_root, ignore_errors=True)
    shutil.rmtree(build_dir, ignore_errors=True)
    console.print(f"built {BINARY} ({key}) in {time.perf_counter() - started:.0f} s; log: {log_path}", highlight=False)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--print-path", action="store_true", help="print the binary's path; exit 1 if it is not built")
    mode.add_argument("--force", action="store_true", help="rebuild, ignoring the cached binary")
    parser.add_argument("--sdist", type=Path, default=None, help="build from this llama-cpp-python sdist (a GPU "
                        "machine without a network: tools/gpu_bundle.py's) instead of the cached download")
    args = parser.parse_args(argv)
    flags = server_flags()
    cache = cache_root()
    key = server_key(flags)
    path = binary_path(cache, key)
    if args.print_path:
        print(path)
        return 0 if path.is_file() else 1
    if args.force or not path.is_file():
        path = build(cache, key, flags, args.sdist)
    print(path)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)
