"""The HTTP side: OpenAI's chat and completion endpoints over one engine, the models list, health, the page.

Every request becomes a Job for the engine's worker thread; the handler waits for the job's first event,
so a request that cannot be served (a prompt beyond the context, say) gets its status code before any
byte of a stream is sent.

In front of the routes: a bound on the request body, and without an API key a check of the Host header,
so that a web page cannot reach a local server by DNS rebinding (its requests name the attacker's host).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from importlib import resources
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specee_edge.engine import Engine, GenerationStats, TokenRecord
from specee_edge.engine.sampling import check_logit_bias
from specee_edge.errors import ContextFullError, SpecEEError
from specee_edge.exits import depth_band, depth_bands
from specee_edge.grammar import Grammar
from specee_edge.pack import PackLevelError, parse_quality
from specee_edge.runtime import rpc
from specee_edge.runtime.model import check_token_ids
from specee_edge.server import protocol
from specee_edge.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from specee_edge.server.tools import CallStream, ToolUse, messages_for_template, parse_calls, plan_tools
from specee_edge.server.worker import EngineWorker, Job, QueueFullError, ServerClosingError

# The page's colour of each exit-depth band (exits.DEPTH_BAND_SHARES), the terminal's hues (green, cyan,
# yellow, magenta) in shades that read on white.
BAND_COLOURS = ("#2e9e44", "#1a9fb5", "#c49a00", "#b4379c")
RETRY_AFTER_S = 1
CLIENT_GONE = 499
MAX_BODY_BYTES = 8 << 20  # far above what a context of tokens takes as text
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
Body = TypeVar("Body", ChatCompletionRequest, CompletionRequest)


@dataclass
class ServerConfig:
    model_id: str              # what /v1/models lists and every reply names (requests may name any model)
    api_key: str | None = None
    max_queue: int = 16
    chat_template: str | None = None  # instead of the model's
    allowed_hosts: frozenset[str] | None = None  # Host header names accepted without a key (None: any)


def is_loopback(bind: str) -> bool:
    return bind in LOOPBACK_HOSTS or bind.startswith("127.")


def allowed_hosts(bind: str) -> frozenset[str] | None:
    """The names a browser may call a server bound to `bind` by: loopback names for a loopback address, the
    address itself otherwise; None for a wildcard address, whose names cannot be known."""
    if bind in ("0.0.0.0", "::", ""):
        return None
    return LOOPBACK_HOSTS | {bind} if is_loopback(bind) else frozenset({bind})


def host_name(header: str) -> str:
    """The name in a Host header, without its port: `[::1]:8080` -> `::1`, `localhost:8080` -> `localhost`."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class Guard:
    """ASGI middleware: 413 for a body over MAX_BODY_BYTES (declared or streamed), 403 for a Host header the
    server was not bound under (when config.allowed_hosts is set)."""

    def __init__(self, app: ASGIApp, config: ServerConfig):
        self.app, self.config = app, config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        allowed = self.config.allowed_hosts
        if allowed is not None and not self.config.api_key and host_name(headers.get("host", "")) not in allowed:
            return await _refuse(send, 403, f"the Host header {headers.get('host', '')!r} does not name this server"
                                            " (start it with --api-key to serve other names)")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return await _refuse(send, 413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        seen = 0

        async def bounded_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
            return message

        await self.app(scope, bounded_receive, send)


async def _refuse(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class ApiError(Exception):
    """A request the server answers with OpenAI's error object and `status`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.param, self.headers = status, kind, code, param, headers


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    worker = EngineWorker(engine, max_queue=config.max_queue)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        worker.close()  # after uvicorn has closed the connections, which cancels their jobs

    app = FastAPI(title="specee-edge", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(Guard, config=config)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(str(e), e.kind, e.code, e.param), status_code=e.status, headers=e.headers)

    @app.exception_handler(Exception)
    async def server_bug(_: Request, e: Exception) -> JSONResponse:  # logged by uvicorn; the client gets one line
        return JSONResponse(error_body(f"the server failed: {type(e).__name__}: {e}", "server_error"), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(_validation_message(e)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    def check_api_key(request: Request) -> None:
        """With --api-key, every /v1/ route wants it (/health and the page stay open)."""
        if not config.api_key:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        given = given.strip() if scheme.lower() == "bearer" else ""
        if not secrets.compare_digest(given.encode(), config.api_key.encode()):
            what = "a wrong API key" if given else "no API key"
            raise ApiError(401, f"{what}: send Authorization: Bearer KEY", "authentication_error", "invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @app.get("/health")
    async def health() -> JSONResponse:
        """503 once an RPC worker holding the model's layers is lost: no request can be served until a restart."""
        body = {"status": "ok", "queued": worker.queued, "tokens_generated": worker.tokens_generated}
        if lost := lost_workers(engine):
            body |= {"status": "error", "lost_workers": lost, "message": lost_message(lost)}
        return JSONResponse(body, status_code=503 if lost else 200)

    def model_object() -> dict:
        policy = engine.policy
        levels = [level.quality for level in policy.pack.levels] if policy else []
        bands = [{"first": first, "last": last, "colour": BAND_COLOURS[band]}
                 for first, last, band in depth_bands(engine.n_layer)]
        specee = {"n_layer": engine.n_layer, "n_ctx": engine.ctx.n_ctx, "pack": policy is not None,
                  "early_exit": engine.early_exit, "exact": engine.exact,
                  "quality_levels": levels, "quality": _level_quality(engine, engine.config.quality), "depth_bands": bands,
                  "layer_colours": [BAND_COLOURS[depth_band(layer, engine.n_layer)] for layer in range(engine.n_layer)]}
        return {"id": config.model_id, "object": "model", "created": 0, "owned_by": "specee-edge", "specee": specee}

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_object()]}

    @v1.get("/models/{name:path}")
    async def model(name: str) -> dict:
        """One model is served, under any name (clients hard-code theirs): its object says which it is."""
        return model_object()

    # Bodies are parsed and checked off the event loop, which serves every client's stream: a body of millions of
    # token ids took seconds of CPU. A template may be slow on long conversations too.
    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await run_in_threadpool(_parse, ChatCompletionRequest, await request.body())
        tool_use = await run_in_threadpool(_tool_use, engine, body, config.chat_template)
        prompt = await run_in_threadpool(_format_chat, engine, body, config.chat_template, tool_use)
        return await _complete(request, body, prompt, chat=True, tool_use=tool_use)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body, prompt = await run_in_threadpool(_completion, engine, await request.body())
        return await _complete(request, body, prompt, chat=False)

    app.include_router(v1)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return resources.files("specee_edge.server").joinpath("static/index.html").read_text()

    async def _complete(request: Request, body: ChatCompletionRequest | CompletionRequest, prompt: str | list[int],
                        *, chat: bool, tool_use: ToolUse | None = None) -> Response:
        if body.n != 1:
            raise ApiError(400, f"n must be 1 (one choice per request), got {body.n}", code="unsupported_value")
        if body.reply_limit is not None and body.reply_limit > engine.ctx.n_ctx:
            field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            raise ApiError(400, f"{field} is {body.reply_limit}, more than the context holds ({engine.ctx.n_ctx} tokens,"
                                " prompt included)", param=field)
        if lost := lost_workers(engine):  # the request would only fail in the queue
            raise ApiError(503, lost_message(lost), "server_error", "worker_lost")
        sampling = body.sampling()
        with refused_as("logit_bias"):  # the Sampler's own check, made before the request waits in the queue
            check_logit_bias(sampling.logit_bias, engine.model.info.n_vocab)
        quality = _request_quality(engine, body.quality, engine.config.quality)
        with refused_as((body.grammar_fields or ["response_format"])[0]):
            grammar = await run_in_threadpool(body.reply_grammar)
        if tool_use is not None and tool_use.grammar is not None:
            if grammar is not None:
                raise ApiError(400, f"tool_choice {tool_use.choice!r} constrains the reply to calls: give no "
                                    f"{body.grammar_fields[0]} with it", param="tool_choice")
            grammar = Grammar(tool_use.grammar, "tool_choice")
        max_tokens = body.reply_limit or engine.ctx.n_ctx  # none: until the context is full
        job = Job(prompt, max_tokens, sampling, body.stops(), quality, asyncio.get_running_loop(), body.n_logprobs,
                  grammar)
        try:
            worker.submit(job)
        except QueueFullError as e:
            raise ApiError(503, str(e), "server_error", "queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        reply = Reply(job, request, chat, config.model_id, _level_quality(engine, quality), engine.model.token_to_piece,
                      tool_use)
        streaming = False
        try:
            first = await reply.next_event()
            if first[0] == "error":
                raise _api_error(first[1])
            if body.stream:
                streaming = True  # from here the stream's own end (or the client's going) cancels the job
                return EventSourceResponse(reply.chunks(first, body.include_usage), sep="\n")
            return JSONResponse(await reply.whole(first))
        except ClientGone:  # nobody reads the answer; nginx's "client closed request" is what the log shows
            return Response(status_code=CLIENT_GONE)
        finally:
            if not streaming:  # answered, failed, or the client went away (or the server stops): a no-op once done
                job.cancel()

    return app


