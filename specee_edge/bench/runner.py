"""Whole answers, lanes in a shuffled order: vanilla llama.cpp, the bare Context, SpecEE per KV mode and quality
level, the peer (llama-cpp-python's own speculative decoding with prompt lookup) and llama-server each decode a
prompt's whole answer alone, then the next lane does, in an order shuffled anew for every prompt; the cost lanes,
in a pass of their own, take vanilla's tokens in turns.

Every lane is timed the same way, as llama-server times itself: a whole answer, decoding only (the prompt pass and
each prompt's first token are not timed), each step with the argmax or sampling of its token. How far machine drift
moves a ratio is the bootstrap's to say (its interval, over prompts), not interleaving's to hide. Vanilla and SpecEE
pay alike for what a user's loop does with each token: detokenizing it and matching stop strings; the bare Context
pays for nothing but the step and the draw.

Under a grammar (bench --grammar, -j, the extract set) every lane decodes under the same GBNF: the lanes drawn by
specee-edge's Sampler with a GrammarConstraint made afresh for each answer (a grammar's state is one reply's), the
engines through their own `grammar=`, the peer through llama-cpp-python's LlamaGrammar; each pays its grammar's cost
inside its timed steps.
"""

from __future__ import annotations

import codecs
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np
from llama_cpp import Llama, llama_cpp
from llama_cpp.llama_grammar import LlamaGrammar
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from specee_edge.bench.report import BARE_CONTEXT, LLAMA_CPP_PYTHON, TIME_PARTS
from specee_edge.engine import GREEDY, Engine, TokenRecord
from specee_edge.engine.constraint import GrammarConstraint
from specee_edge.engine.sampling import Sampler, SamplingParams
from specee_edge.engine.stops import StopMatcher
from specee_edge.errors import SpecEEError
from specee_edge.grammar import Grammar
from specee_edge.runtime import Context, rpc
from specee_edge.runtime.costs import Timing
from specee_edge.runtime.rpc import Endpoint

T = TypeVar("T")


def prompt_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """The sampling of the index-th prompt: every lane draws from the same seed there, so that lanes whose
    distributions are the full model's (vanilla, exact mode) draw the same tokens up to numerical near-ties."""
    return sampling if sampling.greedy else dataclasses.replace(sampling, seed=(sampling.seed or 0) + index)


@dataclass
class Stopwatch:
    """Times a lane's decode steps into its Timing; with RPC workers, also the replies each step waited for."""

    workers: tuple[Endpoint, ...] = ()

    def step(self, timing: Timing, call: Callable[[], T | None]) -> T | None:
        """One step: `call`'s result, its time added to `timing`. None from `call` means there was no step left
        (the answer had ended): nothing is counted."""
        before = rpc.replies(self.workers) if self.workers else None
        start = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - start
        if result is not None:
            timing.add(seconds)
            if before is not None:
                timing.replies += rpc.replies(self.workers) - before
        return result


def decode_rest(tokens: list[int], step: Callable[[int], int], max_tokens: int, is_eog: Callable[[int], bool],
                timing: Timing, watch: Stopwatch) -> None:
    """Extend an answer (its first token drawn from the prompt pass) a timed step at a time: each step feeds the
    last token and draws the next, until max_tokens or an end of generation."""
    while len(tokens) < max_tokens and not is_eog(tokens[-1]):
        tokens.append(watch.step(timing, lambda: step(tokens[-1])))


def decode_answer(lane: AnswerLane, draw: Sampler, handle, step: Callable[[int], int],
                  watch: Stopwatch) -> None:
    """A lane's answer after its prompt pass, drawn by `draw` from the llama.cpp context `handle`: its first token
    from the prompt's logits, then decode_rest; the answer goes to lane.outputs, its grammar's refused draws to
    lane.masked_draws, and the sampler is closed."""
    try:
        tokens = [draw.from_context(handle)]
        lane.outputs.append(tokens)
        decode_rest(tokens, step, lane.max_tokens, lane.is_eog, lane.timing, watch)
    finally:
        lane.masked_draws += draw.masked_draws
        draw.close()


