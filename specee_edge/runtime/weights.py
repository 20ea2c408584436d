"""The few target-model tensors that live outside llama.cpp's graph: token embeddings, final norm, LM head
(and the logit lens through them, which calibrate and bench share).

Read from the model GGUF's memory map (through `GGUFIndex`) and dequantized on demand with gguf-py, so the
draft head can look up one embedding row per token without loading the whole table.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from pathlib import Path

import gguf
import numpy as np

from specee_edge.archs import ARCHS
from specee_edge.errors import ModelLoadError
from specee_edge.gguf_index import GGUFIndex

LENS_ROWS = 512  # rows per lens matmul: [rows, n_vocab] float32 stays near 100 MB


class TargetWeights:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = GGUFIndex(self.path)
        self._tensors = {t.name: t for t in self.reader.tensors}
        arch = self.reader.value("general.architecture")
        self.rms_eps = float(self.reader.value(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6)
        facts = ARCHS.get(arch)
        key = facts.softcap_key if facts else None
        self.softcap = float(self.reader.value(key) or 0.0) if key else 0.0
        self._embd = self._tensor("token_embd.weight")
        # a tied LM head has no output.weight: it reads the embedding table
        self._head = self._tensors.get("output.weight", self._embd)

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise ModelLoadError(f"{self.path.name} has no tensor {name}")
        return self._tensors[name]

    @staticmethod
    def _rows(tensor, ids: np.ndarray) -> np.ndarray:
        data = tensor.data[np.asarray(ids, dtype=np.int64)]
        return np.asarray(gguf.quants.dequantize(data, tensor.tensor_type), dtype=np.float32).reshape(len(ids), -1)

    def embeddings(self, ids) -> np.ndarray:
        """[len(ids), n_embd] token embeddings."""
        return self._rows(self._embd, np.atleast_1d(ids))

    def head_rows(self, ids) -> np.ndarray:
        """[len(ids), n_embd] rows of the LM head."""
        return self._rows(self._head, np.atleast_1d(ids))

    @cached_property
    def lm_head(self) -> np.ndarray:
        """The whole LM head [n_vocab, n_embd] in float32 (calibration only: it is large)."""
        return self._rows(self._head, np.arange(self._head.data.shape[0]))

    @cached_property
    def output_norm(self) -> np.ndarray:
        t = self._tensor("output_norm.weight")
        return np.asarray(t.data, dtype=np.float32).reshape(-1)

    def final_norm(self, hidden: np.ndarray) -> np.ndarray:
        """The model's final RMS norm over the last axis."""
        return final_norm(hidden, self.output_norm, self.rms_eps)

    def capped(self, logits: np.ndarray) -> np.ndarray:
        """What the model's output path makes of raw LM-head logits: its soft-capping, if it has one."""
        if not self.softcap:
            return logits
        return (self.softcap * np.tanh(logits / self.softcap)).astype(np.float32)


def rms_scaled_f16(hidden: np.ndarray) -> np.ndarray:
    """Hidden states for storage: each vector divided by its RMS, in float16.

    What an RMS norm reads of a vector does not depend on its scale, and everything that reads stored
    hidden states goes through one (the logit lens, the probes, the draft); gemma's residual stream
    holds values past float16's 65,504, which would overflow unscaled.
    """
    rms = np.sqrt(np.mean(np.square(hidden, dtype=np.float64), axis=-1, keepdims=True))
    return (hidden / np.maximum(rms, np.finfo(np.float32).tiny)).astype(np.float16)


def final_norm(hidden: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    h = np.asarray(hidden, dtype=np.float32)
    return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * gamma


def lens_top1(hidden: np.ndarray, weights: TargetWeights, progress: Callable[[int], None] = lambda n: None) -> np.ndarray:
    """argmax over the vocabulary of final_norm(h) through the LM head, for [..., n_embd] hidden states
    (a soft-cap, being monotone, leaves it unchanged)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = np.empty(len(flat), dtype=np.int32)
    head_t = lens_head(weights)
    for i in range(0, len(flat), LENS_ROWS):
        out[i : i + LENS_ROWS] = lens_chunk(flat[i : i + LENS_ROWS], weights, head_t)
        progress(min(LENS_ROWS, len(flat) - i))
    return out.reshape(hidden.shape[:-1])


def lens_head(weights: TargetWeights) -> np.ndarray:
    """The LM head transposed, [n_embd, n_vocab], as the lens multiplies by it (one copy per lens_top1 call)."""
    return np.ascontiguousarray(weights.lm_head.T)


def lens_chunk(hidden: np.ndarray, weights: TargetWeights, head_t: np.ndarray) -> np.ndarray:
    """The lens's top-1 of up to LENS_ROWS hidden states [rows, n_embd] (head_t: lens_head's)."""
    return np.argmax(weights.final_norm(hidden.astype(np.float32)) @ head_t, axis=1).astype(np.int32)
