"""`specee-edge models` and the names it shows, on stores laid out as their tools lay them out (Hugging Face's
cache, llama.cpp's, Ollama's manifests and blobs, LM Studio's folders), and packs kept in the cache by
the model's fingerprint for models in those stores."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specee_edge.default_model import default_model_path
from specee_edge.errors import ModelLoadError
from specee_edge.pack.locate import cached_pack_path, find_pack, pack_beside
from specee_edge.stores import ResolvedModel, resolve_model
from specee_edge import stores as stores_module
from specee_edge.stores import in_store, llama_cpp_dir, pack_output, resolve_stored, stored_models
from tests.conftest import SHIPPED_PACK
from tests.tiny_gguf import TinyConfig, write_tiny_model

CLI = Path(sys.executable).parent / "specee-edge"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
STORE_ENV = ("OLLAMA_MODELS", "LLAMA_CACHE", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
             "LOCALAPPDATA")


def ollama_put(root: Path, name: str, tag: str, model: Path, *, link: bool = False) -> Path:
    """A model as `ollama pull` leaves it: its GGUF as a content-addressed blob, a manifest naming it."""
    digest = hashlib.sha256(model.read_bytes() if not link else model.name.encode()).hexdigest()
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    if link:  # the 98 MB default model: linked, not copied
        blob.symlink_to(model)
    else:
        shutil.copyfile(model, blob)
    template = root / "blobs" / f"sha256-{'1' * 64}"
    template.write_text("{{ .Prompt }}")
    parts = name.split("/")
    parts = ["registry.ollama.ai", "library", *parts] if len(parts) == 1 else ["registry.ollama.ai", *parts]
    manifest = root / "manifests" / Path(*parts) / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": blob.stat().st_size},
        {"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{'1' * 64}", "size": 13}]}))
    return blob


def hf_put(hub: Path, repo: str, file: str, model: Path) -> Path:
    """A file as huggingface_hub caches it: a blob, a snapshot link to it, refs/main naming the snapshot."""
    folder = hub / f"models--{repo.replace('/', '--')}"
    blob = folder / "blobs" / hashlib.sha256(model.read_bytes()).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model, blob)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    link = folder / "snapshots" / COMMIT / file
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    return link


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """A home folder with a model in each store, specee-edge's cache empty."""
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(stores_module, "OLLAMA_SYSTEM_STORE", tmp_path / "usr-share-ollama" / ".ollama" / "models")
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "specee"))
    llama = write_tiny_model(tmp_path / "tiny-Q4_K_M.gguf", TinyConfig("llama"))
    gpt2 = write_tiny_model(tmp_path / "gpt2.gguf", TinyConfig("gpt2"))
    paths = {
        "ollama:qwen2.5:0.5b": ollama_put(home / ".ollama" / "models", "qwen2.5", "0.5b", llama),
        "ollama:someone/gpt:latest": ollama_put(home / ".ollama" / "models", "someone/gpt", "latest", gpt2),
        "hf:tester/tiny-GGUF/tiny-Q4_K_M.gguf": hf_put(home / ".cache" / "huggingface" / "hub", "tester/tiny-GGUF",
                                                       "tiny-Q4_K_M.gguf", llama),
        "llama.cpp:tester_tiny-GGUF_tiny-Q4_K_M.gguf": home / ".cache" / "llama.cpp" / "tester_tiny-GGUF_tiny-Q4_K_M.gguf",
        "lmstudio:lmstudio-community/tiny-GGUF/tiny-Q4_K_M.gguf":
            home / ".lmstudio" / "models" / "lmstudio-community" / "tiny-GGUF" / "tiny-Q4_K_M.gguf",
        "lmstudio:someone/big-GGUF/big-Q8_0-00001-of-00002.gguf":
            home / ".lmstudio" / "models" / "someone" / "big-GGUF" / "big-Q8_0-00001-of-00002.gguf",
    }
    for name, path in paths.items():
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(llama, path)
    (paths["lmstudio:someone/big-GGUF/big-Q8_0-00001-of-00002.gguf"].with_name("big-Q8_0-00002-of-00002.gguf")
     .write_bytes(b"\0" * 1000))
    (home / ".lmstudio" / "models" / "lmstudio-community" / "tiny-GGUF" / "mmproj-tiny-f16.gguf").write_bytes(b"x")
    return paths


def test_the_stores_are_listed_by_the_names_that_load_them(stores):
    found = {m.name: m for m in stored_models() if m.store != "specee-edge"}  # the default model's wheel is there too
    assert set(found) == set(stores)  # one entry for the split model, none for the projector
    for name, path in stores.items():
        assert found[name].path == path
        assert resolve_stored(name) == path
    assert resolve_stored("ollama:qwen2.5:0.5b") == resolve_stored("ollama:registry.ollama.ai/library/qwen2.5:0.5b")
    with pytest.raises(ModelLoadError, match=r"^Ollama has no model ollama:qwen2\.5:7b \(no manifest .*\): `specee-edge "
                                             "models` lists what it has$"):
        resolve_stored("ollama:qwen2.5:7b")
    with pytest.raises(ModelLoadError, match=r"^no model lmstudio:a/b/c\.gguf"):
        resolve_stored("lmstudio:a/b/c.gguf")