@dataclass
class StepParts:
    """A lane's decode steps split as an engine's are (bench.run.time_split): the decode is `layers`, the draw
    `sample`, and `other` whatever else the lane's timed step does (its loop; vanilla's detokenizing and stop
    strings), so that the bare Context's and Llama.eval's llama_decode can be set side by side."""

    decode_ms: float = 0.0  # summed over the timed steps
    sample_ms: float = 0.0

    def step(self, decode: Callable[[], object], draw: Callable[[], int]) -> int:
        """decode(), then draw(): its token, each one's time added."""
        t0 = time.perf_counter()
        decode()
        t1 = time.perf_counter()
        drawn = draw()
        self.decode_ms += (t1 - t0) * 1e3
        self.sample_ms += (time.perf_counter() - t1) * 1e3
        return drawn

    def per_step(self, timing: Timing) -> dict[str, float]:
        """ms per step of `timing` (the lane's timed steps, which these parts are of) by TIME_PARTS."""
        parts = dict.fromkeys(TIME_PARTS, 0.0)
        if timing.steps:
            decode, sample = self.decode_ms / timing.steps, self.sample_ms / timing.steps
            parts.update(layers=decode, sample=sample, other=timing.ms - decode - sample)
        return parts


class AnswerLane:
    """What every lane that answers a token at a time keeps: its limits, its draw, its timing and its answers.
    constrain: a fresh GrammarConstraint for each answer (None: no grammar)."""

    def __init__(self, max_tokens: int, is_eog: Callable[[int], bool], sampling: SamplingParams = GREEDY,
                 constrain: Callable[[], GrammarConstraint] | None = None):
        self.max_tokens = max_tokens
        self.is_eog = is_eog
        self.sampling = sampling
        self.constrain = constrain
        self.timing = Timing()
        self.outputs: list[list[int]] = []  # generated tokens, one list per prompt
        self.masked_draws: int | None = 0   # draws the grammar refused first, over every answer (None: uncounted)

    def sampler(self, prompt: Sequence[int], n_vocab: int) -> Sampler:
        """The next answer's draw: its prompt's sampling (prompt_sampling), under a fresh grammar."""
        return Sampler(prompt_sampling(self.sampling, len(self.outputs)), n_vocab, prompt,
                       constraint=self.constrain() if self.constrain is not None else None)


class VanillaLane(AnswerLane):
    """The stock llama-cpp-python path: Llama.eval one token at a time; times eval, the draw, the token's text and
    the stop-string matching. Greedy, or sampled by the engine's sampler, llama.cpp's chain (seeded per prompt)."""

    name = LLAMA_CPP_PYTHON

    def __init__(self, llm: Llama, max_tokens: int, is_eog: Callable[[int], bool], sampling: SamplingParams = GREEDY,
                 constrain: Callable[[], GrammarConstraint] | None = None):
        super().__init__(max_tokens, is_eog, sampling, constrain)
        self.llm = llm
        self.parts = StepParts()

    def answer(self, prompt: Sequence[int], watch: Stopwatch) -> None:
        self.timing.begin_prompt()
        self.llm.reset()
        self.llm.eval(prompt)
        draw = self.sampler(prompt, self.llm.n_vocab())
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stops = StopMatcher(())

        def decode(token: int) -> None:
            self.llm.eval([token])
            # on an asynchronous backend (RPC workers, a GPU) eval returns before the step has run: wait for it here,
            # as Context.decode does, so that the draw's time is the draw's
            llama_cpp.llama_synchronize(self.llm.ctx)

        def step(token: int) -> int:
            stops.feed(text.decode(self.llm.detokenize([token])))
            return self.parts.step(lambda: decode(token), lambda: draw.from_context(self.llm.ctx))

        decode_answer(self, draw, self.llm.ctx, step, watch)

    def time_split(self) -> dict[str, float]:
        """ms per decode step by TIME_PARTS: Llama.eval is `layers`, the draw `sample`, the token's text and stop
        strings `other`."""
        return self.parts.per_step(self.timing)


