"""The engine state fuzzer (issue 14): random REPL-like action sequences on the default model, one engine
per KV mode with the shipped pack and one with a multi-layer pack, invariants checked after every action
(tests/fuzz_engine.py says which and why each is exact).

`make test` runs SHORT_ACTIONS actions of seed SHORT_SEED (every invariant, no coverage check); the slow tier
(`make test-slow`, which CI runs) seed DEFAULT_SEED, DEFAULT_ACTIONS actions (about 150 s on 2 cores), and checks
that the run reached every action and event it is meant to test. Longer or other runs (`make fuzz` runs 20,000):

    SPECEE_FUZZ_ACTIONS=20000 SPECEE_FUZZ_SEED=7 pytest -q tests/test_fuzz.py

A failure names the seed, the action index and the last actions; the same seed and count replay it.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest

import tests.fuzz_engine as fuzz
from specee_edge.engine import GREEDY, EngineConfig
from specee_edge.engine.engine import Engine
from tests.fuzz_engine import EngineFuzzer, FuzzFailure, write_multilayer_pack

DEFAULT_ACTIONS = 2000
DEFAULT_SEED = 14
SHORT_ACTIONS = 300
SHORT_SEED = 15
SELF_TEST_ACTIONS = 400  # the planted defects below are caught within ~100 actions of seed 14


def fuzz_settings() -> tuple[int, int]:
    return (int(os.environ.get("SPECEE_FUZZ_ACTIONS", DEFAULT_ACTIONS)),
            int(os.environ.get("SPECEE_FUZZ_SEED", DEFAULT_SEED)))


@pytest.fixture(scope="module")
def multi_pack(default_model, tmp_path_factory):
    return write_multilayer_pack(default_model.info.path, tmp_path_factory.mktemp("fuzz") / "multi.specee.gguf")


def run_fuzz(model_path, multi_pack, seed: int, n_actions: int, capsys, record_property) -> fuzz.Report:
    fuzzer = EngineFuzzer(model_path, seed=seed, multi_pack=multi_pack)
    try:
        report = fuzzer.run(n_actions)
    finally:
        fuzzer.close()
    record_property("fuzz_actions", report.actions)
    record_property("fuzz_seconds", round(report.seconds, 1))
    with capsys.disabled():
        print(f"\n{report.summary()}")
    assert report.actions == n_actions
    return report


def test_a_short_engine_state_fuzz(default_model, multi_pack, capsys, record_property):
    """make test's run: fewer actions, every invariant checked after each; it must have decoded and switched."""
    report = run_fuzz(default_model.info.path, multi_pack, SHORT_SEED, SHORT_ACTIONS, capsys, record_property)
    assert report.kinds["chat"] > 0 and report.events["exact_rounds"] > 0 and report.events["twin_syncs"] > 0


@pytest.mark.slow
def test_engine_state_fuzz(default_model, multi_pack, capsys, record_property):
    n_actions, seed = fuzz_settings()
    report = run_fuzz(default_model.info.path, multi_pack, seed, n_actions, capsys, record_property)
    if n_actions >= DEFAULT_ACTIONS:
        # the run must have reached what it is meant to test, or passing says little
        ev, kinds = report.events, report.kinds
        for kind in ("chat", "regen", "clear", "early_exit", "threshold", "quality", "engine", "overflow", "fill"):
            assert kinds[kind] > 0, f"no {kind} action in {n_actions}"
        for event in ("exits_mask", "exits_fill", "exits_full", "exits_mask_skipping_2+_layers",
                      "exits_fill_skipping_2+_layers", "exits_full_skipping_2+_layers", "interrupted",
                      "finish_context", "finish_length", "context_full_error", "vanilla_checked", "twin_syncs",
                      "deep_checks", "exact_rounds"):
            assert ev[event] > 0, f"no {event} in {n_actions} actions"
        assert ev["twin_compared_decodes"] >= n_actions // 10


# --- the fuzzer can fail: planted defects are caught, and the message says how to replay -----------


def run_until_failure(model_path, multi_pack) -> str:
    fuzzer = EngineFuzzer(model_path, seed=DEFAULT_SEED, multi_pack=multi_pack)
    try:
        with pytest.raises(FuzzFailure) as caught:
            fuzzer.run(SELF_TEST_ACTIONS)
    finally:
        fuzzer.close()
    message = str(caught.value)
    assert f"(seed {DEFAULT_SEED})" in message and "<- failed here" in message
    assert f"SPECEE_FUZZ_SEED={DEFAULT_SEED} SPECEE_FUZZ_ACTIONS=" in message
    return message


def test_fuzzer_catches_a_cache_the_engine_lost_track_of(default_model, multi_pack, monkeypatch):
    """An engine that forgets to drop the token an interrupt left in the cache."""
    monkeypatch.setattr(Engine, "_sync_cache", lambda self, limit: None)
    assert "cache lengths disagree" in run_until_failure(default_model.info.path, multi_pack)


def test_fuzzer_catches_kv_that_differ_from_a_clean_replay(default_model, multi_pack, monkeypatch):
    """Mask-mode engines checked against twins that fill instead: the exited cells' skipped layers hold
    other K/V, which only the decodes after them can see. Twins follow everything here, to be quick."""
    original = fuzz.Twin.__init__

    def filling_twin(self, model, mode, n_cand, n_ctx=fuzz.N_CTX):
        original(self, model, "fill" if mode == "mask" else mode, n_cand, n_ctx)

    monkeypatch.setattr(fuzz.Twin, "__init__", filling_twin)
    monkeypatch.setattr(fuzz, "TWIN_SHARE", 1.0)
    monkeypatch.setattr(fuzz, "TWIN_SYNC_P", 1.0)
    message = run_until_failure(default_model.info.path, multi_pack)
    assert "not reproduced by a context that replays only the live decodes" in message


def resident_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.slow
def test_engines_opened_and_closed_in_a_loop_keep_memory_flat(default_model):
    """Each close frees the native context, the model and the pack's memory map at once (checked with the
    garbage collector off), and resident memory after many open/close cycles stays within 5 % of after
    ten. `make fuzz` runs 200 cycles, the slow tier 40."""
    cycles = 200 if fuzz_settings()[0] > DEFAULT_ACTIONS else 40
    after = {}
    for cycle in range(1, cycles + 1):
        gc.disable()
        try:
            engine = Engine(default_model.info.path, config=EngineConfig(n_ctx=256, n_threads=2))
            engine.generate("Hi", max_tokens=2, sampling=GREEDY)
            ctx, weights = weakref.ref(engine.ctx), weakref.ref(engine.policy.draft._weights)
            engine.close()
            del engine
            assert ctx() is None and weights() is None  # freed now, not at the next collection
        finally:
            gc.enable()
        if cycle in (10, cycles):
            after[cycle] = resident_mb()
    assert after[cycles] <= 1.05 * after[10], after
