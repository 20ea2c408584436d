"""specee-edge bench on the default model and its shipped pack, tiny settings: every documented key, sane values."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
from llama_cpp import Llama
from typer.testing import CliRunner

from specee_edge.bench.quality import repetition
from specee_edge.bench.report import LLAMA_CPP_PYTHON, repeat_of
from specee_edge.bench.run import NO_PACK, EngineSpec, bench_qualities, pick_prompts
from specee_edge.bench.runner import ContextLane, Stopwatch, VanillaLane
from specee_edge.data.prompts import Prompt, bench_prompts
from specee_edge.cli import app
from specee_edge.engine import DEFAULT_KV_MODE, GREEDY, Engine, EngineConfig, GenerationStats
from specee_edge.errors import SpecEEError
from specee_edge.pack import EXACT_QUALITY, read_pack, write_pack
from tests.conftest import CHAT_PROMPT, LOOSE, SHIPPED_PACK, STRICT, write_two_level_pack

BENCH_DOC = Path(__file__).resolve().parents[1] / "docs" / "bench.md"
PROMPTS, TOKENS = 2, 8


def documented_keys() -> tuple[set[str], set[str]]:
    """docs/bench.md's JSON schema table: (top-level keys, keys of each `modes` entry)."""
    section = BENCH_DOC.read_text()
    top, per_mode = set(), set()
    for key, in_modes in re.findall(r"^\| `([a-z_]+)` \|[^|]*\| (yes|no) \|", section, flags=re.M):
        top.add(key)
        if in_modes == "yes":
            per_mode.add(key)
    return top, per_mode


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("bench")
    args = ["bench", "-p", str(PROMPTS), "-n", str(TOKENS), "-t", "2", "--ppl-tokens", "32", "--greedy-only", "--no-peer",
            "--no-llama-server", "--json", str(out / "bench.json"), "--plot", str(out / "exits.png")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads((out / "bench.json").read_text()), out / "exits.png", result.output


@pytest.fixture(scope="module")
def two_level_pack(tmp_path_factory) -> Path:
    """The two lossy levels and an exact level that drafts with the loose one's exits."""
    path = write_two_level_pack(tmp_path_factory.mktemp("pack") / "two.specee.gguf")
    pack = read_pack(path)
    loose = pack.level(LOOSE)
    exact = dataclasses.replace(loose, quality=EXACT_QUALITY, max_draft=4.0, speedup=2.0, speedup_sampled=2.0,
                                speedup_low=1.5, speedup_sampled_low=1.5)
    return write_pack(path, dataclasses.replace(pack, levels=[*pack.levels, exact]))


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory, two_level_pack) -> tuple[dict, Path, str, list[str]]:
    """`--quality all` on a two-level pack: one SpecEE lane per level in one run; and each engine the run loaded."""
    out = tmp_path_factory.mktemp("sweep")
    args = ["bench", "--pack", str(two_level_pack), "--quality", "all", "-p", str(PROMPTS), "-n", str(TOKENS),
            "-t", "2", "--ppl-tokens", "32", "--no-llama-server", "--json", str(out / "sweep.json"),
            "--plot", str(out / "sweep.png")]
    loaded: list[str] = []
    load = EngineSpec.load
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineSpec, "load", lambda spec, model: loaded.append(spec.name) or load(spec, model))
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads((out / "sweep.json").read_text()), out / "sweep.png", result.output, loaded


def test_json_has_every_documented_key(bench_run):
    data, _, _ = bench_run
    top, per_mode = documented_keys()
    assert top and per_mode
    assert set(data) == top
    assert set(data["modes"]) == {DEFAULT_KV_MODE, NO_PACK}  # the pack's default level, and exact mode without it
    assert set(data["modes"][DEFAULT_KV_MODE]) == per_mode and not data["modes"][NO_PACK]["pack"]
    assert set(data["ms_per_token"]) == {"draft", "layers", "predictor", "verify", "batch", "other", "sample"}
    default = read_pack(SHIPPED_PACK).default_quality
    assert data["quality"] == data["default_quality"] == default


