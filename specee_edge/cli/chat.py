"""`specee-edge chat` (the REPL) and `specee-edge generate` (one shot); flags in llama.cpp's spelling."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from specee_edge.cli.app import app, console, err_console, fail
from specee_edge.errors import ModelLoadError, SpecEEError
from specee_edge.pack.format import quality_name

if TYPE_CHECKING:
    from specee_edge.engine import Engine

# The options both commands take, declared once.
ModelArg = Annotated[str | None, typer.Argument(metavar="MODEL", show_default=False, help=(
    "model: a GGUF, a registry name, or a name `specee-edge models` lists (default: the default model)"))]
ModelOpt = Annotated[str | None, typer.Option("-m", "--model", show_default=False, help="the model, instead of the argument")]
HfRepo = Annotated[str | None, typer.Option("-hf", "-hfr", "--hf-repo", metavar="USER/REPO[:QUANT]", show_default=False, help=(
    "the model from a Hugging Face repository, as llama.cpp's -hf: the quant the tag names, else Q4_K_M, else the"
    " first GGUF; into the Hugging Face cache (HF_TOKEN, HF_HUB_OFFLINE apply)"))]
HfFile = Annotated[str | None, typer.Option("-hff", "--hf-file", show_default=False,
                                            help="the file of the -hf repository to load, instead of picking a quant")]
PackOpt = Annotated[str | None, typer.Option("--pack", show_default=False,
                                             help="pack GGUF (default: MODEL.specee.gguf beside the model, else a shipped one)")]
NPredict = Annotated[int, typer.Option("-n", "--n-predict", help="tokens to generate at most (-1: until the context is full)")]
CtxSize = Annotated[int, typer.Option("-c", "--ctx-size", help="context size in tokens (0: the model's)")]
GpuLayers = Annotated[str | None, typer.Option("-ngl", "--n-gpu-layers", show_default=False,
                                                help="layers to offload to the GPU or the --rpc workers: a number, or all"
                                                     " (auto and -1 mean all too: unlike llama.cpp, nothing is fitted"
                                                     " to the free memory; default: all with --rpc, else 0)")]
OffloadFirst = Annotated[bool, typer.Option("--offload-first", help=(
    "SpecEE's placement: -ngl offloads the FIRST layers (and the output layer) instead of llama.cpp's last ones, so"
    " that a token leaving early skips the layers left on the CPU; same -ngl, same device memory"))]
OverrideTensor = Annotated[list[str] | None, typer.Option("-ot", "--override-tensor", show_default=False, help=(
    "weights whose name matches PATTERN go to BUFFER_TYPE (CPU, CUDA0, ...), as llama.cpp's -ot: PATTERN=TYPE,"
    " comma-separated, the flag repeatable; after -ngl placed the layers (their KV cache stays where -ngl put it)"))]
Rpc = Annotated[str | None, typer.Option("--rpc", show_default=False, help=(
    "comma-separated RPC workers (HOST:PORT, each running `specee-edge rpc-worker`): the offloaded layers go to them,"
    " as llama.cpp's --rpc; the first layers stay on this machine. RPC has no authentication: trusted networks only"))]
RPC_TIMEOUT_S = 60.0  # runtime.rpc.DEFAULT_TIMEOUT_S (not imported here: it loads the runtime)
RpcTimeout = Annotated[float, typer.Option("--rpc-timeout", help=(
    "seconds one send or receive to an RPC worker may wait before the worker counts as lost (a power loss or a cut"
    " cable closes no connection); 0: wait forever. Raise it where a worker's share of a long prompt takes longer"))]
TensorSplit = Annotated[str | None, typer.Option("-ts", "--tensor-split", show_default=False, help=(
    "the offloaded layers' shares per device, comma-separated, in llama.cpp's order (the --rpc workers first),"
    " e.g. 3,1 (default: by each device's free memory)"))]
Threads = Annotated[int | None, typer.Option("-t", "--threads", show_default=False, help="CPU threads (default: cores, at most 8)")]
Seed = Annotated[int, typer.Option("-s", "--seed", help="sampling seed (-1: random)")]
Temp = Annotated[float, typer.Option("--temp", help="temperature (0: greedy)")]
TopK = Annotated[int, typer.Option("--top-k", help="top-k sampling (0: off)")]
TopP = Annotated[float, typer.Option("--top-p", help="top-p sampling (1: off)")]
MinP = Annotated[float, typer.Option("--min-p", help="min-p sampling (0: off)")]
RepeatPenalty = Annotated[float, typer.Option("--repeat-penalty", help="penalty on the last 64 tokens (1: off)")]
SystemPrompt = Annotated[str | None, typer.Option("-sys", "--system-prompt", show_default=False, help="system prompt")]
ChatTemplate = Annotated[str | None, typer.Option("--chat-template", show_default=False,
                                                  help="chatml, llama3, mistral, gemma, a Jinja file or a template (default: the model's)")]
NoEarlyExit = Annotated[bool, typer.Option("--no-early-exit", help="plain decoding: every layer, no drafts (the pack stays loaded)")]
Speculation = Annotated[str, typer.Option("--speculation", help=(
    "exact mode: auto (each round as measured cheapest on this machine) or always (draft at every chance, as"
    " llama.cpp's speculative decoding does; the same rounds on every run)"))]
Quality = Annotated[str | None, typer.Option("--quality", show_default=False, help=(
    "the pack's quality level: exact (early exits draft tokens that the full model verifies in batches, so the "
    "replies are the model's own), or a lossy level such as 0.95: at each step, the token it emits is the one the full "
    "model would pick on the same text, in at least that share of the steps (the low end of a 95% interval measured on "
    "prompts calibration chose nothing on; default: the pack's default level; `specee-edge info PACK` lists each level's agreement and the share "
    "of whole greedy answers that stay identical). One wrong token changes the rest of a reply: a level below "
    "0.98 can keep few answers identical, and says so. A lossy head-free exit samples among its k candidates only"))]
Threshold = Annotated[float | None, typer.Option("--threshold", show_default=False,
                                                 help="exit threshold for every layer (default: the quality level's per-layer ones)")]
ColorExits = Annotated[bool, typer.Option("--color-exits", help="colour each token by the layer it left at")]
GrammarOpt = Annotated[str | None, typer.Option("--grammar", show_default=False, help=(
    "a GBNF grammar (llama.cpp's) every reply follows, start rule root"))]
GrammarFile = Annotated[Path | None, typer.Option("--grammar-file", show_default=False, help="read the GBNF grammar from a file")]
JsonSchema = Annotated[str | None, typer.Option("-j", "--json-schema", show_default=False, help=(
    "a JSON schema every reply fits (its JSON, or @FILE): made a grammar; a keyword the grammar cannot enforce is refused"))]
Verbose = Annotated[bool, typer.Option("--verbose", help="the detailed stats after each reply")]


class FlashAttnSetting(str, Enum):
    on = "on"
    off = "off"
    auto = "auto"


FlashAttn = Annotated[FlashAttnSetting, typer.Option("-fa", "--flash-attn", help=(
    "flash attention, as llama.cpp's flag: auto turns it on wherever the device runs it (on the CPU a step costs"
    " about 10 % less)"))]


class KvMode(str, Enum):
    mask = "mask"
    fill = "fill"
    full = "full"


KvModeOpt = Annotated[KvMode | None, typer.Option("--kv-mode", show_default=False,
                      help="K/V of the layers an exited token skipped (default: fill, or mask where fill is unsupported)")]


@dataclass
class EngineOptions:
    """The command line's engine settings, before anything is loaded."""

    model: str | None
    pack: str | None
    n_ctx: int
    n_gpu_layers: str
    threads: int | None
    kv_mode: str | None
    quality: str | None
    threshold: float | None
    early_exit: bool
    rpc: str | None = None
    tensor_split: str | None = None
    rpc_timeout: float = RPC_TIMEOUT_S
    offload_first: bool = False
    override_tensor: list[str] | None = None
    speculation: str = "auto"
    flash_attn: str = "auto"


