"""ctypes bindings of the C API that patches/ add to libllama (include/llama-specee.h).

The library is the one llama-cpp-python loaded; the functions exist only in the patched build.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from specee_edge.errors import SETUP_HINT, RuntimeMissingError

try:
    import llama_cpp
    from llama_cpp import llama_cpp as _llama
except ModuleNotFoundError as e:
    if not (e.name or "").startswith("llama_cpp"):
        raise
    raise RuntimeMissingError(f"the patched llama.cpp runtime is not installed: {SETUP_HINT}") from None
except ImportError as e:
    raise RuntimeMissingError(f"llama_cpp cannot be imported ({e}): {SETUP_HINT}") from None

MAX_CANDIDATES = 8

KV_MODES = {"mask": 0, "full": 1, "fill": 2}

_lib = _llama._lib

llama_context_p = _llama.llama_context_p_ctypes
llama_model_p = _llama.llama_model_p_ctypes


class TokenInfo(ctypes.Structure):
    """struct llama_specee_token_info: what the last single-token decode did."""

    _fields_ = [
        ("exit_layer", ctypes.c_int32),
        ("exit_kind", ctypes.c_int32),
        ("n_probes", ctypes.c_int32),
        ("n_verify_fail", ctypes.c_int32),
        ("n_heads", ctypes.c_int32),
        ("n_cand", ctypes.c_int32),
        ("cand", ctypes.c_int32 * MAX_CANDIDATES),
        ("t_draft_us", ctypes.c_int64),
        ("t_predictor_us", ctypes.c_int64),
        ("t_verify_us", ctypes.c_int64),
        ("graph_probes", ctypes.c_int32),
        ("graph_draft", ctypes.c_int32),
        ("graph_depth_mask", ctypes.c_int32),
        ("graph_eval_callback", ctypes.c_int32),
    ]


class Decision(ctypes.Structure):
    """struct llama_specee_decision: what the exit rule decided over a sequence of checks."""

    _fields_ = [
        ("exit_layer", ctypes.c_int32),
        ("exit_kind", ctypes.c_int32),
        ("n_probes", ctypes.c_int32),
        ("n_verify_fail", ctypes.c_int32),
    ]


# int32_t (*)(int32_t il, const float * cand_logits, int32_t n_cand, void * user_data): an exit kind
probe_callback_t = ctypes.CFUNCTYPE(
    ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_float), ctypes.c_int32, ctypes.c_void_p
)

_floats = ctypes.POINTER(ctypes.c_float)

_SIGNATURES: dict[str, tuple[list, object]] = {
    "llama_specee_supported": ([llama_model_p], ctypes.c_int32),
    "llama_specee_layer_device": ([llama_model_p, ctypes.c_int32], ctypes.c_char_p),
    "llama_specee_arch": (
        [ctypes.c_int32, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_int32)],
        ctypes.c_int32,
    ),
    "llama_specee_enable": ([llama_context_p, ctypes.c_int32, ctypes.c_int], ctypes.c_int32),
    "llama_specee_set_probe_layers": (
        [llama_context_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32],
        ctypes.c_int32,
    ),
    "llama_specee_set_candidates": (
        [llama_context_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32],
        ctypes.c_int32,
    ),
    "llama_specee_set_callback": ([llama_context_p, probe_callback_t, ctypes.c_void_p], None),
    "llama_specee_probe_logits": ([llama_context_p], ctypes.POINTER(ctypes.c_float)),
    "llama_specee_exit_head_logits": ([llama_context_p], ctypes.POINTER(ctypes.c_float)),
    "llama_specee_exit_layer": ([llama_context_p], ctypes.c_int32),
    "llama_specee_resume": ([llama_context_p], ctypes.c_int32),
    "llama_specee_forget": ([llama_context_p], None),
    "llama_specee_draft_from_row": ([llama_context_p, ctypes.c_int32], ctypes.c_int32),
    "llama_specee_fail_allocations": ([llama_context_p, ctypes.c_int32], None),
    "llama_specee_set_capture_layers": (
        [llama_context_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32],
        ctypes.c_int32,
    ),
    "llama_specee_get_capture": (
        [llama_context_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)],
        ctypes.POINTER(ctypes.c_float),
    ),
    "llama_specee_cell_depth": ([llama_context_p, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32),
    "llama_specee_set_draft": (
        [llama_context_p, ctypes.c_int32, ctypes.c_int32, _floats, _floats, _floats, _floats, ctypes.c_float,
         _floats, ctypes.POINTER(ctypes.c_int32)],
        ctypes.c_int32,
    ),
    "llama_specee_set_lookup": ([llama_context_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32], ctypes.c_int32),
    "llama_specee_lm_rows_size": ([llama_context_p, ctypes.POINTER(ctypes.c_int32)], ctypes.c_size_t),
    "llama_specee_set_lm_rows": ([llama_context_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int32),
    "llama_specee_set_predictor": (
        [llama_context_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), _floats],
        ctypes.c_int32,
    ),
    "llama_specee_set_exit": ([llama_context_p, ctypes.c_int32, ctypes.c_int, ctypes.c_float], ctypes.c_int32),
    "llama_specee_decide": (
        [llama_context_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), _floats, ctypes.POINTER(ctypes.c_uint8),
         ctypes.POINTER(Decision)],
        ctypes.c_int32,
    ),
    "llama_specee_predictor_prob": ([llama_context_p, ctypes.c_int32, _floats], ctypes.c_float),
    "llama_specee_set_timing": ([llama_context_p, ctypes.c_bool], None),
    "llama_specee_get_token_info": ([llama_context_p, ctypes.POINTER(TokenInfo)], ctypes.c_int32),
}


def _bind() -> dict[str, ctypes._CFuncPtr]:
    functions = {}
    for name, (argtypes, restype) in _SIGNATURES.items():
        try:
            fn = getattr(_lib, name)
        except AttributeError:
            raise RuntimeMissingError(
                f"llama_cpp in {Path(llama_cpp.__file__).parent} is not the patched runtime (its libllama lacks "
                f"{name}): {SETUP_HINT}"
            ) from None
        fn.argtypes = argtypes
        fn.restype = restype
        functions[name] = fn
    return functions


C = _bind()

# llama.cpp's llama_get_logits_ith, bound again to return the address (llama-cpp-python's binding returns a float
# pointer, from which numpy's view is made in numpy.ctypeslib's Python): item access on the library makes a function
# object of its own, leaving llama-cpp-python's as it is
logits_address = _lib["llama_get_logits_ith"]
logits_address.argtypes = [llama_context_p, ctypes.c_int32]
logits_address.restype = ctypes.c_void_p
