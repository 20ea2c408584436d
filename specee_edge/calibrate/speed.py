"""What a unit of calibration's work costs on this machine, for this model, measured in a few seconds before the
run starts (budget.py turns it into each stage's estimated time).

- a plain token and a prompt pass: a short greedy answer through the engine, early exit off;
- a collection step: the same prompt answered by the collector (every layer's output captured), twice: once
  stopping right after the prompt, once PROBE_TOKENS later; the difference is the steps' time alone;
- a hidden state through the logit lens: a chunk of random hidden states through the final norm and the LM
  head (numpy), the faster of two, and the head's transposition that every answer's lens pays once.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from specee_edge.calibrate.budget import MachineSpeed
from specee_edge.calibrate.collect import Collector
from specee_edge.data.prompts import Prompt
from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.runtime.weights import LENS_ROWS, TargetWeights, lens_chunk, lens_head

PROBE_TOKENS = 32


def measure_speed(model: Path, weights: TargetWeights, prompt: Prompt, *, threads: int) -> MachineSpeed:
    plain_s, prompt_s = _engine_speed(model, prompt, threads)
    return MachineSpeed(step_s=_collection_step(model, prompt, threads) or plain_s, prompt_s=prompt_s,
                        plain_s=plain_s, **_lens_speed(weights))


def _engine_speed(model: Path, prompt: Prompt, threads: int) -> tuple[float, float]:
    """(seconds per plain token, seconds of the prompt's pass)."""
    engine = Engine(model, pack=None, config=EngineConfig(n_ctx=1024, n_threads=threads))
    try:
        tokens = engine.prompt_tokens(prompt.text)
        engine.generate(tokens, max_tokens=4, sampling=GREEDY)  # builds the graphs once
        engine.reset()
        stats = engine.generate(tokens, max_tokens=PROBE_TOKENS, sampling=GREEDY).stats
    finally:
        engine.close()
    return stats.decode_s / max(1, stats.n_decode), stats.prompt_s


def _collection_step(model: Path, prompt: Prompt, threads: int) -> float | None:
    """Seconds per collection step, or None where the answer ended before a step could be timed."""
    collector = Collector(model, n_threads=threads, max_answer=PROBE_TOKENS + 1)
    try:
        with threadpool_limits(limits=1, user_api="blas"):  # as collection runs
            runs = []
            for max_answer in (PROBE_TOKENS + 1, 1, PROBE_TOKENS + 1):  # the first builds the graphs
                collector.max_answer = max_answer
                t0 = time.perf_counter()
                shard = collector.answer(0, prompt, GREEDY)
                runs.append((shard.steps, time.perf_counter() - t0))
    finally:
        collector.close()
    (_, _), (short_steps, short_s), (long_steps, long_s) = runs
    return (long_s - short_s) / (long_steps - short_steps) if long_steps > short_steps and long_s > short_s else None


def _lens_speed(weights: TargetWeights) -> dict[str, float]:
    """lens_row_s and lens_head_s (MachineSpeed's fields)."""
    weights.lm_head  # dequantized once for the whole run (a cached property): not the lens's cost
    t0 = time.perf_counter()
    head_t = lens_head(weights)
    head_s = time.perf_counter() - t0
    hidden = np.random.default_rng(0).standard_normal((LENS_ROWS, head_t.shape[0])).astype(np.float16)
    seconds = []
    for _ in range(2):  # the faster of two: the first also pays for warming the caches and the allocator
        t0 = time.perf_counter()
        lens_chunk(hidden, weights, head_t)
        seconds.append(time.perf_counter() - t0)
    return {"lens_row_s": min(seconds) / LENS_ROWS, "lens_head_s": head_s}
