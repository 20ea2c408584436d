"""A model across machines on loopback: two `specee-edge rpc-worker` processes on 127.0.0.1 hold most of the
default model's layers (ggml's RPC backend), the first layers stay on the client's CPU.

The client runs in its own process (tests/rpc_client.py): ggml keeps registered workers for the life of a
process. Greedy answers with exits off, at a lossy level and in exact mode must be the one-machine engine's;
a worker killed mid-reply is a Python error and the client process lives on; a worker that is not there is
a one-line error before anything loads.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specee_edge.errors import SpecEEError
from specee_edge.runtime import rpc
from tests.conftest import SHIPPED_PACK
from tests.test_exact import exact_pack  # noqa: F401  (the shipped pack with an exact level: a fixture)

CLI = Path(sys.executable).with_name("specee-edge")
N_GPU_LAYERS = 20  # SmolLM2's 30 layers: 0-10 on the client, 11-29 and the output head on the two workers
START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((rpc.LOOPBACK, 0))
        return s.getsockname()[1]


def start_worker(port: int, host: str = rpc.LOOPBACK) -> subprocess.Popen:
    worker = subprocess.Popen([str(CLI), "rpc-worker", "--host", host, "--port", str(port), "--threads", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


def client(command: str, pack: Path, workers: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.rpc_client", command, str(pack), str(N_GPU_LAYERS), workers],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_a_model_split_across_two_workers_answers_as_on_one_machine(workers, exact_pack):  # noqa: F811
    proc = client("compare", exact_pack, workers)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    result = json.loads(out.splitlines()[-1])
    first_remote = result["n_layer"] + 1 - N_GPU_LAYERS
    for mode in ("plain", "lossy", "exact"):
        for local, remote in zip(result["local"][mode], result["rpc"][mode]):
            assert remote["tokens"] == local["tokens"], mode
            assert remote["exits"] == local["exits"], mode
            # the workers run the same CPU kernels: not only the tokens, the logits are the same to the bit
            assert remote["last_logits"] == local["last_logits"], mode
    # exits stop after layers that live on the workers, and after the client's (the remote splits then never run)
    exits = [il for mode in ("lossy", "exact") for answer in result["rpc"][mode] for il in answer["exits"] if il is not None]
    assert any(il >= first_remote for il in exits) and any(il < first_remote for il in exits), exits
    # every layer past the split waits for the workers; a stop or a probe there adds replies
    assert result["replies_per_token"]["plain"] >= 1
    assert result["replies_per_token"]["lossy"] > result["replies_per_token"]["plain"]
    print(json.dumps({k: result[k] for k in ("replies_per_token", "wait_ms_per_token", "bare_round_trip_ms")}))


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


@pytest.mark.parametrize("text", ["", "host", "host:", ":50052", "host:0", "host:70000", "::1:50052", "a:1,a:1"])
def test_bad_worker_addresses_are_one_line(text):
    with pytest.raises(SpecEEError):
        rpc.parse_endpoints(text)


def test_worker_addresses_parse():
    assert rpc.parse_endpoints("10.0.0.2:50052, gpu-box:7000") == (rpc.Endpoint("10.0.0.2", 50052),
                                                                    rpc.Endpoint("gpu-box", 7000))
