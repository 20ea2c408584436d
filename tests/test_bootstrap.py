"""Intervals that resample prompts (specee_edge/bootstrap.py) and the cost lanes' fit (runtime/costs.py),
on synthetic numbers."""

from __future__ import annotations

import numpy as np
import pytest

from specee_edge.bootstrap import ratio_interval, speedup_interval
from specee_edge.pack.format import QualityLevel
from specee_edge.runtime.costs import PARTS, ROUNDS, CostLane, TokenCosts, stop_layers
from tests.conftest import load_tool

N_LAYER = 12


def test_an_interval_over_prompts_is_wider_than_one_over_tokens_where_prompts_differ():
    """20 prompts of 200 steps: most agree on 99 % of their steps, a few on 80 %. Counting the 4,000 steps as
    independent gives about +-0.4 points; the prompts' own spread is several times that."""
    agree = np.array([198.0] * 16 + [160.0] * 4)
    steps = np.full(20, 200.0)
    low, high = ratio_interval(agree, steps)
    point = agree.sum() / steps.sum()
    assert low < point < high
    p, n = point, steps.sum()
    token_half_width = 1.96 * np.sqrt(p * (1 - p) / n)
    assert (high - low) / 2 > 2 * token_half_width
    assert ratio_interval(np.full(20, 190.0), steps) == pytest.approx((0.95, 0.95))  # no spread, no width


def lanes_timing(parts: dict[str, float], tokens: int, noise_ms: float, seed: int, rounds: int = 1,
                 drift: float = 0.0, split: int | None = None) -> list[list[CostLane]]:
    """Rounds of cost lanes (no context: their samples are made up) whose tokens cost what `parts` say, plus
    noise; each round's parts are off by a random share of up to about `drift` (what changes between rounds).
    `split`: the first layer on another device, whose layers and crossing cost what split_layer_ms and
    crossing_ms say (parts without them: none)."""
    rng = np.random.default_rng(seed)
    n = N_LAYER
    callback = 0.07  # what a Python probe callback adds to a layer
    timed = []
    for _ in range(rounds):
        p, f, l, mask, h, d, c, s, k, q, past_l, cross = (parts.get(p, 0.0) * (1 + drift * rng.normal()) for p in PARTS)
        on_split = lambda x: past_l * max(x - split, 0) + cross * (x > split) if split is not None else 0.0
        means = {"plain": (p, n), "checked_one": (f + n * l + n * n * q + on_split(n) + h + d + c, n),
                 "checked_all": (f + n * l + n * n * q + on_split(n) + h + d + n * c, n), "draft": (d, n)}
        for il in stop_layers(n, split):
            x = il + 1
            means[f"stop_mask@{il}"] = (f + x * (l + mask) + x * x * q + on_split(x) + d + c + s, x)
            means[f"stop_fill@{il}"] = (f + x * l + x * x * q + on_split(x) + d + c + s + (n - x) * k, x)
            means[f"stop_free@{il}"] = (f + x * (l + mask + callback) + x * x * q + on_split(x) + s, x)
            means[f"stop_head@{il}"] = (f + x * (l + mask + callback) + x * x * q + on_split(x) + s + h, x)
        lanes = []
        for name, (mean, layers_run) in means.items():
            lane = CostLane(name, ctx=None, layers_run=layers_run, split=split if name == "plain" else None)
            lane.samples = list(mean + rng.normal(0, noise_ms, tokens)
                                + rng.exponential(noise_ms, tokens) * (rng.random(tokens) < 0.05))
            lanes.append(lane)
        timed.append(lanes)
    return timed


TRUTH = dict(plain_ms=2.0 + N_LAYER * 0.45 + 3.0, fixed_ms=2.0, layer_ms=0.5, mask_ms=0.04, head_ms=3.0, draft_ms=0.3, check_ms=0.02, stop_ms=0.1,
             fill_ms=0.05, curve_ms=0.004)


