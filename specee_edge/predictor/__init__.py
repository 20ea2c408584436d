"""Exit predictors: features and the per-layer MLP."""

from specee_edge.pack.mlp import MLPPredictor

__all__ = ["MLPPredictor"]
