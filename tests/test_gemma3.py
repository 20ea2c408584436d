"""gemma3: its sliding-window cache pair (iSWA), output soft-capping and a GGUF without a chat template.

Tiny random-weight gemma3 GGUFs: a window of 8 tokens on layers 0, 1 and 3, layer 2 global, logits
soft-capped at 2. The runtime tests shared by every architecture (stop, exit logits, resume, KV modes)
run on them too (tests/test_runtime.py); these are the ones only a sliding window has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from llama_cpp import llama_cpp as llama_c

from specee_edge.chat_templates import GEMMA_CHAT_TEMPLATE
from specee_edge.draft import LinearDraft
from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.errors import SpecEEError
from specee_edge.pack.format import DraftHead
from specee_edge.registry import REGISTRY_ENV, entry_for_file
from specee_edge.runtime import Context, Model
from specee_edge.runtime.weights import TargetWeights
from tests.conftest import supported_model_path
from tests.test_runtime import TINY_PROMPT, assert_hooks_off_match_stock, forced_exit_run, greedy, teacher_forced, top_k

WINDOW = "gemma3-swa"


@pytest.fixture(scope="module")
def swa_model(tiny_dir) -> Model:
    return Model(supported_model_path(tiny_dir, WINDOW))


def test_hooks_off_match_stock_llama_across_the_window(swa_model):
    assert_hooks_off_match_stock(swa_model, swa_model.tokenize(TINY_PROMPT), 40, n_ctx=128)  # 40: well past the window


@pytest.mark.parametrize("mode", ["mask", "fill"])
def test_cells_reused_after_the_window_moved_on_never_leak_stale_kv(swa_model, mode):
    """With a window cache of 256 cells (swa_full off), 300 tokens make it reuse the cells of tokens that
    left the window: their K/V stay in the layers a reusing token skips. Exiting every other token at
    layer 0, decoding must match a cache that never reuses a cell (swa_full on: those rows hold zeros).
    Flash attention off: its F16 accumulation shows the order of the sums at about 3e-3, where a tolerance would
    blur what is tested; the cells' masking is the same either way."""
    prompt = swa_model.tokenize(TINY_PROMPT)
    continuation = greedy(Context(swa_model, n_threads=1, n_ctx=512), prompt, 300)

    def run(swa_full: bool) -> np.ndarray:
        ctx = Context(swa_model, n_threads=1, n_ctx=512, n_batch=64, swa_full=swa_full, flash_attn="off")
        ctx.enable_early_exit(4, mode)
        return forced_exit_run(ctx, prompt, continuation, exit_layer=0)

    reusing, fresh = run(swa_full=False), run(swa_full=True)
    # the same cells in another order: only the order of the attention sums differs
    np.testing.assert_allclose(reusing, fresh, rtol=1e-4, atol=1e-5)
    # the comparison can fail: the exits changed what later tokens see
    never_exited = teacher_forced(Context(swa_model, n_threads=1, n_ctx=512, n_batch=64, swa_full=False, flash_attn="off"),
                                  prompt, continuation)
    assert not np.allclose(reusing[1::2], never_exited[1::2], atol=1e-3)


def test_the_window_cache_reuses_cells_without_swa_full(swa_model):
    """What the test above relies on: without swa_full the window cache drops positions behind the window."""
    prompt = swa_model.tokenize(TINY_PROMPT)
    for swa_full, first_kept in ((False, lambda p: p > 0), (True, lambda p: p == 0)):
        ctx = Context(swa_model, n_threads=1, n_ctx=512, n_batch=64, swa_full=swa_full)
        greedy(ctx, prompt, 300)
        assert first_kept(llama_c.llama_memory_seq_pos_min(ctx._mem, 0))


def exited_at_layer_1(model: Model) -> tuple[Context, int, int]:
    """A mask-mode context whose last token (at position p) stopped after layer 1: (ctx, p, token)."""
    ctx = Context(model, n_threads=1, n_ctx=128)
    ctx.enable_early_exit(4, "mask")
    ctx.set_probe_layers([1])
    ctx.decode(model.tokenize(TINY_PROMPT))
    p = ctx.n_past
    ctx.set_candidates(top_k(ctx.logits(), 4))
    ctx.set_probe_callback(lambda il, z: True)
    token = int(np.argmax(ctx.logits()))
    assert ctx.decode([token]) == 1
    ctx.set_probe_callback(None)
    return ctx, p, token


def test_depth_is_kept_in_both_caches_through_seq_rm_clear_and_state_save(swa_model):
    ctx, p, token = exited_at_layer_1(swa_model)
    assert ctx.cell_depth(p) == 1
    assert llama_c.llama_state_get_size(ctx._ctx) == 0  # a shallow cell cannot be saved (0006, both caches)

    ctx.truncate(p)  # both caches free the cell; a full-depth token takes position p again
    assert ctx.cell_depth(p) == -1
    ctx.decode([token])
    assert ctx.cell_depth(p) == swa_model.info.n_layer - 1
    assert llama_c.llama_state_get_size(ctx._ctx) > 0

    ctx.clear()
    assert ctx.cell_depth(p) == -1 and ctx.n_past == 0


