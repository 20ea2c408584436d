"""Build and install the patched llama-cpp-python runtime into this environment.

The stock llama-cpp-python sdist is downloaded once, our early-exit sources
(``patches/src``, whole files) are copied into its vendored llama.cpp, every
``patches/*.patch`` (the hooks in llama.cpp's own files) is applied in sorted
order, and the resulting wheel is built and installed with ``pip``. Wheels are
cached under a key that covers the version, the sources, the patches, the CMake
flags, the Python tag, the machine and its CPU's instruction sets (and for CUDA,
the nvcc release), so rebuilding only happens when one of those changes.

Environment:
    CMAKE_ARGS         CMake flags as llama-cpp-python takes them: -DGGML_CUDA=on, -DGGML_VULKAN=on or
                       -DGGML_METAL=on picks the backend, the rest is passed on
    SPECEE_BACKEND     cpu (default), cuda, vulkan or metal: the backend, by name
    SPECEE_CMAKE_ARGS  extra CMake flags, appended to the backend's flags
    CUDAARCHS          CUDA architectures (CMake's variable), else the GPUs nvidia-smi sees, else ggml-cuda's
                       default list; -DCMAKE_CUDA_ARCHITECTURES in either of the above wins
    SPECEE_CACHE       cache directory (default: ~/.cache/specee-edge)

`specee-edge setup` runs it in the environment the package is installed in; a source checkout's
``make setup`` runs ``tools/build_runtime.py [--force | --print-key]`` with its .venv's interpreter. On a
machine with no network, ``--sdist`` names a local sdist (tools/gpu_bundle.py makes a pruned one) and
``--target DIR`` installs with ``pip --target`` into a folder on PYTHONPATH rather than into the
interpreter's environment.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import deque
from pathlib import Path
from typing import NoReturn

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)

from specee_edge.libstdcxx import installed_package_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
DIST_NAME = "llama-cpp-python"
MARKER_NAME = "specee_build_key.txt"
# A wheel or sdist install carries the repository's patches/ as specee_edge/patches (pyproject.toml maps
# it there); a source checkout or an editable install reads the repository's own.
_PACKAGE = Path(__file__).resolve().parent
PATCH_DIR = _PACKAGE / "patches" if (_PACKAGE / "patches").is_dir() else _PACKAGE.parent / "patches"
SOURCE_DIR = PATCH_DIR / "src"  # our own files, copied whole into llama.cpp's tree
PUBLIC_HEADERS = ("llama-specee.h",)  # go to include/; every other source goes to src/
BASE_CMAKE_FLAGS = (
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_COMMON=OFF",  # honoured once keep_common_optional() has edited the sdist
    "-DGGML_RPC=ON",  # ggml's RPC backend: `specee-edge rpc-worker` and `--rpc` (layers on other machines)
)
BACKEND_FLAGS = {
    "cpu": (),
    "cuda": ("-DGGML_CUDA=on",),
    "vulkan": ("-DGGML_VULKAN=on",),
    "metal": ("-DGGML_METAL=on",),
}
# a backend's switch in CMAKE_ARGS, as llama-cpp-python's users write it
BACKEND_ARG = re.compile(r"(?<!\S)-DGGML_(CUDA|VULKAN|METAL)=(?:on|1|true|yes)(?!\S)", re.IGNORECASE)
# a user's own -DCMAKE_CUDA_ARCHITECTURES, which wins over the GPUs' (as CMake's CUDAARCHS does)
CUDA_ARCH_ARG = re.compile(r"(?<!\S)-DCMAKE_CUDA_ARCHITECTURES(?::[A-Z]+)?=")
COMPUTE_CAP = re.compile(r"(\d+)\.(\d+)")
# what a backend's build needs on the machine, checked before the download: (program, how to get it)
BACKEND_TOOLS = {
    "vulkan": ("glslc", "apt-get install glslc libvulkan-dev spirv-headers (and mesa-vulkan-drivers for lavapipe,"
                        " Mesa's Vulkan device on the CPU)"),
}
# x86: -march=native without AMX. ggml's AMX kernels run tile instructions on worker threads whose
# tile state Linux never enabled (its XFD is per thread; ggml asks on the main thread only), so on
# AMX CPUs the first batched matmul dies with SIGILL (seen on a 2-core Xeon VM: any prompt of more
# than a few tokens). GGML_NATIVE would put -march=native after our flags, so it is off, its x86
# defaults with it, and the compiler flags carry -march=native instead; ggml then takes AVX-512 paths.
# Not on Windows: MSVC ignores -march=native, which left an SSE2-only build, and ggml's native detection
# there (GGML_NATIVE, on by default) picks MSVC's /arch flags, with no AMX.
X86_MACHINES = ("x86_64", "amd64")
X86_NATIVE_NO_AMX = "-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
X86_FLAGS = (
    "-DGGML_NATIVE=OFF",
    *(f"-DGGML_{isa}=OFF" for isa in ("SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C")),
    f"-DCMAKE_C_FLAGS='{X86_NATIVE_NO_AMX}'",
    f"-DCMAKE_CXX_FLAGS='{X86_NATIVE_NO_AMX}'",
)
LOG_TAIL_LINES = 40
NINJA_PROGRESS = re.compile(r"^\s*\[(\d+)/(\d+)\]")
MAKE_PROGRESS = re.compile(r"^\s*\[\s*(\d+)%\]")
OUTPUT_FILE = re.compile(r"\s-o\s+(\S+)")
PATCH_FILE_LINE = re.compile(r"^(?:checking|patching) file (.+)$", re.IGNORECASE)
PATCH_HEADER_LINE = re.compile(r"^\|\+\+\+ (\S+)")
PATCH_HUNK_FAILED = re.compile(r"^(Hunk #\d+ FAILED at \d+)", re.IGNORECASE)
PATCH_REVERSED = "Reversed (or previously applied) patch detected"
PATCH_NO_FILE = "No file to patch"

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # one-line errors, however narrow the terminal


def die(message: str, code: int = 1) -> NoReturn:
    """Print a one-line error and exit with ``code``."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    sys.exit(code)


