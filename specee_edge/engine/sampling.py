"""Token sampling on one step's logits (the exit layer's or the last layer's), by llama.cpp's own sampler chain.

logit bias -> penalties -> top-k -> top-p -> min-p -> temperature -> draw. Temperature <= 0 is greedy.
"""

from __future__ import annotations

import ctypes
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import llama_cpp
import numpy as np

from specee_edge.engine.constraint import GrammarConstraint, token_array
from specee_edge.errors import SpecEEError
from specee_edge.runtime.context import LogitsViews
from specee_edge.runtime.model import check_token_ids

# Bounds on the fields that size an allocation or go to llama.cpp as 32-bit integers (where a larger value
# would wrap silently: repeat_last_n = 2**40 reached it as 0, penalties off)
MAX_REPEAT_LAST_N = 1 << 20  # the penalty sampler keeps a ring of this many int32 tokens (4 MiB)
INT32_MAX = 2**31 - 1        # top_k's type in llama.cpp
MAX_SEED = 2**32 - 2         # 2**32 - 1 is LLAMA_DEFAULT_SEED, "a random seed"


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise SpecEEError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def check_n_logprobs(n: int | None, n_vocab: int) -> None:
    """How many alternatives each token's logprobs lists (None: no logprobs): at most the whole vocabulary."""
    if n is not None:
        _check_int("logprobs", n, 0, n_vocab)


