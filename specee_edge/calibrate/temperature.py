"""Stage 6: a temperature per exit layer, so that an exit's softmax matches the full model's.

A layer that agrees with the final top-1 is usually less (or more) sure of it than the final layer:
its logits, divided by T, are fitted to minimise the cross-entropy against the final layer's
distribution (equivalently the KL divergence) on the steps where the default level's exits leave at that
layer, the logits the engine divides by T. A temperature that does not lower the cross-entropy on held-out
steps that exit there stays 1, and the figures reported are measured on other held-out steps (the check's
steps decide, they do not also grade the decision). The last layer (a head-free exit that skips the output head) keeps T = 1:
its full logits are the output's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import log_softmax

from specee_edge.calibrate.dataset import Dataset
from specee_edge.runtime.weights import TargetWeights

ROWS_PER_LAYER = 384   # steps whose full logits are computed per layer (the cost is the LM head)
MIN_ROWS = 16
BETA_RANGE = (0.05, 20.0)  # 1/T


@dataclass
class TemperatureFit:
    temperatures: dict[int, float]
    nll_raw: float     # held-out cross-entropy of the exits against the final layer's distribution, T = 1
    nll_fitted: float  # the same with the temperatures kept (on steps that played no part in keeping them)


def _logits(ds: Dataset, weights: TargetWeights, rows: np.ndarray, layer: int) -> np.ndarray:
    return weights.capped(weights.final_norm(ds.hidden[rows, layer].astype(np.float32)) @ weights.lm_head.T)


def cross_entropy(z: np.ndarray, target: np.ndarray, beta: float) -> float:
    """Mean over rows of -sum_v target_v log softmax(beta z)_v."""
    return float(-(target * log_softmax(beta * z, axis=1)).sum(axis=1).mean())


def fit_beta(z: np.ndarray, target: np.ndarray) -> float:
    """argmin over beta of cross_entropy (convex in beta)."""
    return float(minimize_scalar(lambda beta: cross_entropy(z, target, beta), bounds=BETA_RANGE, method="bounded").x)


def _sample(rows: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    return np.sort(rng.choice(rows, min(n, len(rows)), replace=False)) if len(rows) else rows


def fit_temperatures(ds: Dataset, weights: TargetWeights, layers: list[int], fit_rows: dict[int, np.ndarray],
                     check_rows: dict[int, np.ndarray], seed: int = 0, progress=lambda: None) -> TemperatureFit:
    """fit_rows / check_rows: per layer, the steps that exit there (fitted on the first; kept if better on every
    other step of the second, and graded on the rest)."""
    rng = np.random.default_rng(seed)
    temperatures, raw, fitted, count = {}, 0.0, 0.0, 0
    for layer in layers:
        temperatures[layer] = 1.0
        fit, check = _sample(fit_rows.get(layer, np.array([], int)), ROWS_PER_LAYER, rng), \
            _sample(check_rows.get(layer, np.array([], int)), ROWS_PER_LAYER // 2, rng)
        if layer < ds.n_layer - 1 and len(fit) >= MIN_ROWS and len(check) >= MIN_ROWS // 2:
            beta = fit_beta(_logits(ds, weights, fit, layer), np.exp(log_softmax(_logits(ds, weights, fit, -1), axis=1)))
            z, target = _logits(ds, weights, check, layer), np.exp(log_softmax(_logits(ds, weights, check, -1), axis=1))
            decide, grade = slice(0, None, 2), slice(1, None, 2)
            if cross_entropy(z[decide], target[decide], beta) < cross_entropy(z[decide], target[decide], 1.0):
                temperatures[layer] = round(1.0 / beta, 4)
            n = len(z[grade])
            raw += cross_entropy(z[grade], target[grade], 1.0) * n
            fitted += cross_entropy(z[grade], target[grade], 1.0 / temperatures[layer]) * n
            count += n
        progress()
    return TemperatureFit(temperatures, raw / max(count, 1), fitted / max(count, 1))
