"""GPU checks (pytest -m gpu, run by tools/gpu_check.sh on a CUDA build): full and partial offload.

With partial offload the graph has several splits; a stop must skip all of them, and resume must
pick up in the right one.
"""

from __future__ import annotations

import numpy as np
import pytest
from llama_cpp import llama_cpp as _llama

from specee_edge.runtime import Context, Model
from tests.conftest import CHAT_PROMPT
from tests.logit_lens import LogitLens
from tests.test_runtime import early_exit_context, forced_exit_run, greedy, stop_at, top_k

pytestmark = pytest.mark.gpu

OFFLOADS = {"partial": 15, "full": 99}


@pytest.fixture(scope="module", params=list(OFFLOADS))
def gpu_model(request, default_model):
    if not _llama.llama_supports_gpu_offload():
        pytest.skip("this llama-cpp-python build has no GPU backend")
    return Model(default_model.info.path, n_gpu_layers=OFFLOADS[request.param])


@pytest.mark.parametrize("layer", [5, 20])
def test_stop_and_resume(gpu_model, layer):
    prompt = gpu_model.tokenize(CHAT_PROMPT)
    reference = Context(gpu_model, n_ctx=512)
    reference.decode(prompt)
    token = int(np.argmax(reference.logits()))
    reference.decode([token])

    ctx = early_exit_context(gpu_model, "mask", n_ctx=512)
    ctx.set_capture_layers([layer])
    ctx.set_probe_layers([layer])
    ctx.set_probe_callback(stop_at(layer))
    ctx.decode(prompt)
    ctx.set_candidates(top_k(ctx.logits(), 4))
    assert ctx.decode([token]) == layer
    (hidden,) = ctx.captured(layer)
    expected = LogitLens.from_gguf(gpu_model.info.path)(hidden)
    np.testing.assert_allclose(ctx.logits(), expected, atol=0.02 * np.abs(expected).max())
    ctx.set_probe_callback(None)
    assert ctx.resume() is None
    np.testing.assert_allclose(ctx.logits(), reference.logits(), atol=1e-3)


@pytest.mark.parametrize("mode", ["mask", "fill", "full"])
def test_kv_modes(gpu_model, mode):
    prompt = gpu_model.tokenize(CHAT_PROMPT)
    continuation = greedy(Context(gpu_model, n_ctx=512), prompt, 16)
    fresh = Context(gpu_model, n_ctx=512)
    fresh.enable_early_exit(4, mode)
    first = forced_exit_run(fresh, prompt, continuation, exit_layer=10)
    reused = Context(gpu_model, n_ctx=512)
    reused.enable_early_exit(4, mode)
    greedy(reused, gpu_model.tokenize("Write a poem about the sea."), 32)
    reused.truncate(0)
    second = forced_exit_run(reused, prompt, continuation, exit_layer=10)
    np.testing.assert_allclose(second, first, atol=1e-3)
