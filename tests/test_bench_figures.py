"""The bench's figures from lanes built by hand (no model): speed-ups per category with their intervals, where a
category holds two prompts (the bench's own tests run one a category, so their category intervals are all None), the
terminal's tables printing every speed-up's interval, and the repeat lanes read against their twins."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from rich.table import Table

from specee_edge.bench.llama_server import PLAIN
from specee_edge.bench.quality import Agreement, Perplexity
from specee_edge.bench.report import (BARE_CONTEXT, LLAMA_CPP_PYTHON, BenchResult, RepeatResult, ToolLane,
                                      _plot_tradeoff, category_ratio, drift_line, drifts, ratio, repeat_of)
from specee_edge.bench.run import (NO_PACK, BenchConfig, DecodePass, context_names, cost_answers, interval_by_category,
                                   lane_speed,
                                   lane_stats, mode_result, repeat_results, sampled_result, server_names,
                                   speedup_by_category, tool_lane)
from specee_edge.bench.runner import SpecEELane
from specee_edge.engine import TokenRecord
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
SLOW = timing([0.085, 0.090, 0.080, 0.085, 0.100])


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


class FakeController:
    def snapshot(self) -> dict:
        return {"plain_ms": 1.0}


def plain_lane(seconds: Sequence[float]) -> SpecEELane:
    """An exact lane without a pack whose rounds were all plain steps (what its figures are made of is not the
    point here: its speed-ups are)."""
    engine = SimpleNamespace(n_layer=4, exact=True, policy=None, controller=FakeController())
    lane = SpecEELane(NO_PACK, engine, STEPS + 1, timing=timing(seconds))
    lane.records = [[TokenRecord(id=1) for _ in range(STEPS + 1)] for _ in CATEGORIES]
    return lane


@pytest.fixture(scope="module")
def result() -> BenchResult:
    """A run's result from hand-built lanes, every speed-up against llama-server plain (BASE), greedy and sampled;
    the last prompt's answer loops."""
    vanilla, vanilla_sampled = TimedLane(timing([0.080, 0.085, 0.075, 0.080, 0.095])), TimedLane(SLOW)
    lane, sampled = plain_lane([0.050, 0.070, 0.080, 0.040, 0.060]), plain_lane([0.060, 0.065, 0.090, 0.050, 0.070])
    no_loop = [0, 1, 2, 3]
    mode = mode_result(lane, vanilla, BASE, None, None, CATEGORIES, no_loop, False, stats=lane_stats(lane, CATEGORIES),
                       agreement=Agreement(1.0, None, 0, (1.0, 1.0)), ppl=Perplexity(10.0, 10.0), margins=[],
                       off_replay=0, sampled=sampled_result(sampled, vanilla_sampled, CATEGORIES, BASE, False),
                       choices=None)
    peer = TimedLane(timing([0.060, 0.060, 0.070, 0.060, 0.070]))
    peer_sampled = TimedLane(timing([0.065, 0.060, 0.080, 0.055, 0.075]))
    return BenchResult(
        model="model.gguf", pack=NO_PACK, n_layer=4, threads=1, k=0, prompt_set="all", prompts=len(CATEGORIES),
        tokens=STEPS + 1, vanilla_steps=vanilla.timing.steps, vanilla_tok_s=vanilla.timing.tok_s, oracle_speedup=None,
        oracle_avg_exit_layer=None, oracle_head_free_speedup=None, oracle_head_free_avg_exit_layer=None,
        oracle_histogram=[], costs=None, ppl_full=10.0, ppl_tokens=32, default_quality=None, modes=[mode],
        seconds=1.0, command="", vanilla_sampled_tok_s=vanilla_sampled.timing.tok_s,
        peer=lane_speed(peer, vanilla, CATEGORIES, BASE, no_loop),
        peer_sampled=lane_speed(peer_sampled, vanilla_sampled, CATEGORIES, BASE),
        baseline=PLAIN, baseline_sampled=PLAIN,
        tools={LLAMA_CPP_PYTHON: tool_lane(vanilla, vanilla, BASE, CATEGORIES, vanilla_sampled, vanilla_sampled, BASE)})


def terminal_text(table: Table, width: int = 80) -> str:
    """The table as an 80-column terminal shows it."""
    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(table)
    return console.export_text()


def bracket(interval: tuple[float, float]) -> str:
    return ratio(1.0, interval).splitlines()[1]


