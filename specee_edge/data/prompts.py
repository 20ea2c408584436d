"""Prompt sets: the built-in ones shipped in this package, or a user's JSONL file (for bench and calibrate)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import numpy as np

from specee_edge.errors import SpecEEError


@dataclass(frozen=True)
class Prompt:
    category: str
    text: str


def _read_jsonl(text: str, source: str, key: str) -> list[Prompt]:
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(Prompt(str(row.get(key, "custom")), str(row["prompt"])))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise SpecEEError(f"{source}:{n}: expected a JSON object with a \"prompt\" string") from None
    if not prompts:
        raise SpecEEError(f"{source} holds no prompts")
    return prompts


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """The built-in calibration prompts, or `path` (JSONL: {"prompt": ..., "category": optional})."""
    if path is None:
        return _read_jsonl(files(__package__).joinpath("calibrate_prompts.jsonl").read_text(), "calibrate_prompts.jsonl", "category")
    path = Path(path)
    if not path.is_file():
        raise SpecEEError(f"prompt file not found: {path}")
    return _read_jsonl(path.read_text(encoding="utf-8"), str(path), "category")


# Spec-Bench's six categories (Xia et al. 2024), as the built-in sets name them. Summaries, question answering and
# retrieval run over real text shipped with this machine's packages and Python (each row names its source).
SPEC_BENCH = ("multi-turn", "translation", "summarization", "qa", "math-reasoning", "rag")


# Sets whose answers are held to a grammar: their prompts ask for JSON of EXTRACT_SCHEMA's shape. `all` leaves
# them out (it is the free-text sets, as the figures measured on it had them).
EXTRACT = "extract"
GRAMMAR_SETS = (EXTRACT,)


def bench_prompts(name_or_path: str) -> list[Prompt]:
    """A built-in bench set (chat, code, math, summarize, edit, one of SPEC_BENCH, spec-bench for those six, all
    of those, or extract: facts to copy into EXTRACT_SCHEMA's JSON), a comma list of built-in sets (code,chat,edit:
    their prompts together, in file order), or a JSONL file."""
    if Path(name_or_path).suffix == ".jsonl":
        return load_prompts(name_or_path)
    rows = _read_jsonl(files(__package__).joinpath("bench_prompts.jsonl").read_text(), "bench_prompts.jsonl", "set")
    sets = sorted({p.category for p in rows})
    names = [name.strip() for name in name_or_path.split(",") if name.strip()]
    unknown = [name for name in names if name not in ("all", "spec-bench", *sets)]
    if unknown or not names:
        raise SpecEEError(f"unknown prompt set {name_or_path!r}: choose {', '.join(sets)}, spec-bench, all, "
                          "a comma list of them, or a .jsonl file")
    free_text = [s for s in sets if s not in GRAMMAR_SETS]
    chosen = {category for name in names
              for category in (SPEC_BENCH if name == "spec-bench" else free_text if name == "all" else (name,))}
    return [p for p in rows if p.category in chosen]


def extract_schema() -> dict:
    """The JSON schema the extract set's answers fill: people and their roles, organization, date, place, amount,
    summary."""
    return json.loads(files(__package__).joinpath("extract_schema.json").read_text())


def heldout_text() -> str:
    return files(__package__).joinpath("heldout.txt").read_text()


CALIBRATION_SPLIT = (0.6, 0.2, 0.2)  # calibration's prompts: train / threshold calibration / test


def split(n: int, seed: int, fractions: tuple[float, ...]) -> list[np.ndarray]:
    """Shuffle range(n) and cut it into consecutive parts of the given fractions (the last takes the rest)."""
    order = np.random.default_rng(seed).permutation(n)
    cuts = np.cumsum([round(f * n) for f in fractions[:-1]])
    return np.split(order, cuts)
