"""Head-free exits, graph rebuilds and the early-exit state's edges, on tiny random-weight models.

A tiny model's draft and predictors are random here: what is tested is what the runtime does with a
decision (which logits the step returns, which heads run, what the next graph holds), not how good the
decisions are.
"""

from __future__ import annotations

import ctypes
import gc
import weakref

import numpy as np
import pytest

from specee_edge.archs import ARCHS
from specee_edge.errors import SpecEEError
from specee_edge.exits import ExitKind
from specee_edge.runtime import Context, Model
from specee_edge.runtime._bindings import C, Decision
from specee_edge.runtime.context import GraphInfo
from tests.conftest import supported_model_path, tiny_model_path

K = 4
PROMPT = [1, 5, 9, 14, 3, 7, 2, 11]


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> Model:
    return Model(tiny_model_path(tiny_dir, "llama"))


def random_draft(model: Model, seed: int = 0, vocab: int = 64) -> dict:
    rng = np.random.default_rng(seed)
    d = model.info.n_embd
    return dict(w_embd=rng.normal(0, 0.1, (d, d)), w_hidden=rng.normal(0, 0.1, (d, d)), bias=np.zeros(d),
                norm=np.ones(d), eps=1e-5, head=rng.normal(0, 0.1, (vocab, d)),
                vocab_map=rng.choice(model.info.n_vocab, vocab, replace=False), quant="f32")


def always(model: Model, ctx: Context, layers: list[int], kind: ExitKind) -> None:
    """Predictors on `layers` that always fire (a sigmoid is above 0), leaving as `kind`."""
    weights = [np.zeros((8, 3 * K), np.float32), np.zeros((1, 8), np.float32)]
    biases = [np.zeros(8, np.float32), np.full(1, 5.0, np.float32)]
    for il in layers:
        ctx.set_predictor(il, weights, biases)
        ctx.set_exit(il, kind, 0.0)
    ctx.set_probe_layers(layers)


def drafted_context(model: Model, kv_mode: str = "fill", **kwargs) -> Context:
    ctx = Context(model, n_threads=1, n_ctx=64, **kwargs)
    ctx.enable_early_exit(K, kv_mode)
    ctx.set_draft(**random_draft(model))
    return ctx


def test_a_head_free_exit_returns_the_candidates_logits_and_runs_no_head(tiny):
    ctx = drafted_context(tiny)
    n_layer = tiny.info.n_layer
    always(tiny, ctx, [1], ExitKind.HEAD_FREE)
    ctx.decode(PROMPT)
    ctx.decode([4])
    step = ctx.step_info()
    assert (step.exit_layer, step.exit_kind, step.heads) == (1, ExitKind.HEAD_FREE, 0)
    logits = ctx.logits()
    finite = np.flatnonzero(np.isfinite(logits))
    assert sorted(finite.tolist()) == sorted(step.candidates) and len(finite) == K
    full = ctx.exit_head_logits()  # the exit layer's full head, on demand
    assert np.isfinite(full).all() and ctx.step_info().heads == 1
    # the candidates' logits are what the full head gives them (the probe reads the same rows)
    np.testing.assert_allclose(logits[finite], full[finite], rtol=1e-3, atol=1e-3)
    assert ctx.cell_depth(len(PROMPT)) == n_layer - 1  # fill: the skipped layers' K/V were written
    ctx.close()


