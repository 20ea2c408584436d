"""Quality of SpecEE's outputs: agreement with the full model, exact prefix, held-out perplexity."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specee_edge.engine import GREEDY, Engine
from specee_edge.runtime import Context


def full_model_argmax(ctx: Context, prompt: Sequence[int], output: Sequence[int]) -> np.ndarray:
    """Teacher forcing: the full model's argmax at each decode step of `output` (the steps giving output[1:]).

    One token per decode, as generation runs: a batched pass takes other matmul kernels and by itself
    disagrees with sequential greedy decoding on a few percent of near-tie steps.
    """
    ctx.clear()
    ctx.decode(list(prompt))
    argmax = []
    for token in output[:-1]:
        ctx.decode([token])
        argmax.append(int(np.argmax(ctx.logits())))
    return np.array(argmax, dtype=np.int64)


def agreement(ctx: Context, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
              advance: Callable[[float], None] = lambda n: None) -> float:
    """Share of decode steps whose token equals the full model's argmax there (1.0 without steps)."""
    matches = steps = 0
    for prompt, output in zip(prompts, outputs):
        if len(output) < 2:
            continue
        reference = full_model_argmax(ctx, prompt, output)
        matches += int(np.sum(reference == np.asarray(output[1:])))
        steps += len(reference)
        advance(len(reference))
    return matches / steps if steps else 1.0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def exact_prefix(reference: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> float:
    """Mean number of generated tokens before the first divergence from `reference` (vanilla greedy)."""
    return float(np.mean([common_prefix(r, o) for r, o in zip(reference, outputs)]))


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    z = logits.astype(np.float64)
    top = z.max()
    return float(z[token] - top - np.log(np.sum(np.exp(z - top))))


@dataclass
class Perplexity:
    value: float  # the engine's logits: exits divided by their layer's calibrated temperature
    raw: float    # the exits' logits as the layer computes them


def perplexity(engine: Engine, tokens: Sequence[int], *, early_exit: bool,
               advance: Callable[[float], None] = lambda n: None) -> Perplexity:
    """Teacher forcing through the engine one token at a time, exits on or off: exp(mean NLL of tokens[1:]),
    with and without the pack's temperatures (one pass: the tokens' exits are the same)."""
    previous = engine.early_exit
    engine.set_early_exit(early_exit)
    engine.reset()
    try:
        for _ in engine.stream(tokens[:1], max_tokens=1, sampling=GREEDY):  # the first token, as a prompt
            pass
        nll = raw_nll = 0.0
        for i, token in enumerate(tokens[1:], 1):
            nll -= log_softmax_at(engine.logits(), token)
            raw_nll -= log_softmax_at(engine.ctx.logits(), token)
            if i < len(tokens) - 1:
                engine._forward(token)  # the token's step, exits as the policy decides
            advance(1)
    finally:
        engine.set_early_exit(previous)
        engine.reset()
    n = max(len(tokens) - 1, 1)
    return Perplexity(float(np.exp(nll / n)), float(np.exp(raw_nll / n)))
