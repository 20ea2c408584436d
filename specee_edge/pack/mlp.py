"""The per-layer exit predictor a pack holds: an MLP with ReLU between layers and a sigmoid out (SpecEE: 12->512->1).

It lives with the pack format because its weights are what a pack stores; `specee_edge.predictor`
re-exports it beside the features and the schedule that drive it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class MLPPredictor:
    """weights[j] is [out, in] (as nn.Linear stores it), biases[j] is [out]; the last layer has out = 1."""

    weights: list[np.ndarray]
    biases: list[np.ndarray]

    @property
    def n_features(self) -> int:
        return self.weights[0].shape[1]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.n_features, *(w.shape[0] for w in self.weights))

    def __call__(self, features: np.ndarray) -> np.ndarray:
        """Exit probability for features [..., n_features]."""
        x = np.asarray(features, dtype=np.float32)
        for j, (w, b) in enumerate(zip(self.weights, self.biases)):
            x = x @ w.T + b
            if j < len(self.weights) - 1:
                x = np.maximum(x, 0.0)
        return 1.0 / (1.0 + np.exp(-x[..., 0]))
