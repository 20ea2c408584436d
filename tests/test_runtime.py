"""The patched runtime: probes, stops, exit logits, resume, KV modes, bad input.

Tiny random-weight GGUFs (one per supported architecture, gemma3 with and without its sliding window)
and the default model.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from llama_cpp import Llama
from llama_cpp import llama_cpp as llama_c

from specee_edge.errors import ContextFullError, ModelLoadError, SpecEEError, UnsupportedModelError
from specee_edge.runtime import Context, Model
from tests.conftest import CHAT_PROMPT, SUPPORTED_VARIANTS, supported_model_path, tiny_model_path
from tests.logit_lens import LogitLens
from tests.tiny_gguf import write_corrupt_model

TINY_PROMPT = "hello world, the quick brown fox"


def greedy(ctx: Context, prompt: list[int], n: int) -> list[int]:
    ctx.decode(prompt)
    out = []
    for _ in range(n):
        token = int(np.argmax(ctx.logits()))
        out.append(token)
        ctx.decode([token])
    return out


def early_exit_context(model: Model, kv_mode: str = "mask", n_ctx: int = 128, flash_attn: str = "auto") -> Context:
    ctx = Context(model, n_ctx=n_ctx, flash_attn=flash_attn)
    ctx.enable_early_exit(4, kv_mode)
    return ctx


def stop_at(layer: int):
    """A probe callback that stops every token at `layer`."""
    return lambda il, cand_logits: il == layer


def top_k(logits: np.ndarray, k: int) -> list[int]:
    return [int(t) for t in np.argsort(-logits)[:k]]


# --- hooks off / never stopping ------------------------------------------------------------


def assert_hooks_off_match_stock(model: Model, prompt: list[int], n: int, n_ctx: int, flash_attn: str = "auto") -> None:
    """Our context, with and without early exit enabled (never stopping), decodes exactly like stock Llama with the
    same attention kernels (auto is on, on the CPU)."""
    llm = Llama(model_path=str(model.info.path), n_ctx=n_ctx, n_threads=2, flash_attn=flash_attn != "off", verbose=False)
    stock = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        stock.append(token)
        if len(stock) == n:
            break

    plain = Context(model, n_ctx=n_ctx, flash_attn=flash_attn)
    assert greedy(plain, prompt, n) == stock

    probing = early_exit_context(model, "mask", n_ctx=n_ctx, flash_attn=flash_attn)
    probing.set_probe_layers(range(model.info.n_layer - 1))
    calls = []
    probing.set_probe_callback(lambda il, z: calls.append(il) or False)
    assert greedy(probing, prompt, n) == stock
    # prompt processing never probes; each generated token probes every layer but the last
    assert len(calls) == n * (model.info.n_layer - 1)


@pytest.mark.parametrize("flash_attn", ["auto", "off"])
def test_hooks_off_matches_stock_llama(default_model, flash_attn):
    assert_hooks_off_match_stock(default_model, default_model.tokenize(CHAT_PROMPT), 64, n_ctx=512, flash_attn=flash_attn)


def test_prompt_processing_never_stops(default_model):
    ctx = early_exit_context(default_model, "mask", n_ctx=512)
    ctx.set_probe_layers([5])
    calls = []
    ctx.set_probe_callback(lambda il, z: calls.append(il) or True)
    assert ctx.decode(default_model.tokenize(CHAT_PROMPT)) is None
    assert calls == []


# --- stop, exit logits, resume --------------------------------------------------------------


@pytest.mark.parametrize("variant", SUPPORTED_VARIANTS)
@pytest.mark.parametrize("tied", [False, True])
def test_stop_gives_logit_lens_of_the_exit_layer(tiny_dir, variant, tied):
    path = supported_model_path(tiny_dir, variant, tied_embeddings=tied)
    model = Model(path)
    lens = LogitLens.from_gguf(path)
    layer = model.info.n_layer // 2

    ctx = early_exit_context(model, "mask", n_ctx=128)
    ctx.set_capture_layers([layer])
    ctx.set_probe_layers([layer])
    probes = []
    ctx.set_probe_callback(lambda il, z: probes.append((il, z.copy())) or True)
    ctx.decode(model.tokenize(TINY_PROMPT))
    candidates = top_k(ctx.logits(), 4)
    ctx.set_candidates(candidates)

    assert ctx.decode([candidates[0]]) == layer
    (hidden,) = ctx.captured(layer)
    expected = lens(hidden)
    # F32 weights: only float rounding separates llama.cpp from numpy
    np.testing.assert_allclose(ctx.logits(), expected, rtol=1e-4, atol=1e-4)
    assert probes[0][0] == layer
    np.testing.assert_allclose(probes[0][1], expected[candidates], rtol=1e-4, atol=1e-4)


def test_stop_on_the_default_model_matches_numpy(default_model):
    lens = LogitLens.from_gguf(default_model.info.path)
    layer = 20
    ctx = early_exit_context(default_model, "mask", n_ctx=512)
    ctx.set_capture_layers([layer])
    ctx.set_probe_layers([layer])
    seen = {}

    def callback(il, cand_logits):
        seen["probe"] = cand_logits.copy()
        seen["exit"] = ctx.probe_logits()
        return True

    ctx.set_probe_callback(callback)
    ctx.decode(default_model.tokenize(CHAT_PROMPT))
    candidates = top_k(ctx.logits(), 4)
    ctx.set_candidates(candidates)
    assert ctx.decode([candidates[0]]) == layer
    assert ctx.exit_layer == layer

    (hidden,) = ctx.captured(layer)
    expected = lens(hidden)
    # Q8_0 LM head: llama.cpp quantizes the normed activations to 8 bits for the dot products,
    # which moves logits of magnitude ~30 by up to ~0.1; the probe uses F32 rows
    scale = np.abs(expected).max()
    np.testing.assert_allclose(ctx.logits(), expected, atol=0.01 * scale)
    np.testing.assert_allclose(seen["probe"], expected[candidates], atol=0.01 * scale)
    # the logits seen by the callback are the ones the stop produced, not a recomputation
    np.testing.assert_array_equal(seen["exit"], ctx.logits())
    assert int(np.argmax(ctx.logits())) == int(np.argmax(expected))


@pytest.mark.parametrize("variant", SUPPORTED_VARIANTS)
def test_resume_equals_a_decode_that_never_stopped(tiny_dir, variant):
    model = Model(supported_model_path(tiny_dir, variant))
    prompt = model.tokenize(TINY_PROMPT)
    reference = Context(model, n_ctx=128)
    ref_tokens = greedy(reference, prompt, 12)

    ctx = early_exit_context(model, "mask", n_ctx=128)
    ctx.set_probe_layers([1, 2])
    ctx.decode(prompt)
    tokens = []
    for _ in range(12):
        token = int(np.argmax(ctx.logits()))
        tokens.append(token)
        ctx.set_candidates(top_k(ctx.logits(), 4))
        ctx.set_probe_callback(stop_at(1))
        assert ctx.decode([token]) == 1
        ctx.set_probe_callback(stop_at(2))  # probes stay active after a resume
        assert ctx.resume() == 2
        ctx.set_probe_callback(None)
        assert ctx.resume() is None
        assert ctx.cell_depth(ctx.n_past - 1) == model.info.n_layer - 1
    assert tokens == ref_tokens


def test_resume_on_the_default_model_is_bit_identical(default_model):
    prompt = default_model.tokenize(CHAT_PROMPT)
    reference = Context(default_model, n_ctx=512)
    reference.decode(prompt)
    token = int(np.argmax(reference.logits()))
    reference.decode([token])

    ctx = early_exit_context(default_model, "mask", n_ctx=512)
    ctx.set_probe_layers([15])
    ctx.set_probe_callback(stop_at(15))
    ctx.decode(prompt)
    ctx.set_candidates(top_k(ctx.logits(), 4))
    assert ctx.decode([token]) == 15
    assert ctx.cell_depth(ctx.n_past - 1) == 15
    assert ctx.resume() is None
    np.testing.assert_array_equal(ctx.logits(), reference.logits())


def test_resume_without_a_stop_is_an_error(default_model):
    ctx = early_exit_context(default_model, "mask", n_ctx=256)
    ctx.decode(default_model.tokenize("Hi"))
    with pytest.raises(SpecEEError, match="nothing to resume"):
        ctx.resume()


# --- KV of skipped layers --------------------------------------------------------------------


def forced_exit_run(ctx: Context, prompt: list[int], continuation: list[int], exit_layer: int) -> np.ndarray:
    """Teacher-force `continuation`, exiting every other token at `exit_layer`; logits of every step."""
    ctx.set_probe_layers([exit_layer])
    ctx.decode(prompt)
    steps = []
    for i, token in enumerate(continuation):
        ctx.set_candidates(top_k(ctx.logits(), 4))
        ctx.set_probe_callback(stop_at(exit_layer) if i % 2 == 0 else None)
        ctx.decode([token])
        steps.append(ctx.logits().copy())
    return np.array(steps)


def teacher_forced(ctx: Context, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """Logits of every step of `continuation` after `prompt`, nothing stopping."""
    ctx.decode(prompt)
    steps = []
    for token in continuation:
        ctx.decode([token])
        steps.append(ctx.logits().copy())
    return np.array(steps)


@pytest.mark.parametrize("variant", SUPPORTED_VARIANTS)
def test_full_mode_continues_bit_identically(tiny_dir, variant):
    model = Model(supported_model_path(tiny_dir, variant))
    prompt = model.tokenize(TINY_PROMPT)
    continuation = greedy(Context(model, n_ctx=128), prompt, 16)
    never_exited = teacher_forced(Context(model, n_ctx=128), prompt, continuation)

    ctx = early_exit_context(model, "full", n_ctx=128)
    exits = forced_exit_run(ctx, prompt, continuation, exit_layer=1)
    # the odd steps ran full depth after an exited token: its skipped layers were completed first
    np.testing.assert_array_equal(exits[1::2], never_exited[1::2])
    assert all(ctx.cell_depth(p) == model.info.n_layer - 1 for p in range(ctx.n_past - 1))
    # the comparison can fail: where the skipped layers are not completed (mask), the odd steps differ
    masked = forced_exit_run(early_exit_context(model, "mask", n_ctx=128), prompt, continuation, exit_layer=1)
    assert not np.array_equal(masked[1::2], never_exited[1::2])


@pytest.mark.parametrize("mode", ["mask", "fill"])
def test_kv_modes_ignore_what_the_cells_held_before(default_model, mode):
    prompt = default_model.tokenize(CHAT_PROMPT)
    continuation = greedy(Context(default_model, n_ctx=512), prompt, 24)

    fresh = early_exit_context(default_model, mode, n_ctx=512)  # skipped layers of exited cells hold zeros
    zeros = forced_exit_run(fresh, prompt, continuation, exit_layer=10)

    reused = early_exit_context(default_model, mode, n_ctx=512)  # ... or the K/V of an earlier conversation
    greedy(reused, default_model.tokenize("Write a poem about the sea and the wind."), 48)
    reused.truncate(0)
    garbage = forced_exit_run(reused, prompt, continuation, exit_layer=10)

    np.testing.assert_array_equal(garbage, zeros)
    exited = len(prompt)  # position of the first teacher-forced token, which exited
    # mask: deeper layers skip the cell; fill: its K/V were rebuilt, so it is complete
    assert reused.cell_depth(exited) == (10 if mode == "mask" else default_model.info.n_layer - 1)
    assert reused.cell_depth(exited + 1) == default_model.info.n_layer - 1


@pytest.mark.parametrize("variant", SUPPORTED_VARIANTS)
def test_fill_rebuilds_the_exact_kv_when_only_the_last_layer_is_skipped(tiny_dir, variant):
    """Exiting after layer n-2, h_exit is the last layer's true input: fill must equal full depth."""
    model = Model(supported_model_path(tiny_dir, variant))
    prompt = model.tokenize(TINY_PROMPT)
    continuation = greedy(Context(model, n_ctx=128), prompt, 16)
    last_but_one = model.info.n_layer - 2

    full = forced_exit_run(early_exit_context(model, "full"), prompt, continuation, exit_layer=last_but_one)
    filled = forced_exit_run(early_exit_context(model, "fill"), prompt, continuation, exit_layer=last_but_one)
    masked = forced_exit_run(early_exit_context(model, "mask"), prompt, continuation, exit_layer=last_but_one)
    # the odd steps ran full depth over a cache in which every other token had exited
    np.testing.assert_allclose(filled[1::2], full[1::2], rtol=1e-5, atol=1e-5)
    assert not np.allclose(masked[1::2], full[1::2], atol=1e-3)  # without the filled K/V it differs


