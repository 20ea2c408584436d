"""Exit predictors: features and the per-layer MLP."""

from specee_edge.predictor.mlp import MLPPredictor

__all__ = ["MLPPredictor"]
