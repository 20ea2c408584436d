"""A model across machines on loopback: two `specee-edge rpc-worker` processes on 127.0.0.1 hold most of the
default model's layers (ggml's RPC backend), the first layers stay on the client's CPU.

The client runs in its own process (tests/rpc_client.py): ggml keeps registered workers for the life of a
process. Greedy answers with exits off, at a lossy level and in exact mode must be the one-machine engine's;
a worker killed mid-reply is a Python error and the client process lives on; a worker that is not there is
a one-line error before anything loads; a worker that goes silent without closing its connection is lost
after --rpc-timeout, and a server says so (503, /health) instead of hanging.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from specee_edge.errors import SpecEEError
from specee_edge.runtime.costs import split_text
from specee_edge.runtime import rpc
from specee_edge.cli.chat import RPC_TIMEOUT_S
from tests.conftest import SHIPPED_PACK
from tests.test_exact import exact_pack  # noqa: F401  (the shipped pack with an exact level: a fixture)

CLI = Path(sys.executable).with_name("specee-edge")
N_GPU_LAYERS = 20  # SmolLM2's 30 layers: 0-10 on the client, 11-29 and the output head on the two workers
FIRST_LAYERS = 24  # --offload-first: 0-22 and the output head on the workers, 23-29 on the client (the shipped
#                    pack's exits fire on both sides)
START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((rpc.LOOPBACK, 0))
        return s.getsockname()[1]


def start_worker(port: int, host: str = rpc.LOOPBACK) -> subprocess.Popen:
    # Ctrl+C as at a keyboard: a shell's background job (a test run started with &) inherits SIGINT ignored
    worker = subprocess.Popen([str(CLI), "rpc-worker", "--host", host, "--port", str(port), "--threads", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:  # ggml's own lines sit in a pipe buffer: knock until it listens
        if worker.poll() is not None:
            raise AssertionError(f"rpc-worker exited: {worker.stderr.read()}")
        try:
            socket.create_connection((rpc.LOOPBACK, port), timeout=1).close()
            return worker
        except OSError:
            time.sleep(0.1)
    raise AssertionError("rpc-worker did not start")


def stop(worker: subprocess.Popen) -> None:
    if worker.poll() is None:
        worker.kill()
    worker.wait(timeout=10)


@pytest.fixture(scope="module")
def workers():
    ports = [free_port(), free_port()]
    started = [start_worker(port) for port in ports]
    yield ",".join(f"{rpc.LOOPBACK}:{port}" for port in ports)
    for worker in started:
        stop(worker)


def client(command: str, pack: Path, workers: str, layers: str = str(N_GPU_LAYERS), **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.rpc_client", command, str(pack), layers, workers],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def compare_split(pack: Path, workers: str, layers: str) -> tuple[dict, list[int]]:
    """The client's `compare` with LAYERS on the workers: its answers must be the one machine's (tokens, exits and
    logits, since the workers run the same CPU kernels: the logits are the same to the bit). Returns the result and
    the layers the lossy and exact answers' tokens exited at."""
    proc = client("compare", pack, workers, layers=layers)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    result = json.loads(out.splitlines()[-1])
    for mode in ("plain", "lossy", "exact"):
        for local, remote in zip(result["local"][mode], result["rpc"][mode]):
            assert remote["tokens"] == local["tokens"], mode
            assert remote["exits"] == local["exits"], mode
            assert remote["last_logits"] == local["last_logits"], mode
    exits = [il for mode in ("lossy", "exact") for answer in result["rpc"][mode] for il in answer["exits"] if il is not None]
    return result, exits


@pytest.mark.slow
def test_a_model_split_across_two_workers_answers_as_on_one_machine(workers, exact_pack):  # noqa: F811
    result, exits = compare_split(exact_pack, workers, str(N_GPU_LAYERS))
    first_remote = result["n_layer"] + 1 - N_GPU_LAYERS
    # exits stop after layers that live on the workers, and after the client's (the remote splits then never run)
    assert any(il >= first_remote for il in exits) and any(il < first_remote for il in exits), exits
    # every layer past the split waits for the workers; a stop or a probe there adds replies
    assert result["replies_per_token"]["plain"] >= 1
    assert result["replies_per_token"]["lossy"] > result["replies_per_token"]["plain"]
    print(json.dumps({k: result[k] for k in ("replies_per_token", "wait_ms_per_token", "bare_round_trip_ms")}))


def test_spec_ees_placement_puts_the_first_layers_on_the_workers_and_answers_as_on_one_machine(workers, exact_pack):  # noqa: F811
    """--offload-first (patch 0013): -ngl's count, but the first layers and the output go to the workers, so that a
    token leaving early skips the client's layers; answers, exits and logits stay the one machine's."""
    result, exits = compare_split(exact_pack, workers, f"first:{FIRST_LAYERS}")
    *layers, output = result["devices"]
    on_workers = FIRST_LAYERS - 1  # the output layer is one of -ngl's
    assert all(d.startswith("RPC") for d in layers[:on_workers]) and output.startswith("RPC"), result["devices"]
    assert all(d == "CPU" for d in layers[on_workers:]), result["devices"]
    # exits after the workers' layers (the client's layers then never run), and after the client's
    assert any(il < on_workers for il in exits) and any(il >= on_workers for il in exits), exits


