"""A built (non-editable) install carries models/ (the registry and the shipped packs) and patches/ (what
`specee-edge setup` builds the runtime from), and finds them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from specee_edge.build_runtime import PATCH_DIR
from specee_edge.shipped import shipped_dir
from tests.conftest import project_copy

ROOT = Path(__file__).resolve().parents[1]


def build_package(tmp_path: Path) -> Path:
    """The files a wheel of the project holds, laid out as an install puts them (its purelib).

    `build_py` is the step of a wheel build that gathers them; bdist_wheel then zips its output. It
    needs no `wheel` package and no index (this project's venv has neither a build frontend nor `wheel`).
    """
    src = project_copy(tmp_path / "src")
    lib = tmp_path / "lib"
    result = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
                             "--build-lib", str(lib)], cwd=src, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return lib


def test_built_package_carries_the_models_folder(tmp_path):
    lib = build_package(tmp_path)
    # every module of the source tree is there (pyproject lists the packages by hand)
    modules = {p.relative_to(ROOT) for p in (ROOT / "specee_edge").rglob("*.py")}
    assert modules <= {p.relative_to(lib) for p in lib.rglob("*.py")}
    shipped = {p.name for p in (ROOT / "models").iterdir()}
    assert {"registry.json", "SmolLM2-135M-Instruct.Q4_1.specee.gguf"} <= shipped
    assert {p.name for p in (lib / "specee_edge" / "models").iterdir()} == shipped
    patches = {p.relative_to(ROOT / "patches") for p in (ROOT / "patches").rglob("*") if p.is_file()}
    assert {p.relative_to(lib / "specee_edge" / "patches") for p in (lib / "specee_edge" / "patches").rglob("*")
            if p.is_file()} == patches

    # installed like that, away from the repository, the package finds them through shipped_dir() and PATCH_DIR
    script = ("import specee_edge, specee_edge.registry as registry; from specee_edge.shipped import shipped_dir;"
              " from specee_edge.build_runtime import PATCH_DIR;"
              " print(specee_edge.__file__); print(shipped_dir()); print(sorted(registry.load_registry())); print(PATCH_DIR)")
    env = {k: v for k, v in os.environ.items() if k not in ("SPECEE_REGISTRY",)} | {"PYTHONPATH": str(lib)}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    module, found, names, patch_dir = result.stdout.splitlines()
    assert Path(module).is_relative_to(lib) and Path(found) == lib / "specee_edge" / "models"
    assert Path(patch_dir) == lib / "specee_edge" / "patches"
    assert "smollm2-135m-instruct" in names


def test_source_checkout_finds_the_repository_models_and_patches_folders():
    assert shipped_dir() == ROOT / "models"
    assert PATCH_DIR == ROOT / "patches"
