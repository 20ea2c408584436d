"""Stage 3: the linear draft head: ridge regression (numpy, closed form), then cross-entropy.

The ridge target is final_norm(h_s), so that the LM head rows of the draft vocabulary read it like the
model's own head. From there, a few epochs of Adam on the softmax cross-entropy of the draft
vocabulary's scores against the full model's next token train what the engine uses, the ranking:
held-out recall@4 rose from 0.460 to 0.533 on SmolLM2 and from 0.491 to 0.550 on the 1.5B model,
in every prompt category, for about 30 s more. Steps whose previous token could have left early
appear twice, once with h_{s-1} from the last layer and once from its oracle exit layer, so the head
stays good after an early exit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import gguf
import numpy as np

from specee_edge.calibrate.dataset import Dataset
from specee_edge.draft import LINEAR_DRAFT_KIND, LinearDraft
from specee_edge.pack.format import DraftHead
from specee_edge.runtime.weights import TargetWeights


# the ridge penalty per 1,000 rows: held-out recall@4 of the 1.5B model's draft was 0.452 at 1.0 and
# 0.491 at 0.1 (10,000 training rows for 4.7M weights: less shrinkage, not more, generalised better)
DRAFT_RIDGE = 0.1
# Adam on the cross-entropy: 2 epochs at 3e-4 peaked on SmolLM2 (a third overfits) and came within
# 0.003 of the best on the 1.5B model (1e-4 for 3 epochs); 1e-4 and 3e-4 were flat, 3e-5 too slow
DRAFT_EPOCHS = 2
DRAFT_LR = 3e-4
DRAFT_BATCH = 1024


@dataclass
class SourceRecall:
    """Held-out recall of one prompt category (or all), per candidate source."""

    steps: int
    vocab_coverage: float  # next tokens inside the draft vocabulary
    draft: float           # recall@k of the draft head alone
    lookup: float          # the prompt-lookup candidate alone
    merged: float          # the engine's candidates: the lookup's first, the draft's after it


@dataclass
class DraftReport:
    vocab: int
    vocab_coverage: float    # held-out next tokens inside the draft vocabulary
    recall_at_1: float
    recall_at_k: float
    recall_at_k_after_exit: float  # with h_{s-1} from the previous token's oracle exit layer
    recall_at_k_merged: float = 0.0  # with the prompt-lookup candidate, as the engine proposes
    by_category: dict[str, SourceRecall] = field(default_factory=dict)


def draft_vocabulary(next_tokens: np.ndarray, size: int, n_vocab: int, required: Sequence[int] = ()) -> np.ndarray:
    """`required` (the model's end-of-generation tokens: a head-free exit can emit only what the draft
    proposes), then the most frequent next tokens, topped up with the lowest ids (BPE's earliest merges)."""
    required = np.unique(np.asarray(required, dtype=np.int64))
    ids, counts = np.unique(next_tokens, return_counts=True)
    frequent = ids[np.argsort(-counts, kind="stable")]
    chosen = np.concatenate([required, frequent[~np.isin(frequent, required)]])[:max(size, len(required))]
    rest = np.setdiff1d(np.arange(n_vocab), chosen)[: size - len(chosen)]
    return np.concatenate([chosen, rest]).astype(np.int32)


def quantized(array: np.ndarray, qtype=gguf.GGMLQuantizationType.Q8_0) -> np.ndarray:
    """What the pack will hold: the array through a quantize/dequantize round trip."""
    return gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(array, np.float32), qtype), qtype).reshape(array.shape)


