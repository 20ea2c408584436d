"""Calibration's estimate, its sizing to a number of minutes, and its progress lines (budget.py, progress.py)."""

from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console

from specee_edge.calibrate.budget import (CHEAP_ROUNDS, DEFAULT_SIZE, SMALLEST_SIZE, STAGES, MachineSpeed, RunShape,
                                          estimate, fit_minutes, given_up, remaining, scaled)
from specee_edge.calibrate.progress import RunProgress, clock

# SmolLM2-135M's shape; speeds of the order this 2-core machine measures
SHAPE = RunShape(n_layer=30, first_layer=7, n_embd=576, n_vocab=49152, draft_vocab=4096, levels=5, lookup=True,
                 prompts=120, code_share=25 / 120, max_answer=256, exact_prompts=4)
SPEED = MachineSpeed(step_s=0.011, prompt_s=0.05, plain_s=0.010, lens_row_s=7e-4, lens_head_s=0.05)


def total(size, shape=SHAPE, speed=SPEED) -> float:
    return sum(estimate(size, shape, speed).values())


def test_every_stage_is_estimated_and_positive():
    seconds = estimate(DEFAULT_SIZE, SHAPE, SPEED)
    assert list(seconds) == [key for key, _ in STAGES]
    assert all(s > 0 for s in seconds.values())


def test_the_data_stages_grow_with_the_answer_steps():
    small = estimate(dataclasses.replace(DEFAULT_SIZE, tokens=20000), SHAPE, SPEED)
    large = estimate(dataclasses.replace(DEFAULT_SIZE, tokens=40000), SHAPE, SPEED)
    for key in ("answers", "lens", "draft", "predictors", "levels", "temperatures"):
        assert large[key] == pytest.approx(2 * small[key], rel=1e-6), key
    assert large["costs"] == small["costs"]  # timed on a fixed number of tokens


def test_decoding_stages_follow_the_measured_token():
    slow = estimate(DEFAULT_SIZE, SHAPE, dataclasses.replace(SPEED, step_s=0.022, prompt_s=0.1, plain_s=0.020))
    fast = estimate(DEFAULT_SIZE, SHAPE, SPEED)
    for key in ("answers", "costs", "engine", "exact"):
        assert slow[key] == pytest.approx(2 * fast[key]), key
    for key in ("lens", "draft", "predictors", "levels", "temperatures"):  # numpy's, priced by the lens's rate
        assert slow[key] == fast[key], key


def test_what_the_work_dir_holds_is_not_estimated_again():
    fresh = estimate(DEFAULT_SIZE, SHAPE, SPEED)
    resumed = estimate(DEFAULT_SIZE, dataclasses.replace(SHAPE, cached_steps=DEFAULT_SIZE.tokens, lens_cached=True), SPEED)
    assert resumed["answers"] == 0 and resumed["lens"] == 0
    half = estimate(DEFAULT_SIZE, dataclasses.replace(SHAPE, cached_steps=DEFAULT_SIZE.tokens // 2), SPEED)
    assert half["answers"] == pytest.approx(fresh["answers"] / 2, rel=1e-3)


def test_known_exiting_levels_price_the_engine_and_exact_mode():
    none = estimate(DEFAULT_SIZE, dataclasses.replace(SHAPE, exiting=0), SPEED)
    two = estimate(DEFAULT_SIZE, dataclasses.replace(SHAPE, exiting=2), SPEED)
    assert none["engine"] == 0 and 0 < none["exact"] < two["exact"] < two["engine"] + two["exact"]


def test_replays_cannot_use_more_steps_than_the_split_holds():
    few = dataclasses.replace(DEFAULT_SIZE, tokens=6000)  # a calibration split of 1,200 steps
    assert estimate(few, SHAPE, SPEED)["engine"] == estimate(
        dataclasses.replace(few, replay_tokens=1200, heldout_tokens=1200), SHAPE, SPEED)["engine"]


@pytest.mark.parametrize("minutes", [8, 15, 30])
def test_a_sized_run_is_the_largest_that_fits(minutes):
    size = fit_minutes(minutes, SHAPE, SPEED)
    assert total(size) <= 60 * minutes
    assert size.cost_rounds == DEFAULT_SIZE.cost_rounds  # kept while a run with them fits
    a_bit_larger = dataclasses.replace(size, tokens=int(size.tokens * 1.02), replay_tokens=int(size.replay_tokens * 1.02),
                                       heldout_tokens=int(size.heldout_tokens * 1.02))
    assert total(a_bit_larger) > 60 * minutes * 0.99


def test_minutes_never_size_a_run_above_the_default():
    assert fit_minutes(10_000, SHAPE, SPEED) == DEFAULT_SIZE


def test_too_few_minutes_give_the_smallest_run_with_fewer_cost_rounds():
    slow = dataclasses.replace(SPEED, plain_s=0.5, step_s=0.5)
    assert fit_minutes(1, SHAPE, slow) == scaled(0.0, CHEAP_ROUNDS) == SMALLEST_SIZE


def test_fewer_cost_rounds_only_when_the_smallest_run_does_not_fit_with_all():
    with_all = total(scaled(0.0, DEFAULT_SIZE.cost_rounds))
    size = fit_minutes(with_all / 60 * 0.97, SHAPE, SPEED)
    assert size.cost_rounds == CHEAP_ROUNDS and size.tokens >= SMALLEST_SIZE.tokens


def test_what_a_smaller_run_gives_up_is_said():
    assert given_up(DEFAULT_SIZE, SHAPE) == []
    lines = given_up(SMALLEST_SIZE, SHAPE)
    assert len(lines) == 6
    assert any("2.0x as wide" in line for line in lines)  # 1,000 held-out steps against 4,000
    assert any("0.87" in line for line in lines)  # fewer cost rounds


def test_what_is_left_follows_the_pace_of_the_finished_stages():
    estimates = {"a": 100.0, "b": 50.0, "c": 10.0}
    assert remaining(estimates, {}) == 160
    assert remaining(estimates, {"a": 150.0}) == pytest.approx(1.5 * 60)  # running 1.5x slower than estimated
    assert remaining(estimates, {"a": 1000.0}) == pytest.approx(2 * 60)  # the pace is capped
    # the current stage: its own progress once a tenth is done, else its estimate less its time so far
    assert remaining(estimates, {"a": 100.0}, "b", 20.0, 0.5) == pytest.approx(20 + 10)
    assert remaining(estimates, {"a": 100.0}, "b", 20.0, None) == pytest.approx(30 + 10)
    assert remaining(estimates, {"a": 100.0}, "b", 80.0, None) == pytest.approx(10)


def test_clock():
    assert clock(0) == "0:00" and clock(59.6) == "1:00" and clock(3725) == "1:02:05"


def test_a_log_gets_one_line_per_stage_with_the_whole_run():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    estimates = {key: 1.0 for key, _ in STAGES}
    with RunProgress(console, estimates) as progress:
        for key, _ in STAGES:
            with progress.stage(key, "steps", 10) as advance:
                advance(10)
    lines = out.getvalue().splitlines()
    assert len(lines) == len(STAGES)
    assert lines[0].startswith("calibrate 1/9 answers (steps): 0:00 (estimated 0:01); elapsed 0:00, about 0:0")
    assert lines[-1].startswith("calibrate 9/9 temperatures") and lines[-1].endswith("about 0:00 left")
    assert set(progress.seconds) == set(estimates)