def test_depth_moves_with_its_cell_through_a_context_shift(swa_model):
    """llama.cpp's context shift (drop positions [1, 1 + n), move the rest n back): the exited token's
    depth follows it to its new position in both caches, and decoding goes on."""
    ctx, p, _ = exited_at_layer_1(swa_model)
    greedy(ctx, [int(np.argmax(ctx.logits()))], 3)  # four full-depth tokens after it: positions p+1 .. p+4

    n = 3
    assert llama_c.llama_memory_can_shift(ctx._mem)
    assert llama_c.llama_memory_seq_rm(ctx._mem, 0, 1, 1 + n)
    llama_c.llama_memory_seq_add(ctx._mem, 0, 1 + n, -1, -n)
    full = swa_model.info.n_layer - 1
    assert ctx.cell_depth(p - n) == 1  # the exited token, n positions back
    assert [ctx.cell_depth(q) for q in range(p - n + 1, p + 2)] == [full] * 4
    assert ctx.cell_depth(p + 4) == -1
    ctx.decode([int(np.argmax(ctx.logits()))])  # the shifted cache decodes on (K re-RoPE'd in both caches)


@pytest.fixture
def base_model_entry(tiny_dir, tmp_path, monkeypatch) -> Path:
    """A tiny gemma3 without a chat template, which the registry ($SPECEE_REGISTRY) knows as a base model
    whose template is gemma, as the shipped registry knows gemma-3-270m."""
    path = supported_model_path(tiny_dir, WINDOW, chat_template=False)
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"models": {"tiny-gemma": {
        "description": "tiny", "arch": "gemma3", "n_layer": 4, "license": "none", "size_bytes": path.stat().st_size,
        "sha256": "0" * 64, "filename": path.name, "chat_template": "gemma", "prompting": "completion",
        "chat_template_notes": "", "source": {"kind": "pypi-wheel", "package": "tiny", "version": "0", "path": "tiny/x.gguf"}}}}))
    monkeypatch.setenv(REGISTRY_ENV, str(registry))
    return path


def test_a_gguf_without_a_chat_template_gets_its_registry_entry_s(base_model_entry, monkeypatch):
    """A chat turn in the template the registry names; for a base model, bench and calibrate prompt plainly."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]
    registry = os.environ[REGISTRY_ENV]
    monkeypatch.delenv(REGISTRY_ENV)  # the shipped registry does not know the file
    engine = Engine(base_model_entry, pack=None, config=EngineConfig(n_ctx=128, n_threads=1))
    with pytest.raises(SpecEEError, match="has no chat template: pass --chat-template .*gemma"):
        engine.format_chat(messages)
    assert engine.prompting == "chat"

    monkeypatch.setenv(REGISTRY_ENV, registry)
    assert entry_for_file(base_model_entry).chat_template == "gemma"
    engine = Engine(base_model_entry, pack=None, config=EngineConfig(n_ctx=128, n_threads=1))
    assert engine.chat_template == GEMMA_CHAT_TEMPLATE
    text = engine.format_chat(messages)
    assert text == "<start_of_turn>user\nBe brief.\n\nhello world<end_of_turn>\n<start_of_turn>model\n"
    assert len(engine.chat(messages, max_tokens=4, sampling=GREEDY).tokens) >= 1
    # a base model: bench and calibration give it their prompts as plain text, not as a chat turn
    assert engine.format_prompt("hello world") == "hello world\n\n"


def test_chat_says_a_base_model_continues_text(base_model_entry, tmp_path):
    env = dict(os.environ, COLUMNS="200", SPECEE_CACHE=str(tmp_path))
    result = subprocess.run([str(Path(sys.executable).with_name("specee-edge")), "chat", str(base_model_entry), "-n", "4"],
                            input="hello world\n/exit\n", capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"{base_model_entry.name} is a base model, not instruction-tuned" in result.stdout


def test_in_graph_draft_reads_the_unscaled_embedding_and_the_last_hidden_state(swa_model):
    """gemma3 scales its input embedding by sqrt(n_embd) for layer 0; the draft head in the graph reads
    it unscaled, as LinearDraft (and calibration) computes it: an F32 head gives the same candidates."""
    rng = np.random.default_rng(0)
    n_embd, n_vocab, last = swa_model.info.n_embd, swa_model.info.n_vocab, swa_model.info.n_layer - 1
    vocab_map = rng.permutation(n_vocab)[:64]
    tensors = {"fc.weight": rng.standard_normal((n_embd, 2 * n_embd)).astype(np.float32),
               "fc.bias": rng.standard_normal(n_embd).astype(np.float32),
               "head.weight": rng.standard_normal((len(vocab_map), n_embd)).astype(np.float32),
               "norm.weight": np.ones(n_embd, np.float32), "norm.eps": np.array([1e-6], np.float32)}
    draft = LinearDraft(DraftHead("linear", tensors, vocab_map), TargetWeights(swa_model.info.path), 4)
    ctx = Context(swa_model, n_threads=1, n_ctx=128)
    ctx.enable_early_exit(4, "fill")
    ctx.set_draft(**draft.runtime_args())
    ctx.set_probe_callback(lambda il, z: False)
    ctx.set_probe_layers([1])
    ctx.set_capture_layers([last])
    ctx.decode(swa_model.tokenize(TINY_PROMPT))
    hidden, token = ctx.captured(last)[-1], int(np.argmax(ctx.logits()))
    for _ in range(24):  # across the window
        ctx.decode([token])
        assert list(ctx.step_info().candidates) == draft.propose(token, hidden).tolist()
        hidden, token = ctx.captured(last)[-1], int(np.argmax(ctx.logits()))
