"""What the eval computes from the answers: the full model's log-likelihood of each, and paired 95% intervals of a
level's difference from plain decoding: bootstrapped over problems for means and ratios, Newcombe's score interval
for the difference of two paired pass rates."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.special import log_softmax

from specee_edge.bootstrap import interval, ratio_interval
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
    return float(a.sum() / max(b.sum(), 1e-12)), ratio_interval(a, b, seed)


Z_95 = 1.959963984540054  # the standard normal's 97.5th percentile


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson's score interval for a proportion, with continuity correction (Newcombe 1998's method 4)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    low = 0.0 if successes == 0 else (2 * n * p + z * z - 1 - z * math.sqrt(
        z * z - 2 - 1 / n + 4 * p * (n * (1 - p) + 1))) / (2 * (n + z * z))
    high = 1.0 if successes == n else (2 * n * p + z * z + 1 + z * math.sqrt(
        z * z + 2 - 1 / n + 4 * p * (n * (1 - p) - 1))) / (2 * (n + z * z))
    return max(0.0, low), min(1.0, high)


def paired_proportion_difference(level: Sequence[bool], plain: Sequence[bool]) -> tuple[float, tuple[float, float]]:
    """The difference of two pass rates on the same problems and its 95% interval: Newcombe's hybrid score
    interval for paired proportions with continuity correction (Newcombe 1998, Statistics in Medicine 17:2635,
    method 11). At small counts it agrees with McNemar's exact test where a percentile bootstrap does not: with 4
    problems only the level passes and none only plain decoding passes, the bootstrap's interval excludes 0 while
    the exact test gives p = 0.125; this one holds 0."""
    level, plain = np.asarray(level, dtype=bool), np.asarray(plain, dtype=bool)
    n = len(level)
    if n == 0:
        return 0.0, (-1.0, 1.0)
    both, only_level = int((level & plain).sum()), int((level & ~plain).sum())
    only_plain, neither = int((~level & plain).sum()), int((~level & ~plain).sum())
    p1, p2 = (both + only_level) / n, (both + only_plain) / n
    (l1, u1), (l2, u2) = wilson_interval(both + only_level, n), wilson_interval(both + only_plain, n)
    margins = (both + only_level) * (only_plain + neither) * (both + only_plain) * (only_level + neither)
    association = both * neither - only_level * only_plain
    if association > 0:  # the continuity correction of the correlation, as for the margins
        association = max(association - n / 2, 0.0)
    phi = association / math.sqrt(margins) if margins else 0.0
    below = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    above = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    difference = p1 - p2
    return difference, (max(-1.0, difference - below), min(1.0, difference + above))
