"""Exact mode: early exits draft, the full model verifies them in one batch, the answers stay the full model's.

The runtime's part (a verification batch keeps its rows for the next draft) on a tiny random-weight model;
the engine's rounds on the default model, at a level whose loose head-free exits draft often and are often
wrong, so that rounds are accepted whole, corrected at every position, and cut by stops and limits. The rounds'
mechanics run with speculation="always" (draft at every chance); exactness is checked with the controller on too,
on an engine whose plain steps are made dearer so that it drafts (tests/test_controller_runtime.py has the rest).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specee_edge.bench.quality import batched_replay
from specee_edge.engine import GREEDY, Engine, EngineConfig, SamplingParams
from specee_edge.engine.controller import Choice, ExitPrior, Outcome
from specee_edge.engine.records import GenerationStats, Round, TokenRecord, TokenSource
from specee_edge.errors import SpecEEError
from specee_edge.exits import ExitKind
from specee_edge.pack import EXACT_QUALITY, OFF, LayerExit, PackLevelError, parse_quality, read_pack, write_pack
from specee_edge.pack.io import PackError
from specee_edge.runtime import Context, Model
from tests.conftest import SHIPPED_PACK, slowed, tiny_model_path
from tests.test_exits import PROMPT, always, drafted_context

QUESTIONS = ("What is the capital of France?", "Write a haiku about rain.", "List three prime numbers.",
             "Explain what a compiler does in one sentence.")


def exact_level_of(pack, max_draft: int = 6, threshold: float = 0.3):
    """An exact level drafting with head-free exits on every predictor layer above `threshold`."""
    exits = {il: LayerExit(ExitKind.HEAD_FREE, threshold) for il in pack.predictors}
    return dataclasses.replace(pack.levels[0], quality=EXACT_QUALITY, exits=exits, offline=sorted(pack.predictors),
                               max_draft=float(max_draft), speedup=2.0, speedup_sampled=2.0,
                               speedup_low=1.5, speedup_sampled_low=1.5)  # drafts both ways


@pytest.fixture(scope="module")
def exact_pack(tmp_path_factory):
    pack = read_pack(SHIPPED_PACK)
    lossy = [lv for lv in pack.levels if not lv.exact]
    path = tmp_path_factory.mktemp("exact") / "exact.specee.gguf"
    write_pack(path, dataclasses.replace(pack, levels=[*lossy, exact_level_of(pack)], default_quality=EXACT_QUALITY))
    return path


@pytest.fixture(scope="module")
def engine(default_model, exact_pack) -> Engine:
    return Engine(default_model.info.path, pack=exact_pack,
                  config=EngineConfig(n_ctx=1024, n_threads=2, speculation="always", draft_max=6))


@pytest.fixture(scope="module")
def auto_engine(default_model, exact_pack) -> Engine:
    """The controller on, on a machine where a single-token step costs four times what it costs here."""
    return slowed(Engine(default_model.info.path, pack=exact_pack, config=EngineConfig(n_ctx=1024, n_threads=2)),
                  step=4.0)


def prompt_of(engine: Engine, question: str) -> list[int]:
    return engine.tokenize(engine.format_chat([{"role": "user", "content": question}]))


def assert_batched_replay(engine: Engine, prompt: list[int], records: list) -> None:
    """The answer is exactly llama.cpp's greedy tokens evaluated as its rounds evaluated them (batched_replay, the
    definition of exact mode), on a plain context shaped as the engine's (its batches chunked alike)."""
    plain = Context(engine.model, n_ctx=engine.ctx.n_ctx, n_batch=engine.ctx.n_batch, n_threads=2)
    try:
        assert batched_replay(plain, prompt, records) == [r.id for r in records]
    finally:
        plain.close()


def vanilla(engine: Engine, prompt: list[int], **kwargs):
    engine.set_early_exit(False)
    try:
        engine.reset()
        return engine.generate(prompt, **kwargs)
    finally:
        engine.set_early_exit(True)
        engine.reset()


def rounds_of(records: list[TokenRecord]) -> list[Round]:
    """The exact-mode rounds that emitted these records, each once, in order."""
    rounds: list[Round] = []
    for record in records:
        if record.round is not None and (not rounds or record.round is not rounds[-1]):
            rounds.append(record.round)
    return rounds


def assert_cache_holds_the_reply(engine: Engine, prompt: list[int], reply: list[int]) -> None:
    """After a reply the cache holds the prompt and every token but the last, each cell at full depth."""
    expected = prompt + reply[:-1]
    assert engine.cached_tokens == expected
    assert engine.ctx.n_past == len(expected)
    assert all(engine.ctx.cell_depth(pos) == engine.n_layer - 1 for pos in range(len(expected)))


# --- the runtime: a batch's rows for the next draft ----------------------------------------------

