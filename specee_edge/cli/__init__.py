"""The `specee-edge` command line: one module per group of commands, all on one typer app."""

from specee_edge.cli import bench, calibrate, chat, pull, rpc_worker, serve  # noqa: F401
from specee_edge.cli import tools  # noqa: F401  (registers its commands)
from specee_edge.cli.app import app

__all__ = ["app"]