def chosen_backend(cmake_args: str) -> str:
    """The backend SPECEE_BACKEND names, else the one CMAKE_ARGS turns on (-DGGML_CUDA=on, ...), else cpu."""
    named = os.environ.get("SPECEE_BACKEND", "").strip().lower()
    if named and named not in BACKEND_FLAGS:
        die(f"unknown SPECEE_BACKEND {named!r} (expected one of: {', '.join(BACKEND_FLAGS)})", 2)
    turned_on = sorted({m.group(1).lower() for m in BACKEND_ARG.finditer(cmake_args)})
    if len(turned_on) > 1 or (named and turned_on and turned_on != [named]):
        chosen = ([f"SPECEE_BACKEND={named}"] if named else []) + [f"-DGGML_{b.upper()}=on" for b in turned_on]
        die(f"one backend at a time: {' and '.join(chosen)} ask for different ones", 2)
    return named or (turned_on[0] if turned_on else "cpu")


def cmake_flags() -> str:
    """Return the CMake flags for the backend chosen via SPECEE_BACKEND or CMAKE_ARGS."""
    user_args = os.environ.get("CMAKE_ARGS", "").strip()
    backend = chosen_backend(user_args)
    if backend in BACKEND_TOOLS and shutil.which(BACKEND_TOOLS[backend][0]) is None:
        tool, how = BACKEND_TOOLS[backend]
        die(f"the {backend} backend needs {tool}: {how}", 2)
    # The backend's own flag is dropped from CMAKE_ARGS and put where SPECEE_BACKEND puts it, so that both
    # spellings of one configuration give one cache key.
    passed_on = " ".join(BACKEND_ARG.sub(" ", user_args).split()) if user_args else ""
    extra = [arg for arg in (os.environ.get("SPECEE_CMAKE_ARGS", "").strip(), passed_on) if arg]
    machine = machine_flags(platform.machine(), platform.system(), backend)
    if backend == "cuda":
        machine = (*machine, *cuda_architectures(" ".join(extra), os.environ.get("CUDAARCHS", ""), gpu_compute_caps()))
    return " ".join([*BASE_CMAKE_FLAGS, *BACKEND_FLAGS[backend], *machine, *extra])


