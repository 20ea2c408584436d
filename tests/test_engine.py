"""The engine on the default model with the shipped pack: baseline identity, exits, quality, API."""

from __future__ import annotations

import numpy as np
import pytest
from llama_cpp import Llama

from specee_edge.engine import GREEDY, Engine, EngineConfig, SamplingParams
from specee_edge.engine.exit import SHIPPED_PACKS, find_pack
from specee_edge.engine.sampling import Sampler, masks_every_token, token_logprobs
from specee_edge.engine.stops import StopMatcher
from specee_edge.errors import ContextFullError, SpecEEError
from specee_edge.exits import ExitKind
from specee_edge.pack import PackMismatchError, read_pack, write_pack
from specee_edge.runtime import Context
from tests.conftest import CHAT_PROMPT, exiting_quality

SHIPPED_PACK = SHIPPED_PACKS / "SmolLM2-135M-Instruct.Q4_1.specee.gguf"
QUESTIONS = [
    "Explain in a few sentences how a rainbow forms.",
    "Write a Python function that returns the factorial of n.",
    "List three tips for staying focused while studying.",
]
# The highest level that exits. Calibration measured its agreement through the engine on prompts its
# exits were not chosen on (approximate K/V included); three answers of ~96 tokens here are a small
# sample (a standard error of ~0.02 at 0.9), so the floor is the low end of the stored 95% interval less
# 2.5 of those. It still fails when the predictors, the exit rule or the KV handling break: at this level
# most tokens exit, and untrained predictors agree ~0.6-0.8.
EXIT_QUALITY = exiting_quality()
EXIT_LEVEL = next(level for level in read_pack(SHIPPED_PACKS / "SmolLM2-135M-Instruct.Q4_1.specee.gguf").levels
                  if level.quality == EXIT_QUALITY)
AGREEMENT_FLOOR = EXIT_LEVEL.agreement_interval()[0] - 0.05


@pytest.fixture(scope="module")
def engine(default_model) -> Engine:
    assert SHIPPED_PACK.is_file(), "the default model's pack must be shipped in models/"
    return Engine(default_model.info.path, config=EngineConfig(n_ctx=1024, n_threads=2))


def chat_tokens(engine: Engine, question: str) -> list[int]:
    return engine.tokenize(engine.format_chat([{"role": "user", "content": question}]))


def full_model_argmax(engine: Engine, prompt: list[int], generated: list[int]) -> list[int]:
    """Teacher forcing: the full model's argmax after the prompt and after each generated token.

    Token by token, as generation decodes: a batched pass over the same tokens takes other matmul
    kernels and disagrees with sequential greedy decoding on ~4% of near-tie steps by itself.
    """
    ctx = Context(engine.model, n_ctx=1024)
    ctx.decode(prompt)
    argmax = [int(np.argmax(ctx.logits()))]
    for token in generated[:-1]:
        ctx.decode([token])
        argmax.append(int(np.argmax(ctx.logits())))
    return argmax


def test_pack_is_found_beside_or_shipped(engine, tmp_path):
    assert find_pack(engine.model.info.path) == SHIPPED_PACK
    assert engine.policy is not None and engine.early_exit
    model = tmp_path / engine.model.info.path.name
    model.symlink_to(engine.model.info.path)
    assert find_pack(model) == SHIPPED_PACK  # by the file's name
    beside = tmp_path / SHIPPED_PACK.name
    beside.write_bytes(b"")
    assert find_pack(model) == beside  # a pack beside the model comes first
    assert find_pack(tmp_path / "other.gguf") is None


def test_early_exit_off_matches_stock_llama(engine, default_model):
    prompt = default_model.tokenize(CHAT_PROMPT)
    llm = Llama(model_path=str(default_model.info.path), n_ctx=512, n_threads=2, flash_attn=True, verbose=False)
    stock = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        stock.append(token)
        if len(stock) == 48 or default_model.is_eog(token):
            break
    engine.set_early_exit(False)
    try:
        engine.reset()
        ours = engine.generate(prompt, max_tokens=48, sampling=GREEDY)
    finally:
        engine.set_early_exit(True)
    assert ours.tokens == stock
    assert ours.stats.exit_rate == 0.0 and ours.stats.avg_exit_layer == engine.n_layer - 1