def test_values_are_sane(bench_run):
    data, _, _ = bench_run
    n_layer = data["n_layer"]
    assert data["kv_mode"] == DEFAULT_KV_MODE
    assert (data["prompts"], data["tokens"]) == (PROMPTS, TOKENS)
    assert 0 < data["steps"] <= PROMPTS * (TOKENS - 1)
    assert 0 < data["vanilla_tok_s"] and 0 < data["specee_tok_s"] and 0 < data["speedup"]
    assert 1 < data["ppl_full"] < 1e4 and 1 < data["ppl_specee"] < 1e4 and 1 < data["ppl_specee_raw"] < 1e4
    assert len(data["oracle_histogram"]) == n_layer and sum(data["oracle_histogram"]) == data["vanilla_steps"]
    # the cost lanes measured a real model: every layer and the head cost something
    # the cost lanes measured this model (a part's sign is a timing: on a loaded machine a layer's slope measured
    # below zero, as docs/bench.md allows; only the head, 8 layers' worth, stands clear of such noise)
    assert data["costs"]["n_layer"] == n_layer and data["costs"]["head_ms"] > 0
    assert all(np.isfinite(data["costs"][part]) for part in ("layer_ms", "draft_ms", "check_ms", "stop_ms"))
    # `other` is the step's time less what was timed inside it (forward, batch, draw): inside, so never more than
    # the step (a part counted twice would be); the draw is timed (llama-server's timings hold it)
    assert data["ms_per_token"]["other"] >= 0 and data["ms_per_token"]["sample"] > 0
    # repetition per category of the prompts run; the speed-up on answers that do not loop is over a subset
    assert len(data["repetition_by_category"]) == PROMPTS and 0 <= data["looping_answers"] <= PROMPTS
    assert all(0 <= r <= 1 for r in data["repetition_by_category"].values())
    assert (data["speedup_no_loop"] is None) == (data["looping_answers"] == PROMPTS)


def within(value: float, interval: list[float]) -> bool:
    low, high = interval
    return low - 1e-9 <= value <= high + 1e-9


def test_every_lane_answers_whole_in_a_shuffled_order_and_every_speedup_has_its_interval(bench_run):
    data, _, output = bench_run
    level = "exact" if data["exact"] else f"{data['quality']:g}"
    # llama-server not run: only the bare Context has its repeat lane
    lanes = {LLAMA_CPP_PYTHON, ContextLane.name, repeat_of(ContextLane.name), f"specee-edge {DEFAULT_KV_MODE}@{level}",
             f"specee-edge {NO_PACK}"}
    order = data["lane_order"]
    assert order["seed"] == 0 and order["sampled"] is None  # --greedy-only
    assert len(order["greedy"]) == PROMPTS and all(set(names) == lanes and len(names) == len(lanes)
                                                   for names in order["greedy"])
    # the bare Context control lane: our runtime's plain step and draw, the Llama.eval lane's answers
    bare = data["tools"][ContextLane.name]
    assert bare["tok_s"] > 0 and bare["identical"] == 1.0
    assert data["bare_ms_per_token"]["layers"] > 0 and data["bare_ms_per_token"]["other"] >= 0
    # Llama.eval's step split alike: its eval beside the bare Context's decode, its text and stop strings in other
    vanilla_parts = data["vanilla_ms_per_token"]
    assert vanilla_parts["layers"] > 0 and vanilla_parts["sample"] > 0 and vanilla_parts["other"] > 0
    assert sum(vanilla_parts.values()) == pytest.approx(1e3 / data["vanilla_tok_s"], rel=1e-6)
    # its repeat, a fresh equal twin, read against it: the run's noise
    [repeat] = data["repeats"]
    twin = data["tools"][repeat_of(ContextLane.name)]["tok_s"] / bare["tok_s"]
    assert (repeat["lane"], repeat["twin"]) == (repeat_of(ContextLane.name), ContextLane.name)
    assert repeat["decoding"] == "greedy"
    assert repeat["ratio"] == pytest.approx(twin) and repeat["interval"] is not None
    assert repeat["drifted"] == ("the run drifted" in output)
    for lane in (data, *data["modes"].values(), *data["tools"].values()):
        assert within(lane["speedup"], lane["speedup_interval"])
        assert set(lane["speedup_by_category_interval"]) == set(lane["speedup_by_category"])
        # a category of one prompt (each, here) has no interval
        assert all(interval is None for interval in lane["speedup_by_category_interval"].values())
    # against itself, the baseline's interval is 1 (--no-llama-server: the Llama.eval lane)
    assert data["tools"][LLAMA_CPP_PYTHON]["speedup_interval"] == [1.0, 1.0]
    assert "95% interval" in " ".join(output.split())


