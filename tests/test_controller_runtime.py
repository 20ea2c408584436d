"""Exact mode's controller on the real runtime: it backs off where batches are dear and drafts where plain steps
are, on the default model without a pack (prompt-lookup drafts, what any GGUF gets) and with its pack.

`tests.conftest.slowed` makes each decode of several tokens, or of one, take that many times as
long, as on a machine where it costs that much more: the controller must see it in what it measures and choose
accordingly. The assertions are on its choices, not on timings.
"""

from __future__ import annotations

import pytest

from specee_edge.bench.quality import NEAR_TIE, divergence_margins
from specee_edge.engine import GREEDY, Engine, EngineConfig, SamplingParams
from specee_edge.engine.controller import EXPLORE_SHARE, Choice
from specee_edge.engine.records import TokenSource
from specee_edge.runtime import Context
from tests.conftest import slowed
from tests.test_exact import assert_cache_holds_the_reply, exact_pack, prompt_of  # noqa: F401 (a fixture)

# an edit: the answer copies most of the prompt, where lookup drafts are right
EDIT = ("Rename the variable `tmp` to `total` everywhere in this function and return the whole function:\n\n"
        "def order_total(items, tax_rate):\n    tmp = 0.0\n    for item in items:\n        tmp += item.price * item.quantity\n"
        "    if tmp > 100:\n        tmp = tmp * 0.95\n    tmp = tmp * (1 + tax_rate)\n    return round(tmp, 2)\n")
# a list the model knows: nothing to copy, and exits at layers that draft it right (5 to 8 of 24 exit drafts
# accepted, with flash attention on or off)
PLANETS = "Name the planets of the solar system in order."
SAMPLED = SamplingParams(seed=3)


def engine_on(model_path, knob: str | None, factor: float, pack=None) -> Engine:
    """An engine whose steps or batches (knob) cost ``factor`` times as much, with or without a pack."""
    engine = Engine(model_path, pack=pack, config=EngineConfig(n_ctx=1024, n_threads=2))
    return slowed(engine, **{knob: factor}) if knob else engine


def answer(engine: Engine, sampling: SamplingParams, n: int = 64, question: str = EDIT):
    prompt = prompt_of(engine, question)
    records = list(engine.stream(prompt, max_tokens=n, sampling=sampling))
    assert_cache_holds_the_reply(engine, prompt, [r.id for r in records])
    engine.reset()
    return records, engine.stats


@pytest.fixture(scope="module")
def dear_batches(default_model) -> Engine:
    engine = engine_on(default_model.info.path, "batch", 3.0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def dear_steps(default_model) -> Engine:
    engine = engine_on(default_model.info.path, "step", 4.0)
    yield engine
    engine.close()


def test_without_a_pack_exact_mode_drafts_by_lookup(dear_steps):
    assert dear_steps.policy is None and dear_steps.exact and not dear_steps.early_exit
    records, stats = answer(dear_steps, GREEDY)
    assert stats.lookup_rounds > 0 and stats.lookup_rounds == stats.rounds  # no exits without a pack
    assert stats.exits == 0 and all(r.exit_layer is None for r in records)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_dear_plain_steps_make_it_draft(dear_steps, sampling):
    _, stats = answer(dear_steps, sampling)
    shares = stats.choice_shares()
    assert shares["lookup"] > 0.3, (shares, stats.controller)
    assert stats.controller["batch_ms"] and stats.mean_drafts >= 1


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_dear_batches_make_it_decode_plainly(dear_batches, sampling):
    """Batches three times as dear as here: after its first try, nearly every token is a plain step, and what
    exploring costs stays within its budget (EXPLORE_SHARE of the request's time; a point for timing noise)."""
    answer(dear_batches, sampling)  # a first request learns what batches cost on this "machine"
    _, stats = answer(dear_batches, sampling)
    shares = stats.choice_shares()
    assert shares["plain"] >= 0.9, (shares, stats.controller)
    plain_ms = stats.controller["plain_ms"]
    assert stats.explore_ms <= (EXPLORE_SHARE + 0.01) * plain_ms * stats.n_decode, (stats.explore_ms, plain_ms)


def test_the_controller_keeps_the_answer_exact(default_model, dear_steps):
    """Whatever it chooses, greedy exact mode answers what vanilla answers, up to near-ties (batches and single
    steps run other kernels)."""
    records, stats = answer(dear_steps, GREEDY, n=48)
    assert stats.rounds > 0
    dear_steps.set_early_exit(False)
    try:
        plain, _ = answer(dear_steps, GREEDY, n=48)
    finally:
        dear_steps.set_early_exit(True)
    prompt = prompt_of(dear_steps, EDIT)
    reference = Context(dear_steps.model, n_ctx=1024, n_threads=2)
    margins = divergence_margins(reference, [prompt], [[r.id for r in plain]], [[r.id for r in records]])
    reference.close()
    assert all(margin < NEAR_TIE for margin in margins), margins


def test_the_pack_adds_exit_drafts_priced_like_the_rest(default_model, exact_pack):
    """With an exact level whose exits draft (head-free exits on every predictor layer; the shipped pack's exact
    level drafts by lookup alone), exit-draft rounds are a choice beside lookup rounds and plain steps: one runs and
    is verified, its drafting steps are priced, and its records name the layer the draft left at and count no
    early exit."""
    engine = engine_on(default_model.info.path, "step", 4.0, pack=exact_pack)
    try:
        assert engine.exact and engine.early_exit
        # the edit's answer copies its prompt: lookup drafts win there, and its few exit drafts may all be rejected
        records, stats = answer(engine, GREEDY, question=PLANETS)
        assert stats.rounds > 0 and stats.exits == 0
        exit_rounds = [r.round for r in records if r.round is not None and r.round.choice == Choice.EXIT]
        assert any(r.drafts for r in exit_rounds), (stats.tokens_by_choice, stats.controller)  # one drafted and verified
        assert stats.controller["draft_step_ms"] is not None  # ... and its drafting steps priced the next ones
        assert all(r.exit_layer is None for r in records)
        assert all(r.draft_layer is None for r in records if r.source != TokenSource.ACCEPTED)
        assert any(r.draft_layer is not None for r in records if r.round in exit_rounds)
    finally:
        engine.close()
