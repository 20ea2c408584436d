"""One bench run: the decoding passes (every lane a whole answer at a time, in a shuffled order), the cost lanes,
the oracle, then quality; the result for report.py."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from llama_cpp import Llama
from threadpoolctl import threadpool_limits

from specee_edge.bench.oracle import Oracle, oracle_depths
from specee_edge.bench.quality import (LOOP_SHARE, NEAR_TIE, Agreement, Perplexity, agreement, batched_replay,
                                      divergence_margins, exact_prefix, perplexity, repetition)
from specee_edge.bench.lookup_replay import replay_by_category
from specee_edge.bench.report import (BARE_CONTEXT, LLAMA_CPP_PYTHON, TIME_PARTS, BenchResult, ExactChoices, ModeResult,
                                     RepeatResult, RoundTrips, RpcResult, ToolLane, SampledResult, repeat_of, twin_of)
from specee_edge.bench.llama_server import (DEFAULT_SPEC_TYPES, DRAFT, PLAIN, LlamaServer, LlamaServerError, ServerLane,
                                            ServerSetup, lane_args, speculates)
from specee_edge.bench.runner import (ContextLane, Lane, PeerLane, SpecEELane, VanillaLane, one_line,
                                      reference_failed, run_lanes)
from specee_edge.bench.structured import check_grammar, grammar_run
from specee_edge.bootstrap import speedup_interval
from specee_edge.data.prompts import GRAMMAR_SETS, Prompt, bench_prompts, extract_schema, heldout_text
from specee_edge.engine import AUTO, DEFAULT_KV_MODE, Engine, EngineConfig, GenerationStats, TokenRecord
from specee_edge.engine.constraint import GrammarConstraint
from specee_edge.engine.sampling import GREEDY, SamplingParams
from specee_edge.engine.exit import find_pack
from specee_edge.errors import SpecEEError
from specee_edge.gguf_index import GGUFIndex
from specee_edge.grammar import Grammar, grammar_from_schema
from specee_edge.pack import EXACT_QUALITY, Pack, parse_quality, read_pack
from specee_edge.runtime import Context, Model, device_memory, placement, rpc
from specee_edge.runtime.costs import DraftSetup, Timing, TokenCosts, cost_lanes, time_rounds
from specee_edge.runtime.device_memory import Footprint, check_fits, fitting, footprint
from specee_edge.runtime.weights import TargetWeights
from specee_edge.threads import default_threads

ENGINE_CTX = 2048  # the engines' context: a prompt and its answer, or the held-out text
NO_PACK = "no pack"  # the lane of the engine without a pack
# the cost lanes' tokens: whole answers, the first ones in the run's order (its categories in turns), up to this many
# timed steps, at least one answer. Each token is a step of every cost lane (16 with a pack of k = 4): on
# Qwen2.5-Coder-1.5B, 181 tokens took 160 s of a 3-prompt run's 619 s on 2 cores. Calibration prices its decisions
# from 3 answers of 32 tokens a round.
COST_TOKENS = 256


class Reporter(Protocol):
    """Progress: task() returns a function that advances that task by n units."""

    def task(self, description: str, total: float) -> Callable[[float], None]: ...


class Silent:
    def task(self, description: str, total: float) -> Callable[[float], None]:
        return lambda n: None


@dataclass
class BenchConfig:
    model: Path
    pack: str | Path | None = AUTO
    prompt_set: str = "all"          # a built-in set or a .jsonl file
    num_prompts: int = 8             # taken in turns from each category; 0: all of them
    tokens: int = 96                 # generated per prompt (the first comes from the prompt pass)
    kv_modes: list[str] = field(default_factory=lambda: [DEFAULT_KV_MODE])
    threads: int = field(default_factory=default_threads)
    quality: str | None = None       # --quality: None (the pack's default level), "all", or a list "0.95,0.99"
    threshold: float | None = None   # None: the level's per-layer thresholds; above 1: exits impossible
    python_policy: bool = False      # also a lane per KV mode with the Python exit policy (its cost, same decisions)
    ppl_tokens: int = 0              # held-out tokens for perplexity; 0: all of them
    sampled: bool = True             # a second pass with chat's default sampling (seeded per prompt)
    peer: bool = True                # llama-cpp-python's prompt-lookup speculative decoding as a lane
    lookup_lane: bool = True         # a lane of exact mode without the pack: prompt-lookup drafts, what any GGUF gets
    flash_attn: str = "auto"         # --flash-attn, in every lane: llama.cpp's on, off or auto
    seed: int = 0                    # the sampled pass's seed (prompt i draws from seed + i in every lane)
    llama_server: Path | None = None  # the llama-server program: its lanes, plain the baseline (None: no such lanes)
    llama_server_asked: bool = False  # its lanes were asked for, even if the program could not be found or built
    spec_types: list[str] = field(default_factory=lambda: list(DEFAULT_SPEC_TYPES))  # a llama-server lane each
    draft_model: Path | None = None  # a same-vocabulary model: a llama-server lane drafting with it (-md DRAFT)
    repeat: bool = True              # a repeat lane of llama-server plain and of the bare Context: the run's noise
    dropped: list[str] = field(default_factory=list)  # lanes dropped before the run, a line each (a failed build)
    command: str = ""
    grammar: Grammar | None = None   # every lane decodes under it (--grammar, --grammar-file, -j)
    schema: Any = None               # the JSON schema it was made from, whole answers validated against it

    def __post_init__(self) -> None:
        """A set whose prompts ask for JSON of the extract schema's shape runs under that schema unless a grammar is
        given: its answers are meant to fit it, as a user's would under -j."""
        if self.grammar is None and self.prompt_set in GRAMMAR_SETS:
            self.schema = extract_schema()
            self.grammar = grammar_from_schema(self.schema, f"the {self.prompt_set} set's schema")


def pick_prompts(prompts: Sequence[Prompt], n: int) -> list[Prompt]:
    """Up to n prompts, one from each category in turn (file order within a category); n = 0: all."""
    by_category: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    turns = []
    for i in range(max(map(len, by_category.values()))):
        turns.extend(group[i] for group in by_category.values() if i < len(group))
    return turns[:n] if n > 0 else turns


