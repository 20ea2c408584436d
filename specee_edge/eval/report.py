"""Eval results: dataclasses, the JSON document, the samples log and rich tables."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich import box
from rich.console import Group
from rich.table import Table

INTERVALS = ("95% intervals: bootstrap over problems, the same problems resampled for a level and plain decoding "
             "(paired), 2000 resamples")
PASS_INTERVAL = "pass@1 - plain: Newcombe's paired score interval, continuity-corrected (1998, method 11)"


@dataclass
class Sample:
    """One answer: a problem at a level (--log-samples writes one per line)."""

    task: str
    problem: str
    level: str
    reply: str
    tokens: int                  # answer tokens (the end-of-generation token included)
    decode_s: float              # decode time, the prompt excluded
    log_likelihood: float        # the full model's mean log-probability per answer token
    repetition: float            # share of the answer's tokens inside a 4-gram it already said
    turn: int                    # its place among the problem's answers (the levels run in a shuffled order)
    code: str | None = None      # humaneval: the code taken from the reply
    passed: bool | None = None   # humaneval: the problem's tests passed
    outcome: str | None = None   # humaneval: passed, timed out, or the program's last line of error


@dataclass
class LevelResult:
    """A level's figures over a task's problems; each difference is against plain decoding on the same problems."""

    level: str                   # plain, exact, or a lossy level's agreement
    answers: int
    tok_s: float                 # decoded tokens over decode time, summed over the answers
    seconds_per_answer: float    # mean decode time of a whole answer (prompt excluded)
    log_likelihood: float        # mean over answers of the full model's mean log-probability per token
    repetition: float            # mean share of answer tokens inside a repeated 4-gram (a loop scores well above)
    looping: int                 # answers at least half repeated
    identical: float             # answers token for token plain decoding's
    pass_at_1: float | None = None  # humaneval: share of problems whose program passes their tests
    time_ratio: float | None = None  # time per whole answer against plain's: decode time summed, a ratio of totals
    time_ratio_interval: tuple[float, float] | None = None
    log_likelihood_gap: float | None = None  # mean log_likelihood minus plain's, per problem
    log_likelihood_gap_interval: tuple[float, float] | None = None
    pass_at_1_diff: float | None = None
    pass_at_1_diff_interval: tuple[float, float] | None = None
    only_level_passed: int | None = None  # problems this level passes and plain fails (discordant pairs)
    only_plain_passed: int | None = None  # ... and the other way round
    exact: bool = False          # exact mode: its answers should be plain's
    divergences: int | None = None  # exact mode: answers that depart from plain's
    near_ties: int | None = None  # ... at a position where plain's top two logits differ by under 0.25
    largest_divergence_margin: float | None = None
    # exact mode, greedy: answers that are not llama.cpp's own evaluation of their rounds (bench.quality.batched_replay)
    off_replay: int | None = None
    unchanged: bool | None = None  # exact mode: greedy, off_replay is 0; sampled, every divergence is a near-tie


@dataclass
class TaskResult:
    task: str
    problems: int
    levels: list[LevelResult]
    prompt_set: str | None = None  # loglik: the prompts' set
    limits: str | None = None      # humaneval: the limits its programs ran under
    samples: list[Sample] = field(default_factory=list)


@dataclass
class EvalResult:
    model: str
    pack: str | None
    threads: int
    temperature: float           # 0: greedy
    seed: int | None
    tokens: int                  # the most tokens of an answer
    tasks: list[TaskResult]
    seconds: float
    command: str
    stored: Path | None = None   # --store: the file beside the pack the figures went to

    def to_json(self) -> dict:
        document = asdict(self)
        document["stored"] = str(self.stored) if self.stored else None
        for task in document["tasks"]:
            del task["samples"]
        return document

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def write_samples(self, path: Path) -> None:
        with path.open("w", encoding="utf-8") as f:
            for task in self.tasks:
                for sample in task.samples:
                    f.write(json.dumps(asdict(sample), ensure_ascii=False) + "\n")

    def render(self) -> Group:
        return Group(*(table for task in self.tasks for table in task_tables(self, task)))


def signed(value: float, interval: tuple[float, float] | None) -> str:
    """A difference, its interval on the line below."""
    return f"{value:+.3f}" + (f"\n({interval[0]:+.2f},{interval[1]:+.2f})" if interval else "")


def same_cell(level: LevelResult) -> str:
    """Answers token for token plain's; for exact mode, whether it is unchanged: greedy, every answer llama.cpp's own
    evaluation of its batches; sampled, every divergence a near-tie."""
    text = f"{level.identical:.2f}"
    if not level.exact or not level.divergences:
        return text + ("\nunchanged" if level.exact else "")
    if level.off_replay is not None:
        return text + (f"\nunchanged:\n{level.divergences} batch\nnear-ties" if level.unchanged else
                       f"\nCHANGED:\n{level.off_replay} off\nllama.cpp")
    beyond = level.divergences - level.near_ties
    return text + (f"\nunchanged:\n{level.near_ties} near-ties" if level.unchanged else
                   f"\nCHANGED:\n{beyond} beyond\nnear-ties")


def task_tables(result: EvalResult, task: TaskResult) -> list[Table]:
    """The answers' figures, then their speed (two tables, so that each fits 80 columns)."""
    decoding = "greedy" if result.temperature == 0 else f"temperature {result.temperature:g}, seed {result.seed}"
    subject = f"{task.problems} problems" if task.prompt_set is None else f"{task.problems} prompts ({task.prompt_set})"
    code = task.levels[0].pass_at_1 is not None
    answers = Table(title=f"{task.task}: {subject}, {decoding}, up to {result.tokens} tokens; {result.model}, "
                          f"pack {result.pack or 'none'}", title_justify="left", box=box.SIMPLE_HEAD)
    answers.add_column("level", no_wrap=True)
    for column in (("pass@1\n(- plain)",) if code else ()) + (
            "log-lik\n/token", "log-lik\n- plain", "repeated\n(loops)", "same as\nplain"):
        answers.add_column(column, justify="right", no_wrap=True)
    speed = Table(title=f"{task.task}: decoding speed, {result.threads} thread{'s' if result.threads > 1 else ''}", title_justify="left",
                  box=box.SIMPLE_HEAD)
    for column in ("level", "tok/s", "time per\nanswer", "time\n/ plain"):
        speed.add_column(column, justify="right" if column != "level" else "left", no_wrap=True)
    for level in task.levels:
        row = [level.level]
        if code:
            row.append(f"{level.pass_at_1:.3f}" + ("" if level.pass_at_1_diff is None else "\n" + signed(
                level.pass_at_1_diff, level.pass_at_1_diff_interval) + f"\n+{level.only_level_passed} -{level.only_plain_passed}"))
        gap = "" if level.log_likelihood_gap is None else signed(level.log_likelihood_gap,
                                                                  level.log_likelihood_gap_interval)
        answers.add_row(*row, f"{level.log_likelihood:.3f}", gap, f"{level.repetition:.3f}\n({level.looping})",
                        same_cell(level))
        ratio = "" if level.time_ratio is None else (
            f"{level.time_ratio:.3f}x\n({level.time_ratio_interval[0]:.2f},{level.time_ratio_interval[1]:.2f})")
        speed.add_row(level.level, f"{level.tok_s:.1f}", f"{level.seconds_per_answer:.2f} s", ratio)
    notes = [INTERVALS + (f"; {PASS_INTERVAL}; pass@1, last line: +problems only the level passes, -problems "
                          "only plain passes" if code else "")]
    notes.append("log-lik: the full model's mean log-probability per answer token, teacher forced; repeated: share of "
                 "answer tokens inside a 4-gram the answer already said, (answers at least half repeated): loops "
                 "score well on log-lik; exact mode is unchanged when, greedy, every answer is llama.cpp's own "
                 "evaluation of its verification batches (a divergence from plain is then the batch kernels' "
                 "arithmetic at a near-tie), or, sampled, every divergence is where plain's top two logits differ by "
                 "under 0.25")
    if task.limits:
        notes.append(f"each program ran in a child process: {task.limits}")
    answers.caption = "; ".join(notes)
    answers.caption_justify = "left"
    speed.caption = ("time per answer: decode time of a whole answer, the prompt excluded; / plain: total decode time "
                     "over the total of plain decoding's, on the same problems")
    speed.caption_justify = "left"
    return [answers, speed]
