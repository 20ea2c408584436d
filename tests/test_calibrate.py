"""`specee-edge calibrate` end to end on a tiny random-weight model, and its pieces."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from specee_edge.calibrate import CalibrateConfig, calibrate
from specee_edge.calibrate.collect import Collector
from specee_edge.calibrate.dataset import Dataset
from specee_edge.calibrate.draft_fit import draft_vocabulary
from specee_edge.calibrate.exact import speedup_of
from specee_edge.calibrate.pipeline import interleaved, split_answered
from specee_edge.calibrate.temperature import fit_temperatures
from specee_edge.data.prompts import CALIBRATION_SPLIT, SPEC_BENCH, Prompt, bench_prompts, load_prompts, split
from specee_edge.cli import app
from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.errors import SpecEEError
from specee_edge.exits import ExitKind
from specee_edge.pack import EXACT_QUALITY, read_pack, target_identity
from specee_edge.predictor.rule import probe_features
from specee_edge.bench.run import draft_setup
from specee_edge.runtime.costs import cost_lanes
from tests.conftest import supported_model_path, tiny_model_path

PROMPTS = ["hello world", "the quick brown fox", "what is the capital of France?", "one, two, three",
           "once upon a time", "def main(): return 0", "how are you today?", "tokenize the prompt"]


# One thread: a tiny model's decode takes ~0.2 ms, which a second thread cannot speed up, and ggml's threads
# spin-wait at every op's barrier, so while another process keeps a core busy each of the ~100 barriers of a
# decode waits out a scheduler slice (measured on 2 cores: 0.2 ms a token with one thread, 540 ms with two).
THREADS = 1


def calibrate_tiny(work, model):
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    config = CalibrateConfig(model=model, output=work / "tiny.specee.gguf", workdir=work / "work", tokens=240,
                             prompts=prompts, max_answer=32, threads=THREADS, hidden=32, command="test")
    return config, calibrate(config)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_dir):
    return calibrate_tiny(tmp_path_factory.mktemp("calibrate"), tiny_model_path(tiny_dir, "llama", n_layer=6))


def test_calibrate_tiny_model_end_to_end(tiny_run):
    config, report = tiny_run
    pack = read_pack(config.output)
    assert pack.target == target_identity(config.model)
    assert pack.draft is not None and pack.draft.kind == "linear"
    assert pack.provenance["command"] == "test"
    stored = pack.provenance["report"]
    assert stored["tokens"] == report.tokens > 0
    assert 0.0 <= report.draft.recall_at_1 <= report.draft.recall_at_k <= 1.0
    assert pack.levels[-1].quality == EXACT_QUALITY and set(level.quality for level in pack.levels) <= {
        *config.levels, EXACT_QUALITY} | {stats.quality for stats in report.levels}
    # exact mode is the default: its exits are on where that was measured faster than plain decoding, else it drafts
    # by prompt lookup alone
    exact = pack.level()
    assert pack.default_quality == EXACT_QUALITY and exact.exact
    chosen = report.exact.chosen
    drafts = exact.drafts(greedy=True) or exact.drafts(greedy=False)
    assert drafts == report.exact.on == chosen.pays
    assert drafts or exact.off  # where drafting did not pay beyond its noise, every layer is off
    for speedup, low in ((chosen.speedup, exact.speedup_low), (chosen.speedup_sampled, exact.speedup_sampled_low)):
        assert speedup.low <= speedup.point <= speedup.high and low == pytest.approx(speedup.low)
    assert report.exact.trials and stored["exact"]["chosen"]["max_draft"] == exact.max_draft
    assert set(pack.temperatures) == set(pack.predictors)
    assert max(pack.predictors) == pack.target.n_layer - 1  # the last layer's predictor: the head skip
    costs = pack.provenance["costs_ms"]
    for part, (low, high) in costs["intervals"].items():  # as measured (a tiny model's layers are noise), with
        assert low <= costs[part] <= high                  # the interval that says so
    assert costs["plain_ms"] > 0  # a plain token's median
    assert set(costs["share_intervals"]) == set(costs["intervals"]) - {"plain_ms"}
    for part, (low, high) in costs["share_intervals"].items():  # what the decisions price: shares of a plain token
        assert low <= costs[part] / costs["plain_ms"] <= high
    assert pack.provenance["kv_mode"] == "fill"
    assert costs["placement"] == "layers 0-5 on CPU; the output on CPU"  # where the costs were timed
    shipped = {level.quality: level for level in pack.levels[:-1]}
    for stats in report.levels:
        assert 0.0 <= stats.agreement <= 1.0 and 0.0 <= stats.exit_rate <= 1.0
        if not stats.quality:  # dropped: its held-out figures fell below every name it could take
            continue
        level = shipped.pop(stats.quality)
        assert set(level.exits) == set(pack.predictors)  # every trained layer stays in the pack
        assert set(level.offline) <= set(pack.predictors)
        assert level.exits[pack.target.n_layer - 1].kind != ExitKind.VERIFIED
        # on only where the calibration split predicted a gain beyond its noise; shipped under what it holds
        assert level.off == (stats.calibration_speedup_low <= 1.0)
        assert level.off or (level.quality <= stats.agreement_low + 1e-6 and level.steps > 0)
    assert not shipped
    # temperatures are kept only where they lower the held-out cross-entropy against the full model
    assert np.isfinite(report.nll_temperature) and np.isfinite(report.nll_raw)


def assert_every_level_decodes(config: CalibrateConfig) -> None:
    """Each level decodes, and consults its predictors exactly when it has layers on (a level calibration turned
    off, and an exact level that decodes plainly, run none: `early_exit` alone is true whenever a pack is loaded)."""
    engine = Engine(config.model, pack=config.output, config=EngineConfig(n_ctx=256, n_threads=THREADS))
    try:
        for quality in [level.quality for level in read_pack(config.output).levels]:
            engine.set_quality(quality)
            level = engine.policy.level
            assert engine.policy.quality == quality and engine.exact == (quality == EXACT_QUALITY)
            engine.reset()
            out = engine.generate("hello world", max_tokens=8, sampling=GREEDY)
            assert out.stats.n_decode >= 1
            checks = not level.off and (not level.exact or level.drafts(greedy=True))
            assert (out.stats.probes > 0) == checks, (quality, level.off, out.stats.probes)
    finally:
        engine.close()
    # a random tiny model's levels do not pay, so calibration turns them off: one threshold everywhere turns
    # the pack's predictors on, and they must then be consulted
    engine = Engine(config.model, pack=config.output, config=EngineConfig(n_ctx=256, n_threads=THREADS, threshold=0.5))
    try:
        out = engine.generate("hello world", max_tokens=8, sampling=GREEDY)
        assert out.stats.n_decode >= 1 and out.stats.probes > 0
    finally:
        engine.close()


def test_every_level_of_a_calibrated_pack_decodes(tiny_run):
    assert_every_level_decodes(tiny_run[0])


def test_calibrate_a_sliding_window_model_with_soft_capped_logits(tmp_path, tiny_dir):
    """gemma3 end to end: features from soft-capped candidate logits, a pack every level of which decodes."""
    config, report = calibrate_tiny(tmp_path, supported_model_path(tiny_dir, "gemma3-swa", n_layer=6))
    pack = read_pack(config.output)
    assert pack.target.arch == "gemma3" and pack.predictors and report.tokens > 0
    assert_every_level_decodes(config)


def test_calibrate_resumes_from_its_work_dir(tiny_run):
    config, _ = tiny_run
    shards = sorted((config.workdir / "collect").glob("*.npz"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    calibrate(config)
    assert shards and [p.stat().st_mtime_ns for p in shards] == stamps  # nothing answered again


def test_work_dir_of_another_model_is_refused(tiny_run, tiny_dir):
    config, _ = tiny_run
    other = CalibrateConfig(model=tiny_model_path(tiny_dir, "qwen2"), output=config.output.with_name("x.gguf"),
                            workdir=config.workdir, prompts=config.prompts, tokens=64)
    with pytest.raises(SpecEEError, match="another model"):
        calibrate(other)


def test_cli_errors_are_one_line(tmp_path):
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path / "missing.gguf")])
    assert result.exit_code == 1
    assert "model file" in result.output and len(result.output.strip().splitlines()) == 1


def test_built_in_prompt_sets():
    prompts = load_prompts()
    assert len(prompts) >= 100
    assert {p.category for p in prompts} >= {"chat", "explain", "code", "math", "summarize"}
    assert {p.category for p in bench_prompts("all")} == {"chat", "code", "math", "summarize", "edit", *SPEC_BENCH}
    assert {p.category for p in bench_prompts("spec-bench")} == set(SPEC_BENCH)
    together = bench_prompts("code, chat,edit")
    assert {p.category for p in together} == {"code", "chat", "edit"}
    assert together == [p for p in bench_prompts("all") if p.category in ("code", "chat", "edit")]
    for wrong in ("poetry", "code,poetry", ","):
        with pytest.raises(SpecEEError, match="unknown prompt set"):
            bench_prompts(wrong)


def test_split_is_a_partition():
    parts = split(50, 3, (0.6, 0.2, 0.2))
    assert sorted(np.concatenate(parts).tolist()) == list(range(50))
    assert [len(p) for p in parts] == [30, 10, 10]


def test_draft_vocabulary_orders_by_frequency_then_ids():
    vocab = draft_vocabulary(np.array([7, 7, 7, 3, 3, 9]), 5, 20)
    assert vocab.tolist() == [7, 3, 9, 0, 1]
    # end-of-generation tokens come first, however rare: a head-free exit can only emit what the draft proposes
    assert draft_vocabulary(np.array([7, 7, 7, 3, 3, 9]), 5, 20, required=[19, 3]).tolist() == [3, 19, 7, 9, 0]


def test_features_match_the_definition():
    z = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    features, p = probe_features(z, None)
    assert np.allclose(p, np.exp(z) / np.exp(z).sum())
    assert np.allclose(features, np.concatenate([z, p, p]))
    features2, _ = probe_features(z + 1.0, p * 0.5)
    assert np.allclose(features2[8:], p - p * 0.5)


def test_a_speedup_interval_resamples_the_prompts():
    same = [(64, 1.0)] * 6
    twice = speedup_of(same, [(64, 0.5)] * 6)
    assert (twice.point, twice.low, twice.high) == pytest.approx((2.0, 2.0, 2.0))
    # one prompt much faster, the rest a little slower: the mean gains, its interval straddles 1
    mixed = speedup_of(same, [(64, 0.4)] + [(64, 1.05)] * 5)
    assert mixed.point > 1.0 and mixed.low < 1.0 < mixed.high
    assert mixed == speedup_of(same, [(64, 0.4)] + [(64, 1.05)] * 5)  # seeded: the same interval again


def test_a_temperature_is_fitted_kept_and_graded_on_other_steps():
    """A layer whose logits are the final layer's times 0.4 gets T = 0.4 back, and lowers the cross-entropy on
    steps that played no part in fitting or keeping it; a layer already calibrated keeps T = 1, the last
    layer always does."""
    rng = np.random.default_rng(0)
    n, n_embd, n_vocab = 400, 16, 50
    final = rng.normal(size=(n, n_embd)).astype(np.float32) * 2
    hidden = np.stack([0.4 * final, final, final], axis=1).astype(np.float16)
    zeros = np.zeros(n, np.int32)
    ds = Dataset(prompt=zeros, answer=zeros, token=zeros, hidden=hidden, prev_final=hidden[:, -1], prev_exit=hidden[:, -1],
                 top1=np.zeros((n, 3), np.int32))
    head = rng.normal(size=(n_vocab, n_embd)).astype(np.float32)
    weights = SimpleNamespace(final_norm=lambda h: h, capped=lambda z: z, lm_head=head)  # an identity norm, no cap
    rows = np.arange(n)
    fit = fit_temperatures(ds, weights, [0, 1, 2], {il: rows[:200] for il in range(3)}, {il: rows[200:] for il in range(3)})
    assert fit.temperatures[0] == pytest.approx(0.4, abs=0.01)
    assert fit.temperatures[1] == pytest.approx(1.0, abs=0.01) and fit.temperatures[2] == 1.0
    assert fit.nll_fitted < fit.nll_raw - 0.1


def test_the_cost_lanes_force_the_parts_they_are_named_after(tiny_run):
    """Each lane of runtime/costs.py does what its formula says on the real runtime: checked lanes check and
    never stop, the native and callback stops stop where they are named, mask-mode stops pay the depth mask
    and fill-mode ones do not, the draft lane reads the in-graph timer."""
    config, _ = tiny_run
    engine = Engine(config.model, pack=config.output, config=EngineConfig(n_ctx=256, n_threads=THREADS))
    tokens = engine.tokenize("the quick brown fox jumps over the lazy dog and runs away")
    lanes = cost_lanes(engine.model, draft_setup(engine), n_ctx=64, n_threads=THREADS, k=engine.policy.k)
    n_layer = engine.n_layer
    try:
        for lane in lanes:
            lane.start(tokens[:3])
            for step, token in enumerate(tokens[3:9]):
                lane.step(token)
                if lane.name == "plain":
                    continue
                info = lane.ctx.step_info()
                if lane.name.startswith("checked") or lane.name == "draft":
                    assert info.exit_layer is None and info.probes == (n_layer if lane.name == "checked_all" else 1)
                else:
                    assert info.exit_layer == lane.layers_run - 1, lane.name
                    assert info.exit_kind == (ExitKind.VERIFIED if lane.name.startswith("stop_head") else ExitKind.HEAD_FREE)
                    native = lane.name.startswith(("stop_mask", "stop_fill"))
                    assert info.probes == (1 if native else 0)  # a callback is no native check
                # the cells a stop skipped are masked from the next token on, unless fill mode filled them
                assert info.graph.depth_mask == (lane.name.startswith("stop_") and not lane.name.startswith("stop_fill")
                                                 and step > 0), (lane.name, step)
            assert len(lane.samples) == 6
        draft = next(lane for lane in lanes if lane.name == "draft")
        assert min(draft.samples) > 0 and max(draft.samples) < 1e3  # the timer's milliseconds, not a wall clock's
    finally:
        for lane in lanes:
            lane.ctx.close()
        engine.close()  # the lanes' contexts use its model


def test_the_cost_lanes_time_the_draft_the_pack_holds(tmp_path, tiny_dir, monkeypatch):
    """Calibration prices the draft by timing it: the lanes must run it stored as the pack stores it (an f32
    draft costs about twice a q8_0 one on CPUs: 0.647 against 0.322 ms on SmolLM2)."""
    import specee_edge.calibrate.pipeline as pipeline

    timed = []
    measure = pipeline.measure_costs
    monkeypatch.setattr(pipeline, "measure_costs", lambda model, setup, *a, **kw: timed.append(setup.draft["quant"])
                        or measure(model, setup, *a, **kw))
    config, _ = calibrate_tiny(tmp_path, tiny_model_path(tiny_dir, "llama", n_layer=6))
    assert timed == [read_pack(config.output).draft.quant]


def test_answers_take_the_prompts_in_turns_from_each_category():
    """A run shorter than one round of answers still answers every kind of prompt."""
    prompts = load_prompts()
    order = interleaved(prompts)
    assert sorted(order) == list(range(len(prompts)))
    categories = {prompt.category for prompt in prompts}
    assert {prompts[i].category for i in order[: len(categories)]} == categories


@pytest.mark.parametrize("args, message", [(["--minutes", "15", "--tokens", "1000"], "leave out --tokens"),
                                           (["--minutes", "0"], "--minutes must be above 0")])
def test_minutes_size_the_run_alone(tmp_path, args, message):
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path / "model.gguf"), *args])
    assert result.exit_code == 1
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_the_split_is_over_the_prompts_answered():
    everyone = np.repeat(np.arange(40), 3)
    assert all(np.array_equal(a, b) for a, b in zip(split_answered(everyone, 0), split(40, 0, CALIBRATION_SPLIT)))
    some = np.array(interleaved(load_prompts())[:20])  # a short run: 20 prompts, of every category
    parts = split_answered(np.repeat(some, 2), 0)
    assert sorted(np.concatenate(parts).tolist()) == sorted(some.tolist())
    assert [len(part) for part in parts] == [12, 4, 4]


def test_collection_decodes_after_the_engines_prompt_tokens(tiny_dir, monkeypatch):
    # the engine's one rendering of a prompt into tokens, as bench and eval decode after, is calibration's too
    collector = Collector(tiny_model_path(tiny_dir, "llama"), n_threads=1, max_answer=2)
    rendered = [*collector.engine.prompt_tokens("Hi"), 7, 8]
    monkeypatch.setattr(collector.engine, "prompt_tokens", lambda text: list(rendered))
    shard = collector.answer(0, Prompt("chat", "Hi"), GREEDY)
    collector.close()
    assert shard.tokens[:len(rendered)].tolist() == rendered and shard.start == len(rendered) - 1
