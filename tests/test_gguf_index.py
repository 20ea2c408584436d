"""GGUFIndex, the lean GGUF header reader: it agrees with gguf.GGUFReader, keeps fingerprints, refuses damaged files."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFValueType

from specee_edge.default_model import default_model_path
from specee_edge.errors import ModelLoadError
from specee_edge.pack.format import TargetIdentity
from specee_edge.gguf_index import GGUFIndex, GGUFStrings
from specee_edge.pack.target import fingerprint, target_identity
from specee_edge.runtime.weights import TargetWeights
from tests.conftest import tiny_model_path
from tests.tiny_gguf import ARCHS, CORRUPT_KINDS, WEIGHT_TYPES, write_corrupt_model


def reference_identity(path, reader: gguf.GGUFReader) -> TargetIdentity:
    """target_identity as computed before GGUFIndex, from gguf-py's reader."""
    arch = reader.get_field("general.architecture").contents()
    return TargetIdentity(
        arch=arch,
        n_layer=int(reader.get_field(f"{arch}.block_count").contents()),
        n_embd=int(reader.get_field(f"{arch}.embedding_length").contents()),
        n_vocab=len(reader.get_field("tokenizer.ggml.tokens").data),
        fingerprint=fingerprint(path, reader),  # duck-typed: .tensors (name, shape, tensor_type), .data_offset
    )


def assert_agrees(index: GGUFIndex, reader: gguf.GGUFReader, *, strings: bool = True) -> None:
    assert list(index.fields) == list(reader.fields)
    for key, field in reader.fields.items():
        if field.types[0] != GGUFValueType.ARRAY:
            value = index.value(key)
            assert value == field.contents() and type(value) is type(field.contents()), key
            assert index.array_len(key) is None
            continue
        if field.types[1] == GGUFValueType.ARRAY:
            continue  # gguf-py flattens arrays of arrays: tested on their own
        assert index.array_len(key) == len(field.data), key
        value = index.value(key)
        if field.types[-1] == GGUFValueType.STRING:
            assert isinstance(value, GGUFStrings)
            if strings:
                assert index.strings(key) == field.contents(), key
        else:
            assert isinstance(value, np.ndarray) and value.tolist() == field.contents(), key
    assert index.data_offset == reader.data_offset
    assert len(index.tensors) == len(reader.tensors)
    for mine, theirs in zip(index.tensors, reader.tensors):
        assert mine.name == theirs.name
        assert mine.tensor_type == theirs.tensor_type and isinstance(mine.tensor_type, GGMLQuantizationType)
        assert mine.shape.dtype.type is theirs.shape.dtype.type and mine.shape.tolist() == theirs.shape.tolist()
        assert str(list(mine.shape)) == str(list(theirs.shape)), mine.name  # the fingerprint's text
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (
            theirs.n_elements, theirs.n_bytes, theirs.data_offset), mine.name
        assert mine.data.shape == theirs.data.shape and mine.data.dtype == theirs.data.dtype, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name
        assert not mine.data.flags.writeable
        assert index.tensor(mine.name) is mine


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_agree_with_gguf_py(tiny_dir, arch, weight_type):
    path = tiny_model_path(tiny_dir, arch, weight_type=weight_type)
    reader, index = gguf.GGUFReader(path), GGUFIndex(path)
    assert_agrees(index, reader)
    assert target_identity(path) == target_identity(path, index) == reference_identity(path, reader)


def test_tied_embeddings_and_weights(tiny_dir):
    path = tiny_model_path(tiny_dir, "qwen3", weight_type="q8_0", tied_embeddings=True)
    reader = gguf.GGUFReader(path)
    assert_agrees(GGUFIndex(path), reader)
    weights = TargetWeights(path)
    assert isinstance(weights.reader, GGUFIndex)
    assert target_identity(path, weights.reader) == reference_identity(path, reader)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    ids = np.array([0, 5, 7, 5])
    expected = gguf.quants.dequantize(embd.data[ids], embd.tensor_type)
    assert np.array_equal(weights.embeddings(ids), expected)
    assert np.array_equal(weights.head_rows(ids), expected)  # tied: the head is the embedding table


@pytest.fixture(scope="module")
def default_pair():
    path = default_model_path()
    start = time.perf_counter()
    reader = gguf.GGUFReader(path)
    t_reader = time.perf_counter() - start
    start = time.perf_counter()
    index = GGUFIndex(path)
    t_index = time.perf_counter() - start
    print(f"\nopen {path.name}: gguf.GGUFReader {t_reader:.2f} s, GGUFIndex {t_index * 1e3:.1f} ms")
    return path, reader, index


def test_default_model_agrees_with_gguf_py(default_pair):
    path, reader, index = default_pair
    assert_agrees(index, reader)
    assert target_identity(path) == reference_identity(path, reader)
    assert index.array_len("tokenizer.ggml.tokens") == 49152


def test_lazy_strings(default_pair):
    _, reader, index = default_pair
    tokens = index.value("tokenizer.ggml.tokens")
    expected = reader.get_field("tokenizer.ggml.tokens").contents()
    assert len(tokens) == len(expected) and repr(tokens) == f"GGUFStrings(len={len(expected)})"
    for i in (0, 1, 100, len(expected) - 1, -1, -2):
        assert tokens[i] == expected[i]
    assert tokens[10:20] == expected[10:20] and tokens[::5000] == expected[::5000]
    with pytest.raises(IndexError):
        tokens[len(expected)]
    with pytest.raises(TypeError):
        index.strings("general.architecture")
    with pytest.raises(TypeError):
        index.strings("tokenizer.ggml.token_type")
    assert index.strings("no.such.key") is None and index.value("no.such.key") is None
    assert index.array_len("no.such.key") is None and "no.such.key" not in index