def test_a_stores_name_resolves_to_its_file_and_stays_the_models_name(stores):
    for name, path in stores.items():
        assert resolve_model(name) == ResolvedModel(path, name)
    blob = stores["ollama:qwen2.5:0.5b"]
    assert resolve_model(str(blob)) == ResolvedModel(blob, str(blob))  # a path given stays a path
    with pytest.raises(ModelLoadError, match=r"^Ollama has no model ollama:qwen2\.5:7b"):
        resolve_model("ollama:qwen2.5:7b")


def test_chat_and_serve_name_a_stores_model_by_its_name_not_its_blob(stores):
    from specee_edge.cli.chat import EngineOptions, load_engine, pick_model
    from specee_edge.cli.serve import served_model_id

    name = "ollama:qwen2.5:0.5b"
    opts = EngineOptions(pick_model(name, None), None, 256, "0", 1, None, None, None, True)
    engine, label, notice = load_engine(opts, strict_pack=False)
    try:
        assert engine.model.info.path == stores[name]
    finally:
        engine.close()
    assert label == name and served_model_id(None, None, label) == name  # /v1/models and every reply
    assert notice.startswith(f"no pack for {name}: ") and f"`specee-edge calibrate {name}`" in notice


def test_the_models_command_reads_each_header(stores, tmp_path):
    result = subprocess.run([CLI, "models"], capture_output=True, text=True, env=dict(os.environ, COLUMNS="250"),
                            timeout=120)
    assert result.returncode == 0, result.stderr
    cells = [[w for w in line.split() if w != "│"] for line in result.stdout.splitlines()]
    rows = {row[0]: row for row in cells if row and ":" in row[0]}
    assert rows["ollama:qwen2.5:0.5b"][1:3] == ["ollama", "llama"] and "yes" in rows["ollama:qwen2.5:0.5b"]
    assert rows["ollama:someone/gpt:latest"][2] == "gpt2" and "no" in rows["ollama:someone/gpt:latest"]
    assert rows["hf:tester/tiny-GGUF/tiny-Q4_K_M.gguf"][1] == "huggingface"
    assert "smollm2-135m-instruct" in result.stdout  # the registry's, with its shipped pack
    assert "shipped with specee-edge" in result.stdout


def test_a_pack_for_a_model_in_a_store_is_kept_and_found_by_its_fingerprint(stores, tmp_path):
    blob = ollama_put(Path(os.environ["HOME"]) / ".ollama" / "models", "smollm2", "135m", default_model_path(), link=True)
    assert find_pack(blob) is None  # named sha256-...: no pack beside it, none shipped by that name
    output = pack_output(blob)
    assert output == cached_pack_path(blob) and output.is_relative_to(tmp_path / "specee" / "packs")
    assert pack_output(tmp_path / "tiny-Q4_K_M.gguf") == pack_beside(tmp_path / "tiny-Q4_K_M.gguf")  # a folder of one's own
    shutil.copyfile(SHIPPED_PACK, output)  # as calibrate would leave it
    assert find_pack(blob) == output

    env = dict(os.environ, COLUMNS="250")
    info = subprocess.run([CLI, "info", str(blob)], capture_output=True, text=True, env=env, timeout=120)
    assert info.returncode == 0, info.stderr
    assert "in the cache, by the model's fingerprint" in info.stdout
    generate = subprocess.run([CLI, "generate", "ollama:smollm2:135m", "-p", "Hi", "-n", "4", "--temp", "0", "--json"],
                              capture_output=True, text=True, env=env, timeout=120)
    assert generate.returncode == 0, generate.stderr
    assert json.loads(generate.stdout)["pack"] == str(output)


def test_a_hugging_face_name_loads_mains_file_as_hf_does_where_another_snapshot_is_newer(stores):
    name = "hf:tester/tiny-GGUF/tiny-Q4_K_M.gguf"
    main = stores[name]
    other = main.parents[1] / ("f" * 40) / main.name  # a revision fetched later, by another tool
    other.parent.mkdir()
    shutil.copyfile(stores["ollama:someone/gpt:latest"], other)
    os.utime(other.parent, (main.parent.stat().st_mtime + 60,) * 2)
    assert resolve_stored(name) == main
    assert {m.name: m.path for m in stored_models()}[name] == main
    (main.parents[2] / "refs" / "main").unlink()  # no main in the cache: the newest snapshot
    assert resolve_stored(name) == other


def test_llama_cpps_cache_folder_is_where_llama_cpp_puts_it_on_each_os(stores, tmp_path, monkeypatch):
    home = Path(os.environ["HOME"])
    assert llama_cpp_dir("Linux") == home / ".cache" / "llama.cpp"
    assert llama_cpp_dir("Darwin") == home / "Library" / "Caches" / "llama.cpp"
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "AppData" / "Local"))
    assert llama_cpp_dir("Windows") == tmp_path / "AppData" / "Local" / "llama.cpp"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert llama_cpp_dir("Linux") == tmp_path / "xdg" / "llama.cpp"
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "moved"))
    assert llama_cpp_dir("Darwin") == llama_cpp_dir("Windows") == tmp_path / "moved"


