"""Token sampling on one step's logits (the exit layer's or the last layer's), llama.cpp's chain order.

penalties -> top-k -> top-p -> min-p -> temperature -> draw. Temperature <= 0 is greedy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingParams:
    """llama.cpp's defaults; `seed` None draws a fresh seed per generation."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = SamplingParams(temperature=0.0)


def apply_repeat_penalty(logits: np.ndarray, history: Sequence[int], penalty: float, last_n: int) -> np.ndarray:
    if penalty == 1.0 or not history or last_n == 0:
        return logits
    ids = np.unique(np.asarray(history[-last_n:], dtype=np.int64))
    logits = logits.copy()
    picked = logits[ids]
    logits[ids] = np.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, history: Sequence[int] = ()) -> int:
    logits = apply_repeat_penalty(np.asarray(logits, dtype=np.float32), history, params.repeat_penalty, params.repeat_last_n)
    if params.greedy:
        return int(np.argmax(logits))

    # candidates sorted by logit, best first; top-k bounds the sort
    k = params.top_k if 0 < params.top_k < len(logits) else len(logits)
    ids = np.argpartition(logits, -k)[-k:] if k < len(logits) else np.arange(len(logits))
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    z = logits[ids].astype(np.float64)
    probs = np.exp(z - z[0])
    probs /= probs.sum()

    if params.top_p < 1.0:  # the smallest prefix whose mass reaches top_p
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        ids, z, probs = ids[:keep], z[:keep], probs[:keep]
    if params.min_p > 0.0:  # probs[0] is the largest
        keep = probs >= params.min_p * probs[0]
        ids, z = ids[keep], z[keep]

    p = np.exp((z - z[0]) / params.temperature)
    return int(rng.choice(ids, p=p / p.sum()))