def fit_draft(ds: Dataset, weights: TargetWeights, train: np.ndarray, test: np.ndarray, *, k: int, vocab: int,
              lookup: np.ndarray, categories: np.ndarray, eog_tokens: Sequence[int],
              ridge: float = DRAFT_RIDGE) -> tuple[DraftHead, DraftReport]:
    """lookup: every row's prompt-lookup candidate (-1: none); categories: every row's prompt category;
    eog_tokens: the model's end-of-generation tokens, always in the draft vocabulary."""
    gamma, eps = weights.output_norm, weights.rms_eps
    tokens = np.unique(ds.token)
    embedding = dict(zip(tokens.tolist(), weights.embeddings(tokens)))

    def inputs(rows: np.ndarray, prev: np.ndarray) -> np.ndarray:
        emb = np.stack([embedding[t] for t in ds.token[rows].tolist()])
        return np.concatenate([emb, weights.final_norm(prev[rows].astype(np.float32)), np.ones((len(rows), 1), np.float32)], axis=1)

    # rows whose previous step (in the same answer) could leave early
    previous = np.maximum(train - 1, 0)
    exited = train[(train > 0) & (ds.answer[previous] == ds.answer[train]) & (ds.oracle_exit()[previous] < ds.n_layer - 1)]
    x = np.concatenate([inputs(train, ds.prev_final), inputs(exited, ds.prev_exit)]).astype(np.float64)
    y = weights.final_norm(ds.hidden[np.concatenate([train, exited]), -1].astype(np.float32)).astype(np.float64)
    reg = ridge * len(x) / 1000.0 * np.eye(x.shape[1])
    reg[-1, -1] = 0.0  # the bias is not shrunk
    w = np.linalg.solve(x.T @ x + reg, x.T @ y).T.astype(np.float32)  # [n_embd, 2 n_embd + 1]
    del y

    vocab_map = draft_vocabulary(ds.final[train], vocab, weights.lm_head.shape[0], eog_tokens)
    head_rows = quantized(weights.lm_head[vocab_map])
    position = {int(t): i for i, t in enumerate(vocab_map)}
    targets = np.array([position.get(int(t), -1) for t in ds.final[np.concatenate([train, exited])]], dtype=np.int64)
    w = refine_cross_entropy(x.astype(np.float32), targets, w, head_rows, seed=0)
    tensors = {
        "fc.weight": quantized(w[:, :-1]),
        "fc.bias": w[:, -1].copy(),
        "head.weight": head_rows,
        "norm.weight": gamma.copy(),
        "norm.eps": np.array([eps], dtype=np.float32),
    }
    # q8_0: what the pack stores and the runtime runs, so that the cost lanes time the same draft
    head = DraftHead(LINEAR_DRAFT_KIND, tensors, vocab_map, quant="q8_0")
    return head, evaluate(LinearDraft(head, weights, k), ds, test, embedding, lookup[test], categories[test])


def refine_cross_entropy(x: np.ndarray, targets: np.ndarray, w: np.ndarray, head: np.ndarray, *, seed: int,
                         epochs: int = DRAFT_EPOCHS, lr: float = DRAFT_LR, batch: int = DRAFT_BATCH) -> np.ndarray:
    """Adam on mean softmax cross-entropy of head @ (w @ x) against `targets` (rows of `head`; -1: outside
    the draft vocabulary, left out). x: [rows, n_in] with a ones column for the bias; w: [n_embd, n_in]."""
    w = w.copy()
    m, v = np.zeros_like(w), np.zeros_like(w)
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    rng = np.random.default_rng(seed)
    rows = np.flatnonzero(targets >= 0)
    step = 0
    for _ in range(epochs):
        order = rng.permutation(rows)
        for start in range(0, len(order), batch):
            idx = order[start : start + batch]
            xb, yb = x[idx], targets[idx]
            scores = (xb @ w.T) @ head.T
            scores -= scores.max(axis=1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(len(yb)), yb] -= 1.0  # d(loss)/d(scores), summed over the batch
            grad = ((p @ head).T @ xb) / len(yb)
            step += 1
            m = beta1 * m + (1 - beta1) * grad
            v = beta2 * v + (1 - beta2) * grad * grad
            w -= lr * (m / (1 - beta1**step)) / (np.sqrt(v / (1 - beta2**step)) + eps)
    return w


def evaluate(draft: LinearDraft, ds: Dataset, test: np.ndarray, embedding: dict[int, np.ndarray],
             lookup: np.ndarray, categories: np.ndarray) -> DraftReport:
    emb = np.stack([embedding[t] for t in ds.token[test].tolist()])
    target = ds.final[test]

    def recall(prev: np.ndarray, k: int) -> float:
        cands = draft.top_k(draft.scores(emb, prev[test].astype(np.float32)))[:, :k]
        return float(np.mean((cands == target[:, None]).any(axis=1)))

    scores = draft.scores(emb, ds.prev_final[test].astype(np.float32))
    hit_draft = (draft.top_k(scores) == target[:, None]).any(axis=1)
    hit_merged = (draft.merged_top_k(scores, lookup) == target[:, None]).any(axis=1)
    hit_lookup, covered = lookup == target, np.isin(target, draft.vocab_map)

    def by_source(rows: np.ndarray) -> SourceRecall:
        return SourceRecall(int(rows.sum()), float(covered[rows].mean()), float(hit_draft[rows].mean()),
                            float(hit_lookup[rows].mean()), float(hit_merged[rows].mean()))

    return DraftReport(
        vocab=len(draft.vocab_map),
        vocab_coverage=float(np.mean(np.isin(target, draft.vocab_map))),
        recall_at_1=recall(ds.prev_final, 1),
        recall_at_k=recall(ds.prev_final, draft.k),
        recall_at_k_after_exit=recall(ds.prev_exit, draft.k),
        recall_at_k_merged=float(hit_merged.mean()),
        by_category={c: by_source(categories == c) for c in sorted(set(categories.tolist()))},
    )