def test_open_decodes_no_string_of_the_vocabulary(default_pair, monkeypatch):
    """What makes opening fast (gguf.GGUFReader takes seconds): no vocabulary string is decoded until asked for."""
    path = default_pair[0]
    decoded = []
    decode = GGUFStrings._decode
    monkeypatch.setattr(GGUFStrings, "_decode", lambda self, off: decoded.append(off) or decode(self, off))
    index = GGUFIndex(path)
    tokens = index.value("tokenizer.ggml.tokens")
    assert len(tokens) == 49152 and decoded == []
    assert tokens[100] == default_pair[1].get_field("tokenizer.ggml.tokens").contents()[100] and len(decoded) == 1


def write_kitchen_sink(path, endianess: GGUFEndian) -> None:
    """Every value type, an array of arrays, a custom alignment, tensors of several types."""
    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    w.add_custom_alignment(64)
    for name, kind in (("u8", "uint8"), ("i8", "int8"), ("u16", "uint16"), ("i16", "int16"), ("u32", "uint32"),
                       ("i32", "int32"), ("u64", "uint64"), ("i64", "int64")):
        getattr(w, f"add_{kind}")(f"test.{name}", 7 if name.startswith("u") else -7)
    w.add_float32("test.f32", 0.1)
    w.add_float64("test.f64", 0.1)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héllo")
    w.add_array("test.floats", [1.5, -2.0, 3.25])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.bools", [True, False])
    w.add_array("test.strings", ["a", "", "ünï", "last"])
    w.add_array("test.nested", [[1, 2], [3, 4, 5]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 3, 4)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("q8_0", q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_value_types_alignment_and_byte_order(tmp_path, endianess):
    path = tmp_path / "sink.gguf"
    write_kitchen_sink(path, endianess)
    index, reader = GGUFIndex(path), gguf.GGUFReader(path)
    assert_agrees(index, reader)
    assert index.alignment == 64 and index.data_offset % 64 == 0
    assert index.byte_order == ("<" if endianess == GGUFEndian.LITTLE else ">")
    assert index.value("test.str") == "héllo"
    assert index.strings("test.strings") == ["a", "", "ünï", "last"]
    nested = index.value("test.nested")
    assert index.array_len("test.nested") == 2 and [a.tolist() for a in nested] == [[1, 2], [3, 4, 5]]
    assert index.fields["test.nested"].item_type == GGUFValueType.ARRAY
    assert index.tensor("f16").data.shape == (2, 3, 4) and index.tensor("f16").shape.tolist() == [4, 3, 2]
    assert index.tensor("q8_0").data.shape == (4, 64 // 32 * 34)


# ---------------------------------------------------------------- damaged files

@pytest.mark.parametrize("kind", CORRUPT_KINDS)
def test_corrupt_files_raise_model_load_error(tmp_path, kind):
    path = write_corrupt_model(tmp_path / f"{kind}.gguf", kind)
    with pytest.raises(ModelLoadError) as err:
        GGUFIndex(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    with pytest.raises(ModelLoadError):
        target_identity(path)
    with pytest.raises(ModelLoadError):
        TargetWeights(path)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        GGUFIndex(tmp_path / "nope.gguf")


def test_header_cut_anywhere_and_bad_headers(tiny_dir, tmp_path):
    good_path = tiny_model_path(tiny_dir, "llama", weight_type="q8_0")
    good = good_path.read_bytes()
    data_offset = GGUFIndex(good_path).data_offset
    cut = tmp_path / "cut.gguf"
    for n in sorted({4, 5, 8, 23, 24, 30, 100, 1000, data_offset // 2, data_offset - 1, data_offset,
                     data_offset + 1, len(good) - 1}):
        cut.write_bytes(good[:n])
        with pytest.raises(ModelLoadError, match="corrupt or truncated"):
            GGUFIndex(cut)

    def patched(at: int, value: bytes) -> GGUFIndex:
        data = bytearray(good)
        data[at : at + len(value)] = value
        cut.write_bytes(bytes(data))
        return GGUFIndex(cut)

    with pytest.raises(ModelLoadError, match="version 1 is not supported"):
        patched(4, (1).to_bytes(4, "little"))
    with pytest.raises(ModelLoadError):
        patched(8, (1 << 40).to_bytes(8, "little"))  # tensor count
    with pytest.raises(ModelLoadError):
        patched(16, (1 << 40).to_bytes(8, "little"))  # kv count
    # the first tensor info: a dimension of 2^40 runs far past the end of the file
    at = good.index(b"token_embd.weight") + len(b"token_embd.weight") + 4
    with pytest.raises(ModelLoadError, match="past the end"):
        patched(at, (1 << 40).to_bytes(8, "little"))
    cut.write_bytes(b"GGUF" + np.random.default_rng(1).integers(0, 256, 4092, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError):
        GGUFIndex(cut)


def test_fuzzed_headers_never_crash(tiny_dir, tmp_path):
    """Bounded fuzz: random byte edits in the header give a ModelLoadError or an index, nothing else."""
    good_path = tiny_model_path(tiny_dir, "gpt2", weight_type="f16")
    good = good_path.read_bytes()
    header_end = GGUFIndex(good_path).data_offset
    rng = np.random.default_rng(1234)
    path = tmp_path / "fuzz.gguf"
    outcomes = {"refused": 0, "read": 0}
    for _ in range(200):
        data = bytearray(good)
        for _ in range(rng.integers(1, 6)):
            data[rng.integers(4, header_end)] = rng.integers(0, 256)
        path.write_bytes(bytes(data))
        try:
            GGUFIndex(path)
            outcomes["read"] += 1
        except ModelLoadError as e:
            assert "\n" not in str(e)
            outcomes["refused"] += 1
    assert outcomes["refused"] and outcomes["read"]
