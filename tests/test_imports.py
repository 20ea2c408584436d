"""The package's import structure: the commands that only read files work without the patched runtime."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.conftest import tiny_model_path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_PACK = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.specee.gguf"

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