def test_costs_are_recovered_within_their_intervals_and_never_clipped():
    costs = TokenCosts.fit(lanes_timing(TRUTH, 300, 0.2, seed=1))
    for part, value in TRUTH.items():
        low, high = costs.intervals[part]
        assert low <= getattr(costs, part) <= high
        assert low - 0.05 <= value <= high + 0.05, part
    # a part too small to see: its estimate falls on either side of 0, as measured, and its interval spans 0
    nothing = TRUTH | {"stop_ms": 0.0}
    fits = [TokenCosts.fit(lanes_timing(nothing, 100, 0.5, seed=seed)) for seed in range(12)]
    assert min(c.stop_ms for c in fits) < 0 < max(c.stop_ms for c in fits)
    assert sum(c.intervals["stop_ms"][0] < 0 < c.intervals["stop_ms"][1] for c in fits) >= 10


def test_each_side_of_a_split_and_the_crossing_are_priced_apart():
    """The first 5 layers on a fast device, the rest on the CPU at 0.4 ms more a layer, 0.3 ms to hand a token's
    hidden state over: the stops on both sides recover both slopes and the step, and an exit before the split is
    worth the slow layers and the crossing it skips. On one device the split's parts are none."""
    split = 5
    truth = TRUTH | {"layer_ms": 0.1, "split_layer_ms": 0.4, "crossing_ms": 0.3}
    costs = TokenCosts.fit(lanes_timing(truth, 400, 0.05, seed=6, split=split))
    assert costs.split == split and stop_layers(N_LAYER, split)[:2] == [2, 4] and split in stop_layers(N_LAYER, split)
    for part in ("layer_ms", "split_layer_ms", "crossing_ms", "head_ms", "fixed_ms"):
        assert getattr(costs, part) == pytest.approx(truth[part], abs=0.03), part
        low, high = costs.intervals[part]
        assert low <= getattr(costs, part) <= high
    saved = costs.head_free_ms(np.array([split + 1])) - costs.head_free_ms(np.array([split]))
    assert saved[0] == pytest.approx(0.1 + 0.4 + 0.3 + (2 * split + 1) * truth["curve_ms"], abs=0.05)
    one_device = TokenCosts.fit(lanes_timing(TRUTH, 100, 0.05, seed=6))
    assert one_device.split is None and one_device.split_layer_ms == one_device.crossing_ms == 0.0
    # a side too short to stop on twice is priced with the other's layers
    assert stop_layers(N_LAYER, N_LAYER - 2) == stop_layers(N_LAYER) == stop_layers(N_LAYER, 1)


def test_the_depth_mask_and_the_fill_are_told_apart():
    """A mask-mode layer that costs more than a plain one must not come out as a cheaper fill (the two stop
    lines share their intercept up to n fills) nor as a dearer plain layer."""
    truth = TRUTH | {"mask_ms": 0.2, "fill_ms": 0.03}
    costs = TokenCosts.fit(lanes_timing(truth, 400, 0.05, seed=3))
    for part in ("layer_ms", "mask_ms", "fill_ms"):
        assert getattr(costs, part) == pytest.approx(truth[part], abs=0.01), part
    fill_mode = costs.token_features(np.array([5]), np.array([2]), np.ones(1), np.zeros(1), fill=True)[0]
    mask_mode = costs.token_features(np.array([5]), np.array([2]), np.ones(1), np.zeros(1), fill=False)[0]
    assert fill_mode[PARTS.index("mask_ms")] == 0 and mask_mode[PARTS.index("mask_ms")] == 6
    assert mask_mode[PARTS.index("fill_ms")] == 0 and fill_mode[PARTS.index("fill_ms")] == N_LAYER - 6


def test_an_interval_over_rounds_holds_what_changes_between_them():
    """Rounds whose parts drift apart by a few per cent widen the interval several times over rounds that do
    not, for the same tokens; one round alone cannot see the drift."""
    def width(fit: TokenCosts) -> float:
        low, high = fit.intervals["head_ms"]
        return high - low

    steady = TokenCosts.fit(lanes_timing(TRUTH, 100, 0.05, seed=4, rounds=4))
    drifting = TokenCosts.fit(lanes_timing(TRUTH, 100, 0.05, seed=4, rounds=4, drift=0.04))
    assert width(drifting) > 3 * width(steady)
    assert width(TokenCosts.fit(lanes_timing(TRUTH, 400, 0.05, seed=4, drift=0.04))) < width(drifting) / 3


