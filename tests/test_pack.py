"""Packs: round trips, conversion from other formats, binding to the target, hostile files, the CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import gguf
import joblib
import numpy as np
import pytest
from sklearn.neural_network import MLPClassifier
from typer.testing import CliRunner

import specee_edge.pack.io as pack_io
from specee_edge.cli import app
from specee_edge.default_model import default_model_path
from specee_edge.errors import SpecEEError
from specee_edge.exits import ExitKind
from specee_edge.gguf_index import GGUFIndex
from specee_edge.pack import (
    EXACT_QUALITY,
    OFF,
    DraftHead,
    Pack,
    PackError,
    PackLevelError,
    PackMismatchError,
    LayerExit,
    QualityLevel,
    Schedule,
    check_target,
    read_pack,
    target_identity,
    write_pack,
)
from specee_edge.pack.convert import convert
from specee_edge.pack.format import ROUND_MAX_DRAFTS
from specee_edge.pack.safetensors import write_safetensors
from specee_edge.pack.target import FINGERPRINT_DATA_BYTES
from specee_edge.predictor import MLPPredictor
from specee_edge.shipped import shipped_dir
from tests.conftest import SHIPPED_PACK, tiny_model_path
from tests.tiny_gguf import write_corrupt_model

RNG = np.random.default_rng(0)
K = 4


def random_predictor(hidden: int = 512, n_features: int = 3 * K) -> MLPPredictor:
    return MLPPredictor(
        [RNG.standard_normal((hidden, n_features)).astype(np.float32) * 0.3,
         RNG.standard_normal((1, hidden)).astype(np.float32) * 0.1],
        [RNG.standard_normal(hidden).astype(np.float32) * 0.1, np.array([0.2], dtype=np.float32)],
    )


def linear_draft_tensors(n_embd: int, n_out: int = 100) -> dict[str, np.ndarray]:
    """The tensors of the linear draft head `calibrate` trains (specee_edge/draft/linear.py)."""
    return {"fc.weight": (RNG.standard_normal((n_embd, 2 * n_embd)) * 0.05).astype(np.float32),
            "fc.bias": np.zeros(n_embd, np.float32),
            "head.weight": (RNG.standard_normal((n_out, n_embd)) * 0.05).astype(np.float32),
            "norm.weight": np.ones(n_embd, np.float32), "norm.eps": np.array([1e-5], np.float32)}


def eagle_tensors(n_embd: int) -> dict[str, np.ndarray]:
    """An EAGLE-1 draft head as its authors release it (which convert refuses: the engine cannot run it)."""
    def w(*shape):
        return (RNG.standard_normal(shape) * 0.05).astype(np.float16)

    return {
        "fc.weight": w(n_embd, 2 * n_embd), "fc.bias": w(n_embd),
        "layers.0.self_attn.q_proj.weight": w(n_embd, n_embd), "layers.0.self_attn.k_proj.weight": w(n_embd, n_embd),
        "layers.0.self_attn.v_proj.weight": w(n_embd, n_embd), "layers.0.self_attn.o_proj.weight": w(n_embd, n_embd),
        "layers.0.mlp.gate_proj.weight": w(2 * n_embd, n_embd), "layers.0.mlp.up_proj.weight": w(2 * n_embd, n_embd),
        "layers.0.mlp.down_proj.weight": w(n_embd, 2 * n_embd),
        "layers.0.post_attention_layernorm.weight": np.ones(n_embd, dtype=np.float16),
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_model_path(tmp_path_factory.mktemp("pack-models"), "llama")
    return path, target_identity(path)


def sample_pack(target, *, draft: bool = True) -> Pack:
    return Pack(
        target=target,
        k=K,
        threshold=0.5,
        schedule=Schedule(offline=[1, 2]),
        predictors={layer: random_predictor(hidden=64) for layer in (0, 1, 2)},
        draft=DraftHead("linear", linear_draft_tensors(target.n_embd), vocab_map=np.arange(100, dtype=np.int64))
        if draft else None,
        provenance={"command": "test", "samples_per_layer": [10, 20, 30]},
        # values that float32 holds exactly, so a round trip compares equal
        levels=[QualityLevel(0.9, {0: LayerExit(ExitKind.VERIFIED, 0.625), 1: LayerExit(ExitKind.HEAD_FREE, 0.5), 2: OFF},
                             [1], 0.25, 0.9375, 1.25, 0.125),
                QualityLevel(0.98, {0: OFF, 1: LayerExit(ExitKind.VERIFIED, 0.8125), 2: OFF}, [], 0.125, 0.984375, 1.0625,
                             0.015625)],
        default_quality=0.98,
        temperatures={0: 1.5, 1: 1.25, 2: 0.875},
    )


FEATURES = RNG.standard_normal((256, 3 * K)).astype(np.float32)


# --- round trips ---------------------------------------------------------------------------------


def test_round_trip_f32_is_exact(tiny, tmp_path):
    _, target = tiny
    pack = sample_pack(target)
    back = read_pack(write_pack(tmp_path / "p.gguf", pack, draft_quant="q8_0"))
    assert (back.target, back.k, back.threshold, back.schedule, back.provenance) == (
        pack.target, pack.k, pack.threshold, pack.schedule, pack.provenance)
    assert (back.levels, back.default_quality, back.temperatures) == (pack.levels, pack.default_quality, pack.temperatures)
    assert back.predictors.keys() == pack.predictors.keys()
    for layer, p in pack.predictors.items():
        for a, b in zip(p.weights + p.biases, back.predictors[layer].weights + back.predictors[layer].biases):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(back.draft.vocab_map, pack.draft.vocab_map)
    for name, array in pack.draft.tensors.items():  # Q8_0: 8-bit blocks of 32
        np.testing.assert_allclose(back.draft.tensors[name], array, atol=np.abs(array).max() / 100)


@pytest.mark.parametrize("quant, rel", [("q4_0", 1 / 6), ("f16", 1e-3)])
def test_draft_quantization_options(tiny, tmp_path, quant, rel):
    _, target = tiny
    pack = sample_pack(target)
    back = read_pack(write_pack(tmp_path / "p.gguf", pack, draft_quant=quant))
    w = pack.draft.tensors["fc.weight"]
    np.testing.assert_allclose(back.draft.tensors["fc.weight"], w, atol=np.abs(w).max() * rel)
    q4, q8 = (tmp_path / "q4.gguf"), (tmp_path / "q8.gguf")
    write_pack(q4, pack, draft_quant="q4_0")
    write_pack(q8, pack, draft_quant="q8_0")
    assert q4.stat().st_size < q8.stat().st_size


def test_f16_predictors_match_within_f16_tolerance(tiny, tmp_path):
    _, target = tiny
    pack = sample_pack(target, draft=False)
    back = read_pack(write_pack(tmp_path / "p.gguf", pack, predictor_type="f16"))
    for layer, p in pack.predictors.items():
        np.testing.assert_allclose(back.predictors[layer](FEATURES), p(FEATURES), atol=2e-3)


# --- conversion ----------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_convert_sklearn_joblib(tiny, tmp_path):
    _, target = tiny
    x = RNG.standard_normal((400, 3 * K))
    y = (x[:, 0] + x[:, 5] > 0).astype(int)
    classifiers = {layer: MLPClassifier(hidden_layer_sizes=(512,), max_iter=30, random_state=layer).fit(x, y)
                   for layer in (1, 2)}
    joblib.dump(classifiers, tmp_path / "preds.joblib")
    joblib.dump(MLPClassifier(hidden_layer_sizes=(16,), max_iter=30).fit(x, y), tmp_path / "one.joblib")

    pack = convert([str(tmp_path / "preds.joblib"), f"{tmp_path / 'one.joblib'}:0"], target)
    back = read_pack(write_pack(tmp_path / "p.gguf", pack))
    for layer, clf in classifiers.items():
        np.testing.assert_allclose(back.predictors[layer](FEATURES), clf.predict_proba(FEATURES)[:, 1], atol=1e-5)
    assert back.predictors[1].shape == (12, 512, 1) and back.predictors[0].shape == (12, 16, 1)
    with pytest.raises(SpecEEError, match="give its layer"):
        convert([str(tmp_path / "one.joblib")], target)


def test_convert_npz(tiny, tmp_path):
    _, target = tiny
    p = random_predictor(hidden=32)
    np.savez(tmp_path / "p.npz", **{"layer2.weight0": p.weights[0], "layer2.bias0": p.biases[0],
                                     "layer2.weight1": p.weights[1], "layer2.bias1": p.biases[1]})
    back = read_pack(write_pack(tmp_path / "p.gguf", convert([str(tmp_path / "p.npz")], target)))
    np.testing.assert_allclose(back.predictors[2](FEATURES), p(FEATURES), atol=1e-6)


def paper_safetensors(path, layers, hidden=512):
    """The SpecEE paper's released predictor file layout: F16 `model.layers.{i}.pred.{up,down}.*`."""
    tensors, reference = {}, {}
    for il in layers:
        p = random_predictor(hidden)
        half = [a.astype(np.float16) for a in (p.weights[0], p.biases[0], p.weights[1], p.biases[1])]
        tensors |= {f"model.layers.{il}.pred.up.weight": half[0], f"model.layers.{il}.pred.up.bias": half[1],
                    f"model.layers.{il}.pred.down.weight": half[2], f"model.layers.{il}.pred.down.bias": half[3]}
        reference[il] = MLPPredictor([half[0].astype(np.float32), half[2].astype(np.float32)],
                                     [half[1].astype(np.float32), half[3].astype(np.float32)])
    write_safetensors(path, tensors)
    return reference


