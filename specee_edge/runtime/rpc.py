"""ggml's RPC backend (ggml-rpc), as llama.cpp's `rpc-server` and `--rpc` use it.

A worker serves its machine's CPU backend over TCP (ggml_backend_rpc_start_server). A client adds
each worker's devices through the RPC backend's registry (ggml_backend_rpc_add_server, then
ggml_backend_register, as common/arg.cpp's --rpc does), after which llama.cpp's default device
selection puts the offloaded layers (n_gpu_layers, split by tensor_split) on them. The graph runs
across the machines; the patched scheduler's stops, resumes and batches are unchanged.

patches/0010-rpc-lost-server.patch makes a lost worker an error this module reports instead of an
abort of the whole process, and counts the replies the client waits for (the price of a stop or
a probe read after a layer that lives on a worker). patches/0012-rpc-socket-timeout.patch bounds the
wait: a worker that is silent for --rpc-timeout seconds (DEFAULT_TIMEOUT_S) without closing the connection
(power loss, a cut cable, a frozen process) counts as lost too, and TCP keepalive finds a vanished
host on an idle connection.
"""

from __future__ import annotations

import ctypes
import socket
import statistics
import threading
import time
from dataclasses import dataclass

from llama_cpp import llama_cpp as _llama

from specee_edge.errors import SETUP_HINT, SpecEEError

DEFAULT_PORT = 50052  # rpc-server's
LOOPBACK = "127.0.0.1"
CONNECT_TIMEOUT_S = 3.0
# the longest one send or receive to a worker may wait before the worker counts as lost: above what a
# worker's share of a long prompt's batch takes on a slow machine (a reply waits for the graphs before it)
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 86400.0  # a day: ggml takes milliseconds as a 32-bit count
GGML_BACKEND_DEVICE_TYPE_CPU = 0

# ggml as libllama loaded it (a symbol lookup through libllama reaches its dependencies): llama_cpp._ggml loads
# another copy of libggml (the wheel's libggml.so is a file, not a link to libllama's libggml.so.0), whose
# backend registry libllama never sees
libggml = _llama._lib

_dev_p = ctypes.c_void_p
_reg_p = ctypes.c_void_p

for _name, _args, _res in (
    ("ggml_backend_reg_by_name", [ctypes.c_char_p], _reg_p),
    ("ggml_backend_reg_get_proc_address", [_reg_p, ctypes.c_char_p], ctypes.c_void_p),
    ("ggml_backend_reg_dev_count", [_reg_p], ctypes.c_size_t),
    ("ggml_backend_reg_dev_get", [_reg_p, ctypes.c_size_t], _dev_p),
    ("ggml_backend_dev_memory", [_dev_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)], None),
    ("ggml_backend_register", [_reg_p], None),
    ("ggml_backend_dev_by_type", [ctypes.c_int], _dev_p),
    # every device's buffer type by name, as llama.cpp's -ot names them (runtime.placement)
    ("ggml_backend_dev_count", [], ctypes.c_size_t),
    ("ggml_backend_dev_get", [ctypes.c_size_t], _dev_p),
    ("ggml_backend_dev_buffer_type", [_dev_p], ctypes.c_void_p),
    ("ggml_backend_buft_name", [ctypes.c_void_p], ctypes.c_char_p),
):
    getattr(libggml, _name).argtypes = _args
    getattr(libggml, _name).restype = _res

_add_server_t = ctypes.CFUNCTYPE(_reg_p, ctypes.c_char_p)
_start_server_t = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                   ctypes.POINTER(_dev_p))
_is_lost_t = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_char_p)
_get_replies_t = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64),
                                  ctypes.POINTER(ctypes.c_uint64))
_set_timeout_t = ctypes.CFUNCTYPE(None, ctypes.c_uint32)