def bench_pack(config: BenchConfig) -> Pack | None:
    """The pack the engines will load (as Engine finds it); None where the model has none."""
    path = find_pack(config.model) if config.pack == AUTO else config.pack
    return read_pack(path) if path is not None else None


def check_without_pack(config: BenchConfig) -> None:
    """Without a pack the bench runs what needs none: what asks for more is refused, one line each."""
    asked = [q for q in (config.quality or "").split(",") if q.strip()]
    needs = [f"--quality {q.strip()}: a lossy level" for q in asked
             if q.strip().lower() != "all" and parse_quality(q) != EXACT_QUALITY]
    needs += ["--threshold: exits"] if config.threshold is not None else []
    needs += ["--python-policy: the exit policy"] if config.python_policy else []
    needs += [f"--kv-mode {','.join(config.kv_modes)}: exits"] if config.kv_modes != [DEFAULT_KV_MODE] else []
    if needs:
        raise SpecEEError("\n".join(f"{need} needs a pack, and {config.model.name} has none (`specee-edge calibrate` "
                                    "makes one)" for need in needs))


def bench_qualities(spec: str | None, pack: Pack) -> list[float | None]:
    """The levels to run, ascending: --quality None is the pack's default (None), `all` every level,
    a comma list the level Pack.level picks for each (the lowest at or above it)."""
    if spec is None:
        return [None]
    if spec.strip().lower() == "all":
        return [level.quality for level in pack.levels] or [None]
    asked = [parse_quality(q) for q in spec.split(",")]
    return sorted({pack.level(q).quality for q in asked})


@dataclass(frozen=True)
class EngineSpec:
    """One SpecEE lane's engine, made afresh for each decoding pass (a fresh context, a cold controller) on the
    run's one loaded model: every engine shares its weights."""

    name: str                         # the KV mode, `MODE/python`, or NO_PACK
    pack: str | Path | None
    config: EngineConfig

    def load(self, model: Model) -> Engine:
        return Engine(model, pack=self.pack, config=self.config)


def engine_specs(config: BenchConfig, qualities: Sequence[float | None]) -> list[EngineSpec]:
    """An engine per lane: each KV mode at each quality level natively, and as `MODE/python` with the
    Python policy if asked; as users run them (the draft's share of a step comes from the cost lanes)."""
    specs = []
    for mode in config.kv_modes if qualities else ():
        for quality in qualities:
            for native in (True, False) if config.python_policy else (True,):
                specs.append(EngineSpec(mode if native else f"{mode}/python", config.pack, EngineConfig(
                    n_ctx=ENGINE_CTX, n_threads=config.threads, flash_attn=config.flash_attn, kv_mode=mode,
                    quality=quality, threshold=config.threshold, native=native)))
    if config.lookup_lane or not qualities:
        specs.append(EngineSpec(NO_PACK, None, EngineConfig(n_ctx=ENGINE_CTX, n_threads=config.threads,
                                                            flash_attn=config.flash_attn)))
    return specs


def draft_setup(engine: Engine) -> DraftSetup:
    """The engine's draft head and one of its predictors, for the cost lanes."""
    mlp = engine.policy.predictors[max(engine.policy.predictors)]
    return DraftSetup(engine.policy.draft.runtime_args(), (mlp.weights, mlp.biases))


def run_bench(config: BenchConfig, reporter: Reporter = Silent()) -> BenchResult:
    # numpy's BLAS single-threaded (the draft head, the oracle's capture), except in the logit lens:
    # idle BLAS workers spin and fight llama.cpp's threads for the cores (up to 100x slower decoding)
    with threadpool_limits(limits=1, user_api="blas"):
        return _run_bench(config, reporter)


def server_names(config: BenchConfig) -> list[str]:
    """The llama-server lanes asked for: plain first (the baseline), its repeat, then each --spec-type, then -md
    DRAFT."""
    if config.llama_server is None:
        return []
    return [PLAIN, *([repeat_of(PLAIN)] if config.repeat else []), *config.spec_types,
            *([DRAFT] if config.draft_model else [])]


def reachable_servers(config: BenchConfig, model: Model, dropped: list[str]) -> list[str]:
    """server_names, but none where the model's layers live on RPC workers: ggml's rpc-server serves one client at
    a time, and this process holds the workers for the whole run, so a llama-server could not load its layers there
    (it would wait for them until its start timed out). Each lane left out is a line in `dropped`."""
    names = server_names(config)
    if names and model.workers:
        dropped.extend(f"{name}: not run: the RPC workers ({', '.join(map(str, model.workers))}) serve one client at "
                       "a time, and this bench holds them" for name in names)
        return []
    return names


def context_names(config: BenchConfig) -> list[str]:
    """The bare Context lanes: the control, then its repeat. A repeat is a fresh equal twin of a lane, its ratio to
    it the run's noise (RepeatResult)."""
    return [BARE_CONTEXT, *([repeat_of(BARE_CONTEXT)] if config.repeat else [])]


def check_device_memory(config: BenchConfig, model: Model, n_engines: int, servers: Sequence[str]) -> Footprint:
    """Before the run loads more than its one copy of the model: whether each pass fits the devices' free memory,
    else one line naming the pass, the device and what it needs (runtime/device_memory.py). The pass of the Python
    lanes holds the Llama lanes' copies (vanilla, the peer) and every context: the bare Context lanes', and the
    engines' of both passes at once where the sampled pass runs (its fresh engines beside the greedy pass's, kept
    for quality). Where layers are offloaded, llama-server's lanes run in a pass of their own (decode_pass): a copy
    and a context each, the draft model's offloaded layers for -md, beside the engines' contexts. Returns the
    model's footprint (nothing offloaded: nothing checked, the weights are the file's shared memory map)."""
    placed = footprint(GGUFIndex(config.model), model.layer_devices())
    if not placed.offloaded:
        return placed
    free = device_memory.free_bytes()
    engines = n_engines * (2 if config.sampled else 1)
    llamas = 1 + int(config.peer)
    contexts = llamas + len(context_names(config)) + engines
    check_fits("the bench's pass of the llama-cpp-python and specee-edge lanes",
               placed.need(llamas, contexts * ENGINE_CTX), free,
               f"{llamas} more copies of the offloaded weights, {contexts} contexts of {ENGINE_CTX} cells",
               "lower -ngl, or run fewer lanes (--no-peer, fewer --quality levels or --kv-mode modes, --greedy-only)")
    if servers:
        need = placed.need(len(servers), (len(servers) + engines) * ENGINE_CTX)
        parts = f"{len(servers)} llama-servers' copies of the offloaded weights and contexts, {engines} engines' contexts"
        if DRAFT in servers and config.draft_model is not None:
            drafted = draft_footprint(config.draft_model, model.layer_devices()[-1]).need(1, ENGINE_CTX)
            need = {d: need.get(d, 0) + drafted.get(d, 0) for d in need.keys() | drafted.keys()}
            parts += ", the draft model's offloaded layers"
        check_fits("the bench's llama-server pass", need, free, parts,
                   "lower -ngl, or run fewer llama-server lanes (--spec-type none, --no-repeat, no --draft-model)")
    return placed