def load_engine(opts: EngineOptions, *, strict_pack: bool) -> tuple[Engine, str, str | None]:
    """Resolve the model and load it with its pack.

    A pack the engine cannot use: with strict_pack an error, else a notice and early exit off. A quality
    level the pack lacks is always an error: the user asked for it.
    Returns (engine, model label, notice): notice is the one line to print, or None.
    """
    from specee_edge.pack import parse_quality
    from specee_edge.engine import AUTO, Engine, EngineConfig
    from specee_edge.pack import PackLevelError
    from specee_edge.threads import default_threads
    from specee_edge.stores import resolve_model

    model = resolve_model(opts.model)
    model_path, label = model.path, model.name
    if opts.threshold is not None and not 0.0 <= opts.threshold <= 1.0:
        raise SpecEEError(f"--threshold is a probability: 0..1, got {opts.threshold:g}")
    set_placement(opts.rpc, opts.n_gpu_layers, opts.tensor_split, opts.rpc_timeout, opts.offload_first,
                  opts.override_tensor)
    config = EngineConfig(n_ctx=opts.n_ctx, n_threads=opts.threads or default_threads(), kv_mode=opts.kv_mode,
                          quality=parse_quality(opts.quality), threshold=opts.threshold, early_exit=opts.early_exit,
                          speculation=opts.speculation, flash_attn=opts.flash_attn)
    pack = opts.pack if opts.pack is not None else AUTO
    notice = None
    try:
        engine = Engine(model_path, pack=pack, config=config)
    except SpecEEError as e:
        if strict_pack or isinstance(e, (ModelLoadError, PackLevelError)):
            raise
        engine = Engine(model_path, pack=None, config=config)  # fails again if the model, not the pack, is the problem
        notice = f"{e}; early exit off (exact mode with prompt-lookup drafts only)"
    if engine.policy is None and notice is None and engine.exact:
        notice = (f"no pack for {label}: exact mode with prompt-lookup drafts only; `specee-edge calibrate {label}`"
                  " adds exit drafts and lossy quality levels")
    return engine, label, notice


