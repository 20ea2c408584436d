"""One engine, many clients: requests wait in arrival order for the one thread that owns the engine.

The engine is not thread-safe and a model's decode uses every core, so requests are served one at a time.
Each request is a Job: the worker thread streams its records into the job's asyncio queue, and checks
before each token whether the client has gone, so a disconnect frees the engine within one token.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from specee_edge.engine import Engine, GenerationStats, SamplingParams, TokenRecord
from specee_edge.errors import SpecEEError
from specee_edge.grammar import Grammar

log = logging.getLogger("specee_edge.server")

EventKind = Literal["token", "done", "error"]


class QueueFullError(SpecEEError):
    """The queue holds as many requests as it may: the client should retry later."""


class ServerClosingError(SpecEEError):
    """The server stops before it got to the request."""


@dataclass
class Job:
    """One request's generation, and the channel its events come back through."""

    prompt: str | list[int]  # text, or token ids decoded as given
    max_tokens: int
    sampling: SamplingParams
    stop: Sequence[str]
    quality: float | None  # the pack's level for this request (None: the pack's default)
    loop: asyncio.AbstractEventLoop
    n_logprobs: int | None = None  # each token's logprobs, with this many alternatives (None: none)
    grammar: Grammar | None = None  # every token of the reply is one it allows
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: EventKind, value: TokenRecord | GenerationStats | Exception) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def cancel(self) -> None:
        """The client has gone: the worker stops before the next token (or skips the job if it waits)."""
        self.cancelled.set()


class EngineWorker:
    """The thread that owns the engine, and the bounded queue in front of it."""

    def __init__(self, engine: Engine, *, max_queue: int):
        self.engine = engine
        self.max_queue = max_queue  # requests waiting or running
        self._quality = engine.config.quality  # the level the engine is set to
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._in_queue = 0
        self.tokens_generated = 0  # over the server's life, cancelled replies' tokens included
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="specee-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._in_queue >= self.max_queue:
                raise QueueFullError(f"the server is busy: {self._in_queue} requests are queued (--max-queue {self.max_queue})")
            self._in_queue += 1
        self._jobs.put(job)

    @property
    def queued(self) -> int:
        with self._lock:
            return self._in_queue

    def close(self) -> None:
        """Stop the thread once the job in hand ends; jobs still waiting are told the server is stopping."""
        self._closing = True
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._closing:
                    job.emit("error", ServerClosingError("the server is shutting down"))
                elif not job.cancelled.is_set():
                    self._serve(job)
            except Exception as e:  # a bug, not bad input: log it, tell the client, keep serving
                log.exception("generation failed")
                job.emit("error", e)
            finally:
                with self._lock:
                    self._in_queue -= 1

    def _serve(self, job: Job) -> None:
        engine = self.engine
        if engine.policy is not None and job.quality != self._quality:
            engine.set_quality(job.quality)
            self._quality = job.quality
        try:
            tokens = engine.tokenize(job.prompt) if isinstance(job.prompt, str) else job.prompt
            engine.check_prompt(tokens)  # a prompt refused leaves the cached conversation as it was
            reuse_cache(engine, tokens)
            # a client that goes away during a long prompt stops it at the next batch
            stream = engine.stream(tokens, max_tokens=job.max_tokens, sampling=job.sampling, stop=job.stop,
                                   logprobs=job.n_logprobs, grammar=job.grammar, cancel=job.cancelled.is_set)
            for record in stream:
                if job.cancelled.is_set():
                    stream.close()  # the engine keeps what it decoded, consistently (as Ctrl+C does)
                    return
                self.tokens_generated += 1
                job.emit("token", record)
        except SpecEEError as e:
            job.emit("error", e)
            return
        job.emit("done", engine.stats)


def reuse_cache(engine: Engine, tokens: Sequence[int]) -> None:
    """Keep the cache only for a prompt that extends what it holds (a conversation's next turn); anything else
    starts from an empty cache, so that a reply does not depend on which request came before.

    Reuse is not free of effects: the engine keeps only cells computed through every layer (it decodes again
    from the first an early exit left approximate), but a reply's cells came from one-token steps, and a fresh
    request would decode the same tokens as one batch, whose kernels differ in the last bits. A greedy reply
    can then differ where two tokens nearly tie (as with llama-server's cache_prompt)."""
    cached = engine.cached_tokens
    if cached and list(tokens[:len(cached)]) != cached:
        engine.reset()