def test_a_batch_keeps_its_rows_for_the_next_draft(tiny_dir):
    model = Model(tiny_model_path(tiny_dir, "llama"))

    def next_candidates(row: int | None) -> tuple[int, ...]:
        ctx = drafted_context(model)
        always(model, ctx, [2], ExitKind.HEAD_FREE)
        ctx.decode(PROMPT[:4])
        ctx.decode(PROMPT[4:], output_all=True)  # the verification batch: every row's logits
        if row is not None:
            ctx.truncate(4 + row + 1)  # forgets the draft's input, not the batch's rows
            ctx.draft_from_row(row)
        ctx.decode([PROMPT[0]])
        candidates = ctx.step_info().candidates
        ctx.close()
        return candidates

    last = len(PROMPT) - 4 - 1
    assert next_candidates(last) == next_candidates(None)  # the last row is what a batch leaves anyway
    assert next_candidates(0) != next_candidates(None)

    ctx = drafted_context(model)
    always(model, ctx, [2], ExitKind.HEAD_FREE)
    with pytest.raises(SpecEEError, match="no output row"):
        ctx.draft_from_row(0)  # no batch yet
    ctx.decode(PROMPT, output_all=True)
    with pytest.raises(SpecEEError, match="no output row 8"):
        ctx.draft_from_row(len(PROMPT))
    ctx.decode([3])  # a single-token graph makes the rows stale
    with pytest.raises(SpecEEError, match="no output row"):
        ctx.draft_from_row(0)
    ctx.close()


# --- the pack and the names -------------------------------------------------------------------------

def test_the_exact_level_round_trips_and_is_checked(tmp_path):
    pack = read_pack(SHIPPED_PACK)
    lossy = [lv for lv in pack.levels if not lv.exact]
    level = dataclasses.replace(exact_level_of(pack, max_draft=5), draft_stop=0.6, acceptance=0.7, tokens_per_round=2.5)
    write_pack(tmp_path / "ok.gguf", dataclasses.replace(pack, levels=[*lossy, level], default_quality=EXACT_QUALITY))
    back = read_pack(tmp_path / "ok.gguf")
    assert back.level().exact and back.level(parse_quality("exact")) == back.level()
    assert (back.level().max_draft, back.level().draft_stop) == (5, pytest.approx(0.6))
    assert not back.level(lossy[0].quality).exact

    with pytest.raises(PackError, match="only the level of quality 1 is exact"):
        bad = dataclasses.replace(level, quality=0.999)
        write_pack(tmp_path / "bad.gguf", dataclasses.replace(pack, levels=[*lossy, bad], default_quality=0.999))
    with pytest.raises(PackError, match="drafts a round"):
        bad = dataclasses.replace(level, max_draft=99.0)
        write_pack(tmp_path / "bad.gguf", dataclasses.replace(pack, levels=[*lossy, bad], default_quality=EXACT_QUALITY))
    without = dataclasses.replace(pack, levels=lossy, default_quality=lossy[-1].quality)
    with pytest.raises(PackLevelError, match="no quality level at or above 1"):
        without.level(parse_quality("exact"))
    assert parse_quality("1") == parse_quality("exact") == EXACT_QUALITY
    with pytest.raises(SpecEEError, match="exact or an agreement"):
        parse_quality("precise")


# --- the engine's rounds --------------------------------------------------------------------------

@pytest.mark.parametrize("lane", ["engine", pytest.param("auto_engine", marks=pytest.mark.slow)])
def test_greedy_exact_mode_is_llama_cpps_batched_evaluation_as_its_rounds_draft_accept_and_correct(lane, request):
    """Every answer is exactly llama.cpp's greedy tokens evaluated as its rounds evaluated them (batched_replay, the
    definition of exact); the rounds draft, accept, correct and finish with bonuses."""
    engine = request.getfixturevalue(lane)
    assert engine.exact
    reference = Context(engine.model, n_ctx=1024, n_threads=2)
    totals = dict.fromkeys(("rounds", "drafts", "accepted"), 0)
    sources = set()
    try:
        for question in QUESTIONS:
            prompt = prompt_of(engine, question)
            records = list(engine.stream(prompt, max_tokens=40, sampling=GREEDY))
            assert_cache_holds_the_reply(engine, prompt, [r.id for r in records])
            engine.reset()
            for key in totals:
                totals[key] += getattr(engine.stats, key)
            sources |= {r.source for r in records}
            assert batched_replay(reference, prompt, records) == [r.id for r in records], question
    finally:
        reference.close()
    assert totals["rounds"] > 0 and 0 < totals["accepted"] < totals["drafts"]
    assert {TokenSource.ACCEPTED, TokenSource.CORRECTION} <= sources


