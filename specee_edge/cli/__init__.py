"""The `specee-edge` command line: one module per group of commands, all on one typer app."""

from specee_edge.cli import bench, calibrate, chat, evaluate, models, pull, rpc_worker, serve, setup  # noqa: F401
from specee_edge.cli import tools  # noqa: F401  (registers its commands)
from specee_edge.cli.app import app, err_console
from specee_edge.errors import SETUP_HINT, RuntimeMissingError

__all__ = ["app", "main"]


def main() -> None:
    """The console script: the app, with a missing or stock llama_cpp reported in one line wherever a command
    first imports it (a command's own error handling covers only the runtime it loads itself)."""
    try:
        app()
    except RuntimeMissingError as e:
        err_console.print(f"[red]error:[/red] {e}", highlight=False)
        raise SystemExit(1) from None
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("llama_cpp"):
            raise
        err_console.print(f"[red]error:[/red] the patched llama.cpp runtime is not installed: {SETUP_HINT}",
                          highlight=False)
        raise SystemExit(1) from None
