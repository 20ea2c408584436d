"""Interleaved decoding: vanilla llama.cpp, SpecEE per KV mode and quality level, the peer (llama-cpp-python's
own speculative decoding with prompt lookup) and the cost lanes take turns.

Every lane decodes the same prompts, and within a prompt the lanes take turns token by token, so a
change in machine speed (another process, thermal throttling) hits all of them alike. Only decoding
is timed, not the prompt: each step with the argmax or sampling of its token, as llama-server's
timings count them. Vanilla and SpecEE pay alike for what a user's loop does with each token:
detokenizing it and matching stop strings.
"""

from __future__ import annotations

import codecs
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from specee_edge.bench.report import LLAMA_CPP_PYTHON
from specee_edge.engine import GREEDY, Engine, TokenRecord
from specee_edge.engine.sampling import Sampler, SamplingParams
from specee_edge.engine.stops import StopMatcher
from specee_edge.errors import SpecEEError
from specee_edge.runtime import rpc
from specee_edge.runtime.costs import Timing
from specee_edge.runtime.rpc import Endpoint


def prompt_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """The sampling of the index-th prompt: every lane draws from the same seed there, so that lanes whose
    distributions are the full model's (vanilla, exact mode) draw the same tokens up to numerical near-ties."""
    return sampling if sampling.greedy else dataclasses.replace(sampling, seed=(sampling.seed or 0) + index)


class VanillaLane:
    """The stock llama-cpp-python path: Llama.eval one token at a time; times eval, the draw, the token's text and
    the stop-string matching. Greedy, or sampled by the engine's sampler, llama.cpp's chain (seeded per prompt)."""

    def __init__(self, llm: Llama, max_tokens: int, is_eog: Callable[[int], bool], sampling: SamplingParams = GREEDY):
        self.llm = llm
        self.max_tokens = max_tokens
        self.is_eog = is_eog
        self.sampling = sampling
        self.timing = Timing()
        self.outputs: list[list[int]] = []  # generated tokens, one list per prompt
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopMatcher(())
        self._draw: Sampler | None = None  # the prompt's, seeded for it

    def start(self, prompt: Sequence[int]) -> None:
        self.timing.begin_prompt()
        self.llm.reset()
        self.llm.eval(prompt)
        if self._draw is not None:
            self._draw.close()
        self._draw = Sampler(prompt_sampling(self.sampling, len(self.outputs)), self.llm.n_vocab(), prompt)
        self.outputs.append([self._draw.from_context(self.llm.ctx)])
        self._text.reset()
        self._stops = StopMatcher(())

    def next_input(self) -> int | None:
        """The token the next step feeds, or None when this prompt's answer is complete."""
        tokens = self.outputs[-1]
        if len(tokens) >= self.max_tokens or self.is_eog(tokens[-1]):
            return None
        return tokens[-1]

    def step(self, token: int) -> None:
        start = time.perf_counter()
        self._stops.feed(self._text.decode(self.llm.detokenize([token])))
        self.llm.eval([token])  # on an asynchronous backend (RPC workers, a GPU) this returns before the step has run:
        self.outputs[-1].append(self._draw.from_context(self.llm.ctx))  # reading the logits waits for it, timed too
        self.timing.add(time.perf_counter() - start)


class PeerLane:
    """What a user would pick instead: llama-cpp-python's own lossless speculative decoding with prompt lookup
    (Llama(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=2)), its README's setting for CPU-only
    machines), through Llama.generate with llama.cpp's sampler chain; a step is one next() of it."""

    def __init__(self, model_path: str, n_ctx: int, n_threads: int, max_tokens: int, is_eog: Callable[[int], bool],
                 sampling: SamplingParams = GREEDY, llama_kwargs: dict | None = None):
        # logits_all: a draft model makes Llama keep every row's logits, but it sizes their array by the argument
        # (n_batch rows when False), so a prompt longer than n_batch broke Llama.eval (`could not broadcast`)
        self.llm = Llama(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=2), logits_all=True, verbose=False,
                         **(llama_kwargs or {}))
        self.max_tokens = max_tokens
        self.is_eog = is_eog
        self.sampling = sampling
        self.timing = Timing()
        self.outputs: list[list[int]] = []
        self._tokens: Iterator[int] | None = None

    def start(self, prompt: Sequence[int]) -> None:
        s = prompt_sampling(self.sampling, len(self.outputs))
        self.timing.begin_prompt()
        self.llm.reset()
        self.llm.set_seed(s.seed or 0)
        self._tokens = self.llm.generate(list(prompt), top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                                         temp=s.temperature if not s.greedy else 0.0, repeat_penalty=s.repeat_penalty)
        self.outputs.append([next(self._tokens)])

    def step(self) -> bool:
        tokens = self.outputs[-1]
        if self._tokens is None or len(tokens) >= self.max_tokens or self.is_eog(tokens[-1]):
            self.end()
            return False
        start = time.perf_counter()
        token = next(self._tokens)
        self.timing.add(time.perf_counter() - start)
        tokens.append(token)
        return True

    def end(self) -> None:
        if self._tokens is not None:
            self._tokens.close()
            self._tokens = None

    def close(self) -> None:
        self.end()
        self.llm.close()