def test_prompt_lookup_drafts_rounds_that_repeat_the_context(engine):
    """Where the context offers a continuation, a round verifies it with no drafting step: a reply that copies its
    prompt is drafted by lookup, and it is still vanilla's answer."""
    prompt = prompt_of(engine, "Repeat exactly, twice: the quick brown fox jumps over the lazy dog.")
    records = list(engine.stream(prompt, max_tokens=40, sampling=GREEDY))
    stats = engine.stats
    assert_cache_holds_the_reply(engine, prompt, [r.id for r in records])
    engine.reset()
    lookup_rounds = [r for r in rounds_of(records) if r.choice == Choice.LOOKUP and r.drafts]
    assert stats.lookup_rounds == len(lookup_rounds) > 0
    # a lookup round decodes no drafting step: its tokens probed no layer and no draft of theirs left one early
    from_lookup = [r for r in records if r.round is not None and r.round.choice == Choice.LOOKUP]
    assert from_lookup and all(r.probes == 0 and r.draft_layer is None for r in from_lookup)
    assert_batched_replay(engine, prompt, records)


def test_plain_streaks_decode_and_tell_every_round(default_model):
    """Where batches cost far more than steps, exact mode's rounds run in plain streaks: the answer is vanilla's, the
    cache holds it, streaks share their Round among their tokens, and every round is told to the controller once,
    also when the reply is closed in the middle of a streak."""
    engine = Engine(default_model.info.path, pack=None, config=EngineConfig(n_ctx=1024, n_threads=2))
    try:
        prompt = prompt_of(engine, "List the days of the week, twice.")
        plain = vanilla(engine, prompt, max_tokens=48, sampling=GREEDY)
        list(engine.stream(prompt, max_tokens=4, sampling=GREEDY))  # a plain step measured
        engine.reset()
        for rows, ms in ((2, 1e4), (9, 4e4)):  # drafting can never pay: every round is a streak's until a wait ends
            engine.controller.batches[Choice.LOOKUP].add(rows, ms)
        told = engine.controller._rounds
        records = list(engine.stream(prompt, max_tokens=48, sampling=GREEDY))
        assert [r.id for r in records] == plain.tokens
        assert_cache_holds_the_reply(engine, prompt, plain.tokens)
        assert engine.controller._rounds - told == len(records) - 1  # the first token is the prompt's
        streaks = [r for r in rounds_of(records) if sum(rec.round is r for rec in records) > 1]
        assert streaks and all(r.choice == Choice.PLAIN and not r.drafts for r in streaks)
        engine.reset()
        told = engine.controller._rounds
        stream = engine.stream(prompt, max_tokens=48, sampling=GREEDY)
        closed = [next(stream).id for _ in range(10)]
        stream.close()
        assert closed == plain.tokens[:10] and engine.controller._rounds - told == 9
        assert_cache_holds_the_reply(engine, prompt, closed)
    finally:
        engine.close()


FILLER = "Read this, then list the days of the week, twice. " + "The weather was calm and the sea was quiet. " * 18


@pytest.mark.parametrize("question, ending", [
    (FILLER, {"max_tokens": 256}),  # a prompt of 224 tokens in 256 cells: the cache fills 33 tokens in
    ("List the days of the week, twice.", {"max_tokens": 48, "stop": ["Thursday:"]}),
], ids=["full context", "stop string"])
def test_a_reply_that_ends_during_plain_streaks_is_vanillas(default_model, question, ending):
    """A full context or a stop string ends the reply wherever the streaks are: vanilla's tokens and finish reason,
    the cache holds the reply, and each round is told to the controller once."""
    engine = Engine(default_model.info.path, pack=None, config=EngineConfig(n_ctx=256, n_threads=2))
    try:
        prompt = prompt_of(engine, question)
        plain = vanilla(engine, prompt, sampling=GREEDY, **ending)
        list(engine.stream(prompt, max_tokens=4, sampling=GREEDY))  # a plain step measured
        engine.reset()
        for rows, ms in ((2, 1e4), (9, 4e4)):  # drafting can never pay
            engine.controller.batches[Choice.LOOKUP].add(rows, ms)
        told = engine.controller._rounds
        records = list(engine.stream(prompt, sampling=GREEDY, **ending))
        assert [r.id for r in records] == plain.tokens
        assert engine.stats.finish_reason == plain.stats.finish_reason == ("context" if question == FILLER else "stop")
        assert engine.controller._rounds - told == len(records) - 1
        assert any(sum(rec.round is r for rec in records) > 1 for r in rounds_of(records))  # streaks ran
        assert_cache_holds_the_reply(engine, prompt, plain.tokens)
    finally:
        engine.close()


