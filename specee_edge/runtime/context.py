"""A llama_context that can stop a token's forward pass after any layer.

Thin wrappers over llama-cpp-python's low-level API plus the patched C API (see _bindings.py).
One sequence per context; positions follow the KV cache (each decode appends).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from llama_cpp import llama_cpp as _llama

from specee_edge.archs import SUPPORTED
from specee_edge.errors import ContextFullError, DecodeCancelled, SpecEEError, UnsupportedModelError
from specee_edge.exits import ExitKind
from specee_edge.gguf_index import GGUFIndex
from specee_edge.runtime import rpc
from specee_edge.runtime._bindings import C, KV_MODES, MAX_CANDIDATES, Decision, TokenInfo, logits_address, probe_callback_t
from specee_edge.runtime.model import Model

# called after an active probe with (layer, candidate logits); returns how the token leaves there:
# ExitKind.NONE (or False) goes on, VERIFIED (or True) stops with the layer's exit head, HEAD_FREE stops
# with the candidates' logits. The logits are a view of a buffer the next probe overwrites: copy them to keep them.
ProbeCallback = Callable[[int, np.ndarray], "ExitKind | bool"]

SEQ = 0
# llama.cpp's --flash-attn values and their llama_flash_attn_type
FLASH_ATTN = {"auto": _llama.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": _llama.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              "off": _llama.LLAMA_FLASH_ATTN_TYPE_DISABLED}
MIN_BATCH = 3  # n_batch at least 3: every decode of two tokens or more then splits into chunks of two or more

# how the runtime stores draft matrices (ggml type ids)
DRAFT_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}
OUTPUT_WEIGHT = "output.weight"  # an untied model's output head, as GGUF names it


@dataclass(frozen=True)
class StepInfo:
    """What the last single-token decode did inside llama_decode. Times in milliseconds."""

    exit_layer: int | None     # None: every layer ran and the output head gave the logits
    exit_kind: ExitKind        # how it left (NONE without an exit)
    probes: int                # native predictors evaluated
    verify_failures: int       # positive predictions whose exit top-1 was not a candidate
    heads: int                 # full-vocabulary heads run: exit heads and the output head (0: head-free)
    candidates: tuple[int, ...]  # this step's candidates for the next token, best first
    draft_ms: float            # graph start to the draft's candidates (0 unless timing is on)
    predictor_ms: float
    verify_ms: float
    graph: GraphInfo


@dataclass(frozen=True)
class GraphInfo:
    """What the last decode's graph held beyond the stock one."""

    probes: int         # layers with a candidate probe (the last layer's included)
    draft: bool         # the draft head (else the candidates were an input, or there were none)
    depth_mask: bool    # the per-layer depth bias (only while a cached cell is shallow)
    eval_callback: bool  # the scheduler called back per node (only while a probe, capture or timing asks)


def _pointer(array: np.ndarray, ctype) -> ctypes._Pointer:
    """A pointer to the array's data for the call at hand (the caller keeps the array alive). Made from the
    address: numpy's data_as builds a reference cycle per call, which only the garbage collector frees."""
    return ctypes.cast(array.ctypes.data, ctypes.POINTER(ctype))


def _floats(array: np.ndarray) -> ctypes._Pointer:
    return _pointer(array, ctypes.c_float)


def _int32_array(values: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_int32 * len(values))(*values)


class LogitsViews:
    """The logits of a llama_context's outputs as numpy arrays, read in place: views kept by address. llama.cpp writes
    every decode's logits into the same buffer (a larger one only when a batch needs more rows), so a view made once
    reads every later decode's logits at its address. Made anew at every draw, the view cost 5 µs warm and about
    60 µs right after a decode (numpy.ctypeslib's Python, run cold)."""

    MAX_VIEWS = 64  # rows of a verification batch each have their own; past this many, the kept ones are dropped

    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab
        self._views: dict[int, np.ndarray] = {}

    def __call__(self, ctx: _llama.llama_context_p, row: int = -1) -> np.ndarray:
        """Output `row`'s logits of the last decode on `ctx` (-1: its last output): a view valid until the next decode."""
        address = logits_address(ctx, row)
        if not address:
            raise SpecEEError(f"no logits for output {row} of the last decode")
        view = self._views.get(address)
        if view is None:
            if len(self._views) >= self.MAX_VIEWS:
                self._views.clear()
            view = np.frombuffer((ctypes.c_float * self.n_vocab).from_address(address), dtype=np.float32)
            self._views[address] = view
        return view


