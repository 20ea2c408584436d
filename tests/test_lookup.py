"""Prompt lookup: the incremental index against a brute-force scan, the in-graph merge against numpy,
and the engine's index following its cache through chat turns, /regen, /clear and interruptions."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from specee_edge.draft import LinearDraft
from specee_edge.draft.lookup import Continuation, PromptLookup, lookup_drafts, lookup_proposals
from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.errors import SpecEEError
from specee_edge.pack import read_pack, write_pack
from specee_edge.pack.io import PackError
from specee_edge.runtime import Context
from specee_edge.runtime.weights import TargetWeights
from tests.conftest import CHAT_PROMPT, SHIPPED_PACK
from tests.test_native import context_with_draft


def scan(tokens: list[int], max_n: int) -> int | None:
    """What prompt lookup must propose, by rescanning the whole context: for the longest suffix
    (n = max_n .. 1) that occurred before, the token after its latest earlier occurrence."""
    p = len(tokens) - 1
    for n in range(min(max_n, len(tokens)), 0, -1):
        suffix = tokens[p - n + 1 :]
        for end in range(p - 1, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1]
    return None


def test_incremental_index_proposes_what_a_scan_proposes():
    rng = random.Random(0)
    for _ in range(200):
        index, tokens = PromptLookup(rng.choice([1, 2, 3, 4])), []
        for _ in range(150):
            action = rng.random()
            if action < 0.1:  # the KV cache truncated (a new prompt sharing a prefix, /regen)
                keep = rng.randint(0, len(tokens))
                index.truncate(keep)
                tokens = tokens[:keep]
            elif action < 0.12:
                index.clear()
                tokens = []
            else:  # a small alphabet makes repeats, and so proposals, frequent
                new = [rng.randint(0, 5) for _ in range(rng.choice([1, 1, 1, 4]))]
                index.extend(new)
                tokens += new
            assert index.tokens == tokens
            assert index.propose() == scan(tokens, index.max_n)


def test_lookup_proposals_replays_a_context_step_by_step():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 9]
    assert lookup_proposals(tokens, 2, len(tokens), 4) == [scan(tokens[: p + 1], 4) for p in range(2, len(tokens))]
    assert lookup_proposals(tokens, 2, len(tokens), 0) == [None] * (len(tokens) - 2)


@pytest.fixture(scope="module")
def lookup_pack(tmp_path_factory):
    """The shipped pack, with prompt lookup on and a threshold override used by the tests that exit."""
    pack = read_pack(SHIPPED_PACK)
    path = tmp_path_factory.mktemp("lookup") / "lookup.specee.gguf"
    write_pack(path, dataclasses.replace(pack, lookup_max_n=4))
    return path


def test_pack_keeps_its_lookup_setting(lookup_pack, tmp_path):
    pack = read_pack(lookup_pack)
    assert pack.lookup_max_n == 4 and read_pack(SHIPPED_PACK).lookup_max_n in (0, 4)
    with pytest.raises(PackError, match="n-grams"):
        write_pack(tmp_path / "bad.specee.gguf", dataclasses.replace(pack, lookup_max_n=9))


def test_in_graph_merge_equals_the_numpy_merge(default_model):
    """With float32 matrices the graph's draft equals numpy's exactly, so the merged candidates must too:
    the lookup token first, then the draft's best others (a lookup token the draft also proposes is not
    repeated; one outside the draft vocabulary is taken as it is)."""
    pack = read_pack(SHIPPED_PACK)
    draft = LinearDraft(dataclasses.replace(pack.draft, quant="f32"), TargetWeights(default_model.info.path), pack.k)
    outside = int(np.setdiff1d(np.arange(default_model.info.n_vocab), draft.vocab_map)[7])
    last = default_model.info.n_layer - 1
    ctx = context_with_draft(default_model, draft)
    ctx.set_capture_layers([last])
    ctx.decode(default_model.tokenize(CHAT_PROMPT))
    hidden, token = ctx.captured(last)[-1], int(np.argmax(ctx.logits()))
    for step in range(24):
        scores = draft.scores(draft.embedding(token), hidden)
        lookup = [-1, int(draft.top_k(scores)[1]), outside][step % 3]
        ctx.set_lookup([] if lookup < 0 else [lookup])
        ctx.decode([token])
        expected = draft.merged_top_k(scores[None], np.array([lookup]))[0]
        assert list(ctx.step_info().candidates) == expected.tolist()
        assert len(set(expected.tolist())) == draft.k
        hidden, token = ctx.captured(last)[-1], int(np.argmax(ctx.logits()))
    ctx.close()


def test_set_lookup_refuses_bad_ids_and_lasts_one_token(default_model):
    pack = read_pack(SHIPPED_PACK)
    draft = LinearDraft(pack.draft, TargetWeights(default_model.info.path), pack.k)
    ctx = Context(default_model, n_ctx=128)
    ctx.enable_early_exit(draft.k, "fill")
    with pytest.raises(SpecEEError, match="draft head"):  # nothing to merge with yet
        ctx.set_lookup([5])
    ctx.close()
    ctx = context_with_draft(default_model, draft, n_ctx=128)
    for bad in ([5, 5], [1, 2, 3, 4, 5], [-1], [default_model.info.n_vocab]):
        with pytest.raises(SpecEEError, match="distinct ids"):
            ctx.set_lookup(bad)
    tokens = default_model.tokenize(CHAT_PROMPT)

    def last_step(lookup: list[int] | None = None) -> tuple[int, ...]:
        """The last prompt token as a single-token step; the batch before it sets the draft's h_prev."""
        ctx.truncate(0)
        ctx.decode(tokens[:-1])
        if lookup is not None:
            ctx.set_lookup(lookup)
        ctx.decode(tokens[-1:])
        return ctx.step_info().candidates

    plain = last_step()
    assert last_step([42])[0] == 42 and last_step([42])[1:] == plain[:-1]
    assert last_step() == plain  # the lookup was for one token only
    ctx.close()