@pytest.mark.parametrize("max_tokens", [40, 200])  # the answer cut by max_tokens; ended by an end of generation
def test_the_bench_replay_of_lookup_counts_the_rounds_the_engine_ran(default_model, max_tokens):
    """replay_lookup over an answer (the bench's figure for machines where a batch costs a step) against an engine
    that drafts by lookup at every match (no pack, speculation "always"): the same rounds, drafts and accepted
    drafts, whether the request's max_tokens or an end of generation ends the answer."""
    from specee_edge.bench.lookup_replay import replay_lookup

    engine = Engine(default_model.info.path, pack=None,
                    config=EngineConfig(n_ctx=1024, n_threads=2, speculation="always"))
    try:
        prompt = prompt_of(engine, "List the days of the week, twice.")
        answer = [r.id for r in engine.stream(prompt, max_tokens=max_tokens, sampling=GREEDY)]
        stats = engine.stats
        assert stats.finish_reason == ("length" if max_tokens == 40 else "stop")
        replay = replay_lookup(prompt, answer, engine.model.eog_ids, max_tokens, max_n=engine.lookup_max_n)
        assert stats.lookup_rounds > 3
        assert (replay.rounds, replay.drafts, replay.accepted) == (stats.lookup_rounds, stats.drafts, stats.accepted)
        assert replay.tokens == stats.n_decode and replay.plain == stats.n_decode - stats.round_tokens
    finally:
        engine.close()


def test_an_exact_level_with_every_exit_off_drafts_from_prompt_lookup_alone(engine, exact_pack):
    """Calibration's lookup-only candidate: no step probes a layer, every round is a lookup round, a round cut
    short is rolled back without a draft head, and the answer is vanilla's."""
    pack = read_pack(exact_pack)
    lookup_only = dataclasses.replace(pack.level(), exits=dict.fromkeys(pack.predictors, OFF), offline=[], max_draft=2.0)
    assert lookup_only.off
    prompt = prompt_of(engine, "Repeat exactly, twice: the quick brown fox jumps over the lazy dog.")
    engine.policy.set_level(lookup_only)
    try:
        records = list(engine.stream(prompt, max_tokens=40, sampling=GREEDY))
        stats = engine.stats
        assert_cache_holds_the_reply(engine, prompt, [r.id for r in records])
    finally:
        engine.set_quality(None)
        engine.reset()
    assert stats.probes == 0 and stats.rounds == stats.lookup_rounds > 0
    assert max(r.drafts for r in rounds_of(records)) <= 6 and 0 < stats.accepted < stats.drafts
    assert_batched_replay(engine, prompt, records)


def test_lookup_continues_the_latest_occurrence_of_the_longest_suffix():
    from specee_edge.draft.lookup import Continuation, PromptLookup, match_bucket

    index = PromptLookup(max_n=3)
    index.extend([5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7])
    assert index.continuation(3) == Continuation([1, 2, 6], 2)  # "6 7" last occurred before 1 2; the longest match wins
    assert index.propose() == 1 and index.propose(max_n=1) == 1  # "7" last occurred before 1 too
    index.extend([8])
    found = index.continuation(5)
    assert found == Continuation([9, 6, 7, 1, 2], 3) and found.bucket == 2  # "6 7 8" occurred once
    assert index.propose(max_n=1) == 9 and index.propose(max_n=0) is None
    assert index.continuation(0) == Continuation([], 3)
    assert PromptLookup(max_n=3).continuation(2) == Continuation([], 0) and Continuation([], 0).bucket == 0
    assert [match_bucket(n) for n in (1, 2, 3, 4, 7, 8, 12)] == [1, 2, 2, 4, 4, 8, 8]


def test_lookup_after_a_token_equals_extending_the_index_and_leaves_it_as_it_was():
    """continuation_after (what exact mode asks at every round) against extend, continuation, truncate, on random
    contexts over small vocabularies (many repeats and runs, where a match can end at the last token)."""
    import random

    from specee_edge.draft.lookup import PromptLookup

    rng = random.Random(0)
    for _ in range(2000):
        index = PromptLookup(max_n=rng.choice([1, 3, 8]))
        index.extend(rng.randrange(rng.choice([2, 3, 50])) for _ in range(rng.randrange(40)))
        token, limit = rng.randrange(3), rng.randrange(10)
        tokens, ends = list(index.tokens), repr(index._ends)
        found = index.continuation_after(token, limit)
        assert index.tokens == tokens and repr(index._ends) == ends
        index.extend([token])
        assert found == index.continuation(limit) == scanned_continuation(index.tokens, index.max_n, limit), (
            tokens, token, limit)
        index.truncate(rng.randrange(len(tokens) + 1))
        rebuilt = PromptLookup(max_n=index.max_n)
        rebuilt.extend(index.tokens)
        assert index._ends == rebuilt._ends  # truncating undid exactly what extending registered


