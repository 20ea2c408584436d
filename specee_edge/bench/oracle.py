"""The oracle bound: each token exits, for free, at the earliest layer whose top-1 equals the final top-1.

Depths: the full model runs over vanilla's outputs (teacher forced, every layer's output captured)
and the logit lens (final norm + LM head) gives every layer's top-1. Cost by depth: forced stops
decode vanilla's tokens in the same interleaved run, each stopping every token after a fixed layer
(an exit still pays the exit head); a line through their times prices any depth.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from specee_edge.bench.runner import Timing
from specee_edge.runtime import Context, Model
from specee_edge.runtime.weights import TargetWeights, lens_top1, rms_scaled_f16

STOP_FRACTIONS = (0.25, 0.5, 0.75)  # forced stops at these shares of the depth, plus full depth


class StopLane:
    """Decodes vanilla's tokens, every one stopped after `layer` (None: full depth, probes idle)."""

    def __init__(self, model: Model, layer: int | None, *, n_ctx: int, n_threads: int, k: int):
        self.ctx = Context(model, n_ctx=n_ctx, n_threads=n_threads)
        self.ctx.enable_early_exit(k, "mask")
        self.ctx.set_candidates(list(range(k)))
        if layer is not None:
            self.ctx.set_probe_layers([layer])
            self.ctx.set_probe_callback(lambda il, cand_logits: True)
        self.layers_run = model.info.n_layer if layer is None else layer + 1
        self.timing = Timing()

    def start(self, prompt: Sequence[int]) -> None:
        self.ctx.clear()
        self.ctx.decode(prompt)

    def step(self, token: int) -> None:
        start = time.perf_counter()
        self.ctx.decode([token])
        self.timing.add(time.perf_counter() - start)


def stop_lanes(model: Model, *, n_ctx: int, n_threads: int, k: int) -> list[StopLane]:
    n_layer = model.info.n_layer
    layers = sorted({max(0, round(n_layer * f) - 1) for f in STOP_FRACTIONS})
    return [StopLane(model, layer, n_ctx=n_ctx, n_threads=n_threads, k=k) for layer in (*layers, None)]


@dataclass
class TimeModel:
    """Decode time of one token as a line in the number of layers it runs (ms = intercept + per_layer * layers)."""

    layers_run: list[int]
    ms: list[float]
    intercept_ms: float
    per_layer_ms: float

    @classmethod
    def fit(cls, lanes: Sequence[StopLane]) -> TimeModel:
        layers = [lane.layers_run for lane in lanes]
        ms = [lane.timing.ms for lane in lanes]
        slope, intercept = np.polyfit(layers, ms, 1)
        return cls(layers, ms, float(intercept), max(float(slope), 0.0))

    def ms_at(self, layers_run: np.ndarray | int) -> np.ndarray:
        return self.intercept_ms + self.per_layer_ms * np.asarray(layers_run, dtype=np.float64)


@dataclass
class Oracle:
    depths: np.ndarray  # per vanilla step: the earliest layer whose top-1 equals the final top-1
    time_model: TimeModel
    n_layer: int

    @property
    def speedup(self) -> float:
        """Full-depth time over the oracle's, both priced by the time model (no predictor, draft or KV cost)."""
        if not len(self.depths):
            return 1.0
        return float(self.time_model.ms_at(self.n_layer) / np.mean(self.time_model.ms_at(self.depths + 1)))

    @property
    def avg_exit_layer(self) -> float:
        return float(np.mean(self.depths)) if len(self.depths) else float(self.n_layer - 1)

    @property
    def histogram(self) -> list[int]:
        return np.bincount(self.depths, minlength=self.n_layer).tolist()


def oracle_depths(model: Model, weights: TargetWeights, prompts: Sequence[Sequence[int]],
                  outputs: Sequence[Sequence[int]], *, n_ctx: int, n_threads: int,
                  advance: Callable[[float], None] = lambda n: None) -> np.ndarray:
    """Each decode step's oracle exit layer along `outputs` (steps in order, prompts concatenated).

    `advance` counts steps: half for the capture, half for the lens.
    """
    n_layer = model.info.n_layer
    ctx = Context(model, n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads)  # one ubatch: captures hold every row
    ctx.enable_early_exit(1)
    ctx.set_capture_layers(list(range(n_layer)))
    hidden = []
    for prompt, output in zip(prompts, outputs):
        if len(output) < 2:
            continue
        ctx.clear()
        ctx.decode([*prompt, *output[:-1]], output_all=True)
        # rows from len(prompt) on feed output[j] and predict output[j + 1]: the decode steps
        hidden.append(rms_scaled_f16(np.stack([ctx.captured(il)[len(prompt):] for il in range(n_layer)], axis=1)))
        advance((len(output) - 1) / 2)
    ctx.close()
    if not hidden:
        return np.zeros(0, dtype=np.int64)
    with threadpool_limits(limits=n_threads, user_api="blas"):  # no llama.cpp threads to fight here
        top1 = lens_top1(np.concatenate(hidden), weights, lambda rows: advance(rows / n_layer / 2))
    return np.argmax(top1 == top1[:, -1:], axis=1)
