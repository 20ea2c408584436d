"""Stage 3: the linear draft head, fitted by ridge regression (numpy, closed form).

Target: final_norm(h_s), so that the LM head rows of the draft vocabulary read it like the model's own
head. Steps whose previous token could have left early appear twice, once with h_{s-1} from the
last layer and once from its oracle exit layer, so the head stays good after an early exit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import gguf
import numpy as np
from threadpoolctl import threadpool_limits

from specee_edge.calibrate.dataset import Dataset
from specee_edge.draft import LINEAR_DRAFT_KIND, LinearDraft
from specee_edge.pack.format import DraftHead
from specee_edge.runtime.weights import TargetWeights


@dataclass
class DraftReport:
    vocab: int
    vocab_coverage: float    # held-out next tokens inside the draft vocabulary
    recall_at_1: float
    recall_at_k: float
    recall_at_k_after_exit: float  # with h_{s-1} from the previous token's oracle exit layer
    ms_per_token: float
    cost_share: float        # of one target forward


def draft_vocabulary(next_tokens: np.ndarray, size: int, n_vocab: int) -> np.ndarray:
    """The `size` most frequent next tokens, topped up with the lowest ids (BPE's earliest merges)."""
    ids, counts = np.unique(next_tokens, return_counts=True)
    chosen = ids[np.argsort(-counts, kind="stable")][:size]
    rest = np.setdiff1d(np.arange(n_vocab), chosen)[: size - len(chosen)]
    return np.concatenate([chosen, rest]).astype(np.int32)


def quantized(array: np.ndarray, qtype=gguf.GGMLQuantizationType.Q8_0) -> np.ndarray:
    """What the pack will hold: the array through a quantize/dequantize round trip."""
    return gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(array, np.float32), qtype), qtype).reshape(array.shape)


def fit_draft(ds: Dataset, weights: TargetWeights, train: np.ndarray, test: np.ndarray, *, k: int, vocab: int,
              forward_ms: float, ridge: float = 1.0) -> tuple[DraftHead, DraftReport]:
    """forward_ms: one single-token forward of the target, timed just before (the draft's cost is a share of it)."""
    gamma, eps = weights.output_norm, weights.rms_eps
    tokens = np.unique(ds.token)
    embedding = dict(zip(tokens.tolist(), weights.embeddings(tokens)))

    def inputs(rows: np.ndarray, prev: np.ndarray) -> np.ndarray:
        emb = np.stack([embedding[t] for t in ds.token[rows].tolist()])
        return np.concatenate([emb, weights.final_norm(prev[rows].astype(np.float32)), np.ones((len(rows), 1), np.float32)], axis=1)

    exited = train[ds.oracle_exit()[np.maximum(train - 1, 0)] < ds.n_layer - 1]  # rows whose previous step could leave early
    x = np.concatenate([inputs(train, ds.prev_final), inputs(exited, ds.prev_exit)]).astype(np.float64)
    y = weights.final_norm(ds.hidden[np.concatenate([train, exited]), -1].astype(np.float32)).astype(np.float64)
    reg = ridge * len(x) / 1000.0 * np.eye(x.shape[1])
    reg[-1, -1] = 0.0  # the bias is not shrunk
    w = np.linalg.solve(x.T @ x + reg, x.T @ y).T.astype(np.float32)  # [n_embd, 2 n_embd + 1]

    vocab_map = draft_vocabulary(ds.final[train], vocab, weights.lm_head.shape[0])
    tensors = {
        "fc.weight": quantized(w[:, :-1]),
        "fc.bias": w[:, -1].copy(),
        "head.weight": quantized(weights.lm_head[vocab_map]),
        "norm.weight": gamma.copy(),
        "norm.eps": np.array([eps], dtype=np.float32),
    }
    head = DraftHead(LINEAR_DRAFT_KIND, tensors, vocab_map)
    return head, evaluate(LinearDraft(head, weights, k), ds, test, embedding, forward_ms)


def evaluate(draft: LinearDraft, ds: Dataset, test: np.ndarray, embedding: dict[int, np.ndarray],
             forward_ms: float) -> DraftReport:
    emb = np.stack([embedding[t] for t in ds.token[test].tolist()])
    target = ds.final[test]

    def recall(prev: np.ndarray, k: int) -> float:
        cands = draft.top_k(draft.scores(emb, prev[test].astype(np.float32)))[:, :k]
        return float(np.mean((cands == target[:, None]).any(axis=1)))

    # cost of one proposal as the engine calls it (single-threaded BLAS, see Engine.stream)
    token, hidden = int(ds.token[test[0]]), ds.prev_final[test[0]].astype(np.float32)
    with threadpool_limits(limits=1, user_api="blas"):
        draft.propose(token, hidden)
        t0, n = time.perf_counter(), 200
        for _ in range(n):
            draft.propose(token, hidden)
        ms = (time.perf_counter() - t0) / n * 1e3
    return DraftReport(
        vocab=len(draft.vocab_map),
        vocab_coverage=float(np.mean(np.isin(target, draft.vocab_map))),
        recall_at_1=recall(ds.prev_final, 1),
        recall_at_k=recall(ds.prev_final, draft.k),
        recall_at_k_after_exit=recall(ds.prev_exit, draft.k),
        ms_per_token=ms,
        cost_share=ms / forward_ms,
    )
