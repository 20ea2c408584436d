"""Shared fixtures: the default model (SmolLM2-135M-Instruct Q4_1) and tiny random-weight GGUFs."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from specee_edge.default_model import default_model_path
from specee_edge.engine import Engine
from specee_edge.exits import ExitKind
from specee_edge.pack import read_pack, write_pack
from specee_edge.pack.format import LayerExit
from specee_edge.runtime import Model
from specee_edge.shipped import shipped_dir
from tests.tiny_gguf import TinyConfig, write_tiny_model

SHIPPED_PACK = shipped_dir() / "SmolLM2-135M-Instruct.Q4_1.specee.gguf"
LOOSE, STRICT = 0.9, 0.99  # the quality levels of write_two_level_pack
CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n"


def slowed(engine: Engine, step: float = 1.0, batch: float = 1.0) -> Engine:
    """``engine`` with each decode of its context of one token (a step) or of several (a batch) made ``step`` or
    ``batch`` times as long, by sleeping after it: a machine where that costs more, for the controller to see."""
    decode = engine.ctx.decode

    def slow_decode(tokens, **kwargs):
        t0 = time.perf_counter()
        exit_layer = decode(tokens, **kwargs)
        time.sleep(((step if len(tokens) == 1 else batch) - 1.0) * (time.perf_counter() - t0))
        return exit_layer

    engine.ctx.decode = slow_decode
    return engine


def project_copy(src: Path) -> Path:
    """What a package build reads of the project (pyproject, README, the package, models/, patches/), copied to `src`."""
    root = Path(__file__).resolve().parents[1]
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    for name in ("specee_edge", "models", "patches"):
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def load_tool(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """tools/NAME.py as a module, registered under its name for the test (its dataclasses look it up there)."""
    spec = importlib.util.spec_from_file_location(name, f"tools/{name}.py")
    tool = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, tool)
    spec.loader.exec_module(tool)
    return tool


@pytest.fixture(scope="session")
def default_model() -> Model:
    return Model(default_model_path())


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


def tiny_model_path(tiny_dir: Path, arch: str, **overrides) -> Path:
    config = TinyConfig(arch=arch, **overrides)
    suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    path = tiny_dir / f"{arch}{'-' + suffix if suffix else ''}.gguf"
    if not path.exists():
        write_tiny_model(path, config)
    return path


# The tiny model of each architecture early exit supports. gemma3 twice: global attention only (one
# unified cache), and with a window of 8 tokens on layers 0, 1 and 3 (llama.cpp keeps an iSWA cache pair:
# the window layers' cache and the global layer's) and its output soft-capped at 2.
SUPPORTED_VARIANTS: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "gemma3": {},
    "gemma3-swa": {"n_swa": 8, "swa_pattern": 3, "final_softcap": 2.0},
}


def supported_model_path(tiny_dir: Path, variant: str, **overrides) -> Path:
    return tiny_model_path(tiny_dir, variant.split("-")[0], **SUPPORTED_VARIANTS[variant], **overrides)


def exiting_quality(pack_path: Path = SHIPPED_PACK) -> float:
    """The highest lossy quality level of a pack with a layer on (a default level may turn every layer off)."""
    return max(level.quality for level in read_pack(pack_path).levels
               if level.on_layers and not level.exact)


def write_two_level_pack(path: Path) -> Path:
    """The default model's shipped pack with two lossy quality levels and no exact one: LOOSE (threshold 0.3
    everywhere, so tokens exit) and STRICT, the default (the shipped highest lossy level's thresholds), and
    temperatures of 1.2."""
    pack = read_pack(SHIPPED_PACK)
    lossy_default = [level for level in pack.levels if not level.exact][-1]  # the pack's default is exact mode
    strict = dataclasses.replace(lossy_default, quality=STRICT)
    last = pack.target.n_layer - 1  # its exit skips the output head: head-free or off
    loose = dataclasses.replace(pack.levels[0], quality=LOOSE, exits={
                                    il: LayerExit(ExitKind.HEAD_FREE if il == last else ExitKind.VERIFIED, 0.3)
                                    for il in strict.exits},
                                exit_rate=0.2, agreement=0.93)  # the loosest level's offline layers: checked from the start
    write_pack(path, dataclasses.replace(pack, levels=[loose, strict], default_quality=STRICT,
                                         temperatures=dict.fromkeys(pack.predictors, 1.2)))
    return path


BROWSER_MISSING = "no chromium/chromedriver (Debian: apt-get install chromium chromium-driver)"
LLAMA_SERVER_MISSING = "make llama-server builds it"


def pytest_terminal_summary(terminalreporter) -> None:
    """Tests skipped for a missing program are said loudly at the end: what went untested on this machine."""
    reasons = [str(report.longrepr) for report in terminalreporter.stats.get("skipped", [])]
    for needle, what in ((BROWSER_MISSING, f"the chat page was NOT tested in a browser: {BROWSER_MISSING}"),
                         (LLAMA_SERVER_MISSING, "the bench's llama-server lanes were NOT tested: llama-server is not"
                                                f" built ({LLAMA_SERVER_MISSING}, once: 20-40 minutes on 2 cores)")):
        if any(needle in reason for reason in reasons):
            terminalreporter.write_sep("!", what, red=True, bold=True)
