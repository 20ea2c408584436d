"""The SpecEE decoding engine and its Python API."""

from specee_edge.engine.engine import AUTO, DEFAULT_KV_MODE, Engine, EngineConfig, Generation
from specee_edge.engine.records import GenerationStats, TokenRecord
from specee_edge.engine.sampling import GREEDY, SamplingParams

__all__ = [
    "AUTO", "DEFAULT_KV_MODE", "GREEDY", "Engine", "EngineConfig", "Generation", "GenerationStats",
    "SamplingParams", "TokenRecord",
]
