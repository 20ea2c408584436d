"""Interleaved decoding: vanilla llama.cpp, SpecEE per KV mode and quality level, and the cost lanes
take turns.

Every lane decodes the same prompts, and within a prompt the lanes take turns token by token, so a
change in machine speed (another process, thermal throttling) hits all of them alike. Only decode
time is counted: the prompt, and the argmax or sampling of each token, are not. Vanilla and SpecEE
pay alike for what a user's loop does with each token: detokenizing it and matching stop strings.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import llama_cpp
import numpy as np
from llama_cpp import Llama

from specee_edge.engine import GREEDY, Engine, TokenRecord
from specee_edge.engine.stops import StopMatcher
from specee_edge.runtime.costs import Timing


class VanillaLane:
    """The stock llama-cpp-python path: Llama.eval one token at a time, greedy; times eval, the token's text
    and the stop-string matching."""

    def __init__(self, llm: Llama, max_tokens: int, is_eog: Callable[[int], bool]):
        self.llm = llm
        self.max_tokens = max_tokens
        self.is_eog = is_eog
        self.timing = Timing()
        self.outputs: list[list[int]] = []  # generated tokens, one list per prompt
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopMatcher(())

    def start(self, prompt: Sequence[int]) -> None:
        self.llm.reset()
        self.llm.eval(prompt)
        self.outputs.append([self._argmax()])
        self._text.reset()
        self._stops = StopMatcher(())

    def _argmax(self) -> int:
        # Llama.eval keeps no scores without logits_all: read the last token's logits from llama.cpp
        logits = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),))))

    def next_input(self) -> int | None:
        """The token the next step feeds, or None when this prompt's answer is complete."""
        tokens = self.outputs[-1]
        if len(tokens) >= self.max_tokens or self.is_eog(tokens[-1]):
            return None
        return tokens[-1]

    def step(self, token: int) -> None:
        start = time.perf_counter()
        self._stops.feed(self._text.decode(self.llm.detokenize([token])))
        self.llm.eval([token])
        self.timing.add(time.perf_counter() - start)
        self.outputs[-1].append(self._argmax())


@dataclass
class SpecEELane:
    """One engine (one KV mode) streaming greedily; a step is one next() of its stream, less sampling."""

    kv_mode: str
    engine: Engine
    max_tokens: int
    timing: Timing = field(default_factory=Timing)
    records: list[list[TokenRecord]] = field(default_factory=list)  # one list per prompt
    _stream: Iterator[TokenRecord] | None = field(default=None, init=False, repr=False)

    def start(self, prompt: Sequence[int]) -> None:
        self.engine.reset()  # every lane starts each prompt from an empty cache
        self._stream = self.engine.stream(prompt, max_tokens=self.max_tokens, sampling=GREEDY)
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
        self.timing.add(time.perf_counter() - start - record.sample_ms / 1e3)
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


class FedLane(Protocol):
    """A lane that decodes the tokens vanilla produced (teacher forcing): the cost lanes."""

    timing: Timing

    def start(self, prompt: Sequence[int]) -> None: ...

    def step(self, token: int) -> None: ...


def run_interleaved(prompts: Sequence[Sequence[int]], vanilla: VanillaLane, specee: Sequence[SpecEELane],
                    fed: Sequence[FedLane], advance: Callable[[int], None] = lambda n: None) -> None:
    """Decode every prompt with every lane, token by token in turns; `advance` counts steps."""
    steps = vanilla.max_tokens - 1
    for prompt in prompts:
        vanilla.start(prompt)
        for lane in (*specee, *fed):
            lane.start(prompt)
        for done in range(steps):
            token = vanilla.next_input()
            busy = token is not None
            if busy:
                vanilla.step(token)
                for lane in fed:
                    lane.step(token)
            for lane in specee:
                busy |= lane.step()
            if not busy:
                advance(steps - done)
                break
            advance(1)
        for lane in specee:
            lane.end()
