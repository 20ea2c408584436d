"""Tiny random-weight GGUF models for fast unit tests.

``write_tiny_model`` writes a few-hundred-KB model that the llama.cpp vendored in
llama-cpp-python 0.3.36 loads and runs (``llama``, ``qwen2``, ``qwen3``, ``gemma3`` and
``gpt2``; ``gpt2`` is the architecture llama.cpp supports but our early exit does
not: fused QKV, LayerNorm with biases, learned position embeddings, no RoPE).
``gemma3`` has Gemma's post-attention and post-FFN norms and Q/K norms, its input
embedding scaled by sqrt(n_embd), optional output soft-capping, and with
``n_swa > 0`` a sliding window on all layers but every ``swa_pattern``-th (llama.cpp
then keeps two caches: one for the window layers, one for the global ones).
``write_corrupt_model`` writes files llama.cpp must refuse to load. With ``tiled=True``,
``write_tiny_model`` writes models of real sizes too (tools/gpu_costs.py: a Llama-2-7B shape in f16,
13.5 GB): every tensor is cut from one block of random values, repeated, and streamed to the file.

The vocabulary is a real byte-level BPE (``tokenizer.ggml.model = "gpt2"``,
pre-tokenizer ``gpt-2``) with merges trained on a small English text, so
``llama_tokenize`` works on plain ASCII text.  Token ids 0-3 are
``<|endoftext|>`` (BOS), ``<|im_start|>``, ``<|im_end|>`` (EOS) and ``<unk>``;
then the printable-ASCII/whitespace byte tokens, the other 158 byte tokens when
``n_vocab >= 292`` (otherwise non-ASCII bytes are silently dropped by
``llama_tokenize``), then merged tokens up to ``n_vocab``.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType, TokenType

# Weight scales, tuned so greedy decoding does not collapse onto one token (also
# with tied embeddings): small token embeddings, 1/sqrt(fan_in) matmuls, and a
# weak attention output so the last position is not dominated by the context mean.
EMBD_SCALE = 0.05
ATTN_OUT_GAIN = 0.1
ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "gpt2")
WEIGHT_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
QUANT_TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
               "q4_1": GGMLQuantizationType.Q4_1}
QUANT_BLOCK = 32  # values per block of every type in QUANT_TYPES
CORRUPT_KINDS = ("truncated", "garbage", "empty")

BOS_ID, IM_START_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = (
    "hello world! Hello there, how are you today? The quick brown fox jumps over the lazy dog. "
    "This is a tiny test model for the speculative early exit engine. It is not trained, "
    "so the text it writes is random, but the tokenizer is real and works on plain text. "
    "What is the capital of France? The capital of France is Paris. One, two, three, four, "
    "five, six, seven, eight, nine, ten. def main(): return 0 # a comment in code. "
    "Once upon a time there was a little model that wanted to think faster than the others. "
    "We tokenize the prompt, evaluate it, and generate tokens one at a time until the end. "
)
_PRETOKENIZE = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class TinyConfig:
    """Shape and contents of a tiny model.

    ``arch`` is one of ``ARCHS``; ``"gpt2"`` is the llama.cpp-supported
    architecture that our early exit does not support.  ``n_vocab`` counts every
    token (specials, bytes and merges) and must be at least 128.  With
    ``tied_embeddings`` there is no ``output.weight`` and llama.cpp reuses
    ``token_embd.weight``.  ``weight_type`` applies to the 2-D matmul weights
    (the quantized types need every row length to be a multiple of 32); norms,
    biases and gpt2's position embeddings stay f32. ``n_embd_head`` sets the
    attention heads' width where it is not ``n_embd / n_head`` (gemma-3-270m:
    4 heads of 256 on a 640-wide stream).
    """

    arch: str = "llama"
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_vocab: int = 256
    n_ctx_train: int = 256
    tied_embeddings: bool = False
    weight_type: str = "f32"
    seed: int = 0
    n_swa: int = 0
    swa_pattern: int = 2
    final_softcap: float = 0.0
    chat_template: bool = True
    n_embd_head: int = 0  # 0: n_embd // n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd_head or self.n_embd // self.n_head

    @property
    def n_embd_q(self) -> int:
        return self.head_dim * self.n_head

    @property
    def n_embd_kv(self) -> int:
        return self.head_dim * self.n_head_kv


@lru_cache(maxsize=None)
def _byte_encoder() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=None)
def _bpe_merges(n_merges: int) -> tuple[tuple[str, str], ...]:
    """Deterministic BPE merges learned on ``_CORPUS`` (byte-encoded symbols)."""
    enc = _byte_encoder()
    words = Counter(tuple(enc[b] for b in w.encode()) for w in _PRETOKENIZE.findall(_CORPUS))
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return tuple(merges)


@lru_cache(maxsize=None)
def build_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """Return ``(tokens, token_types, merges)`` for a byte-level BPE of ``n_vocab`` tokens."""
    enc = _byte_encoder()
    ascii_bytes = list(range(32, 127)) + [9, 10, 13]
    other_bytes = [b for b in range(256) if b not in ascii_bytes]
    min_vocab = 128  # specials + ASCII bytes + some merges (llama.cpp rejects an empty merge list)
    if n_vocab < min_vocab:
        raise ValueError(f"n_vocab must be >= {min_vocab}, got {n_vocab}")
    tokens = list(SPECIAL_TOKENS) + [enc[b] for b in ascii_bytes]
    if n_vocab >= len(tokens) + len(other_bytes) + 32:
        tokens += [enc[b] for b in other_bytes]
    types = [TokenType.CONTROL] * 3 + [TokenType.UNKNOWN] + [TokenType.NORMAL] * (len(tokens) - 4)
    n_merges = n_vocab - len(tokens)
    merges = _bpe_merges(n_merges)
    tokens += [a + b for a, b in merges]
    types += [TokenType.NORMAL] * len(merges)
    # The corpus runs out of merges near 650 tokens: fill up with plain-text tokens
    # that decode fine but that the tokenizer never produces.
    while len(tokens) < n_vocab:
        tokens.append(f"<pad_{len(tokens)}>")
        types.append(TokenType.NORMAL)
    return tokens, [int(t) for t in types], [f"{a} {b}" for a, b in merges]


class _Weights:
    """Random tensor factory that writes through a ``GGUFWriter``."""

    def __init__(self, writer: gguf.GGUFWriter, config: TinyConfig) -> None:
        self.writer = writer
        self.config = config
        self.rng = np.random.default_rng(config.seed)

    def matrix(self, name: str, rows: int, cols: int, scale: float | None = None) -> None:
        """A 2-D matmul weight, numpy shape ``(rows, cols)`` (rows = output dim)."""
        scale = 1.0 / np.sqrt(cols) if scale is None else scale
        data = (self.rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        wtype = self.config.weight_type
        if wtype == "f32":
            self.writer.add_tensor(name, data)
        elif wtype == "f16":
            self.writer.add_tensor(name, data.astype(np.float16))
        else:
            qtype = QUANT_TYPES[wtype]
            self.writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    def vector(self, name: str, n: int, mean: float = 0.0, scale: float = 0.02) -> None:
        """A 1-D f32 tensor (norm weights: mean 1, biases: mean 0)."""
        self.writer.add_tensor(name, (mean + self.rng.standard_normal(n) * scale).astype(np.float32))

    def f32_matrix(self, name: str, rows: int, cols: int, scale: float) -> None:
        self.writer.add_tensor(name, (self.rng.standard_normal((rows, cols)) * scale).astype(np.float32))


class _TiledWeights:
    """The same tensors as _Weights, cut from one block of random values repeated, and streamed: a model of
    billions of weights is written about as fast as its bytes reach the disk and is never held in memory
    whole. Two passes over the tensors: the first declares them (``declaring``), the second writes their
    data, in the same order."""

    BLOCK = 1 << 18  # values drawn once; a multiple of QUANT_BLOCK, so quantized blocks tile whole

    def __init__(self, writer: gguf.GGUFWriter, config: TinyConfig) -> None:
        self.writer = writer
        self.config = config
        self.values = np.random.default_rng(config.seed).standard_normal(self.BLOCK).astype(np.float32)
        self.encoded: dict[tuple[str, float, float], np.ndarray] = {}
        self.declaring = True

    def _block(self, wtype: str, mean: float, scale: float) -> np.ndarray:
        """BLOCK values of mean + scale * N(0, 1), encoded as ``wtype``, as bytes."""
        key = (wtype, mean, scale)
        if key not in self.encoded:
            data = mean + self.values * np.float32(scale)
            if wtype in QUANT_TYPES:
                data = gguf.quants.quantize(data.reshape(-1, QUANT_BLOCK), QUANT_TYPES[wtype])
            elif wtype == "f16":
                data = data.astype(np.float16)
            self.encoded[key] = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        return self.encoded[key]

    def _tensor(self, name: str, shape: tuple[int, ...], wtype: str, mean: float, scale: float) -> None:
        block = self._block(wtype, mean, scale)
        nbytes = int(np.prod(shape)) * len(block) // self.BLOCK
        if self.declaring:
            qtype = QUANT_TYPES.get(wtype, GGMLQuantizationType.F16 if wtype == "f16" else GGMLQuantizationType.F32)
            self.writer.add_tensor_info(name, (*shape[:-1], nbytes // int(np.prod(shape[:-1]))), np.dtype(np.uint8),
                                        nbytes, raw_dtype=qtype)
        else:
            self.writer.write_tensor_data(np.resize(block, nbytes))

    def matrix(self, name: str, rows: int, cols: int, scale: float | None = None) -> None:
        self._tensor(name, (rows, cols), self.config.weight_type, 0.0, 1.0 / np.sqrt(cols) if scale is None else scale)

    def vector(self, name: str, n: int, mean: float = 0.0, scale: float = 0.02) -> None:
        self._tensor(name, (n,), "f32", mean, scale)

    def f32_matrix(self, name: str, rows: int, cols: int, scale: float) -> None:
        self._tensor(name, (rows, cols), "f32", 0.0, scale)


def _add_metadata(w: gguf.GGUFWriter, c: TinyConfig) -> None:
    w.add_name(f"tiny-{c.arch}-{c.weight_type}")
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                     "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[c.weight_type])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(c.n_vocab)
    w.add_context_length(c.n_ctx_train)
    w.add_embedding_length(c.n_embd)
    w.add_block_count(c.n_layer)
    w.add_feed_forward_length(c.n_ff)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_head_kv)
    if c.arch == "gpt2":
        w.add_layer_norm_eps(1e-5)
    else:
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(10000.0)
        w.add_rope_dimension_count(c.head_dim)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if c.arch == "gemma3":
        if c.n_swa:
            w.add_sliding_window(c.n_swa)
            w.add_uint32(f"{c.arch}.attention.sliding_window_pattern", c.swa_pattern)
            w.add_float32(f"{c.arch}.rope.freq_base_swa", 1000.0)
        if c.final_softcap:
            w.add_final_logit_softcapping(c.final_softcap)

    tokens, types, merges = build_vocab(c.n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_pad_token_id(BOS_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if c.chat_template:
        w.add_chat_template(CHATML_TEMPLATE)


def _add_tensors(t: _Weights, c: TinyConfig) -> None:
    e, q, kv, ff = c.n_embd, c.n_embd_q, c.n_embd_kv, c.n_ff
    t.matrix("token_embd.weight", c.n_vocab, e, scale=EMBD_SCALE)
    if c.arch == "gpt2":
        t.f32_matrix("position_embd.weight", c.n_ctx_train, e, scale=0.02)
    for i in range(c.n_layer):
        p = f"blk.{i}."
        if c.arch == "gpt2":
            t.vector(p + "attn_norm.weight", e, mean=1.0, scale=0.1)
            t.vector(p + "attn_norm.bias", e)
            t.matrix(p + "attn_qkv.weight", e + 2 * kv, e)
            t.vector(p + "attn_qkv.bias", e + 2 * kv)
            t.matrix(p + "attn_output.weight", e, e, scale=ATTN_OUT_GAIN / np.sqrt(e))
            t.vector(p + "attn_output.bias", e)
            t.vector(p + "ffn_norm.weight", e, mean=1.0, scale=0.1)
            t.vector(p + "ffn_norm.bias", e)
            t.matrix(p + "ffn_up.weight", ff, e)
            t.vector(p + "ffn_up.bias", ff)
            t.matrix(p + "ffn_down.weight", e, ff)
            t.vector(p + "ffn_down.bias", e)
            continue
        t.vector(p + "attn_norm.weight", e, mean=1.0, scale=0.1)
        t.matrix(p + "attn_q.weight", q, e)
        t.matrix(p + "attn_k.weight", kv, e)
        t.matrix(p + "attn_v.weight", kv, e)
        if c.arch == "qwen2":
            t.vector(p + "attn_q.bias", q, scale=0.1)
            t.vector(p + "attn_k.bias", kv, scale=0.1)
            t.vector(p + "attn_v.bias", kv, scale=0.1)
        if c.arch in ("qwen3", "gemma3"):
            t.vector(p + "attn_q_norm.weight", c.head_dim, mean=1.0, scale=0.1)
            t.vector(p + "attn_k_norm.weight", c.head_dim, mean=1.0, scale=0.1)
        t.matrix(p + "attn_output.weight", e, q, scale=ATTN_OUT_GAIN / np.sqrt(q))
        t.vector(p + "ffn_norm.weight", e, mean=1.0, scale=0.1)
        t.matrix(p + "ffn_gate.weight", ff, e)
        t.matrix(p + "ffn_up.weight", ff, e)
        t.matrix(p + "ffn_down.weight", e, ff)
        if c.arch == "gemma3":  # gemma's norms after attention and FFN (stored with Gemma's +1 folded in)
            t.vector(p + "post_attention_norm.weight", e, mean=1.0, scale=0.1)
            t.vector(p + "post_ffw_norm.weight", e, mean=1.0, scale=0.1)
    t.vector("output_norm.weight", e, mean=1.0, scale=0.1)
    if c.arch == "gpt2":
        t.vector("output_norm.bias", e)
    if not c.tied_embeddings:
        t.matrix("output.weight", c.n_vocab, e)


def _check(c: TinyConfig) -> None:
    if c.arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {c.arch!r}")
    if c.weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {WEIGHT_TYPES}, got {c.weight_type!r}")
    if (c.n_embd % c.n_head and not c.n_embd_head) or c.n_head % c.n_head_kv:
        raise ValueError("n_embd must be divisible by n_head (or n_embd_head set), and n_head by n_head_kv")
    if c.n_embd_head and c.arch == "gpt2":
        raise ValueError("gpt2's heads are n_embd / n_head wide")
    if c.weight_type in QUANT_TYPES and (c.n_embd % QUANT_BLOCK or c.n_ff % QUANT_BLOCK or c.n_embd_q % QUANT_BLOCK):
        raise ValueError(f"{c.weight_type} needs n_embd, n_ff and the heads' width to be multiples of {QUANT_BLOCK}")


def write_tiny_model(path: str | os.PathLike[str], config: TinyConfig = TinyConfig(), *, tiled: bool = False) -> Path:
    """Write a random-weight GGUF model for ``config`` to ``path``; return the path. ``tiled``: its tensors
    repeat one block of random values and are streamed (_TiledWeights), for models of real sizes."""
    _check(config)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, config.arch)
    _add_metadata(writer, config)
    if tiled:
        weights = _TiledWeights(writer, config)
        _add_tensors(weights, config)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        weights.declaring = False
        _add_tensors(weights, config)
    else:
        _add_tensors(_Weights(writer, config), config)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    writer.close()
    return path


def write_corrupt_model(path: str | os.PathLike[str], kind: str) -> Path:
    """Write an unloadable ``.gguf`` file to ``path``; return the path.

    ``kind``: ``"truncated"`` (a valid tiny model cut in half), ``"garbage"``
    (4 KiB of seeded random bytes, not starting with the GGUF magic) or
    ``"empty"`` (zero bytes).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "truncated":
        with tempfile.TemporaryDirectory() as tmp:
            data = write_tiny_model(Path(tmp) / "full.gguf").read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "garbage":
        data = np.random.default_rng(1234).integers(0, 256, 4096, dtype=np.uint8).tobytes()
        path.write_bytes(b"JUNK" + data[4:])
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        raise ValueError(f"kind must be one of {CORRUPT_KINDS}, got {kind!r}")
    return path


if __name__ == "__main__":
    import time

    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            for wtype in WEIGHT_TYPES:
                cfg = TinyConfig(arch=arch, weight_type=wtype, tied_embeddings=(wtype == "f16"))
                t0 = time.perf_counter()
                out = write_tiny_model(Path(tmp) / f"{arch}-{wtype}.gguf", cfg)
                ms = (time.perf_counter() - t0) * 1e3
                print(f"{out.name:20s} {out.stat().st_size / 1024:8.1f} KiB  {ms:6.1f} ms")
        for kind in CORRUPT_KINDS:
            out = write_corrupt_model(Path(tmp) / f"corrupt-{kind}.gguf", kind)
            print(f"{out.name:20s} {out.stat().st_size / 1024:8.1f} KiB")
