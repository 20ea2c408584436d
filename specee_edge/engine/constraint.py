"""One reply's grammar, as llama.cpp's grammar sampler runs it: which tokens the reply may take next.

A grammar is checked the way llama.cpp's own sampler checks it: the token drawn from the whole distribution is
tested alone first, and only when the grammar refuses it is the whole vocabulary masked and the token drawn again
(a mask over 151,936 tokens costs milliseconds; a test of one token, microseconds). The grammar advances by the
tokens that are emitted, and by nothing else: exact mode's drafts are tested on a copy.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp
import numpy as np

from specee_edge.errors import SpecEEError
from specee_edge.grammar import ROOT, Grammar
from specee_edge.runtime import Model
from specee_edge.runtime.logging import caught_messages

# llama_token_data as numpy lays it out, to hand llama.cpp an array of candidates without a copy per element
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)
assert TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


def token_array(ids: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, llama_cpp.llama_token_data_array]:
    """llama.cpp's candidates array over `ids` with their `logits`, and the numpy buffer that holds it (keep it
    alive while llama.cpp reads the array)."""
    data = np.empty(len(ids), TOKEN_DATA)
    data["id"], data["logit"], data["p"] = ids, logits, 0.0
    return data, llama_cpp.llama_token_data_array(data.ctypes.data_as(llama_cpp.llama_token_data_p), len(ids), -1,
                                                  False)


def _refusal(lines: Sequence[str]) -> str:
    """The reason in what llama.cpp said when it refused a grammar: its parser's error, else its log's."""
    for line in lines:
        if "error parsing grammar:" in line:
            return line.split("error parsing grammar:", 1)[1].strip()
    reasons = [line.strip() for line in lines if line.strip() and "failed to parse grammar" not in line]
    return reasons[0] if reasons else "llama.cpp refused it"


class GrammarConstraint:
    """A grammar sampler over a model's vocabulary, for one reply."""

    def __init__(self, model: Model, grammar: Grammar, sampler: llama_cpp.llama_sampler_p | None = None):
        self.model, self.grammar = model, grammar
        self._sampler = sampler
        if sampler is not None:
            return
        with caught_messages() as said:
            self._sampler = llama_cpp.llama_sampler_init_grammar(model.vocab_handle, grammar.text.encode(),
                                                                 ROOT.encode())
        if not self._sampler:
            self._sampler = None
            raise SpecEEError(f"{grammar.origin}: the grammar does not parse: {_refusal(said)}")

    def allows(self, token: int) -> bool:
        """The grammar takes `token` next (tested alone)."""
        data, array = token_array(np.array([token], np.int32), np.zeros(1, np.float32))
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))
        return bool(np.isfinite(data["logit"][0]))

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` (full vocabulary, or -inf where a head-free exit computed none) with -inf wherever the grammar
        refuses the token."""
        ids = np.flatnonzero(logits > -np.inf).astype(np.int32)
        data, array = token_array(ids, logits[ids])
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))
        masked = np.full_like(logits, -np.inf)
        masked[ids] = data["logit"]
        return masked

    def accept(self, token: int) -> None:
        """The reply took `token`: the grammar moves past it."""
        llama_cpp.llama_sampler_accept(self._sampler, token)

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar takes from here (exact mode's drafts; the grammar itself
        does not move)."""
        trial = GrammarConstraint(self.model, self.grammar, llama_cpp.llama_sampler_clone(self._sampler))
        try:
            for n, token in enumerate(tokens):
                if not trial.allows(token):
                    return n
                trial.accept(token)
            return len(tokens)
        finally:
            trial.close()

    def close(self) -> None:
        if self._sampler is not None:
            llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:
        self.close()
