"""`specee-edge eval`: task figures of every quality level against plain decoding, paired on the same problems."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from specee_edge.cli.app import app, console, fail
from specee_edge.cli.bench import progress_bars
from specee_edge.cli.chat import HfFile, HfRepo, ModelArg, PackOpt, Temp, Threads, pick_model
from specee_edge.errors import SpecEEError


OUTPUT_OPTIONS = ("--json", "--log-samples")  # where a run writes its own files: not part of how it measured


def measuring_command(argv: list[str]) -> str:
    """The command line that measured the figures, as `info` shows it beside them: without the output options,
    whose paths are the measuring machine's own."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in OUTPUT_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{option}=" for option in OUTPUT_OPTIONS)):
            kept.append(arg)
    return " ".join(["specee-edge", *kept])


@app.command("eval")
def eval_command(
    model: ModelArg = None,
    hf_repo: HfRepo = None,
    hf_file: HfFile = None,
    pack: PackOpt = None,
    tasks: Annotated[str, typer.Option("--tasks", help="humaneval (runs the model's code: needs --confirm-run-unsafe-code), loglik (the full model's log-likelihood of answers to --prompts), or both: humaneval,loglik")] = "humaneval",
    limit: Annotated[int, typer.Option("--limit", help="problems (prompts) per task, from the first (0: all)")] = 0,
    problems: Annotated[str | None, typer.Option("--problems", help="these problems by number, as 64-163 or 0-9,22 (HumanEval/N; a prompt set's in --limit's order), then --limit of them")] = None,
    quality: Annotated[str, typer.Option("--quality", help="the pack's levels to compare with plain decoding: all, or a list such as exact,0.95")] = "all",
    guard: Annotated[str, typer.Option("--guard", help="also run each lossy level under each of these exit guards (a comma list): words (no exit for a token after one ending inside a word), marginM (an exit whose top two candidates' logits differ by less than M is undone), or both joined by +: words,margin2,words+margin2")] = "none",
    prompts: Annotated[str, typer.Option("--prompts", help="the loglik task's prompts: a bench set (chat, code, math, summarize, edit, Spec-Bench's, spec-bench, all) or a .jsonl file")] = "all",
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="the most tokens of an answer")] = 512,
    threads: Threads = None,
    temp: Temp = 0.0,
    seed: Annotated[int, typer.Option("-s", "--seed", help="with --temp above 0: problem i draws from seed + i at every level")] = 0,
    confirm_run_unsafe_code: Annotated[bool, typer.Option("--confirm-run-unsafe-code", help="allow the humaneval task to run the programs the model writes, each in a child process with the limits the table names")] = False,
    store: Annotated[bool, typer.Option("--store", help="keep the figures beside the pack (PACK.eval.json, with the pack's sha256), where `specee-edge info PACK` shows them")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the figures as JSON here")] = None,
    log_samples: Annotated[Path | None, typer.Option("--log-samples", help="write every answer here, one JSON line each (reply, code, outcome, log-likelihood, time)")] = None,
) -> None:
    """Every quality level against plain decoding on the same problems, in one engine: pass@1 (HumanEval), the full
    model's log-likelihood of the answers, repetition, and time per whole answer, each difference with its 95%
    interval."""
    from specee_edge.engine import AUTO, GREEDY, SamplingParams
    from specee_edge.engine.guard import parse_guard
    from specee_edge.eval.run import EvalConfig, parse_problems, parse_tasks, run_eval
    from specee_edge.stores import resolve_model
    from specee_edge.threads import default_threads

    try:
        if temp < 0:
            raise SpecEEError(f"--temp must be 0 (greedy) or more, got {temp:g}")
        config = EvalConfig(
            model=resolve_model(pick_model(model, None, hf_repo, hf_file)).path, pack=pack or AUTO,
            tasks=parse_tasks(tasks), limit=limit,
            problems=parse_problems(problems) if problems is not None else None, quality=quality, guards=[parse_guard(g) for g in guard.split(',')], prompt_set=prompts, tokens=n_predict, threads=threads or default_threads(),
            sampling=GREEDY if temp == 0 else SamplingParams(temperature=temp, seed=seed),
            run_code=confirm_run_unsafe_code, store=store, command=measuring_command(sys.argv[1:]))
        with progress_bars(20) as progress:
            result = run_eval(config, progress)
    except SpecEEError as e:
        raise fail(e) from None
    console.print(result.render())
    if result.stored:
        console.print(f"stored the figures in {result.stored}")
    if json_path:
        result.write_json(json_path)
        console.print(f"wrote {json_path}")
    if log_samples:
        result.write_samples(log_samples)
        console.print(f"wrote {log_samples}")
