"""Exit predictors: the per-layer MLP, the exit rule that uses it, and the online schedule."""

from specee_edge.pack.mlp import MLPPredictor

__all__ = ["MLPPredictor"]