def machine_flags(machine: str, system: str, backend: str) -> tuple[str, ...]:
    """The CPU flags for ``machine`` (platform.machine()) under ``system`` (platform.system()): -march=native
    without AMX on x86 but on Windows and for Metal, ggml's own native detection elsewhere."""
    native_x86 = machine.lower() in X86_MACHINES and system != "Windows" and backend != "metal"
    return X86_FLAGS if native_x86 else ()


def gpu_compute_caps() -> list[str]:
    """The compute capabilities of the GPUs nvidia-smi sees ("8.9", ...); none where it is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return result.stdout.split() if result.returncode == 0 else []


def cuda_architectures(user_args: str, cudaarchs: str, compute_caps: list[str]) -> tuple[str, ...]:
    """The -DCMAKE_CUDA_ARCHITECTURES flag of a CUDA build: none where the user's flags set it; the user's
    CUDAARCHS; else the GPUs present (8.9 -> 89), so that the wheel, and its cache key, hold their code only;
    else none, and ggml-cuda picks: its default list where GGML_NATIVE is off (x86 but Windows), else CMake's
    `native`."""
    if CUDA_ARCH_ARG.search(user_args):
        return ()
    if cudaarchs.strip():
        return (f"-DCMAKE_CUDA_ARCHITECTURES={cudaarchs.strip()}",)
    archs = sorted({f"{m.group(1)}{m.group(2)}" for cap in compute_caps if (m := COMPUTE_CAP.fullmatch(cap.strip()))},
                   key=int)
    return (f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(archs)}",) if archs else ()


def nvcc_release() -> str:
    """The release line of `nvcc --version` ("Cuda compilation tools, release 13.0, V13.0.88"), of the nvcc CMake
    takes (CUDACXX, else the PATH's): a CUDA build's kernels are that compiler's, so another toolkit is another
    build ("" where there is none, or it fails)."""
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
    if not nvcc:
        return ""
    try:
        result = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return next((line.strip() for line in result.stdout.splitlines() if "release" in line), "")


def cpu_features() -> str:
    """The CPU's instruction-set flags (a native build runs only where they all hold), or its name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor()


def patch_files() -> list[Path]:
    """Return the patches to apply, in application order."""
    return sorted(PATCH_DIR.glob("*.patch"))


def source_files() -> list[Path]:
    """Return our whole source files, by name."""
    return sorted(SOURCE_DIR.iterdir())


def source_destination(name: str) -> str:
    """The folder of llama.cpp's tree where our source ``name`` goes."""
    return "include" if name in PUBLIC_HEADERS else "src"


def copy_sources(llama_dir: Path) -> None:
    """Copy our sources into ``llama_dir``; the patches then hook them into llama.cpp."""
    for source in source_files():
        shutil.copyfile(source, llama_dir / source_destination(source.name) / source.name)


def compute_key(cmake_args: str, patches: list[Path], python: bool = True, ours: bool = True) -> str:
    """Hash everything that determines the build into a cache key: `patches` (those the build depends on), and with
    python the wheel's Python tag (a program such as llama-server does not depend on it), with ours our sources
    (a program that never calls the specee API, such as llama-server, runs their hooks idle); for a CUDA build,
    the nvcc release that compiles its kernels."""
    digest = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        digest.update(label.encode())
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)

    add("version", LLAMA_CPP_PYTHON_VERSION.encode())
    for source in source_files() if ours else ():
        add("source-name", source.name.encode())
        add("source-bytes", source.read_bytes())
    for patch in patches:
        add("patch-name", patch.name.encode())
        add("patch-bytes", patch.read_bytes())
    add("cmake", cmake_args.encode())
    if any(m.group(1).lower() == "cuda" for m in BACKEND_ARG.finditer(cmake_args)):
        add("nvcc", nvcc_release().encode())
    if python:
        add("python", sys.implementation.cache_tag.encode())
    add("machine", platform.machine().encode())
    add("cpu", cpu_features().encode())
    return digest.hexdigest()


