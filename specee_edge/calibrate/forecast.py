"""How long `specee-edge calibrate MODEL` (its defaults) would take on this machine, without running it.

The same estimate calibrate prints before it starts (budget.py over speed.py's measurements, a few seconds of
decoding and one pass of the logit lens), for a user who wants to know before deciding: `bench` on a model
without a pack says it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from specee_edge.calibrate.budget import RunShape, estimate, size_of
from specee_edge.calibrate.pipeline import CalibrateConfig
from specee_edge.calibrate.speed import measure_speed
from specee_edge.data.prompts import load_prompts
from specee_edge.pack import target_identity
from specee_edge.runtime.weights import TargetWeights


@dataclass(frozen=True)
class Forecast:
    fewest_s: float  # no quality level exits (the engine's and exact mode's work is then least)
    most_s: float    # every level exits


def forecast(model: Path, threads: int) -> Forecast:
    """The default calibration's whole run on `model` here, both ends of what the level search may choose."""
    config = CalibrateConfig(model=model, output=model.with_suffix(".specee.gguf"), threads=threads)
    prompts = load_prompts(config.prompts)
    weights = TargetWeights(model)
    speed = measure_speed(model, weights, prompts[0], threads=threads)
    n_layer = target_identity(model).n_layer
    n_vocab, n_embd = weights.lm_head.shape
    shape = RunShape(n_layer=n_layer, first_layer=config.first_layer or n_layer // 4, n_embd=n_embd, n_vocab=n_vocab,
                     draft_vocab=config.draft_vocab, levels=len(config.levels), lookup=config.lookup > 0,
                     prompts=len(prompts), code_share=sum(p.category == "code" for p in prompts) / len(prompts),
                     max_answer=config.max_answer, exact_prompts=config.exact_prompts)
    fewest, most = (sum(estimate(size_of(config), dataclasses.replace(shape, exiting=n), speed).values())
                    for n in (0, len(config.levels)))
    return Forecast(fewest, most)
