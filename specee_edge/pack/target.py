"""A model GGUF's identity, read from its header with the lean `GGUFIndex` (no weights loaded)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from specee_edge.errors import ModelLoadError, SpecEEError
from specee_edge.gguf_index import GGUFIndex
from specee_edge.pack.format import TargetIdentity

FINGERPRINT_DATA_BYTES = 1 << 20  # the header plus this much tensor data: cheap, and unique in practice


class PackMismatchError(SpecEEError):
    """A pack made for another model."""


def _shape_text(shape: Sequence[int], *, legacy: bool) -> str:
    dims = [int(d) for d in shape]
    if legacy:  # what `str(list(shape))` gave for numpy uint64 dims on NumPy 2, written out so any NumPy agrees
        return "[" + ", ".join(f"np.uint64({d})" for d in dims) + "]"
    return str(dims)


def fingerprints(path: Path, reader: GGUFIndex) -> tuple[str, str]:
    """(current, legacy): sha256 of the tensor table and the first MiB of tensor data.

    The legacy form hashed each shape through numpy's text of its uint64 dims, which differs between
    NumPy 1 and 2; packs written before the current form (the shipped ones included) hold the NumPy 2
    text, so a model's identity keeps it to accept them.
    """
    current, legacy = hashlib.sha256(), hashlib.sha256()
    for t in reader.tensors:
        for digest, is_legacy in ((current, False), (legacy, True)):
            digest.update(f"{t.name}:{_shape_text(t.shape, legacy=is_legacy)}:{int(t.tensor_type)};".encode())
    with Path(path).open("rb") as f:
        f.seek(reader.data_offset)
        data = f.read(FINGERPRINT_DATA_BYTES)
    current.update(data)
    legacy.update(data)
    return current.hexdigest(), legacy.hexdigest()


def fingerprint(path: Path, reader: GGUFIndex) -> str:
    """The form new packs are written with: shapes as plain integers."""
    return fingerprints(path, reader)[0]


def target_identity(path: Path, reader: GGUFIndex | None = None) -> TargetIdentity:
    """`reader`: the file's index if already open (saves reopening it)."""
    reader = reader or GGUFIndex(path)
    arch = reader.value("general.architecture")
    n_layer = reader.value(f"{arch}.block_count")
    n_embd = reader.value(f"{arch}.embedding_length")
    n_vocab = reader.array_len("tokenizer.ggml.tokens")
    if arch is None or n_layer is None or n_embd is None or n_vocab is None:
        raise ModelLoadError(f"{path} is not a model GGUF (no architecture, layer count or vocabulary)")
    current, legacy = fingerprints(path, reader)
    return TargetIdentity(
        arch=str(arch),
        n_layer=int(n_layer),
        n_embd=int(n_embd),
        n_vocab=n_vocab,
        fingerprint=current,
        legacy_fingerprint=legacy,
    )


def check_target(pack_target: TargetIdentity, model: TargetIdentity, pack_path: Path, model_path: Path) -> None:
    """Refuse a pack made for another model, naming both sides."""
    if not model.accepts(pack_target):
        raise PackMismatchError(
            f"pack {Path(pack_path).name} was made for another model: pack target ({pack_target.describe()}) "
            f"!= {Path(model_path).name} ({model.describe()})"
        )
