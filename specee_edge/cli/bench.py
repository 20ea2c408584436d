"""`specee-edge bench`: speed and quality against vanilla llama.cpp, side by side, with the oracle bound."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specee_edge.cli.app import app, console, err_console, fail
from specee_edge.cli.chat import (RPC_TIMEOUT_S, FlashAttn, FlashAttnSetting, GpuLayers, GrammarFile, GrammarOpt,
                                  HfFile, HfRepo, JsonSchema, ModelArg, OffloadFirst, OverrideTensor, PackOpt, Rpc,
                                  RpcTimeout, TensorSplit, pick_model, reply_grammar, set_placement)
from specee_edge.errors import SpecEEError

REFRESH_S = 0.2


class ManualProgress:
    """rich progress without its refresh thread (it steals the GIL from the timed loops: 10x slower decoding)."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self._last = 0.0

    def task(self, description: str, total: float) -> Callable[[float], None]:
        task = self.progress.add_task(description, total=total)

        def advance(n: float) -> None:
            self.progress.advance(task, n)
            now = time.perf_counter()
            if now - self._last >= REFRESH_S:
                self._last = now
                self.progress.refresh()

        return advance


@contextmanager
def progress_bars(width: int = 9) -> Iterator[ManualProgress]:
    """Progress bars on stderr, each named in `width` characters, refreshed by their advances; gone once done.
    Ctrl+C meanwhile ends the command (status 130) with no results."""
    columns = (TextColumn(f"{{task.description:>{width}}}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=err_console, transient=True, auto_refresh=False) as progress:
            yield ManualProgress(progress)
    except KeyboardInterrupt:
        err_console.print("interrupted: no results")
        raise typer.Exit(130) from None


def pack_note(model: Path, threads: int) -> str:
    """One line: what a pack would add to a model that has none, and how long calibrate would take here."""
    from specee_edge.calibrate.forecast import forecast
    from specee_edge.calibrate.progress import clock

    with err_console.status("estimating what calibrate would take here ..."):
        f = forecast(model, threads)
    return (f"no pack: a pack would add exit drafts (exact mode drafting where the context offers nothing to copy) and "
            f"lossy quality levels; `specee-edge calibrate {model}` would take {clock(f.fewest_s)} to {clock(f.most_s)} "
            f"on this machine (estimated, not run)")


def given_schema(json_schema: str | None):
    """-j's schema (its JSON, or @FILE's), which whole answers are validated against; reply_grammar has read it and
    made it a grammar already, so it is there and is JSON."""
    if json_schema is None:
        return None
    return json.loads(Path(json_schema[1:]).expanduser().read_text(encoding="utf-8")
                      if json_schema.startswith("@") else json_schema)


@app.command()
def bench(
    model: ModelArg = None,
    hf_repo: HfRepo = None,
    hf_file: HfFile = None,
    pack: PackOpt = None,
    prompts: Annotated[str, typer.Option("--prompts", help=(
        "chat, code, math, summarize, edit; Spec-Bench's multi-turn, translation, summarization, qa, math-reasoning, "
        "rag (spec-bench: those six); all (those); extract (facts to copy into JSON: every lane runs under its "
        "schema's grammar unless --grammar, --grammar-file or -j gives one); or a .jsonl file"))] = "all",
    num_prompts: Annotated[int, typer.Option("-p", "--num-prompts", help="prompts to run, in turns from each category (0: all)")] = 8,
    tokens: Annotated[int, typer.Option("-n", "--tokens", help="tokens generated per prompt")] = 96,
    kv_mode: Annotated[str | None, typer.Option("--kv-mode", help="mask, fill, full, or all (default: the engine's)")] = None,
    threads: Annotated[int | None, typer.Option("-t", "--threads", help="CPU threads (default: one per physical core)")] = None,
    flash_attn: FlashAttn = FlashAttnSetting.auto,
    n_gpu_layers: GpuLayers = None,
    rpc_workers: Rpc = None,
    rpc_timeout: RpcTimeout = RPC_TIMEOUT_S,
    tensor_split: TensorSplit = None,
    offload_first: OffloadFirst = False,
    override_tensor: OverrideTensor = None,
    quality: Annotated[str | None, typer.Option("--quality", show_default=False, help=(
        "the pack's quality levels to run, each its own SpecEE lane: exact (the full model's own answers, drafts "
        "verified in batches) or a lossy level's agreement with the full model; all, or a list such as exact,0.95 "
        "(default: the pack's default level)"))] = None,
    threshold: Annotated[float | None, typer.Option("--threshold", help="one exit threshold for every layer (default: the level's)")] = None,
    ppl_tokens: Annotated[int, typer.Option("--ppl-tokens", help="held-out tokens for perplexity (0: all)")] = 0,
    python_policy: Annotated[bool, typer.Option("--python-policy", help="also run each KV mode with the Python exit policy (MODE/python)")] = False,
    sampled: Annotated[bool, typer.Option("--sampled/--greedy-only", help="also decode with chat's default sampling (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), seeded per prompt")] = True,
    peer: Annotated[bool, typer.Option("--peer/--no-peer", help="a lane of llama-cpp-python's own speculative decoding with prompt lookup (num_pred_tokens=2)")] = True,
    lookup_lane: Annotated[bool, typer.Option("--lookup-lane/--no-lookup-lane", help="a lane of exact mode without the pack: prompt-lookup drafts only, what any GGUF gets")] = True,
    llama_server: Annotated[bool, typer.Option("--llama-server/--no-llama-server", help=(
        "lanes of llama.cpp's own llama-server (plain: the baseline of every speed-up; and its speculation), built "
        "from the runtime's vendored llama.cpp on first use (cached; 30-40 minutes, only where run from a terminal)"))] = True,
    llama_server_path: Annotated[Path | None, typer.Option("--llama-server-bin", help="run this llama-server program "
                                                           "instead of the cached build (or set SPECEE_LLAMA_SERVER)")] = None,
    spec_type: Annotated[str | None, typer.Option("--spec-type", show_default=False, help=(
        "llama-server's self-speculative types, a lane each: a comma list of ngram-mod, ngram-simple, ngram-map-k, "
        "ngram-map-k4v, ngram-cache; all; or none (default: ngram-mod,ngram-map-k)"))] = None,
    draft_model: Annotated[Path | None, typer.Option("--draft-model", "-md", help="a small model with the same "
                                                     "vocabulary: a llama-server lane drafting with it (-md DRAFT "
                                                     "--spec-type draft-simple)")] = None,
    repeat: Annotated[bool, typer.Option("--repeat/--no-repeat", help=(
        "run llama-server plain and the bare Context twice in each pass, the second a fresh equal twin: its ratio "
        "to the first is the run's noise (a line at the top where it drifted)"))] = True,
    seed: Annotated[int, typer.Option("-s", "--seed", help="the sampled pass's seed (prompt i draws from seed + i in every lane) and the lanes' shuffled order's")] = 0,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the results as JSON here")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="write a PNG here: speedup against agreement and perplexity, the exit layers")] = None,
    grammar: GrammarOpt = None,
    grammar_file: GrammarFile = None,
    json_schema: JsonSchema = None,
) -> None:
    """Decode the same prompts with vanilla llama.cpp and SpecEE, whole answers in a shuffled order: speed, oracle bound, quality.
    With a grammar (--grammar, --grammar-file, -j; --prompts extract has its own) every lane decodes under it."""
    from specee_edge.bench import BenchConfig, plot_bench, run_bench
    from specee_edge.bench.run import NO_PACK
    from specee_edge.bench.llama_server import LlamaServerError, find_binary, has_terminal, parse_spec_types
    from specee_edge.engine import AUTO, DEFAULT_KV_MODE
    from specee_edge.threads import default_threads
    from specee_edge.stores import resolve_model
    from specee_edge.runtime import KV_MODES

    mode = kv_mode or DEFAULT_KV_MODE
    modes = [DEFAULT_KV_MODE, *(m for m in KV_MODES if m != DEFAULT_KV_MODE)] if mode == "all" else [mode]
    try:
        if mode != "all" and mode not in KV_MODES:
            raise SpecEEError(f"unknown KV mode {mode!r}: choose {', '.join(KV_MODES)} or all")
        set_placement(rpc_workers, n_gpu_layers, tensor_split, rpc_timeout, offload_first, override_tensor)
        spec_types = parse_spec_types(spec_type)
        constraint = reply_grammar(grammar, grammar_file, json_schema)
        if draft_model is not None and not draft_model.is_file():
            raise SpecEEError(f"no draft model at {draft_model}")
        server, dropped = None, []
        if llama_server:
            try:
                # before the progress bars: a build shows its own; without a terminal, none starts
                server = find_binary(llama_server_path, build=has_terminal())
            except LlamaServerError as e:
                dropped.append(f"llama-server: {e}")
                err_console.print(f"[yellow]llama-server lanes dropped:[/] {e}", highlight=False)
        config = BenchConfig(
            model=resolve_model(pick_model(model, None, hf_repo, hf_file)).path, pack=pack or AUTO, prompt_set=prompts, num_prompts=num_prompts,
            tokens=tokens, kv_modes=modes, threads=threads or default_threads(), quality=quality, threshold=threshold,
            ppl_tokens=ppl_tokens, python_policy=python_policy, sampled=sampled, peer=peer, lookup_lane=lookup_lane, seed=seed,
            flash_attn=flash_attn.value,
            llama_server=server, llama_server_asked=llama_server, spec_types=spec_types, draft_model=draft_model, repeat=repeat, dropped=dropped, command=" ".join(["specee-edge", *sys.argv[1:]]),
            grammar=constraint, schema=given_schema(json_schema),
        )
        with progress_bars() as progress:
            result = run_bench(config, progress)
    except SpecEEError as e:
        raise fail(e) from None
    except KeyboardInterrupt:  # before the bars (a llama-server build)
        err_console.print("interrupted: no results")
        raise typer.Exit(130) from None
    console.print(result.render())
    if result.pack == NO_PACK:
        console.print(pack_note(config.model, config.threads), highlight=False)
    if json_path:
        result.write_json(json_path)
        console.print(f"wrote {json_path}")
    if plot:
        plot_bench(result, plot)
        console.print(f"wrote {plot}")