def test_convert_paper_safetensors_with_a_predictor_on_every_layer(tiny, tmp_path):
    """The paper's file has predictors on layers 0..n_layer-1: the last one is left out, with one line."""
    _, target = tiny  # 4 layers: predictors on 0..2
    source = tmp_path / "model-predictor.safetensors"
    reference = paper_safetensors(source, layers=range(target.n_layer))
    notes = []
    pack = convert([str(source)], target, note=notes.append)
    back = read_pack(write_pack(tmp_path / "p.gguf", pack))
    assert sorted(back.predictors) == back.schedule.offline == [0, 1, 2]
    for il in (0, 1, 2):
        np.testing.assert_allclose(back.predictors[il](FEATURES), reference[il](FEATURES), atol=1e-5)
    assert notes == [f"{source}: left out the predictor of layer 3: the paper's rule never exits at the last layer"]


def test_convert_refuses_eagle_draft_heads(tiny, tmp_path):
    _, target = tiny
    write_safetensors(tmp_path / "eagle.safetensors", eagle_tensors(target.n_embd))
    paper_safetensors(tmp_path / "ok.safetensors", layers=[1], hidden=8)
    with pytest.raises(SpecEEError, match=r"an EAGLE draft head; the engine runs only the linear draft head"):
        convert([str(tmp_path / "ok.safetensors"), str(tmp_path / "eagle.safetensors")], target)