def test_the_last_layers_check_skips_the_output_head(tiny):
    n_layer = tiny.info.n_layer
    plain = Context(tiny, n_threads=1, n_ctx=64)
    plain.decode(PROMPT)
    plain.decode([4])
    reference = plain.logits().copy()
    ctx = drafted_context(tiny)
    always(tiny, ctx, [n_layer - 1], ExitKind.HEAD_FREE)
    ctx.decode(PROMPT)
    ctx.decode([4])
    step = ctx.step_info()
    assert (step.exit_layer, step.exit_kind, step.heads) == (n_layer - 1, ExitKind.HEAD_FREE, 0)
    assert ctx.cell_depth(len(PROMPT)) == n_layer - 1  # every layer ran: nothing to fill or mask
    candidates = list(step.candidates)
    np.testing.assert_allclose(ctx.logits()[candidates], reference[candidates], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(ctx.exit_head_logits(), reference, rtol=1e-4, atol=1e-4)
    with pytest.raises(SpecEEError, match="head-free or off"):
        ctx.set_exit(n_layer - 1, ExitKind.VERIFIED, 0.5)
    plain.close()
    ctx.close()


def test_each_knob_shapes_the_next_graph(tiny):
    """What a graph holds follows every knob at the next decode: exits on and off, a layer's kind, the
    schedule, a new draft head, a shallow cell."""
    n_layer = tiny.info.n_layer
    ctx = Context(tiny, n_threads=1, n_ctx=64)
    ctx.enable_early_exit(K, "mask")
    ctx.decode(PROMPT)

    def graph_after(token: int = 4):
        ctx.decode([token])
        return ctx.step_info().graph

    assert graph_after() == GraphInfo(0, False, False, False)
    ctx.set_draft(**random_draft(tiny))
    always(tiny, ctx, [1, 2], ExitKind.VERIFIED)
    ctx.set_exit(1, ExitKind.VERIFIED, 1.0)  # never fires, but is checked
    ctx.set_exit(2, ExitKind.VERIFIED, 1.0)
    assert graph_after() == GraphInfo(2, True, False, True)
    ctx.set_exit(2, ExitKind.NONE, 1.0)
    assert graph_after().probes == 1
    ctx.set_predictor(n_layer - 1, *predictor_never())
    ctx.set_exit(n_layer - 1, ExitKind.HEAD_FREE, 1.0)
    assert graph_after().probes == 2
    ctx.set_probe_layers([])  # nothing can decide: the stock graph again, no callback
    assert graph_after() == GraphInfo(0, False, False, False)
    ctx.set_probe_layers([1])
    first = graph_after(6)
    ctx.set_draft(**random_draft(tiny, seed=1, vocab=32))  # a new head: the graph must use its tensors
    ctx.decode([6])
    assert set(ctx.step_info().candidates) <= set(random_draft(tiny, seed=1, vocab=32)["vocab_map"].tolist())
    assert first.draft
    ctx.set_exit(1, ExitKind.HEAD_FREE, 0.0)  # a head-free stop in mask mode leaves a shallow cell
    graph_after(6)
    assert graph_after(6).depth_mask
    ctx.close()


def predictor_never():
    return [np.zeros((8, 3 * K), np.float32), np.zeros((1, 8), np.float32)], [np.zeros(8, np.float32), np.zeros(1, np.float32)]


def test_a_prompt_never_exits_even_in_a_one_token_batch(tiny):
    """A prompt of n_batch + 1 tokens: no chunk of one token, and the C side builds no probe into any
    graph of a batch (a one-token ubatch included)."""
    ctx = drafted_context(tiny, kv_mode="mask", n_batch=8)
    always(tiny, ctx, [1], ExitKind.HEAD_FREE)
    assert ctx._chunks(list(range(9))) == [list(range(7)), [7, 8]]
    ctx.decode([*PROMPT, 3])
    assert ctx.exit_layer is None
    assert all(ctx.cell_depth(pos) == tiny.info.n_layer - 1 for pos in range(9))
    ctx.decode([5])  # one llama_decode of one token is a step: it may exit
    assert ctx.exit_layer == 1
    ctx.close()


def test_clear_forgets_the_drafts_previous_hidden_state(tiny):
    """After clear, the first draft reads zeros, as in a fresh context (not the old conversation's state)."""
    def first_candidates(ctx: Context) -> tuple[int, ...]:
        ctx.set_probe_callback(lambda il, z: ExitKind.NONE)
        ctx.set_probe_layers([1])
        ctx.decode([PROMPT[0]])
        return ctx.step_info().candidates

    fresh = drafted_context(tiny)
    expected = first_candidates(fresh)
    used = drafted_context(tiny)
    used.decode(PROMPT)
    used.decode([3])
    used.clear()
    assert first_candidates(used) == expected
    fresh.close()
    used.close()


def test_truncating_a_stopped_token_drops_its_pending_layers_in_full_mode(tiny):
    ctx = Context(tiny, n_threads=1, n_ctx=64)
    ctx.enable_early_exit(K, "full")
    ctx.set_candidates([1, 2, 3, 4])
    ctx.set_probe_callback(lambda il, z: ExitKind.VERIFIED if il == 1 else ExitKind.NONE)
    ctx.set_probe_layers([1])
    ctx.decode(PROMPT)
    ctx.decode([4])
    assert ctx.exit_layer == 1 and ctx.cell_depth(len(PROMPT)) == 1
    ctx.truncate(len(PROMPT))  # the stopped token is gone: the next decode must not complete it
    ctx.set_probe_layers([])
    ctx.decode([6])
    assert ctx.cell_depth(len(PROMPT)) == tiny.info.n_layer - 1 and ctx.n_past == len(PROMPT) + 1
    ctx.close()


def test_steps_without_candidates_report_none(tiny):
    ctx = Context(tiny, n_threads=1, n_ctx=64)
    ctx.enable_early_exit(K, "mask")
    ctx.decode(PROMPT)
    ctx.decode([4])
    assert ctx.step_info().candidates == ()  # not K zeros, which would count token 0 as a hit
    ctx.close()


def test_inputs_are_checked_at_the_c_boundary(tiny):
    ctx = drafted_context(tiny)
    weights, biases = predictor_never()
    with pytest.raises(SpecEEError, match="bias"):
        ctx.set_predictor(1, weights, [np.zeros(7, np.float32), biases[1]])
    with pytest.raises(SpecEEError, match=r"expected \[out, 12\]"):
        ctx.set_predictor(1, [np.zeros((8, 5), np.float32), weights[1]], biases)
    with pytest.raises(SpecEEError, match="no native predictor"):
        ctx.set_exit(2, ExitKind.VERIFIED, 0.5)
    repeated = random_draft(tiny)
    repeated["vocab_map"][5] = repeated["vocab_map"][0]  # one id on two rows of the head
    with pytest.raises(SpecEEError, match="llama_specee_set_draft failed"):
        ctx.set_draft(**repeated)
    layers, logits, verified = (ctypes.c_int32 * 1)(1), (ctypes.c_float * K)(), (ctypes.c_uint8 * 1)(0)
    out = ctypes.byref(Decision())
    assert C["llama_specee_decide"](ctx._ctx, 1, layers, logits, None, out) == -1  # NULL arrays are refused
    assert C["llama_specee_decide"](ctx._ctx, 1, None, logits, verified, out) == -1
    assert C["llama_specee_decide"](ctx._ctx, 1, layers, logits, verified, None) == -1
    assert C["llama_specee_decide"](ctx._ctx, 1, layers, logits, verified, out) == 0
    ctx.close()


def test_a_draft_set_twice_without_a_decode_gets_a_new_graph(tiny):
    """Graph reuse keys the draft head by the set_draft call that made it, not by its tensors' addresses: a
    third head can get the first one's freed addresses back (it did: the reused graph, built for a 64-row
    head, read a 16-row one and ggml aborted)."""
    ctx = drafted_context(tiny, kv_mode="mask")
    always(tiny, ctx, [1], ExitKind.VERIFIED)
    ctx.set_exit(1, ExitKind.VERIFIED, 1.0)  # checked, never leaves: the draft runs in every step's graph
    ctx.decode(PROMPT)
    ctx.decode([4])
    for _ in range(3):
        ctx.set_draft(**random_draft(tiny, seed=1, vocab=32))
        third = random_draft(tiny, seed=2, vocab=16)
        ctx.set_draft(**third)
        ctx.decode([6])
        assert set(ctx.step_info().candidates) <= set(third["vocab_map"].tolist())
        ctx.set_draft(**random_draft(tiny))
        ctx.decode([7])
    ctx.close()


def test_a_new_draft_waits_for_a_full_mode_tokens_remaining_layers(tiny):
    ctx = Context(tiny, n_threads=1, n_ctx=64)
    ctx.enable_early_exit(K, "full")
    ctx.set_draft(**random_draft(tiny))
    always(tiny, ctx, [1], ExitKind.HEAD_FREE)
    ctx.decode(PROMPT)
    ctx.decode([4])
    assert ctx.exit_layer == 1 and ctx.cell_depth(len(PROMPT)) == 1
    ctx.set_draft(**random_draft(tiny, seed=2))  # completes the token first (its graph writes the old h_prev)
    assert ctx.cell_depth(len(PROMPT)) == tiny.info.n_layer - 1
    ctx.set_probe_layers([])
    ctx.decode([5])
    assert np.isfinite(ctx.logits()).all()
    ctx.close()


def test_allocation_failures_fall_back_and_leave_the_context_usable(tiny):
    """An out-of-memory for the exit head rejects the verification (the token goes on); for the fill graph,
    the cell's depth is recorded as in mask mode. Nothing aborts."""
    ctx = drafted_context(tiny)
    always(tiny, ctx, [1], ExitKind.VERIFIED)
    ctx.decode(PROMPT)
    ctx.fail_allocations(1)
    ctx.decode([4])
    assert ctx.exit_layer is None and ctx.step_info().verify_failures == 1
    ctx.set_exit(1, ExitKind.HEAD_FREE, 0.0)
    ctx.fail_allocations(2)  # the head's input (where fill reads the exit state) and then the fill graph
    ctx.decode([5])
    assert ctx.exit_layer == 1 and ctx.cell_depth(len(PROMPT) + 1) == 1  # masked instead of filled
    ctx.decode([6])  # usable: the next token attends around the shallow cell
    assert np.isfinite(ctx.logits()[list(ctx.step_info().candidates)]).all()
    ctx.close()


def test_a_closed_context_is_freed_at_once(tiny):
    """No reference cycle keeps a context (and its llama_context) alive until the garbage collector runs."""
    gc.disable()
    try:
        ctx = drafted_context(tiny)
        ctx.set_probe_callback(lambda il, z: ExitKind.NONE)
        ref = weakref.ref(ctx)
        ctx.close()
        del ctx
        assert ref() is None
    finally:
        gc.enable()


def test_the_architecture_tables_agree():
    names, i = {}, 0
    name, softcap = ctypes.c_char_p(), ctypes.c_int32()
    while C["llama_specee_arch"](i, ctypes.byref(name), ctypes.byref(softcap)) == 0:
        names[name.value.decode()] = bool(softcap.value)
        i += 1
    assert names == {a.name: a.softcap_key is not None for a in ARCHS.values()}


@pytest.mark.parametrize("variant", ["gemma3-swa", "qwen3"])
def test_head_free_exits_on_other_architectures(tiny_dir, variant):
    model = Model(supported_model_path(tiny_dir, variant))
    ctx = drafted_context(model)
    always(model, ctx, [1, model.info.n_layer - 1], ExitKind.HEAD_FREE)
    ctx.decode(PROMPT)
    for token in (4, 5, 6):
        ctx.decode([token])
        assert ctx.step_info().exit_kind == ExitKind.HEAD_FREE and ctx.step_info().heads == 0
    ctx.close()
