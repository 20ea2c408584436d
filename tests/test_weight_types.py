"""Every weight type a user's GGUF may hold, with a pack: plain, lossy and exact mode run, and exact mode's greedy
answers are plain decoding's.

llama.cpp repacks some types at load into layouts for the CPU's matrix kernels (Q4_0, IQ4_NL and Q4_K on AVX2 and
AVX-512; more on ARM), which take matrix products only: the probes' rows of the LM head (a get_rows) then come from
the token embedding's own copy (tied models) or from a plain copy of output.weight (untied ones). Before that, the
scheduler aborted (GGML_ASSERT(*cur_backend_id != -1)) at the first graph with probes. The models are tiny
random-weight ones, written in F32 and requantized with llama.cpp's quantize API, every matrix in the one type
(256 columns, so that the K-quants need no fallback).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from specee_edge.bench.quality import divergence_margins
from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.exits import ExitKind
from specee_edge.pack import EXACT_QUALITY, OFF, DraftHead, LayerExit, Pack, QualityLevel, Schedule, target_identity, write_pack
from specee_edge.runtime import Context
from specee_edge.runtime.quantize import requantize, weight_types
from tests.test_pack import linear_draft_tensors, random_predictor
from tests.tiny_gguf import TinyConfig, write_tiny_model

TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_K", "Q4_K", "Q6_K", "IQ4_NL")
REPACKED = ("Q4_0", "Q4_K", "IQ4_NL")  # repacked for x86's AVX2/AVX-512 kernels: untied models take another path
SHAPE = dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=256)
K = 4
LOSSY = 0.9
PROMPTS = ("Once upon a time", "The capital of France is")
TOKENS = 24
TINY_TIE = 0.1


def tiny_pack(model: Path, out: Path) -> Path:
    """Random predictors on layers 0-2 and the last, and a draft over the whole vocabulary; a lossy level whose
    verified exits (the last layer's head-free) fire often, and an exact level drafting with head-free exits."""
    target = target_identity(model)
    layers = (0, 1, 2, target.n_layer - 1)
    rng = np.random.default_rng(0)
    lossy = QualityLevel(LOSSY, {il: LayerExit(ExitKind.HEAD_FREE if il == layers[-1] else ExitKind.VERIFIED, 0.3)
                                 for il in layers}, list(layers), exit_rate=0.5, agreement=0.95)
    drafting = {il: LayerExit(ExitKind.HEAD_FREE, 0.3) if il != layers[-1] else OFF for il in layers}
    exact = dataclasses.replace(lossy, quality=EXACT_QUALITY, exits=drafting, max_draft=4.0, speedup=2.0,
                                speedup_sampled=2.0, speedup_low=1.5, speedup_sampled_low=1.5)
    pack = Pack(target=target, k=K, threshold=0.5, schedule=Schedule(offline=list(layers)),
                predictors={il: random_predictor(hidden=32) for il in layers},
                draft=DraftHead("linear", linear_draft_tensors(target.n_embd, target.n_vocab),
                                vocab_map=rng.permutation(target.n_vocab).astype(np.int64)),
                levels=[lossy, exact], default_quality=EXACT_QUALITY)
    return write_pack(out, pack)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[bool, Path]:
    """The F32 sources, by tied embeddings."""
    folder = tmp_path_factory.mktemp("weight-types")
    return {tied: write_tiny_model(folder / f"f32-{'tied' if tied else 'untied'}.gguf",
                                   TinyConfig(arch="llama", tied_embeddings=tied, **SHAPE)) for tied in (True, False)}


def answers(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        engine.reset()
        out.append(engine.generate(prompt, max_tokens=TOKENS, sampling=GREEDY).tokens)
    return out


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("type_name", TYPES)
def test_every_weight_type_runs_with_a_pack(models, tmp_path, type_name, tied):
    if not tied and type_name not in REPACKED:
        pytest.skip("an untied output head differs from a tied one only where llama.cpp repacks it")
    model = requantize(models[tied], tmp_path / f"{type_name}.gguf", type_name, threads=1)
    assert weight_types(model) == {type_name: 1.0}
    pack = tiny_pack(model, tmp_path / f"{type_name}.specee.gguf")

    def engine(**config) -> Engine:
        return Engine(model, pack=pack, config=EngineConfig(n_ctx=256, n_threads=1, **config))

    plain = engine(early_exit=False)
    prompts = [plain.tokenize(p) for p in PROMPTS]
    reference = answers(plain, prompts)
    assert plain.stats.probes == 0
    plain.close()

    lossy = engine(quality=LOSSY)
    answers(lossy, prompts)
    assert lossy.stats.exits > 0  # the probes ran, and decided
    lossy.close()

    exact = engine(speculation="always")
    assert exact.exact
    outputs = answers(exact, prompts)
    assert exact.stats.rounds > 0 and exact.stats.drafts > 0
    # the full model's answers: equal, or departing only where its own top two logits nearly tie (batches take
    # other kernels than single tokens; this random model's logits span about 5)
    reference_ctx = Context(exact.model, n_ctx=256, n_threads=1)
    margins = divergence_margins(reference_ctx, prompts, reference, outputs)
    reference_ctx.close()
    assert all(margin < TINY_TIE for margin in margins), margins
    exact.close()
