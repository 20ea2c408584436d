"""95% intervals by the bootstrap, resampling whole prompts.

A reply's tokens are not independent draws: one early difference changes every token after it, and the
answers to one prompt share its subject. An interval that counted tokens as independent (Wilson's over a
few thousand steps) would be several times too narrow, so every interval calibration stores resamples
prompts, each with all of its tokens, answers and timings.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

RESAMPLES = 2000


def resampled_rows(n: int, seed: int = 0) -> np.ndarray:
    """[RESAMPLES, n] indices of n units drawn with replacement, one resample per row."""
    return np.random.default_rng(seed).integers(0, n, (RESAMPLES, n))


def interval(statistic: Callable[[np.ndarray], np.ndarray], n: int, seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of `statistic` over resamples of n units. `statistic` takes
    indices [..., n] and returns one value per leading index."""
    low, high = np.percentile(statistic(resampled_rows(n, seed)), [2.5, 97.5])
    return float(low), float(high)


def ratio_interval(numerator: np.ndarray, denominator: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95% interval of sum(numerator) / sum(denominator), one entry of each per unit (say, agreeing steps
    and steps per prompt)."""
    numerator, denominator = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)
    return interval(lambda rows: numerator[rows].sum(-1) / np.maximum(denominator[rows].sum(-1), 1e-12),
                    len(numerator), seed)


def speedup_interval(lane: np.ndarray, base: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95% interval of a lane's speed over a baseline's: (the lane's steps / its seconds) over (the baseline's
    steps / its seconds), each summed over the prompts, the same prompts resampled for both (paired). lane, base:
    one (steps, seconds) row per prompt, as Timing.by_prompt holds them. A resample in which either decoded nothing
    has no ratio and is left out."""
    lane, base = (np.asarray(x, dtype=float).reshape(-1, 2) for x in (lane, base))

    def tok_s(timing: np.ndarray, rows: np.ndarray) -> np.ndarray:
        steps, seconds = timing[rows, 0].sum(-1), timing[rows, 1].sum(-1)
        return np.divide(steps, seconds, out=np.full(steps.shape, np.nan), where=seconds > 0)

    def ratio(rows: np.ndarray) -> np.ndarray:
        base_tok_s = tok_s(base, rows)
        return np.divide(tok_s(lane, rows), base_tok_s, out=np.full(base_tok_s.shape, np.nan), where=base_tok_s > 0)

    low, high = np.nanpercentile(ratio(resampled_rows(len(lane), seed)), [2.5, 97.5])
    return float(low), float(high)