@pytest.mark.slow
def test_the_sampled_pass_loads_fresh_engines(sweep_run):
    """Its controllers start cold, as the greedy pass's did: each lane's engine is loaded once per pass."""
    data, _, _, loaded = sweep_run
    assert len(loaded) == 2 * len(data["modes"])
    assert sorted(loaded[: len(data["modes"])]) == sorted(loaded[len(data["modes"]):])


def test_repetition_counts_tokens_inside_a_repeated_4_gram():
    assert repetition([1, 2, 3, 4, 5, 6, 7, 8]) == 0.0
    assert repetition([1, 2, 3, 4, 1, 2, 3, 4]) == 0.5          # the second 1 2 3 4
    assert repetition([9, 1, 2, 3, 4, 1, 2, 3, 4, 1]) == 0.5    # the second 1 2 3 4 and the 1 after it (2 3 4 1)
    assert repetition([7] * 10) == pytest.approx(0.9)           # a loop: all but the first 4-gram's first token
    assert repetition([]) == 0.0


def test_lane_figures_match_an_engine_run_apart(bench_run, default_model):
    """The default level's lane against the same prompts answered by an engine outside the bench: the same
    steps, exits and recall (greedy decoding is deterministic)."""
    data, _, _ = bench_run
    engine = Engine(default_model.info.path, config=EngineConfig(n_ctx=2048, n_threads=1))
    stats = GenerationStats(engine.n_layer, early_exit=True)
    for prompt in pick_prompts(bench_prompts("all"), PROMPTS):
        engine.reset()
        records = list(engine.stream(engine.format_prompt(prompt.text), max_tokens=TOKENS, sampling=GREEDY))
        for record in records[1:]:
            stats.add(record)
    engine.close()
    assert data["steps"] == stats.n_decode  # the same answers' lengths
    assert data["exit_histogram"] == np.bincount([data["n_layer"] - 1 if e is None else e for e in stats.exit_layers],
                                                 minlength=data["n_layer"]).tolist()
    assert data["draft_recall_at_k"] == pytest.approx(stats.draft_recall_at_k)
    assert data["head_free_rate"] == pytest.approx(stats.head_free_rate)
    if not stats.exits:  # a level that never exits answers like vanilla
        assert data["agreement"] == 1.0 and data["identical"] == 1.0


def test_terminal_report_and_plot(bench_run):
    _, plot, output = bench_run
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for figure in ("vanilla", "speedup", "oracle_speedup", "head-free", "agree", "prefix", "exit layers",
                   "ms per decode step", "bare: the Context lane", "candidate_mass"):
        assert figure in output


