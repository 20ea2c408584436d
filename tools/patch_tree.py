"""A git work tree of the patched llama.cpp, for editing the patch series and moving to a newer llama.cpp.

    checkout DIR   the sdist's vendored llama.cpp in DIR as a git repository: one commit of the stock
                   tree, one that copies our whole sources (patches/src), then one commit per
                   patches/*.patch, its header as the commit message
    export DIR     the other way: patches/*.patch rewritten from DIR's commits after the sources commit
                   (each commit's message becomes its patch's header, its subject the file name), and
                   patches/src from DIR's copies of our sources (--patches OUT: into OUT and OUT/src instead)

Editing a hook: change the file in DIR, `git commit --fixup=<the patch's commit>`, then
`GIT_SEQUENCE_EDITOR=: git rebase -i --autosquash <the sources commit>` and `export`. Moving to a
newer llama.cpp: rebase the patch commits onto the new stock tree, resolve, export, rebuild, run the tests
(docs/runtime.md).

Run it with the project's interpreter: `.venv/bin/python tools/patch_tree.py checkout /tmp/llama.cpp`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specee_edge.build_runtime import (  # noqa: E402
    PATCH_DIR, cache_root, copy_sources, extract_sdist, fetch_sdist, patch_files, source_destination, source_files,
)

STOCK = "stock llama.cpp (llama-cpp-python's vendored tree)"
SOURCES = "specee sources (patches/src)"


def git(tree: Path, *args: str, capture: bool = False) -> str:
    result = subprocess.run(["git", *args], cwd=tree, check=True, text=True, capture_output=capture)
    return result.stdout if capture else ""


def commit_all(tree: Path, message: str) -> None:
    git(tree, "add", "-A")
    git(tree, "-c", "user.name=specee", "-c", "user.email=specee@localhost", "commit", "-q",
        "--allow-empty", "-m", message)


def header_of(patch: Path) -> str:
    """The leading `# ` comment lines of a patch file, as plain text."""
    lines = []
    for line in patch.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[2:] if line.startswith("# ") else line[1:])
    return "\n".join(lines).strip() + "\n"


def checkout(dest: Path) -> None:
    if dest.exists():
        sys.exit(f"error: {dest} exists")
    with tempfile.TemporaryDirectory() as tmp:
        source = extract_sdist(fetch_sdist(cache_root() / "sdist"), Path(tmp))
        shutil.copytree(source / "vendor" / "llama.cpp", dest)
    (dest / ".git").unlink(missing_ok=True)  # a submodule's pointer file in the sdist
    git(dest, "init", "-q")
    commit_all(dest, STOCK)
    copy_sources(dest)
    commit_all(dest, SOURCES)
    for patch in patch_files():
        git(dest, "apply", "--whitespace=nowarn", str(patch))
        commit_all(dest, f"{patch.stem}\n\n{header_of(patch)}")
    print(f"{dest}: {len(patch_files())} patch commits on top of '{SOURCES}'")


def export(tree: Path, out: Path = PATCH_DIR) -> None:
    if not (tree / ".git").exists():
        sys.exit(f"error: {tree} is no git work tree: make one with `patch_tree.py checkout {tree}`")
    log = git(tree, "log", "--reverse", "--format=%H %s", capture=True).splitlines()
    subjects = [line.split(" ", 1) for line in log]
    base = next((i for i, (_, subject) in enumerate(subjects) if subject == SOURCES), None)
    if base is None:
        sys.exit(f"error: {tree} has no commit '{SOURCES}': not a tree `patch_tree.py checkout` made")
    own = {f"{source_destination(path.name)}/{path.name}" for path in source_files()}
    out.joinpath("src").mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.patch"):
        old.unlink()
    for sha, name in subjects[base + 1:]:
        body = git(tree, "log", "-1", "--format=%b", sha, capture=True).strip()
        header = "".join(f"# {line}".rstrip() + "\n" for line in body.splitlines())
        diff = git(tree, "diff-tree", "-p", "--no-commit-id", f"{sha}~1", sha, capture=True)
        ours = [line for line in diff.splitlines() if line.startswith("diff --git")
                and line.split()[-1].removeprefix("b/") in own]
        if ours:
            sys.exit(f"error: {name} writes our own sources ({ours[0]}): edit them in patches/src instead")
        (out / f"{name}.patch").write_text(f"{header}\n{diff}")
    for path in source_files():
        shutil.copyfile(tree / source_destination(path.name) / path.name, out / "src" / path.name)
    print(f"exported {len(subjects) - base - 1} patches and {len(source_files())} sources from {tree} to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("checkout").add_argument("dir", type=Path)
    export_parser = sub.add_parser("export")
    export_parser.add_argument("dir", type=Path)
    export_parser.add_argument("--patches", type=Path, default=PATCH_DIR, help="write here (default: patches/)")
    args = parser.parse_args()
    if args.command == "checkout":
        checkout(args.dir.resolve())
    else:
        export(args.dir.resolve(), args.patches.resolve())


if __name__ == "__main__":
    main()