def cache_root() -> Path:
    """Return the cache directory (SPECEE_CACHE or ~/.cache/specee-edge)."""
    configured = os.environ.get("SPECEE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specee-edge"


def installed_key() -> str | None:
    """Return the build key recorded next to the installed package, if any."""
    package_dir = installed_package_dir()
    if package_dir is None:
        return None
    try:
        return (package_dir / MARKER_NAME).read_text().strip()
    except OSError:
        return None


def add_to_record(path: Path) -> None:
    """List ``path`` in the distribution's RECORD so pip removes it on reinstall.

    Without this, installing any other llama-cpp-python over ours would leave
    a stale marker behind that claims the patched build is installed.
    """
    dist = importlib.metadata.distribution(DIST_NAME)
    record = next(f for f in dist.files or () if f.name == "RECORD")
    record_path = Path(record.locate())
    relative = path.resolve().relative_to(Path(dist.locate_file("")).resolve()).as_posix()
    data = path.read_bytes()
    checksum = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    text = record_path.read_text()
    separator = "" if text.endswith("\n") else "\n"
    record_path.write_text(f"{text}{separator}{relative},sha256={checksum},{len(data)}\n")


def write_marker(key: str) -> None:
    """Record ``key`` as the build key of the installed ``llama_cpp``."""
    package_dir = installed_package_dir()
    if package_dir is None:
        die("llama_cpp is not importable after installing the wheel")
    marker = package_dir / MARKER_NAME
    marker.write_text(key + "\n")
    add_to_record(marker)


def run_quiet(cmd: list[str], what: str) -> None:
    """Run ``cmd`` behind a spinner; on failure show its output and exit 1."""
    with console.status(what):
        result = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if result.returncode != 0:
        err_console.print(result.stdout + result.stderr, markup=False, highlight=False)
        die(f"{what} failed (exit {result.returncode})")


def pip_command() -> list[str]:
    """This interpreter's pip. A virtual environment made by uv has none: ensurepip adds it (offline)."""
    if importlib.util.find_spec("pip") is None:
        if importlib.util.find_spec("ensurepip") is None:
            die(f"{sys.executable} has no pip and no ensurepip to add it: install pip into this environment "
                "(uv pip install pip) and run this again", 2)
        run_quiet([sys.executable, "-m", "ensurepip", "--default-pip"], "adding pip to this environment")
        importlib.invalidate_caches()
    return [sys.executable, "-m", "pip"]


def isolation_flags() -> list[str]:
    """Build in this environment where its build tools are (make setup installs them, and a machine with no
    network needs that); else pip fetches llama-cpp-python's build requirements (scikit-build-core, and cmake
    and ninja where the system has none) into an isolated build environment, as `pip install` would."""
    return ["--no-build-isolation"] if importlib.util.find_spec("scikit_build_core") is not None else []


def find_sdist(sdist_dir: Path) -> Path | None:
    """Return the cached sdist tarball, if present."""
    matches = sorted(sdist_dir.glob(f"llama[-_]cpp[-_]python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"))
    return matches[0] if matches else None


def fetch_sdist(sdist_dir: Path) -> Path:
    """Return the sdist, downloading it into the cache first if needed."""
    cached = find_sdist(sdist_dir)
    if cached is not None:
        return cached
    sdist_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=sdist_dir, prefix=".download-") as tmp:
        run_quiet(
            [
                *pip_command(), "download",
                f"{DIST_NAME}=={LLAMA_CPP_PYTHON_VERSION}",
                "--no-deps", "--no-binary", DIST_NAME, *isolation_flags(),
                "-d", tmp,
            ],
            f"downloading {DIST_NAME} {LLAMA_CPP_PYTHON_VERSION} sdist",
        )
        downloaded = find_sdist(Path(tmp))
        if downloaded is None:
            die(f"pip download did not produce a {DIST_NAME} {LLAMA_CPP_PYTHON_VERSION} sdist")
        target = sdist_dir / downloaded.name
        os.replace(downloaded, target)
    return target