@pytest.mark.slow
def test_quality_sweep_has_a_lane_per_level(sweep_run, two_level_pack):
    data, _, _, _ = sweep_run
    _, per_mode = documented_keys()
    lanes = {f"{DEFAULT_KV_MODE}@{LOOSE:g}": LOOSE, f"{DEFAULT_KV_MODE}@{STRICT:g}": STRICT,
             f"{DEFAULT_KV_MODE}@exact": EXACT_QUALITY}
    assert set(data["modes"]) == {*lanes, NO_PACK}  # and exact mode without the pack
    for name, quality in lanes.items():
        mode = data["modes"][name]
        assert set(mode) == per_mode
        assert (mode["kv_mode"], mode["quality"]) == (DEFAULT_KV_MODE, quality)
        assert 0 <= mode["agreement"] <= 1 and 0 < mode["speedup"] and 1 < mode["ppl_specee_raw"] < float("inf")
        low, high = mode["agreement_interval"]  # over the bench's prompts
        assert low <= mode["agreement"] <= high
    # the top level is the default level's lane
    assert data["quality"] == data["default_quality"] == STRICT
    assert data["speedup"] == data["modes"][f"{DEFAULT_KV_MODE}@{STRICT:g}"]["speedup"]
    # threshold 0.3 lets tokens exit, and the temperatures then move the perplexity
    loose = data["modes"][f"{DEFAULT_KV_MODE}@{LOOSE:g}"]
    assert loose["exit_rate"] > 0 and loose["ppl_specee"] != loose["ppl_specee_raw"]
    # its head-free exits chose among their candidates: the full model's mass there is measured, not assumed
    if loose["head_free_rate"] > 0:
        assert 0 < loose["candidate_mass"] < 1
    # the same exits as drafts: verified in batches, every divergence from vanilla a near-tie
    exact = data["modes"][f"{DEFAULT_KV_MODE}@exact"]
    assert exact["exact"] and not loose["exact"]
    # whether its rounds draft is the controller's call on this machine: the figures are there either way
    shares = exact["choices"]["shares"]
    assert sum(shares.values()) == pytest.approx(1.0) and exact["choices"]["controller"]["plain_ms"] > 0
    assert 0 <= exact["acceptance_rate"] <= 1
    assert exact["tokens_per_round"] >= 1 if shares["plain"] < 1 else exact["tokens_per_round"] == 0
    assert exact["ms_per_token"]["batch"] > 0 and loose["ms_per_token"]["batch"] == 0
    # divergences count answers that depart from vanilla's (one that merely ends sooner is not one); a divergence
    # made on purpose is counted with its margin in tests/test_quality.py. That exact mode's are near-ties cannot be
    # checked on a run that may have none (near_ties == divergences held vacuously here)
    for lane in (exact, loose):
        assert 0 <= lane["near_ties"] <= lane["divergences"] <= round((1 - lane["identical"]) * data["prompts"])
    # what does hold on every run: exact mode's answers are llama.cpp's own evaluation of their rounds
    assert exact["off_replay"] == 0 and loose["off_replay"] is None
    assert exact["agreement"] >= loose["agreement"]
    # the sampled pass and the peer lane ran on the same prompts
    assert data["vanilla_sampled_tok_s"] > 0 and exact["sampled"]["speedup"] > 0
    assert data["repetition_sampled_by_category"].keys() == data["repetition_by_category"].keys()
    assert 0 <= data["looping_answers_sampled"] <= data["prompts"]
    sampled_shares = exact["sampled"]["exact"]["shares"]
    assert sum(sampled_shares.values()) == pytest.approx(1.0) and 0 <= exact["sampled"]["identical"] <= 1
    if sampled_shares["plain"] < 1:
        assert exact["sampled"]["tokens_per_round"] >= 1
    else:
        assert exact["sampled"]["tokens_per_round"] == 0
    assert data["peer"]["speedup"] > 0 and data["peer_sampled"]["speedup"] > 0
    # beside the measured figures, the pack's: exact mode's speed-ups, a lossy level's agreement interval
    assert (exact["calibrated_speedup"], exact["calibrated_speedup_sampled"], exact["calibrated_agreement"]) == (2.0, 2.0, None)
    stored = read_pack(two_level_pack).level(LOOSE)
    assert loose["calibrated_speedup"] == pytest.approx(stored.speedup) and loose["calibrated_speedup_sampled"] is None
    assert loose["calibrated_agreement"] == pytest.approx(list(stored.agreement_interval()))