def scanned_continuation(tokens: list[int], max_n: int, limit: int):
    """Lookup by its definition, scanning the context: the longest suffix (up to max_n) that occurred earlier followed
    by a token, and up to `limit` tokens after its latest such occurrence."""
    from specee_edge.draft.lookup import Continuation

    p = len(tokens)
    for n in range(min(max_n, p), 0, -1):
        ends = [e for e in range(n - 1, p - 1) if tokens[e - n + 1 : e + 1] == tokens[p - n :]]
        if ends:
            return Continuation(tokens[ends[-1] + 1 : ends[-1] + 1 + limit], n)
    return Continuation([], 0)


def test_a_lossy_level_would_change_the_answers_exact_mode_keeps(engine, exact_pack):
    """The same exits as the answer (a lossy level) depart from vanilla: what exact mode's verification prevents."""
    pack = read_pack(exact_pack)
    lossy = dataclasses.replace(pack.level(), quality=0.9, max_draft=0.0)
    prompt = prompt_of(engine, QUESTIONS[1])
    plain = vanilla(engine, prompt, max_tokens=40, sampling=GREEDY)
    engine.policy.set_level(lossy)
    try:
        lossy_tokens = engine.generate(prompt, max_tokens=40, sampling=GREEDY).tokens
    finally:
        engine.set_quality(None)
        engine.reset()
    assert lossy_tokens != plain.tokens


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_rounds_cut_by_the_token_limit_leave_the_cache_exact(engine, max_tokens):
    prompt = prompt_of(engine, QUESTIONS[0])
    plain = vanilla(engine, prompt, max_tokens=max_tokens, sampling=GREEDY)
    out = engine.generate(prompt, max_tokens=max_tokens, sampling=GREEDY)
    assert len(out.tokens) == len(plain.tokens) <= max_tokens
    assert_cache_holds_the_reply(engine, prompt, out.tokens)
    engine.reset()


def test_a_stop_string_or_a_closed_stream_mid_round_leaves_the_cache_exact(engine):
    prompt = prompt_of(engine, "Count from one to twenty in words, separated by commas.")
    records = list(engine.stream(prompt, max_tokens=48, sampling=GREEDY))
    engine.reset()
    stop = "".join(r.text for r in records[6:9]).strip()  # a few tokens in, likely inside a round
    assert stop
    cut = engine.generate(prompt, max_tokens=48, sampling=GREEDY, stop=[stop])
    assert stop not in cut.text and cut.stats.finish_reason == "stop" and len(cut.tokens) < len(records)
    assert_cache_holds_the_reply(engine, prompt, cut.tokens)
    engine.reset()
    stream = engine.stream(prompt, max_tokens=48, sampling=GREEDY)
    taken = [next(stream).id for _ in range(6)]
    stream.close()  # as Ctrl+C or a client that disconnects does
    assert_cache_holds_the_reply(engine, prompt, taken)
    # the next turn decodes on from what the cache holds
    follow = engine.generate(prompt + taken, max_tokens=8, sampling=GREEDY)
    assert follow.stats.n_cached == len(prompt) + len(taken) - 2  # a prefill decodes at least two tokens
    engine.reset()


def round_records(round_: Round, sources: list[TokenSource]) -> list[TokenRecord]:
    return [TokenRecord(id=i, source=source, round=round_) for i, source in enumerate(sources)]


def test_acceptance_counts_the_drafts_a_cut_round_could_emit():
    """A round of 4 drafts accepted whole, cut after 2 tokens (a stop string, an end of generation, max_tokens):
    2 drafted, 2 accepted, not 2 of 4; a round corrected at its second row still counts all 4 of its drafts."""
    whole = Round(Choice.LOOKUP, drafts=4, accepted=4, emitted=5)
    cut = GenerationStats(30, True, exact=True)
    for record in round_records(whole, [TokenSource.ACCEPTED] * 4 + [TokenSource.BONUS])[:2]:
        cut.add(record)
    assert (cut.rounds, cut.drafts, cut.accepted, cut.acceptance_rate) == (1, 2, 2, 1.0)
    corrected = Round(Choice.EXIT, drafts=4, accepted=1, emitted=2)
    stats = GenerationStats(30, True, exact=True)
    for record in round_records(corrected, [TokenSource.ACCEPTED, TokenSource.CORRECTION]):
        stats.add(record)
    for record in round_records(whole, [TokenSource.ACCEPTED] * 4 + [TokenSource.BONUS]):
        stats.add(record)
    assert (stats.rounds, stats.drafts, stats.accepted) == (2, 8, 5)


def test_a_round_at_the_end_of_the_context(default_model, exact_pack):
    engine = Engine(default_model.info.path, pack=exact_pack, config=EngineConfig(n_ctx=256, n_threads=2))
    prompt = prompt_of(engine, "Count from one to one hundred in words, separated by commas.")
    out = engine.generate(prompt, max_tokens=1000, sampling=GREEDY)
    # as in plain decoding: the cache holds n_ctx tokens, and the last token emitted has no cell left
    assert out.stats.finish_reason == "context" and len(prompt) + len(out.tokens) == engine.ctx.n_ctx + 1
    assert out.stats.rounds > 0
    assert_cache_holds_the_reply(engine, prompt, out.tokens)
    engine.close()


