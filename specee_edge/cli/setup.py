"""`specee-edge setup`: what `chat` needs in the environment the package was installed into.

The patched llama.cpp runtime, built from source here the way llama-cpp-python builds (CMAKE_ARGS picks a
GPU backend) and cached by its build key, and the default model when it is missing. `make setup` builds
the runtime with the same code (tools/build_runtime.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from specee_edge.cli.app import app, console, fail
from specee_edge.errors import SpecEEError


@app.command()
def setup(
    force: Annotated[bool, typer.Option("--force", help="rebuild the runtime, ignoring the cached wheel")] = False,
    sdist: Annotated[Path | None, typer.Option("--sdist", show_default=False,
                                               help="build from this llama-cpp-python sdist instead of downloading it")] = None,
    runtime_only: Annotated[bool, typer.Option("--runtime-only", help="the runtime only, not the default model")] = False,
    print_key: Annotated[bool, typer.Option("--print-key", help="print the runtime's build key and stop")] = False,
) -> None:
    """Build and install the patched runtime (CMAKE_ARGS="-DGGML_CUDA=on", -DGGML_VULKAN=on or -DGGML_METAL=on
    for a GPU, as for llama-cpp-python; cached), then fetch the default model if it is missing."""
    from specee_edge import build_runtime

    if print_key:
        console.print(build_runtime.build_key(), highlight=False)
        return
    build_runtime.ensure_runtime(force=force, sdist=sdist)
    if runtime_only:
        return
    from specee_edge.default_model import DEFAULT_MODEL_NAME, default_model_path

    try:
        path = default_model_path()
    except SpecEEError:
        from specee_edge.cli.pull import pull

        pull(DEFAULT_MODEL_NAME, list_models=False, index_url=None, find_links=None, no_index=False)
    else:
        console.print(f"default model: {path}", highlight=False)
