"""Everything the README tells a user to type exists: each `specee-edge CMD --option` in its code blocks and inline
code is a command of the CLI with that option, each option named alone is an option of some command, and each
`make TARGET` is a Makefile target."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from specee_edge.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
INLINE = re.compile(r"`([^`\n]+)`")
OPTION = re.compile(r"^--?[a-zA-Z][\w-]*$")


def commands() -> dict[str, set[str]]:
    """Each command's name -> its option spellings (every alias, both sides of a --x/--no-x flag, and --help)."""
    group = typer.main.get_command(app)
    return {name: {"--help", *(opt for param in command.params for opt in (*param.opts, *param.secondary_opts))}
            for name, command in group.commands.items()}


def snippets() -> list[str]:
    """The README's code: each line of its code blocks (comments cut) and each inline code span."""
    blocks = [line.split(" #")[0] for block in FENCE.findall(README) for line in block.splitlines()]
    return blocks + INLINE.findall(FENCE.sub("", README))


def invocations() -> list[tuple[str, list[str]]]:
    """(command, the option-looking words after it) for each `specee-edge CMD ...` in the README's code."""
    found = []
    for snippet in snippets():
        for part in re.split(r"[|;&>]", snippet):
            words = shlex.split(part, comments=True) if part.count('"') % 2 == 0 else part.split()
            names = [w for w in words if w.endswith("specee-edge")]
            if not names:
                continue
            rest = words[words.index(names[0]) + 1:]
            if rest and not rest[0].startswith("-"):
                found.append((rest[0], [w.split("=")[0] for w in rest[1:] if OPTION.match(w.split("=")[0])]))
    return found


def lone_options() -> set[str]:
    """Options the README names in inline code without a command: `--pack`, `-c/--ctx-size`, `--quality 0.9`."""
    options = set()
    for span in INLINE.findall(FENCE.sub("", README)):
        if "specee-edge" in span or not span.startswith("-"):
            continue
        for word in re.split(r"[\s/,]+", span):
            if OPTION.match(word):
                options.add(word)
    return options


def test_the_readme_names_commands_and_options():
    """The parser finds what it should, so the checks below check something."""
    found: dict[str, set[str]] = {}
    for command, options in invocations():
        found.setdefault(command, set()).update(options)
    assert {"chat", "generate", "serve", "calibrate", "bench", "info", "pull"} <= set(found)
    assert "--minutes" in found["calibrate"] and "--port" in found["serve"]
    assert {"--pack", "--max-queue", "-ngl"} <= lone_options()


@pytest.mark.parametrize("command, options", invocations(), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_every_command_and_option_in_the_readme_exists(command, options):
    known = commands()
    assert command in known, f"README runs `specee-edge {command}`, which is not a command"
    assert not set(options) - known[command], f"`specee-edge {command}` has no {sorted(set(options) - known[command])}"


def test_every_option_the_readme_names_alone_exists():
    every = set().union(*commands().values())
    assert not lone_options() - every, f"no command has {sorted(lone_options() - every)}"


def test_every_make_target_in_the_readme_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = {m for snippet in snippets() for m in re.findall(r"(?:^|[\s(])make ([\w-]+)", snippet)}
    assert named and not named - targets, f"no Makefile target {sorted(named - targets)}"