def test_fill_is_refused_where_it_cannot_rebuild_kv(tiny_dir):
    model = Model(tiny_model_path(tiny_dir, "gpt2"))
    with pytest.raises(UnsupportedModelError):
        early_exit_context(model, "fill")


def test_depth_survives_seq_rm_and_clear(default_model):
    ctx = early_exit_context(default_model, "mask", n_ctx=256)
    ctx.set_probe_layers([8])
    ctx.decode(default_model.tokenize("The sky is"))
    p = ctx.n_past
    ctx.set_candidates(top_k(ctx.logits(), 4))
    ctx.set_probe_callback(stop_at(8))
    ctx.decode([260])
    assert ctx.cell_depth(p) == 8

    ctx.truncate(p)  # the cell is freed; a full-depth token takes position p again
    assert ctx.cell_depth(p) == -1
    ctx.set_probe_callback(None)
    ctx.decode([260])
    assert ctx.cell_depth(p) == default_model.info.n_layer - 1

    ctx.clear()
    assert ctx.cell_depth(p) == -1 and ctx.n_past == 0


# --- bad input ---------------------------------------------------------------------------------


def test_unsupported_architecture_is_refused(tiny_dir):
    model = Model(tiny_model_path(tiny_dir, "gpt2"))
    assert not model.info.supports_early_exit
    ctx = Context(model, n_ctx=64)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ctx.enable_early_exit(4, "mask")