def extract_sdist(sdist: Path, dest: Path) -> Path:
    """Extract ``sdist`` into a fresh ``dest`` and return the source tree."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, **safe)
    (source,) = [p for p in dest.iterdir() if p.is_dir()]
    return source


# llama-cpp-python forces llama.cpp's common library on, though its Python package never loads it: 57
# of the build's 144 steps, about 40 % of its time. Without FORCE the flag above turns it off.
COMMON_FORCED = 'set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)'


def keep_common_optional(source: Path) -> None:
    """Let -DLLAMA_BUILD_COMMON=OFF through llama-cpp-python's CMakeLists.txt."""
    cmake_lists = source / "CMakeLists.txt"
    text = cmake_lists.read_text()
    if COMMON_FORCED not in text:
        die(f"{cmake_lists} no longer forces LLAMA_BUILD_COMMON as expected: update keep_common_optional()")
    cmake_lists.write_text(text.replace(COMMON_FORCED, COMMON_FORCED.replace(" FORCE)", ")")))


def describe_patch_failure(output: str) -> list[str]:
    """Turn GNU/BSD patch output into 'file: problem' lines."""
    problems: list[str] = []
    current = "?"
    for raw in output.splitlines():
        line = raw.strip()
        if match := PATCH_FILE_LINE.match(line):
            current = match.group(1).strip("'\"")
        elif match := PATCH_HEADER_LINE.match(line):
            current = match.group(1).split("/", 1)[-1]
        elif match := PATCH_HUNK_FAILED.match(line):
            problems.append(f"{current}: {match.group(1)}")
        elif line.startswith(PATCH_REVERSED):
            problems.append(f"{current}: already applied (or reversed)")
        elif line.startswith(PATCH_NO_FILE):
            problems.append(f"{current}: file to patch not found")
    return problems


def apply_patches(llama_dir: Path, patches: list[Path]) -> None:
    """Apply ``patches`` in order inside ``llama_dir``; exit 1 naming any that fails."""
    if patches and shutil.which("patch") is None:
        die("applying patches/*.patch needs GNU patch: apt-get install patch (on Windows, Git for Windows' "
            "usr\\bin\\patch.exe on PATH)", 2)
    for patch in patches:
        for dry_run in (True, False):
            cmd = ["patch", "-p1", "--batch", "--forward", "--fuzz=0", "-i", str(patch)]
            result = subprocess.run(
                cmd + (["--dry-run"] if dry_run else []),
                cwd=llama_dir, capture_output=True, text=True, errors="replace",
            )
            if result.returncode != 0:
                output = result.stdout + result.stderr
                details = describe_patch_failure(output) or output.strip().splitlines()
                err_console.print(
                    f"[bold red]error:[/] {patch.name} does not apply to llama.cpp "
                    f"(llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}):",
                    highlight=False,
                )
                for detail in details:
                    err_console.print(f"  {detail}", markup=False, highlight=False)
                err_console.print(f"  patch file: {patch}", markup=False, highlight=False)
                sys.exit(1)
        console.print(f"applied {patch.name}", highlight=False)


