"""The predictor's input, computed the same way at calibration and at inference.

After a checked layer l the probe gives z_l, the logits of the k candidates through the final norm
and the candidates' rows of the LM head. The features are [z_l, softmax(z_l), softmax(z_l) - p_prev],
where p_prev is the softmax of the previous *checked* layer of the same token (zeros at the first
checked layer, so the delta equals p there).
"""

from __future__ import annotations

import numpy as np


def candidate_probs(cand_logits: np.ndarray) -> np.ndarray:
    """Softmax over the k candidates only (last axis)."""
    z = cand_logits - cand_logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def probe_features(cand_logits: np.ndarray, prev_probs: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(features [..., 3k], probs [..., k]) for candidate logits [..., k]; prev_probs None at the first check."""
    z = np.asarray(cand_logits, dtype=np.float32)
    p = candidate_probs(z)
    delta = p if prev_probs is None else p - prev_probs
    return np.concatenate([z, p, delta], axis=-1), p
