"""The bench's quality figures (specee_edge/bench/quality.py) on a tiny random-weight model."""

from __future__ import annotations

import numpy as np
import pytest

from specee_edge.bench.quality import divergence_margins
from specee_edge.runtime import Context, Model
from tests.conftest import tiny_model_path

PROMPT = [1, 5, 9, 13]


def greedy(ctx: Context, prefix: list[int], n: int) -> list[int]:
    """n greedy tokens after the prompt and `prefix`, one token a decode (as vanilla decodes)."""
    ctx.clear()
    ctx.decode(PROMPT)
    for token in prefix:
        ctx.decode([token])
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(ctx.logits())))
        ctx.decode([tokens[-1]])
    return tokens


def test_a_divergence_is_counted_with_its_top_2_margin(tiny_dir):
    """Of an equal answer, one that ends sooner and one that takes the runner-up at position 3, only the last is a
    divergence, with the full model's top-1 minus top-2 logit there."""
    ctx = Context(Model(tiny_model_path(tiny_dir, "llama")), n_ctx=256, n_threads=1)
    reference = greedy(ctx, [], 6)
    greedy(ctx, reference[:3], 0)  # the cache at the divergence: the logits after the shared prefix
    logits = np.sort(ctx.logits().astype(np.float64))
    runner_up = int(np.argsort(ctx.logits())[-2])
    outputs = [reference, reference[:4], [*reference[:3], runner_up]]
    margins = divergence_margins(ctx, [PROMPT] * 3, [reference] * 3, outputs)
    ctx.close()
    assert margins == [pytest.approx(logits[-1] - logits[-2])]