def test_convert_refuses_sources_that_do_not_fit_the_target(tiny, tmp_path):
    _, target = tiny  # 4 layers: predictors on 0..2
    paper_safetensors(tmp_path / "llama2.safetensors", layers=[15, 16, 17], hidden=8)
    with pytest.raises(SpecEEError, match=r"layers \[15, 16, 17\].*4 layers"):
        convert([str(tmp_path / "llama2.safetensors")], target)
    with pytest.raises(SpecEEError, match="unknown source type"):
        convert([str(tiny[0])], target)


def test_pack_for_another_model_is_refused(tiny, default_model, tmp_path):
    path, target = tiny
    pack = read_pack(write_pack(tmp_path / "p.gguf", sample_pack(target)))
    check_target(pack.target, target, tmp_path / "p.gguf", path)
    other = target_identity(default_model.info.path)
    with pytest.raises(PackMismatchError, match=r"made for another model.*4 layers.*30 layers"):
        check_target(pack.target, other, tmp_path / "p.gguf", default_model.info.path)


def test_fingerprint_hashes_plain_integers(tiny, tmp_path):
    """The tensor table as `name:[d0, d1]:type;` (no numpy text, which differs between NumPy 1 and 2)."""
    path, target = tiny
    index = GGUFIndex(path)
    digest = hashlib.sha256()
    for t in index.tensors:
        digest.update(f"{t.name}:[{', '.join(str(int(d)) for d in t.shape)}]:{int(t.tensor_type)};".encode())
    with path.open("rb") as f:
        f.seek(index.data_offset)
        digest.update(f.read(FINGERPRINT_DATA_BYTES))
    assert target.fingerprint == digest.hexdigest() != target.legacy_fingerprint
    # new packs hold this form
    assert read_pack(write_pack(tmp_path / "p.gguf", sample_pack(target))).target.fingerprint == target.fingerprint