def test_bad_arguments_are_refused(tiny_dir):
    model = Model(tiny_model_path(tiny_dir, "llama"))
    ctx = Context(model, n_ctx=64)
    with pytest.raises(SpecEEError, match="not enabled"):
        ctx.set_probe_layers([1])
    for n_cand in (0, 9):
        with pytest.raises(SpecEEError, match="1..8"):
            ctx.enable_early_exit(n_cand, "mask")
    with pytest.raises(SpecEEError, match="KV mode"):
        ctx.enable_early_exit(4, "fill-with-zeros")
    ctx.enable_early_exit(4, "mask")
    last = model.info.n_layer - 1
    for layer in (-1, last + 1, last + 5):  # the last layer may be probed: there a stop skips the output head
        with pytest.raises(SpecEEError, match="out of range"):
            ctx.set_probe_layers([layer])
    with pytest.raises(SpecEEError, match="expected 4 candidates"):
        ctx.set_candidates([1, 2])
    with pytest.raises(SpecEEError, match="candidate ids"):
        ctx.set_candidates([1, 2, 3, model.info.n_vocab])
    with pytest.raises(SpecEEError, match="out of range"):
        ctx.decode([model.info.n_vocab + 3])
    # what JSON's "\ud800" decodes to: no UTF-8 form, a one-line error rather than a UnicodeEncodeError
    with pytest.raises(SpecEEError, match=r"lone UTF-16 surrogate \(U\+D800\) at character 2"):
        model.tokenize("hi\ud800!")


