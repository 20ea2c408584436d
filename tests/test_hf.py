"""-hf USER/REPO[:QUANT] and --hf-file, against a Hub of the test's own on 127.0.0.1 (HF_ENDPOINT) that answers
the way huggingface.co does: the model API (/api/models/{repo}/revision/main) and file URLs
(/{repo}/resolve/{revision}/{file}, HEAD and ranged GET), with its error codes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specee_edge.hf import HubError, cache_dir, hf_model, hub_cache_dir, pick_file, split_parts
from tests.tiny_gguf import TinyConfig, write_tiny_model

CLI = Path(sys.executable).parent / "specee-edge"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "tester/tiny-GGUF"
SPLIT_REPO = "tester/split-GGUF"
# huggingface_hub's cache folder (constants.HF_HUB_CACHE) under each environment of argv[1], as a fresh
# import of it computes it
HUGGINGFACE_HUBS_CACHE = """
import importlib, json, os, sys
from huggingface_hub import constants
folders = []
for environment in json.loads(sys.argv[1]):
    for name, value in environment.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    folders.append(importlib.reload(constants).HF_HUB_CACHE)
print(json.dumps(folders))
"""


class Hub:
    """Repositories of files in memory, served over HTTP as the Hub serves them."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.cut: set[str] = set()  # files whose bodies stop halfway, as a dropped connection leaves them
        self.tokens: dict[str, str] = {}  # private repositories: the token each needs
        self.gets: list[str] = []
        self.answers: dict[str, tuple[int, str, dict[str, str]]] = {}  # the model API's forced answers, per repo
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self.answer(body=False)

            def do_GET(self) -> None:
                self.answer(body=True)

            def refuse(self, code: int, error_code: str, headers: dict[str, str] | None = None) -> None:
                payload = json.dumps({"error": error_code}).encode()
                self.send_response(code)
                for name, value in (headers or {"X-Error-Code": error_code}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def authorized(self, repo: str) -> bool:
                return repo not in hub.tokens or self.headers.get("Authorization") == f"Bearer {hub.tokens[repo]}"

            def answer(self, body: bool) -> None:
                path = self.path.split("?")[0]
                if path.startswith("/api/models/"):
                    repo = path.removeprefix("/api/models/").split("/revision/")[0]
                    if repo in hub.answers:
                        return self.refuse(*hub.answers[repo])
                    if repo not in hub.repos or not self.authorized(repo):
                        return self.refuse(401, "RepoNotFound")  # the Hub answers a private repository so too
                    payload = json.dumps({"id": repo, "sha": COMMIT,
                                          "siblings": [{"rfilename": f} for f in hub.repos[repo]]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    return self.wfile.write(payload) if body else None
                owner, name, resolve, _revision, file = (path.lstrip("/").split("/", 4) + [""] * 5)[:5]
                repo = f"{owner}/{name}"
                if resolve != "resolve" or repo not in hub.repos or not self.authorized(repo):
                    return self.refuse(404, "RepoNotFound")
                if file not in hub.repos[repo]:
                    return self.refuse(404, "EntryNotFound")
                data = hub.repos[repo][file]
                start = int(self.headers.get("Range", "bytes=0-").removeprefix("bytes=").split("-")[0] or 0)
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if body:
                    hub.gets.append(file)
                    end = len(data) // 2 if file in hub.cut else len(data)
                    self.wfile.write(data[start:max(start, end)])
                    self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory) -> bytes:
    return write_tiny_model(tmp_path_factory.mktemp("hub") / "tiny.gguf", TinyConfig("llama")).read_bytes()


@pytest.fixture
def hub(tiny_bytes, tmp_path, monkeypatch):
    hub = Hub()
    hub.repos[REPO] = {"README.md": b"# tiny", "mmproj-tiny-f16.gguf": b"projector", "tiny-Q8_0.gguf": tiny_bytes,
                       "tiny-Q4_K_M.gguf": tiny_bytes + b"", "tiny-q2_k.gguf": tiny_bytes}
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token saved by a login here
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield hub
    hub.close()


def test_the_quant_is_picked_as_llama_cpp_picks_it():
    files = ["README.md", "mmproj-m-f16.gguf", "m-Q2_K.gguf", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-IQ4_XS.gguf"]
    assert pick_file(files, None) == "m-Q4_K_M.gguf"  # the default
    assert pick_file(files, "q8_0") == "m-Q8_0.gguf"  # a tag, any case
    assert pick_file(files, "Q4_K") is None  # a tag matches a whole quant name, not a prefix of one
    assert pick_file(["m-Q2_K.gguf", "m-Q8_0.gguf"], None) == "m-Q8_0.gguf"
    assert pick_file(["mmproj-x.gguf", "b-Q2_K.gguf", "a-Q3_K.gguf"], None) == "b-Q2_K.gguf"  # else the first model
    assert pick_file(["mmproj-x.gguf", "README.md"], None) is None
    split = ["big/m-Q4_K_M-00002-of-00002.gguf", "big/m-Q4_K_M-00001-of-00002.gguf"]
    assert pick_file(split, None) == "big/m-Q4_K_M-00001-of-00002.gguf"  # the first part
    assert split_parts(split, split[1]) == [split[1], split[0]]
    with pytest.raises(HubError, match="lacks big/m-Q4_K_M-00002-of-00002.gguf"):
        split_parts(split[1:], split[1])


def test_a_repo_downloads_once_into_the_hugging_face_cache(hub, tmp_path, tiny_bytes, monkeypatch):
    path = hf_model(REPO).path
    assert path.name == "tiny-Q4_K_M.gguf" and path.read_bytes() == tiny_bytes
    assert path.is_relative_to(tmp_path / "hf" / "models--tester--tiny-GGUF" / "snapshots" / COMMIT)
    assert hf_model(f"{REPO}:q2_K").path.name == "tiny-q2_k.gguf"
    assert hf_model(REPO, "TINY-Q8_0.gguf").name == f"hf:{REPO}/tiny-Q8_0.gguf"  # the repository's spelling
    gets = list(hub.gets)
    assert hf_model(REPO).path == path and hub.gets == gets  # cached: nothing fetched again
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and found offline, through the cache alone
    hub.close()
    assert hf_model(REPO).path == path


def test_a_private_repo_takes_hf_token(hub, tiny_bytes, monkeypatch):
    hub.repos["tester/private-GGUF"] = {"p-Q4_K_M.gguf": tiny_bytes}
    hub.tokens["tester/private-GGUF"] = "hf_secret"
    with pytest.raises(HubError, match="^no model repository tester/private-GGUF .*needs HF_TOKEN"):
        hf_model("tester/private-GGUF")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert hf_model("tester/private-GGUF").path.read_bytes() == tiny_bytes


def test_every_model_command_takes_hf():
    import typer

    from specee_edge.cli import app

    commands = typer.main.get_command(app).commands
    for name in ("chat", "generate", "serve", "bench", "calibrate"):
        options = {opt for param in commands[name].params for opt in param.opts}
        assert {"-hf", "--hf-repo", "--hf-file"} <= options, name


def test_a_split_model_comes_whole(hub, tiny_bytes):
    hub.repos[SPLIT_REPO] = {"m-Q4_K_M-00001-of-00002.gguf": tiny_bytes, "m-Q4_K_M-00002-of-00002.gguf": b"part two"}
    path = hf_model(SPLIT_REPO).path
    assert path.name == "m-Q4_K_M-00001-of-00002.gguf"
    assert hf_model(SPLIT_REPO).name == f"hf:{SPLIT_REPO}/m-Q4_K_M-00001-of-00002.gguf"
    assert (path.parent / "m-Q4_K_M-00002-of-00002.gguf").read_bytes() == b"part two"


@pytest.mark.parametrize("spec, file, message", [
    ("tester/nothing-here", None, "no model repository tester/nothing-here on http://127.0.0.1"),
    (f"{REPO}:Q5_K_M", None, f"{REPO} has no GGUF tagged Q5_K_M: it has mmproj-tiny-f16.gguf, tiny-Q4_K_M.gguf"),
    (REPO, "tiny-f32.gguf", f"{REPO} has no file tiny-f32.gguf"),
    ("not-a-repo", None, "-hf takes USER/REPO[:QUANT]"),
])
def test_a_wrong_repo_quant_or_file_is_one_line(hub, spec, file, message):
    with pytest.raises(HubError, match="^" + message.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")):
        hf_model(spec, file)


@pytest.mark.parametrize("answer, message", [
    ((429, "", {}), "{hub} is limiting requests (429): wait a few minutes"),
    ((503, "", {}), "{hub} failed (503): run the command again later"),
    ((500, "", {}), "{hub} failed (500)"),
    ((401, "", {"X-Error-Message": "Invalid credentials in Authorization header"}), "{hub} refused the token (401)"),
    ((404, "", {"X-Error-Code": "RevisionNotFound"}), "tester/tiny-GGUF has no revision main on {hub}"),
    ((403, "", {}), "{hub} answered 403 for tester/tiny-GGUF"),
], ids=["429", "503", "500", "bad-token", "no-revision", "403"])
def test_the_hubs_refusals_are_one_line(hub, answer, message, monkeypatch):
    hub.answers[REPO] = answer
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(HubError, match="^" + re.escape(message.format(hub=hub.url)) + "[^\n]*$"):
        hf_model(REPO)


def test_a_malformed_repository_id_is_one_line(hub):
    with pytest.raises(HubError, match="^-hf 'tester/bad name' is not a repository id: [^\n]*$"):
        hf_model("tester/bad name")


@pytest.mark.parametrize("variable", ["LLAMA_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_CACHE"])
def test_the_cache_is_llama_cpps_hugging_face_cache(hub, tmp_path, tiny_bytes, monkeypatch, variable):
    # llama.cpp's -hf looks in LLAMA_CACHE, HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, then HF_HOME, in that order
    for name in ("LLAMA_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, str(tmp_path / variable))
    path = hf_model(REPO).path
    assert path.is_relative_to(tmp_path / variable) and path.read_bytes() == tiny_bytes
    hub.gets.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hf_model(REPO).path == path and hub.gets == []


def test_after_llama_cache_the_cache_is_huggingface_hubs_own(tmp_path, monkeypatch):
    values = {"HF_HUB_CACHE": "~/hub-cache", "HUGGINGFACE_HUB_CACHE": str(tmp_path / "legacy"),
              "HF_HOME": "$HOME/hf-home", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    # every combination of those set and unset
    environments = [{name: value if mask >> bit & 1 else None for bit, (name, value) in enumerate(values.items())}
                    for mask in range(2 ** len(values))]
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("LLAMA_CACHE", "HUGGINGFACE_CO_STAGING"):  # the latter: huggingface_hub's own tests' cache
        monkeypatch.delenv(name, raising=False)
    theirs = subprocess.run([sys.executable, "-c", HUGGINGFACE_HUBS_CACHE, json.dumps(environments)],
                            capture_output=True, text=True, check=True, timeout=120).stdout
    for environment, folder in zip(environments, json.loads(theirs), strict=True):
        for name, value in environment.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        assert hub_cache_dir() == cache_dir() == Path(folder), environment
    monkeypatch.setenv("LLAMA_CACHE", "~/llama-cache")
    assert cache_dir() == tmp_path / "home" / "llama-cache"


def test_no_network_and_nothing_cached_is_one_line(hub, monkeypatch):
    hub.close()
    with pytest.raises(HubError, match=rf"^cannot reach {hub.url}: .*, and {REPO} is not in the Hugging Face cache"):
        hf_model(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match=f"^HF_HUB_OFFLINE is set, and {REPO} is not in the Hugging Face cache"):
        hf_model(REPO)


def test_a_cut_download_is_one_line_and_resumes(hub, tiny_bytes):
    hub.cut.add("tiny-Q4_K_M.gguf")
    with pytest.raises(HubError, match="^downloading tiny-Q4_K_M.gguf from tester/tiny-GGUF failed .*run the command "
                                       "again to resume"):
        hf_model(REPO)
    hub.cut.clear()
    assert hf_model(REPO).path.read_bytes() == tiny_bytes


def test_an_hf_model_is_named_as_the_models_list_names_it(hub):
    """-hf hands its model on by its hf: name, so chat's messages give a name that loads it again, not the path
    of its file in the cache."""
    from specee_edge.cli.chat import pick_model
    from specee_edge.stores import ResolvedModel, resolve_model

    name = f"hf:{REPO}/tiny-Q8_0.gguf"
    assert pick_model(None, None, f"{REPO}:Q8_0") == name
    assert resolve_model(name) == ResolvedModel(hf_model(f"{REPO}:Q8_0").path, name)


def test_generate_takes_hf(hub, tmp_path):
    env = dict(os.environ, COLUMNS="200", SPECEE_CACHE=str(tmp_path / "specee"))
    result = subprocess.run([CLI, "generate", "-hf", f"{REPO}:Q8_0", "-p", "hello", "-n", "2", "--raw", "--temp", "0",
                             "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"].endswith("tiny-Q8_0.gguf")
    wrong = subprocess.run([CLI, "generate", "-hf", f"{REPO}:Q5_K_M", "-p", "hello"], capture_output=True, text=True,
                           env=env, timeout=120)
    assert wrong.returncode == 1 and wrong.stderr.strip().count("\n") == 0 and "no GGUF tagged Q5_K_M" in wrong.stderr
    both = subprocess.run([CLI, "generate", "-hf", REPO, "-m", "x.gguf", "-p", "hello"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert both.returncode == 1 and "two models given" in both.stderr


@pytest.mark.parametrize("alias", [None, "my-model"])
def test_serve_names_an_hf_model_as_llama_server_does(hub, tmp_path, monkeypatch, alias):
    """/v1/models and every reply name an -hf model by its repository as given (llama-server's name for it), not
    by the path of its file in the cache; -a/--alias names it instead."""
    import httpx

    from tests.test_server import Server

    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "specee"))
    server = Server("-hf", f"{REPO}:Q8_0", *(["-a", alias] if alias else []))
    try:
        listed = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
        reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60).json()
    finally:
        out = server.stop()
    expected = alias or f"{REPO}:Q8_0"
    assert [model["id"] for model in listed] == [expected], out
    assert reply["model"] == expected


def test_serve_refuses_an_empty_alias():
    result = subprocess.run([CLI, "serve", "-a", " "], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == "error: --alias is empty: give the model a name, or leave the flag out"