def test_engine_lookup_follows_its_cache_across_turns_regen_clear_and_interruptions(default_model, lookup_pack):
    engine = Engine(default_model.info.path, pack=lookup_pack, config=EngineConfig(n_ctx=1024, n_threads=2, threshold=0.5))
    n_vocab, k = default_model.info.n_vocab, engine.policy.k
    proposals = exits = 0

    def reply(messages: list[dict], max_tokens: int, stop_after: int | None = None) -> None:
        nonlocal proposals, exits
        stream = engine.stream_chat(messages, max_tokens=max_tokens, sampling=GREEDY)
        ids = []
        for n, record in enumerate(stream):
            ids.append(record.id)
            if n and record.draft_hit is not None:  # a single-token step: its lookup and candidates
                context = engine.cached_tokens
                assert engine.policy.lookup == scan(context, 4)
                candidates = engine.policy.candidates
                assert len(set(candidates)) == k and all(0 <= c < n_vocab for c in candidates)
                if engine.policy.lookup is not None:
                    assert candidates[0] == engine.policy.lookup
                    proposals += 1
                exits += record.exit_layer is not None
            if stop_after is not None and n == stop_after:
                stream.close()  # as Ctrl+C or a closed stream leaves it
                break
        # the cache holds the prompt and every token but the last sampled one (never decoded), stopped or not
        prompt = engine.tokenize(engine.format_chat(messages))
        assert engine.cached_tokens == prompt + ids[:-1] and len(engine.cached_tokens) == engine.ctx.n_past
        assert engine._history.propose() == scan(engine.cached_tokens, 4)

    question = [{"role": "user", "content": "List three fruits, then list the same three fruits again."}]
    reply(question, 48)
    reply(question, 48)                       # /regen: the same prompt again, the reply truncated away
    reply(question, 40, stop_after=12)        # interrupted
    follow_up = question + [{"role": "assistant", "content": "Apples, pears, plums."},
                            {"role": "user", "content": "And again, please."}]
    reply(follow_up, 32)                      # the next turn extends the cache
    engine.reset()                            # /clear
    assert engine.cached_tokens == [] and engine._history.propose() is None
    reply(question, 24)
    engine.close()
    assert proposals > 20 and exits > 0


@pytest.mark.parametrize("eog, expected", [(frozenset(), [3, 9, 4, 5]), (frozenset({9, 2}), [3, 9]),
                                           (frozenset({5}), [3, 9, 4, 5]), (frozenset({3}), [3])])
def test_lookup_drafts_end_at_the_first_end_of_generation(eog, expected):
    """Drafts copied past an end-of-generation token are cut after it (nothing is decoded past one); the index is
    left as it was."""
    index = PromptLookup(8)
    index.extend([1, 2, 3, 9, 4, 5, 7, 1])
    assert lookup_drafts(index, 2, 4, eog) == Continuation(expected, 2)
    assert lookup_drafts(index, 2, 0, eog) == Continuation([], 0)  # a round that may check no drafts is offered none
    assert index.tokens == [1, 2, 3, 9, 4, 5, 7, 1]
