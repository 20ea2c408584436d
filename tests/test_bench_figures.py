"""The bench's figures from lanes built by hand (no model): speed-ups per category with their intervals, where a
category holds two prompts (the bench's own tests run one a category, so their category intervals are all None)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from specee_edge.bench.report import category_ratio, ratio
from specee_edge.bench.run import interval_by_category, lane_speed, speedup_by_category
from specee_edge.runtime.costs import Timing

# as pick_prompts takes them, a category in turn: two prompts of code, two of chat, and math alone
CATEGORIES = ["code", "chat", "math", "code", "chat"]
STEPS = 7  # timed steps per answer


def timing(seconds: Sequence[float], steps: int = STEPS) -> Timing:
    """A lane's timing: `steps` steps in each prompt's given seconds."""
    timed = Timing()
    for spent in seconds:
        timed.begin_prompt()
        timed.add_span(steps, spent)
    return timed


@dataclass
class TimedLane:
    """What lane_speed reads of a lane: its timing and its answers."""

    timing: Timing
    outputs: list[list[int]] = field(default_factory=lambda: [[1] * (STEPS + 1) for _ in CATEGORIES])


BASE = timing([0.070, 0.080, 0.070, 0.075, 0.090])
FAST = timing([0.050, 0.070, 0.080, 0.040, 0.060])


def test_a_category_of_two_prompts_has_an_interval_around_its_speedup():
    speedups = speedup_by_category(FAST, BASE, CATEGORIES)
    intervals = interval_by_category(FAST, BASE, CATEGORIES)
    assert set(intervals) == set(speedups) == {"chat", "code", "math"}
    for category, prompts in (("code", [0, 3]), ("chat", [1, 4])):
        low, high = intervals[category]
        assert low < speedups[category] < high  # its prompts' speed-ups differ: a range, and their pooled one inside
        # two prompts resampled: the interval runs about from one prompt's speed-up to the other's
        alone = sorted(FAST.tok_s_on([i]) / BASE.tok_s_on([i]) for i in prompts)
        assert (low, high) == pytest.approx(alone, rel=1e-9)
    assert intervals["math"] is None  # one prompt: no interval


def test_a_category_speedup_is_printed_with_its_interval_or_as_one_prompt():
    result = lane_speed(TimedLane(FAST), TimedLane(BASE), CATEGORIES, BASE)
    code = category_ratio(result, "code")
    assert code == ratio(result.speedup_by_category["code"], result.speedup_by_category_interval["code"])
    assert code.splitlines()[1].startswith("[")
    assert category_ratio(result, "math") == f"{result.speedup_by_category['math']:.3f}x\n(1 prompt)"
    assert category_ratio(result, "poetry") == "-"