def draft_footprint(draft_model: Path, device: str) -> Footprint:
    """The -md draft model as llama-server places it with -ngld equal to the target's -ngl: llama.cpp's own order
    (the output and the last layers), on `device` (where the target's output runs)."""
    index = GGUFIndex(draft_model)
    n_layer = int(index.value(f"{index.value('general.architecture')}.block_count") or 0)
    offloaded = min(max(placement.default().n_gpu_layers - 1, 0), n_layer)
    output = device if placement.default().n_gpu_layers > 0 else device_memory.CPU
    return footprint(index, [device_memory.CPU] * (n_layer - offloaded) + [device] * offloaded + [output])


def open_servers(config: BenchConfig, model: Model, names: Sequence[str], stack: ExitStack, dropped: list[str],
                 suffix: str = "") -> dict[str, LlamaServer]:
    """A fresh llama-server per lane named, split as `model` is (its placement), stopped when
    `stack` closes (success, error or Ctrl+C); a lane whose server does not start, does not split the model so, or
    does not speculate where the lane would, is a line in `dropped` (its name, then `suffix`)."""
    chosen = placement.default()
    devices = tuple(dict.fromkeys(d for d in model.layer_devices() if d != device_memory.CPU))
    setup = ServerSetup(config.llama_server, config.model, config.threads, ENGINE_CTX, config.flash_attn,
                        placement=chosen, devices=devices) if names else None
    servers = {}
    for name in names:
        try:
            servers[name] = stack.enter_context(LlamaServer(setup, lane_args(name, setup, config.draft_model),
                                                            speculative=speculates(name)))
        except LlamaServerError as e:
            dropped.append(f"{name}{suffix}: {e}")
    return servers


def measure_costs(config: BenchConfig, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                  engine: Engine, seq_ctx: int, placed: Footprint, reporter: Reporter) -> TokenCosts:
    """The cost lanes, fed vanilla's first greedy answers (cost_answers; every token but the last, which no step of
    its answer fed) in a pass of their own, one round of calibration's procedure (runtime/costs.py time_rounds: a
    few untimed tokens first, the lanes in turns) on the run's model: the speed lanes decode as a user's decoding
    would, without 16 more contexts evicting their caches between steps (in a micro-benchmark, 10 other contexts in
    turns made a step of the default model 3.7 % dearer than alone). Where the lanes' K/V would not fit the device's
    free memory together, they run in groups that do, one after another (`placed`: the model's footprint)."""
    setup = draft_setup(engine)
    make_lanes = lambda model: cost_lanes(model, setup, n_ctx=seq_ctx, n_threads=config.threads,  # noqa: E731
                                          k=engine.policy.k, flash_attn=config.flash_attn)
    fed = cost_answers([([*prompt, *answer[:-1]], len(prompt)) for prompt, answer in zip(prompts, answers)])
    group = None
    if placed.offloaded:
        one_lane, free = placed.need(copies=0, cells=seq_ctx), device_memory.free_bytes()
        check_fits("a cost lane", one_lane, free, f"one context of {seq_ctx} cells", "lower -ngl or --tokens")
        group = fitting(free, one_lane)
    advance = reporter.task("costs", sum(len(tokens) - n_prompt for tokens, n_prompt in fed))
    return TokenCosts.fit(time_rounds(engine.model, make_lanes, fed, rounds=1, seed=0, advance=advance, group=group))


def cost_answers(fed: Sequence[tuple[list[int], int]], limit: int = COST_TOKENS) -> list[tuple[list[int], int]]:
    """The first of `fed` (a prompt and its answer, the prompt's length) whose answers hold at most `limit` steps
    together, at least the first."""
    kept, steps = [], 0
    for tokens, n_prompt in fed:
        steps += len(tokens) - n_prompt
        if kept and steps > limit:
            break
        kept.append((tokens, n_prompt))
    return kept


@dataclass
class DecodePass:
    """One decoding pass (greedy or sampled) once every lane answered: each lane was fresh for it (a new Llama, a
    new Context, new engines, a new peer, new servers); the dropped ones are left out."""

    vanilla: VanillaLane
    contexts: dict[str, ContextLane]  # the bare Context and its repeat, by name
    specee: dict[int, SpecEELane]     # by the engine's index in the run's list
    peer: PeerLane | None
    servers: dict[str, ServerLane]
    order: list[list[str]]            # per prompt, the lanes by name in the order they answered

    @property
    def context(self) -> ContextLane | None:
        return self.contexts.get(BARE_CONTEXT)

    @property
    def lanes(self) -> list[Lane]:
        """Every lane that answered the whole pass."""
        return [self.vanilla, *self.contexts.values(), *self.specee.values(), *([self.peer] if self.peer else []),
                *self.servers.values()]

    @property
    def plain(self) -> ServerLane | None:
        return self.servers.get(PLAIN)

    @property
    def twins(self) -> list[tuple[Lane, Lane]]:
        """Each repeat lane with the lane it repeats, where both answered the whole pass."""
        lanes: dict[str, Lane] = {**self.servers, **self.contexts}
        return [(lane, lanes[twin]) for name, lane in lanes.items() if (twin := twin_of(name)) in lanes]

    @property
    def base(self) -> Timing:
        """Every speed-up's baseline: llama-server plain, else the Llama.eval lane."""
        return self.plain.timing if self.plain else self.vanilla.timing

    @property
    def baseline(self) -> str:
        return PLAIN if self.plain else LLAMA_CPP_PYTHON