@dataclass
class SamplingParams:
    """llama.cpp's defaults; `seed` None draws a fresh seed per generation. Integer fields are refused out of
    their bounds (SpecEEError), never wrapped or clamped."""

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

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Also made by the Sampler: a field may have been set after construction."""
        _check_int("repeat_last_n", self.repeat_last_n, 0, MAX_REPEAT_LAST_N)
        _check_int("top_k", self.top_k, 0, INT32_MAX)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


GREEDY = SamplingParams(temperature=0.0)


def check_logit_bias(bias: Mapping[int, float], n_vocab: int) -> None:
    """The one check of a logit bias, made by the Sampler and, before it queues a request, by the server: token ids
    of the vocabulary, and biases that are finite, or -inf to ban the token (NaN and +inf leave no distribution)."""
    check_token_ids(bias, n_vocab, "logit_bias")
    for token, value in bias.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or value == math.inf:
            raise SpecEEError(f"logit_bias gives token {token} the bias {value!r}: a bias is a finite number,"
                              " or -inf to ban the token")


def apply_logit_bias(logits: np.ndarray, bias: Mapping[int, float]) -> np.ndarray:
    if not bias:
        return logits
    logits = logits.copy()
    ids = np.fromiter(bias, np.int64, len(bias))
    logits[ids] += np.fromiter(bias.values(), np.float32, len(bias))
    return logits


def masks_every_token(logits: np.ndarray, params: SamplingParams) -> bool:
    """Whether the request's logit bias leaves none of `logits` finite (as after a head-free exit, whose
    candidates it may all ban): the caller must find full-vocabulary logits to sample from."""
    if not params.logit_bias:
        return False
    return not np.isfinite(apply_logit_bias(np.asarray(logits, dtype=np.float32), params.logit_bias)).any()


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


def sampler_chain(params: SamplingParams, n_vocab: int) -> llama_cpp.llama_sampler_p:
    """llama.cpp's chain for `params`, in the order of llama-cpp-python's Llama (a seed of None: a random one)."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = lambda sampler: llama_cpp.llama_sampler_chain_add(chain, sampler)
    if params.logit_bias:
        bias = (llama_cpp.llama_logit_bias * len(params.logit_bias))(
            *(llama_cpp.llama_logit_bias(token, value) for token, value in params.logit_bias.items()))
        add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), bias))
    if params.penalized:
        add(llama_cpp.llama_sampler_init_penalties(n_vocab, params.repeat_last_n, params.repeat_penalty,
                                                   params.frequency_penalty, params.presence_penalty))
    if params.greedy:
        add(llama_cpp.llama_sampler_init_greedy())
        return chain
    add(llama_cpp.llama_sampler_init_top_k(params.top_k))
    add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
    add(llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
    add(llama_cpp.llama_sampler_init_temp(params.temperature))
    seed = llama_cpp.LLAMA_DEFAULT_SEED if params.seed is None else params.seed
    add(llama_cpp.llama_sampler_init_dist(seed))
    return chain


class Sampler:
    """One request's draws, through llama.cpp's sampler chain: what llama-cpp-python's Llama samples with, so a
    seed draws the same tokens from the same logits. The chain accepts each drawn token, which its penalties
    look back on after the prompt; tokens that are never drawn (exact mode's drafts) never enter it.
    Greedy decoding with no bias and no penalty needs no chain: an argmax.

    With a grammar, as llama.cpp's own sampler does it: the token drawn from the whole distribution is kept if the
    grammar takes it, else the grammar masks the vocabulary and the token is drawn again (greedy: the best token
    the grammar allows). The grammar, like the chain, moves past drawn tokens only."""

    def __init__(self, params: SamplingParams, n_vocab: int, prompt: Sequence[int] = (),
                 n_logprobs: int | None = None, constraint: GrammarConstraint | None = None):
        self._chain = None  # before the checks: __del__ closes a sampler that failed them too
        self.constraint = constraint
        params.check()
        check_logit_bias(params.logit_bias, n_vocab)
        check_n_logprobs(n_logprobs, n_vocab)
        self.params = params
        self.n_vocab = n_vocab
        self.n_logprobs = n_logprobs
        self.masked_draws = 0  # draws the grammar refused first, drawn again over the masked vocabulary
        self._logits = LogitsViews(n_vocab)  # any llama_context's: the bench draws from llama-cpp-python's too
        if params.greedy and not params.penalized and not params.logit_bias:
            return
        self._chain = sampler_chain(params, n_vocab)
        if params.penalized and params.repeat_last_n:
            for token in prompt[-params.repeat_last_n:]:
                llama_cpp.llama_sampler_accept(self._chain, token)

    def from_context(self, ctx: llama_cpp.llama_context_p, row: int = -1) -> int:
        """The next token from a llama_context's logits of output `row` (the last decode's), read in place."""
        if self._chain is not None and not self.params.logit_bias and self.constraint is None:
            return llama_cpp.llama_sampler_sample(self._chain, ctx, row)  # accepts the token too
        return self(self._logits(ctx, row))

    def __call__(self, logits: np.ndarray) -> int:
        """The next token from full-vocabulary `logits` (a head-free exit's: finite for its candidates only,
        which are all the chain is handed)."""
        token = self._pick(logits)
        if self.constraint is not None and not self.constraint.allows(token):
            self.masked_draws += 1
            masked = self.constraint.mask(logits)
            if not np.isfinite(masked).any():
                raise SpecEEError(f"{self.constraint.grammar.origin}: the grammar allows none of the tokens left "
                                  "(logit_bias bans them?)")
            token = self._pick(masked)
        if self._chain is not None:
            llama_cpp.llama_sampler_accept(self._chain, token)
        if self.constraint is not None:
            self.constraint.accept(token)
        return token

    def _pick(self, logits: np.ndarray) -> int:
        """The chain's choice from `logits`, not yet accepted."""
        if self._chain is None:
            return int(np.argmax(logits))
        if masks_every_token(logits, self.params):
            raise SpecEEError("logit_bias bans every token: nothing is left to sample")
        ids = np.flatnonzero(logits > -np.inf)
        data, array = token_array(ids, logits[ids])  # data: the buffer the array points into, kept alive
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(array))
        return int(array.data[array.selected].id)

    def allows_any(self, logits: np.ndarray) -> bool:
        """Whether the grammar takes any token that `logits` leave finite (a head-free exit's candidates)."""
        return self.constraint is None or bool(np.isfinite(self.constraint.mask(logits)).any())

    def allowed_drafts(self, drafts: Sequence[int]) -> int:
        """How many of exact mode's drafts the grammar would take in order: the rest cannot be accepted."""
        return len(drafts) if self.constraint is None else self.constraint.allowed_prefix(drafts)

    def logprobs(self, logits: np.ndarray, token: int) -> TokenLogprobs | None:
        """None unless the request asked for log-probabilities."""
        return None if self.n_logprobs is None else token_logprobs(logits, token, self.n_logprobs)

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
        if self.constraint is not None:
            self.constraint.close()

    def __del__(self) -> None:
        self.close()
