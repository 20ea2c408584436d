"""Requantize a GGUF with llama.cpp's own quantize API (llama_model_quantize, what `llama-quantize` runs).

Used to try one model in every weight type a user's GGUF may hold: the tests' weight-type matrix, the
bench of a model without a pack, and tools/batch_costs_by_type.py. `pure` gives every matrix the asked
type (llama.cpp's `--pure`); without it llama.cpp picks its usual mix (the output head in Q6_K, some
layers one step up). Either way a matrix whose rows do not split into the type's blocks (256 values for
the K-quants) falls back to a type that fits, as llama-quantize does: `weight_types` says what a file holds.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from llama_cpp import llama_cpp as _llama

from specee_edge.errors import SpecEEError
from specee_edge.gguf_index import GGUFIndex
from specee_edge.runtime.logging import quiet_llama_logs
from specee_edge.threads import default_threads

# the llama_ftype of each weight type, by llama.cpp's name for the type (a K-quant's "_M" mix is what
# llama-quantize makes of it by default; with pure=True only the type itself matters)
FTYPES = {
    "F16": _llama.LLAMA_FTYPE_MOSTLY_F16,
    "BF16": _llama.LLAMA_FTYPE_MOSTLY_BF16,
    "Q8_0": _llama.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q4_0": _llama.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q4_1": _llama.LLAMA_FTYPE_MOSTLY_Q4_1,
    "Q5_0": _llama.LLAMA_FTYPE_MOSTLY_Q5_0,
    "Q5_1": _llama.LLAMA_FTYPE_MOSTLY_Q5_1,
    "Q4_K": _llama.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q5_K": _llama.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "Q6_K": _llama.LLAMA_FTYPE_MOSTLY_Q6_K,
    "IQ4_NL": _llama.LLAMA_FTYPE_MOSTLY_IQ4_NL,
}


def weight_type(name: str) -> str:
    """`name` as a key of FTYPES (any case), or a one-line error listing them."""
    key = name.strip().upper()
    if key not in FTYPES:
        raise SpecEEError(f"unknown weight type {name!r}: choose from {', '.join(FTYPES)}")
    return key


def requantize(source: Path, out: Path, type_name: str, *, pure: bool = True, threads: int = 0) -> Path:
    """Write `source` requantized to `type_name` at `out` and return `out`. Quantized weights are
    requantized (llama-quantize's --allow-requantize): a copy of a shipped Q4_1 model in another type
    decodes and costs as that type does, though its values carry both roundings."""
    key = weight_type(type_name)
    source, out = Path(source), Path(out)
    if not source.is_file():
        raise SpecEEError(f"no model file at {source}")
    quiet_llama_logs()
    params = _llama.llama_model_quantize_default_params()
    params.ftype = FTYPES[key]
    params.allow_requantize = True
    params.pure = pure
    params.nthread = threads or default_threads()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".part")  # a failed or interrupted run leaves no file that looks whole
    try:
        rc = _llama.llama_model_quantize(str(source).encode(), str(partial).encode(), params)
        if rc != 0:
            raise SpecEEError(f"llama.cpp could not quantize {source.name} to {key} (llama_model_quantize returned {rc})")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def weight_types(path: Path) -> dict[str, float]:
    """The share of the file's matrix weights (2-D tensors) in each GGML type, largest first."""
    counts: Counter[str] = Counter()
    for t in GGUFIndex(path).tensors:
        if len(t.shape) >= 2:
            counts[t.tensor_type.name] += t.n_elements
    total = sum(counts.values()) or 1
    return {name: n / total for name, n in counts.most_common()}