@pytest.mark.slow
def test_the_costs_price_each_side_of_the_first_layers_split(workers, exact_pack):  # noqa: F811
    """The cost lanes on SpecEE's placement over the workers stop on both sides of the split, and the fit prices
    the client's layers apart from the workers' and the crossing between them (the figures are printed: on
    loopback both sides run the same CPU, so the crossing is what a worker's round trip costs)."""
    one_worker = workers.split(",")[0]  # with two, the first crossing would be between them
    proc = client("costs", exact_pack, one_worker, layers=f"first:{FIRST_LAYERS}")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    costs = json.loads(out.splitlines()[-1])
    print(split_text(costs), f"; a layer {costs['layer_ms']:.3f} ms, a plain token {costs['plain_ms']:.2f} ms")
    assert costs["split"] == FIRST_LAYERS - 1  # the first layer back on the client
    for part in ("layer_ms", "split_layer_ms", "crossing_ms"):
        low, high = costs["intervals"][part]
        assert low <= costs[part] <= high and np.isfinite(costs[part]), part


def test_a_stop_before_the_first_remote_layer_sends_the_workers_nothing(workers, exact_pack):  # noqa: F811
    """The draft head lives with the first layer, on this machine: a token that stops before the workers' layers
    runs none of their graphs but one, and waits for 2 replies (with the draft head on the first worker: 9.1).
    The 2 left are the probe's: its candidates' rows of the LM head, which -ngl puts on the last worker."""
    proc = client("local_stop", exact_pack, workers)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    result = json.loads(out.splitlines()[-1])
    assert set(result["exits"]) == {result["layer"]}
    assert result["replies_per_token"] < 3, result


def test_a_worker_killed_mid_reply_is_an_error_and_the_process_lives_on(exact_pack):  # noqa: F811
    ports = [free_port(), free_port()]
    started = [start_worker(port) for port in ports]
    try:
        proc = client("kill", exact_pack, ",".join(f"{rpc.LOOPBACK}:{p}" for p in ports), stdin=subprocess.PIPE)
        assert proc.stdout.readline().strip() == "mid-reply", proc.stderr.read()
        stop(started[1])
        out, err = proc.communicate("go\n", timeout=120)
    finally:
        for worker in started:
            stop(worker)
    assert proc.returncode == 0, err  # no abort(), no segfault
    result = json.loads(out.splitlines()[-1])
    lost = f"WorkerLostError: lost the RPC worker at {rpc.LOOPBACK}:{ports[1]}"
    assert len(result["errors"]) == 2 and all(e.startswith(lost) for e in result["errors"]), result["errors"]
    assert "load the model again" in result["errors"][0]
    assert len(result["local_after"]) == 8


