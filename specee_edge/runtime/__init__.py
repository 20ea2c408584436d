"""The patched llama.cpp runtime: models, contexts that stop after any layer, probes, KV modes."""

from specee_edge.gguf_index import check_gguf_file
from specee_edge.runtime._bindings import KV_MODES, MAX_CANDIDATES
from specee_edge.runtime.context import Context, ProbeCallback
from specee_edge.runtime.model import Model, ModelInfo

__all__ = ["KV_MODES", "MAX_CANDIDATES", "Context", "Model", "ModelInfo", "ProbeCallback", "check_gguf_file"]
