"""Housekeeping commands: doctor, version, info, convert."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from specee_edge import __version__
from specee_edge.cli.app import app, console, fail
from specee_edge.errors import SpecEEError


@app.command()
def doctor() -> None:
    """Check the installation: the patched runtime and the default model."""
    from specee_edge.default_model import default_model_path

    console.print(f"specee-edge {__version__}")
    try:
        from specee_edge.runtime import Model

        path = default_model_path()
        info = Model(path).info
    except SpecEEError as e:
        raise fail(e) from None
    console.print(f"patched runtime: ok; default model: {path.name} ({info.arch}, {info.n_layer} layers)")


@app.command()
def version() -> None:
    """Print the version."""
    console.print(__version__)


@app.command()
def info(model: Annotated[str, typer.Argument(help="a model GGUF, a name `specee-edge models` shows, or a "
                                                   "specee pack")]) -> None:
    """Summarize a model GGUF or a pack: architecture, layers, sizes, schedule, predictors, provenance."""
    from specee_edge.cli.chat import pick_model
    from specee_edge.cli.info import summarize
    from specee_edge.stores import resolve_model

    try:
        console.print(summarize(resolve_model(pick_model(model, None)).path))
    except SpecEEError as e:
        raise fail(e) from None


@app.command()
def convert(
    sources: Annotated[list[str], typer.Argument(help="predictor files (.joblib[:LAYER], .npz, .safetensors)")],
    output: Annotated[Path, typer.Option("-o", "--output", help="the pack to write")],
    model: Annotated[Path, typer.Option("-m", "--model", help="the target model GGUF the pack is for")],
    predictor_type: Annotated[str, typer.Option("--predictor-type", help="predictor weights: f32 or f16")] = "f32",
    threshold: Annotated[float, typer.Option("--threshold", help="exit threshold on the predictor's output")] = 0.5,
) -> None:
    """Convert predictors (scikit-learn, numpy, the SpecEE paper's safetensors) into a pack."""
    from specee_edge.pack import target_identity, write_pack
    from specee_edge.pack.convert import convert as convert_sources

    try:
        target = target_identity(model)
        pack = convert_sources(sources, target, threshold=threshold, command=" ".join(["specee-edge", *sys.argv[1:]]),
                               note=lambda line: console.print(line, highlight=False, soft_wrap=True))
        write_pack(output, pack, predictor_type=predictor_type)
    except SpecEEError as e:
        raise fail(e) from None
    console.print(f"wrote {output}: {len(pack.predictors)} predictors (k = {pack.k}) for {model.name}", soft_wrap=True)