def test_a_seed_samples_the_tokens_stock_llama_samples(engine, default_model):
    """llama.cpp's own sampler chain: with early exit off, chat's default sampling and a seed draw the reply
    llama-cpp-python's Llama draws with the same settings and seed (and the same attention kernels: the engine's
    flash attention is auto, on on the CPU)."""
    prompt = default_model.tokenize(CHAT_PROMPT)
    llm = Llama(model_path=str(default_model.info.path), n_ctx=512, n_threads=2, flash_attn=True, verbose=False)
    engine.set_early_exit(False)
    try:
        for seed in (1, 2, 3):
            llm.set_seed(seed)
            stock = []
            for token in llm.generate(prompt, temp=0.8, top_k=40, top_p=0.95, min_p=0.05, reset=True):
                stock.append(token)
                if len(stock) == 32 or default_model.is_eog(token):
                    break
            engine.reset()
            assert engine.generate(prompt, max_tokens=32, sampling=SamplingParams(seed=seed)).tokens == stock, seed
    finally:
        engine.set_early_exit(True)
        llm.close()


def test_exits_happen_and_agree_with_the_full_model(engine):
    engine.set_quality(EXIT_QUALITY)
    agree = total = exits = 0
    for question in QUESTIONS:
        engine.reset()
        prompt = chat_tokens(engine, question)
        out = engine.generate(prompt, max_tokens=96, sampling=GREEDY)
        stats = out.stats
        assert stats.predictor_calls_per_token > 0
        exits += stats.exits
        reference = full_model_argmax(engine, prompt, out.tokens)
        agree += sum(a == b for a, b in zip(out.tokens, reference))
        total += len(out.tokens)
    engine.set_quality(None)
    assert exits >= EXIT_LEVEL.exit_rate / 2 * total  # exits are a large share, so wrong ones would show
    assert agree / total >= AGREEMENT_FLOOR, f"agreement {agree / total:.3f}"


def test_stats_names_and_ranges(engine):
    engine.reset()
    engine.generate(chat_tokens(engine, QUESTIONS[0]), max_tokens=32, sampling=GREEDY)
    s = engine.stats.summary()
    for key in ("prompt_tok_s", "decode_tok_s", "avg_exit_layer", "exit_rate", "predictor_calls_per_token",
                "verify_fail_rate", "draft_recall_at_k"):
        assert key in s
    assert 0 <= s["exit_rate"] <= 1 and 0 <= s["draft_recall_at_k"] <= 1
    assert s["avg_exit_layer"] <= engine.n_layer - 1
    assert s["decode_tok_s"] > 0 and s["prompt_tok_s"] > 0


def test_seed_reproduces_sampled_text(engine):
    params = SamplingParams(temperature=0.9, seed=1234)
    runs = []
    for _ in range(2):
        engine.reset()
        runs.append(engine.generate(CHAT_PROMPT, max_tokens=24, sampling=params).tokens)
    assert runs[0] == runs[1]
    engine.reset()
    other = engine.generate(CHAT_PROMPT, max_tokens=24, sampling=SamplingParams(temperature=0.9, seed=99)).tokens
    assert other != runs[0]


def test_stop_string_ends_the_reply_without_it(engine):
    engine.reset()
    full = engine.generate(CHAT_PROMPT, max_tokens=32, sampling=GREEDY).text
    stop = full.split()[3]  # a word from the middle of the greedy answer
    engine.reset()
    out = engine.generate(CHAT_PROMPT, max_tokens=32, sampling=GREEDY, stop=[stop])
    assert out.stats.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]


def test_closed_stream_leaves_the_engine_usable(engine):
    engine.reset()
    expected = engine.generate(CHAT_PROMPT, max_tokens=24, sampling=GREEDY).tokens
    stream = engine.stream(CHAT_PROMPT, max_tokens=24, sampling=GREEDY)
    for _ in range(5):
        next(stream)
    stream.close()
    assert engine.stats.finish_reason == "interrupted"
    assert engine.generate(CHAT_PROMPT, max_tokens=24, sampling=GREEDY).tokens == expected

    stream = engine.stream(CHAT_PROMPT, max_tokens=24, sampling=GREEDY)
    next(stream)
    with pytest.raises(KeyboardInterrupt):
        stream.throw(KeyboardInterrupt)
    assert engine.ctx.n_past == len(engine.cached_tokens)
    assert engine.generate(CHAT_PROMPT, max_tokens=24, sampling=GREEDY).tokens == expected