def coverage(rounds: int, measurements: int = 40) -> np.ndarray:
    """Per part (on one device: the split's parts are none), the share of simulated measurements whose interval
    holds the true cost, where the parts drift by 3 % between rounds (and barely from token to token)."""
    held = np.zeros(len(TRUTH))
    for seed in range(measurements):
        fit = TokenCosts.fit(lanes_timing(TRUTH, 40, 0.005, seed=seed, rounds=rounds, drift=0.03), seed)
        held += [fit.intervals[part][0] <= TRUTH[part] <= fit.intervals[part][1] for part in TRUTH]
    return held / measurements


@pytest.mark.slow
def test_six_rounds_hold_the_true_costs_three_did_not():
    """What changes between rounds is seen only through the rounds: calibration's 6 must hold the true costs
    about as often as a 95% interval promises (0.97 of the time, averaged over the parts); 3 held them 0.87."""
    six, three = coverage(6), coverage(3)
    assert ROUNDS == 6 and six.mean() >= 0.92 and three.mean() < 0.9
    print(f"true costs held: 6 rounds {six.mean():.2f} (worst part {six.min():.2f}), 3 rounds {three.mean():.2f}"
          f" ({three.min():.2f})")


def test_a_predicted_speedup_carries_the_costs_noise():
    """The same decisions priced by costs timed with more noise get a wider interval around the same point."""
    rng = np.random.default_rng(0)
    exit_layer = rng.integers(4, N_LAYER, 1000)
    kind = np.where(exit_layer < N_LAYER - 1, 2, 0)
    prompt = np.repeat(np.arange(20), 50)
    widths = []
    for noise in (0.05, 2.0):
        costs = TokenCosts.fit(lanes_timing(TRUTH, 200, noise, seed=2))
        features = costs.token_features(exit_layer, kind, np.ones(1000), np.zeros(1000), fill=False)
        per_prompt = np.stack([np.bincount(prompt, weights=column) for column in features.T], axis=-1)
        low, high = costs.speedup_interval(per_prompt, np.bincount(prompt).astype(float))
        point = costs.plain_ms * 1000 / costs.token_ms(exit_layer, kind, np.ones(1000), np.zeros(1000), fill=False).sum()
        assert low < point < high
        widths.append(high - low)
    assert widths[1] > 2 * widths[0]


def test_two_runs_on_a_machine_two_per_cent_faster_differ_in_ms_not_in_shares_of_a_plain_token(monkeypatch):
    """tools/compare_packs.py: a run on a machine 2 % faster throughout moves every large part outside the
    other's interval in ms, and none in shares of a plain token (the intervals the pack stores for those)."""
    tool = load_tool("compare_packs", monkeypatch)
    first = TokenCosts.fit(lanes_timing(TRUTH, 100, 0.05, seed=5, rounds=3)).to_dict()
    faster = TokenCosts.fit(lanes_timing({part: ms * 0.98 for part, ms in TRUTH.items()}, 100, 0.05 * 0.98, seed=5,
                                         rounds=3)).to_dict()
    large = [part for part in PARTS if abs(first[part]) > 2.5]  # moved by 2 % beyond their intervals' width
    in_ms = tool.cost_table([tool.in_ms(first), tool.in_ms(faster)], "ms")
    shares = tool.cost_table([tool.in_shares(first), tool.in_shares(faster)], "shares")
    assert in_ms.within <= in_ms.parts - len(large) and len(large) >= 2
    assert shares.within == shares.inside == shares.parts == len(PARTS) - 1