class ContextLane(AnswerLane):
    """The floor of our Python path: the runtime's Context, early exit never enabled, a token at a time with the
    engines' draw (Sampler: a numpy argmax greedy, llama.cpp's chain sampled), nothing else: no text, no stop
    strings, no statistics. Its decode and its draw are timed as an engine times them, so that the bench can set
    an engine's `other` beside the floor's. `name`: another for its repeat lane, a fresh equal twin."""

    name = BARE_CONTEXT

    def __init__(self, ctx: Context, max_tokens: int, is_eog: Callable[[int], bool], sampling: SamplingParams = GREEDY,
                 name: str = BARE_CONTEXT, constrain: Callable[[], GrammarConstraint] | None = None):
        super().__init__(max_tokens, is_eog, sampling, constrain)
        self.name = name
        self.ctx = ctx
        self.parts = StepParts()

    def answer(self, prompt: Sequence[int], watch: Stopwatch) -> None:
        self.timing.begin_prompt()
        self.ctx.clear()
        self.ctx.decode(list(prompt))
        draw = self.sampler(prompt, self.ctx.n_vocab)

        def step(token: int) -> int:  # Context.decode waits for the step on any backend
            return self.parts.step(lambda: self.ctx.decode([token]), lambda: draw.from_context(self.ctx.handle))

        decode_answer(self, draw, self.ctx.handle, step, watch)

    def time_split(self) -> dict[str, float]:
        """ms per decode step by TIME_PARTS: the decode is `layers`, the draw `sample`, and `other` what the lane's
        loop adds around them."""
        return self.parts.per_step(self.timing)


class PeerLane(AnswerLane):
    """What a user would pick instead: llama-cpp-python's own lossless speculative decoding with prompt lookup
    (Llama(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=2)), its README's setting for CPU-only
    machines), through Llama.generate with llama.cpp's sampler chain; a step is one next() of it. A grammar goes in
    as llama-cpp-python's LlamaGrammar (its text only: generate() makes the grammar's sampler afresh for each
    answer), which masks the vocabulary in the chain at every draw; its refused draws are not counted."""

    name = "peer (llama-cpp-python prompt lookup)"

    def __init__(self, model_path: str, n_ctx: int, n_threads: int, max_tokens: int, is_eog: Callable[[int], bool],
                 sampling: SamplingParams = GREEDY, llama_kwargs: dict | None = None, grammar: Grammar | None = None):
        # logits_all: a draft model makes Llama keep every row's logits, but it sizes their array by the argument
        # (n_batch rows when False), so a prompt longer than n_batch broke Llama.eval (`could not broadcast`)
        self.llm = Llama(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=2), logits_all=True, verbose=False,
                         **(llama_kwargs or {}))
        super().__init__(max_tokens, is_eog, sampling)
        self.masked_draws = None  # llama-cpp-python's chain draws: its grammar's refusals are not seen
        self.grammar = LlamaGrammar.from_string(grammar.text, verbose=False) if grammar is not None else None

    def answer(self, prompt: Sequence[int], watch: Stopwatch) -> None:
        s = prompt_sampling(self.sampling, len(self.outputs))
        self.timing.begin_prompt()
        self.llm.reset()
        self.llm.set_seed(s.seed or 0)
        stream = self.llm.generate(list(prompt), top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                                   temp=s.temperature if not s.greedy else 0.0, repeat_penalty=s.repeat_penalty,
                                   grammar=self.grammar)
        try:
            tokens = [next(stream)]
            self.outputs.append(tokens)
            decode_rest(tokens, lambda _: next(stream), self.max_tokens, self.is_eog, self.timing, watch)
        finally:
            stream.close()

    def close(self) -> None:
        self.llm.close()