def test_ollamas_system_store_and_a_custom_lm_studio_folder_are_found(stores, tmp_path):
    llama = stores["ollama:qwen2.5:0.5b"]
    service = ollama_put(stores_module.OLLAMA_SYSTEM_STORE, "llama3.2", "1b", llama)
    home = Path(os.environ["HOME"])
    custom = tmp_path / "my-models" / "pub" / "tiny-GGUF" / "tiny-Q4_0.gguf"
    custom.parent.mkdir(parents=True)
    shutil.copyfile(llama, custom)
    (home / ".lmstudio").mkdir(exist_ok=True)
    (home / ".lmstudio" / "settings.json").write_text(json.dumps({"downloadsFolder": str(tmp_path / "my-models")}))
    found = {m.name: m.path for m in stored_models()}
    assert found["ollama:llama3.2:1b"] == service and resolve_stored("ollama:llama3.2:1b") == service
    assert found["ollama:qwen2.5:0.5b"] == llama  # the user's store, as before
    assert found["lmstudio:pub/tiny-GGUF/tiny-Q4_0.gguf"] == custom
    assert resolve_stored("lmstudio:pub/tiny-GGUF/tiny-Q4_0.gguf") == custom
    assert "lmstudio:lmstudio-community/tiny-GGUF/tiny-Q4_K_M.gguf" in found  # the default folder still


def test_the_models_list_fits_80_columns_and_info_takes_its_names(stores):
    env = dict(os.environ, COLUMNS="80")
    result = subprocess.run([CLI, "models"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    for name in [*stores, "smollm2-135m-instruct"]:
        assert name in lines  # whole, on a line of its own: it can be copied
    for name in ("smollm2-135m-instruct", "ollama:qwen2.5:0.5b", "hf:tester/tiny-GGUF/tiny-Q4_K_M.gguf"):
        info = subprocess.run([CLI, "info", name], capture_output=True, text=True, env=env, timeout=120)
        assert info.returncode == 0 and "architecture" in info.stdout, (name, info.stderr)


def test_llama_cache_holding_llama_cpps_hugging_face_cache_lists_each_model_once(stores, tmp_path, monkeypatch):
    # this llama.cpp's -hf keeps the Hugging Face layout in LLAMA_CACHE; older releases kept flat files there
    moved = tmp_path / "llama-cache"
    llama = stores["ollama:qwen2.5:0.5b"]
    link = hf_put(moved, "tester/moved-GGUF", "moved-Q4_K_M.gguf", llama)
    shutil.copyfile(llama, moved / "old_flat-Q4_0.gguf")
    monkeypatch.setenv("LLAMA_CACHE", str(moved))
    names = [m.name for m in stored_models() if m.path.is_relative_to(moved)]
    assert sorted(names) == ["hf:tester/moved-GGUF/moved-Q4_K_M.gguf", "llama.cpp:old_flat-Q4_0.gguf"]
    assert resolve_stored("hf:tester/moved-GGUF/moved-Q4_K_M.gguf") == link


def test_huggingface_hubs_own_caches_still_count_where_the_cache_moved(stores, tmp_path, monkeypatch):
    # LLAMA_CACHE moves -hf's cache, HF_HUB_CACHE huggingface_hub's: what other tools left in the one under
    # HF_HOME (here ~/.cache/huggingface/hub) is listed, loads and is not written into all the same
    llama = stores["ollama:qwen2.5:0.5b"]
    moved = hf_put(tmp_path / "llama-cache", "tester/moved-GGUF", "moved-Q4_K_M.gguf", llama)
    hub = hf_put(tmp_path / "hub-cache", "tester/hub-GGUF", "hub-Q4_K_M.gguf", llama)
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "llama-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    expected = {"hf:tester/moved-GGUF/moved-Q4_K_M.gguf": moved, "hf:tester/hub-GGUF/hub-Q4_K_M.gguf": hub,
                "hf:tester/tiny-GGUF/tiny-Q4_K_M.gguf": stores["hf:tester/tiny-GGUF/tiny-Q4_K_M.gguf"]}
    assert {m.name: m.path for m in stored_models() if m.store == "huggingface"} == expected
    for name, path in expected.items():
        assert resolve_stored(name) == path and in_store(path)

    twin = hf_put(tmp_path / "llama-cache", "tester/tiny-GGUF", "tiny-Q4_K_M.gguf", llama)
    twins = [m.path for m in stored_models() if m.name == "hf:tester/tiny-GGUF/tiny-Q4_K_M.gguf"]
    assert twins == [twin] and resolve_stored("hf:tester/tiny-GGUF/tiny-Q4_K_M.gguf") == twin  # -hf's copy

    home_hub = hf_put(tmp_path / "hf-home" / "hub", "tester/home-GGUF", "home-Q4_K_M.gguf", llama)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert resolve_stored("hf:tester/home-GGUF/home-Q4_K_M.gguf") == home_hub and in_store(home_hub)