def test_next_turn_reuses_the_cache(engine, monkeypatch):
    """The second turn decodes only what the cache lacks: the tokens the context is given are counted."""
    engine.reset()
    messages = [{"role": "user", "content": "Name a colour."}]
    first_prompt = chat_tokens(engine, messages[0]["content"])
    first = engine.generate(first_prompt, max_tokens=16, sampling=GREEDY)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And another one?"}]
    prompt = engine.tokenize(engine.format_chat(messages))
    cached = list(engine.cached_tokens)
    n_common = next((i for i, (a, b) in enumerate(zip(cached, prompt)) if a != b), min(len(cached), len(prompt)))
    assert n_common >= len(first_prompt)  # the first turn's prompt at least is in the cache

    decoded: list[int] = []
    decode = engine.ctx.decode

    def counting_decode(tokens, **kwargs):
        decoded.extend(tokens)
        return decode(tokens, **kwargs)

    monkeypatch.setattr(engine.ctx, "decode", counting_decode)
    engine.set_early_exit(False)  # one token a step: every decoded token is accounted for (rounds: test_exact.py)
    try:
        second = engine.generate(prompt, max_tokens=16, sampling=GREEDY)
    finally:
        engine.set_early_exit(True)
    # what the cache lacked, then each generated token but the last (which is never fed back), and nothing else
    assert decoded == prompt[n_common:] + second.tokens[:-1]
    assert engine.cached_tokens == prompt + second.tokens[:-1]


def first_approximate_position(prompt: list[int], records, n_layer: int) -> int | None:
    """The cache position of the first token whose step left before the last layer (its cell's upper layers
    filled or masked)."""
    return next((len(prompt) + i - 1 for i, r in enumerate(records)
                 if r.exit_layer is not None and r.exit_layer < n_layer - 1), None)


def test_a_next_turn_reuses_only_the_cells_computed_in_full(default_model):
    """A reply decoded at an exiting level leaves cells whose upper layers were masked (or filled): the next turn
    decodes again from the first of them, so its K/V are what a fresh request would compute."""
    # a low threshold everywhere: the shipped level leaves at the last layer only, which skips no layer
    engine = Engine(default_model.info.path, config=EngineConfig(n_ctx=1024, n_threads=2, kv_mode="mask", threshold=0.2))
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    first_prompt = chat_tokens(engine, QUESTIONS[0])
    records = list(engine.stream(first_prompt, max_tokens=48, sampling=GREEDY))
    shallow = first_approximate_position(first_prompt, records, engine.n_layer)
    assert shallow is not None and engine.ctx.cell_depth(shallow) < engine.n_layer - 1
    messages += [{"role": "assistant", "content": "".join(r.text for r in records)}, {"role": "user", "content": "Shorter?"}]
    prompt = engine.tokenize(engine.format_chat(messages))
    list(engine.stream(prompt, max_tokens=1, sampling=GREEDY))  # the prompt's logits only: no step yet
    assert len(first_prompt) <= engine.stats.n_cached <= shallow
    assert [engine.ctx.cell_depth(pos) for pos in range(len(prompt))] == [engine.n_layer - 1] * len(prompt)
    engine.close()


def test_a_prompt_with_a_bos_of_its_own_gets_no_second(tiny_dir):
    from specee_edge.chat_templates import named_template
    from tests.conftest import tiny_model_path
    from tests.tiny_gguf import BOS_ID

    engine = Engine(tiny_model_path(tiny_dir, "llama"), pack=None, config=EngineConfig(n_ctx=128, n_threads=1))
    assert engine.model.adds_bos  # the tiny model asks for a BOS, as Gemma and Llama 3 do
    text = engine.format_chat([{"role": "user", "content": "hi"}], named_template("llama3"))  # writes {{ bos_token }}
    tokens = engine.tokenize(text)
    assert tokens[0] == BOS_ID and tokens[1] != BOS_ID
    assert engine.tokenize("hi")[0] == BOS_ID  # a prompt without one still gets it
    engine.close()


def test_a_prefill_can_be_cancelled_between_batches(default_model):
    engine = Engine(default_model.info.path, config=EngineConfig(n_ctx=512, n_batch=32, n_threads=2))
    prompt = engine.tokenize("word " * 100)
    asked: list[int] = []

    def cancel() -> bool:
        asked.append(engine.ctx.n_past)
        return len(asked) == 2  # after the second batch

    assert list(engine.stream(prompt, max_tokens=8, sampling=GREEDY, cancel=cancel)) == []
    assert engine.stats.finish_reason == "interrupted" and asked == [32, 64]
    assert engine.cached_tokens == prompt[:64]  # what was decoded stays, consistently
    out = engine.generate(prompt, max_tokens=4, sampling=GREEDY)
    assert out.stats.n_cached == 64 and len(out.tokens) == 4
    engine.close()