def test_sampling_with_a_seed_repeats(engine):
    """Each emitted token is one draw from the request's generator, in order: a seed repeats the reply."""
    prompt = prompt_of(engine, QUESTIONS[3])
    sampling = SamplingParams(temperature=0.8, seed=11)
    first = engine.generate(prompt, max_tokens=40, sampling=sampling)
    engine.reset()
    again = engine.generate(prompt, max_tokens=40, sampling=sampling)
    engine.reset()
    assert first.tokens == again.tokens and first.stats.rounds > 0


@pytest.mark.slow
def test_exact_sampling_keeps_the_full_models_token_frequencies(engine):
    """On a fixed prompt, three-token replies are as frequent as vanilla's (seeds differ between the lanes: no
    coupling), their second and third tokens drawn in verification batches."""
    prompt = prompt_of(engine, "Name an animal.")
    n = 150

    def three_tokens(exact: bool, offset: int) -> list[tuple[int, ...]]:
        """n replies of three tokens drawn from the two likeliest at each step (at most 8 outcomes)."""
        engine.set_early_exit(exact)
        drawn = []
        for seed in range(n):
            out = engine.generate(prompt, max_tokens=3, sampling=SamplingParams(temperature=1.0, top_k=2, top_p=1.0,
                                                                              min_p=0.0, seed=offset + seed))
            drawn.append(tuple(out.tokens))
        engine.set_early_exit(True)
        return drawn

    ours, theirs = three_tokens(True, 0), three_tokens(False, 10_000)
    engine.reset()
    outcomes = sorted(set(ours) | set(theirs))
    p = np.array([ours.count(o) for o in outcomes]) / n
    q = np.array([theirs.count(o) for o in outcomes]) / n
    total_variation = 0.5 * np.abs(p - q).sum()
    # two samples of 150 from one distribution over at most 8 replies: total variation about 0.1 (0.25 is far
    # in the tail); an engine that accepted its drafts without drawing would shift the mass to the drafts' reply
    assert total_variation < 0.25, (total_variation, outcomes)
    assert len(set(ours)) > 2


def test_records_name_their_source_and_stats_add_up(engine):
    prompt = prompt_of(engine, QUESTIONS[2])
    records = list(engine.stream(prompt, max_tokens=32, sampling=GREEDY))
    stats = engine.stats
    engine.reset()
    decoded = records[1:]  # the first comes from the prompt's logits
    assert stats.round_tokens == sum(r.source != TokenSource.FULL for r in decoded)
    assert stats.accepted == sum(r.source == TokenSource.ACCEPTED for r in decoded)
    assert 0 < stats.acceptance_rate < 1 and stats.tokens_per_round >= 1
    assert sum(r.drafts for r in rounds_of(decoded)) == stats.drafts
    assert sum(r.emitted for r in rounds_of(decoded)) == len(decoded)
    assert stats.time_ms["batch"] > 0
    summary = stats.summary()
    assert summary["acceptance_rate"] == stats.acceptance_rate and summary["tokens_per_round"] == stats.tokens_per_round


# --- review findings (batches split by n_batch, stats of verified tokens, empty schedules) ----------

def test_a_context_refuses_what_would_split_a_batch(default_model):
    with pytest.raises(SpecEEError, match="n_batch must be at least 3"):
        Context(default_model, n_ctx=64, n_batch=2)
    ctx = Context(default_model, n_ctx=64, n_batch=4)
    try:
        assert ctx._chunks(list(range(5))) == [[0, 1, 2], [3, 4]]  # never a one-token chunk, which could exit
        with pytest.raises(SpecEEError, match="at most n_batch = 4"):
            ctx.decode(list(range(1, 6)), output_all=True)  # rows' logits would be read from the last chunk only
    finally:
        ctx.close()


def test_rounds_fit_one_llama_decode_at_a_small_n_batch(default_model, exact_pack):
    """n_batch = 4: every round checks at most 3 drafts, so that its rows are one llama_decode's outputs, and the
    answer is still llama.cpp's batched evaluation of its rounds (the prompt in chunks of 4, as the engine's)."""
    engine = Engine(default_model.info.path, pack=exact_pack,
                    config=EngineConfig(n_ctx=512, n_batch=4, n_threads=2, speculation="always"))
    try:
        prompt = prompt_of(engine, "Repeat exactly, twice: the quick brown fox jumps over the lazy dog.")
        records = list(engine.stream(prompt, max_tokens=40, sampling=GREEDY))
        assert_cache_holds_the_reply(engine, prompt, [r.id for r in records])
        assert engine.stats.rounds > 0 and max(r.drafts for r in rounds_of(records)) <= 3
        assert_batched_replay(engine, prompt, records)
    finally:
        engine.close()