INSECURE_HOST_WARNING = (
    "WARNING: Host ('{host}') is != '127.0.0.1'\n"
    "         Never expose the RPC server to an open network!\n"
    "         This is an experimental feature and is not secure!"
)  # llama.cpp's rpc-server prints the same: RPC has no authentication and no encryption


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Replies:
    """Messages that waited for a worker's reply, and the time spent waiting (the worker runs commands
    in order: a reply also waits for the graph computes sent before it)."""

    count: int = 0
    wait_ms: float = 0.0

    def __sub__(self, other: Replies) -> Replies:
        return Replies(self.count - other.count, self.wait_ms - other.wait_ms)

    def __add__(self, other: Replies) -> Replies:
        return Replies(self.count + other.count, self.wait_ms + other.wait_ms)


class WorkerLostError(SpecEEError):
    """An RPC worker stopped answering: the layers it held are gone, the model must be loaded again."""


def parse_endpoint(text: str) -> Endpoint:
    host, sep, port = text.strip().partition(":")  # ggml-rpc splits at the first colon: no IPv6 literals
    # ASCII digits only: str.isdigit() takes "5²", which int() then refuses
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise SpecEEError(f"an RPC worker is HOST:PORT with an IPv4 address or a name (e.g. 192.168.1.20:{DEFAULT_PORT}),"
                          f" got {text!r}")
    return Endpoint(host, int(port))


