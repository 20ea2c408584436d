"""`specee-edge rpc-worker`: serve this machine's CPU to other machines' models (llama.cpp's rpc-server)."""

from __future__ import annotations

import os
import sys
import threading
from typing import Annotated

import typer

from specee_edge.cli.app import app, console, err_console, fail
from specee_edge.errors import SpecEEError

POLL_S = 0.5  # how often the main thread looks up from waiting (Ctrl+C lands there, not in ggml's accept loop)


@app.command("rpc-worker")
def rpc_worker(
    host: Annotated[str, typer.Option("-H", "--host", help="address to bind to")] = "127.0.0.1",
    port: Annotated[int, typer.Option("-p", "--port", help="port to bind to")] = 50052,
    threads: Annotated[int | None, typer.Option("-t", "--threads", show_default=False,
                                                help="CPU threads for the layers served (default: cores, at most 8)")] = None,
) -> None:
    """Serve this machine's CPU backend over ggml's RPC protocol: models started with --rpc HOST:PORT elsewhere put
    layers here. One client at a time; no authentication, so keep it on a trusted network. Ctrl+C stops it."""
    from specee_edge.cli.serve import _listen
    from specee_edge.runtime import rpc
    from specee_edge.threads import default_threads

    try:
        endpoint = rpc.parse_endpoint(f"{host}:{port}")
        if threads is not None and threads < 1:
            raise SpecEEError(f"--threads must be at least 1, got {threads}")
        _listen(host, port).close()  # a taken port or a foreign address is one line, before ggml starts
    except SpecEEError as e:
        raise fail(e) from None
    if host != rpc.LOOPBACK:
        err_console.print(rpc.INSECURE_HOST_WARNING.format(host=host), style="bold yellow", highlight=False, markup=False)
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
