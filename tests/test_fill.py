"""Fill's K/V against a numpy reference of the same projection, read back from llama.cpp's own cache.

After a token stops at layer e in fill mode, each skipped layer j > e holds K = RoPE(K_norm(W_k ·
attn_norm_j(h_e))) and V = W_v · attn_norm_j(h_e) for it, with RoPE at layer j's own frequency. The cache
is read through llama.cpp's sequence state (llama_state_seq_get_data), parsed here; the reference is
computed in numpy from the GGUF's weights and the exit layer's captured output h_e. Stops at several
depths on a tiny llama, and on a tiny gemma3 whose window layers (RoPE base 1,000) and global layers
(10,000) live in two caches.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np
import pytest
from llama_cpp import llama_cpp as _llama

from specee_edge.exits import ExitKind
from specee_edge.gguf_index import GGUFIndex
from specee_edge.runtime import Context, Model
from tests.conftest import supported_model_path, tiny_model_path

PROMPT = [1, 5, 9, 14, 3, 7, 2]  # shorter than gemma's window: no window cell is left out of the state
STOP_TOKEN = 11


class Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def array(self, dtype, count: int) -> np.ndarray:
        out = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.at)
        self.at += out.nbytes
        return out


def cache_kv(reader: Reader, layers: list[int], n_embd_kv: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """One cache's K and V per layer, [cells, n_embd_kv] each (llama_kv_cache::state_write, F16, no cell ext)."""
    assert reader.take("I") == 1  # one stream
    n_cells = reader.take("I")
    for _ in range(n_cells):
        _pos, n_seq = reader.take("iI")
        reader.take(f"{n_seq}i")
    v_trans, n_layer = reader.take("II")
    assert n_layer == len(layers)
    keys = {}
    for il in layers:
        k_type, row = reader.take("iQ")
        assert k_type == 1 and row == 2 * n_embd_kv  # F16
        keys[il] = reader.array(np.float16, n_cells * n_embd_kv).reshape(n_cells, n_embd_kv).astype(np.float32)
    out = {}
    for il in layers:
        if v_trans:
            v_type, el, width = reader.take("iII")
            assert (v_type, el, width) == (1, 2, n_embd_kv)
            v = reader.array(np.float16, n_cells * n_embd_kv).reshape(n_embd_kv, n_cells).T
        else:
            v_type, row = reader.take("iQ")
            v = reader.array(np.float16, n_cells * n_embd_kv).reshape(n_cells, n_embd_kv)
        out[il] = (keys[il], v.astype(np.float32))
    return out


def rope(x: np.ndarray, pos: int, base: float, neox: bool) -> np.ndarray:
    """x [n_head, d]; adjacent pairs (llama) or halves (neox)."""
    d = x.shape[-1]
    theta = pos * base ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(theta), np.sin(theta)
    if neox:
        a, b = x[:, : d // 2], x[:, d // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=1)
    a, b = x[:, 0::2], x[:, 1::2]
    out = np.empty_like(x)
    out[:, 0::2], out[:, 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def reference_kv(index: GGUFIndex, il: int, h: np.ndarray, pos: int, base: float, neox: bool, eps: float):
    def tensor(name: str) -> np.ndarray:
        t = index.tensor(f"blk.{il}.{name}")
        return None if t is None else np.asarray(t.data, dtype=np.float32)

    x = rms(h, eps) * tensor("attn_norm.weight")
    k, v = x @ tensor("attn_k.weight").T, x @ tensor("attn_v.weight").T
    k_norm = tensor("attn_k_norm.weight")
    head_dim = k_norm.shape[0] if k_norm is not None else index.value(f"{index.value('general.architecture')}.rope.dimension_count")
    k = k.reshape(-1, head_dim)
    if k_norm is not None:
        k = rms(k, eps) * k_norm
    return rope(k, pos, base, neox).reshape(-1), v


def filled(model: Model, exit_layer: int) -> tuple[bytes, np.ndarray]:
    """The sequence state after a token stopped (head-free) at exit_layer in fill mode, and its h_exit."""
    ctx = Context(model, n_threads=1, n_ctx=64)
    ctx.enable_early_exit(4, "fill")
    ctx.set_candidates([1, 2, 3, 4])
    ctx.set_probe_callback(lambda il, z: ExitKind.HEAD_FREE if il == exit_layer else ExitKind.NONE)
    ctx.set_probe_layers([exit_layer])
    ctx.set_capture_layers([exit_layer])
    ctx.decode(PROMPT)
    ctx.decode([STOP_TOKEN])
    assert ctx.exit_layer == exit_layer and ctx.cell_depth(len(PROMPT)) == model.info.n_layer - 1
    h = ctx.captured(exit_layer)[-1].astype(np.float64)
    size = _llama.llama_state_seq_get_size(ctx._ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    assert _llama.llama_state_seq_get_data(ctx._ctx, buf, size, 0) == size
    ctx.close()
    return bytes(buf), h


def check(model: Model, exit_layer: int, caches: list[list[int]], bases: dict[int, float], neox: bool) -> int:
    index = GGUFIndex(model.info.path)
    arch = index.value("general.architecture")
    eps = float(index.value(f"{arch}.attention.layer_norm_rms_epsilon"))
    n_kv = index.tensor("blk.0.attn_k.weight").data.shape[0]
    state, h = filled(model, exit_layer)
    reader = Reader(state)
    assert reader.take("Ii") == (0xAF143CD8, 0)  # llama.cpp's io magic, then the sequence
    checked = 0
    for layers in caches:
        kv = cache_kv(reader, layers, n_kv)
        for il in layers:
            if il <= exit_layer:
                continue
            k_ref, v_ref = reference_kv(index, il, h, len(PROMPT), bases[il], neox, eps)
            k, v = kv[il]
            np.testing.assert_allclose(k[len(PROMPT)], k_ref, rtol=2e-2, atol=2e-3, err_msg=f"K of layer {il}")
            np.testing.assert_allclose(v[len(PROMPT)], v_ref, rtol=2e-2, atol=2e-3, err_msg=f"V of layer {il}")
            checked += 1
    assert reader.at == len(state)
    return checked


@pytest.mark.parametrize("exit_layer", [0, 1, 2])
def test_fill_writes_the_projection_of_the_exit_state_llama(tiny_dir, exit_layer):
    model = Model(tiny_model_path(tiny_dir, "llama"))
    n = model.info.n_layer
    assert check(model, exit_layer, [list(range(n))], dict.fromkeys(range(n), 10000.0), neox=False) == n - 1 - exit_layer


def test_fill_writes_window_and_global_layers_of_gemma3(tiny_dir):
    """swa_pattern 3: layers 0, 1 (window, base 1,000) and 2 (global, base 10,000) repeat; the base cache
    holds the global layers, the window cache the others."""
    model = Model(supported_model_path(tiny_dir, "gemma3-swa", n_layer=6))
    n = model.info.n_layer
    global_layers = [il for il in range(n) if il % 3 == 2]
    window_layers = [il for il in range(n) if il % 3 != 2]
    bases = {il: 10000.0 if il in global_layers else 1000.0 for il in range(n)}
    assert check(model, 0, [global_layers, window_layers], bases, neox=True) == n - 1