@pytest.mark.slow
def test_quality_sweep_table_and_plot(sweep_run):
    _, plot, output, _ = sweep_run
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = output[output.index("speed and quality"):]
    # each lane's speed-ups on a line of their own, above the line with its name and their intervals
    rows = [line.split()[0] for line in table.splitlines()[:30] if line.strip() and not line.split()[0].endswith("x")]
    lanes = [f"{DEFAULT_KV_MODE}@{LOOSE:g}", f"{DEFAULT_KV_MODE}@{STRICT:g}*", f"{DEFAULT_KV_MODE}@exact"]
    rows_seen = rows[rows.index("vanilla"):rows.index("oracle") + 2]
    assert rows_seen == ["vanilla", *lanes, NO_PACK.split()[0], "peer", "oracle", "oracle"]
    for figure in ("speedup", "sampled", "acceptance_rate", "tokens_per_round", "verify_cost", "near-ties",
                   "calibrated"):
        assert figure in output


def test_bench_qualities(two_level_pack):
    pack = read_pack(two_level_pack)
    assert bench_qualities(None, pack) == [None]  # the engine takes the pack's default
    assert bench_qualities("all", pack) == [LOOSE, STRICT, EXACT_QUALITY]
    assert bench_qualities("exact,0.95", pack) == [STRICT, EXACT_QUALITY]
    assert bench_qualities("0.95,0.99", pack) == [STRICT]  # each the lowest level at or above it
    assert bench_qualities(f"{STRICT}, {LOOSE}", pack) == [LOOSE, STRICT]
    for bad in ("high", "0.9,", "1.5", "0"):
        with pytest.raises(SpecEEError):
            bench_qualities(bad, pack)
    with pytest.raises(SpecEEError, match="no quality level at or above 0.999"):
        bench_qualities("0.999", read_pack(write_two_level_pack(two_level_pack.with_name("lossy.gguf"))))


def test_vanilla_lane_is_stock_greedy(default_model):
    """The vanilla lane's token loop gives what llama-cpp-python's own greedy generate() gives."""
    prompt = default_model.tokenize(CHAT_PROMPT)
    llm = Llama(model_path=str(default_model.info.path), n_ctx=256, n_threads=1, n_threads_batch=1, verbose=False)
    stock = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        stock.append(token)
        if len(stock) == 12 or default_model.is_eog(token):
            break
    lane = VanillaLane(llm, 12, default_model.is_eog)
    lane.answer(prompt, Stopwatch())
    assert lane.outputs == [stock]
    assert lane.timing.steps == len(stock) - 1


def test_the_vanilla_lane_is_named_for_what_it_runs():
    """It is Llama.eval a token at a time with our draw, not llama-cpp-python's create_completion: its name in the
    tables and the JSON (`tools`, `baseline`) says Llama.eval, as docs/bench.md does."""
    assert LLAMA_CPP_PYTHON.endswith("Llama.eval")
    assert BENCH_DOC.read_text().count(f"`{LLAMA_CPP_PYTHON}`") >= 3  # the lane's section, `baseline`, `tools`


def test_pick_prompts_takes_categories_in_turn():
    prompts = [Prompt(c, f"{c}{i}") for c in ("a", "b", "c") for i in range(3 if c != "c" else 1)]
    assert [p.text for p in pick_prompts(prompts, 5)] == ["a0", "b0", "c0", "a1", "b1"]
    assert len(pick_prompts(prompts, 0)) == len(prompts)


def test_bad_kv_mode_is_one_line_error():
    result = CliRunner().invoke(app, ["bench", "--kv-mode", "nope"])
    assert result.exit_code == 1
    assert "unknown KV mode" in result.output


@pytest.mark.parametrize("quality, message", [("1.5", "in (0, 1]: got 1.5"), ("best", "such as 0.95")])
def test_bad_quality_is_one_line_error(quality, message):
    result = CliRunner().invoke(app, ["bench", "--quality", quality])
    assert result.exit_code == 1
    assert result.output.strip().count("\n") == 0 and message in result.output