def constraints(config: BenchConfig, model: Model) -> Callable[[], GrammarConstraint] | None:
    """A fresh GrammarConstraint of the run's grammar over `model`'s vocabulary at each call (None: no grammar):
    a grammar's state is one answer's."""
    return partial(GrammarConstraint, model, config.grammar) if config.grammar is not None else None


def decode_pass(config: BenchConfig, prompts: Sequence[Sequence[int]], model: Model,
                engines: dict[int, tuple[str, Engine]], names: Sequence[str], with_peer: bool, sampling: SamplingParams, rng: np.random.Generator,
                dropped: list[str], what: str, reporter: Reporter, servers_apart: bool = False) -> DecodePass:
    """Every lane answers every prompt whole, the lanes in an order shuffled per prompt (runner.run_lanes): vanilla
    (Llama.eval, its context the engines' size: attention over a larger cache costs more), the bare Context and its
    repeat (context_names: each its own Context), an engine's lane each, the peer (with_peer) and a llama-server per
    name, all under the run's grammar if any. servers_apart: the llama-server lanes answer after the others, in a
    pass of their own once the Llama lanes' copies of the model are freed (each server loads another copy onto the
    device). A lane that fails is a line in `dropped`."""
    suffix = f", {what}"
    llm = vanilla_llama(config)
    ctxs = [Context(model, n_ctx=ENGINE_CTX, n_threads=config.threads, flash_attn=config.flash_attn)
            for _ in context_names(config)]
    constrain = constraints(config, model)
    vanilla = VanillaLane(llm, config.tokens, model.is_eog, sampling, constrain)
    contexts = [ContextLane(ctx, config.tokens, model.is_eog, sampling, name, constrain)
                for ctx, name in zip(ctxs, context_names(config))]
    specee = {i: SpecEELane(mode, engine, config.tokens, sampling, config.grammar)
              for i, (mode, engine) in engines.items()}
    peer = None
    try:
        peer = peer_lane(config, model.is_eog, sampling) if with_peer else None
    except Exception as e:  # noqa: BLE001 - an optional lane: llama-cpp-python raises ValueError where it does not load
        dropped.append(f"{PeerLane.name}{suffix}: {one_line(e)}")
    server_suffix = suffix if what != "greedy" else ""
    python_lanes: list[Lane] = [vanilla, *contexts, *specee.values(), *([peer] if peer else [])]
    server_lanes: list[ServerLane] = []
    try:
        with ExitStack() as stack:
            if not servers_apart:
                server_lanes = server_lanes_of(config, model, names, stack, dropped, server_suffix, sampling)
            lanes: list[Lane] = [*python_lanes, *server_lanes]
            log = run_lanes(prompts, lanes, rng, reporter.task(f"decoding, {what}", len(prompts) * len(lanes)),
                            workers=model.workers)
    finally:
        llm.close()
        for ctx in ctxs:
            ctx.close()
        if peer is not None:
            peer.close()
    failed = [(lanes[i], message) for i, message in log.failed.items()]
    order = [[lanes[i].name for i in answered] for answered in log.order]
    if servers_apart and names:
        with ExitStack() as stack:
            server_lanes = server_lanes_of(config, model, names, stack, dropped, server_suffix, sampling)
            log = run_lanes(prompts, server_lanes, rng, reporter.task(f"llama-server, {what}",
                                                                      len(prompts) * len(server_lanes)),
                            workers=model.workers, reference=False)
        failed += [(server_lanes[i], message) for i, message in log.failed.items()]
        order = [[*before, *(server_lanes[i].name for i in answered)] for before, answered in zip(order, log.order)]
    dropped.extend(f"{lane.name}{suffix}: {message}" for lane, message in failed)
    gone = {id(lane) for lane, _ in failed}
    return DecodePass(vanilla=vanilla, contexts={lane.name: lane for lane in contexts if id(lane) not in gone},
                      specee={i: lane for i, lane in specee.items() if id(lane) not in gone},
                      peer=None if peer is None or id(peer) in gone else peer,
                      servers={lane.name: lane for lane in server_lanes if id(lane) not in gone}, order=order)


def server_lanes_of(config: BenchConfig, model: Model, names: Sequence[str], stack: ExitStack, dropped: list[str],
                    suffix: str, sampling: SamplingParams) -> list[ServerLane]:
    """A lane per llama-server that started (open_servers), stopped when `stack` closes."""
    return [ServerLane(name, server, config.tokens, sampling, config.grammar)
            for name, server in open_servers(config, model, names, stack, dropped, suffix).items()]


def vanilla_llama(config: BenchConfig) -> Llama:
    """The Llama.eval lane's model, its context the engines' size. That lane is every lane's reference: where its
    model does not load, the run ends with the line run_lanes gives where it fails to answer, not a traceback."""
    try:
        return Llama(model_path=str(config.model), n_ctx=ENGINE_CTX, n_threads=config.threads,
                     n_threads_batch=config.threads, verbose=False, **llama_kwargs(config))
    except Exception as e:  # noqa: BLE001 - llama-cpp-python raises ValueError where a model does not load
        raise reference_failed(e) from None


def tool_lane(lane: Lane, vanilla: VanillaLane, base: Timing, categories: Sequence[str], sampled: Lane | None,
              vanilla_sampled: VanillaLane | None, base_sampled: Timing | None) -> ToolLane:
    """Another tool's lane (llama-server, llama-cpp-python's Llama.eval) or the bare Context against the baseline,
    greedy and sampled."""
    greedy = lane_speed(lane, vanilla, categories, base)
    result = ToolLane(tok_s=lane.timing.tok_s, speedup=greedy.speedup, identical=greedy.identical,
                      drafted=getattr(lane, "drafted", 0), accepted=getattr(lane, "accepted", 0),
                      speculates=getattr(lane, "speculates", False),
                      speedup_by_category=greedy.speedup_by_category, speedup_interval=greedy.speedup_interval,
                      speedup_by_category_interval=greedy.speedup_by_category_interval)
    if sampled is not None and vanilla_sampled is not None and base_sampled is not None:
        other = lane_speed(sampled, vanilla_sampled, categories, base_sampled)
        result.tok_s_sampled = sampled.timing.tok_s
        result.speedup_sampled = other.speedup
        result.speedup_sampled_interval = other.speedup_interval
        result.drafted_sampled = getattr(sampled, "drafted", 0)
        result.accepted_sampled = getattr(sampled, "accepted", 0)
        result.speedup_by_category_sampled = other.speedup_by_category
        result.speedup_by_category_sampled_interval = other.speedup_by_category_interval
    return result


