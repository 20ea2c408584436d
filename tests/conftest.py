"""Shared fixtures: the default model (SmolLM2-135M-Instruct Q4_1) and tiny random-weight GGUFs."""

from __future__ import annotations

from pathlib import Path

import pytest

from specee_edge.default_model import default_model_path
from specee_edge.runtime import Model
from tests.tiny_gguf import TinyConfig, write_tiny_model

CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n"


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
