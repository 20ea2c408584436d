"""Stage 1: the model's own answers, and every layer's hidden states along them.

Each prompt is answered greedily through the runtime (early exit off), then prompt + answer are
decoded again as one batch with every layer's output captured: one shard per prompt, so an
interrupted run picks up where it stopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specee_edge.data.prompts import Prompt
from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.runtime import Context


@dataclass
class Shard:
    """One prompt's answer. Positions are token indices; hidden covers positions start-1 .. len-2."""

    tokens: np.ndarray  # int32 [n_tokens]: prompt then answer
    start: int          # the last prompt position: the first whose next token is generated
    hidden: np.ndarray  # float16 [n_tokens - start, n_layer, n_embd]

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.stem + ".tmp.npz")
        np.savez(tmp, tokens=self.tokens, start=self.start, hidden=self.hidden)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Shard:
        with np.load(path) as z:
            return cls(z["tokens"], int(z["start"]), z["hidden"])


def shard_path(workdir: Path, index: int) -> Path:
    return workdir / "collect" / f"prompt_{index:04d}.npz"


class Collector:
    def __init__(self, model_path: Path, *, n_threads: int, max_answer: int):
        self.max_answer = max_answer
        n_ctx = 2048
        self.engine = Engine(model_path, pack=None, config=EngineConfig(n_ctx=n_ctx, n_threads=n_threads))
        self.n_layer = self.engine.n_layer
        # one ubatch per decode, so each layer's capture holds every position
        self.capture = Context(self.engine.model, n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads)
        self.capture.enable_early_exit(1)
        self.capture.set_capture_layers(list(range(self.n_layer)))

    def answer(self, prompt: Prompt) -> Shard:
        engine = self.engine
        engine.reset()
        text = engine.format_chat([{"role": "user", "content": prompt.text}])
        prompt_tokens = engine.tokenize(text)
        answer = engine.generate(prompt_tokens, max_tokens=self.max_answer, sampling=GREEDY)
        tokens = prompt_tokens + answer.tokens
        start = len(prompt_tokens) - 1
        self.capture.clear()
        self.capture.decode(tokens[:-1], output_all=True)  # the last token's hidden state predicts nothing we keep
        hidden = np.stack([self.capture.captured(il)[start - 1 :] for il in range(self.n_layer)], axis=1)
        return Shard(np.asarray(tokens, dtype=np.int32), start, hidden.astype(np.float16))

    def close(self) -> None:
        self.capture.close()
        self.engine.close()


def forward_ms(model_path: Path, n_threads: int, n: int = 32) -> float:
    """Median time of one single-token forward of the target (the unit of the draft's cost)."""
    engine = Engine(model_path, pack=None, config=EngineConfig(n_ctx=512, n_threads=n_threads))
    try:
        ctx = engine.ctx
        ctx.decode(engine.tokenize("The draft head costs a share of this forward."))
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            ctx.decode([int(np.argmax(ctx.logits()))])
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3
    finally:
        engine.close()
