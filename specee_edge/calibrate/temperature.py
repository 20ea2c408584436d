"""Stage 6: a temperature per exit layer, so that an exit's softmax matches the full model's.

A layer that agrees with the final top-1 is usually less (or more) sure of it than the final layer:
its logits, divided by T, are fitted to minimise the cross-entropy against the final layer's
distribution (equivalently the KL divergence) on the steps where the default level's exits leave at that
layer, the logits the engine divides by T. Every decision is taken on the calibration split: T is fitted
on half of its steps that exit there and kept only if it lowers the cross-entropy on the other half (else
it stays 1). The figures reported are measured on held-out steps, which played no part in either. The last layer (a head-free exit that skips the output head) keeps T = 1:
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


def _exit_logits(ds: Dataset, weights: TargetWeights, rows: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """The layer's logits at these steps, and the final layer's distribution (the target)."""
    return _logits(ds, weights, rows, layer), np.exp(log_softmax(_logits(ds, weights, rows, -1), axis=1))


def fit_temperatures(ds: Dataset, weights: TargetWeights, layers: list[int], calib_rows: dict[int, np.ndarray],
                     test_rows: dict[int, np.ndarray], seed: int = 0, progress=lambda: None) -> TemperatureFit:
    """calib_rows / test_rows: per layer, the steps that exit there, on the calibration split (fitted on every
    other step, kept if better on the rest) and held out (graded)."""
    rng = np.random.default_rng(seed)
    temperatures, raw, fitted, count = {}, 0.0, 0.0, 0
    for layer in layers:
        temperatures[layer] = 1.0
        calib = _sample(calib_rows.get(layer, np.array([], int)), 2 * ROWS_PER_LAYER, rng)
        fit, decide = calib[0::2], calib[1::2]
        grade = _sample(test_rows.get(layer, np.array([], int)), ROWS_PER_LAYER // 2, rng)
        if layer < ds.n_layer - 1 and len(fit) >= MIN_ROWS and len(decide) >= MIN_ROWS // 2:
            beta = fit_beta(*_exit_logits(ds, weights, fit, layer))
            z, target = _exit_logits(ds, weights, decide, layer)
            if cross_entropy(z, target, beta) < cross_entropy(z, target, 1.0):
                temperatures[layer] = round(1.0 / beta, 4)
        if layer < ds.n_layer - 1 and len(grade):
            z, target = _exit_logits(ds, weights, grade, layer)
            raw += cross_entropy(z, target, 1.0) * len(grade)
            fitted += cross_entropy(z, target, 1.0 / temperatures[layer]) * len(grade)
            count += len(grade)
        progress()
    return TemperatureFit(temperatures, raw / max(count, 1), fitted / max(count, 1))
