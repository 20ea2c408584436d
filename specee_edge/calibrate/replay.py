"""The engine itself on collected answers: what a level does once its exits' K/V are approximate.

Teacher forcing (`replay`): each answer's tokens are fed to the engine one decode at a time, early
exit on, so the engine decides every step's exit as it would in a reply (its KV mode, online schedule
and verification), and each step's token, the argmax of the engine's logits, is compared with the full
model's top-1 that the collection recorded on the same prefix. The first step of an answer comes from
the prompt's batch, which never exits: it is not counted. The agreement's interval, and the predicted
speed-up's, resample the answers' prompts (specee_edge/bootstrap.py).

Free running (`identical_answers`): the engine answers the prompts greedily, as a user would get it,
and each answer is compared with the full model's greedy answer: one wrong token changes the rest of a
reply, and on code one wrong token can break the program.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from specee_edge.bootstrap import ratio_interval
from specee_edge.calibrate.collect import Shard
from specee_edge.engine import GREEDY, Engine, GenerationStats
from specee_edge.pack.format import QualityLevel
from specee_edge.runtime.costs import TokenCosts


@dataclass(frozen=True)
class Replay:
    steps: int
    agreement: float
    exit_rate: float
    head_free_rate: float
    avg_exit_layer: float
    verify_fail_rate: float
    agreement_low: float  # 95% interval of the agreement, bootstrapped over the answers' prompts
    agreement_high: float
    speedup: float  # plain decoding's time over the engine's decisions priced by the measured costs (1: not priced)
    speedup_low: float = 1.0  # 95% interval of it, the prompts and the costs' own noise resampled together
    speedup_high: float = 1.0


def pick_answers(shards: Sequence[Shard], prompts: np.ndarray, max_steps: int) -> list[Shard]:
    """Whole answers to these prompts, in order, until max_steps steps."""
    chosen, steps = [], 0
    for shard in shards:
        if shard.prompt in prompts and steps < max_steps:
            chosen.append(shard)
            steps += shard.steps
    return chosen


def replay(engine: Engine, level: QualityLevel, answers: Sequence[Shard], costs: TokenCosts | None = None) -> Replay:
    """Teacher-forced run of `level` over `answers` (see the module docstring)."""
    engine.policy.set_level(level)
    stats = GenerationStats(engine.n_layer, early_exit=True)
    kinds, checks, rejections, agrees, prompts = [], [], [], [], []
    with threadpool_limits(limits=1, user_api="blas"):  # numpy's threads would fight the decode's
        for shard in answers:
            engine.reset()
            prompt = shard.tokens[: shard.start + 1].tolist()
            for _ in engine.stream(prompt, max_tokens=1, sampling=GREEDY):  # the prompt pass: step 0's logits
                pass
            for j, reference in enumerate(shard.final_top1.tolist()[1:], 1):
                record = engine.step(int(shard.tokens[shard.start + j]))
                stats.add(record)
                kinds.append(record.exit_kind)
                checks.append(record.probes)
                rejections.append(record.verify_failures)
                agrees.append(int(np.argmax(engine.logits())) == reference)
                prompts.append(shard.prompt)
    engine.reset()
    # per prompt (all of its answers): the unit the intervals resample
    _, group = np.unique(np.array(prompts, dtype=np.int64), return_inverse=True)
    steps_of = np.bincount(group).astype(float)
    agreement = float(np.mean(agrees)) if agrees else 1.0
    low, high = ratio_interval(np.bincount(group, weights=np.array(agrees, dtype=float)), steps_of) if agrees else (1.0, 1.0)
    speedup = speedup_low = speedup_high = 1.0
    if costs is not None and agrees and not level.off:
        exit_layer = np.array([engine.n_layer - 1 if e is None else e for e in stats.exit_layers])
        features = costs.token_features(exit_layer, np.array(kinds), np.array(checks), np.array(rejections),
                                        fill=engine.kv_mode == "fill")
        per_prompt = np.stack([np.bincount(group, weights=column) for column in features.T], axis=-1)
        speedup = float(costs.plain_ms * len(agrees) / (features @ costs.parts).sum())
        speedup_low, speedup_high = costs.speedup_interval(per_prompt, steps_of)
    return Replay(len(agrees), agreement, stats.exit_rate, stats.head_free_rate, stats.avg_exit_layer,
                  stats.verify_fail_rate, low, high, speedup, speedup_low, speedup_high)


def identical_answers(engine: Engine, level: QualityLevel, greedy: Sequence[Shard], max_tokens: int) -> list[bool]:
    """Per greedy answer: the engine's greedy answer to its prompt equals it over the first max_tokens."""
    engine.policy.set_level(level)
    same = []
    with threadpool_limits(limits=1, user_api="blas"):
        for shard in greedy:
            reference = shard.tokens[shard.start + 1:].tolist()[:max_tokens]
            engine.reset()
            out = engine.generate(shard.tokens[: shard.start + 1].tolist(), max_tokens=len(reference), sampling=GREEDY)
            same.append(out.tokens[: len(reference)] == reference)
    engine.reset()
    return same
