"""The native exit path on the default model: the in-graph draft, the C predictors and verification
inside llama_decode, against their numpy references and the Python policy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specee_edge.draft import LinearDraft
from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.engine.exit import find_pack
from specee_edge.pack import read_pack, write_pack
from specee_edge.predictor.rule import probe_features
from specee_edge.runtime import Context
from specee_edge.pack.format import OFF
from specee_edge.runtime.context import GraphInfo
from specee_edge.runtime.weights import TargetWeights
from tests.conftest import CHAT_PROMPT

STEPS = 48
QUESTION = "Explain in a few sentences how a rainbow forms."
# the paper's threshold on the shipped pack: exits on most layers it checks, so decisions are many
LOOSE_THRESHOLD = 0.5


@pytest.fixture(scope="module")
def pack(default_model):
    return read_pack(find_pack(default_model.info.path))


def draft_of(pack, default_model, quant: str) -> LinearDraft:
    head = dataclasses.replace(pack.draft, quant=quant)
    return LinearDraft(head, TargetWeights(default_model.info.path), pack.k)


def context_with_draft(default_model, draft: LinearDraft, n_ctx: int = 512) -> Context:
    """A context whose single-token graphs run `draft`, with a probe at layer 20 that never stops."""
    ctx = Context(default_model, n_ctx=n_ctx)
    ctx.enable_early_exit(draft.k, "fill")
    ctx.set_draft(**draft.runtime_args())
    ctx.set_probe_callback(lambda il, z: False)
    ctx.set_probe_layers([20])
    return ctx


def in_graph_and_reference_candidates(default_model, draft: LinearDraft) -> list[tuple[np.ndarray, tuple[int, ...], np.ndarray]]:
    """Greedy decoding with the draft in the graph and a callback that never stops (so every step
    runs every layer): per step (numpy scores, the graph's candidates, numpy's candidates)."""
    last = default_model.info.n_layer - 1
    ctx = context_with_draft(default_model, draft)
    ctx.set_capture_layers([last])  # the reference reads h_{s-1} from the capture
    ctx.decode(default_model.tokenize(CHAT_PROMPT))
    hidden = ctx.captured(last)[-1]
    token = int(np.argmax(ctx.logits()))
    steps = []
    for _ in range(STEPS):
        ctx.decode([token])
        scores = draft.scores(draft.embedding(token), hidden)
        steps.append((scores, ctx.step_info().candidates, draft.propose(token, hidden)))
        hidden = ctx.captured(last)[-1]
        token = int(np.argmax(ctx.logits()))
    ctx.close()
    return steps


def test_in_graph_f32_draft_equals_the_numpy_draft(default_model, pack):
    for _scores, graph, reference in in_graph_and_reference_candidates(default_model, draft_of(pack, default_model, "f32")):
        assert list(graph) == reference.tolist()


def test_in_graph_q8_0_draft_equals_the_numpy_draft_up_to_ties(default_model, pack):
    """Q8_0 matmuls quantize the activations too, so two candidates whose float scores are nearly equal
    may swap: where the ids differ, the numpy scores of both lists must agree rank by rank."""
    draft = draft_of(pack, default_model, "q8_0")
    steps = in_graph_and_reference_candidates(default_model, draft)
    index = {int(t): i for i, t in enumerate(draft.vocab_map)}
    same = 0
    for scores, graph, reference in steps:
        if list(graph) == reference.tolist():
            same += 1
            continue
        graph_scores = scores[[index[t] for t in graph]]
        reference_scores = scores[[index[int(t)] for t in reference]]
        np.testing.assert_allclose(graph_scores, reference_scores, atol=0.02 * float(np.ptp(scores)))
    assert same >= 0.8 * len(steps)


def test_c_predictor_equals_the_numpy_mlp(default_model, pack):
    ctx = Context(default_model, n_ctx=64)
    ctx.enable_early_exit(pack.k, "mask")
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 4.0, size=(200, pack.k)).astype(np.float32)
    prev = None
    for layer, mlp in pack.predictors.items():
        ctx.set_predictor(layer, mlp.weights, mlp.biases)
        for z in logits:
            features, prev = probe_features(z, prev)
            assert ctx.predictor_prob(layer, features) == pytest.approx(float(mlp(features)), abs=1e-5)
    ctx.close()


def test_a_threshold_that_cannot_fire_decodes_like_vanilla(default_model):
    prompt = CHAT_PROMPT
    vanilla = Engine(default_model.info.path, config=EngineConfig(n_ctx=512, n_threads=2, early_exit=False))
    never = Engine(default_model.info.path, config=EngineConfig(n_ctx=512, n_threads=2, threshold=1.01))
    expected = vanilla.generate(prompt, max_tokens=STEPS, sampling=GREEDY)
    got = never.generate(prompt, max_tokens=STEPS, sampling=GREEDY)
    assert got.tokens == expected.tokens
    assert got.stats.exits == 0 and got.stats.predictor_calls_per_token > 0  # the predictors ran
    vanilla.close()
    never.close()


@pytest.mark.parametrize("kv_mode", ["fill", "mask"])
def test_python_and_native_policies_make_the_same_decisions(default_model, kv_mode):
    def run(native: bool):
        engine = Engine(default_model.info.path, config=EngineConfig(
            n_ctx=512, n_threads=2, kv_mode=kv_mode, threshold=LOOSE_THRESHOLD, native=native))
        records = list(engine.stream_chat([{"role": "user", "content": QUESTION}], max_tokens=STEPS, sampling=GREEDY))
        engine.close()
        return records

    native, python = run(True), run(False)
    assert [r.id for r in native] == [r.id for r in python]
    assert [r.exit_layer for r in native] == [r.exit_layer for r in python]
    assert [r.probes for r in native] == [r.probes for r in python]
    assert [r.verify_failures for r in native] == [r.verify_failures for r in python]
    assert any(r.exit_layer is not None for r in native)  # the comparison covers exits


def test_regenerating_a_reply_with_a_loose_threshold(default_model):
    """/regen decodes a prompt the cache already holds: the uncached part used to be one token, whose
    single-token graph probed, exited and read an empty capture (IndexError, and every call after)."""
    engine = Engine(default_model.info.path, config=EngineConfig(n_ctx=512, n_threads=2, threshold=0.0))
    messages = [{"role": "user", "content": "Tell me about the moon."}]
    replies = [engine.chat(messages, max_tokens=20, sampling=GREEDY) for _ in range(3)]
    assert all(r.tokens for r in replies)
    assert replies[-1].stats.exits > 0  # the regenerated replies still exit early
    engine.close()


def test_graphs_hold_only_what_is_asked(default_model):
    """Early exit off: stock graphs (no probe, no draft, no depth bias) computed without an eval
    callback. On: the draft and a probe on each layer that has a predictor, and the callback. The depth bias only while a cached cell is shallow (mask mode
    after an exit), never in fill mode."""
    prompt = default_model.tokenize(CHAT_PROMPT)
    fill = Engine(default_model.info.path, config=EngineConfig(n_ctx=512, n_threads=2, kv_mode="fill", threshold=0.0))
    n_predictors = len(fill.policy.predictors)
    fill.set_early_exit(False)
    fill.generate(prompt, max_tokens=4, sampling=GREEDY)
    assert fill.ctx.step_info().graph == GraphInfo(probes=0, draft=False, depth_mask=False, eval_callback=False)
    fill.set_early_exit(True)
    out = fill.generate(prompt, max_tokens=STEPS, sampling=GREEDY)
    assert out.stats.exits > 0
    assert fill.ctx.step_info().graph == GraphInfo(probes=n_predictors, draft=True, depth_mask=False, eval_callback=True)
    fill.close()

    mask = Engine(default_model.info.path, config=EngineConfig(n_ctx=512, n_threads=2, kv_mode="mask", threshold=0.0))
    records = list(mask.stream(prompt, max_tokens=STEPS, sampling=GREEDY))
    first_exit = next(i for i, r in enumerate(records) if r.exit_layer is not None)
    assert first_exit < len(records) - 1  # so the last step ran over a cache holding a shallow cell
    assert mask.ctx.step_info().graph.depth_mask
    mask.reset()
    mask.set_early_exit(False)
    mask.generate(prompt, max_tokens=2, sampling=GREEDY)  # the shallow cells are gone
    assert mask.ctx.step_info().graph == GraphInfo(probes=0, draft=False, depth_mask=False, eval_callback=False)
    mask.close()


def test_a_level_that_turns_every_layer_off_decodes_plainly(default_model, tmp_path):
    """Calibration turns a layer off at a level (its exit NONE); with every layer off the
    engine takes the plain path: stock graphs, no draft, no probes, vanilla's tokens."""
    pack = read_pack(find_pack(default_model.info.path))
    off = dataclasses.replace(pack.levels[0], quality=0.99, exits=dict.fromkeys(pack.predictors, OFF), offline=[])
    path = write_pack(tmp_path / "off.specee.gguf", dataclasses.replace(
        pack, levels=[pack.levels[0], off], default_quality=0.99), draft_quant=pack.draft.quant)
    prompt = default_model.tokenize(CHAT_PROMPT)
    engine = Engine(default_model.info.path, pack=path, config=EngineConfig(n_ctx=512, n_threads=2))
    vanilla = Engine(default_model.info.path, config=EngineConfig(n_ctx=512, n_threads=2, early_exit=False))
    assert engine.policy.idle
    out = engine.generate(prompt, max_tokens=STEPS, sampling=GREEDY)
    assert out.tokens == vanilla.generate(prompt, max_tokens=STEPS, sampling=GREEDY).tokens
    assert out.stats.predictor_calls_per_token == 0 and out.stats.exits == 0
    assert engine.ctx.step_info().graph == GraphInfo(probes=0, draft=False, depth_mask=False, eval_callback=False)
    engine.set_quality(pack.levels[0].quality)  # a level with layers on wakes it up: its layers decide again
    assert engine.generate(prompt, max_tokens=8, sampling=GREEDY).stats.predictor_calls_per_token > 0
    engine.close()
    vanilla.close()