def set_placement(rpc_workers: str | None, n_gpu_layers: str | None, tensor_split: str | None,
                  rpc_timeout: float = RPC_TIMEOUT_S, offload_first: bool = False,
                  override_tensor: list[str] | None = None) -> None:
    """-ngl, -ts, --offload-first, -ot, --rpc and --rpc-timeout: where every model this command loads puts its
    layers (the workers are connected now, so that one that is not there is an error before anything loads)."""
    from specee_edge.runtime import placement, rpc

    endpoints = rpc.parse_endpoints(rpc_workers) if rpc_workers is not None else ()
    layers = placement.parse_gpu_layers(n_gpu_layers if n_gpu_layers is not None else "all" if endpoints else "0")
    chosen = placement.Placement(layers, placement.parse_tensor_split(tensor_split), offload_first,
                                 placement.parse_tensor_overrides(override_tensor))
    rpc.connect(endpoints, rpc_timeout)
    placement.set_default(chosen)


def chat_template_text(value: str | None) -> str | None:
    """--chat-template: a known name, a file of Jinja, or the template itself."""
    from specee_edge.chat_templates import template_text

    return None if value is None else template_text(value)


def reply_grammar(grammar: str | None, grammar_file: Path | None, json_schema: str | None):
    """--grammar, --grammar-file or -j/--json-schema (at most one of them), as a Grammar; None without them."""
    from specee_edge.grammar import grammar_from_schema, grammar_from_text

    given = [name for name, value in (("--grammar", grammar), ("--grammar-file", grammar_file),
                                      ("-j/--json-schema", json_schema)) if value is not None]
    if len(given) > 1:
        raise SpecEEError(f"{' and '.join(given)}: give one grammar")
    if grammar is not None:
        return grammar_from_text(grammar, "--grammar")
    if grammar_file is not None:
        return grammar_from_text(_read_text(grammar_file, "grammar file"), f"--grammar-file {grammar_file}")
    if json_schema is not None:
        if json_schema.startswith("@"):
            return grammar_from_schema(_read_text(Path(json_schema[1:]), "schema file"), f"--json-schema {json_schema}")
        return grammar_from_schema(json_schema, "--json-schema")
    return None


def _read_text(path: Path, what: str) -> str:
    try:
        return path.expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecEEError(f"cannot read the {what} {path}: {e.strerror if isinstance(e, OSError) else e}") from None


def sampling_params(temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float, seed: int):
    from specee_edge.engine import SamplingParams

    return SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                          seed=None if seed < 0 else seed)


def pick_model(model: str | None, model_opt: str | None, hf_repo: str | None = None,
               hf_file: str | None = None) -> str | None:
    """The model the command line names: the argument, -m, or -hf (downloaded here, then named as `specee-edge
    models` shows it: hf:USER/REPO/FILE) - at most one of them. `specee_edge.stores.resolve_model` finds its file."""
    if model is not None and model_opt is not None and model != model_opt:
        raise SpecEEError(f"two models given: {model} and -m {model_opt}")
    named = model_opt or model
    if hf_repo is None:
        if hf_file is not None:
            raise SpecEEError("--hf-file names a file of the -hf repository: give -hf USER/REPO too")
        return named
    if named is not None:
        raise SpecEEError(f"two models given: {named} and -hf {hf_repo}")
    from specee_edge.hf import hf_model

    return hf_model(hf_repo, hf_file).name


