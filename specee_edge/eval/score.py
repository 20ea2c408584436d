"""What the eval computes from the answers: the full model's log-likelihood of each, and paired 95% intervals of a
level's difference from plain decoding, bootstrapped over problems."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.special import log_softmax

from specee_edge.bootstrap import interval
from specee_edge.runtime import Context


def mean_log_likelihoods(ctx: Context, prompt: Sequence[int], answers: Sequence[Sequence[int]]) -> list[float]:
    """The full model's mean log-probability per token of each answer after `prompt`, teacher forced: the prompt but
    its last token, decoded once for every answer, then that token and the answer but its last in one batch whose
    rows give each answer token's distribution. `ctx` is a context with early exit off (every layer, as plain
    decoding) and n_batch >= the longest answer."""
    ctx.clear()
    if len(prompt) > 1:
        ctx.decode(list(prompt[:-1]))
    scores = []
    for answer in answers:
        if not answer:
            scores.append(0.0)
            continue
        ctx.truncate(len(prompt) - 1)
        ctx.decode([prompt[-1], *answer[:-1]], output_all=True)
        total = sum(float(log_softmax(ctx.logits(row).astype(np.float64))[token]) for row, token in enumerate(answer))
        scores.append(total / len(answer))
    return scores


def paired_difference(level: np.ndarray, plain: np.ndarray, seed: int = 0) -> tuple[float, tuple[float, float]]:
    """mean(level - plain) over problems, and its 95% interval: the same problems resampled for both (paired)."""
    diff = np.asarray(level, dtype=float) - np.asarray(plain, dtype=float)
    return float(diff.mean()), interval(lambda rows: diff[rows].mean(-1), len(diff), seed)


def paired_ratio(level: np.ndarray, plain: np.ndarray, seed: int = 0) -> tuple[float, tuple[float, float]]:
    """sum(level) / sum(plain) over problems (a ratio of totals, as time per whole answer), and its 95% interval:
    the same problems resampled for both."""
    a, b = np.asarray(level, dtype=float), np.asarray(plain, dtype=float)
    ratio = lambda rows: a[rows].sum(-1) / np.maximum(b[rows].sum(-1), 1e-12)
    return float(a.sum() / max(b.sum(), 1e-12)), interval(ratio, len(a), seed)
