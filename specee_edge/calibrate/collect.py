"""Stage 1: the model's own answers, with every layer's hidden state captured as they are generated.

Each prompt is answered through the runtime one token at a time, exactly as the engine decodes
(early exit off), and every decode records each layer's output: the hidden states are those of
inference, not of a second batched pass whose rounding can swap near-ties. The full model's top-1
at each step is read from the runtime's own logits. Round 0 answers every prompt greedily; later
rounds answer them again with sampling (another seed per round), for more and more varied steps.
One shard per answer, so an interrupted run picks up where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specee_edge.data.prompts import Prompt
from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.engine.sampling import Sampler, SamplingParams
from specee_edge.runtime.weights import rms_scaled_f16

SAMPLED = SamplingParams(temperature=0.8)  # rounds after the first: llama.cpp's default sampler


@dataclass
class Shard:
    """One answer. Positions are token indices; hidden covers positions start-1 .. len-2."""

    prompt: int            # index of the prompt in the prompt set (answers to one prompt share a split)
    tokens: np.ndarray     # int32 [n_tokens]: prompt then answer
    start: int             # the last prompt position: the first whose next token is generated
    hidden: np.ndarray     # float16 [n_tokens - start, n_layer, n_embd], each vector over its RMS
    final_top1: np.ndarray  # int32 [n_tokens - start - 1]: the runtime's argmax at positions start .. len-2

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.stem + ".tmp.npz")
        np.savez(tmp, prompt=self.prompt, tokens=self.tokens, start=self.start, hidden=self.hidden, final_top1=self.final_top1)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Shard:
        with np.load(path) as z:
            return cls(int(z["prompt"]), z["tokens"], int(z["start"]), z["hidden"], z["final_top1"])

    @property
    def steps(self) -> int:
        return len(self.hidden) - 1

    @staticmethod
    def steps_in(path: Path) -> int:
        """The steps of a saved answer, without reading its hidden states (one final top-1 per step)."""
        with np.load(path) as z:
            return len(z["final_top1"])


def shard_path(workdir: Path, round_: int, index: int) -> Path:
    return workdir / "collect" / f"round{round_}_prompt{index:04d}.npz"


def round_sampling(round_: int, index: int) -> SamplingParams:
    if round_ == 0:
        return GREEDY
    return SamplingParams(**{**SAMPLED.__dict__, "seed": round_ * 100_003 + index})


class Collector:
    def __init__(self, model_path: Path, *, n_threads: int, max_answer: int):
        self.max_answer = max_answer
        n_ctx = 2048
        self.engine = Engine(model_path, pack=None, config=EngineConfig(n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads))
        self.n_layer = self.engine.n_layer
        self.ctx = self.engine.ctx
        self.ctx.enable_early_exit(1)  # no probe layers: the stock graph, plus the capture
        self.ctx.set_capture_layers(list(range(self.n_layer)))

    def _captured(self) -> np.ndarray:
        """[n_rows, n_layer, n_embd] of the last decode, as stored (`rms_scaled_f16`)."""
        return rms_scaled_f16(np.stack([self.ctx.captured(il) for il in range(self.n_layer)], axis=1))

    def answer(self, index: int, prompt: Prompt, sampling: SamplingParams) -> Shard:
        engine, ctx = self.engine, self.ctx
        ctx.clear()
        tokens = engine.prompt_tokens(prompt.text)
        start = len(tokens) - 1
        draw = Sampler(sampling, engine.model.info.n_vocab, tokens)
        ctx.decode(tokens, output_all=True)  # else the last layer keeps only the last row
        hidden = [self._captured()[-2:]]  # positions start-1 and start
        final_top1 = []
        for n in range(self.max_answer):
            final_top1.append(int(np.argmax(ctx.logits())))
            token = draw.from_context(ctx.handle)
            tokens.append(token)
            if engine.model.is_eog(token) or n == self.max_answer - 1 or len(tokens) >= ctx.n_ctx:
                break  # the last token's hidden state predicts nothing we keep
            ctx.decode([token])
            hidden.append(self._captured())
        draw.close()
        return Shard(index, np.asarray(tokens, dtype=np.int32), start, np.concatenate(hidden),
                     np.asarray(final_top1[: len(tokens) - 1 - start], dtype=np.int32))

    def close(self) -> None:
        self.engine.close()
