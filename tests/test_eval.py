"""`specee-edge eval` (issue 56): the HumanEval grader on canonical and wrong solutions, the code taken from a reply,
the sandbox's limits, the full model's log-likelihood, and eval itself on a few problems of the default model."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from scipy.special import log_softmax
from typer.testing import CliRunner

from specee_edge.cli import app
from specee_edge.default_model import default_model_path
from specee_edge.eval import humaneval
from specee_edge.errors import SpecEEError
from specee_edge.eval.run import HUMANEVAL, LOGLIK, PLAIN, EvalConfig, parse_problems, run_eval, task_items
from specee_edge.eval.sandbox import limits, run_program
from specee_edge.eval.score import mean_log_likelihoods, paired_difference, paired_ratio
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
    outcome = run_program(humaneval.program(problem, humaneval.extract_code(reply)), limits())
    assert outcome.passed, outcome.reason


def test_wrong_solutions_fail(problems):
    problem = problems["HumanEval/53"]  # add(x, y)
    wrong = "def add(x: int, y: int):\n    return x - y\n"
    outcome = run_program(humaneval.program(problem, wrong), limits())
    assert not outcome.passed and outcome.reason == "AssertionError"
    # no code at all: the prompt's stub returns None
    assert not run_program(humaneval.program(problem, "I cannot help with that."), limits()).passed
    assert not run_program(humaneval.program(problem, "def add(x, y) return"), limits()).passed  # a syntax error


def test_a_program_that_loops_is_stopped(problems):
    looping = "def add(x, y):\n    while True:\n        pass\n"
    outcome = run_program(humaneval.program(problems["HumanEval/53"], looping), limits(time_s=1.0))
    assert outcome == outcome.__class__(False, "timed out")


def test_the_limits_that_apply_here():
    applied = limits()
    assert applied.memory and applied.cpu and applied.no_core  # Linux
    hog = "x = bytearray(4 << 30)\n"
    assert run_program(hog, applied).reason == "MemoryError"
    if applied.network:
        reach = "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n"
        assert "Network is unreachable" in run_program(reach, applied).reason
    assert "network not limited" in applied.describe() or "no network (unshare -n)" in applied.describe()


def test_the_code_is_the_longest_python_block():
    short, long = "def f():\n    return 1\n", "def f():\n    x = 1\n    return x\n"
    assert humaneval.extract_code(f"```python\n{short}```\ntext\n```python\n{long}```") == long
    assert humaneval.extract_code(f"```python\n{long}") == long  # cut off by the token limit
    assert humaneval.extract_code("```\nnot python\n```") == "```\nnot python\n```"  # no python block: the reply
    assert humaneval.extract_code("return 1") == "return 1"


def test_paired_intervals():
    level, plain = np.array([1, 1, 0, 1.0]), np.array([1, 0, 0, 1.0])
    diff, (low, high) = paired_difference(level, plain)
    assert diff == 0.25 and low == 0.0 and 0.25 <= high <= 0.75
    ratio, (low, high) = paired_ratio([2.0, 4.0], [1.0, 2.0])
    assert ratio == low == high == 2.0  # every problem twice as slow: no spread to resample


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
    assert "unshare -n" in result.output or "network not limited" in result.output
    data = json.loads(out.read_text())
    (task,) = data["tasks"]
    assert task["task"] == "humaneval" and task["problems"] == 2 and "wall clock" in task["limits"]
    levels = {lv["level"]: lv for lv in task["levels"]}
    assert list(levels) == [PLAIN, "0.9", "0.9+words", "exact"]  # a lossy level, then itself under the guard
    for name, level in levels.items():
        assert level["pass_at_1"] in (0.0, 0.5, 1.0) and level["seconds_per_answer"] > 0
        if name != PLAIN:
            low, high = level["time_ratio_interval"]
            assert level["time_ratio"] > 0 and low <= level["time_ratio"] <= high
            assert level["pass_at_1_diff"] == level["pass_at_1"] - levels[PLAIN]["pass_at_1"]
            assert level["only_level_passed"] - level["only_plain_passed"] == round(2 * level["pass_at_1_diff"])
    assert levels["exact"]["unchanged"]
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 8 and {r["problem"] for r in rows} == {"HumanEval/0", "HumanEval/1"}
    assert all(r["outcome"] and r["code"] is not None and r["tokens"] <= 40 for r in rows)
    # what the table says passed is what the samples say
    assert np.mean([r["passed"] for r in rows if r["level"] == PLAIN]) == levels[PLAIN]["pass_at_1"]

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
