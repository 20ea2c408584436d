"""One exit rule: the runtime's (C, llama_specee_decide) and predictor/rule.py decide alike.

Random predictors, exit kinds, thresholds, schedules (which layers a token checks, in order), candidate
logits and verification outcomes; both implementations must reach the same decision, check count and
rejection count. The candidate merge with prompt lookup is compared through the real graph.
"""

from __future__ import annotations

import numpy as np
import pytest

from specee_edge.exits import ExitKind
from specee_edge.pack.format import OFF, LayerExit
from specee_edge.predictor import MLPPredictor
from specee_edge.predictor.rule import TokenChecks, decide
from specee_edge.runtime import Context, Model
from tests.conftest import tiny_model_path

K = 4
DECISIONS = 10_000
# the predictor's probability is computed in float32 by both sides, in another order: where it lies this
# close to the threshold the two may round to opposite sides, and such checks are left out (and counted)
TIE = 1e-5


def random_mlp(rng: np.random.Generator, hidden: int) -> MLPPredictor:
    w0 = rng.normal(0, 0.6, (hidden, 3 * K)).astype(np.float32)
    w1 = rng.normal(0, 0.4, (1, hidden)).astype(np.float32)
    return MLPPredictor([w0, w1], [rng.normal(0, 0.3, hidden).astype(np.float32), rng.normal(0, 0.5, 1).astype(np.float32)])


def random_exits(rng: np.random.Generator, layers: list[int], last: int) -> dict[int, LayerExit]:
    exits = {}
    for il in layers:
        kind = ExitKind(rng.choice([0, 1, 2], p=[0.2, 0.4, 0.4]))
        if il == last and kind == ExitKind.VERIFIED:
            kind = ExitKind.HEAD_FREE  # the last layer's exit head is the output head: head-free or off
        exits[il] = LayerExit(kind, float(rng.choice(np.round(np.arange(0.3, 1.0, 0.01), 2)))) if kind else OFF
    return exits


def near_threshold(layers, logits, predictors, exits) -> bool:
    checks = TokenChecks()
    for il, z in zip(layers, logits):
        _, prob = checks.check(z, predictors[il], exits[il])
        if exits[il].on and abs(prob - exits[il].threshold) < TIE:
            return True
    return False


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Model(tiny_model_path(tmp_path_factory.mktemp("rule"), "llama"))


def test_the_c_and_python_rules_decide_alike(tiny):
    rng = np.random.default_rng(7)
    n_layer = tiny.info.n_layer
    ctx = Context(tiny, n_threads=1, n_ctx=32)
    ctx.enable_early_exit(K, "mask")
    decided = ties = 0
    kinds = {kind: 0 for kind in ExitKind}
    for _round in range(20):  # new predictors and exits every 500 decisions
        predictors = {il: random_mlp(rng, int(rng.integers(4, 64))) for il in range(n_layer)}
        exits = random_exits(rng, list(predictors), n_layer - 1)
        for il, mlp in predictors.items():
            ctx.set_predictor(il, mlp.weights, mlp.biases)
            ctx.set_exit(il, exits[il].kind, exits[il].threshold)
        for _ in range(DECISIONS // 20):
            layers = sorted(rng.choice(n_layer, size=int(rng.integers(1, n_layer + 1)), replace=False).tolist())
            logits = rng.normal(0, rng.choice([0.5, 2.0, 6.0]), (len(layers), K)).astype(np.float32)
            verified = rng.random(len(layers)) < 0.6
            if near_threshold(layers, logits, predictors, exits):
                ties += 1
                continue
            ours = decide(layers, logits, verified, predictors, exits)
            theirs = ctx.decide(layers, logits, verified)
            native = (None if theirs.exit_layer < 0 else theirs.exit_layer, ExitKind(theirs.exit_kind),
                      theirs.n_probes, theirs.n_verify_fail)
            assert (ours.exit_layer, ours.kind, ours.probes, ours.rejections) == native, (layers, exits)
            kinds[ours.kind] += 1
            decided += 1
    ctx.close()
    assert decided >= 0.999 * DECISIONS and ties <= 0.001 * DECISIONS
    assert min(kinds.values()) > 0.1 * DECISIONS  # no exit, verified and head-free decisions all tested
