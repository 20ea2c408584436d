"""A linear draft head over a reduced vocabulary (trained by `specee-edge calibrate`).

    x = [embedding(y_s); final_norm(h_{s-1})]        h_{s-1} from the layer where step s-1 left
    g = fc.weight @ x + fc.bias                      a guess at final_norm(h_s)
    candidates = top-k of head.weight @ g            head.weight: LM-head rows of the draft vocabulary

The draft vocabulary is the most frequent tokens of the calibration answers (vocab_map gives their
target ids): scoring it costs a fraction of the full LM head.

With prompt lookup (draft.lookup), the lookup's token takes the first slot and the draft fills the
others with its best tokens but that one: `merged_top_k` is what the graph computes (patches/0007).
"""

from __future__ import annotations

import numpy as np

from specee_edge.errors import SpecEEError
from specee_edge.pack.format import DraftHead
from specee_edge.runtime.weights import TargetWeights, final_norm

LINEAR_DRAFT_KIND = "linear"
EMBEDDING_CACHE_ROWS = 8192


class LinearDraft:
    def __init__(self, head: DraftHead, weights: TargetWeights, k: int):
        if head.kind != LINEAR_DRAFT_KIND:
            raise SpecEEError(f"the engine runs {LINEAR_DRAFT_KIND!r} draft heads; this pack holds a {head.kind!r} one")
        t = head.tensors
        try:
            fc = t["fc.weight"]
            self.n_embd = fc.shape[0]
            # fc over [embedding; hidden] split in two, so nothing is concatenated per token
            self.w_embd = np.ascontiguousarray(fc[:, : self.n_embd])
            self.w_hidden = np.ascontiguousarray(fc[:, self.n_embd :])
            self.bias = t["fc.bias"]
            self.head = np.ascontiguousarray(t["head.weight"])
            self.gamma = t["norm.weight"]
            self.eps = float(t["norm.eps"][0])
        except KeyError as e:
            raise SpecEEError(f"linear draft head lacks tensor draft.{e.args[0]}") from None
        n_out = self.head.shape[0]
        self.vocab_map = np.arange(n_out) if head.vocab_map is None else np.asarray(head.vocab_map, dtype=np.int64)
        if len(self.vocab_map) != n_out or self.w_hidden.shape != (self.n_embd, self.n_embd):
            raise SpecEEError("linear draft head: inconsistent tensor shapes")
        self.k = k
        self.quant = head.quant  # how the runtime stores the matrices, as the pack does
        self._weights = weights
        self._embeddings: dict[int, np.ndarray] = {}

    def runtime_args(self) -> dict:
        """Context.set_draft's arguments: the head as the runtime holds it."""
        return dict(w_embd=self.w_embd, w_hidden=self.w_hidden, bias=self.bias, norm=self.gamma, eps=self.eps,
                    head=self.head, vocab_map=self.vocab_map, quant=self.quant)

    def embedding(self, token: int) -> np.ndarray:
        row = self._embeddings.get(token)
        if row is None:  # dequantizing one row costs ~0.2 ms; text reuses few tokens
            if len(self._embeddings) >= EMBEDDING_CACHE_ROWS:
                self._embeddings.pop(next(iter(self._embeddings)))
            row = self._embeddings[token] = self._weights.embeddings(token)[0]
        return row

    def normed(self, hidden: np.ndarray) -> np.ndarray:
        return final_norm(hidden, self.gamma, self.eps)

    def propose(self, token: int, hidden: np.ndarray) -> np.ndarray:
        """k target token ids, best first, for the position after `token`; `hidden` is h_{s-1} (not normed)."""
        return self.top_k(self.scores(self.embedding(token), hidden))

    def scores(self, embedding: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        """Draft-vocabulary scores for [n_embd] or [rows, n_embd] inputs."""
        guess = embedding @ self.w_embd.T + self.normed(hidden) @ self.w_hidden.T + self.bias
        return guess @ self.head.T

    def top_k(self, scores: np.ndarray) -> np.ndarray:
        """Target ids of the k best scores (last axis), best first."""
        top = np.argpartition(scores, -self.k, axis=-1)[..., -self.k :]
        order = np.argsort(-np.take_along_axis(scores, top, axis=-1), axis=-1)
        return self.vocab_map[np.take_along_axis(top, order, axis=-1)]

    def merged_top_k(self, scores: np.ndarray, lookup: np.ndarray) -> np.ndarray:
        """[rows, k] candidates: each row's lookup token first (-1: none, the draft takes every slot),
        then the draft's best tokens other than it, as the graph merges them."""
        lookup = np.asarray(lookup, dtype=np.int64)
        scores = np.array(scores, dtype=np.float32)
        rows = np.flatnonzero(lookup >= 0)
        order = np.argsort(self.vocab_map, kind="stable")
        at = np.minimum(np.searchsorted(self.vocab_map, lookup[rows], sorter=order), len(order) - 1)
        in_draft = self.vocab_map[order[at]] == lookup[rows]
        scores[rows[in_draft], order[at[in_draft]]] = -np.inf
        ranked = self.top_k(scores)
        merged = np.concatenate([lookup[:, None], ranked[:, :-1]], axis=1)
        return np.where(lookup[:, None] >= 0, merged, ranked)