def tool_lanes(greedy: DecodePass, sampled: DecodePass | None, categories: Sequence[str]) -> dict[str, ToolLane]:
    """llama-server's lanes, the Llama.eval lane and the bare Context lanes, by name, each greedy and sampled."""
    lanes: list[Lane] = [*greedy.servers.values(), greedy.vanilla, *greedy.contexts.values()]
    others: dict[str, Lane] = {}
    if sampled is not None:
        others = {lane.name: lane for lane in [*sampled.servers.values(), sampled.vanilla, *sampled.contexts.values()]}
    return {lane.name: tool_lane(lane, greedy.vanilla, greedy.base, categories, others.get(lane.name),
                                 sampled.vanilla if sampled else None, sampled.base if sampled else None)
            for lane in lanes}


def _run_bench(config: BenchConfig, reporter: Reporter) -> BenchResult:
    """The run on one loaded copy of the model, which every engine and Context lane shares; the engines are closed
    before it, however the run ends."""
    if config.tokens < 2:
        raise SpecEEError("--tokens must be at least 2 (the first token comes from the prompt pass)")
    with ExitStack() as stack:
        model = Model(config.model)
        stack.callback(model.close)
        return _bench_on(model, config, reporter, stack)


def _bench_on(model: Model, config: BenchConfig, reporter: Reporter, stack: ExitStack) -> BenchResult:
    start = time.perf_counter()
    pack = bench_pack(config)
    if pack is None:  # the lanes that need none: exact mode drafting by prompt lookup, vanilla, the peer
        check_without_pack(config)
    default_level = pack.level() if pack else None
    specs = engine_specs(config, bench_qualities(config.quality, pack) if pack else [])
    dropped = list(config.dropped)
    servers = reachable_servers(config, model, dropped)
    placed = check_device_memory(config, model, len(specs), servers)

    def load(spec: EngineSpec) -> Engine:
        engine = spec.load(model)
        stack.callback(engine.close)
        return engine

    engines = {i: (spec.name, load(spec)) for i, spec in enumerate(specs)}
    first = engines[0][1]
    n_layer, k = first.n_layer, first.policy.k if pack else 0
    if config.grammar is not None:
        check_grammar(model, config.grammar)
    selected = pick_prompts(bench_prompts(config.prompt_set), config.num_prompts)
    prompts = [first.prompt_tokens(p.text) for p in selected]
    seq_ctx = max(map(len, prompts)) + config.tokens
    if seq_ctx > ENGINE_CTX:
        raise SpecEEError(f"a prompt and its answer ({seq_ctx} tokens) must fit {ENGINE_CTX}: lower --tokens")
    heldout = first.tokenize(heldout_text())[: min(config.ppl_tokens or ENGINE_CTX, ENGINE_CTX)]
    order = np.random.default_rng(config.seed)  # the lanes' order, shuffled per prompt in both passes

    # 1. speed: every lane a whole answer at a time, in a shuffled order per prompt, greedy
    greedy = decode_pass(config, prompts, model, engines, servers, config.peer, GREEDY, order, dropped, "greedy",
                         reporter, servers_apart=placed.offloaded)
    # the oracle and perplexity still read the first engine
    kept = [engine for i, (_, engine) in engines.items() if i in greedy.specee or engine is first]
    for _, engine in engines.values():
        if engine not in kept:
            engine.close()
    if not greedy.specee:
        raise SpecEEError("every specee-edge lane failed: " + "; ".join(dropped))
    lanes = list(greedy.specee.values())
    vanilla, base = greedy.vanilla, greedy.base
    where = model.placement_text()  # read now: the engines, and their models, are closed before the report
    if model.placement.tensor_overrides:  # llama-cpp-python 0.3.36's Llama has no way to pass them
        where += " (not in the llama-cpp-python lanes: Llama cannot take -ot)"
    categories = [p.category for p in selected]
    greedy_stats = {i: lane_stats(lane, categories) for i, lane in greedy.specee.items()}
    greedy_choices = {i: exact_choices(lane, greedy_stats[i], vanilla, categories)
                      for i, lane in greedy.specee.items()}
    costs = measure_costs(config, prompts, vanilla.outputs, first, seq_ctx, placed, reporter) if pack else None

    # 1b. the same lanes, each fresh (new engines: their controllers start cold, as in the greedy pass), with chat's
    # default sampling: every lane draws from one seed per prompt
    sampled: dict[int, SampledResult] = {}
    second = None
    if config.sampled:
        fresh = {i: (specs[i].name, load(specs[i])) for i in greedy.specee}
        try:
            second = decode_pass(config, prompts, model, fresh, list(greedy.servers), greedy.peer is not None,
                                 SamplingParams(seed=config.seed),
                                 order, dropped, "sampled", reporter, servers_apart=placed.offloaded)
            sampled = {i: sampled_result(lane, second.vanilla, categories, second.base, bool(model.workers))
                       for i, lane in second.specee.items()}
        finally:
            for _, engine in fresh.values():
                engine.close()
    vanilla_sampled = second.vanilla if second else None
    rpc_result = rpc_report(model.workers, vanilla, vanilla_sampled) if model.workers else None
    tools = tool_lanes(greedy, second, categories)
    repeats = repeat_results([("greedy", greedy), *([("sampled", second)] if second else [])])
    baseline = greedy.baseline
    baseline_sampled = second.baseline if second else None
    base_sampled = second.base if second else None
    peer, peer_sampled = greedy.peer, second.peer if second else None
    lane_order = {"seed": config.seed, "greedy": greedy.order, "sampled": second.order if second else None}
    grammar = grammar_run(config.grammar, config.schema, model, [
        ("greedy", greedy.lanes), *([("sampled", second.lanes)] if second else [])]) if config.grammar else None

    # 2. the oracles along vanilla's outputs (they price exits, which a pack holds)
    oracle = None
    if pack:
        weights = TargetWeights(config.model)
        depths = oracle_depths(model, weights, first.policy.draft, first.policy.pack.lookup_max_n, prompts,
                               vanilla.outputs, n_ctx=seq_ctx, n_threads=config.threads,
                               advance=reporter.task("oracle", vanilla.timing.steps))
        oracle = Oracle(depths, costs, n_layer)

    # 3. quality: agreement, exact prefix, held-out perplexity with and without exits; the full model's greedy
    # choices under the run's grammar, as its lanes drew theirs
    reference = Context(model, n_ctx=seq_ctx, n_batch=seq_ctx, n_threads=config.threads, flash_attn=config.flash_attn)
    constrain = constraints(config, model)
    advance = reporter.task("quality", sum(lane.timing.steps for lane in lanes) + (len(lanes) + 1) * (len(heldout) - 1))
    ppl_full = perplexity(first, heldout, early_exit=False, advance=advance).value
    # how much of each vanilla greedy answer repeats itself, and the answers that do not loop
    repeated = [repetition(output) for output in vanilla.outputs]
    no_loop = [i for i, share in enumerate(repeated) if share < LOOP_SHARE]
    repeated_sampled = [repetition(output) for output in vanilla_sampled.outputs] if vanilla_sampled else []
    modes = [
        mode_result(lane, vanilla, base, oracle, costs, categories, no_loop, bool(model.workers),
                    stats=greedy_stats[i], agreement=agreement(reference, prompts, lane.records, advance, constrain),
                    # exact mode's distribution is the full model's: its perplexity is plain decoding's
                    ppl=perplexity(lane.engine, heldout, early_exit=not lane.engine.exact, advance=advance),
                    margins=divergence_margins(reference, prompts, vanilla.outputs, lane.outputs, constrain),
                    off_replay=sum(batched_replay(reference, prompt, records, constrain) != output for prompt, records,
                                   output in zip(prompts, lane.records, lane.outputs)) if lane.engine.exact else None,
                    sampled=sampled.get(i), choices=greedy_choices[i])
        for i, lane in greedy.specee.items()
    ]
    reference.close()
    # the replay drafts as the first engine does (its pack's lookup length, its model's ends of generation): before
    # the engines and their models are closed
    replay = lambda outputs: replay_by_category(prompts, outputs, categories, first.model.eog_ids, config.tokens,
                                                 first.lookup_max_n)
    lookup_replay = replay(vanilla.outputs)
    lookup_replay_sampled = replay(vanilla_sampled.outputs) if vanilla_sampled else {}
    for engine in kept:
        engine.close()
    return BenchResult(
        model=config.model.name, pack=first.pack_path.name if pack else NO_PACK, n_layer=n_layer, threads=config.threads,
        k=k, prompt_set=config.prompt_set, prompts=len(prompts), tokens=config.tokens,
        vanilla_steps=vanilla.timing.steps, vanilla_tok_s=vanilla.timing.tok_s,
        oracle_speedup=oracle.speedup if oracle else None, oracle_avg_exit_layer=oracle.avg_exit_layer if oracle else None,
        oracle_head_free_speedup=oracle.head_free_speedup if oracle else None,
        oracle_head_free_avg_exit_layer=oracle.head_free_avg_exit_layer if oracle else None,
        oracle_histogram=oracle.histogram if oracle else [], costs=costs, ppl_full=ppl_full, ppl_tokens=len(heldout),
        default_quality=default_level.quality if default_level else None, modes=modes,
        vanilla_sampled_tok_s=vanilla_sampled.timing.tok_s if vanilla_sampled else None,
        peer=lane_speed(peer, vanilla, categories, base, no_loop) if peer else None,
        peer_sampled=lane_speed(peer_sampled, vanilla_sampled, categories, base_sampled)
        if peer_sampled and vanilla_sampled and base_sampled else None,
        baseline=baseline, tools=tools, dropped=dropped, baseline_sampled=baseline_sampled,
        bare_ms_per_token=greedy.context.time_split() if greedy.context else None,
        vanilla_ms_per_token=vanilla.time_split(),
        notes=baseline_notes(config.llama_server_asked or config.llama_server is not None, baseline, baseline_sampled),
        repetition_by_category=by_category(repeated, categories),
        looping_answers=len(repeated) - len(no_loop),
        repetition_sampled_by_category=by_category(repeated_sampled, categories) if vanilla_sampled else {},
        looping_answers_sampled=sum(share >= LOOP_SHARE for share in repeated_sampled),
        lookup_replay=lookup_replay, lookup_replay_sampled=lookup_replay_sampled,
        seconds=time.perf_counter() - start, command=config.command, rpc=rpc_result, placement=where,
        lane_order=lane_order, repeats=repeats, grammar=grammar,
    )


