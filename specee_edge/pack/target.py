"""A model GGUF's identity, read from its header with the lean `GGUFIndex` (no weights loaded)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from specee_edge.errors import ModelLoadError, SpecEEError
from specee_edge.pack.format import TargetIdentity
from specee_edge.gguf_index import GGUFIndex

FINGERPRINT_DATA_BYTES = 1 << 20  # the header plus this much tensor data: cheap, and unique in practice


class PackMismatchError(SpecEEError):
    """A pack made for another model."""


def fingerprint(path: Path, reader: GGUFIndex) -> str:
    digest = hashlib.sha256()
    for t in reader.tensors:
        # t.shape holds numpy uint64s, as gguf-py's ReaderTensor.shape did: their repr is part of the digest
        digest.update(f"{t.name}:{list(t.shape)}:{int(t.tensor_type)};".encode())
    with Path(path).open("rb") as f:
        f.seek(reader.data_offset)
        digest.update(f.read(FINGERPRINT_DATA_BYTES))
    return digest.hexdigest()


def target_identity(path: Path, reader: GGUFIndex | None = None) -> TargetIdentity:
    """`reader`: the file's index if already open (saves reopening it)."""
    reader = reader or GGUFIndex(path)
    arch = reader.value("general.architecture")
    n_layer = reader.value(f"{arch}.block_count")
    n_embd = reader.value(f"{arch}.embedding_length")
    n_vocab = reader.array_len("tokenizer.ggml.tokens")
    if arch is None or n_layer is None or n_embd is None or n_vocab is None:
        raise ModelLoadError(f"{path} is not a model GGUF (no architecture, layer count or vocabulary)")
    return TargetIdentity(
        arch=str(arch),
        n_layer=int(n_layer),
        n_embd=int(n_embd),
        n_vocab=n_vocab,
        fingerprint=fingerprint(path, reader),
    )


def check_target(pack_target: TargetIdentity, model: TargetIdentity, pack_path: Path, model_path: Path) -> None:
    """Refuse a pack made for another model, naming both sides."""
    if pack_target != model:
        raise PackMismatchError(
            f"pack {Path(pack_path).name} was made for another model: pack target ({pack_target.describe()}) "
            f"!= {Path(model_path).name} ({model.describe()})"
        )
