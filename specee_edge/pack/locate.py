"""Where a model's pack is found: beside the model, in the cache by the model's fingerprint, or shipped.

A pack beside the model is named after it (MODEL.specee.gguf). A model in a store that is not ours to
write (the Hugging Face cache, Ollama's blobs, LM Studio's folders, a read-only share) gets its pack in
the cache instead, named by the model's fingerprint, so that the same model finds it wherever it lies.
"""

from __future__ import annotations

from pathlib import Path

from specee_edge.build_runtime import cache_root
from specee_edge.errors import ModelLoadError
from specee_edge.gguf_index import GGUFIndex
from specee_edge.pack.target import fingerprint
from specee_edge.shipped import shipped_dir

SHIPPED_PACKS = shipped_dir()
PACK_SUFFIX = ".specee.gguf"
PACK_CACHE = "packs"  # the cache's folder of packs by model fingerprint


def pack_beside(model_path: Path) -> Path:
    """MODEL.specee.gguf in the model's folder."""
    return Path(model_path).with_name(Path(model_path).name.removesuffix(".gguf") + PACK_SUFFIX)


def cached_pack_path(model_path: Path) -> Path:
    """The cache's pack path for the model's fingerprint (ModelLoadError where the model is no GGUF)."""
    return cache_root() / PACK_CACHE / f"{fingerprint(Path(model_path), GGUFIndex(model_path))}{PACK_SUFFIX}"


def find_pack(model_path: Path) -> Path | None:
    """The pack beside the model, else the cache's for its fingerprint, else a shipped one of the beside name."""
    beside = pack_beside(model_path)
    if beside.is_file():
        return beside
    try:
        cached = cached_pack_path(model_path)
    except ModelLoadError:  # not a readable GGUF: loading the model says so, in its own words
        cached = None
    if cached is not None and cached.is_file():
        return cached
    shipped = SHIPPED_PACKS / beside.name
    return shipped if shipped.is_file() else None


def pack_origin(pack_path: Path, model_path: Path) -> str:
    """Where find_pack found ``pack_path``, in words."""
    if pack_path.parent == Path(model_path).parent:
        return "beside the model"
    if pack_path.parent == cache_root() / PACK_CACHE:
        return "in the cache, by the model's fingerprint"
    return "shipped with specee-edge" if pack_path.parent == SHIPPED_PACKS else "given"
