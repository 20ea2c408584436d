"""A loaded GGUF model: thin wrapper over llama_model with the facts early exit needs."""

from __future__ import annotations

import ctypes
import functools
import numbers
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from llama_cpp import llama_cpp as _llama

from specee_edge.errors import ModelLoadError, SpecEEError
from specee_edge.gguf_index import check_gguf_file
from specee_edge.runtime import rpc
from specee_edge.runtime._bindings import C
from specee_edge.runtime.logging import quiet_llama_logs
from specee_edge.runtime.placement import Placement, describe_devices
from specee_edge.runtime.placement import default as placement_default


def check_token_ids(ids: Iterable[object], n_vocab: int, what: str) -> None:
    """Token ids given by a user (a prompt as ids, logit_bias's keys) are integers in [0, n_vocab): a negative one
    would index the logits from their end, one past the vocabulary out of their bounds."""
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < n_vocab]
    if bad:
        raise SpecEEError(f"{what} names tokens outside the vocabulary [0, {n_vocab}): {bad[:4]}")


def utf8(text: str) -> bytes:
    """`text` in UTF-8. A lone UTF-16 surrogate (what JSON's "\\ud800" decodes to) is not a character and has no
    UTF-8 form: a one-line error instead of a UnicodeEncodeError."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SpecEEError(f"a lone UTF-16 surrogate (U+{ord(text[e.start]):04X}) at character {e.start} is not text:"
                          " surrogates come in pairs") from None


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    supports_early_exit: bool


class Model:
    """A llama_model loaded from a GGUF file (freed by close() or when collected)."""

    def __init__(self, path: str | os.PathLike, *, placement: Placement | None = None):
        """placement: where the layers go (-ngl, -ts, --offload-first: runtime.placement); None: the process's
        (placement.default(), set by the command line; nothing offloaded unless it says so). Offloaded layers go to
        the GPUs and the RPC workers added with runtime.rpc.connect."""
        path = check_gguf_file(path)
        quiet_llama_logs()
        self.placement = placement if placement is not None else placement_default()
        params = _llama.llama_model_default_params()
        buffers = self.placement.apply(params)  # noqa: F841  (params points into them until the load returns)
        # where the offloaded layers go; a decode checks that these still answer
        self.workers = rpc.registered() if self.placement.n_gpu_layers > 0 else ()
        self._model = _llama.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            rpc.check_workers(self.workers)
            raise ModelLoadError(f"llama.cpp could not load {path} (corrupt, truncated or unsupported GGUF)")
        self._vocab = _llama.llama_model_get_vocab(self._model)
        self._is_eog: dict[int, bool] = {}  # asked for every drafted token: a dict lookup, not a ctypes call
        self._pieces: dict[int, bytes] = {}  # token_to_piece(special=False), as the reply asks for them
        self.info = ModelInfo(
            path=path,
            arch=self.meta("general.architecture") or "unknown",
            n_layer=_llama.llama_model_n_layer(self._model),
            n_embd=_llama.llama_model_n_embd(self._model),
            n_vocab=_llama.llama_vocab_n_tokens(self._vocab),
            supports_early_exit=bool(C["llama_specee_supported"](self._model)),
        )

    @property
    def handle(self) -> int:
        return self._model

    @property
    def vocab_handle(self) -> int:
        """The llama_vocab, for samplers that read token texts (a grammar's)."""
        return self._vocab

    def layer_devices(self) -> list[str]:
        """The device each layer runs on, then the output layer's, as ggml names them ("CPU", "CUDA0",
        "RPC0[127.0.0.1:50052]", ...): what the placement gave on this build's devices."""
        if not self._model:  # llama.cpp would read a freed model
            raise SpecEEError("the model is closed")
        return [C["llama_specee_layer_device"](self._model, il).decode() for il in range(self.info.n_layer + 1)]

    def placement_text(self) -> str:
        """Where the layers run, for people: "layers 0-14 on CUDA0, layers 15-29 on CPU; the output on CUDA0"."""
        text = describe_devices(self.layer_devices())
        if self.placement.offload_first:
            text += " (--offload-first)"
        if self.placement.tensor_overrides:
            text += "; -ot " + ",".join(f"{pattern}={buft}" for pattern, buft in self.placement.tensor_overrides)
        return text

    def meta(self, key: str) -> str | None:
        size = 1024
        while True:  # like snprintf, it returns the full length: chat templates often exceed the first guess
            buf = ctypes.create_string_buffer(size)
            n = _llama.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
            if n < size:
                return buf.value.decode("utf-8", errors="replace") if n >= 0 else None
            size = n + 1

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = utf8(text)
        capacity = len(data) + 8
        tokens = (_llama.llama_token * capacity)()
        n = _llama.llama_tokenize(self._vocab, data, len(data), tokens, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            tokens = (_llama.llama_token * capacity)()
            n = _llama.llama_tokenize(self._vocab, data, len(data), tokens, capacity, add_special, parse_special)
        return list(tokens[:n])

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        """The token's bytes. The reply's pieces are kept: every emitted token asks, and on a cache that a decode has
        just filled with weights, a dict lookup costs a few µs where the ctypes call costs about 15."""
        if special:
            return self._piece(token, special=True)
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._piece(token, special=False)
        return piece

    def _piece(self, token: int, *, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = _llama.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = _llama.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        eog = self._is_eog.get(token)
        if eog is None:
            eog = self._is_eog[token] = bool(_llama.llama_vocab_is_eog(self._vocab, token))
        return eog

    def eog_tokens(self) -> list[int]:
        """Every end-of-generation token of the vocabulary (EOS, end of turn, and the like)."""
        n_vocab = _llama.llama_vocab_n_tokens(self._vocab)
        return [t for t in range(n_vocab) if _llama.llama_vocab_is_eog(self._vocab, t)]

    @functools.cached_property
    def eog_ids(self) -> frozenset[int]:
        """eog_tokens(), as a set computed once (a scan of the vocabulary: 26 ms for SmolLM2's 49,152 tokens): exact
        mode asks of every round's drafts whether one ends the generation, in one set operation."""
        return frozenset(self.eog_tokens())

    @property
    def bos(self) -> int:
        return _llama.llama_vocab_bos(self._vocab)

    @property
    def adds_bos(self) -> bool:
        """Whether tokenizing with add_special puts a BOS first."""
        return bool(_llama.llama_vocab_get_add_bos(self._vocab))

    def close(self) -> None:
        if getattr(self, "_model", None):
            _llama.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        self.close()
