"""The model registry (`models/registry.json`): the models `specee-edge pull` can fetch, where each one's
file comes from, and what the engine needs to know of a model its GGUF does not say (its chat template).

The data only: fetching is `specee_edge.pull`'s.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from specee_edge.chat_templates import NAMED_TEMPLATES
from specee_edge.errors import SpecEEError
from specee_edge.shipped import shipped_dir

REGISTRY_ENV = "SPECEE_REGISTRY"
SHIPPED_REGISTRY = shipped_dir() / "registry.json"
# "chat": an instruction-tuned model, prompts go in as a user turn; "completion": a base (pretrained only)
# model, which continues text: in a chat turn it copies the prompt in a loop, so prompts go in as plain text
PROMPTING = ("chat", "completion")


class RegistryError(SpecEEError):
    """The registry file is missing or malformed."""


@dataclass(frozen=True)
class WheelFile:
    """One part of a model: the file at `path` inside the wheel of `package==version`."""

    package: str
    version: str
    path: str
    size_bytes: int

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    description: str
    arch: str
    n_layer: int
    license: str
    size_bytes: int
    sha256: str
    filename: str
    kind: str  # "pypi-wheel" (the whole GGUF in one wheel) or "pypi-parts"
    parts: tuple[WheelFile, ...]
    chat_template_notes: str
    chat_template: str | None = None  # a named template (specee_edge.chat_templates) for a GGUF that has none
    prompting: str = "chat"  # how bench and calibrate present a prompt: a chat turn, or "completion" (base models)


def registry_path(path: Path | None = None) -> Path:
    """`path`, else $SPECEE_REGISTRY, else the shipped models/registry.json."""
    if path is not None:
        return path
    configured = os.environ.get(REGISTRY_ENV)
    return Path(configured).expanduser() if configured else SHIPPED_REGISTRY


def load_registry(path: Path | None = None) -> dict[str, RegistryEntry]:
    """Read and validate the registry: name → entry, in file order."""
    where = registry_path(path)
    try:
        raw = json.loads(where.read_text())
    except FileNotFoundError:
        raise RegistryError(
            f"the model registry {where} is missing: reinstall specee-edge (its wheel carries models/)"
            f" or set {REGISTRY_ENV}"
        ) from None
    except (OSError, ValueError) as e:
        raise RegistryError(f"cannot read the model registry {where}: {e}") from None
    models = raw.get("models") if isinstance(raw, dict) else None
    if not isinstance(models, dict):
        raise RegistryError(f'the model registry {where} has no "models" object')
    return {name: _parse_entry(name, fields, where) for name, fields in models.items()}


def _parse_entry(name: str, fields: object, where: Path) -> RegistryEntry:
    try:
        source = fields["source"]
        kind = source["kind"]
        if kind == "pypi-wheel":
            parts = (_wheel_file(source, fields["size_bytes"]),)
        elif kind == "pypi-parts":
            parts = tuple(_wheel_file(part, part["size_bytes"]) for part in source["parts"])
        else:
            raise RegistryError(f"{where}: model {name!r} has an unknown source kind {kind!r}")
        entry = RegistryEntry(
            name=name,
            description=str(fields["description"]),
            arch=str(fields["arch"]),
            n_layer=int(fields["n_layer"]),
            license=str(fields["license"]),
            size_bytes=int(fields["size_bytes"]),
            sha256=str(fields["sha256"]).lower(),
            filename=str(fields["filename"]),
            kind=kind,
            parts=parts,
            chat_template_notes=str(fields["chat_template_notes"]),
            chat_template=fields.get("chat_template"),
            prompting=str(fields.get("prompting", "chat")),
        )
    except KeyError as e:
        raise RegistryError(f"{where}: model {name!r} lacks the key {e}") from None
    except (TypeError, ValueError) as e:
        raise RegistryError(f"{where}: model {name!r} is malformed ({e})") from None
    if not parts or sum(part.size_bytes for part in parts) != entry.size_bytes:
        raise RegistryError(f"{where}: the parts of model {name!r} do not add up to its size_bytes")
    if entry.prompting not in PROMPTING:
        raise RegistryError(f"{where}: model {name!r} has prompting {entry.prompting!r} (known: {', '.join(PROMPTING)})")
    if entry.chat_template is not None and entry.chat_template not in NAMED_TEMPLATES:
        raise RegistryError(f"{where}: model {name!r} names an unknown chat template {entry.chat_template!r}"
                            f" (known: {', '.join(NAMED_TEMPLATES)})")
    return entry


def _wheel_file(fields: dict, size_bytes: object) -> WheelFile:
    return WheelFile(str(fields["package"]), str(fields["version"]), str(fields["path"]), int(size_bytes))


def entry_for_file(path: Path, registry: Path | None = None) -> RegistryEntry | None:
    """The entry of a model file (its file name and size), None for a model the registry does not know."""
    try:
        size = Path(path).stat().st_size
        entries = load_registry(registry).values()
    except (OSError, RegistryError):
        return None
    return next((e for e in entries if e.filename == Path(path).name and e.size_bytes == size), None)