@dataclass
class SpecEELane:
    """One engine (one KV mode at one level) streaming, under `grammar` if any; a step is one next() of its
    stream."""

    kv_mode: str
    engine: Engine
    max_tokens: int
    sampling: SamplingParams = field(default_factory=lambda: GREEDY)
    grammar: Grammar | None = None
    timing: Timing = field(default_factory=Timing)
    records: list[list[TokenRecord]] = field(default_factory=list)  # one list per prompt
    masked_draws: int = 0  # draws the grammar refused first, over every answer (the engine's stats)
    name: str = field(init=False)  # read while the engine is loaded: closing it lets go of its pack and level

    def __post_init__(self) -> None:
        policy = self.engine.policy
        level = None if policy is None or policy.quality is None else (
            "exact" if self.engine.exact else f"{policy.quality:g}")
        self.name = f"specee-edge {self.kv_mode}" + (f"@{level}" if level else "")

    def answer(self, prompt: Sequence[int], watch: Stopwatch) -> None:
        self.timing.begin_prompt()
        self.engine.reset()  # every lane starts each prompt from an empty cache
        stream = self.engine.stream(prompt, max_tokens=self.max_tokens,
                                    sampling=prompt_sampling(self.sampling, len(self.records)), grammar=self.grammar)
        try:  # closed here: left to the garbage collector, its clean-up would hit a later prompt's cache
            records = [next(stream)]
            self.records.append(records)
            while (record := watch.step(self.timing, lambda: next(stream, None))) is not None:
                records.append(record)
        finally:
            stream.close()  # the stream's end sets the stats' masked_draws
            self.masked_draws += self.engine.stats.masked_draws

    @property
    def outputs(self) -> list[list[int]]:
        return [[r.id for r in records] for records in self.records]

    def decode_records(self) -> list[TokenRecord]:
        """Records of the timed steps (each prompt's first token comes from the prompt pass)."""
        return [r for records in self.records for r in records[1:]]


class Lane(Protocol):
    """A lane: answers a prompt whole, its decode steps timed into `timing` (by `watch`, or by itself: llama-server)."""

    name: str
    timing: Timing
    outputs: list[list[int]]

    def answer(self, prompt: Sequence[int], watch: Stopwatch) -> None: ...


@dataclass
class PassLog:
    """What one decoding pass did: the lanes that failed (by index among the pass's lanes, 0 the reference), each
    with its error in one line, and per prompt the order in which the lanes answered (indices, the same way)."""

    failed: dict[int, str] = field(default_factory=dict)
    order: list[list[int]] = field(default_factory=list)


def run_lanes(prompts: Sequence[Sequence[int]], lanes: Sequence[Lane], rng: np.random.Generator,
              advance: Callable[[int], None] = lambda n: None, *, workers: tuple[Endpoint, ...],
              reference: bool = True) -> PassLog:
    """Every lane answers every prompt whole, one lane after another, in an order `rng` shuffles anew for each
    prompt; `advance` counts answers. workers: the RPC workers the lanes' layers live on (each lane's timing counts
    the replies its steps waited for), required so that no pass, greedy or sampled, leaves them uncounted by
    omission. lanes[0] is the reference (vanilla: the answers quality compares with, the tokens the cost lanes
    decode): where it raises, the run ends with one line (SpecEEError). Any other lane that raises (a peer's bug, a
    server that died) is dropped, a line in the log, and the others go on. reference=False: a pass of other lanes
    alone (llama-server's, after the reference's pass), where any lane that raises is dropped."""
    watch = Stopwatch(workers)
    log = PassLog()
    for prompt in prompts:
        order = [int(i) for i in rng.permutation(len(lanes))]
        log.order.append(order)
        for i in order:
            if i in log.failed:
                continue
            try:
                lanes[i].answer(prompt, watch)
            except Exception as e:  # noqa: BLE001 - any lane's error drops that lane only; the reference's ends the run
                if i == 0 and reference:
                    raise reference_failed(e) from None
                log.failed[i] = one_line(e)
            advance(1)
    return log


def reference_failed(error: BaseException) -> SpecEEError:
    """The run's end where the vanilla lane, every lane's reference, fails to load or to answer: one line."""
    return SpecEEError(f"the vanilla lane ({LLAMA_CPP_PYTHON}, every lane's reference) failed: {one_line(error)}")


def one_line(error: BaseException) -> str:
    """An error as one line: its type and its message's first line."""
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0]}" if message else type(error).__name__
