"""The package's import structure: one-way layers, and the commands that only read files work without
the patched runtime."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from specee_edge.shipped import shipped_dir
from tests.conftest import tiny_model_path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specee_edge"

# Top to bottom: a module may import its own unit (subpackage or top-level module) and the units of
# lower layers, never a unit of its own layer or above. "" is the package root (__version__).
LAYERS = (
    ("cli",),
    ("stores",),
    ("eval",),
    ("bench", "calibrate", "pull", "hf", "server"),
    ("engine",),
    ("draft", "predictor"),
    ("pack",),
    ("runtime", "registry"),
    ("gguf_index", "default_model", "shipped", "threads", "data", "archs", "exits", "chat_templates", "bootstrap",
     "grammar"),
    ("errors", "build_runtime", ""),
    ("libstdcxx",),
)
RANK = {unit: rank for rank, layer in enumerate(LAYERS) for unit in layer}
SHIPPED_PACK = shipped_dir() / "SmolLM2-135M-Instruct.Q4_1.specee.gguf"

# `specee-edge ARGS...` in a fresh interpreter where importing llama_cpp fails, as where it is not built
WITHOUT_LLAMA_CPP = """
import sys

class NoLlamaCpp:
    def find_spec(self, name, path=None, target=None):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            raise ImportError(f"{name} is not installed (blocked by the test)")
        return None

sys.meta_path.insert(0, NoLlamaCpp())
from specee_edge.cli import app
app(sys.argv[1:], prog_name="specee-edge")
"""


def run_without_llama_cpp(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), COLUMNS="200")
    return subprocess.run([sys.executable, "-c", WITHOUT_LLAMA_CPP, *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_info_and_convert_work_without_llama_cpp(tiny_dir, tmp_path):
    result = run_without_llama_cpp("info", str(SHIPPED_PACK))
    assert result.returncode == 0, result.stderr
    assert "candidates (k)" in result.stdout and "llama, 30 layers" in result.stdout
    assert "quality levels" in result.stdout and "temperature" in result.stdout

    model = tiny_model_path(tiny_dir, "llama")
    result = run_without_llama_cpp("info", str(model))
    assert result.returncode == 0, result.stderr
    assert "architecture" in result.stdout and "the patched runtime is not installed" in result.stdout

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "p.npz", **{"layer1.weight0": rng.standard_normal((8, 12), dtype=np.float32),
                                     "layer1.bias0": np.zeros(8, np.float32),
                                     "layer1.weight1": rng.standard_normal((1, 8), dtype=np.float32),
                                     "layer1.bias1": np.zeros(1, np.float32)})
    result = run_without_llama_cpp("convert", str(tmp_path / "p.npz"), "-o", str(tmp_path / "p.specee.gguf"),
                                   "--model", str(model))
    assert result.returncode == 0, result.stderr
    assert "1 predictors (k = 4)" in result.stdout


def unit_of(module: str) -> str:
    """`specee_edge.pack.io` -> "pack"; `specee_edge` -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imported_units(path: Path) -> list[tuple[int, str]]:
    """(line, unit) of every specee_edge import in the file, also those inside functions."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from specee_edge import pack` imports a unit; `from specee_edge import __version__` the root
            names = [f"{base}.{a.name}" if base == "specee_edge" and a.name in RANK else base for a in node.names]
        else:
            continue
        found += sorted({(node.lineno, unit_of(name)) for name in names if name.split(".")[0] == "specee_edge"})
    return found


def test_imports_follow_the_layers():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = unit_of(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
        if own not in RANK:
            violations.append(f"{path.relative_to(ROOT)}: unit {own!r} is in no layer (add it to LAYERS)")
            continue
        for line, unit in imported_units(path):
            if unit not in RANK:
                violations.append(f"{path.relative_to(ROOT)}:{line}: imports {unit!r}, which is in no layer")
            elif unit != own and RANK[unit] <= RANK[own]:
                violations.append(f"{path.relative_to(ROOT)}:{line}: {own or 'specee_edge'} imports {unit}"
                                  f" ({'same layer' if RANK[unit] == RANK[own] else 'a higher layer'})")
    assert not violations, "\n".join(violations)