def test_pack_with_either_fingerprint_form_is_accepted(tiny, tmp_path):
    path, target = tiny
    for fingerprint in (target.fingerprint, target.legacy_fingerprint):
        pack = read_pack(write_pack(tmp_path / "p.gguf", sample_pack(dataclasses.replace(target, fingerprint=fingerprint))))
        check_target(pack.target, target, tmp_path / "p.gguf", path)
    pack = read_pack(write_pack(tmp_path / "p.gguf", sample_pack(dataclasses.replace(target, fingerprint="0" * 64))))
    with pytest.raises(PackMismatchError, match="made for another model"):
        check_target(pack.target, target, tmp_path / "p.gguf", path)


# what the version 1 pack shipped before quality levels held: the legacy form of the default model's fingerprint
V1_SHIPPED_FINGERPRINT = "f2832d9e6375501c3d188f2f7ccbcc220ebf123678d850e54e135a9a3550b0a0"


def test_shipped_pack_holds_the_current_fingerprint_and_the_legacy_form_still_reproduces():
    """The legacy text, written out without numpy's repr, reproduces what the earlier pack was made with."""
    shipped = read_pack(shipped_dir() / "SmolLM2-135M-Instruct.Q4_1.specee.gguf")
    model = target_identity(default_model_path())
    assert shipped.target.fingerprint == model.fingerprint
    assert model.legacy_fingerprint == V1_SHIPPED_FINGERPRINT


# --- hostile packs -------------------------------------------------------------------------------


def write_unchecked(path, pack, monkeypatch):
    """Write a pack that breaks the rules, as a broken or hostile tool would."""
    monkeypatch.setattr(pack_io, "validate", lambda *a, **k: None)
    write_pack(path, pack)
    monkeypatch.undo()
    return path


def test_broken_packs_are_refused(tiny, tmp_path, monkeypatch):
    _, target = tiny
    bad_shape = sample_pack(target, draft=False)
    bad_shape.predictors[1] = random_predictor(hidden=64, n_features=10)
    nan = sample_pack(target, draft=False)
    nan.predictors[2].weights[1][0, 3] = np.nan
    bad_layer = sample_pack(target, draft=False)
    bad_layer.predictors[7] = random_predictor(hidden=8)
    bad_k = sample_pack(target, draft=False)
    bad_k.k = 11
    cases = {
        "chain from 12 inputs": bad_shape,
        "NaN or infinite": nan,
        "out of range": bad_layer,
        "must be 1..8": bad_k,
    }
    for reason, pack in cases.items():
        path = write_unchecked(tmp_path / "bad.gguf", pack, monkeypatch)
        with pytest.raises(PackError, match=reason):
            read_pack(path)
        with pytest.raises(PackError, match=reason):  # and nobody writes one
            write_pack(tmp_path / "refused.gguf", pack)