class Reply:
    """One request's events turned into OpenAI's response objects: whole, or as stream chunks."""

    def __init__(self, job: Job, request: Request, chat: bool, model_id: str, quality: float | None,
                 piece: Callable[[int], bytes], tool_use: ToolUse | None = None):
        self.job, self.request, self.chat, self.model_id, self.quality = job, request, chat, model_id, quality
        self.piece = piece  # a token's bytes, for logprobs
        self.tool_use = tool_use  # the reply's calls are read back into tool_calls
        self.id = protocol.new_id("chatcmpl" if chat else "cmpl")
        self.created = protocol.created()
        self.n_tokens = 0
        self.n_chars = 0  # of the reply so far: the legacy logprobs' text offsets

    async def next_event(self, *, watch_client: bool = True) -> tuple[str, TokenRecord | GenerationStats | Exception]:
        """The job's next event; a client that goes away meanwhile cancels the job. A stream passes
        watch_client=False: its response (sse-starlette) already listens for the disconnect, and a second
        listener on the same connection would only add a task and a poll per token."""
        event = await (self._event_unless_gone() if watch_client else self.job.events.get())
        self.n_tokens += event[0] == "token"
        return event

    async def _event_unless_gone(self) -> tuple[str, TokenRecord | GenerationStats | Exception]:
        while True:
            try:
                return await asyncio.wait_for(self.job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await self.request.is_disconnected():
                    self.job.cancel()
                    raise ClientGone()

    def logprobs(self, records: list[TokenRecord]) -> dict | None:
        """OpenAI's logprobs object for these tokens (None when the request asked for none)."""
        if self.job.n_logprobs is None:
            return None
        entries = [(r.logprobs, r.id) for r in records if r.logprobs is not None]
        if self.chat:
            return protocol.chat_logprobs(entries, self.piece)
        return protocol.completion_logprobs(entries, self.piece, self.n_chars)

    async def whole(self, event: tuple) -> dict:
        records = []
        while event[0] == "token":
            records.append(event[1])
            event = await self.next_event()
        if event[0] == "error":
            raise _api_error(event[1])
        stats = event[1]
        text = "".join(r.text for r in records)
        logprobs = self.logprobs(records)
        calls: list[dict] = []
        if self.tool_use is not None:
            text, calls = parse_calls(text, self.tool_use.fmt, self.tool_use.tools)
        message = {"role": "assistant", "content": (text or None) if calls else text}
        if calls:
            message["tool_calls"] = calls
        choice = ({"index": 0, "message": message, "logprobs": logprobs} if self.chat
                  else {"index": 0, "text": text, "logprobs": logprobs})
        choice["finish_reason"] = protocol.finish_reason(stats, bool(calls))
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_id, "choices": [choice],
                "usage": protocol.usage(stats, self.n_tokens),
                "specee": protocol.reply_extension(stats, self.quality)}

    async def chunks(self, event: tuple, include_usage: bool) -> AsyncIterator[dict]:
        """Server-sent events: a chunk per token, one with the finish reason and the reply's figures, [DONE]."""
        calls = CallStream(self.tool_use.fmt, self.tool_use.tools) if self.tool_use is not None else None
        try:
            if self.chat:
                yield self._chunk({"delta": {"role": "assistant", "content": ""}})
            while event[0] == "token":
                record = event[1]
                if calls is not None:  # text outside calls as it comes, each call once it is whole
                    for delta in calls.feed(record.text):
                        yield self._chunk({"delta": delta}, specee=protocol.token_extension(record))
                else:
                    piece = {"delta": {"content": record.text}} if self.chat else {"text": record.text}
                    if (logprobs := self.logprobs([record])) is not None:
                        piece["logprobs"] = logprobs
                    self.n_chars += len(record.text)
                    yield self._chunk(piece, specee=protocol.token_extension(record))
                event = await self.next_event(watch_client=False)
            if event[0] == "error":  # after the first token only a bug gets here: end the stream with it
                yield {"data": json.dumps(error_body(str(event[1]), "server_error"))}
                return
            stats = event[1]
            for delta in calls.finish() if calls is not None else []:
                yield self._chunk({"delta": delta})
            last = {"delta": {}} if self.chat else {"text": ""}
            called = calls is not None and bool(calls.calls)
            yield self._chunk(last | {"finish_reason": protocol.finish_reason(stats, called)},
                              specee=protocol.reply_extension(stats, self.quality))
            if include_usage:
                yield {"data": json.dumps(self._object([]) | {"usage": protocol.usage(stats, self.n_tokens)})}
            yield {"data": "[DONE]"}
        finally:  # the client went away mid-stream (or the stream ended): stop at the next token
            self.job.cancel()

    def _object(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model_id, "choices": choices}

    def _chunk(self, choice: dict, specee: dict | None = None) -> dict:
        body = self._object([{"index": 0, "finish_reason": None} | choice])
        if specee is not None:
            body["specee"] = specee
        return {"data": json.dumps(body)}