@app.command()
def chat(
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    hf_repo: HfRepo = None,
    hf_file: HfFile = None,
    pack: PackOpt = None,
    n_predict: NPredict = 512,
    ctx_size: CtxSize = 4096,
    n_gpu_layers: GpuLayers = None,
    rpc_workers: Rpc = None,
    rpc_timeout: RpcTimeout = RPC_TIMEOUT_S,
    tensor_split: TensorSplit = None,
    offload_first: OffloadFirst = False,
    override_tensor: OverrideTensor = None,
    threads: Threads = None,
    seed: Seed = -1,
    temp: Temp = 0.8,
    top_k: TopK = 40,
    top_p: TopP = 0.95,
    min_p: MinP = 0.05,
    repeat_penalty: RepeatPenalty = 1.0,
    system_prompt: SystemPrompt = None,
    chat_template: ChatTemplate = None,
    no_early_exit: NoEarlyExit = False,
    speculation: Speculation = "auto",
    flash_attn: FlashAttn = FlashAttnSetting.auto,
    kv_mode: KvModeOpt = None,
    quality: Quality = None,
    threshold: Threshold = None,
    color_exits: ColorExits = False,
    verbose: Verbose = False,
    grammar: GrammarOpt = None,
    grammar_file: GrammarFile = None,
    json_schema: JsonSchema = None,
) -> None:
    """Chat with a model in the terminal, with early exit and its statistics (/help inside)."""
    from specee_edge.cli.render import depth_legend
    from specee_edge.cli.repl import Repl, ReplSettings
    from specee_edge.pull import models_dir

    try:
        opts = EngineOptions(pick_model(model, model_opt, hf_repo, hf_file), pack, ctx_size, n_gpu_layers, threads, kv_mode.value if kv_mode else None,
                             quality, threshold, not no_early_exit, rpc_workers, tensor_split, rpc_timeout,
                             offload_first, override_tensor, speculation=speculation, flash_attn=flash_attn.value)
        settings = ReplSettings(sampling_params(temp, top_k, top_p, min_p, repeat_penalty, seed), n_predict,
                                system_prompt, chat_template_text(chat_template), verbose, color_exits,
                                reply_grammar(grammar, grammar_file, json_schema))
        engine, label, notice = load_engine(opts, strict_pack=False)
    except SpecEEError as e:
        raise fail(e) from None
    _banner(engine, notice)
    if color_exits and engine.policy is not None:
        console.print(depth_legend(engine.n_layer))
    try:
        Repl(engine, settings, console, err_console, history_file=models_dir().parent / "chat_history").run()
    finally:
        engine.close()


def _banner(engine: Engine, notice: str | None) -> None:
    from specee_edge.cli.render import exit_setting, level_warning

    info = engine.model.info
    pack = f", pack {engine.policy.pack_path.name}" if engine.policy else ""
    setting = exit_setting(engine)
    if engine.exact and engine.policy is None:
        state = "exact mode, prompt-lookup drafts where they pay here"
    else:
        state = f"early exit {'on' if engine.early_exit else 'off'}{f', {setting}' if setting else ''}"
    line = {"highlight": False, "markup": False, "soft_wrap": True}
    console.print(f"specee-edge chat · {info.path.name} ({info.arch}, {info.n_layer} layers{pack}) · {state}", **line)
    if notice:
        console.print(notice, style="yellow", **line)
    if warning := level_warning(engine):
        console.print(warning, style="yellow", **line)
    if engine.prompting == "completion":
        console.print(f"{info.path.name} is a base model, not instruction-tuned: it continues text rather than"
                      " answering (specee-edge generate --raw suits it)", style="yellow", **line)
    console.print('/help for commands, """ for multi-line input, Ctrl+C stops a reply, Ctrl+D quits', style="dim", **line)


