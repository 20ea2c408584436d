"""One eval run: every level's answers to the same problems from one engine, then their scores (the full model's
log-likelihood, the tests of a code task), paired with plain decoding's."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from specee_edge.bench.quality import LOOP_SHARE, NEAR_TIE, batched_replay, divergence_margins, repetition
from specee_edge.bench.run import ENGINE_CTX, Reporter, Silent, bench_qualities, pick_prompts
from specee_edge.bench.runner import prompt_sampling
from specee_edge.data.prompts import bench_prompts
from specee_edge.engine import AUTO, GREEDY, Engine, EngineConfig, TokenRecord
from specee_edge.engine.guard import NO_GUARD, ExitGuard
from specee_edge.engine.sampling import SamplingParams
from specee_edge.errors import SpecEEError
from specee_edge.eval import humaneval
from specee_edge.eval.report import EvalResult, LevelResult, Sample, TaskResult
from specee_edge.eval.sandbox import Limits, limits
from specee_edge.eval.score import (mean_log_likelihoods, paired_difference, paired_proportion_difference,
                                    paired_ratio)
from specee_edge.pack import EXACT_QUALITY, parse_quality, quality_name
from specee_edge.pack.task_figures import TaskFigures, store_figures
from specee_edge.runtime import Context
from specee_edge.threads import default_threads

HUMANEVAL, LOGLIK = "humaneval", "loglik"
TASKS = (HUMANEVAL, LOGLIK)
PLAIN = "plain"  # exits off: plain decoding, every level's reference


@dataclass
class EvalConfig:
    model: Path
    pack: str | Path | None = AUTO
    tasks: list[str] = field(default_factory=lambda: [HUMANEVAL])
    limit: int = 0                   # problems (prompts) per task, in the data set's order; 0: all
    problems: list[int] | None = None  # --problems: these problems by number (HumanEval/N), before --limit; None: all
    quality: str = "all"             # the levels besides plain: all, or a list such as exact,0.9
    guards: list[ExitGuard] = field(default_factory=list)  # --guard: each lossy level is also run under each
    prompt_set: str = "all"          # the loglik task's prompts: a built-in set or a .jsonl file
    tokens: int = humaneval.MAX_TOKENS  # the most tokens of an answer
    threads: int = field(default_factory=default_threads)
    sampling: SamplingParams = field(default_factory=lambda: GREEDY)
    run_code: bool = False           # --confirm-run-unsafe-code: the humaneval task runs the model's programs
    store: bool = False              # --store: keep the figures beside the pack (PACK.eval.json), where info reads them
    command: str = ""


@dataclass
class Item:
    """One problem of a task: what the model is asked, and for HumanEval the problem its code is tested on."""

    id: str
    message: str
    problem: humaneval.Problem | None = None


@dataclass(frozen=True)
class Level:
    setting: str | float | None  # PLAIN, or the pack's quality (None: a pack without levels)
    name: str                    # plain, exact, or the lossy level's agreement (and its guard: 0.9+words)
    exact: bool                  # the engine emits the full model's own tokens, drafts verified
    guard: ExitGuard = NO_GUARD


@dataclass
class Answer:
    tokens: list[int]
    text: str
    decode_s: float  # the engine's decode time: the prompt (and the token drawn from it) excluded
    n_decode: int
    records: list[TokenRecord]  # exact mode's say which rows each verification batch held (batched_replay)
    turn: int = 0               # its place among its problem's answers, which ran in a shuffled order


def parse_tasks(spec: str) -> list[str]:
    tasks = [t.strip().lower() for t in spec.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise SpecEEError(f"unknown task {', '.join(unknown) or spec!r}: choose {', '.join(TASKS)} (a comma list)")
    return list(dict.fromkeys(tasks))


def parse_problems(spec: str) -> list[int]:
    """Problem numbers from a comma list of numbers and inclusive ranges, as `64-163` or `0-9,22,28`; in the
    order given, each once."""
    numbers: list[int] = []
    for part in (p.strip() for p in spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not match or (match[2] is not None and int(match[2]) < int(match[1])):
            raise SpecEEError(f"--problems {spec!r}: expected numbers and ranges such as 64-163 or 0-9,22")
        first = int(match[1])
        numbers.extend(range(first, int(match[2] or first) + 1))
    return list(dict.fromkeys(numbers))


def pick_problems(rows: Sequence, problems: list[int] | None, limit: int) -> list[tuple[int, object]]:
    """(number, row) of the rows `problems` names (all if None), then the first `limit` of them (0: all)."""
    numbers = range(len(rows)) if problems is None else problems
    if missing := [n for n in numbers if n >= len(rows)]:
        raise SpecEEError(f"--problems: there are {len(rows)} problems (0-{len(rows) - 1}), not {missing[0]}")
    picked = [(n, rows[n]) for n in numbers]
    return picked[:limit] if limit > 0 else picked


def task_items(task: str, config: EvalConfig) -> list[Item]:
    if task == HUMANEVAL:
        return [Item(p.task_id, humaneval.user_message(p), p)
                for _, p in pick_problems(humaneval.load_problems(), config.problems, config.limit)]
    prompts = pick_prompts(bench_prompts(config.prompt_set), 0)
    return [Item(f"{p.category}/{i}", p.text) for i, p in pick_problems(prompts, config.problems, config.limit)]


def levels_to_run(engine: Engine, spec: str) -> list[float | None]:
    """The levels besides plain, ascending: the pack's (bench's --quality spelling); without a pack, exact mode by
    prompt lookup alone."""
    if engine.policy is not None:
        return bench_qualities(spec, engine.policy.pack)
    lossy = [q for q in spec.split(",") if q.strip().lower() != "all" and parse_quality(q) != EXACT_QUALITY]
    if lossy:
        raise SpecEEError(f"--quality {lossy[0].strip()}: a lossy level needs a pack, and "
                          f"{engine.model.info.path.name} has none (`specee-edge calibrate` makes one)")
    return [EXACT_QUALITY]


def use_level(engine: Engine, level: str | float | None, guard: ExitGuard = NO_GUARD) -> None:
    engine.set_guard(guard)
    if level == PLAIN:
        engine.set_early_exit(False)
        return
    engine.set_early_exit(True)
    if engine.policy is not None:
        engine.set_quality(level)


def engine_level(engine: Engine, setting: str | float | None) -> Level:
    """The level a setting gives the engine, which it now uses."""
    use_level(engine, setting)
    if setting == PLAIN:
        return Level(PLAIN, PLAIN, False)
    quality = engine.policy.quality if engine.policy is not None else EXACT_QUALITY
    return Level(setting, quality_name(quality) if quality is not None else "pack", engine.exact)


def with_guarded(levels: Sequence[Level], guards: Sequence[ExitGuard]) -> list[Level]:
    """Each lossy level followed by itself under each guard."""
    return [variant for level in levels for variant in
            ([level] if level.exact or level.setting == PLAIN else
             [level, *(dataclasses.replace(level, name=f"{level.name}+{g.name}", guard=g) for g in guards if g.on)])]


def run_eval(config: EvalConfig, reporter: Reporter = Silent()) -> EvalResult:
    start = time.perf_counter()
    if HUMANEVAL in config.tasks and not config.run_code:
        raise SpecEEError("the humaneval task runs the programs the model writes on this machine: "
                          "pass --confirm-run-unsafe-code to allow it")
    if config.tokens < 1:
        raise SpecEEError(f"-n/--n-predict must be at least 1, got {config.tokens}")
    items = {task: task_items(task, config) for task in config.tasks}
    engine = Engine(config.model, pack=config.pack, config=EngineConfig(n_ctx=ENGINE_CTX, n_threads=config.threads))
    try:
        if config.store and engine.pack_path is None:
            raise SpecEEError(f"--store keeps the figures beside the pack, and {config.model.name} has none")
        settings = [PLAIN, *levels_to_run(engine, config.quality)]
        levels = with_guarded([engine_level(engine, setting) for setting in settings], config.guards)
        tasks = [run_task(engine, task, items[task], levels, config, reporter) for task in config.tasks]
        pack_path = engine.pack_path
    finally:
        engine.close()
    result = EvalResult(model=config.model.name, pack=pack_path.name if pack_path else None, threads=config.threads,
                        temperature=0.0 if config.sampling.greedy else config.sampling.temperature,
                        seed=config.sampling.seed, tokens=config.tokens, tasks=tasks,
                        seconds=time.perf_counter() - start, command=config.command)
    if config.store:
        result.stored = store_figures(pack_path, [task_figures(result, task) for task in tasks])
    return result


def task_figures(result: EvalResult, task: TaskResult) -> TaskFigures:
    return TaskFigures(task=task.task, problems=task.problems, tokens=result.tokens, threads=result.threads,
                       temperature=result.temperature, command=result.command,
                       levels={level.level: asdict(level) for level in task.levels})


def decode(engine: Engine, prompt: list[int], config: EvalConfig, index: int) -> Answer:
    records = list(engine.stream(prompt, max_tokens=config.tokens, sampling=prompt_sampling(config.sampling, index)))
    return Answer([r.id for r in records], "".join(r.text for r in records), engine.stats.decode_s,
                  engine.stats.n_decode, records)


def run_task(engine: Engine, task: str, items: Sequence[Item], levels: Sequence[Level], config: EvalConfig,
             reporter: Reporter) -> TaskResult:
    """Each problem's answers at every level in turns, in an order shuffled anew for each problem (a change in
    machine speed, or a level that leaves the machine warmer, hits them alike), each from an empty cache; then the
    scores."""
    prompts = [engine.prompt_tokens(item.message) for item in items]
    longest = max(map(len, prompts)) + config.tokens
    if longest > ENGINE_CTX:
        raise SpecEEError(f"a prompt and its answer ({longest} tokens) must fit {ENGINE_CTX}: lower -n/--n-predict")
    names = [level.name for level in levels]
    answers: dict[str, list[Answer]] = {name: [] for name in names}
    advance = reporter.task(f"{task}: decoding", len(items) * len(levels))
    order = np.random.default_rng(config.sampling.seed or 0)
    for i, prompt in enumerate(prompts):
        for turn, level in enumerate(levels[int(j)] for j in order.permutation(len(levels))):
            use_level(engine, level.setting, level.guard)
            engine.reset()
            answers[level.name].append(dataclasses.replace(decode(engine, prompt, config, i), turn=turn))
            advance(1)
    engine.reset()

    # the full model scores every answer, and finds where exact mode's depart from plain decoding's
    ctx = Context(engine.model, n_ctx=ENGINE_CTX, n_batch=ENGINE_CTX, n_threads=config.threads)
    try:
        with threadpool_limits(limits=1, user_api="blas"):
            advance = reporter.task(f"{task}: scoring", len(items))
            log_likelihoods: dict[str, list[float]] = {name: [] for name in names}
            for i, prompt in enumerate(prompts):  # each prompt decoded once for its answers at every level
                for name, score in zip(names, mean_log_likelihoods(ctx, prompt, [answers[n][i].tokens for n in names])):
                    log_likelihoods[name].append(score)
                advance(1)
            plain_tokens = [a.tokens for a in answers[PLAIN]]
            margins = {level.name: divergence_margins(ctx, prompts, plain_tokens, [a.tokens for a in answers[level.name]])
                       for level in levels if level.exact}
            # greedy: exact mode's answers against llama.cpp's own evaluation of their rounds (must all be equal)
            off_replay = {level.name: sum(batched_replay(ctx, prompt, a.records) != a.tokens
                                          for prompt, a in zip(prompts, answers[level.name]))
                          for level in levels if level.exact and config.sampling.greedy}
    finally:
        ctx.close()

    outcomes: dict[str, list] = {}
    applied: Limits | None = None
    if task == HUMANEVAL:
        applied = limits()
        outcomes = test_answers(items, answers, applied, reporter.task(f"{task}: tests", len(items) * len(names)))
    samples = [Sample(task=task, problem=item.id, level=name, reply=answers[name][i].text,
                      tokens=len(answers[name][i].tokens), decode_s=answers[name][i].decode_s,
                      log_likelihood=log_likelihoods[name][i], repetition=repetition(answers[name][i].tokens),
                      turn=answers[name][i].turn,
                      code=code_of(item, answers[name][i]) if task == HUMANEVAL else None,
                      passed=outcomes[name][i].passed if outcomes else None,
                      outcome=outcomes[name][i].reason if outcomes else None)
               for i, item in enumerate(items) for name in names]
    results = [level_result(name, samples, answers, log_likelihoods, outcomes, margins.get(name), off_replay.get(name))
               for name in names]
    return TaskResult(task=task, problems=len(items), prompt_set=config.prompt_set if task == LOGLIK else None,
                      levels=results, limits=applied.describe() if applied else None, samples=samples)


def code_of(item: Item, answer: Answer) -> str:
    return humaneval.extract_code(answer.text, item.problem.entry_point)


def test_answers(items: Sequence[Item], answers: dict[str, list[Answer]], applied: Limits,
                 advance) -> dict[str, list[humaneval.Outcome]]:
    """Each answer's code graded on its problem's tests; answers whose code is the same run once."""
    seen: dict[tuple[str, str], humaneval.Outcome] = {}
    outcomes: dict[str, list[humaneval.Outcome]] = {}
    for name, level_answers in answers.items():
        outcomes[name] = []
        for item, answer in zip(items, level_answers):
            code = code_of(item, answer)
            key = (item.id, code)
            if key not in seen:
                seen[key] = humaneval.grade(item.problem, code, applied)
            outcomes[name].append(seen[key])
            advance(1)
    return outcomes


def level_result(name: str, samples: Sequence[Sample], answers: dict[str, list[Answer]],
                 log_likelihoods: dict[str, list[float]], outcomes: dict[str, list],
                 margins: list[float] | None, off_replay: int | None) -> LevelResult:
    """One level's figures; beside plain's, each difference paired over the problems with its 95% interval."""
    mine, plain = answers[name], answers[PLAIN]
    decode_s = np.array([a.decode_s for a in mine])
    tokens = sum(a.n_decode for a in mine)
    ll, ll_plain = np.array(log_likelihoods[name]), np.array(log_likelihoods[PLAIN])
    repeated = np.array([s.repetition for s in samples if s.level == name])
    result = LevelResult(
        level=name, answers=len(mine), tok_s=tokens / decode_s.sum() if decode_s.sum() else 0.0,
        seconds_per_answer=float(decode_s.mean()), log_likelihood=float(ll.mean()),
        repetition=float(repeated.mean()), looping=int((repeated >= LOOP_SHARE).sum()),
        identical=float(np.mean([a.tokens == p.tokens for a, p in zip(mine, plain)])))
    if outcomes:
        passed = np.array([o.passed for o in outcomes[name]])
        result.pass_at_1 = float(passed.mean())
    if name == PLAIN:
        return result
    result.time_ratio, result.time_ratio_interval = paired_ratio(decode_s, [a.decode_s for a in plain])
    result.log_likelihood_gap, result.log_likelihood_gap_interval = paired_difference(ll, ll_plain)
    if outcomes:
        plain_passed = np.array([o.passed for o in outcomes[PLAIN]])
        result.pass_at_1_diff, result.pass_at_1_diff_interval = paired_proportion_difference(passed, plain_passed)
        result.only_level_passed = int((passed & ~plain_passed).sum())
        result.only_plain_passed = int((~passed & plain_passed).sum())
    if margins is not None:
        result.exact = True
        result.divergences = len(margins)
        result.near_ties = sum(m < NEAR_TIE for m in margins)
        result.largest_divergence_margin = max(margins, default=None)
        result.off_replay = off_replay
        # greedy: unchanged when every answer is llama.cpp's own evaluation of its rounds; sampled: the near-tie rule
        result.unchanged = off_replay == 0 if off_replay is not None else result.divergences == result.near_ties
    return result
