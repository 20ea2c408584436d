"""Token sampling on one step's logits (the exit layer's or the last layer's), llama.cpp's chain order.

logit bias -> penalties -> top-k -> top-p -> min-p -> temperature -> draw. Temperature <= 0 is greedy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from specee_edge.errors import SpecEEError


@dataclass
class SamplingParams:
    """llama.cpp's defaults; `seed` None draws a fresh seed per generation."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0     # llama.cpp's penalties, over the last repeat_last_n tokens:
    frequency_penalty: float = 0.0  #   logit / repeat (or * where negative) - count * frequency - presence
    presence_penalty: float = 0.0
    repeat_last_n: int = 64
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # added to the token's logit first
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


GREEDY = SamplingParams(temperature=0.0)


def apply_logit_bias(logits: np.ndarray, bias: Mapping[int, float]) -> np.ndarray:
    if not bias:
        return logits
    logits = logits.copy()
    ids = np.fromiter(bias, np.int64, len(bias))
    logits[ids] += np.fromiter(bias.values(), np.float32, len(bias))
    return logits


def apply_penalties(logits: np.ndarray, history: Sequence[int], params: SamplingParams) -> np.ndarray:
    """llama.cpp's llama_sampler_penalties: each token seen in the window is divided by the repeat penalty
    (multiplied where negative), then lowered by its count times the frequency penalty plus the presence
    penalty."""
    if not params.penalized or not history or params.repeat_last_n == 0:
        return logits
    ids, counts = np.unique(np.asarray(history[-params.repeat_last_n:], dtype=np.int64), return_counts=True)
    logits = logits.copy()
    picked = logits[ids]
    picked = np.where(picked > 0, picked / params.repeat_penalty, picked * params.repeat_penalty)
    logits[ids] = picked - counts * params.frequency_penalty - params.presence_penalty
    return logits


def masks_every_token(logits: np.ndarray, params: SamplingParams) -> bool:
    """Whether the request's logit bias leaves none of `logits` finite (as after a head-free exit, whose
    candidates it may all ban): the caller must find full-vocabulary logits to sample from."""
    if not params.logit_bias:
        return False
    return not np.isfinite(apply_logit_bias(np.asarray(logits, dtype=np.float32), params.logit_bias)).any()


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, history: Sequence[int] = ()) -> int:
    logits = np.asarray(logits, dtype=np.float32)
    if params.logit_bias:  # only a bias can leave no token (a head-free exit's candidates are finite)
        logits = apply_logit_bias(logits, params.logit_bias)
        if not np.isfinite(logits.max()):
            raise SpecEEError("logit_bias bans every token: nothing is left to sample")
    logits = apply_penalties(logits, history, params)
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


@dataclass
class TokenLogprobs:
    """A drawn token's log-probability under the model's distribution at its step (the logits before bias,
    penalties, truncation and temperature), and the `n` most likely tokens' (OpenAI's logprobs)."""

    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: np.ndarray, token: int, n: int) -> TokenLogprobs:
    """`logits` must be full-vocabulary (finite): a head-free exit's candidates-only logits would
    normalise over 4 tokens."""
    z = np.asarray(logits, dtype=np.float64)
    log_probs = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    top = np.argpartition(log_probs, -n)[-n:] if 0 < n < len(z) else np.arange(len(z) if n else 0)
    top = top[np.argsort(-log_probs[top], kind="stable")]
    return TokenLogprobs(float(log_probs[token]), [(int(t), float(log_probs[t])) for t in top])


class Sampler:
    """One request's draws: its sampling, a generator seeded once, and the tokens the penalties look back on
    (the prompt, then the reply as the caller appends it)."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], n_logprobs: int | None = None):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.history = list(prompt)
        self.n_logprobs = n_logprobs

    def __call__(self, logits: np.ndarray, pending: Sequence[int] = ()) -> int:
        """The next token from `logits`, `pending` tokens after the reply so far."""
        window = [*self.history, *pending] if pending and self.params.penalized else self.history
        return sample(logits, self.params, self.rng, window)

    def logprobs(self, logits: np.ndarray, token: int) -> TokenLogprobs | None:
        """None unless the request asked for log-probabilities."""
        return None if self.n_logprobs is None else token_logprobs(logits, token, self.n_logprobs)