def test_no_environment_variable_slows_decoding(tiny_dir, monkeypatch):
    # the controller's tests slow a context down from the tests (tests.conftest.slowed); a variable once did it
    for name in ("SPECEE_TEST_STEP_COST", "SPECEE_TEST_BATCH_COST"):
        monkeypatch.setenv(name, "50")
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    ctx = Context(Model(tiny_model_path(tiny_dir, "llama")), n_ctx=64)
    ctx.decode([1, 2, 3])
    ctx.decode([4])
    assert slept == []


def test_callback_exceptions_surface_after_decode(tiny_dir):
    model = Model(tiny_model_path(tiny_dir, "llama"))
    ctx = early_exit_context(model, "mask", n_ctx=64)
    ctx.set_probe_layers([1])
    ctx.decode(model.tokenize(TINY_PROMPT))
    ctx.set_candidates([5, 6, 7, 8])

    def broken(il, z):
        raise ValueError("predictor exploded")

    ctx.set_probe_callback(broken)
    with pytest.raises(ValueError, match="predictor exploded"):
        ctx.decode([5])
    ctx.set_probe_callback(None)
    ctx.decode([6])  # still usable


@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty"])
def test_corrupt_model_files_raise(tmp_path, tiny_dir, kind):
    path = write_corrupt_model(tmp_path / f"{kind}.gguf", kind)
    with pytest.raises(ModelLoadError):
        Model(path)


