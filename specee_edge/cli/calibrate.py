"""`specee-edge calibrate`: train a pack for a model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from specee_edge.cli.app import app, console, err_console, fail
from specee_edge.cli.chat import (RPC_TIMEOUT_S, GpuLayers, HfFile, HfRepo, OffloadFirst, OverrideTensor, Rpc,
                                  RpcTimeout, TensorSplit, pick_model, set_placement)
from specee_edge.errors import SpecEEError


@app.command()
def calibrate(
    model: Annotated[str | None, typer.Argument(help="model GGUF (or a registry name from `specee-edge pull --list`)",
                                                show_default=False)] = None,
    hf_repo: HfRepo = None,
    hf_file: HfFile = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="pack to write [default: MODEL.specee.gguf beside the model; for a model in another tool's store (Hugging Face, Ollama, LM Studio, llama.cpp) or a read-only folder, the cache, by the model's fingerprint]")] = None,
    tokens: Annotated[int | None, typer.Option("--tokens", help="answer tokens to collect [default: 65000]")] = None,
    minutes: Annotated[float | None, typer.Option("--minutes", help="size the run (answer tokens and the later stages) to take about this many minutes on this machine, and say what the smaller run gives up")] = None,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="JSONL prompts ({\"prompt\": ...}) instead of the built-in set")] = None,
    k: Annotated[int, typer.Option("--k", help="draft candidates per token")] = 4,
    threads: Annotated[int | None, typer.Option("-t", "--threads", help="CPU threads")] = None,
    n_gpu_layers: GpuLayers = None,
    rpc_workers: Rpc = None,
    rpc_timeout: RpcTimeout = RPC_TIMEOUT_S,
    tensor_split: TensorSplit = None,
    offload_first: OffloadFirst = False,
    override_tensor: OverrideTensor = None,
    seed: Annotated[int, typer.Option("-s", "--seed", help="seed of the splits and the MLPs")] = 0,
    levels: Annotated[str, typer.Option("--levels", help="quality levels: the agreements with the full model to aim for, comma-separated (each ships under the agreement the low end of its held-out 95% interval reaches)")] = "0.9,0.95,0.98,0.99,0.995",
    quality: Annotated[float | None, typer.Option("--quality", help="make a lossy level the pack's default (one of --levels; it keeps the name it ships under) [default: exact mode]")] = None,
    replay_tokens: Annotated[int | None, typer.Option("--replay-tokens", help="steps the engine replays to check each level (on the prompts its exits were chosen on) [default: 2000]")] = None,
    heldout_tokens: Annotated[int | None, typer.Option("--heldout-tokens", help="steps behind each level's stored agreement (prompts nothing was chosen on) [default: 4000]")] = None,
    identical_tokens: Annotated[int | None, typer.Option("--identical-tokens", help="tokens of each held-out greedy answer compared with the full model's [default: 64]")] = None,
    draft_vocab: Annotated[int, typer.Option("--draft-vocab", help="tokens the draft head scores")] = 4096,
    draft_ridge: Annotated[float, typer.Option("--draft-ridge", help="the draft head's ridge penalty per 1,000 rows")] = 0.1,
    lookup: Annotated[int, typer.Option("--lookup", help="prompt lookup: the longest n-gram matched in the context (0: off)")] = 4,
    max_answer: Annotated[int, typer.Option("--max-answer", help="tokens per answer")] = 256,
    work_dir: Annotated[Path | None, typer.Option("--work-dir", help="keeps each stage's results, so a rerun resumes")] = None,
    exact_only: Annotated[bool, typer.Option("--exact-only", help="keep an existing pack's draft head, predictors and lossy levels; choose only its exact level (the pack: --pack, else MODEL's) and make it the default")] = False,
    pack: Annotated[Path | None, typer.Option("--pack", help="with --exact-only: the pack to start from [default: MODEL.specee.gguf beside the model, else the shipped one]")] = None,
) -> None:
    """Calibrate a pack for MODEL: its own answers, a draft head, per-layer predictors, and per quality level each
    layer's exit (off, verified or head-free) and threshold, priced by what each part costs on this machine."""
    from specee_edge.calibrate import CalibrateConfig
    from specee_edge.calibrate import calibrate as run_calibration
    from specee_edge.calibrate.budget import DEFAULT_SIZE
    from specee_edge.stores import resolve_model
    from specee_edge.stores import pack_output
    from specee_edge.threads import default_threads

    try:
        sizes = {"--tokens": tokens, "--replay-tokens": replay_tokens, "--heldout-tokens": heldout_tokens,
                 "--identical-tokens": identical_tokens}
        if minutes is not None and (minutes <= 0 or any(v is not None for v in sizes.values())):
            given = ", ".join(name for name, v in sizes.items() if v is not None)
            raise SpecEEError(f"--minutes sizes the run itself: leave out {given}" if given else "--minutes must be above 0")
        tokens = DEFAULT_SIZE.tokens if tokens is None else tokens
        replay_tokens = DEFAULT_SIZE.replay_tokens if replay_tokens is None else replay_tokens
        heldout_tokens = DEFAULT_SIZE.heldout_tokens if heldout_tokens is None else heldout_tokens
        identical_tokens = DEFAULT_SIZE.identical_tokens if identical_tokens is None else identical_tokens
        set_placement(rpc_workers, n_gpu_layers, tensor_split, rpc_timeout, offload_first, override_tensor)
        if model is None and hf_repo is None:
            raise SpecEEError("give the model to calibrate: a GGUF, a registry name, or -hf USER/REPO[:QUANT]")
        model_path = resolve_model(pick_model(model, None, hf_repo, hf_file)).path
        try:
            level_list = tuple(sorted({float(q) for q in levels.split(",")}))
        except ValueError:
            raise SpecEEError(f"--levels takes comma-separated numbers, got {levels!r}") from None
        if not all(0.5 < q < 1.0 for q in level_list) or (quality is not None and quality not in level_list):
            raise SpecEEError("every --levels value must be in (0.5, 1), and --quality one of them")
        if (not 1 <= k <= 8 or tokens < 1 or draft_vocab < k or min(replay_tokens, heldout_tokens, identical_tokens) < 1
                or not 0 <= lookup <= 8 or draft_ridge < 0):
            raise SpecEEError("need 1 <= --k <= 8, --tokens >= 1, --replay-tokens, --heldout-tokens and --identical-tokens"
                              " >= 1, --draft-vocab >= --k, 0 <= --lookup <= 8 and --draft-ridge >= 0")
        output = output or pack_output(model_path)
        if exact_only:
            _exact_only(model_path, pack, output, prompts=prompts, seed=seed, threads=threads or default_threads())
            return
        config = CalibrateConfig(
            model=model_path, output=output, workdir=work_dir, tokens=tokens, prompts=prompts, k=k,
            threads=threads or default_threads(), seed=seed, max_answer=max_answer, draft_vocab=draft_vocab,
            levels=level_list, quality=quality, replay_tokens=replay_tokens, heldout_tokens=heldout_tokens,
            identical_tokens=identical_tokens, lookup=lookup, draft_ridge=draft_ridge, minutes=minutes,
            command=" ".join(["specee-edge", *sys.argv[1:]]),
        )
        report = run_calibration(config, err_console)
    except SpecEEError as e:
        raise fail(e) from None
    console.print(report.render())
    console.print(f"wrote {output}")


def _exact_only(model_path: Path, pack: Path | None, output: Path, *, prompts: Path | None, seed: int, threads: int) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specee_edge.calibrate.exact import add_exact_level, n_trials
    from specee_edge.engine.exit import find_pack
    from specee_edge.pack import read_pack

    source = pack or find_pack(model_path)
    if source is None:
        raise SpecEEError(f"no pack for {model_path.name} to add exact mode to: calibrate it first, or pass --pack")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console) as progress:
        task = progress.add_task("exact mode (runs)", total=n_trials(read_pack(source)))
        report = add_exact_level(model_path, source, output, prompts_path=prompts, seed=seed, threads=threads,
                                 advance=lambda: progress.advance(task))
    console.print(report.render())
    console.print(f"wrote {output}")
