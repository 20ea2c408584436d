"""`specee-edge rpc-worker`: serve this machine's CPU to other machines' models (llama.cpp's rpc-server)."""

from __future__ import annotations

import os
import sys
import threading
from typing import Annotated

import typer

from specee_edge.cli.app import app, console, err_console, fail
from specee_edge.cli.chat import RPC_TIMEOUT_S
from specee_edge.errors import SpecEEError

POLL_S = 0.5  # how often the main thread looks up from waiting (Ctrl+C lands there, not in ggml's accept loop)


@app.command("rpc-worker")
def rpc_worker(
    host: Annotated[str, typer.Option("-H", "--host", help="address to bind to")] = "127.0.0.1",
    port: Annotated[int, typer.Option("-p", "--port", help="port to bind to")] = 50052,
    threads: Annotated[int | None, typer.Option("-t", "--threads", show_default=False,
                                                help="CPU threads for the layers served (default: cores, at most 8)")] = None,
    rpc_timeout: Annotated[float, typer.Option("--rpc-timeout", help=(
        "with a limit, TCP keepalive frees the worker of a client whose machine vanished after about this many"
        " seconds (an idle client is kept); 0: ggml's own sockets, kept forever"))] = RPC_TIMEOUT_S,
) -> None:
    """Serve this machine's CPU backend over ggml's RPC protocol: models started with --rpc HOST:PORT elsewhere put
    layers here. One client at a time; no authentication, so keep it on a trusted network. Ctrl+C stops it."""
    from specee_edge.cli.serve import _listen
    from specee_edge.runtime import rpc
    from specee_edge.threads import default_threads

    try:
        named = rpc.parse_endpoint(f"{host}:{port}")
        # ggml's server binds IPv4 literals only: a name (localhost, this machine's) binds what it resolves to
        address = rpc.ipv4_address(named.host)
        if address is None:
            raise SpecEEError(f"--host {host} is not an IPv4 address and names none (ggml's RPC server binds IPv4 only)")
        endpoint = rpc.Endpoint(address, port)
        if threads is not None and threads < 1:
            raise SpecEEError(f"--threads must be at least 1, got {threads}")
        _listen(address, port).close()  # a taken port or a foreign address is one line, before ggml starts
        rpc.set_timeout(rpc_timeout)
    except SpecEEError as e:
        raise fail(e) from None
    if address != rpc.LOOPBACK:
        err_console.print(rpc.INSECURE_HOST_WARNING.format(host=address), style="bold yellow", highlight=False, markup=False)
    if address != host:
        console.print(f"--host {host} is {address}")
    # ggml's server loop never returns while it serves: it runs in a thread, so that Ctrl+C reaches this one
    server = threading.Thread(target=rpc.serve, args=(endpoint, threads or default_threads()), daemon=True)
    server.start()
    try:
        while server.is_alive():
            server.join(POLL_S)
    except KeyboardInterrupt:
        console.print(f"rpc-worker on {endpoint} stopped")
        sys.stdout.flush()
        sys.stderr.flush()
        # the server thread is inside ggml's accept loop, which has no way out: leave without unwinding
        # the C++ statics it is using
        os._exit(0)
    raise fail(f"the RPC server on {endpoint} could not start (see ggml's message above)")
