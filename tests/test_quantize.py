"""Requantizing with llama.cpp's quantize API (specee_edge/runtime/quantize.py) and the batch-cost tool built on it."""

from __future__ import annotations

import json

import pytest

from specee_edge.errors import SpecEEError
from specee_edge.runtime import Context, Model, quantize
from specee_edge.runtime.quantize import requantize, weight_types
from tests.conftest import load_tool
from tests.tiny_gguf import TinyConfig, write_tiny_model

SHAPE = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=256)


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("quantize") / "f32.gguf", TinyConfig(**SHAPE))


def test_requantize_writes_the_type_asked_and_the_file_decodes(f32_model, tmp_path):
    pure = requantize(f32_model, tmp_path / "q4_k.gguf", "q4_k")
    assert weight_types(pure) == {"Q4_K": 1.0}
    mixed = requantize(f32_model, tmp_path / "q4_0-mix.gguf", "Q4_0", pure=False)
    assert set(weight_types(mixed)) == {"Q4_0", "Q6_K"}  # llama.cpp's own mix: the output head one step up
    model = Model(pure)
    ctx = Context(model, n_ctx=64, n_threads=1)
    ctx.decode(model.tokenize("hello world"))
    assert ctx.logits().shape == (SHAPE["n_vocab"],)
    ctx.close()
    model.close()


def test_requantize_errors_are_one_line(f32_model, tmp_path):
    with pytest.raises(SpecEEError, match="unknown weight type 'Q3_X': choose from F16, BF16"):
        requantize(f32_model, tmp_path / "x.gguf", "Q3_X")
    with pytest.raises(SpecEEError, match="no model file"):
        requantize(tmp_path / "missing.gguf", tmp_path / "x.gguf", "Q8_0")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(SpecEEError, match="could not quantize broken.gguf to Q8_0"):
        requantize(broken, tmp_path / "x.gguf", "Q8_0")
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.part").exists()


def test_requantize_runs_the_default_threads(f32_model, tmp_path, monkeypatch):
    threads_asked = []

    def quantize_model(source, out, params):
        threads_asked.append(params.nthread)
        return 1  # stop there: the threads are what this test looks at

    monkeypatch.setattr(quantize, "default_threads", lambda: 3)
    monkeypatch.setattr(quantize._llama, "llama_model_quantize", quantize_model)
    for threads in (0, 5):
        with pytest.raises(SpecEEError, match="could not quantize"):
            requantize(f32_model, tmp_path / "x.gguf", "Q8_0", threads=threads)
    assert threads_asked == [3, 5]


def test_batch_costs_by_type_runs_on_a_tiny_model(f32_model, tmp_path, monkeypatch, capsys):
    tool = load_tool("batch_costs_by_type", monkeypatch)
    out = tmp_path / "costs.json"
    results = tool.main([str(f32_model), "--types", "Q4_0,Q8_0", "--rows", "2,4", "--repeats", "2", "-t", "1",
                         "--json", str(out)])
    assert [r.weight_type for r in results] == ["Q4_0", "Q8_0"]
    assert all(r.one_ms > 0 and set(r.rows_ms) == {2, 4} for r in results)
    printed = capsys.readouterr().out
    assert "| Q4_0 | Q4_0 100% |" in printed and "4 rows ms" in printed
    assert [r["weight_type"] for r in json.loads(out.read_text())] == ["Q4_0", "Q8_0"]
    with pytest.raises(SystemExit):
        tool.main([str(f32_model), "--types", "Q9"])
