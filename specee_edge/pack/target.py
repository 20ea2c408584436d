"""A model GGUF's identity, read from its header with gguf-py (no weights loaded)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf

from specee_edge.errors import ModelLoadError, SpecEEError
from specee_edge.pack.format import TargetIdentity
from specee_edge.runtime.model import check_gguf_file

FINGERPRINT_DATA_BYTES = 1 << 20  # the header plus this much tensor data: cheap, and unique in practice


class PackMismatchError(SpecEEError):
    """A pack made for another model."""


def field_value(reader: gguf.GGUFReader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def open_gguf(path: Path) -> gguf.GGUFReader:
    path = check_gguf_file(path)
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf-py raises many kinds on a damaged file
        raise ModelLoadError(f"cannot read {path}: corrupt or truncated GGUF ({type(e).__name__}: {e})") from None


def fingerprint(path: Path, reader: gguf.GGUFReader) -> str:
    digest = hashlib.sha256()
    for t in reader.tensors:
        digest.update(f"{t.name}:{list(t.shape)}:{int(t.tensor_type)};".encode())
    with Path(path).open("rb") as f:
        f.seek(reader.data_offset)
        digest.update(f.read(FINGERPRINT_DATA_BYTES))
    return digest.hexdigest()


def target_identity(path: Path) -> TargetIdentity:
    reader = open_gguf(path)
    arch = field_value(reader, "general.architecture")
    n_layer = field_value(reader, f"{arch}.block_count")
    n_embd = field_value(reader, f"{arch}.embedding_length")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if arch is None or n_layer is None or n_embd is None or tokens is None:
        raise ModelLoadError(f"{path} is not a model GGUF (no architecture, layer count or vocabulary)")
    return TargetIdentity(
        arch=str(arch),
        n_layer=int(n_layer),
        n_embd=int(n_embd),
        n_vocab=len(tokens.data),
        fingerprint=fingerprint(path, reader),
    )


def check_target(pack_target: TargetIdentity, model: TargetIdentity, pack_path: Path, model_path: Path) -> None:
    """Refuse a pack made for another model, naming both sides."""
    if pack_target != model:
        raise PackMismatchError(
            f"pack {Path(pack_path).name} was made for another model: pack target ({pack_target.describe()}) "
            f"!= {Path(model_path).name} ({model.describe()})"
        )
