"""Make the bundle that tools/gpu_check.sh builds and tests from on a GPU machine with no network.

The bundle folder (default .gpu-bundle/, ignored by git, carried beside the working tree) holds:

    llama_cpp_python-<version>.tar.gz   the llama-cpp-python sdist pruned to what a CPU or CUDA build of
                                        tools/build_runtime.py uses (about a tenth of the 77 MB original):
                                        no docs, tests, examples, vocabularies, tools or llama.cpp's common
                                        library, and of ggml's backends only the CPU's, CUDA's, RPC's and BLAS's
                                        (and the files of others that a patch edits)
    wheels/                             the Python packages such a machine lacks (py3-none-any wheels)

The patches are not in it: build_runtime applies them from patches/ on the GPU machine, as here.

    .venv/bin/python tools/gpu_bundle.py [--out .gpu-bundle]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specee_edge.build_runtime import cache_root, die, extract_sdist, fetch_sdist, patch_files  # noqa: E402

# What the GPU image lacks of the package's requirements (its image holds numpy, pyyaml, tqdm, jinja2, ...):
# gguf for the models, diskcache for llama-cpp-python. Pinned to the versions this environment runs.
WHEELS = ("gguf", "diskcache")
# The sdist's top level, and llama.cpp's, as far as the build reads them; everything else is dropped.
SDIST_KEEP = {"CMakeLists.txt", "pyproject.toml", "PKG-INFO", "README.md", "LICENSE.md", "llama_cpp", "vendor"}
LLAMA_KEEP = {"CMakeLists.txt", "CMakePresets.json", "LICENSE", "licenses", "cmake", "include", "src", "ggml",
              "vendor"}
GGML_BACKENDS_KEEP = {"ggml-cpu", "ggml-cuda", "ggml-rpc", "ggml-blas"}
VENDOR_DROP = {"cpp-httplib"}  # used by llama.cpp's common library only


def remove_all_but(folder: Path, keep: set[str]) -> None:
    for entry in folder.iterdir():
        if entry.name not in keep:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def prune(source: Path) -> None:
    """Cut an extracted sdist down to what the build uses (see the module docstring)."""
    remove_all_but(source, SDIST_KEEP)
    llama = source / "vendor" / "llama.cpp"
    remove_all_but(llama, LLAMA_KEEP)
    ggml_src = llama / "ggml" / "src"
    patched = {llama / name for name in patched_files()}  # kept wherever they are, so that every patch applies
    for backend in ggml_src.glob("ggml-*/"):
        if backend.name in GGML_BACKENDS_KEEP:
            continue
        for path in sorted(backend.rglob("*"), reverse=True):  # files before their folders
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
            elif not path.is_dir() and path not in patched:
                path.unlink()
        if backend.is_dir() and not any(backend.iterdir()):
            backend.rmdir()
    for name in VENDOR_DROP:
        shutil.rmtree(llama / "vendor" / name, ignore_errors=True)


def patched_files() -> set[str]:
    """The files of llama.cpp (paths from its root) that patches/ edits."""
    return {line.split()[1].removeprefix("b/") for patch in patch_files()
            for line in patch.read_text().splitlines() if line.startswith("+++ ")}


def pruned_sdist(out: Path) -> Path:
    """Write the pruned sdist into ``out``, named like the original (build_runtime --sdist takes it)."""
    sdist = fetch_sdist(cache_root() / "sdist")
    with tempfile.TemporaryDirectory(prefix="specee-bundle-") as tmp:
        source = extract_sdist(sdist, Path(tmp) / "src")
        prune(source)
        target = out / sdist.name
        with tarfile.open(target, "w:gz", compresslevel=9) as tar:
            tar.add(source, arcname=source.name)
    return target


def download_wheels(out: Path) -> list[Path]:
    """The WHEELS, at this environment's versions, for any CPython 3 on any platform (all are pure Python)."""
    out.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    result = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                             "--python-version", "3.12", "--implementation", "py", "-d", str(out), *pins],
                            capture_output=True, text=True)
    if result.returncode != 0:
        die(f"pip download {' '.join(pins)} failed: {result.stderr.strip().splitlines()[-1:]}")
    return sorted(out.glob("*.whl"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu-bundle", help="the bundle folder (made afresh)")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    files = [pruned_sdist(args.out), *download_wheels(args.out / "wheels")]
    for path in files:
        print(f"{path.stat().st_size / 2**20:7.2f} MiB  {path.relative_to(args.out)}")
    total = sum(path.stat().st_size for path in files)
    print(f"{total / 2**20:7.2f} MiB  in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