def test_quality_levels_pick_the_lowest_level_at_or_above_the_ask(tiny):
    _, target = tiny
    pack = sample_pack(target)
    assert pack.level().quality == 0.98  # the default
    assert pack.level(0.9).quality == 0.9
    assert pack.level(0.95).quality == 0.98  # never less quality than asked
    with pytest.raises(PackLevelError, match="no quality level at or above 0.99 in this pack \\(it offers 0.9, 0.98\\)"):
        pack.level(0.99)
    converted = dataclasses.replace(pack, levels=[], default_quality=None)
    assert converted.level() is None
    with pytest.raises(PackLevelError, match="no quality levels"):
        converted.level(0.9)


def test_inconsistent_levels_are_refused(tiny, tmp_path, monkeypatch):
    _, target = tiny
    cases = {
        "must ascend": dict(levels=lambda p: p.levels[::-1]),
        "default quality": dict(default_quality=lambda p: 0.95),
        "one per predictor layer": dict(levels=lambda p: [p.levels[0], dataclasses.replace(p.levels[1], exits={0: LayerExit(ExitKind.VERIFIED, 0.5)})]),
        "temperatures": dict(temperatures=lambda p: {0: 0.0}),
    }
    for reason, change in cases.items():
        pack = sample_pack(target, draft=False)
        pack = dataclasses.replace(pack, **{k: f(pack) for k, f in change.items()})
        with pytest.raises(PackError, match=reason):
            write_pack(tmp_path / "refused.gguf", pack)


def test_unknown_version_missing_tensor_and_wrong_files(tiny, tmp_path, monkeypatch):
    path, target = tiny
    monkeypatch.setattr(pack_io, "FORMAT_VERSION", 99)
    future = write_pack(tmp_path / "future.gguf", sample_pack(target, draft=False))
    monkeypatch.undo()
    with pytest.raises(PackError, match="version 99"):
        read_pack(future)
    monkeypatch.setattr(pack_io, "FORMAT_VERSION", 1)
    old = write_pack(tmp_path / "old.gguf", sample_pack(target, draft=False))
    monkeypatch.undo()
    with pytest.raises(PackError, match=r"^old.gguf is a version 1 pack \(no quality levels\): recalibrate it with `specee-edge calibrate"):
        read_pack(old)

    good = write_pack(tmp_path / "good.gguf", sample_pack(target, draft=False))
    data = good.read_bytes().replace(b"pred.1.fc1.bias", b"pred.1.fc1.XXXX")
    (tmp_path / "missing.gguf").write_bytes(data)
    with pytest.raises(PackError, match="missing tensor pred.1.fc1.bias"):
        read_pack(tmp_path / "missing.gguf")

    with pytest.raises(PackError, match="not a specee pack"):
        read_pack(path)  # a model, not a pack
    for kind in ("truncated", "garbage", "empty"):
        with pytest.raises(PackError):
            read_pack(write_corrupt_model(tmp_path / f"{kind}.gguf", kind))
    with pytest.raises(PackError, match="not found"):
        read_pack(tmp_path / "nope.gguf")


def test_absurd_declared_tensor_size(tiny, tmp_path):
    _, target = tiny
    good = write_pack(tmp_path / "good.gguf", sample_pack(target, draft=False))
    reader = gguf.GGUFReader(good)
    t = next(t for t in reader.tensors if t.name == "pred.0.fc0.weight")
    data = bytearray(good.read_bytes())
    # the tensor info: name, n_dims (u32), dims (u64 each): make the first dimension 2^40
    at = data.index(b"pred.0.fc0.weight") + len(b"pred.0.fc0.weight") + 4
    data[at : at + 8] = (1 << 40).to_bytes(8, "little")
    (tmp_path / "absurd.gguf").write_bytes(data)
    assert t.n_elements < 1 << 40
    with pytest.raises(PackError):
        read_pack(tmp_path / "absurd.gguf")


