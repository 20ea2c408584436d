"""`specee-edge serve`: the OpenAI-compatible server, with llama-server's flag spellings."""

from __future__ import annotations

import errno
import socket
from typing import Annotated

import typer

from specee_edge.cli.app import app, console, fail
from specee_edge.cli.chat import (RPC_TIMEOUT_S, ChatTemplate, CtxSize, EngineOptions, FlashAttn, FlashAttnSetting,
                                  GpuLayers, HfFile, HfRepo, KvModeOpt, ModelArg, ModelOpt, OffloadFirst,
                                  OverrideTensor, PackOpt, Quality, Rpc, RpcTimeout, Speculation, TensorSplit, Threads,
                                  chat_template_text, load_engine, pick_model)
from specee_edge.errors import SpecEEError


@app.command()
def serve(
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    hf_repo: HfRepo = None,
    hf_file: HfFile = None,
    pack: PackOpt = None,
    host: Annotated[str, typer.Option("--host", help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="port to listen on")] = 8080,
    ctx_size: CtxSize = 4096,
    n_gpu_layers: GpuLayers = None,
    rpc_workers: Rpc = None,
    rpc_timeout: RpcTimeout = RPC_TIMEOUT_S,
    tensor_split: TensorSplit = None,
    offload_first: OffloadFirst = False,
    override_tensor: OverrideTensor = None,
    threads: Threads = None,
    quality: Quality = None,
    speculation: Speculation = "auto",
    flash_attn: FlashAttn = FlashAttnSetting.auto,
    kv_mode: KvModeOpt = None,
    chat_template: ChatTemplate = None,
    api_key: Annotated[str | None, typer.Option("--api-key", show_default=False, envvar="SPECEE_API_KEY",
                                                help="require Authorization: Bearer KEY on /v1/ (env SPECEE_API_KEY)")] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", help="requests waiting or running at most; more get 503")] = 16,
    alias: Annotated[str | None, typer.Option("-a", "--alias", show_default=False,
                                              help="the model's name in /v1/models and replies (default: the -hf "
                                                   "repository as given, else the model as named)")] = None,
) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) and a chat page at /."""
    from specee_edge.cli.render import exit_setting, level_warning

    try:
        import uvicorn

        from specee_edge.server import ServerConfig, create_app
        from specee_edge.server.app import allowed_hosts, is_loopback
    except ImportError as e:
        raise fail(f"serve needs the server extra ({e.name} is missing): pip install 'specee-edge[server]'") from None
    if max_queue < 1:
        raise fail(f"--max-queue must be at least 1, got {max_queue}")
    if alias is not None and not alias.strip():
        raise fail("--alias is empty: give the model a name, or leave the flag out")
    try:
        listener = _listen(host, port)
        opts = EngineOptions(pick_model(model, model_opt, hf_repo, hf_file), pack, ctx_size, n_gpu_layers, threads,
                             kv_mode.value if kv_mode else None, quality, None, True, rpc_workers, tensor_split, rpc_timeout,
                             offload_first, override_tensor, speculation=speculation, flash_attn=flash_attn.value)
        template = chat_template_text(chat_template)
        engine, label, notice = load_engine(opts, strict_pack=False)
    except SpecEEError as e:
        raise fail(e) from None
    path = engine.model.info.path
    config = ServerConfig(model_id=served_model_id(alias, hf_repo, label), api_key=api_key, max_queue=max_queue,
                          chat_template=template, allowed_hosts=allowed_hosts(host))
    line = {"highlight": False, "markup": False, "soft_wrap": True}
    setting = exit_setting(engine)
    state = f"early exit {'on' if engine.early_exit else 'off'}{f', {setting}' if setting else ''}"
    console.print(f"specee-edge serve · {path.name} ({engine.n_layer} layers) · {state}", **line)
    exposed = None if api_key or is_loopback(host) else (
        f"listening on {host} without --api-key: anyone who can reach this address can use the model")
    for warning in (notice, level_warning(engine), exposed):
        if warning:
            console.print(warning, style="yellow", **line)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    console.print(f"chat page {url}/ · OpenAI API {url}/v1 · Ctrl+C stops", **line)
    try:
        # uvicorn picks uvloop and httptools where installed (the server extra's uvicorn[standard]): with the
        # plain asyncio loop and h11, one streaming client got 0.86x generate's tokens/s on 2 cores
        server = uvicorn.Server(uvicorn.Config(create_app(engine, config), log_level="info",
                                               timeout_graceful_shutdown=3))
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # uvicorn shut down cleanly first, then handed the signal back
        pass
    finally:
        engine.close()


def _listen(host: str, port: int) -> socket.socket:
    """Bind now, so that a port in use is one line, not a server that dies after loading the model."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "it is in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise SpecEEError(f"cannot listen on {host}:{port}: {why} (pick another with --port)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def served_model_id(alias: str | None, hf_repo: str | None, label: str) -> str:
    """The model's name to clients, as llama-server picks it: --alias, else the -hf repository as given
    (USER/REPO[:QUANT], never the cache's path), else the model as the command line named it (`label`, from
    `specee_edge.stores.resolve_model`: a store's name such as ollama:qwen2.5:0.5b, never its blob's path)."""
    return alias.strip() if alias else hf_repo or label