def test_the_terminal_prints_each_speedup_with_its_interval(result):
    """Where the JSON holds an interval, the terminal prints it beside the speed-up: speed and quality's table,
    the speed-up on answers that do not loop, the peer's on them."""
    mode, vanilla = result.modes[0], result.tools[LLAMA_CPP_PYTHON]
    quality = terminal_text(result._quality())  # the table fits 80 columns with each interval whole
    for interval in (mode.speedup_interval, mode.sampled.speedup_interval, vanilla.speedup_interval,
                     vanilla.speedup_sampled_interval, result.peer.speedup_interval,
                     result.peer_sampled.speedup_interval):
        assert interval is not None and bracket(interval) in quality
    assert bracket(mode.speedup_no_loop_interval) in terminal_text(result._machinery())
    peer = ratio(result.peer.speedup_no_loop, result.peer.speedup_no_loop_interval, sep=" ")
    row = next(line for line in terminal_text(result._run(), width=160).splitlines() if "peer, no loops" in line)
    assert f"{peer} greedy on the answers that do not loop" in row


def test_the_plot_names_the_vanilla_lane_as_the_tables_do(result):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (agreement_ax, ppl_ax) = plt.subplots(1, 2)
    try:
        _plot_tradeoff(result, agreement_ax, ppl_ax)
        assert f"vanilla ({LLAMA_CPP_PYTHON})" in [text.get_text() for text in agreement_ax.get_legend().get_texts()]
    finally:
        plt.close(figure)


@dataclass
class NamedLane(TimedLane):
    """A lane of a decoding pass, by name."""

    name: str = ""


def decoded(servers: dict[str, Timing], contexts: dict[str, Timing]) -> DecodePass:
    """A pass whose llama-server and bare Context lanes took these timings."""
    return DecodePass(vanilla=NamedLane(BASE, name=LLAMA_CPP_PYTHON), specee={}, peer=None, order=[],
                      servers={name: NamedLane(t, name=name) for name, t in servers.items()},
                      contexts={name: NamedLane(t, name=name) for name, t in contexts.items()})


def test_plain_and_the_bare_context_each_have_a_repeat_lane_unless_turned_off():
    with_server = BenchConfig(model=Path("model.gguf"), llama_server=Path("llama-server"), spec_types=["ngram-mod"])
    assert server_names(with_server) == [PLAIN, f"{PLAIN} (repeat)", "ngram-mod"]  # plain stays first: the baseline
    assert context_names(with_server) == [BARE_CONTEXT, f"{BARE_CONTEXT} (repeat)"]
    # llama-server not built: only the Context repeat runs
    assert server_names(dataclasses.replace(with_server, llama_server=None)) == []
    off = dataclasses.replace(with_server, repeat=False)
    assert server_names(off) == [PLAIN, "ngram-mod"] and context_names(off) == [BARE_CONTEXT]


def test_the_cost_lanes_take_whole_answers_up_to_their_token_budget_and_at_least_one():
    fed = [([7] * 10 + [1] * 63, 10) for _ in range(15)]  # 15 prompts of 10 tokens, answers of 63 steps
    assert cost_answers(fed, limit=256) == fed[:4]  # 252 steps: a fifth answer would pass the budget
    assert cost_answers(fed, limit=252) == fed[:4] and cost_answers(fed, limit=251) == fed[:3]
    assert cost_answers(fed, limit=10) == fed[:1]  # an answer longer than the budget is still timed whole
    assert cost_answers(fed[:2], limit=10_000) == fed[:2]


def test_each_repeat_is_read_against_its_twin_with_the_paired_interval():
    slower = timing([s * 1.05 for s in (0.070, 0.080, 0.070, 0.075, 0.090)])  # every answer 5 % slower than BASE's
    steady = timing([0.0702, 0.0798, 0.0701, 0.0749, 0.0901])
    greedy = decoded({PLAIN: BASE, repeat_of(PLAIN): slower, "ngram-mod": FAST},
                     {BARE_CONTEXT: BASE, repeat_of(BARE_CONTEXT): steady})
    sampled = decoded({PLAIN: BASE}, {BARE_CONTEXT: SLOW, repeat_of(BARE_CONTEXT): SLOW})  # plain's repeat failed
    repeats = repeat_results([("greedy", greedy), ("sampled", sampled)])
    assert [(r.lane, r.twin, r.decoding) for r in repeats] == [
        (repeat_of(PLAIN), PLAIN, "greedy"), (repeat_of(BARE_CONTEXT), BARE_CONTEXT, "greedy"),
        (repeat_of(BARE_CONTEXT), BARE_CONTEXT, "sampled")]
    server, context, context_sampled = repeats
    assert server.ratio == pytest.approx(1 / 1.05) and server.interval == pytest.approx((1 / 1.05, 1 / 1.05))
    assert server.drifted
    assert context.ratio == pytest.approx(steady.tok_s / BASE.tok_s)
    assert context.interval[0] <= context.ratio <= context.interval[1] and not context.drifted
    assert (context_sampled.ratio, context_sampled.interval, context_sampled.drifted) == (1.0, (1.0, 1.0), False)