@contextmanager
def refused_as(param: str) -> Iterator[None]:
    """A check's one-line error as a 400 that names the request's field."""
    try:
        yield
    except (ValueError, SpecEEError) as e:
        raise ApiError(400, str(e), param=param) from None


def _json(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # arrays or objects nested thousands deep: the client's malformed request
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None


def _validate(model: type[Body], data: object) -> Body:
    try:
        return model.model_validate(data)
    except ValidationError as e:  # answered as FastAPI's own validation of a body
        raise RequestValidationError(e.errors()) from None


def _parse(model: type[Body], raw: bytes) -> Body:
    return _validate(model, _json(raw))


def _completion(engine: Engine, raw: bytes) -> tuple[CompletionRequest, str | list[int]]:
    """A completion request and its one prompt. A prompt of token ids is refused by its length first, before
    anything walks it: it cannot be longer than the context."""
    data = _json(raw)
    prompt = data.get("prompt") if isinstance(data, dict) else None
    if isinstance(prompt, list) and prompt:
        batch = isinstance(prompt[0], (str, list))  # OpenAI's list of prompts (of one prompt: validation says so)
        ids = (prompt[0] if len(prompt) == 1 else None) if batch else prompt
        if isinstance(ids, list) and len(ids) >= engine.ctx.n_ctx:
            raise ApiError(400, f"the prompt ({len(ids)} tokens) does not fit the context of {engine.ctx.n_ctx}"
                                " (use a larger -c/--ctx-size or a shorter prompt)",
                           code="context_length_exceeded", param="prompt")
    body = _validate(CompletionRequest, data)
    with refused_as("prompt"):
        prompt = body.single_prompt()
        if isinstance(prompt, list):
            check_token_ids(prompt, engine.model.info.n_vocab, "prompt")
    return body, prompt


def lost_workers(engine: Engine) -> list[str]:
    """The RPC workers holding the model's layers that stopped answering."""
    return [str(worker) for worker in engine.model.workers if rpc.is_lost(worker)]


def lost_message(lost: list[str]) -> str:
    return (f"lost the RPC worker{'s' if len(lost) > 1 else ''} at {', '.join(lost)}, which held layers of the model:"
            " restart the worker, then this server")


def _tool_use(engine: Engine, body: ChatCompletionRequest, template: str | None) -> ToolUse | None:
    """The request's tools as the server runs them (None: no tools, or tool_choice none)."""
    param = "functions" if body.functions is not None or body.function_call is not None else "tools"
    with refused_as(param):
        return plan_tools(body.tools, body.tool_choice, body.functions, body.function_call,
                          template or engine.chat_template, body.parallel_tool_calls)


def _format_chat(engine: Engine, body: ChatCompletionRequest, template: str | None, tool_use: ToolUse | None) -> str:
    with refused_as("messages"):
        messages = messages_for_template([m.for_template() for m in body.messages])
    try:
        return engine.format_chat(messages, template, tool_use.tools if tool_use is not None else None)
    except SpecEEError as e:
        raise ApiError(400, str(e), param="messages") from None
    except Exception as e:  # the template's own error (a role order it refuses, say)
        raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None


def _request_quality(engine: Engine, value: float | str | None, server_quality: float | None) -> float | None:
    """A request's `quality`: a level of the pack's (checked now, so that the request fails with 400); the
    server's --quality where it names none, the pack's default level for `default`."""
    if value is None:
        return server_quality
    if value == "default":
        return None
    if engine.policy is None:
        raise ApiError(400, "quality levels come from a pack, and this server has none", param="quality")
    try:
        quality = parse_quality(str(value))
        engine.policy.pack.level(quality)
    except (PackLevelError, SpecEEError) as e:
        raise ApiError(400, str(e), param="quality") from None
    return quality


def _level_quality(engine: Engine, quality: float | None) -> float | None:
    """The quality of the level a request runs at (None: no levels, or early exit off)."""
    if engine.policy is None or not engine.early_exit or not engine.policy.pack.levels:
        return None
    return engine.policy.pack.level(quality).quality


def _api_error(e: Exception) -> ApiError:
    if isinstance(e, ContextFullError):
        return ApiError(400, str(e), code="context_length_exceeded", param="messages")
    if isinstance(e, ServerClosingError):
        return ApiError(503, str(e), "server_error", "shutting_down")
    if isinstance(e, rpc.WorkerLostError):  # the server's trouble, not the request's
        return ApiError(503, str(e), "server_error", "worker_lost")
    if isinstance(e, SpecEEError):
        return ApiError(400, str(e))
    return ApiError(500, f"the server failed: {type(e).__name__}: {e}", "server_error")


def _validation_message(e: RequestValidationError) -> str:
    """FastAPI's first validation error, in one line: `messages.0.role: Input should be ...`."""
    errors = e.errors()
    if not errors:
        return "the request body is not valid"
    first = errors[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}"
    message = str(first.get("msg")).removeprefix("Value error, ")  # a validator's own sentence
    return f"{where}: {message}" if where else message
