"""specee-edge serve: a real server process on a loopback port, the default model, real clients.

The official `openai` client for the API, raw HTTP where a client would hide what is checked (bad JSON,
a disconnect mid-stream), and a headless Chromium for the page.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from specee_edge.default_model import default_model_path
from specee_edge.engine import GREEDY, Engine, EngineConfig
from tests.conftest import exiting_quality

CLI = str(Path(sys.executable).with_name("specee-edge"))
N_CTX = 1024
COUNTING = "Count from 1 to 1000, one number per line."  # a long reply
MODEL = "smollm2-135m-instruct"  # the registry's name for the default model: what /v1/models lists
QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.", "What does a CPU do?",
    "Write a haiku about rain.", "How many legs does a spider have?", "What is 12 times 12?",
    "Say hello in Spanish.", "What is photosynthesis? One sentence.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`specee-edge serve` in a child process, stopped with Ctrl+C (SIGINT) as a user would."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([CLI, "serve", "--port", str(self.port), "-c", str(N_CTX), "-t", "2", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("the server did not answer /health within 60 s")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def wait_idle(self, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while (health := self.health())["queued"] and time.monotonic() < deadline:
            time.sleep(0.05)
        return health

    def stop(self) -> str:
        self.proc.send_signal(2)
        out, _ = self.proc.communicate(timeout=30)
        return out


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    server = Server()
    yield server
    out = server.stop()
    assert server.proc.returncode == 0, out
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client: OpenAI, question: str, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 48} | kwargs
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], **kwargs)


def stream_text(client: OpenAI, question: str, max_tokens: int = 48) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model=MODEL, temperature=0,
                                                 max_tokens=max_tokens, stream=True,
                                                 messages=[{"role": "user", "content": question}]))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_models_and_health(server: Server, client: OpenAI):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    by_file = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", prompt="Hi", max_tokens=1)
    assert by_file.model == MODEL  # the file's name is the model too
    specee = models[0].model_extra["specee"]
    assert specee["n_layer"] == 30 and specee["n_ctx"] == N_CTX and specee["quality_levels"]
    assert specee["depth_bands"][0]["first"] == 0 and specee["depth_bands"][-1]["last"] == 28
    assert server.health()["status"] == "ok"


def test_chat_reply_is_the_engines_reply(client: OpenAI):
    """The server answers what the engine answers in-process, with the same template and settings."""
    reply = ask(client, QUESTIONS[0])
    engine = Engine(default_model_path(), config=EngineConfig(n_ctx=N_CTX, n_threads=2))
    try:
        expected = engine.chat([{"role": "user", "content": QUESTIONS[0]}], max_tokens=48, sampling=GREEDY)
    finally:
        engine.close()
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == ("stop" if expected.stats.finish_reason == "stop" else "length")
    assert reply.usage.prompt_tokens == expected.stats.n_prompt
    assert reply.usage.completion_tokens == len(expected.tokens)
    figures = reply.model_extra["specee"]
    assert figures["early_exit"] is True and 0 <= figures["exit_rate"] <= 1 and figures["decode_tok_s"] > 0


def test_streamed_chat_equals_the_whole_reply(client: OpenAI):
    whole = ask(client, QUESTIONS[1]).choices[0].message.content
    text, chunks = stream_text(client, QUESTIONS[1])
    assert text == whole
    token_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert all("exit_layer" in c.model_extra["specee"] for c in token_chunks)
    last = chunks[-1]
    assert last.choices[0].finish_reason in ("stop", "length") and "avg_exit_layer" in last.model_extra["specee"]


def test_stream_ends_with_done_and_usage(server: Server):
    body = {"messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    lines = [line for line in httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).text.splitlines()
             if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])["usage"]
    assert usage["completion_tokens"] == 8 and usage["total_tokens"] == usage["prompt_tokens"] + 8


def test_completions_whole_and_streamed(client: OpenAI):
    whole = client.completions.create(model=MODEL, prompt="The capital of France is",
                                      max_tokens=12, temperature=0)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 12
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is",
                                         max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


def test_stop_string_ends_the_reply_before_it(client: OpenAI):
    full = ask(client, QUESTIONS[5]).choices[0].message.content
    word = full.split()[2]
    reply = ask(client, QUESTIONS[5], stop=[word]).choices[0]
    assert reply.finish_reason == "stop" and word not in reply.message.content
    assert full.startswith(reply.message.content)


def test_sampling_with_a_seed_repeats(client: OpenAI):
    a, b = (ask(client, QUESTIONS[3], temperature=0.9, top_p=0.9, seed=7).choices[0].message.content for _ in range(2))
    assert a == b


def test_next_turn_reuses_the_cache(client: OpenAI):
    first = ask(client, QUESTIONS[4])
    messages = [{"role": "user", "content": QUESTIONS[4]},
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And a cat?"}]
    second = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8,
                                            messages=messages)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens  # the whole first prompt, at least, was not decoded again
    other = ask(client, QUESTIONS[6], max_tokens=4)  # another conversation starts from an empty cache
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_a_disconnect_frees_the_engine(server: Server):
    """A client that goes away mid-stream stops its generation: the engine makes at most a token or two more
    than the client read (those in flight), not the 800 it asked for."""
    before = server.wait_idle()["tokens_generated"]
    body = {"messages": [{"role": "user", "content": COUNTING}],
            "max_tokens": 800, "temperature": 0, "stream": True}
    received = 0
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                received += 1
                if received == 10:
                    break
    after = server.wait_idle()["tokens_generated"]
    assert received == 10
    assert after - before <= received + 4, f"the engine went on after the disconnect: {after - before} tokens"
    assert ask(OpenAI(base_url=f"{server.url}/v1", api_key="x"), QUESTIONS[0], max_tokens=4).choices[0].message.content


def test_eight_concurrent_streams_each_get_their_own_reply(client: OpenAI, server: Server):
    alone = {q: stream_text(client, q, max_tokens=64)[0] for q in QUESTIONS}
    results: dict[str, str] = {}
    errors: list[BaseException] = []

    def run(question: str) -> None:
        try:
            results[question] = stream_text(client, question, max_tokens=64)[0]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(q,)) for q in QUESTIONS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert results == alone
    assert server.wait_idle()["queued"] == 0


# --- bad input: an OpenAI error object with the right status, and the server goes on ---------------------

@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"messages": "hello"}).encode(), 400, "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}).encode(), 404, "gpt-4o"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "quality": 1.5}).encode(), 400, "quality"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "quality": "best"}).encode(), 400, "quality"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 2}).encode(), 400, "n must be 1"),
    (json.dumps({"messages": [{"role": "user", "content": "word " * 1500}]}).encode(), 400, f"context of {N_CTX}"),
])
def test_bad_requests_get_an_error_object(server: Server, body: bytes, status: int, needle: str):
    response = httpx.post(f"{server.url}/v1/chat/completions", content=body, timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["type"]
    assert server.health()["status"] == "ok"


def test_openai_client_sees_the_context_error(client: OpenAI):
    import openai

    with pytest.raises(openai.BadRequestError) as raised:
        ask(client, "word " * 1500)
    assert raised.value.code == "context_length_exceeded"


def test_api_key_and_a_full_queue():
    server = Server("--api-key", "sesame", "--max-queue", "1")
    try:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        wrong = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key
        client = OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0)
        body = {"messages": [{"role": "user", "content": COUNTING}], "max_tokens": 400, "temperature": 0, "stream": True}
        auth = {"Authorization": "Bearer sesame"}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=auth, timeout=60) as busy:
            lines = busy.iter_lines()  # kept: a dropped iterator closes the stream, and the server would see it go
            next(lines)  # the engine is generating for this one: the queue is full
            refused = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
            assert refused.status_code == 503 and refused.headers["Retry-After"]
            assert refused.json()["error"]["code"] == "queue_full"
        server.wait_idle()
        assert ask(client, QUESTIONS[0], max_tokens=4).choices[0].message.content
    finally:
        out = server.stop()
    assert "Traceback" not in out, out


def test_serve_errors_are_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run([CLI, "serve", "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert busy.returncode == 1 and "in use" in busy.stderr and "Traceback" not in busy.stderr
    missing = subprocess.run([CLI, "serve", "/nonexistent/model.gguf", "--port", str(free_port())],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1


# --- the page, in a real headless Chromium ------------------------------------------------------------------

def browser_paths() -> tuple[str, str] | None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


def test_page_streams_and_colours_tokens(server: Server):
    paths = browser_paths()
    if paths is None:
        if os.environ.get("SPECEE_REQUIRE_BROWSER"):
            pytest.fail("chromium and chromedriver are required (apt-get install chromium chromium-driver)")
        pytest.skip("no chromium/chromedriver (Debian: apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=paths[1]), options=options)
    try:
        driver.get(server.url + "/")
        WebDriverWait(driver, 30).until(lambda d: "30 layers" in d.find_element(By.ID, "model").text)
        assert "exit depth" in driver.find_element(By.ID, "legend").text
        driver.execute_script("document.getElementById('quality').value = arguments[0];",
                              f"{exiting_quality():g}")
        driver.find_element(By.ID, "input").send_keys("Write a short poem about the sea.")
        driver.find_element(By.ID, "send").click()
        WebDriverWait(driver, 120).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".figures"))
        tokens = driver.find_elements(By.CSS_SELECTOR, ".assistant .token")
        assert len(tokens) > 5
        coloured = [t for t in tokens if t.get_attribute("data-exit-layer") is not None]
        assert coloured, "no token left early, so no colour could be checked"
        assert all(t.value_of_css_property("color") != "rgba(34, 34, 34, 1)" for t in coloured)
        assert "generation" in driver.find_element(By.CSS_SELECTOR, ".figures").text
    finally:
        driver.quit()

