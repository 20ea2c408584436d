"""A numpy logit lens read straight from a GGUF: final_norm(h) through the LM head, soft-capped where
the model is (test reference)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


def _tensor(reader: gguf.GGUFReader, name: str) -> np.ndarray | None:
    for t in reader.tensors:
        if t.name == name:
            return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    return None


def _field(reader: gguf.GGUFReader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


@dataclass
class LogitLens:
    norm_weight: np.ndarray  # [n_embd]
    lm_head: np.ndarray  # [n_vocab, n_embd]
    eps: float
    softcap: float = 0.0  # gemma's output soft-capping: cap * tanh(z / cap) (0: none)

    @classmethod
    def from_gguf(cls, path: Path) -> "LogitLens":
        reader = gguf.GGUFReader(path)
        arch = _field(reader, "general.architecture")
        lm_head = _tensor(reader, "output.weight")
        if lm_head is None:  # tied embeddings
            lm_head = _tensor(reader, "token_embd.weight")
        return cls(
            norm_weight=_tensor(reader, "output_norm.weight"),
            lm_head=lm_head,
            eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
            softcap=float(_field(reader, f"{arch}.final_logit_softcapping") or 0.0) if arch == "gemma3" else 0.0,
        )

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        h = hidden.astype(np.float64)
        normed = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + self.eps) * self.norm_weight
        logits = normed @ self.lm_head.T.astype(np.float64)
        if self.softcap:
            logits = self.softcap * np.tanh(logits / self.softcap)
        return logits.astype(np.float32)
