"""Stage 6: a temperature per exit layer, so that an exit's softmax matches the full model's.

A layer that agrees with the final top-1 is usually less (or more) sure of it than the final layer:
its logits, divided by T, are fitted to minimise the cross-entropy against the final layer's
distribution (equivalently the KL divergence) on steps where the layer's top-1 is the final one,
the steps it can exit on. Cross-entropy is convex in 1/T, so a few Newton steps find it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specee_edge.calibrate.dataset import Dataset
from specee_edge.runtime.weights import TargetWeights

ROWS_PER_LAYER = 384   # steps whose full logits are computed per layer (the cost is the LM head)
NEWTON_STEPS = 8
BETA_RANGE = (0.05, 20.0)  # 1/T


@dataclass
class TemperatureFit:
    temperatures: dict[int, float]
    nll_raw: float     # held-out cross-entropy against the final layer's distribution, exits at T = 1
    nll_fitted: float  # the same with the fitted temperatures


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _logits(ds: Dataset, weights: TargetWeights, rows: np.ndarray, layer: int) -> np.ndarray:
    return weights.capped(weights.final_norm(ds.hidden[rows, layer].astype(np.float32)) @ weights.lm_head.T)


def cross_entropy(z: np.ndarray, target: np.ndarray, beta: float) -> float:
    """Mean over rows of -sum_v target_v log softmax(beta z)_v."""
    return float(-(target * _log_softmax(beta * z)).sum(axis=1).mean())


def fit_beta(z: np.ndarray, target: np.ndarray) -> float:
    """argmin over beta of cross_entropy: d/dbeta = E_q[z] - E_target[z], d2/dbeta2 = Var_q[z]."""
    beta = 1.0
    target_mean = (target * z).sum(axis=1)
    for _ in range(NEWTON_STEPS):
        q = np.exp(_log_softmax(beta * z))
        mean = (q * z).sum(axis=1)
        grad = float((mean - target_mean).mean())
        hess = float(((q * z * z).sum(axis=1) - mean * mean).mean())
        if hess <= 1e-12:
            break
        beta = float(np.clip(beta - grad / hess, *BETA_RANGE))
    return beta


def _eligible(ds: Dataset, rows: np.ndarray, layer: int, n: int, rng: np.random.Generator) -> np.ndarray:
    rows = rows[ds.top1[rows, layer] == ds.final[rows]]
    return np.sort(rng.choice(rows, min(n, len(rows)), replace=False)) if len(rows) else rows


def fit_temperatures(ds: Dataset, weights: TargetWeights, layers: list[int], train: np.ndarray, test: np.ndarray,
                     seed: int = 0, progress=lambda: None) -> TemperatureFit:
    """Fitted on train steps, scored on test steps (both: those where the layer could exit)."""
    rng = np.random.default_rng(seed)
    temperatures, raw, fitted, count = {}, 0.0, 0.0, 0
    for layer in layers:
        fit_rows = _eligible(ds, train, layer, ROWS_PER_LAYER, rng)
        if len(fit_rows) < 16:
            temperatures[layer] = 1.0
            progress()
            continue
        target = np.exp(_log_softmax(_logits(ds, weights, fit_rows, -1)))
        beta = fit_beta(_logits(ds, weights, fit_rows, layer), target)
        temperatures[layer] = round(1.0 / beta, 4)
        eval_rows = _eligible(ds, test, layer, ROWS_PER_LAYER // 2, rng)
        if len(eval_rows):
            z, target = _logits(ds, weights, eval_rows, layer), np.exp(_log_softmax(_logits(ds, weights, eval_rows, -1)))
            raw += cross_entropy(z, target, 1.0) * len(eval_rows)
            fitted += cross_entropy(z, target, beta) * len(eval_rows)
            count += len(eval_rows)
        progress()
    return TemperatureFit(temperatures, raw / max(count, 1), fitted / max(count, 1))
