"""Task figures from `specee-edge eval`, kept beside a pack in PACK.eval.json (X.specee.gguf: X.specee.eval.json),
with the pack's sha256: figures measured on other bytes (a pack recalibrated since) are told apart. A pack without
the file (every pack made before eval existed) has no task figures."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from specee_edge.errors import SpecEEError


@dataclass
class TaskFigures:
    """One task's figures for every level eval ran, each level's keyed by its name (plain, exact, 0.9, ...)."""

    task: str
    problems: int
    tokens: int        # the most tokens of an answer
    threads: int
    temperature: float  # 0: greedy
    command: str
    levels: dict[str, dict]  # level -> eval's figures (pass_at_1, time_ratio, log_likelihood_gap, ... as its JSON)


@dataclass
class StoredFigures:
    tasks: dict[str, TaskFigures]
    current: bool  # measured on this very pack (its sha256 matches)
    path: Path


def figures_path(pack: str | os.PathLike) -> Path:
    pack = Path(pack)
    return pack.with_name(pack.name.removesuffix(".gguf") + ".eval.json")


def pack_digest(pack: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(pack, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_figures(pack: str | os.PathLike) -> StoredFigures | None:
    """The figures stored beside `pack`, or None where there are none."""
    path = figures_path(pack)
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        tasks = {name: TaskFigures(**task) for name, task in document["tasks"].items()}
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise SpecEEError(f"{path} is not a task-figures file written by `specee-edge eval --store`") from None
    return StoredFigures(tasks, document.get("pack_sha256") == pack_digest(pack), path)


def store_figures(pack: str | os.PathLike, figures: list[TaskFigures]) -> Path:
    """Keep `figures` beside `pack`, replacing those of the same tasks; another task's stay if measured on this pack."""
    digest = pack_digest(pack)
    stored = read_figures(pack)
    tasks = dict(stored.tasks) if stored is not None and stored.current else {}
    tasks.update({f.task: f for f in figures})
    path = figures_path(pack)
    document = {"pack_sha256": digest, "tasks": {name: asdict(task) for name, task in sorted(tasks.items())}}
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return path