def ipv4_address(host: str) -> str | None:
    """The IPv4 address `host` names (itself for an IPv4 literal; ggml-rpc connects over IPv4 only), or None
    where the name does not resolve to one."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError, IndexError):
        return None


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """--rpc's value: comma-separated HOST:PORT. Two names of one machine (localhost and 127.0.0.1) are one worker
    named twice: ggml would connect to it once and count its devices twice."""
    endpoints = tuple(parse_endpoint(part) for part in text.split(",") if part.strip())
    if not endpoints:
        raise SpecEEError("--rpc takes one or more HOST:PORT, comma-separated")
    seen: dict[tuple[str, int], Endpoint] = {}
    for endpoint in endpoints:
        key = (ipv4_address(endpoint.host) or endpoint.host, endpoint.port)  # a name that does not resolve: as written
        if key in seen:
            same = "" if seen[key] == endpoint else f" ({seen[key]} and {endpoint} are both {key[0]}:{key[1]})"
            raise SpecEEError(f"--rpc names a worker twice: {text}{same}")
        seen[key] = endpoint
    return endpoints


def set_timeout(seconds: float) -> None:
    """--rpc-timeout: how long one send or receive to a worker may wait before the worker counts as lost, for the
    connections opened from now on (0: no limit, ggml's own behaviour). A worker sets it too: with a limit,
    its connections get TCP keepalive, so that a client whose machine vanished does not hold it for good."""
    if not 0 <= seconds <= MAX_TIMEOUT_S:  # NaN too
        raise SpecEEError(f"--rpc-timeout takes seconds in [0, {MAX_TIMEOUT_S:g}] (0: wait forever), got {seconds:g}")
    # at least 1 ms: a positive timeout must not round to 0, which would mean "no limit"
    _proc("ggml_backend_rpc_set_timeout", _set_timeout_t)(max(1, round(seconds * 1000)) if seconds else 0)


def _rpc_reg() -> int:
    reg = libggml.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise SpecEEError(f"this runtime was built without ggml's RPC backend (GGML_RPC): {SETUP_HINT}")
    return reg


def _proc(name: str, prototype):
    address = libggml.ggml_backend_reg_get_proc_address(_rpc_reg(), name.encode())
    if not address:
        raise SpecEEError(f"ggml's RPC backend lacks {name}: it is not the patched runtime; {SETUP_HINT}")
    return prototype(address)


def _check_listening(endpoint: Endpoint) -> None:
    """A one-line error for a worker that is not there (ggml-rpc itself would only log it)."""
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise SpecEEError(f"no RPC worker at {endpoint} ({reason.lower()}): start one there with "
                          f"`specee-edge rpc-worker --host HOST --port {endpoint.port}`") from None


def connect(endpoints: tuple[Endpoint, ...], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """--rpc and --rpc-timeout: add the workers, so that the layers every model this process loads from now on
    offloads (runtime.placement) go to them."""
    if endpoints:
        set_timeout(timeout_s)
        add_workers(endpoints)


_added: dict[Endpoint, int] = {}  # endpoint -> its registry, registered once per process (ggml keeps them)
_added_lock = threading.Lock()


def add_workers(endpoints: tuple[Endpoint, ...]) -> int:
    """Register each worker's devices with ggml (llama.cpp's --rpc); returns how many devices they add.
    From then on, every model loaded in this process with layers offloaded puts them on these devices."""
    add_server = _proc("ggml_backend_rpc_add_server", _add_server_t)
    total = 0
    with _added_lock:
        for endpoint in endpoints:
            if endpoint not in _added:
                _check_listening(endpoint)
                reg = add_server(str(endpoint).encode())
                if not reg:  # it closed the connection, or is not an RPC server of this protocol version
                    raise SpecEEError(f"{endpoint} did not answer as an RPC worker (a different llama.cpp version?)")
                libggml.ggml_backend_register(reg)
                _added[endpoint] = reg
            elif is_lost(endpoint):
                raise WorkerLostError(f"the RPC worker at {endpoint} was lost earlier in this process: restart "
                                      "this program (after the worker) to use it again")
            total += libggml.ggml_backend_reg_dev_count(_added[endpoint])
    return total


def registered() -> tuple[Endpoint, ...]:
    """The workers whose devices this process registered: where llama.cpp puts offloaded layers."""
    with _added_lock:
        return tuple(_added)


def is_lost(endpoint: Endpoint) -> bool:
    return bool(_proc("ggml_backend_rpc_is_lost", _is_lost_t)(str(endpoint).encode()))


def check_workers(endpoints: tuple[Endpoint, ...]) -> None:
    """Raise WorkerLostError if any of these workers stopped answering."""
    lost = [str(e) for e in endpoints if is_lost(e)]
    if lost:
        raise WorkerLostError(f"lost the RPC worker{'s' if len(lost) > 1 else ''} at {', '.join(lost)}: the layers "
                              "there are gone; restart the worker and load the model again")


def replies(endpoints: tuple[Endpoint, ...]) -> Replies:
    """The replies waited for from these workers so far (their connections' lifetime counters)."""
    get = _proc("ggml_backend_rpc_get_replies", _get_replies_t)
    total = Replies()
    for endpoint in endpoints:
        n, us = ctypes.c_uint64(0), ctypes.c_uint64(0)
        if get(str(endpoint).encode(), ctypes.byref(n), ctypes.byref(us)):
            total += Replies(n.value, us.value / 1e3)
    return total


def round_trip_ms(endpoint: Endpoint, samples: int = 50) -> float:
    """The median time of a bare round trip to a registered worker (a device-memory query: a few bytes each
    way, nothing computed): what a stop after one of its layers adds at the least."""
    with _added_lock:
        reg = _added[endpoint]
    device = libggml.ggml_backend_reg_dev_get(reg, 0)
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        libggml.ggml_backend_dev_memory(device, ctypes.byref(free), ctypes.byref(total))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def serve(endpoint: Endpoint, n_threads: int) -> None:
    """Serve this machine's CPU backend at `endpoint` until the process ends (rpc-server's loop; set_timeout
    before: its clients' connections get keepalive). Returns only if the server could not start."""
    start_server = _proc("ggml_backend_rpc_start_server", _start_server_t)
    cpu = libggml.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not cpu:
        raise SpecEEError("ggml has no CPU device to serve")
    devices = (_dev_p * 1)(cpu)
    start_server(str(endpoint).encode(), None, n_threads, 1, devices)
