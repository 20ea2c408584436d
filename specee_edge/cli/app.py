"""The typer app and the consoles every command shares."""

from __future__ import annotations

import typer
from rich.console import Console

app = typer.Typer(help="Speculative early exit (SpecEE) for llama.cpp models.", no_args_is_help=True)
console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # one line, however narrow the terminal


def fail(error: Exception) -> typer.Exit:
    """Print a one-line error; the caller raises the returned Exit."""
    err_console.print(f"[red]error:[/red] {error}", highlight=False)
    return typer.Exit(1)
