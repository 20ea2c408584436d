"""The exit rule: what the checks of one token decide. One definition for Python.

The runtime runs the same rule in C (patches/src/llama-specee-rule.cpp) inside llama_decode;
calibration's simulation, the level search, the engine's teacher-forced replay and the Python policy
all call this module, and tests/test_rule.py drives both with random inputs and requires the same
decisions.

A token's checks run in layer order. Each computes the features [z, softmax(z), softmax(z) - p_prev]
of the candidates' logits z (p_prev: the previous check of the same token, zeros at its first), and the
layer's predictor gives a probability. Above the layer's threshold the layer's exit kind says what
happens: a head-free exit leaves at once, emitting the candidates' argmax; a verified exit runs the
full exit head and leaves only if its top-1 is a candidate (otherwise the token goes on: a rejection).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
from scipy.special import softmax

from specee_edge.exits import ExitKind
from specee_edge.pack.format import OFF, LayerExit
from specee_edge.pack.mlp import MLPPredictor


class Outcome(IntEnum):
    GO_ON = 0
    HEAD_FREE = 1  # leave now with the candidates' argmax
    VERIFY = 2     # leave if the exit head's top-1 is a candidate


def candidate_probs(cand_logits: np.ndarray) -> np.ndarray:
    """Softmax over the k candidates only (last axis), in float32 as the runtime computes it."""
    return softmax(np.asarray(cand_logits, dtype=np.float32), axis=-1).astype(np.float32)


def probe_features(cand_logits: np.ndarray, prev_probs: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(features [..., 3k], probs [..., k]) for candidate logits [..., k]; prev_probs None at the first check."""
    z = np.asarray(cand_logits, dtype=np.float32)
    p = candidate_probs(z)
    delta = p if prev_probs is None else p - prev_probs
    return np.concatenate([z, p, delta], axis=-1), p


class TokenChecks:
    """One token's checks, in layer order (the rule's state: the previous check's probabilities)."""

    def __init__(self) -> None:
        self.prev_probs: np.ndarray | None = None
        self.probes = 0

    def check(self, cand_logits: np.ndarray, predictor: MLPPredictor, exit: LayerExit) -> tuple[Outcome, float]:
        """The outcome of one layer's check and the predictor's probability."""
        features, self.prev_probs = probe_features(cand_logits, self.prev_probs)
        self.probes += 1
        if not exit.on:
            return Outcome.GO_ON, 0.0
        prob = float(predictor(features))
        if not prob > exit.threshold:
            return Outcome.GO_ON, prob
        return (Outcome.HEAD_FREE if exit.kind == ExitKind.HEAD_FREE else Outcome.VERIFY), prob


@dataclass(frozen=True)
class Decision:
    """What a token's checks decided."""

    exit_layer: int | None  # None: no exit
    kind: ExitKind
    probes: int
    rejections: int         # verified positives whose exit head's top-1 was not a candidate


def decide(layers: Sequence[int], cand_logits: Sequence[np.ndarray], verified: Sequence[bool],
           predictors: Mapping[int, MLPPredictor], exits: Mapping[int, LayerExit]) -> Decision:
    """The checks of `layers` in order; cand_logits[i] and verified[i] belong to layers[i] (verified: the
    layer's exit head would put a candidate first)."""
    checks = TokenChecks()
    rejections = 0
    for layer, z, ok in zip(layers, cand_logits, verified):
        outcome, _ = checks.check(z, predictors[layer], exits.get(layer, OFF))
        if outcome == Outcome.HEAD_FREE:
            return Decision(layer, ExitKind.HEAD_FREE, checks.probes, rejections)
        if outcome == Outcome.VERIFY:
            if ok:
                return Decision(layer, ExitKind.VERIFIED, checks.probes, rejections)
            rejections += 1
    return Decision(None, ExitKind.NONE, checks.probes, rejections)


def candidate_argmax(cand_logits: np.ndarray) -> np.ndarray:
    """Index of the largest candidate logit (last axis; the first on ties): what a head-free exit emits."""
    return np.argmax(cand_logits, axis=-1)