def repeat_results(passes: Sequence[tuple[str, DecodePass]]) -> list[RepeatResult]:
    """Each repeat lane against its twin in each pass (named by the pass): the ratio over every prompt and its
    interval, bootstrapped (paired) as every speed-up's is. A twin that decoded nothing gives no ratio, no result."""
    results = []
    for what, done in passes:
        for repeat, twin in done.twins:
            every = range(len(twin.timing.by_prompt))
            ratio = speedup_on(repeat.timing, twin.timing, every)
            if ratio is not None:
                results.append(RepeatResult(repeat.name, twin.name, what, ratio,
                                            interval_on(repeat.timing, twin.timing, every)))
    return results


def baseline_notes(asked: bool, baseline: str, baseline_sampled: str | None) -> list[str]:
    """A line for each pass whose speed-ups are against the Llama.eval lane although llama-server's lanes
    were asked for (plain did not build, start or answer: its line is under `dropped`)."""
    moved = [what for what, base in (("greedy", baseline), ("sampled", baseline_sampled)) if base == LLAMA_CPP_PYTHON]
    return [f"{what} speed-ups are against {LLAMA_CPP_PYTHON}: llama-server plain, the baseline, did not run "
            "(see dropped)" for what in moved] if asked else []


def by_category(values: Sequence[float], categories: Sequence[str]) -> dict[str, float]:
    return {c: float(np.mean([v for v, cat in zip(values, categories) if cat == c])) for c in sorted(set(categories))}