def test_verified_tokens_are_not_exits_and_every_drafting_step_is_counted(engine):
    """In exact mode no token is an early exit's answer: an accepted draft names the layer its draft left at
    (draft_layer), and the probes and time of every drafting step, emitted or not, are in the records."""
    steps: list = []
    step = engine.step

    def counted(token, exits=True):
        record = step(token, exits)
        steps.append((record.probes, record.forward_ms))  # as decoded: a record may be charged more later
        return record

    engine.step = counted
    try:
        prompt = prompt_of(engine, QUESTIONS[1])
        records = list(engine.stream(prompt, max_tokens=40, sampling=GREEDY))
        stats = engine.stats
    finally:
        del engine.step
        engine.reset()
    assert stats.rounds > stats.lookup_rounds and stats.exits == 0 and stats.avg_exit_layer == engine.n_layer - 1
    assert all(r.exit_layer is None for r in records)
    accepted = [r for r in records if r.source == TokenSource.ACCEPTED and r.round.choice == Choice.EXIT]
    assert any(r.draft_layer is not None for r in accepted)
    assert sum(r.probes for r in records) == sum(probes for probes, _ in steps) > 0
    assert sum(r.forward_ms for r in records) == pytest.approx(sum(ms for _, ms in steps))


def observed_outcomes(engine: Engine) -> list[Outcome]:
    """Every round's Outcome as the engine hands it to its controller (the controller learns from it as usual)."""
    outcomes: list[Outcome] = []
    observe = engine.controller.observe

    def kept(outcome: Outcome) -> float:
        outcomes.append(outcome)
        return observe(outcome)

    engine.controller.observe = kept
    return outcomes


def test_every_drafting_step_is_charged_to_its_round(default_model, tmp_path):
    """An exit round's drafting steps are all priced, the last too where it ran every layer and ended the round
    (at threshold 0.6 about half the drafting rounds end so): one measured step per draft."""
    pack = read_pack(SHIPPED_PACK)
    path = tmp_path / "strict.specee.gguf"
    write_pack(path, dataclasses.replace(pack, levels=[exact_level_of(pack, threshold=0.6)], default_quality=EXACT_QUALITY))
    engine = Engine(default_model.info.path, pack=path,
                    config=EngineConfig(n_ctx=1024, n_threads=2, speculation="always", draft_max=6))
    exit_layers: list[int | None] = []  # of each step since the last round ended
    step = engine.step
    engine.step = lambda token, exits=True: exit_layers.append((record := step(token, exits)).exit_layer) or record
    rounds: list[tuple[Outcome, list[int | None]]] = []
    observe = engine.controller.observe

    def kept(outcome: Outcome) -> float:
        rounds.append((outcome, exit_layers[:]))
        exit_layers.clear()
        return observe(outcome)

    engine.controller.observe = kept
    try:
        for question in QUESTIONS[:2]:
            list(engine.stream(prompt_of(engine, question), max_tokens=40, sampling=GREEDY))
            engine.reset()
    finally:
        engine.close()
    drafted = [(outcome, layers) for outcome, layers in rounds if outcome.plan.choice == Choice.EXIT and outcome.drafts]
    assert any(layers[-1] is None for _, layers in drafted)  # some round's last drafting step ran every layer
    assert all(len(outcome.draft_step_ms) == len(layers) == outcome.drafts for outcome, layers in drafted)


def test_the_controller_keeps_exit_rounds_to_the_levels_max_draft(default_model, tmp_path):
    """Auto mode drafts exits no longer than the exact level's calibrated max_draft (2 here), though a round may
    check up to draft_max (8) and plain steps are dear enough to draft long."""
    pack = read_pack(SHIPPED_PACK)
    path = tmp_path / "short.specee.gguf"
    write_pack(path, dataclasses.replace(pack, levels=[exact_level_of(pack, max_draft=2)], default_quality=EXACT_QUALITY))
    engine = slowed(Engine(default_model.info.path, pack=path, config=EngineConfig(n_ctx=1024, n_threads=2)), step=4.0)
    try:
        outcomes = observed_outcomes(engine)
        for question in QUESTIONS:
            list(engine.stream(prompt_of(engine, question), max_tokens=48, sampling=GREEDY))
            engine.reset()
    finally:
        engine.close()
    exit_plans = [o.plan.drafts for o in outcomes if o.plan.choice == Choice.EXIT]
    assert exit_plans and max(exit_plans) <= 2, exit_plans


