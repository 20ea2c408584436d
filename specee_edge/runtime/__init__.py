"""The patched llama.cpp runtime: models, contexts that stop after any layer, probes, KV modes."""

from specee_edge.runtime._bindings import KV_MODES, MAX_CANDIDATES
from specee_edge.runtime.context import Context, ProbeCallback
from specee_edge.runtime.model import Model, ModelInfo, check_gguf_file

__all__ = ["KV_MODES", "MAX_CANDIDATES", "Context", "Model", "ModelInfo", "ProbeCallback", "check_gguf_file"]