def test_fuzzed_packs_never_crash_or_pass_invalid(tiny, tmp_path):
    """Bounded fuzz: random byte edits give either PackError or a pack that validates."""
    _, target = tiny
    good = write_pack(tmp_path / "good.gguf", sample_pack(target)).read_bytes()
    rng = np.random.default_rng(1234)
    outcomes = {"refused": 0, "read": 0}
    for i in range(300):
        data = bytearray(good)
        for _ in range(rng.integers(1, 9)):
            # half the edits hit the header, where the structure is
            limit = 4096 if rng.random() < 0.5 else len(data)
            data[rng.integers(0, limit)] = rng.integers(0, 256)
        path = tmp_path / "fuzz.gguf"
        path.write_bytes(data)
        try:
            pack = read_pack(path)
        except PackError:
            outcomes["refused"] += 1
            continue
        pack_io.validate(pack)  # whatever reads must be a usable pack
        outcomes["read"] += 1
    assert outcomes["refused"] > 0 and outcomes["read"] > 0


# --- CLI -----------------------------------------------------------------------------------------


def test_cli_convert_and_info(tiny, tmp_path):
    path, target = tiny
    paper_safetensors(tmp_path / "preds.safetensors", layers=[0, 2, 3])
    runner = CliRunner()
    out = tmp_path / "tiny.specee.gguf"
    result = runner.invoke(app, ["convert", str(tmp_path / "preds.safetensors"), "-o", str(out), "--model", str(path)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"{tmp_path / 'preds.safetensors'}: left out the predictor of layer 3: the paper's rule never exits at the last layer",
        f"wrote {out}: 2 predictors (k = 4) for {path.name}",
    ]
    assert "specee-edge convert" in json.dumps(read_pack(out).provenance)

    result = runner.invoke(app, ["info", str(out)])
    assert result.exit_code == 0, result.output
    for text in ("candidates (k)", "12 -> 512 -> 1", "draft head", "provenance", "llama, 4 layers"):
        assert text in result.output

    result = runner.invoke(app, ["info", str(path)])
    assert result.exit_code == 0, result.output
    assert "architecture" in result.output and "supported" in result.output


def test_info_says_an_exact_level_without_exits_drafts_by_lookup():
    """The shipped pack's exact level turns every exit off: the engine still drafts there, by prompt lookup, in the
    rounds its controller finds pay (there is no per-kind switch from calibration); a lossy level off decodes
    plainly."""
    from specee_edge.cli.info import _exits_cell

    pack = read_pack(SHIPPED_PACK)
    exact, lossy_off = pack.level(EXACT_QUALITY), next(lv for lv in pack.levels if lv.off and not lv.exact)
    assert exact.off
    cell = _exits_cell(exact)
    assert "prompt lookup alone" in cell and "controller" in cell and "plainly" not in cell
    # lookup drafts as long as a round may be, whatever max_draft calibration measured (only "always" caps them)
    assert f"prompt lookup up to {ROUND_MAX_DRAFTS} a round" in cell and "exits up to" not in cell
    assert _exits_cell(lossy_off) == "none: decodes plainly"


def test_cli_errors_are_one_line(tiny, tmp_path):
    path, _ = tiny
    runner = CliRunner()
    garbage = write_corrupt_model(tmp_path / "garbage.gguf", "garbage")
    write_safetensors(tmp_path / "eagle.safetensors", eagle_tensors(target_identity(path).n_embd))
    for args in (["info", str(garbage)], ["info", str(tmp_path / "nope.gguf")],
                 ["convert", str(tmp_path / "nope.npz"), "-o", str(tmp_path / "x.gguf"), "--model", str(path)],
                 ["convert", str(tmp_path / "eagle.safetensors"), "-o", str(tmp_path / "x.gguf"), "--model", str(path)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 1
        assert result.output.strip().count("\n") == 0 and "error:" in result.output
