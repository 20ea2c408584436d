"""How the bench times its lanes (specee_edge/bench/runner.py): every lane decodes a prompt's whole answer alone, the
lanes in an order shuffled per prompt and recorded; the bare Context lane; a step that did not happen is not timed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
from llama_cpp import Llama

from specee_edge.bench.runner import ContextLane, Stopwatch, VanillaLane, decode_rest, run_lanes
from specee_edge.engine.sampling import SamplingParams
from specee_edge.errors import SpecEEError
from specee_edge.runtime import Context
from specee_edge.runtime.costs import Timing
from tests.conftest import CHAT_PROMPT

TOKENS = 5


@dataclass
class Recorder:
    """A lane that notes when each of its steps runs, in a log it shares with the other lanes."""

    name: str
    log: list[tuple[str, int]]
    fails_on_prompt: int | None = None
    timing: Timing = field(default_factory=Timing)
    outputs: list[list[int]] = field(default_factory=list)

    def answer(self, prompt: Sequence[int], watch: Stopwatch) -> None:
        if len(self.outputs) == self.fails_on_prompt:
            raise RuntimeError("broken\nsecond line")
        self.timing.begin_prompt()
        tokens = [prompt[0]]
        self.outputs.append(tokens)

        def step(token: int) -> int:
            self.log.append((self.name, len(self.outputs) - 1))
            return token + 1

        decode_rest(tokens, step, TOKENS, lambda t: False, self.timing, watch)


def recorders(n: int, log: list[tuple[str, int]]) -> list[Recorder]:
    return [Recorder(f"lane{i}", log) for i in range(n)]


def test_each_lane_decodes_a_whole_answer_alone():
    """No lane steps while another lane's answer is under way: a prompt's steps come lane by lane, in runs of a
    whole answer (token by token in turns, they alternated)."""
    log: list[tuple[str, int]] = []
    lanes = recorders(4, log)
    run_lanes([[10], [20], [30]], lanes, np.random.default_rng(0), workers=())
    runs = [log[i:i + TOKENS - 1] for i in range(0, len(log), TOKENS - 1)]
    assert len(runs) == 3 * len(lanes)
    assert all(len(set(run)) == 1 for run in runs)  # each run one lane, one prompt
    for lane in lanes:
        assert lane.timing.steps == 3 * (TOKENS - 1) and [steps for steps, _ in lane.timing.by_prompt] == [TOKENS - 1] * 3


def test_the_lanes_order_is_shuffled_per_prompt_and_recorded():
    log: list[tuple[str, int]] = []
    lanes = recorders(5, log)
    prompts = [[i] for i in range(8)]
    record = run_lanes(prompts, lanes, np.random.default_rng(7), workers=())
    assert len(record.order) == len(prompts)
    assert all(sorted(order) == list(range(len(lanes))) for order in record.order)
    assert len({tuple(order) for order in record.order}) > 1  # not one fixed order
    assert {order[0] for order in record.order} != {0}       # the reference is not always first
    ran = [name for i, (name, _) in enumerate(log) if i % (TOKENS - 1) == 0]
    assert ran == [lanes[i].name for order in record.order for i in order]  # the order recorded is the order run
    again = run_lanes(prompts, recorders(5, []), np.random.default_rng(7), workers=())
    assert again.order == record.order  # seeded


def test_a_failing_lane_is_dropped_and_a_failing_reference_ends_the_run():
    log: list[tuple[str, int]] = []
    lanes = recorders(3, log)
    lanes[2].fails_on_prompt = 1
    record = run_lanes([[1], [2], [3]], lanes, np.random.default_rng(0), workers=())
    assert record.failed == {2: "RuntimeError: broken"}
    assert len(lanes[2].outputs) == 1 and len(lanes[1].outputs) == 3  # tried no more after failing
    reference = recorders(2, [])
    reference[0].fails_on_prompt = 0
    with pytest.raises(SpecEEError, match="every lane's reference\\) failed: RuntimeError: broken$"):
        run_lanes([[1]], reference, np.random.default_rng(0), workers=())


def test_every_pass_names_its_rpc_workers():
    """workers= has no default: a pass that left it out (the sampled pass did before d669af4) would count no round
    trips without a word; now it cannot run."""
    with pytest.raises(TypeError, match="workers"):
        run_lanes([[1]], recorders(1, []), np.random.default_rng(0))


def test_a_call_that_returns_none_is_no_step():
    """The stream's last next() ends the answer: it is not a step, and is not timed (a step counted per answer too
    many would flatter no lane alike)."""
    timing, watch = Timing(), Stopwatch()
    timing.begin_prompt()
    assert watch.step(timing, lambda: 3) == 3
    assert watch.step(timing, lambda: None) is None
    assert timing.steps == 1 and timing.by_prompt[0][0] == 1


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(seed=5)],
                         ids=["greedy", "sampled"])
def test_the_bare_context_lane_answers_as_llama_eval_does(default_model, sampling):
    """The control lane: our Context without early exit and our draw, nothing else; the same tokens as the Llama.eval
    lane, greedy and sampled with the same seed (llama.cpp's chain on the same logits), each step timed."""
    prompt = default_model.tokenize(CHAT_PROMPT)
    llm = Llama(model_path=str(default_model.info.path), n_ctx=256, n_threads=1, n_threads_batch=1,
                flash_attn=True, verbose=False)
    ctx = Context(default_model, n_ctx=256, n_threads=1, flash_attn="on")
    try:
        vanilla = VanillaLane(llm, 12, default_model.is_eog, sampling)
        context = ContextLane(ctx, 12, default_model.is_eog, sampling)
        assert run_lanes([prompt, prompt[:-3]], [vanilla, context], np.random.default_rng(0), workers=()).failed == {}
    finally:
        ctx.close()
        llm.close()
    assert context.outputs == vanilla.outputs
    assert context.timing.steps == sum(len(answer) - 1 for answer in context.outputs) and context.timing.tok_s > 0
    # its decode and draw are timed inside each step, as an engine's are: what the loop adds around them is the
    # floor an engine's `other` is set beside
    split = context.time_split()
    assert split["layers"] > 0 and split["sample"] > 0 and 0 <= split["other"] < split["layers"]
    assert split["layers"] + split["sample"] <= context.timing.ms
