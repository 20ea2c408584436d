"""The quality dial's search (calibrate/levels.py) and the exit temperatures, on synthetic steps."""

from __future__ import annotations

import numpy as np
import pytest

from specee_edge.calibrate.dataset import Dataset
from specee_edge.calibrate.levels import (
    CostModel,
    ExitTable,
    LevelSearch,
    bisect_last,
    check_with_engine,
    choose_levels,
    greedy_path,
)
from specee_edge.calibrate.replay import Replay
from specee_edge.calibrate.predictor_fit import Probes, simulate, train_predictors
from specee_edge.calibrate.temperature import cross_entropy, fit_beta
from specee_edge.pack.format import Schedule

N_LAYER, K, ANSWERS, STEPS = 8, 4, 60, 50
LEVELS = (0.9, 0.95, 0.98, 0.99)


@pytest.fixture(scope="module")
def synthetic():
    """Steps whose candidates' logits sharpen with depth; deeper layers agree with the final more often."""
    rng = np.random.default_rng(0)
    n = ANSWERS * STEPS
    depth = np.arange(N_LAYER) / (N_LAYER - 1)
    ease = rng.random(n)  # how early a step settles
    settles = ease[:, None] + depth[None, :] > 1.0
    correct = settles | (rng.random((n, N_LAYER)) < 0.15)
    correct[:, -1] = True
    verified = correct & (rng.random((n, N_LAYER)) < 0.8) | (rng.random((n, N_LAYER)) < 0.05)
    logits = rng.normal(size=(n, N_LAYER, K)).astype(np.float32)
    logits[:, :, 0] += np.where(correct, 3.0, 0.0) * (0.3 + depth) + ease[:, None]
    probes = Probes(np.zeros((n, K), dtype=np.int64), logits, verified & correct, verified, correct)
    answer = np.repeat(np.arange(ANSWERS), STEPS).astype(np.int32)
    ds = Dataset(prompt=answer, answer=answer, token=np.zeros(n, np.int32), hidden=np.zeros((n, N_LAYER, 1), np.float16),
                 prev_final=np.zeros((n, 1), np.float16), prev_exit=np.zeros((n, 1), np.float16),
                 top1=np.zeros((n, N_LAYER), np.int32))
    train = np.flatnonzero(answer < 30)
    calib = np.flatnonzero((answer >= 30) & (answer < 45))
    test = np.flatnonzero(answer >= 45)
    predictors = train_predictors(probes, train, hidden=16, seed=0)
    cost = CostModel(N_LAYER, head=2.0, fill=0.05)
    search = LevelSearch(ds, probes, predictors, calib, test, cost, Schedule(offline=[]), 1 - min(LEVELS))
    return ds, probes, predictors, calib, choose_levels(search, LEVELS), search


def test_each_level_keeps_its_error_budget_on_the_steps_it_was_chosen_on(synthetic):
    ds, probes, predictors, calib, choices, _ = synthetic
    assert any(c.level.exit_rate > 0 for c in choices)  # the search found exits at all
    for choice in choices:
        level = choice.level
        online = simulate(ds, probes, predictors, level.thresholds, calib,
                          Schedule(offline=level.offline))
        assert online.agreement >= level.quality - 1e-12


def test_a_higher_level_never_exits_more(synthetic):
    ds, probes, predictors, calib, choices, _ = synthetic
    for lower, higher in zip(choices, choices[1:]):
        assert all(higher.level.thresholds[il] >= lower.level.thresholds[il] for il in predictors)
    table = ExitTable(probes, predictors, calib, N_LAYER)
    exits = [(table.decide(np.array([c.level.thresholds[il] for il in table.layers])).exit_layer < N_LAYER - 1).sum()
             for c in choices]
    assert exits == sorted(exits, reverse=True)


def test_the_greedy_path_spends_errors_for_savings(synthetic):
    _, probes, predictors, calib, _, _ = synthetic
    table = ExitTable(probes, predictors, calib, N_LAYER)
    path = greedy_path(table, CostModel(N_LAYER, head=2.0, fill=0.05), max_errors=40)
    assert len(path) > 1 and path[0].saved == 0 and path[0].errors == 0
    assert all(b.saved > a.saved for a, b in zip(path, path[1:]))
    assert path[-1].errors <= 40


def test_a_costly_head_makes_rejected_verifications_count():
    cost = CostModel(30, head=8.0, fill=0.06)
    exit_at_15 = cost.token(np.array([15]), np.array([0]))[0]
    assert exit_at_15 == pytest.approx(16 + 8 + 14 * 0.06)
    assert cost.token(np.array([29]), np.array([1]))[0] == pytest.approx(cost.full + 8)


def test_fitted_temperature_recovers_a_known_scale_and_lowers_cross_entropy():
    rng = np.random.default_rng(1)
    z = rng.normal(scale=3.0, size=(200, 500)).astype(np.float64)
    target = np.exp(0.4 * z - np.log(np.exp(0.4 * z).sum(axis=1, keepdims=True)))
    beta = fit_beta(z, target)
    assert beta == pytest.approx(0.4, rel=0.02)
    assert cross_entropy(z, target, beta) < cross_entropy(z, target, 1.0)


def test_bisect_finds_the_boundary_and_respects_its_step_cap():
    assert bisect_last(0, 100, lambda i: i <= 37) == 37
    assert bisect_last(0, 100, lambda i: i <= 37, steps=2) == 25  # probes 50 (fails), 25 (holds)
    assert bisect_last(0, 1, lambda i: False) == 0


def test_levels_the_engine_misses_step_back_and_stay_monotone(synthetic):
    """A stand-in for the engine whose agreement falls with depth along the path faster than the
    K/V-exact estimate: every level steps back to a point where it holds."""
    *_, choices, search = synthetic
    last = len(search.path) - 1

    def measure(level) -> Replay:
        index = next(i for i, p in enumerate(search.path) if list(p.thresholds) == [level.thresholds[il] for il in search.layers])
        return Replay(100, 1.0 - 0.2 * index / max(last, 1), 0.1, 20.0, 0.0)

    checked = check_with_engine(search, choices, measure, refine=8)
    for before, after in zip(choices, checked):
        assert after.index <= before.index
        assert after.level.agreement >= after.level.quality or after.index == 0
    assert [c.index for c in checked] == sorted((c.index for c in checked), reverse=True)