def test_logit_bias_and_logprobs_at_head_free_exits(engine):
    """A bias that bans every candidate of a head-free exit falls back to the exit layer's full head; logprobs
    always come from a full head, never from the 4 candidates alone."""
    engine.set_quality(EXIT_QUALITY)
    try:
        engine.reset()
        banned = {int(t): -np.inf for t in engine.policy.pack.draft.vocab_map if not engine.model.is_eog(int(t))}
        prompt = chat_tokens(engine, QUESTIONS[0])
        records = list(engine.stream(prompt, max_tokens=24, sampling=SamplingParams(temperature=0.0, logit_bias=banned),
                                     logprobs=3))
        assert not any(r.id in banned for r in records)
        engine.reset()
        records = list(engine.stream(prompt, max_tokens=24, sampling=GREEDY, logprobs=8))
        assert any(r.exit_kind == ExitKind.HEAD_FREE for r in records)
        for r in records:
            # eight finite log-probabilities: the candidates' logits alone would give four and -inf
            assert len(r.logprobs.top) == 8 and np.isfinite([r.logprobs.logprob, *(lp for _, lp in r.logprobs.top)]).all()
            assert sum(np.exp(lp) for _, lp in r.logprobs.top) <= 1.0 + 1e-6
            if r.exit_layer is None:  # greedy through every layer: the token is the most likely one
                assert r.logprobs.top[0][0] == r.id
    finally:
        engine.set_quality(None)


def test_full_context(default_model):
    engine = Engine(default_model.info.path, config=EngineConfig(n_ctx=256, n_threads=2))
    with pytest.raises(ContextFullError, match="does not fit"):
        engine.generate("word " * 400, max_tokens=4)
    engine.reset()
    prompt = engine.tokenize("word " * 240)
    out = engine.generate(prompt, max_tokens=64, sampling=GREEDY)
    assert out.stats.finish_reason in ("context", "stop")
    assert engine.ctx.n_past <= engine.ctx.n_ctx


def test_pack_for_another_model_is_refused(tiny_dir):
    from tests.conftest import tiny_model_path

    tiny = tiny_model_path(tiny_dir, "llama")
    with pytest.raises(PackMismatchError, match="made for another model"):
        Engine(tiny, pack=SHIPPED_PACK)


def test_a_pack_whose_draft_cannot_end_a_reply_is_refused(default_model, tmp_path):
    pack = read_pack(SHIPPED_PACK)
    eog = default_model.eog_tokens()
    unused = iter(sorted(set(range(default_model.info.n_vocab)) - set(pack.draft.vocab_map.tolist())))
    pack.draft.vocab_map = np.array([next(unused) if t in eog else t for t in pack.draft.vocab_map.tolist()])
    path = write_pack(tmp_path / "no-eos.specee.gguf", pack, draft_quant=pack.draft.quant)
    with pytest.raises(SpecEEError, match=r"lacks the model's end-of-generation tokens \[0, 2"):
        Engine(default_model.info.path, pack=path)


def draws(params: SamplingParams, logits, n: int = 1, history=()) -> set[int]:
    """The tokens n draws of llama.cpp's chain take from `logits` (one sampler, each draw accepted)."""
    sampler = Sampler(params, len(logits), history)
    try:
        return {sampler(np.asarray(logits, dtype=np.float32)) for _ in range(n)}
    finally:
        sampler.close()


def test_sampling_filters():
    logits = [5.0, 4.9, 1.0, -3.0]
    assert draws(GREEDY, logits) == {0}
    assert draws(SamplingParams(temperature=1.0, top_k=1, seed=1), logits, 20) == {0}
    assert draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5, seed=1), logits, 50) == {0, 1}
    # a seed draws the same tokens again
    seeded = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    runs = [Sampler(seeded, 4) for _ in range(2)]
    assert [runs[0](np.float32(logits)) for _ in range(30)] == [runs[1](np.float32(logits)) for _ in range(30)]