def test_missing_model_file_raises(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        Model(tmp_path / "nope.gguf")
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(ModelLoadError, match="not a file"):
        Model(tmp_path / "dir.gguf")


def test_full_context_raises_and_keeps_the_context_usable(tiny_dir):
    model = Model(tiny_model_path(tiny_dir, "llama"))
    ctx = Context(model, n_ctx=64)
    n_ctx = ctx.n_ctx  # llama.cpp may round the size up
    ctx.decode([5] * (n_ctx - 2))
    with pytest.raises(ContextFullError, match="context full"):
        ctx.decode([5] * 4)
    ctx.decode([5, 6])
    assert ctx.n_past == n_ctx


def test_fill_works_after_every_layer(default_model):
    """Each exit layer has a fill graph of its own (built once): a stop after any layer fills its cell."""
    ctx = early_exit_context(default_model, "fill", n_ctx=256)
    ctx.decode(default_model.tokenize(CHAT_PROMPT))
    last = default_model.info.n_layer - 1
    for layer in [*range(last), *range(last)]:  # twice: the second round reuses the graphs
        ctx.set_probe_layers([layer])
        ctx.set_probe_callback(stop_at(layer))
        token = int(np.argmax(ctx.logits()))
        assert ctx.decode([token]) == layer
        assert ctx.cell_depth(ctx.n_past - 1) == last


@pytest.mark.parametrize("mode", ["mask", "fill"])
def test_state_save_refuses_a_cache_with_shallow_cells(default_model, mode, tmp_path):
    """A cell's depth is not in llama.cpp's state format: saved, a shallow cell would load back as
    complete. So the save refuses while one is cached (mask after an exit) and works otherwise."""
    ctx = early_exit_context(default_model, mode, n_ctx=256)
    prompt = default_model.tokenize(CHAT_PROMPT)
    ctx.decode(prompt)
    assert llama_c.llama_state_get_size(ctx._ctx) > 0
    ctx.set_probe_layers([10])
    ctx.set_probe_callback(stop_at(10))
    ctx.set_candidates(top_k(ctx.logits(), 4))
    assert ctx.decode([int(np.argmax(ctx.logits()))]) == 10
    tokens = (llama_c.llama_token * (len(prompt) + 1))(*prompt, 0)
    saved = llama_c.llama_state_save_file(ctx._ctx, str(tmp_path / "state.bin").encode(), tokens, len(tokens))
    if mode == "mask":
        assert llama_c.llama_state_get_size(ctx._ctx) == 0 and not saved
        ctx.truncate(len(prompt))  # the shallow cell gone, the cache saves again
        assert llama_c.llama_state_get_size(ctx._ctx) > 0
    else:  # fill completed the cell
        assert llama_c.llama_state_get_size(ctx._ctx) > 0 and saved


def test_an_unknown_flash_attention_setting_is_one_line(default_model):
    with pytest.raises(SpecEEError, match="unknown flash attention setting 'yes': choose one of auto, on, off"):
        Context(default_model, n_ctx=64, flash_attn="yes")


def test_kept_pieces_equal_the_vocabulary_s(default_model):
    """token_to_piece keeps what it returned (the reply asks at every token): asked again, or after a special-token
    form was asked, it gives llama_token_to_piece's own bytes."""
    model = default_model
    tokens = [0, 1, 2, 198, 504, 1000, 49151]
    fresh = [model._piece(t, special=False) for t in tokens]
    special = [model.token_to_piece(t, special=True) for t in tokens]
    assert [model.token_to_piece(t) for t in tokens] == fresh == [model.token_to_piece(t) for t in tokens]
    assert special[0] != fresh[0]  # <|endoftext|> is written out only as a special piece
    assert [model.token_to_piece(t, special=True) for t in tokens] == special


def test_logits_views_read_every_decode_as_a_fresh_view_would(tiny_dir):
    """Context.logits() and the Sampler's draw keep numpy views by the buffer's address: after single steps, after a
    batch with every row's logits (llama.cpp may then move its buffer) and after steps again, each view reads what
    a view made afresh from llama.cpp's pointer reads; the kept views stay bounded, and a row the last decode has
    no logits for is one clear error."""
    from specee_edge.engine.sampling import GREEDY, Sampler
    from specee_edge.runtime.context import LogitsViews

    model = Model(tiny_model_path(tiny_dir, "llama"))
    ctx = Context(model, n_ctx=256, n_batch=128)
    draw = Sampler(GREEDY, model.info.n_vocab)
    fresh = lambda row=-1: np.ctypeslib.as_array(llama_c.llama_get_logits_ith(ctx.handle, row), shape=(model.info.n_vocab,))
    ctx.decode(model.tokenize(TINY_PROMPT, add_special=True))
    for rows in (1, 1, 9, 1, 70, 1):
        tokens = [(int(np.argmax(ctx.logits())) + i) % model.info.n_vocab for i in range(rows)]
        ctx.decode(tokens, output_all=rows > 1)
        for row in (range(rows) if rows > 1 else [-1]):
            assert np.array_equal(ctx.logits(row), fresh(row))
            assert draw.from_context(ctx.handle, row) == int(np.argmax(fresh(row)))
    assert len(ctx._logits._views) <= LogitsViews.MAX_VIEWS and len(draw._logits._views) <= LogitsViews.MAX_VIEWS
    with pytest.raises(SpecEEError, match="no logits for output 3"):
        ctx.logits(3)
    model.close()