def test_a_level_with_exits_on_but_nothing_scheduled_drafts_by_lookup(default_model, exact_pack):
    """Exits on, offline set empty: no step is probed, so no batch keeps a draft head; a lookup round cut short
    must not ask for one."""
    pack = read_pack(exact_pack)
    unscheduled = dataclasses.replace(exact_level_of(pack), offline=[])
    engine = Engine(default_model.info.path, pack=exact_pack,
                    config=EngineConfig(n_ctx=1024, n_threads=2, speculation="always"))
    try:
        engine.policy.set_level(unscheduled)
        prompt = prompt_of(engine, "Repeat exactly, twice: the quick brown fox jumps over the lazy dog.")
        records = list(engine.stream(prompt, max_tokens=40, sampling=GREEDY))
        assert engine.stats.lookup_rounds > 0 and engine.stats.accepted < engine.stats.drafts  # one was cut short
        assert_cache_holds_the_reply(engine, prompt, [r.id for r in records])
    finally:
        engine.close()


def test_switching_to_the_exact_level_reads_its_exit_prior(default_model, tmp_path):
    """An engine started at a lossy level starts exit drafts from the exact level's calibration once switched to it
    (/set quality exact, a server request's "quality"), not from the default guess."""
    pack = read_pack(SHIPPED_PACK)
    lossy = [lv for lv in pack.levels if not lv.exact]
    exact = dataclasses.replace(exact_level_of(pack), acceptance=0.73, exit_rate=0.4)
    path = tmp_path / "exact.specee.gguf"
    write_pack(path, dataclasses.replace(pack, levels=[*lossy, exact], default_quality=EXACT_QUALITY))
    engine = Engine(default_model.info.path, pack=path,
                    config=EngineConfig(n_ctx=256, n_threads=2, quality=lossy[-1].quality))
    try:
        assert not engine.exact and engine.controller.exit_prior == ExitPrior()
        engine.set_quality(EXACT_QUALITY)
        prior = engine.controller.exit_prior  # the pack stores float32
        assert engine.exact and (prior.acceptance, prior.exit_share) == (pytest.approx(0.73), pytest.approx(0.4))
        engine.set_quality(lossy[-1].quality)
        assert engine.controller.exit_prior == ExitPrior()
    finally:
        engine.close()


@pytest.mark.parametrize("lane", ["engine", pytest.param("auto_engine", marks=pytest.mark.slow)])
def test_greedy_exact_mode_is_llama_cpps_own_batched_evaluation_token_for_token(lane, request):
    """Defined against llama.cpp itself: replaying an answer's rounds on a plain context (each single step alone,
    each verification batch as one batch of its rows, rejected rows dropped) gives exactly the answer's tokens:
    nothing the drafting steps, probes or rollbacks left in the cache changes a token."""
    engine: Engine = request.getfixturevalue(lane)
    plain = Context(engine.model, n_ctx=engine.ctx.n_ctx, n_threads=2)
    try:
        for question in QUESTIONS:
            prompt = prompt_of(engine, question)
            records = list(engine.stream(prompt, max_tokens=64, sampling=GREEDY))
            engine.reset()
            assert any(r.round is not None and r.round.rows for r in records)  # some rows were verified in a batch
            assert batched_replay(plain, prompt, records) == [r.id for r in records], question
    finally:
        plain.close()


def test_the_engine_tells_its_controller_the_split_and_each_drafting_steps_exit_layer(default_model, exact_pack,
                                                                                      monkeypatch):
    """On a split model (llama.cpp's map says where: here as a GPU's -ngl 7 would place SmolLM2's 30 layers), the
    controller gets the first layer past the split, and each exit round's drafting steps with their exit layers, so
    that it prices the two sides' steps apart."""
    devices = ["CPU"] * 24 + ["CUDA0"] * 6 + ["CUDA0"]
    monkeypatch.setattr(Model, "layer_devices", lambda self: devices)
    engine = Engine(default_model.info.path, pack=exact_pack,
                    config=EngineConfig(n_ctx=512, n_threads=2, speculation="always", draft_max=6))
    controller, outcomes = engine.controller, []
    observe = controller.observe
    monkeypatch.setattr(controller, "observe", lambda outcome: outcomes.append(outcome) or observe(outcome))
    try:
        assert controller.split_layer == 24
        engine.generate(prompt_of(engine, QUESTIONS[0]), max_tokens=24, sampling=GREEDY)
    finally:
        engine.close()
    drafting = [o for o in outcomes if o.draft_step_ms]
    assert drafting
    exited = []
    for outcome in drafting:
        layers = outcome.draft_exit_layers
        assert len(layers) == len(outcome.draft_step_ms) and (layers[-1] is None) == outcome.drafting_ended_full
        exited += layers[:-1] if outcome.drafting_ended_full else layers
    assert None not in exited
    sides = (controller.draft_step.value is not None, controller.draft_step_past.value is not None)
    assert sides == (any(layer < 24 for layer in exited), any(layer >= 24 for layer in exited)) == (True, True)