def test_a_worker_that_is_not_there_is_one_line_before_loading():
    port = free_port()
    cli = subprocess.run([str(CLI), "generate", "-p", "hi", "-n", "1", "--rpc", f"{rpc.LOOPBACK}:{port}"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 1
    assert cli.stderr.strip().splitlines() == [
        f"error: no RPC worker at {rpc.LOOPBACK}:{port} (connection refused): start one there with "
        f"`specee-edge rpc-worker --host HOST --port {port}`"]


def test_a_worker_on_another_address_warns_and_ctrl_c_stops_it():
    port = free_port()
    worker = start_worker(port, host="0.0.0.0")
    worker.send_signal(signal.SIGINT)
    out, err = worker.communicate(timeout=10)
    assert worker.returncode == 0
    assert "WARNING: Host ('0.0.0.0') is != '127.0.0.1'" in err and "Never expose the RPC server" in err
    assert f"rpc-worker on 0.0.0.0:{port} stopped" in out


@pytest.mark.parametrize("text", ["", "host", "host:", ":50052", "host:0", "host:70000", "::1:50052", "a:1,a:1",
                                  "127.0.0.1:5\u00b2", "127.0.0.1:\u0665\u0660"])  # digits, but not ASCII ones
def test_bad_worker_addresses_are_one_line(text):
    with pytest.raises(SpecEEError):
        rpc.parse_endpoints(text)


def test_two_names_of_one_worker_are_a_worker_named_twice():
    with pytest.raises(SpecEEError, match=r"names a worker twice: .*\(localhost:50052 and 127\.0\.0\.1:50052 are both "
                                          r"127\.0\.0\.1:50052\)"):
        rpc.parse_endpoints("localhost:50052,127.0.0.1:50052")
    assert len(rpc.parse_endpoints("localhost:50052,127.0.0.1:50053")) == 2


def test_the_cli_default_timeout_is_the_runtimes():
    assert RPC_TIMEOUT_S == rpc.DEFAULT_TIMEOUT_S


def test_a_worker_bound_by_name_binds_its_address():
    """ggml's server binds IPv4 literals only: `--host localhost` binds 127.0.0.1 (it warned, then failed)."""
    port = free_port()
    worker = start_worker(port, host="localhost")
    worker.send_signal(signal.SIGINT)
    out, err = worker.communicate(timeout=10)
    assert worker.returncode == 0, err
    assert "WARNING" not in err and f"--host localhost is {rpc.LOOPBACK}" in out
    bad = subprocess.run([str(CLI), "rpc-worker", "--host", "no-such-host.invalid", "--port", str(port)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        "error: --host no-such-host.invalid is not an IPv4 address and names none (ggml's RPC server binds IPv4 only)"]


class SilentListener:
    """A TCP listener on loopback that accepts connections and never sends a byte (a frozen worker); with
    `upstream`, it relays to that worker until `silence()`, then swallows whatever arrives (a cut cable)."""

    def __init__(self, upstream: int | None = None):
        self.upstream = upstream
        self.silent = threading.Event()
        self.sock = socket.create_server((rpc.LOOPBACK, 0))
        self.port = self.sock.getsockname()[1]
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def silence(self) -> None:
        self.silent.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections.append(client)
            if self.upstream is None:
                threading.Thread(target=self._swallow, args=(client,), daemon=True).start()
                continue
            server = socket.create_connection((rpc.LOOPBACK, self.upstream))
            self.connections.append(server)
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._relay, args=(source, sink), daemon=True).start()

    def _swallow(self, source: socket.socket) -> None:
        try:
            while source.recv(1 << 16):
                pass
        except OSError:
            return

    def _relay(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                if not self.silent.is_set():
                    sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)  # a closed end closes the other (the worker serves one client at a time)
        except OSError:
            return

    def close(self) -> None:
        self.sock.close()
        for connection in self.connections:
            connection.close()


def test_a_worker_that_never_answers_is_one_line_after_the_timeout():
    """It accepts the connection and never replies to the handshake: ggml waited forever."""
    listener = SilentListener()
    try:
        start = time.monotonic()
        cli = subprocess.run([str(CLI), "generate", "-p", "hi", "-n", "1", "--rpc", f"{rpc.LOOPBACK}:{listener.port}",
                              "--rpc-timeout", "1"], capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - start
    finally:
        listener.close()
    assert cli.returncode == 1, cli.stderr
    assert cli.stderr.strip().splitlines()[-1] == (
        f"error: {rpc.LOOPBACK}:{listener.port} did not answer as an RPC worker (a different llama.cpp version?)")
    assert "recv timed out" in cli.stderr  # ggml's own log line, above ours
    assert elapsed < 30


@pytest.mark.parametrize("value", ["-1", "nan", "1e9"])
def test_a_bad_timeout_is_one_line(value):
    cli = subprocess.run([str(CLI), "generate", "-p", "hi", "-n", "1", "--rpc", f"{rpc.LOOPBACK}:{free_port()}",
                          "--rpc-timeout", value], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 1 and cli.stderr.strip().splitlines() == [
        f"error: --rpc-timeout takes seconds in [0, 86400] (0: wait forever), got {float(value):g}"]


def test_a_worker_gone_silent_mid_service_is_the_servers_503():
    """A server whose worker stops answering (its connection left open): the request in hand fails after
    --rpc-timeout with 503 worker_lost (not a hang, not 400 invalid_request_error forever), /health says
    503 and names the worker, later requests get 503 at once, and Ctrl+C still stops the server."""
    from tests.test_server import Server

    worker_port = free_port()
    worker = start_worker(worker_port)
    relay = SilentListener(upstream=worker_port)
    endpoint = f"{rpc.LOOPBACK}:{relay.port}"
    server = None
    try:
        server = Server("--rpc", endpoint, "--rpc-timeout", "2", "-ngl", "10")
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
        url = f"{server.url}/v1/chat/completions"
        assert httpx.post(url, json=body, timeout=60).status_code == 200
        relay.silence()
        start = time.monotonic()
        failed = httpx.post(url, json=body, timeout=60)
        assert failed.status_code == 503, failed.text
        assert failed.json()["error"]["code"] == "worker_lost" and endpoint in failed.json()["error"]["message"]
        assert time.monotonic() - start < 30
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["lost_workers"] == [endpoint]
        again = httpx.post(url, json=body, timeout=10)
        assert again.status_code == 503 and again.json()["error"]["code"] == "worker_lost"
    finally:
        try:
            out = server.stop() if server is not None else ""
        finally:  # a server that did not stop (the hang this test is about) takes nothing else with it
            if server is not None and server.proc.poll() is None:
                server.proc.kill()
            relay.close()
            stop(worker)
    assert server.proc.returncode == 0 and "Traceback" not in out, out


def test_worker_addresses_parse():
    assert rpc.parse_endpoints("10.0.0.2:50052, gpu-box:7000") == (rpc.Endpoint("10.0.0.2", 50052),
                                                                    rpc.Endpoint("gpu-box", 7000))