def peer_lane(config: BenchConfig, is_eog, sampling: SamplingParams | None = None) -> PeerLane:
    kwargs = {"sampling": sampling} if sampling else {}
    return PeerLane(str(config.model), ENGINE_CTX, config.threads, config.tokens, is_eog,
                    llama_kwargs=llama_kwargs(config), grammar=config.grammar, **kwargs)


def lane_speed(lane: Lane, vanilla: VanillaLane, categories: Sequence[str], base: Timing,
               no_loop: Sequence[int] | None = None) -> SampledResult:
    """A lane's speed-up over the baseline (base: its timing), in all and per category, and its whole answers
    identical to vanilla's (same prompts and seeds); no_loop: the prompts whose vanilla answer does not loop, for
    the speed-up on them alone."""
    identical = identical_answers(lane, vanilla)
    every = range(len(categories))
    return SampledResult(speedup=lane.timing.tok_s / base.tok_s if base.tok_s else 0.0,
                         identical=float(np.mean(identical)) if identical else 0.0,
                         speedup_no_loop=speedup_on(lane.timing, base, no_loop) if no_loop is not None else None,
                         speedup_by_category=speedup_by_category(lane.timing, base, categories),
                         speedup_interval=interval_on(lane.timing, base, every),
                         speedup_no_loop_interval=interval_on(lane.timing, base, no_loop) if no_loop is not None else None,
                         speedup_by_category_interval=interval_by_category(lane.timing, base, categories))


def identical_answers(lane: Lane, vanilla: VanillaLane) -> list[bool]:
    """Per prompt, whether the lane's whole answer is vanilla's."""
    return [output == reference for output, reference in zip(lane.outputs, vanilla.outputs)]


def in_category(categories: Sequence[str]) -> dict[str, list[int]]:
    """The prompts of each category, by index."""
    return {c: [i for i, cat in enumerate(categories) if cat == c] for c in sorted(set(categories))}


def speedup_by_category(lane: Timing, base: Timing, categories: Sequence[str]) -> dict[str, float]:
    return {c: speedup_on(lane, base, prompts) or 0.0 for c, prompts in in_category(categories).items()}


def interval_by_category(lane: Timing, base: Timing,
                         categories: Sequence[str]) -> dict[str, tuple[float, float] | None]:
    """Each category's speed-up interval, bootstrapped over that category's prompts alone (two prompts: about the
    range between their own speed-ups; None for a category of one prompt)."""
    return {c: interval_on(lane, base, prompts) for c, prompts in in_category(categories).items()}


def decode_stats(records: Sequence[Sequence[TokenRecord]], n_layer: int) -> GenerationStats:
    """The stats of these answers' timed steps (each answer's first token comes from the prompt pass)."""
    stats = GenerationStats(n_layer, early_exit=True)
    for answer in records:
        for record in answer[1:]:
            stats.add(record)
    return stats


@dataclass
class LaneStats:
    """A SpecEE lane's decode_stats, over all its answers and over each category's: computed once, read by its
    ModeResult or SampledResult and by its ExactChoices."""

    total: GenerationStats
    by_category: dict[str, GenerationStats]


def lane_stats(lane: SpecEELane, categories: Sequence[str]) -> LaneStats:
    n_layer = lane.engine.n_layer
    return LaneStats(decode_stats(lane.records, n_layer),
                     {category: decode_stats([lane.records[i] for i in prompts], n_layer)
                      for category, prompts in in_category(categories).items()})


def exact_choices(lane: SpecEELane, stats: LaneStats, vanilla: VanillaLane,
                  categories: Sequence[str]) -> ExactChoices | None:
    """What an exact lane's controller chose, in all and per category, with the costs it measured (None for a
    lossy lane)."""
    if not lane.engine.exact:
        return None
    by_category = {}
    for category, prompts in in_category(categories).items():
        part = stats.by_category[category]
        vanilla_tok_s = vanilla.timing.tok_s_on(prompts)
        by_category[category] = {
            "acceptance_rate": part.acceptance_rate, "tokens_per_round": part.tokens_per_round,
            "verify_cost": part.time_ms["batch"] / part.rounds * vanilla_tok_s / 1e3 if part.rounds and vanilla_tok_s else None,
            "plain": part.choice_shares()["plain"]}
    total = stats.total
    return ExactChoices(shares=total.choice_shares(), mean_drafts=total.mean_drafts, explore_rounds=total.explore_rounds,
                        explore_ms_per_token=total.explore_ms / total.n_decode if total.n_decode else 0.0,
                        controller=lane.engine.controller.snapshot(), by_category=by_category)


def speedup_on(lane: Timing, base: Timing, prompts: Sequence[int]) -> float | None:
    """The speed-up over the baseline on the given prompts only (None when there are none)."""
    base_tok_s = base.tok_s_on(prompts)
    return lane.tok_s_on(prompts) / base_tok_s if prompts and base_tok_s else None


def interval_on(lane: Timing, base: Timing, prompts: Sequence[int]) -> tuple[float, float] | None:
    """speedup_on's 95% interval, bootstrapped over the same prompts (None for fewer than two: no interval)."""
    if len(prompts) < 2:
        return None
    return speedup_interval([lane.by_prompt[i] for i in prompts], [base.by_prompt[i] for i in prompts])


def sampled_result(lane: SpecEELane, vanilla: VanillaLane, categories: Sequence[str], base: Timing,
                   on_workers: bool) -> SampledResult:
    """on_workers: layers live on RPC workers (the lane's round trips are reported)."""
    stats = lane_stats(lane, categories)
    result = lane_speed(lane, vanilla, categories, base)
    result.acceptance_rate = stats.total.acceptance_rate
    result.tokens_per_round = stats.total.tokens_per_round
    result.exact = exact_choices(lane, stats, vanilla, categories)
    result.round_trips = round_trips(lane.timing) if on_workers else None
    return result