@app.command()
def generate(
    model: ModelArg = None,
    prompt: Annotated[str | None, typer.Option("-p", "--prompt", show_default=False, help="the prompt")] = None,
    file: Annotated[Path | None, typer.Option("-f", "--file", show_default=False, help="read the prompt from a file (- : stdin)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON object: text, model, pack, stats")] = False,
    raw: Annotated[bool, typer.Option("--raw", help="send the prompt as is, without the chat template")] = False,
    model_opt: ModelOpt = None,
    hf_repo: HfRepo = None,
    hf_file: HfFile = None,
    pack: PackOpt = None,
    n_predict: NPredict = 512,
    ctx_size: CtxSize = 4096,
    n_gpu_layers: GpuLayers = None,
    rpc_workers: Rpc = None,
    rpc_timeout: RpcTimeout = RPC_TIMEOUT_S,
    tensor_split: TensorSplit = None,
    offload_first: OffloadFirst = False,
    override_tensor: OverrideTensor = None,
    threads: Threads = None,
    seed: Seed = -1,
    temp: Temp = 0.8,
    top_k: TopK = 40,
    top_p: TopP = 0.95,
    min_p: MinP = 0.05,
    repeat_penalty: RepeatPenalty = 1.0,
    system_prompt: SystemPrompt = None,
    chat_template: ChatTemplate = None,
    no_early_exit: NoEarlyExit = False,
    speculation: Speculation = "auto",
    flash_attn: FlashAttn = FlashAttnSetting.auto,
    kv_mode: KvModeOpt = None,
    quality: Quality = None,
    threshold: Threshold = None,
    color_exits: ColorExits = False,
    verbose: Verbose = False,
    grammar: GrammarOpt = None,
    grammar_file: GrammarFile = None,
    json_schema: JsonSchema = None,
) -> None:
    """One reply: the text to stdout (pipe-friendly), the stats to stderr; --json for one JSON object."""
    from specee_edge.cli.render import TokenPrinter, exit_setting, footer, level_warning, stats_table

    try:
        text = _prompt_text(prompt, file)
        opts = EngineOptions(pick_model(model, model_opt, hf_repo, hf_file), pack, ctx_size, n_gpu_layers, threads, kv_mode.value if kv_mode else None,
                             quality, threshold, not no_early_exit, rpc_workers, tensor_split, rpc_timeout,
                             offload_first, override_tensor, speculation=speculation, flash_attn=flash_attn.value)
        sampling = sampling_params(temp, top_k, top_p, min_p, repeat_penalty, seed)
        template = chat_template_text(chat_template)
        constraint = reply_grammar(grammar, grammar_file, json_schema)
        engine, _, notice = load_engine(opts, strict_pack=True)
    except SpecEEError as e:
        raise fail(e) from None
    for line in (notice, level_warning(engine)):
        if line:
            err_console.print(line, style="yellow", highlight=False, markup=False, soft_wrap=True)
    max_tokens = n_predict if n_predict >= 0 else engine.ctx.n_ctx
    setting = exit_setting(engine)  # read before close, which lets go of the pack
    level = {"quality": quality_name(engine.policy.quality) if engine.policy and engine.policy.quality is not None else None,
             "exact": engine.exact}
    colour = color_exits and not json_out and sys.stdout.isatty()
    printer = TokenPrinter(Console(highlight=False), engine.n_layer, True) if colour else None
    pieces: list[str] = []
    interrupted = False
    try:
        if raw:
            stream = engine.stream(text, max_tokens=max_tokens, sampling=sampling, grammar=constraint)
        else:
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else [])
            stream = engine.stream_chat(messages + [{"role": "user", "content": text}], chat_template=template,
                                        max_tokens=max_tokens, sampling=sampling, grammar=constraint)
        for record in stream:
            pieces.append(record.text)
            if json_out:
                continue
            if printer:
                printer(record)
            else:
                sys.stdout.write(record.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        interrupted = True
    except SpecEEError as e:
        raise fail(e) from None
    finally:
        engine.close()
    reply = "".join(pieces)
    stats = engine.stats
    if json_out:
        pack_path = str(engine.pack_path) if engine.pack_path else None
        print(json.dumps({"text": reply, "model": str(engine.model.info.path), "pack": pack_path, **level,
                          "stats": stats.summary()}))
    else:
        if reply and not reply.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
        err_console.print(footer(stats, setting), style="dim", highlight=False, markup=False, soft_wrap=True)
        if verbose:
            err_console.print(stats_table(stats))
    if interrupted:
        raise typer.Exit(130)


def _prompt_text(prompt: str | None, file: Path | None) -> str:
    if (prompt is None) == (file is None):
        raise SpecEEError("give the prompt with -p PROMPT or -f FILE (one of them)")
    if prompt is not None:
        return prompt
    if str(file) == "-":
        return sys.stdin.read()
    try:
        return file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecEEError(f"cannot read the prompt file {file}: {e.strerror if isinstance(e, OSError) else e}") from None