def parse_progress(line: str) -> tuple[int, int] | None:
    """Return (done, total) from a ninja ``[n/N]`` or make ``[ n%]`` line."""
    if match := NINJA_PROGRESS.match(line):
        return int(match.group(1)), int(match.group(2))
    if match := MAKE_PROGRESS.match(line):
        return int(match.group(1)), 100
    return None


def status_text(line: str, width: int) -> str:
    """Summarise a build line for the progress bar: the compiled file if any, clipped."""
    if match := OUTPUT_FILE.search(line):
        line = Path(match.group(1)).name
    return line if len(line) <= width else line[: width - 1] + "…"


def stream_build(cmd: list[str], env: dict[str, str], log_path: Path, what: str = "llama.cpp", append: bool = False) -> int:
    """Run the build, logging everything and driving a progress bar (`building WHAT`); return its exit code.
    append: add to the log (a later step of the same build) rather than start it afresh."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    line_width = max(20, console.width - 70)
    progress = Progress(
        SpinnerColumn(),
        TextColumn(f"[bold]building {what}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[line]}", markup=False),
        console=console,
    )
    with log_path.open("a" if append else "w", buffering=1) as log, progress:
        prefix = f"CMAKE_ARGS='{env['CMAKE_ARGS']}' " if "CMAKE_ARGS" in env else ""
        log.write(f"$ {prefix}{' '.join(cmd)}\n")
        task = progress.add_task("build", total=None, line="starting")
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace",
        )
        assert proc.stdout is not None
        seen_progress = False
        for line in proc.stdout:
            log.write(line)
            text = line.strip()
            if not text:
                continue
            step = parse_progress(text)
            if step is not None:
                seen_progress = True
                progress.update(task, completed=step[0], total=step[1])
            if step is not None or not seen_progress:
                progress.update(task, line=status_text(text, line_width))
        return proc.wait()


def print_log_tail(log_path: Path) -> None:
    """Show the last lines of the build log."""
    with log_path.open(errors="replace") as log:
        tail = deque(log, maxlen=LOG_TAIL_LINES)
    err_console.print("".join(tail).rstrip(), markup=False, highlight=False)


def build_wheel(source: Path, out_dir: Path, build_dir: Path, cmake_args: str, log_path: Path) -> Path:
    """Build the wheel from ``source`` into ``out_dir``; exit 1 on failure."""
    env = {
        **os.environ,
        "CMAKE_ARGS": cmake_args,
        "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1),
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [
        *pip_command(), "wheel", str(source),
        "--no-deps", *isolation_flags(), "-v",
        "-w", str(out_dir), "-C", f"build-dir={build_dir}",
    ]
    if stream_build(cmd, env, log_path) != 0:
        print_log_tail(log_path)
        die(f"building llama-cpp-python failed; full log: {log_path}")
    wheels = sorted(out_dir.glob("*.whl"))
    if not wheels:
        die(f"the build produced no wheel; full log: {log_path}")
    return wheels[0]


def store_wheel(wheel: Path, wheel_dir: Path) -> Path:
    """Move ``wheel`` into ``wheel_dir`` atomically and return its new path."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    target = wheel_dir / wheel.name
    fd, partial = tempfile.mkstemp(dir=wheel_dir, prefix=f".{wheel.name}.", suffix=".partial")
    os.close(fd)
    shutil.copyfile(wheel, partial)
    os.replace(partial, target)
    return target


def cached_wheel(wheel_dir: Path) -> Path | None:
    """Return the cached wheel in ``wheel_dir``, if any."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    return wheels[0] if wheels else None


def patched_source(cache: Path, source_root: Path, patches: list[Path], sdist: Path | None = None) -> Path:
    """The sdist (``sdist``, or the cached download) extracted into ``source_root`` with our sources and
    ``patches`` in its vendored llama.cpp; returns the sdist's tree (llama.cpp is in vendor/llama.cpp)."""
    source = extract_sdist(sdist or fetch_sdist(cache / "sdist"), source_root)
    try:
        copy_sources(source / "vendor" / "llama.cpp")
        apply_patches(source / "vendor" / "llama.cpp", patches)
    except BaseException:
        shutil.rmtree(source_root, ignore_errors=True)
        raise
    return source