def test_a_share_of_a_plain_token_holds_the_plain_tokens_noise_too():
    """The stored interval of a part's share is the ratio's own, resample by resample. Here the plain token
    alone changes from round to round (by up to 7.5 %): its share intervals hold that change, which the parts'
    ms intervals divided by the plain token's point would not."""
    rounds = lanes_timing(TRUTH, 100, 0.05, seed=6, rounds=4)
    for lanes, change in zip(rounds, (-0.075, -0.025, 0.025, 0.075)):
        plain = next(lane for lane in lanes if lane.name == "plain")
        plain.samples = [ms * (1 + change) for ms in plain.samples]
    costs = TokenCosts.fit(rounds)
    plain_low, plain_high = costs.intervals["plain_ms"]
    for part in ("layer_ms", "head_ms", "draft_ms"):
        share = getattr(costs, part) / costs.plain_ms
        low, high = costs.share_intervals[part]
        ms_low, ms_high = costs.intervals[part]
        assert low < share < high
        assert (high - low) / share > 0.7 * (plain_high - plain_low) / costs.plain_ms
        assert (high - low) / share > 2 * (ms_high - ms_low) / getattr(costs, part)
    assert "plain_ms" not in costs.share_intervals


def test_comparing_two_packs_names_a_level_on_in_one_run_only_with_the_speed_ups_that_decided_it(monkeypatch):
    """tools/compare_packs.py: a level the second run turned on (its predicted low end just above 1) and the
    first left without exits is named with both predictions; the exact levels differ in nothing."""
    tool = load_tool("compare_packs", monkeypatch)

    def level(asked: float, speedup: float, low: float, on: bool) -> dict:
        return {"asked": asked, "quality": asked, "verified_layers": [], "head_free_layers": [12] if on else [],
                "calibration_speedup": speedup, "calibration_speedup_low": low}

    first = [level(0.9, 1.109, 1.082, True), level(0.98, 1.0, 1.0, False)]
    second = [level(0.9, 1.126, 1.101, True), level(0.98, 1.015, 1.001, True)]
    exact = [QualityLevel(quality=1.0, exits={}, offline=[], max_draft=3, speedup_low=0.9, speedup_sampled_low=0.8)] * 2
    compared = tool.level_table([first, second], exact)
    assert not compared.same_on_off and compared.same_names
    assert compared.flipped == ["0.98: on in the second run (1.015x, low end 1.001), off in the other (no exits)"]
    again = tool.level_table([first, first], exact)
    assert again.same_on_off and again.flipped == []


def timings(rng: np.random.Generator, n: int, ms: float, spread: float) -> np.ndarray:
    """n prompts of 60-90 steps at about `ms` a step, each prompt off by a random share of up to about `spread`."""
    steps = rng.integers(60, 90, n).astype(float)
    return np.stack([steps, steps * ms / 1e3 * (1 + spread * rng.normal(size=n))], axis=1)


def test_a_speedup_interval_holds_its_point_and_narrows_with_more_prompts():
    rng = np.random.default_rng(3)
    widths = []
    for n in (4, 16, 64):
        base, lane = timings(rng, n, 8.0, 0.05), timings(rng, n, 8.4, 0.05)
        point = (lane[:, 0].sum() / lane[:, 1].sum()) / (base[:, 0].sum() / base[:, 1].sum())
        low, high = speedup_interval(lane, base)
        assert low <= point <= high
        widths.append(high - low)
    assert widths[0] > widths[1] > widths[2]


def test_a_lane_against_itself_is_one_and_a_constant_ratio_has_no_width():
    base = timings(np.random.default_rng(4), 12, 8.0, 0.1)
    assert speedup_interval(base, base) == (1.0, 1.0)
    twice_as_fast = base * [1, 0.5]
    assert speedup_interval(twice_as_fast, base) == pytest.approx((2.0, 2.0))


def test_a_speedup_interval_is_paired_over_prompts():
    """Prompts of very different lengths and speeds, the lane 5 % faster on each: pairing the prompts keeps the
    interval near 1.05 however much the prompts differ from one another."""
    base = np.array([[10, 0.2], [90, 0.6], [40, 0.9], [70, 0.3], [20, 0.5], [60, 0.4]], dtype=float)
    lane = base * [1, 1 / 1.05] * np.array([[1.0], [0.99], [1.01], [1.0], [0.995], [1.005]]) ** [0, 1]
    low, high = speedup_interval(lane, base)
    assert 1.03 < low <= high < 1.07