def test_penalties_and_logit_bias_follow_llama_cpp():
    logits = [2.0, 1.2, 0.5, -1.0]
    greedy = lambda **kw: SamplingParams(temperature=0.0, **kw)
    # a repeated token is divided by the repeat penalty (2 / 2 < 1.2); a negative one multiplied
    assert draws(greedy(repeat_penalty=2.0), logits, history=[0]) == {1}
    assert draws(greedy(repeat_penalty=2.0), [-1.0, -1.5, -3.0, -4.0], history=[0]) == {1}
    # count * frequency + presence: token 0 seen twice loses 2 * 0.25 + 0.5 = 1.0 (1.0 < 1.2)
    assert draws(greedy(frequency_penalty=0.25, presence_penalty=0.5), logits, history=[0, 0]) == {1}
    assert draws(greedy(frequency_penalty=0.25, presence_penalty=0.5), logits, history=[0]) == {0}  # 1.25 > 1.2
    assert draws(greedy(presence_penalty=1.0, repeat_last_n=1), logits, history=[0, 2]) == {0}  # 0 is out of the window
    # the chain accepts what it draws: a greedy draw penalized repeats no more
    assert len(draws(greedy(repeat_penalty=10.0), logits, n=3)) == 3
    assert draws(greedy(logit_bias={2: 5.0}), logits) == {2}
    assert draws(greedy(logit_bias={0: -np.inf}), logits) == {1}
    head_free = np.full(4, -np.inf, np.float32)
    head_free[[0, 3]] = [1.0, 0.5]  # a head-free exit's logits: the candidates' only
    assert draws(SamplingParams(seed=1), head_free, 20) <= {0, 3}
    assert masks_every_token(head_free, SamplingParams(logit_bias={0: -np.inf, 3: -np.inf}))
    assert not masks_every_token(head_free, SamplingParams(logit_bias={0: -np.inf}))
    with pytest.raises(SpecEEError, match="bans every token"):
        draws(SamplingParams(logit_bias={0: -np.inf, 3: -np.inf}), head_free)


def test_logprobs_are_the_full_distribution():
    logits = np.array([2.0, 1.0, 0.0, -30.0], dtype=np.float32)
    lp = token_logprobs(logits, 1, 2)
    expected = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    assert lp.logprob == pytest.approx(expected[1])
    assert [t for t, _ in lp.top] == [0, 1] and lp.top[0][1] == pytest.approx(expected[0])
    assert token_logprobs(logits, 3, 0).top == [] and np.isfinite(token_logprobs(logits, 3, 0).logprob)


def _naive_stops(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """What a stop matcher must show: the text up to the first stop string to end, or all of it."""
    text = ""
    for piece in pieces:
        for i in range(len(piece)):
            text += piece[i]
            ends = [len(text) - len(s) for s in stops if text.endswith(s)]
            if ends:
                return text[: min(ends)], True
    return text, False


def test_stop_matcher_agrees_with_a_naive_search():
    rng = np.random.default_rng(3)
    for _ in range(300):
        stops = ["".join(rng.choice(list("ab#"), rng.integers(1, 6))) for _ in range(rng.integers(0, 4))]  # none too
        pieces = ["".join(rng.choice(list("ab#c"), rng.integers(0, 5))) for _ in range(rng.integers(1, 12))]
        m, shown, stopped = StopMatcher(stops), "", False
        for piece in pieces:
            text, stopped = m.feed(piece)
            shown += text
            if stopped:
                break
        if not stopped:
            shown += m.flush()
        assert (shown, stopped) == _naive_stops(stops, pieces), (stops, pieces)


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["</s>"])
    assert m.feed("Hello <") == ("Hello ", False)
    assert m.feed("/s") == ("", False)
    assert m.feed("> tail") == ("", True)
    m = StopMatcher(["###"])
    assert m.feed("a #") == ("a ", False)
    assert m.feed("b") == ("#b", False)


def test_bad_arguments_are_one_line_errors(engine):
    with pytest.raises(SpecEEError, match="max_tokens"):
        engine.generate(CHAT_PROMPT, max_tokens=0)
    with pytest.raises(SpecEEError, match="empty"):
        engine.generate([], max_tokens=4)
    assert engine.generate(CHAT_PROMPT, max_tokens=4, sampling=GREEDY).tokens


def test_early_exit_can_be_switched_mid_conversation(engine):
    engine.reset()
    engine.set_quality(EXIT_QUALITY)  # a level with layers on
    messages = [{"role": "user", "content": "Name a fruit."}]
    engine.set_early_exit(False)
    try:
        first = engine.chat(messages, max_tokens=12, sampling=GREEDY)
    finally:
        engine.set_early_exit(True)
    assert first.stats.predictor_calls_per_token == 0
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And a vegetable?"}]
    second = engine.chat(messages, max_tokens=12, sampling=GREEDY)
    engine.set_quality(None)
    assert second.stats.predictor_calls_per_token > 0
