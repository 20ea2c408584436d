"""Stage 2: the collected answers as training rows, with every layer's logit-lens top-1.

Row s is one decoding step: it feeds token y_s and must produce y_{s+1}. Its hidden states are the
full model's h_s at every layer; the draft's input is y_s and h_{s-1}.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specee_edge.calibrate.collect import Shard
from specee_edge.draft.lookup import lookup_proposals
from specee_edge.runtime.weights import TargetWeights, lens_top1


@dataclass
class Dataset:
    prompt: np.ndarray        # int32 [N]: which prompt the row answers (the splits are by prompt)
    answer: np.ndarray        # int32 [N]: which answer (shard) the row belongs to
    token: np.ndarray         # int32 [N]: y_s
    hidden: np.ndarray        # float16 [N, n_layer, n_embd]: h_s over its RMS (see collect)
    prev_final: np.ndarray    # float16 [N, n_embd]: h_{s-1} at the last layer
    prev_exit: np.ndarray     # float16 [N, n_embd]: h_{s-1} at its oracle exit layer (the last for a prompt position)
    top1: np.ndarray          # int32 [N, n_layer]: logit-lens top-1 of h_s at each layer; the last is the runtime's

    @property
    def n_layer(self) -> int:
        return self.hidden.shape[1]

    @property
    def final(self) -> np.ndarray:
        """The full model's top-1 (what every exit must agree with)."""
        return self.top1[:, -1]

    def oracle_exit(self) -> np.ndarray:
        """Earliest layer whose top-1 equals the final top-1."""
        return np.argmax(self.top1 == self.final[:, None], axis=1)

    def rows(self, prompts: np.ndarray) -> np.ndarray:
        """The steps answering these prompts, less each answer's first: the engine decodes that one (the
        prompt's last token) in the prompt's batch, which never exits and has no draft."""
        first = np.r_[True, self.answer[1:] != self.answer[:-1]]
        return np.flatnonzero(np.isin(self.prompt, prompts) & ~first)


def build(shards: list[Shard], weights: TargetWeights, first_layer: int = 0,
          progress: Callable[[float], None] = lambda n: None) -> Dataset:
    """Rows from every shard. The lens runs on layers >= first_layer (the others get top-1 -1: they
    never exit), the costliest part of calibration; progress is called per position."""
    parts: dict[str, list] = {k: [] for k in Dataset.__dataclass_fields__}
    n_layer = shards[0].hidden.shape[1]
    n_lens = n_layer - first_layer
    for index, shard in enumerate(shards):
        # shard.hidden row j is position start - 1 + j; rows 1.. are steps s = start .. len-2
        top1 = np.full(shard.hidden.shape[:2], -1, dtype=np.int32)
        top1[:, first_layer:] = lens_top1(shard.hidden[:, first_layer:], weights, lambda n: progress(n / n_lens))
        top1[1:, -1] = shard.final_top1  # what inference emits, not the lens's float32 rounding of it
        oracle = np.argmax(top1 == top1[:, -1:], axis=1)
        oracle[0] = n_layer - 1  # the prompt position never exits
        n = len(shard.hidden) - 1
        positions = np.arange(shard.start, shard.start + n)
        parts["prompt"].append(np.full(n, shard.prompt, dtype=np.int32))
        parts["answer"].append(np.full(n, index, dtype=np.int32))
        parts["token"].append(shard.tokens[positions])
        parts["hidden"].append(shard.hidden[1:])
        parts["prev_final"].append(shard.hidden[:-1, -1])
        parts["prev_exit"].append(shard.hidden[np.arange(n), oracle[:-1]])
        parts["top1"].append(top1[1:])
    return Dataset(**{k: np.concatenate(v) for k, v in parts.items()})


def lookup_column(shards: list[Shard], max_n: int) -> np.ndarray:
    """int32 [N]: each row's prompt-lookup candidate, as the engine proposes it at that step (-1: none)."""
    parts = [[-1 if c is None else c for c in lookup_proposals(s.tokens.tolist(), s.start, s.start + s.steps, max_n)]
             for s in shards]
    return np.array([c for part in parts for c in part], dtype=np.int32)


def save(dataset: Dataset, path: Path) -> None:
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, **{k: getattr(dataset, k) for k in Dataset.__dataclass_fields__})
    tmp.replace(path)


def load(path: Path) -> Dataset:
    with np.load(path) as z:
        return Dataset(**{k: z[k] for k in Dataset.__dataclass_fields__})