def test_a_repeat_drifted_outside_the_band_or_where_its_interval_leaves_out_1():
    assert not drifts(1.0, None) and not drifts(1.015, (0.97, 1.06)) and not drifts(0.98, (0.95, 1.01))
    assert drifts(1.03, (0.99, 1.07))   # outside [0.98, 1.02], though its interval holds 1
    assert drifts(1.01, (1.004, 1.02))  # inside the band, but its interval leaves out 1
    assert drifts(0.97, None)


def test_the_drift_line_names_each_repeat_that_drifted():
    server = RepeatResult(repeat_of(PLAIN), PLAIN, "greedy", 0.95, (0.93, 0.97))
    steady = RepeatResult(repeat_of(BARE_CONTEXT), BARE_CONTEXT, "greedy", 1.004, (0.99, 1.02))
    assert drift_line([steady]) is None
    assert drift_line([server, steady]) == ("the run drifted: llama-server (repeat) read 0.95x its twin (0.93-0.97); "
                                            "ratios in this run carry that much noise")
    sampled = RepeatResult(repeat_of(BARE_CONTEXT), BARE_CONTEXT, "sampled", 1.04, None)
    assert drift_line([server, sampled]).startswith(
        "the run drifted: llama-server (repeat) read 0.95x its twin (0.93-0.97), "
        f"{BARE_CONTEXT} (repeat) read 1.04x its twin sampled; ")


def test_the_report_says_a_drift_at_the_top_and_prints_each_repeat_against_its_twin(result):
    repeats = [RepeatResult(repeat_of(PLAIN), PLAIN, "greedy", 0.95, (0.93, 0.97)),
               RepeatResult(repeat_of(PLAIN), PLAIN, "sampled", 1.004, (0.99, 1.02))]
    drifted = dataclasses.replace(result, repeats=repeats)
    top = terminal_text(drifted.render(), width=200).splitlines()[0]
    assert top == drift_line(repeats)
    row = next(line for line in terminal_text(drifted._run(), width=200).splitlines() if " repeat " in line)
    assert f"{repeat_of(PLAIN)} against {PLAIN}: 0.950x [0.93-0.97] greedy, 1.004x [0.99-1.02] sampled" in row
    assert drifted.to_json()["repeats"][0] == {"lane": repeat_of(PLAIN), "twin": PLAIN, "decoding": "greedy",
                                               "ratio": 0.95, "interval": (0.93, 0.97), "drifted": True}
    steady = dataclasses.replace(result, repeats=repeats[1:])
    assert not terminal_text(steady.render(), width=200).startswith("the run drifted")


@dataclass
class DraftingLane(TimedLane):
    """A llama-server lane whose server confirmed speculation, and whose speculation drafted nothing."""

    speculates: bool = True
    drafted: int = 0
    accepted: int = 0


def test_a_speculating_lane_shows_what_it_drafted_even_when_nothing():
    """The draft lane and the n-gram lanes: their accepted / drafted, read from the server's timings (draft_n,
    draft_n_accepted), 0 / 0 included; plain has none to show."""
    assert tool_lane(DraftingLane(FAST), TimedLane(BASE), BASE, CATEGORIES, None, None, None).speculates
    plain = ToolLane(tok_s=1.0, speedup=1.0, identical=1.0)
    drafting = ToolLane(tok_s=1.0, speedup=1.0, identical=1.0, speculates=True)
    result = BenchResult(model="m", pack=NO_PACK, n_layer=4, threads=1, k=0, prompt_set="all", prompts=1, tokens=8,
                         vanilla_steps=1, vanilla_tok_s=1.0, oracle_speedup=None, oracle_avg_exit_layer=None,
                         oracle_head_free_speedup=None, oracle_head_free_avg_exit_layer=None, oracle_histogram=[],
                         costs=None, ppl_full=1.0, ppl_tokens=1, default_quality=None, modes=[], seconds=1.0,
                         command="", tools={PLAIN: plain, "draft": drafting})
    rows = terminal_text(result._against_llama_cpp(), width=200).splitlines()
    assert next(line for line in rows if line.strip().startswith("draft")).rstrip().endswith("0 / 0; 0 / 0")
    assert next(line for line in rows if line.strip().startswith(PLAIN)).rstrip().endswith("-")