def mode_result(lane: SpecEELane, vanilla: VanillaLane, base: Timing, oracle: Oracle | None,
                costs: TokenCosts | None, categories: Sequence[str], no_loop: Sequence[int], on_workers: bool, *,
                stats: LaneStats, agreement: Agreement, ppl: Perplexity, margins: list[float], off_replay: int | None,
                sampled: SampledResult | None, choices: ExactChoices | None) -> ModeResult:
    """categories: each prompt's, in the order the lane answered them; no_loop: the prompts whose vanilla
    answer does not loop; on_workers: layers live on RPC workers (the lane's round trips are reported); oracle and
    costs: None without a pack (nothing exits); stats: the lane's lane_stats, which `choices` was built from too."""
    speed = lane_speed(lane, vanilla, categories, base, no_loop)
    total = stats.total
    # the oracle is priced in vanilla's steps: the gain it bounds is over vanilla
    over_vanilla = lane.timing.tok_s / vanilla.timing.tok_s if vanilla.timing.tok_s else 0.0
    headroom = oracle.head_free_speedup - 1 if oracle else 0.0
    policy = lane.engine.policy
    level = policy.level if policy and policy.threshold is None else None
    return ModeResult(
        kv_mode=lane.kv_mode, quality=policy.quality if policy else EXACT_QUALITY, steps=lane.timing.steps,
        specee_tok_s=lane.timing.tok_s, speedup=speed.speedup, speedup_no_loop=speed.speedup_no_loop,
        speedup_interval=speed.speedup_interval, speedup_no_loop_interval=speed.speedup_no_loop_interval,
        gain_captured=(over_vanilla - 1) / headroom if headroom > 1e-9 else None,
        agreement=agreement.agreement, exact_prefix=exact_prefix(vanilla.outputs, lane.outputs),
        identical=speed.identical, identical_by_category=by_category(identical_answers(lane, vanilla), categories),
        ppl_specee=ppl.value, ppl_specee_raw=ppl.raw,
        avg_exit_layer=total.avg_exit_layer, exit_rate=total.exit_rate, head_free_rate=total.head_free_rate,
        candidate_mass=agreement.candidate_mass,
        predictor_calls_per_token=total.predictor_calls_per_token, verify_fail_rate=total.verify_fail_rate,
        draft_recall_at_k=total.draft_recall_at_k, recall_draft_head=total.recall_draft_head,
        recall_lookup=total.recall_lookup,
        # a category whose answers all ended at the prompt pass had no step to recall
        recall_by_category={c: {"steps": s.n_decode, "draft_recall_at_k": s.draft_recall_at_k,
                                "recall_draft_head": s.recall_draft_head, "recall_lookup": s.recall_lookup}
                            for c, s in stats.by_category.items() if s.n_decode},
        ms_per_token=time_split(total, lane.timing.ms, costs.draft_ms if costs else 0.0),
        exit_histogram=exit_histogram(total.exit_layers, lane.engine.n_layer),
        exact=lane.engine.exact, acceptance_rate=total.acceptance_rate, tokens_per_round=total.tokens_per_round,
        lookup_round_share=total.lookup_rounds / total.rounds if total.rounds else 0.0,
        verify_cost=verify_cost(total, vanilla),
        divergences=len(margins), near_ties=sum(margin < NEAR_TIE for margin in margins),
        largest_divergence_margin=max(margins, default=None), off_replay=off_replay, sampled=sampled,
        calibrated_speedup=level.speedup if level else None,
        calibrated_speedup_sampled=level.speedup_sampled if level and level.exact else None,
        calibrated_agreement=level.agreement_interval() if level and not level.exact and level.steps else None,
        agreement_interval=agreement.interval,
        speedup_by_category=speed.speedup_by_category,
        speedup_by_category_interval=speed.speedup_by_category_interval, choices=choices, pack=policy is not None,
        round_trips=round_trips(lane.timing) if on_workers else None,
    )


def round_trips(timing: Timing) -> RoundTrips:
    steps = max(timing.steps, 1)
    return RoundTrips(timing.replies.count / steps, timing.replies.wait_ms / steps)


def rpc_report(workers: tuple[rpc.Endpoint, ...], vanilla: VanillaLane, vanilla_sampled: VanillaLane | None) -> RpcResult:
    bare = float(np.mean([rpc.round_trip_ms(worker) for worker in workers]))
    return RpcResult([str(w) for w in workers], bare, round_trips(vanilla.timing),
                     round_trips(vanilla_sampled.timing) if vanilla_sampled else None)


def llama_kwargs(config: BenchConfig) -> dict:
    """llama-cpp-python's Llama arguments for this process's placement (-ngl, -ts, --rpc) and the bench's flash
    attention, so that the vanilla and peer lanes put their layers where the engines do and run the same kernels
    (Llama's flash_attn is on or off: auto is on wherever it can run, and the engines' devices can)."""
    chosen = placement.default()
    return {"n_gpu_layers": chosen.n_gpu_layers, "tensor_split": list(chosen.tensor_split) or None,
            "kv_overrides": chosen.kv_overrides() or None, "flash_attn": config.flash_attn != "off"}


def verify_cost(stats: GenerationStats, vanilla: VanillaLane) -> float | None:
    """One verification batch against one vanilla step, both measured in this run (None without rounds)."""
    if not stats.rounds or not vanilla.timing.steps:
        return None
    return (stats.time_ms["batch"] / stats.rounds) / vanilla.timing.ms


def exit_histogram(exit_layers: Sequence[int | None], n_layer: int) -> list[int]:
    """Counts per exit layer; a token that ran every layer counts at n_layer - 1."""
    layers = [n_layer - 1 if il is None else il for il in exit_layers]
    return np.bincount(np.asarray(layers, dtype=np.int64), minlength=n_layer).tolist()


def time_split(stats: GenerationStats, step_ms: float, draft_ms: float) -> dict[str, float]:
    """ms per decode step. The forward (llama_decode) holds the draft (as the cost lanes measured it, on the
    steps that ran one), the layers, the predictors and the verification; sample is the draw of the step's
    token(s); other is what the step costs besides (the schedule, records, the token's text)."""
    if not stats.n_decode:
        return dict.fromkeys(TIME_PARTS, 0.0)
    ms = {key: value / stats.n_decode for key, value in stats.time_ms.items()}
    draft = draft_ms * stats.drafted / stats.n_decode
    return {
        "draft": draft,
        "layers": ms["forward"] - draft - ms["predictor"] - ms["verify"],
        "predictor": ms["predictor"],
        "verify": ms["verify"],
        "batch": ms["batch"],
        "other": step_ms - ms["forward"] - ms["batch"] - ms["sample"],
        "sample": ms["sample"],
    }
