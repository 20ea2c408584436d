"""The quality dial's search (calibrate/levels.py) and the exit temperatures, on synthetic steps."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from specee_edge.calibrate.dataset import Dataset
from specee_edge.calibrate.levels import (
    ExitTable,
    LevelSearch,
    check_with_engine,
    choose_levels,
    greedy_path,
    keep_promises,
    last_holding,
    pays,
    turned_off,
)
from specee_edge.calibrate.predictor_fit import Probes, simulate, train_predictors
from specee_edge.calibrate.replay import Replay
from specee_edge.calibrate.temperature import cross_entropy, fit_beta
from specee_edge.exits import ExitKind
from specee_edge.pack.format import OFF, LayerExit, QualityLevel, Schedule
from specee_edge.predictor.rule import decide
from specee_edge.runtime.costs import TokenCosts
from specee_edge.shipped import shipped_dir

N_LAYER, K, ANSWERS, STEPS = 8, 4, 60, 50
LEVELS = (0.9, 0.95, 0.98, 0.99)
COSTS = TokenCosts(N_LAYER, plain_ms=1.0 + N_LAYER * 1.0 + 2.0, fixed_ms=1.0, layer_ms=1.0, mask_ms=0.0, head_ms=2.0,
                   draft_ms=0.2, check_ms=0.05, stop_ms=0.05, fill_ms=0.05, curve_ms=0.0)


def synthetic_steps():
    """Steps whose candidates' logits sharpen with depth; deeper layers agree with the final more often.
    The candidates' argmax is right wherever the layer's top-1 is, and on some steps where it is not."""
    rng = np.random.default_rng(0)
    n = ANSWERS * STEPS
    depth = np.arange(N_LAYER) / (N_LAYER - 1)
    ease = rng.random(n)  # how early a step settles
    settles = ease[:, None] + depth[None, :] > 1.0
    correct = settles | (rng.random((n, N_LAYER)) < 0.15)
    correct[:, -1] = True
    verified = correct & (rng.random((n, N_LAYER)) < 0.8) | (rng.random((n, N_LAYER)) < 0.05)
    head_free = (correct & verified) | (rng.random((n, N_LAYER)) < 0.1)
    logits = rng.normal(size=(n, N_LAYER, K)).astype(np.float32)
    logits[:, :, 0] += np.where(head_free, 3.0, 0.0) * (0.3 + depth) + ease[:, None]
    probes = Probes(np.zeros((n, K), dtype=np.int64), logits, verified, correct, head_free)
    answer = np.repeat(np.arange(ANSWERS), STEPS).astype(np.int32)
    ds = Dataset(prompt=answer, answer=answer, token=np.zeros(n, np.int32), hidden=np.zeros((n, N_LAYER, 1), np.float16),
                 prev_final=np.zeros((n, 1), np.float16), prev_exit=np.zeros((n, 1), np.float16),
                 top1=np.zeros((n, N_LAYER), np.int32))
    return ds, probes, answer


@pytest.fixture(scope="module")
def synthetic():
    ds, probes, answer = synthetic_steps()
    train = ds.rows(np.arange(30))
    calib = ds.rows(np.arange(30, 45))
    test = ds.rows(np.arange(45, ANSWERS))
    predictors = train_predictors(probes, train, range(2, N_LAYER), hidden=16, seed=0)
    search = LevelSearch(ds, probes, predictors, calib, COSTS, Schedule(offline=[]), 1 - min(LEVELS), fill=True)
    return ds, probes, predictors, calib, test, choose_levels(search, LEVELS), search


def test_dataset_rows_leave_out_each_answers_first_step():
    ds, _, answer = synthetic_steps()
    rows = ds.rows(np.arange(3))
    assert len(rows) == 3 * (STEPS - 1)
    assert not set(rows) & {0, STEPS, 2 * STEPS}  # the prompt's last token: decoded in the prompt's batch


def test_the_vectorised_table_decides_like_the_exit_rule(synthetic):
    """ExitTable.decide (the search's) against rule.decide step by step, on random kinds and thresholds."""
    ds, probes, predictors, calib, *_ = synthetic
    table = ExitTable(probes, predictors, calib, N_LAYER)
    rng = np.random.default_rng(3)
    for _ in range(20):
        kinds = rng.choice([0, 1, 2], size=len(table.layers))
        kinds[(table.layers == N_LAYER - 1) & (kinds == ExitKind.VERIFIED)] = ExitKind.HEAD_FREE
        thresholds = rng.uniform(0.3, 0.99, size=len(table.layers)).round(2)
        d = table.decide(kinds, thresholds)
        exits = {il: LayerExit(ExitKind(int(k)), float(t)) if k else OFF for il, k, t in zip(table.layers.tolist(), kinds, thresholds)}
        on = [il for il in table.layers.tolist() if exits[il].on]
        for i, row in enumerate(calib[:300]):
            ref = decide(on, probes.logits[row, on], probes.verified[row, on], predictors, exits)
            exit_layer = N_LAYER - 1 if ref.exit_layer is None else ref.exit_layer
            assert (d.exit_layer[i], d.kind[i], d.checks[i], d.rejections[i]) == (exit_layer, ref.kind, ref.probes, ref.rejections)
            emits_final = ref.exit_layer is None or probes.exit_correct(ref.kind)[row, ref.exit_layer]
            assert d.wrong[i] == (not emits_final)


def test_a_higher_level_never_exits_more_on_unseen_steps(synthetic):
    ds, probes, predictors, calib, test, choices, search = synthetic
    assert any(not c.level.off for c in choices)  # the search found exits at all
    table = ExitTable(probes, predictors, test, N_LAYER)
    exits = []
    for choice in choices:
        point = search.path[choice.index]
        exits.append(int((table.decide(point.kinds, point.thresholds).kind != ExitKind.NONE).sum()))
    assert exits == sorted(exits, reverse=True)
    assert exits[0] > exits[-1]  # the levels differ


def test_what_the_head_costs_decides_the_kind_of_exit(synthetic):
    """A head as costly as the whole network makes the search take head-free exits. Where verification is
    never wrong (here: it passes exactly where the layer's top-1 is the full model's) and the head is free,
    verified exits cost nothing extra and add no errors: the search takes them."""
    _, probes, predictors, calib, *_ = synthetic
    table = ExitTable(dataclasses.replace(probes, verified=probes.correct.copy()), predictors, calib, N_LAYER)

    def kinds_taken(head_ms: float) -> set[int]:
        costs = dataclasses.replace(COSTS, head_ms=head_ms)
        path = greedy_path(table, costs, max_errors=60, fill=True)
        return {int(k) for k in path[-1].kinds if k != ExitKind.NONE}

    assert kinds_taken(head_ms=20.0) == {ExitKind.HEAD_FREE}
    assert ExitKind.VERIFIED in kinds_taken(head_ms=0.0)


def test_the_greedy_path_spends_errors_for_savings(synthetic):
    _, probes, predictors, calib, *_ = synthetic
    table = ExitTable(probes, predictors, calib, N_LAYER)
    path = greedy_path(table, COSTS, max_errors=40, fill=True)
    assert len(path) > 2 and path[0].saved_ms == 0 and path[0].errors == 0
    assert all(b.saved_ms > a.saved_ms for a, b in zip(path[1:], path[2:]))
    assert max(point.errors for point in path) <= 40
    # the savings are the cost model's: priced again from the decisions they came from
    last = path[-1]
    d = table.decide(last.kinds, last.thresholds)
    priced = COSTS.plain_ms * len(calib) - COSTS.token_ms(d.exit_layer, d.kind, d.checks, d.rejections, fill=True).sum()
    assert last.saved_ms == pytest.approx(priced)


def test_a_level_that_does_not_pay_for_its_draft_turns_every_layer_off(synthetic):
    ds, probes, predictors, calib, *_ = synthetic
    costly_draft = dataclasses.replace(COSTS, draft_ms=100.0)
    search = LevelSearch(ds, probes, predictors, calib, costly_draft, Schedule(offline=[]), 0.1, fill=True)
    assert all(choice.level.off for choice in choose_levels(search, LEVELS))


def test_token_costs_price_each_part():
    exit_15 = COSTS.token_ms(np.array([5]), np.array([ExitKind.HEAD_FREE]), np.array([2]), np.array([1]), fill=True)[0]
    assert exit_15 == pytest.approx(1.0 + 0.2 + 6 * 1.0 + 2 * 0.05 + 1 * 2.0 + 0.05 + 2 * 0.05)  # one rejection's head
    full = COSTS.token_ms(np.array([N_LAYER - 1]), np.array([ExitKind.NONE]), np.array([3]), np.array([0]), fill=True)[0]
    assert full == pytest.approx(COSTS.plain_ms + 0.2 + 3 * 0.05)
    skip_head = COSTS.token_ms(np.array([N_LAYER - 1]), np.array([ExitKind.HEAD_FREE]), np.array([1]), np.array([0]), fill=True)[0]
    assert skip_head == pytest.approx(COSTS.plain_ms - 2.0 + 0.2 + 0.05 + 0.05)


def test_fitted_temperature_recovers_a_known_scale_and_lowers_cross_entropy():
    rng = np.random.default_rng(1)
    z = rng.normal(scale=3.0, size=(200, 500)).astype(np.float64)
    target = np.exp(0.4 * z - np.log(np.exp(0.4 * z).sum(axis=1, keepdims=True)))
    beta = fit_beta(z, target)
    assert beta == pytest.approx(0.4, rel=0.02)
    assert cross_entropy(z, target, beta) < cross_entropy(z, target, 1.0)


def test_last_holding_finds_the_boundary():
    assert last_holding(range(101), lambda i: i <= 37) == 37
    assert last_holding([0, 10, 20, 30, 40], lambda i: i <= 37) == 30
    assert last_holding(range(5), lambda i: False) == 0  # the first candidate is taken to hold
    assert last_holding(range(5), lambda i: True) == 4


def test_levels_the_engine_misses_step_back_and_stay_monotone(synthetic):
    """A stand-in for the engine whose agreement falls with depth along the path faster than the
    K/V-exact estimate: every level steps back to a point where it holds; the choices given are left as
    they were."""
    *_, choices, search = synthetic
    last = len(search.path) - 1
    before = copy.deepcopy(choices)

    def measure(level) -> Replay:
        index = next(i for i in range(len(search.path)) if search.exits_at(i) == level.exits)
        agreement = 1.0 - 0.2 * index / max(last, 1)
        return Replay(100, agreement, 0.1, 0.05, 20.0, 0.0, agreement - 0.01, agreement + 0.01, 1.0)

    checked = check_with_engine(search, choices, measure)
    assert [(c.index, c.level) for c in choices] == [(c.index, c.level) for c in before]
    for chosen, after in zip(choices, checked):
        assert after.index <= chosen.index
        assert after.index == 0 or after.engine.agreement >= after.level.quality
    assert [c.index for c in checked] == sorted((c.index for c in checked), reverse=True)
    assert any(after.index < chosen.index for chosen, after in zip(choices, checked))


def test_simulated_levels_keep_their_budget_on_unseen_steps_within_noise(synthetic):
    """K/V exact, the budget chosen on the calibration split is close to what unseen steps give."""
    ds, probes, predictors, calib, test, choices, _ = synthetic
    for choice in choices:
        online = simulate(ds, probes, predictors, choice.level.exits, test, Schedule(offline=choice.level.offline))
        assert online.agreement >= choice.level.quality - 0.03


def measured_level(quality: float, low: float, *, on: bool = True) -> QualityLevel:
    exits = {3: LayerExit(ExitKind.HEAD_FREE, 0.8) if on else OFF}
    return QualityLevel(quality, exits, [], agreement=low + 0.01, steps=2000.0, agreement_low=low, agreement_high=low + 0.02)


def test_a_level_ships_under_the_agreement_its_held_out_interval_holds():
    """Kept where the interval's low end reaches the name; renamed after it where it does not; dropped where
    that name is taken; a level with every layer off decodes plainly and keeps its name."""
    shipped = keep_promises([measured_level(0.9, 0.905), measured_level(0.95, 0.9337), measured_level(0.98, 0.9049),
                             measured_level(0.99, 0.2, on=False)])
    assert [level and level.quality for level in shipped] == [0.9, 0.93, None, 0.99]
    assert shipped[1].exits == measured_level(0.95, 0.9337).exits  # renamed, not changed
    # a name reached exactly is kept; one below the step's first multiple is dropped
    assert keep_promises([measured_level(0.98, 0.98)])[0].quality == 0.98
    assert keep_promises([measured_level(0.9, 0.004)]) == [None]


def test_a_pack_from_before_the_bootstrap_falls_back_to_wilson():
    old = QualityLevel(0.95, {3: LayerExit(ExitKind.HEAD_FREE, 0.8)}, [], agreement=0.96, steps=4000.0)
    low, high = old.agreement_interval()
    assert low < 0.96 < high and high - low < 0.02  # steps taken as independent: narrow


def test_a_level_is_on_only_where_its_predicted_gain_clears_its_noise():
    def run(low: float) -> Replay:
        return Replay(100, 0.99, 0.3, 0.1, 10.0, 0.0, 0.98, 1.0, 1.2, low, 1.4)

    assert pays(run(1.01)) and not pays(run(1.0)) and not pays(run(0.95)) and not pays(None)
    level = measured_level(0.9, 0.92)
    assert turned_off(level).off and not level.off and turned_off(level).exits.keys() == level.exits.keys()


def test_an_older_pack_is_renamed_by_its_stored_interval(monkeypatch):
    """tools/keep_promises.py on a pack whose level claims more than its interval holds."""
    from specee_edge.pack import read_pack
    from tests.conftest import SHIPPED_PACK, load_tool

    tool = load_tool("keep_promises", monkeypatch)
    pack = read_pack(SHIPPED_PACK)
    level = next(lv for lv in pack.levels if lv.on_layers and not lv.exact)
    claims = dataclasses.replace(level, quality=round(level.agreement_interval()[0] + 0.02, 3))
    others = [lv for lv in pack.levels if lv.quality != level.quality and lv.quality != claims.quality]
    new, changes = tool.promised(dataclasses.replace(pack, levels=sorted([claims, *others], key=lambda lv: lv.quality)))
    assert len(changes) == 1 and claims.quality not in [lv.quality for lv in new.levels]
    assert any(lv.exits == level.exits and lv.quality <= level.agreement_interval()[0] for lv in new.levels)
    assert tool.promised(new)[1] == []


@pytest.mark.parametrize("path", sorted(shipped_dir().glob("*.specee.gguf")), ids=lambda path: path.name)
def test_every_shipped_level_holds_its_name_at_the_low_end_of_a_bootstrapped_interval(path):
    """No level ships under a name its held-out interval (bootstrapped over prompts, not Wilson's over steps)
    does not reach at its low end; a level with every layer off decodes plainly and holds any name."""
    from specee_edge.pack import read_pack

    for level in read_pack(path).levels:
        if level.exact or not level.on_layers:
            continue
        assert level.agreement_high > 0, f"{level.quality:g}: no bootstrapped interval"
        assert level.quality <= level.agreement_low, f"{level.quality:g} above its low end {level.agreement_low:.4f}"