class Context:
    """A llama_context over `model`, single sequence, optionally with early exit enabled."""

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 2048,
        n_batch: int = 512,
        n_threads: int = 2,
        flash_attn: str = "auto",
        swa_full: bool = True,
    ):
        """`flash_attn`: "on", "off", or "auto" (llama.cpp's default: on wherever the device runs it; on the CPU
        a decode step costs about 10 % less than with it off).
        `swa_full`: a sliding-window model keeps every token's K/V in its window cache (llama.cpp's
        default), so that truncating the cache never leaves the window short of tokens it needs."""
        self.model = model
        if n_batch < MIN_BATCH:
            # a prompt split into chunks must not leave a one-token chunk, which would run as a step that may exit
            raise SpecEEError(f"n_batch must be at least {MIN_BATCH} (a prompt is decoded in batches, which never"
                              f" exit), got {n_batch}")
        params = _llama.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = 1
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        if flash_attn not in FLASH_ATTN:
            raise SpecEEError(f"unknown flash attention setting {flash_attn!r}: choose one of {', '.join(FLASH_ATTN)}")
        params.flash_attn_type = FLASH_ATTN[flash_attn]
        params.swa_full = swa_full
        self._ctx = _llama.llama_init_from_model(model.handle, params)
        if not self._ctx:
            rpc.check_workers(model.workers)
            raise SpecEEError(f"llama.cpp could not create a context of {n_ctx} tokens for {model.info.path}")
        self._mem = _llama.llama_get_memory(self._ctx)
        self.n_ctx = _llama.llama_n_ctx(self._ctx)
        self.n_batch = _llama.llama_n_batch(self._ctx)  # llama.cpp clamps it to the requested n_ctx
        self.n_vocab = model.info.n_vocab
        self._logits = LogitsViews(self.n_vocab)
        # a step's batch, kept: a decode of one token writes its id here (building the array and the batch per step
        # cost about 17 µs of the step's Python)
        self._step_token = (_llama.llama_token * 1)()
        self._step_batch = _llama.llama_batch_get_one(self._step_token, 1)
        # with the CPU the only device, llama_decode returns once the graph has run: nothing to wait for
        self._waits = rpc.libggml.ggml_backend_dev_count() > 1
        self.n_cand = 0
        self.kv_mode: str | None = None
        self._probe_callback: ProbeCallback | None = None
        # kept alive as long as the context; it holds the context weakly, so that no reference cycle
        # delays llama_free until the garbage collector finds it
        this = weakref.ref(self)
        self._c_callback = probe_callback_t(lambda il, z, n, _: this()._on_probe(il, z, n) if this() else 0)
        self._callback_error: BaseException | None = None
        self._cand_view: np.ndarray | None = None

    # --- early exit set-up -------------------------------------------------------------------

    def enable_early_exit(self, n_cand: int = 4, kv_mode: str = "mask") -> None:
        """Build candidate probes into single-token graphs; `kv_mode` handles the skipped layers' K/V."""
        if kv_mode not in KV_MODES:
            raise SpecEEError(f"unknown KV mode {kv_mode!r}: choose one of {', '.join(KV_MODES)}")
        if not 1 <= n_cand <= MAX_CANDIDATES:
            raise SpecEEError(f"the number of candidates must be in 1..{MAX_CANDIDATES}, got {n_cand}")
        rc = C["llama_specee_enable"](self._ctx, n_cand, KV_MODES[kv_mode])
        if rc == -1:
            raise UnsupportedModelError(
                f"early exit does not support the {self.model.info.arch!r} architecture (supported: {SUPPORTED})"
            )
        if rc == -4:
            raise UnsupportedModelError(
                f"KV mode 'fill' cannot rebuild this model's K/V ({self.model.info.arch}: fused or scaled"
                " projections, or a rotated KV cache); use 'mask' or 'full'"
            )
        if rc != 0:
            raise SpecEEError(f"llama_specee_enable failed ({rc})")
        self._hand_over_lm_rows()
        self.n_cand = n_cand
        self.kv_mode = kv_mode
        # a new early-exit state in C: no callback yet, and its candidate-logits buffer moved
        self._probe_callback = None
        self._cand_view = None

    def _hand_over_lm_rows(self) -> None:
        """The probes read their candidates' rows of the LM head with get_rows, which an output head that
        llama.cpp repacked for the CPU's matrix kernels (Q4_0, IQ4_NL, Q4_K, ... on AVX2 and ARM) cannot give:
        a model whose output head is not its token embedding then needs a plain copy, read from the GGUF."""
        ggml_type = ctypes.c_int32(-1)
        size = C["llama_specee_lm_rows_size"](self._ctx, ctypes.byref(ggml_type))
        if not size:
            return
        path = self.model.info.path
        output = GGUFIndex(path).tensor(OUTPUT_WEIGHT)
        if output is None or int(output.tensor_type) != ggml_type.value or output.n_bytes != size:
            raise SpecEEError(f"{path.name}'s output head, repacked for this CPU, needs a plain copy for early exit's"
                              f" probes, and the file holds no {OUTPUT_WEIGHT} that llama.cpp loaded")
        data = np.ascontiguousarray(output.data)  # a view of the file's memory map: C copies it
        rc = C["llama_specee_set_lm_rows"](self._ctx, ggml_type.value, data.ctypes.data, size)
        if rc != 0:
            raise SpecEEError(f"early exit could not keep a copy of {path.name}'s output head"
                              f" ({size / 2**20:.0f} MiB) for its probes ({rc})")

    def set_probe_layers(self, layers: Sequence[int]) -> None:
        """Layers where the token may stop (the schedule), each in [0, n_layer): after the last layer a stop
        skips the output head. Graphs hold probes only while one of them has an exit on or a callback is
        set; [] turns early exit off."""
        self._require_early_exit()
        n_layer = self.model.info.n_layer
        for il in layers:
            if not 0 <= il < n_layer:
                raise SpecEEError(f"probe layer {il} is out of range [0, {n_layer})")
        if C["llama_specee_set_probe_layers"](self._ctx, _int32_array(layers), len(layers)) != 0:
            raise SpecEEError("llama_specee_set_probe_layers failed")

    def set_candidates(self, token_ids: Sequence[int]) -> None:
        """Candidate ids for the next single-token decode (ignored once a draft head is set)."""
        self._require_early_exit()
        if len(token_ids) != self.n_cand:
            raise SpecEEError(f"expected {self.n_cand} candidates, got {len(token_ids)}")
        if C["llama_specee_set_candidates"](self._ctx, _int32_array(token_ids), len(token_ids)) != 0:
            raise SpecEEError(f"candidate ids must be in [0, {self.n_vocab}): {list(token_ids)}")

    def set_draft(self, *, w_embd: np.ndarray, w_hidden: np.ndarray, bias: np.ndarray, norm: np.ndarray, eps: float,
                  head: np.ndarray, vocab_map: np.ndarray, quant: str = "q8_0") -> None:
        """Run the linear draft head inside every single-token graph; its top-k become the candidates.

        g = w_embd @ emb(token) + w_hidden @ (rms_norm(h_prev) * norm) + bias, candidates =
        vocab_map[top-k(head @ g)], where h_prev is the hidden state the previous step left with. The
        matrices ([out, in]) are stored as `quant` on the backend that runs the layers.
        """
        self._require_early_exit()
        if quant not in DRAFT_TYPES:
            raise SpecEEError(f"draft matrices are stored as {', '.join(DRAFT_TYPES)}, not {quant!r}")
        n_embd = self.model.info.n_embd
        w_embd, w_hidden, head = (np.ascontiguousarray(a, dtype=np.float32) for a in (w_embd, w_hidden, head))
        bias, norm = (np.ascontiguousarray(a, dtype=np.float32).reshape(-1) for a in (bias, norm))
        vocab_map = np.ascontiguousarray(vocab_map, dtype=np.int32)
        if (w_embd.shape != (n_embd, n_embd) or w_hidden.shape != (n_embd, n_embd) or bias.shape != (n_embd,)
                or norm.shape != (n_embd,) or head.ndim != 2 or head.shape[1] != n_embd
                or vocab_map.shape != (head.shape[0],)):
            raise SpecEEError(f"draft head shapes do not fit n_embd {n_embd}")
        rc = C["llama_specee_set_draft"](self._ctx, DRAFT_TYPES[quant], head.shape[0], _floats(w_embd),
                                         _floats(w_hidden), _floats(bias), _floats(norm), eps, _floats(head),
                                         _pointer(vocab_map, ctypes.c_int32))
        if rc != 0:
            raise SpecEEError(f"llama_specee_set_draft failed ({rc}): draft ids must be in [0, {self.n_vocab}) and"
                              f" at least {self.n_cand}, rows a multiple of the {quant} block")

    def set_predictor(self, layer: int, weights: Sequence[np.ndarray], biases: Sequence[np.ndarray]) -> None:
        """The native exit predictor after `layer`: dense layers ([out, in] weights), ReLU between, a sigmoid
        out. It decides nothing until set_exit gives the layer an exit kind and threshold."""
        self._require_early_exit()
        weights = [np.ascontiguousarray(w, np.float32) for w in weights]
        biases = [np.ascontiguousarray(b, np.float32).reshape(-1) for b in biases]
        n_in = 3 * self.n_cand
        for j, (w, b) in enumerate(zip(weights, biases, strict=True)):
            if w.ndim != 2 or w.shape[1] != n_in or b.shape != (w.shape[0],):
                raise SpecEEError(f"predictor for layer {layer}: dense layer {j} has weight {w.shape} and bias {b.shape},"
                                  f" expected [out, {n_in}] and [out]")
            n_in = w.shape[0]
        if not weights or n_in != 1:
            raise SpecEEError(f"predictor for layer {layer}: {3 * self.n_cand} features in, 1 out")
        dims = [weights[0].shape[1], *(w.shape[0] for w in weights)]
        params = np.concatenate([np.concatenate([w.reshape(-1), b]) for w, b in zip(weights, biases)])
        rc = C["llama_specee_set_predictor"](self._ctx, layer, len(weights), _int32_array(dims), _floats(params))
        if rc != 0:
            raise SpecEEError(f"predictor for layer {layer} rejected ({rc}): layers in [0, {self.model.info.n_layer})")

    def clear_predictors(self) -> None:
        self._require_early_exit()
        for layer in range(self.model.info.n_layer):
            C["llama_specee_set_predictor"](self._ctx, layer, 0, None, None)

    def set_exit(self, layer: int, kind: ExitKind, threshold: float) -> None:
        """How `layer`'s predictor lets a token leave: above `threshold`, verified by the exit head or
        head-free (NONE: the layer is off and its probe leaves the graph)."""
        self._require_early_exit()
        rc = C["llama_specee_set_exit"](self._ctx, layer, int(kind), threshold)
        if rc == -1:
            raise SpecEEError(f"layer {layer} has no native predictor")
        if rc != 0:
            raise SpecEEError(f"layer {layer} cannot exit {ExitKind(kind).label}: the last layer's exit is head-free or off")

    def predictor_prob(self, layer: int, features: np.ndarray) -> float:
        """The native predictor of `layer` on one feature vector (3 * n_cand floats): its exit probability."""
        self._require_early_exit()
        x = np.ascontiguousarray(features, dtype=np.float32)
        if x.shape != (3 * self.n_cand,):
            raise SpecEEError(f"expected {3 * self.n_cand} features, got shape {x.shape}")
        prob = C["llama_specee_predictor_prob"](self._ctx, layer, _floats(x))
        if prob < 0:
            raise SpecEEError(f"layer {layer} has no native predictor")
        return float(prob)

    def decide(self, layers: Sequence[int], cand_logits: np.ndarray, verified: Sequence[bool]) -> Decision:
        """The native exit rule on given checks (what decode runs after each probe): layers in order,
        cand_logits [len(layers), n_cand], verified[i] whether layer i's exit head would put a candidate first."""
        self._require_early_exit()
        z = np.ascontiguousarray(cand_logits, dtype=np.float32).reshape(len(layers), self.n_cand)
        ok = np.ascontiguousarray(verified, dtype=np.uint8)
        out = Decision()
        rc = C["llama_specee_decide"](self._ctx, len(layers), _int32_array(layers), _floats(z),
                                      _pointer(ok, ctypes.c_uint8), ctypes.byref(out))
        if rc != 0:
            raise SpecEEError(f"layers must be in [0, {self.model.info.n_layer}): {list(layers)}")
        return out

    def set_timing(self, on: bool) -> None:
        """Time the draft inside the graph (one extra scheduler split per token)."""
        self._require_early_exit()
        C["llama_specee_set_timing"](self._ctx, on)

    def set_lookup(self, token_ids: Sequence[int]) -> None:
        """Candidates for the next single-token decode only, ahead of the draft head's: they take the first
        slots and the draft fills the rest with its best other tokens (none repeats). At most n_cand
        distinct ids; an empty list leaves every slot to the draft."""
        self._require_early_exit()
        if C["llama_specee_set_lookup"](self._ctx, _int32_array(token_ids), len(token_ids)) != 0:
            raise SpecEEError(f"lookup candidates need a draft head and at most {self.n_cand} distinct ids"
                              f" in [0, {self.n_vocab}): {list(token_ids)}")

    def step_info(self) -> StepInfo:
        """What the last single-token decode did; inside a probe callback, the step so far."""
        self._require_early_exit()
        info = TokenInfo()
        C["llama_specee_get_token_info"](self._ctx, ctypes.byref(info))
        return StepInfo(
            exit_layer=None if info.exit_layer < 0 else info.exit_layer,
            exit_kind=ExitKind(info.exit_kind),
            probes=info.n_probes,
            verify_failures=info.n_verify_fail,
            heads=info.n_heads,
            candidates=tuple(info.cand[: info.n_cand]),
            draft_ms=info.t_draft_us / 1e3,
            predictor_ms=info.t_predictor_us / 1e3,
            verify_ms=info.t_verify_us / 1e3,
            graph=GraphInfo(info.graph_probes, bool(info.graph_draft), bool(info.graph_depth_mask),
                            bool(info.graph_eval_callback)),
        )

    def set_probe_callback(self, callback: ProbeCallback | None) -> None:
        """A Python policy, called at each active probe (it overrides native predictors); None removes it."""
        self._require_early_exit()
        self._probe_callback = callback
        c_callback = self._c_callback if callback else ctypes.cast(None, probe_callback_t)
        C["llama_specee_set_callback"](self._ctx, c_callback, None)

    def probe_logits(self) -> np.ndarray:
        """Inside the probe callback: the probed layer's full-vocabulary exit logits (a copy)."""
        ptr = C["llama_specee_probe_logits"](self._ctx)
        if not ptr:
            raise SpecEEError("probe_logits() is only valid inside a probe callback")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def exit_head_logits(self) -> np.ndarray:
        """After an exit: the full-vocabulary logits of its layer (a head-free exit computes them now; the
        step skipped them), a copy. Raises without an exit."""
        ptr = C["llama_specee_exit_head_logits"](self._ctx) if self.n_cand else None
        if not ptr:
            raise SpecEEError("exit_head_logits() needs a token that exited (and memory for the exit head)")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def fail_allocations(self, n: int) -> None:
        """Testing: the next n allocations of the exit head and fill graphs fail, as an out-of-memory would."""
        self._require_early_exit()
        C["llama_specee_fail_allocations"](self._ctx, n)

    def _on_probe(self, il: int, cand_logits, n_cand: int) -> int:
        if self._callback_error is not None:
            return ExitKind.NONE
        if self._cand_view is None:  # the buffer is fixed for the life of the early-exit state
            self._cand_view = np.ctypeslib.as_array(cand_logits, shape=(n_cand,))
        try:
            return int(self._probe_callback(il, self._cand_view))
        except BaseException as e:  # noqa: BLE001 - re-raised after llama_decode returns
            self._callback_error = e
            return ExitKind.NONE

    def _require_early_exit(self) -> None:
        if not self.n_cand:
            raise SpecEEError("early exit is not enabled on this context")

    # --- decoding ----------------------------------------------------------------------------

    @property
    def handle(self) -> _llama.llama_context_p:
        """The llama_context, for llama.cpp's sampler chain to read logits from."""
        return self._ctx

    @property
    def n_past(self) -> int:
        return _llama.llama_memory_seq_pos_max(self._mem, SEQ) + 1

    def decode(self, tokens: Sequence[int], *, output_all: bool = False,
               cancel: Callable[[], bool] | None = None) -> int | None:
        """Append `tokens`; logits for the last one (for each, with output_all).

        Returns the exit layer, or None for full depth. output_all also makes the last layer's
        hidden state exist for every token (llama.cpp otherwise prunes it to the output rows).
        cancel: asked before each llama_decode of n_batch tokens after the first; True raises
        DecodeCancelled, with the batches decoded so far in the cache.
        """
        if not tokens:
            raise SpecEEError("nothing to decode")
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextFullError(
                f"context full: {self.n_past} + {len(tokens)} tokens exceed the context of {self.n_ctx}"
                " (use a larger -c/--ctx-size or clear the conversation)"
            )
        for t in tokens:
            if not 0 <= t < self.n_vocab:
                raise SpecEEError(f"token id {t} is out of range [0, {self.n_vocab})")
        if output_all and len(tokens) > self.n_batch:  # logits(row) reads the last llama_decode's outputs only
            raise SpecEEError(f"a decode with every row's logits takes at most n_batch = {self.n_batch} tokens,"
                              f" got {len(tokens)}")
        tokens = list(tokens)
        for i, chunk in enumerate([tokens] if len(tokens) <= self.n_batch else self._chunks(tokens)):
            if i and cancel is not None and cancel():
                raise DecodeCancelled(f"cancelled after {self.n_past} of the prompt's tokens")
            if output_all:
                rc = self._decode_all(chunk, self.n_past)
            elif len(chunk) == 1:  # a step
                self._step_token[0] = chunk[0]
                rc = _llama.llama_decode(self._ctx, self._step_batch)
            else:  # llama_batch_get_one asks for the logits of the chunk's last token
                array = (_llama.llama_token * len(chunk))(*chunk)
                rc = _llama.llama_decode(self._ctx, _llama.llama_batch_get_one(array, len(chunk)))
            self._wait_for_decode()
            self._raise_callback_error()
            if rc == 1:
                raise ContextFullError("context full: no KV cache slot for the batch")
            if rc != 0:
                raise SpecEEError(f"llama_decode failed ({rc})")
        return self.exit_layer

    def _chunks(self, tokens: list[int]) -> list[list[int]]:
        """`tokens` in llama_decode calls of at most n_batch tokens, none of a single token unless `tokens`
        is one: a single-token decode is a step that may exit early, a batch (a prompt) never does."""
        chunks = [tokens[i : i + self.n_batch] for i in range(0, len(tokens), self.n_batch)]
        if len(chunks) > 1 and len(chunks[-1]) == 1:
            chunks[-1].insert(0, chunks[-2].pop())
        return chunks

    def _decode_all(self, chunk: Sequence[int], pos0: int) -> int:
        batch = _llama.llama_batch_init(len(chunk), 0, 1)
        try:
            for i, t in enumerate(chunk):
                batch.token[i] = t
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = SEQ
                batch.logits[i] = True
            batch.n_tokens = len(chunk)
            return _llama.llama_decode(self._ctx, batch)
        finally:
            _llama.llama_batch_free(batch)

    def resume(self) -> int | None:
        """Continue the last stopped token from the layer after its exit (probes still active)."""
        rc = C["llama_specee_resume"](self._ctx)
        self._wait_for_decode()
        self._raise_callback_error()
        if rc < 0:
            raise SpecEEError(f"llama_specee_resume failed ({rc})")
        if rc == 1:
            raise SpecEEError("nothing to resume: the last token did not stop early")
        return self.exit_layer

    def _wait_for_decode(self) -> None:
        """Wait for the decode's work (on an asynchronous backend, a GPU or RPC workers, llama_decode returns once
        the graph is queued), so that a step's time holds its compute, not the sampling that reads its logits; and
        with layers on RPC workers, see now a worker lost during it: a lost worker's results read as zeros, so
        nothing it returned may be used. (With the CPU the only device there is nothing to wait for: the decode has
        run.)"""
        if self._waits:
            _llama.llama_synchronize(self._ctx)
        if self.model.workers:
            rpc.check_workers(self.model.workers)

    def _raise_callback_error(self) -> None:
        if self._callback_error is not None:
            error, self._callback_error = self._callback_error, None
            raise error

    @property
    def exit_layer(self) -> int | None:
        il = C["llama_specee_exit_layer"](self._ctx) if self.n_cand else -1
        return None if il < 0 else il

    def logits(self, index: int = -1) -> np.ndarray:
        """Logits of the last decoded token, or of the index-th token of an output_all decode (a view
        valid until the next decode)."""
        return self._logits(self._ctx, index)

    # --- hidden states (calibration) ---------------------------------------------------------

    def set_capture_layers(self, layers: Sequence[int]) -> None:
        """Record these layers' outputs (before the final norm) for every token of each decode."""
        self._require_early_exit()
        if C["llama_specee_set_capture_layers"](self._ctx, _int32_array(layers), len(layers)) != 0:
            raise SpecEEError(f"capture layers must be in [0, {self.model.info.n_layer}): {list(layers)}")

    def captured(self, layer: int) -> np.ndarray:
        """[n_rows, n_embd] hidden states of `layer` from the last decode (a copy)."""
        n_rows = ctypes.c_int32(0)
        ptr = C["llama_specee_get_capture"](self._ctx, layer, ctypes.byref(n_rows))
        if not ptr:
            return np.zeros((0, self.model.info.n_embd), dtype=np.float32)
        return np.ctypeslib.as_array(ptr, shape=(n_rows.value, self.model.info.n_embd)).copy()

    # --- KV cache ----------------------------------------------------------------------------

    def cell_depth(self, pos: int) -> int:
        """Last layer whose K/V the token at `pos` holds (n_layer - 1 when complete), -1 if absent."""
        return C["llama_specee_cell_depth"](self._ctx, SEQ, pos)

    def clear(self) -> None:
        _llama.llama_memory_clear(self._mem, True)
        self._forget()

    def truncate(self, n_keep: int) -> None:
        """Forget every position from `n_keep` on."""
        if n_keep >= self.n_past:
            return
        if not _llama.llama_memory_seq_rm(self._mem, SEQ, n_keep, -1):
            raise SpecEEError(f"could not remove positions from {n_keep} on")
        self._forget()

    def draft_from_row(self, row: int) -> None:
        """After a batch decoded with output_all and the draft in its graph (probe layers set): the next draft
        reads output `row`'s last-layer hidden state instead of the last row's. Call it after truncating the
        cache to that row's token (truncation forgets the draft's input, not the batch's rows)."""
        self._require_early_exit()
        rc = C["llama_specee_draft_from_row"](self._ctx, row)
        if rc == -1:
            raise SpecEEError("draft_from_row() needs a draft head")
        if rc != 0:
            raise SpecEEError(f"the last batch kept no output row {row} for the draft (at most 64 rows, all output,"
                              " decoded with the draft in the graph)")

    def _forget(self) -> None:
        """The early-exit state carries the last token's hidden state (the next draft's input) and, in full
        mode, a stopped token's pending layers: neither may outlive the tokens they belong to."""
        if self.n_cand:
            C["llama_specee_forget"](self._ctx)

    def close(self) -> None:
        self._probe_callback = None  # a Python policy holds this context: no cycle outlives close
        if getattr(self, "_ctx", None):
            _llama.llama_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        self.close()