@dataclass
class SpecEELane:
    """One engine (one KV mode at one level) streaming; a step is one next() of its stream."""

    kv_mode: str
    engine: Engine
    max_tokens: int
    sampling: SamplingParams = field(default_factory=lambda: GREEDY)
    timing: Timing = field(default_factory=Timing)
    records: list[list[TokenRecord]] = field(default_factory=list)  # one list per prompt
    _stream: Iterator[TokenRecord] | None = field(default=None, init=False, repr=False)

    def start(self, prompt: Sequence[int]) -> None:
        self.timing.begin_prompt()
        self.engine.reset()  # every lane starts each prompt from an empty cache
        self._stream = self.engine.stream(prompt, max_tokens=self.max_tokens,
                                          sampling=prompt_sampling(self.sampling, len(self.records)))
        self.records.append([next(self._stream)])

    def step(self) -> bool:
        """Decode one token; False when the answer is complete."""
        if self._stream is None:
            return False
        start = time.perf_counter()
        try:
            record = next(self._stream)
        except StopIteration:
            self._stream = None
            return False
        self.timing.add(time.perf_counter() - start)
        self.records[-1].append(record)
        return True

    def end(self) -> None:
        """Close the stream now: left to the garbage collector, its clean-up would hit a later prompt's cache."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    @property
    def outputs(self) -> list[list[int]]:
        return [[r.id for r in records] for records in self.records]

    def decode_records(self) -> list[TokenRecord]:
        """Records of the timed steps (each prompt's first token comes from the prompt pass)."""
        return [r for records in self.records for r in records[1:]]


class Lane(Protocol):
    """A lane that decodes on its own (SpecEE, the peer, a llama-server): start a prompt, then step until False."""

    timing: Timing
    outputs: list[list[int]]

    def start(self, prompt: Sequence[int]) -> None: ...

    def step(self) -> bool: ...

    def end(self) -> None: ...


class FedLane(Protocol):
    """A lane that decodes the tokens vanilla produced (teacher forcing): the cost lanes."""

    timing: Timing

    def start(self, prompt: Sequence[int]) -> None: ...

    def step(self, token: int) -> None: ...


def run_interleaved(prompts: Sequence[Sequence[int]], vanilla: VanillaLane, specee: Sequence[Lane],
                    fed: Sequence[FedLane], advance: Callable[[int], None] = lambda n: None,
                    workers: tuple[Endpoint, ...] = ()) -> dict[int, str]:
    """Decode every prompt with every lane, token by token in turns; `advance` counts steps. The fed lanes
    (the cost lanes) step in a new random order at each token, as calibration's do (runtime/costs.py).
    workers: the RPC workers the lanes' layers live on; each lane's timing counts the replies its steps waited for.
    A lane of `specee` that raises (a peer's bug, a server that died) is dropped and the others go on: returns
    those lanes, by index, each with its error in one line. Vanilla is every lane's reference (the tokens the fed
    lanes decode, the answers quality compares with): where it raises, the run ends with one line (SpecEEError)."""
    order = np.random.default_rng(0)
    failed: dict[int, str] = {}

    def counted(lane: Lane | VanillaLane | FedLane, *token: int):
        if not workers:
            return lane.step(*token)
        before = rpc.replies(workers)
        result = lane.step(*token)
        lane.timing.replies += rpc.replies(workers) - before
        return result

    def guarded(i: int, call: Callable[[], bool | None]) -> bool:
        try:
            return bool(call())
        except Exception as e:  # noqa: BLE001 - any lane's error drops that lane only
            failed[i] = one_line(e)
            try:
                specee[i].end()
            except Exception:  # noqa: BLE001 - its clean-up may fail the same way
                pass
            return False

    def live() -> list[int]:
        return [i for i in range(len(specee)) if i not in failed]

    def reference(call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - without its answers no lane can be compared: one line, not a trace
            raise SpecEEError(f"the vanilla lane ({LLAMA_CPP_PYTHON}, every lane's reference) failed: "
                              f"{one_line(e)}") from None

    steps = vanilla.max_tokens - 1
    for prompt in prompts:
        reference(lambda: vanilla.start(prompt))
        for i in live():
            guarded(i, lambda: specee[i].start(prompt))
        for lane in fed:
            lane.start(prompt)
        for done in range(steps):
            token = vanilla.next_input()
            busy = token is not None
            if busy:
                reference(lambda: counted(vanilla, token))
                for j in order.permutation(len(fed)):
                    counted(fed[j], token)
            for i in live():
                busy |= guarded(i, lambda: counted(specee[i]))
            if not busy:
                advance(steps - done)
                break
            advance(1)
        for i in live():
            guarded(i, lambda: specee[i].end())
    return failed


def one_line(error: BaseException) -> str:
    """An error as one line: its type and its message's first line."""
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0]}" if message else type(error).__name__
