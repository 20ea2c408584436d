"""The README and docs/ stand alone: their links resolve, and they cite no file outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# repository paths written in backticks, e.g. `specee_edge/engine/exit.py` or `tools/gpu_check.sh`
REPO_PATH = re.compile(r"`((?:patches|specee_edge|tools|tests|models|docs)/[\w./-]+)`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_cited_repository_paths_exist(page):
    text = page.read_text()
    assert "SPEC.md" not in text and "../shared" not in text, f"{page.name} cites the design notes"
    for path in REPO_PATH.findall(text):
        path = path.rstrip(".")
        if any(ch in path for ch in "*<>"):  # a pattern, not a file
            continue
        assert (ROOT / path).exists(), f"{page.name} cites {path}, which is not in the repository"