def build(cache: Path, key: str, cmake_args: str, patches: list[Path], force: bool, sdist: Path | None) -> Path:
    """Download (unless ``sdist`` is given), patch and build the runtime; return the cached wheel."""
    short = key[:16]
    # A fixed source path per key lets an interrupted build resume in build_dir:
    # scikit-build-core discards a build dir whose recorded source dir differs.
    source_root = cache / "src" / short
    build_dir = cache / "build" / short
    if force:
        shutil.rmtree(build_dir, ignore_errors=True)
    source = patched_source(cache, source_root, patches, sdist)
    keep_common_optional(source)
    log_path = cache / "logs" / f"build-{short}.log"
    with tempfile.TemporaryDirectory(prefix="specee-wheel-") as tmp:
        built = build_wheel(source, Path(tmp), build_dir, cmake_args, log_path)
        wheel = store_wheel(built, cache / "wheels" / short)
    shutil.rmtree(source_root, ignore_errors=True)
    shutil.rmtree(build_dir, ignore_errors=True)
    console.print(f"built {wheel.name} ({short}); log: {log_path}", highlight=False)
    return wheel


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--print-key", action="store_true", help="print the build key and exit")
    mode.add_argument("--force", action="store_true", help="rebuild, ignoring cached wheels")
    parser.add_argument("--sdist", type=Path, help=f"build from this {DIST_NAME} {LLAMA_CPP_PYTHON_VERSION} sdist "
                        "(a tarball, pruned or whole) instead of downloading it")
    parser.add_argument("--target", type=Path, help="install into this folder (pip --target; put it on PYTHONPATH) "
                        "instead of this interpreter's environment")
    return parser.parse_args(argv)


def install_command(wheel: Path, target: Path | None) -> list[str]:
    """pip's command line that installs ``wheel`` over any earlier llama-cpp-python, here or in ``target``."""
    where = ["--target", str(target), "--upgrade"] if target else ["--force-reinstall"]
    return [*pip_command(), "install", "-q", "--no-deps", "--no-index", *where, str(wheel)]


def build_key() -> str:
    """The cache key of the runtime this configuration (environment, patches, machine) builds."""
    return compute_key(cmake_flags(), patch_files())


def ensure_runtime(force: bool = False, sdist: Path | None = None, target: Path | None = None) -> None:
    """Make sure the patched runtime for the current configuration is installed: the installed one if its key
    matches, else the cached wheel, else a fresh build (from ``sdist`` if given), installed here or in ``target``."""
    if sdist is not None and not sdist.is_file():
        die(f"no sdist at {sdist}", 2)
    cmake_args = cmake_flags()
    patches = patch_files()
    key = compute_key(cmake_args, patches)
    short = key[:16]
    if target is not None:
        target.mkdir(parents=True, exist_ok=True)
        sys.path.insert(0, str(target.resolve()))  # where the marker's checks look for llama_cpp
    if not force and installed_key() == key:
        console.print(f"patched runtime up to date ({short})", highlight=False)
        return
    cache = cache_root()
    wheel = None if force else cached_wheel(cache / "wheels" / short)
    if wheel is None:
        wheel = build(cache, key, cmake_args, patches, force, sdist)
    run_quiet(install_command(wheel, target), f"installing {wheel.name}")
    write_marker(key)
    console.print(f"installed patched runtime ({short}, {len(patches)} patches)", highlight=False)


def main(argv: list[str] | None = None) -> int:
    """The script's entry point (tools/build_runtime.py, make setup)."""
    args = parse_args(argv)
    if args.print_key:
        print(build_key())
    else:
        ensure_runtime(args.force, args.sdist, args.target)
    return 0

