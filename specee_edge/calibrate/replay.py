"""The engine itself on calibration answers: what a level does once its exits' K/V are approximate.

Teacher forcing: each answer's tokens are fed to the engine one decode at a time, early exit on, so
the engine decides every step's exit as it would in a reply (its KV mode, online schedule and
verification), and each step's token, the argmax of the engine's logits, is compared with the full
model's top-1 that the collection recorded on the same prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from specee_edge.calibrate.collect import Shard
from specee_edge.engine import GREEDY, Engine, GenerationStats
from specee_edge.pack.format import QualityLevel


@dataclass
class Replay:
    steps: int
    agreement: float
    exit_rate: float
    avg_exit_layer: float
    verify_fail_rate: float


def pick_answers(shards: list[Shard], prompts: np.ndarray, max_steps: int) -> list[Shard]:
    """Whole answers to these prompts, in order, until max_steps steps."""
    chosen, steps = [], 0
    for shard in shards:
        if shard.prompt in prompts and steps < max_steps:
            chosen.append(shard)
            steps += shard.steps
    return chosen


def replay(engine: Engine, level: QualityLevel, answers: list[Shard]) -> Replay:
    engine.policy.set_level(level)
    stats = GenerationStats(engine.n_layer, early_exit=True)
    agree = steps = 0
    with threadpool_limits(limits=1, user_api="blas"):  # numpy's threads would fight the decode's
        for shard in answers:
            engine.reset()
            prompt = shard.tokens[: shard.start + 1].tolist()
            for _ in engine.stream(prompt, max_tokens=1, sampling=GREEDY):  # the prompt pass: step 0's logits
                pass
            for j, reference in enumerate(shard.final_top1.tolist()):
                if j:
                    stats.add(engine._forward(int(shard.tokens[shard.start + j])))
                agree += int(np.argmax(engine.ctx.logits())) == reference
                steps += 1
    engine.reset()
    return Replay(steps, agree / max(steps, 1), stats.exit_rate, stats.avg_exit_layer, stats.verify_fail_rate)
