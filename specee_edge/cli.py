"""The `specee-edge` command line (typer)."""

from __future__ import annotations

import typer
from rich.console import Console

from specee_edge import __version__

app = typer.Typer(help="Speculative early exit (SpecEE) for llama.cpp models.", no_args_is_help=True)
console = Console()


@app.command()
def doctor() -> None:
    """Check the installation: the patched runtime and the default model."""
    from specee_edge.default_model import default_model_path
    from specee_edge.errors import SpecEEError

    console.print(f"specee-edge {__version__}")
    try:
        from specee_edge.runtime import Model

        path = default_model_path()
        info = Model(path).info
    except SpecEEError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None
    console.print(f"patched runtime: ok; default model: {path.name} ({info.arch}, {info.n_layer} layers)")


@app.command()
def version() -> None:
    """Print the version."""
    console.print(__version__)
