"""The OpenAI API's request bodies and response objects, as far as specee-edge serves them.

Request fields the server does not know are ignored, as OpenAI's own API and llama-server do; a known
field of the wrong type is a 400. Sampling defaults are llama.cpp's (llama-server and llama-cpp-python's
server use the same), not OpenAI's. `quality` and the `specee` objects are this server's extensions.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specee_edge.engine import GenerationStats, SamplingParams, TokenRecord
from specee_edge.exits import ExitKind
from specee_edge.pack.format import EXACT_QUALITY


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.8, ge=0.0, le=2.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    top_k: int = Field(default=40, ge=0)          # llama.cpp's; not in OpenAI's API
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    quality: float | Literal["default", "exact"] | None = None  # the pack's quality level for this request

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repeat_penalty=self.repeat_penalty, seed=self.seed)

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError("one prompt per request: n and prompt lists are not supported")
        return self.prompt[0]


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(stats: GenerationStats) -> str:
    """OpenAI's names: a full context ends a reply as max_tokens does."""
    return "stop" if stats.finish_reason == "stop" else "length"


def usage(stats: GenerationStats, n_completion: int) -> dict:
    """Token counts; n_completion: the tokens generated (an end-of-generation token included)."""
    return {"prompt_tokens": stats.n_prompt, "completion_tokens": n_completion,
            "total_tokens": stats.n_prompt + n_completion,
            "prompt_tokens_details": {"cached_tokens": stats.n_cached}}


def token_extension(record: TokenRecord) -> dict:
    """What a streamed token carries beyond OpenAI's chunk: where it left the network."""
    kind = {ExitKind.NONE: None, ExitKind.VERIFIED: "verified", ExitKind.HEAD_FREE: "head_free"}[record.exit_kind]
    return {"exit_layer": record.exit_layer, "exit_kind": kind, "source": record.source.value}


def reply_extension(stats: GenerationStats, quality: float | None) -> dict:
    """The early-exit figures of one reply."""
    return {"early_exit": stats.early_exit, "quality": quality, "n_layer": stats.n_layer,
            "avg_exit_layer": round(stats.avg_exit_layer, 3), "exit_rate": round(stats.exit_rate, 4),
            "head_free_rate": round(stats.head_free_rate, 4), "prompt_tok_s": round(stats.prompt_tok_s, 2),
            "decode_tok_s": round(stats.decode_tok_s, 2), "exact": stats.rounds > 0 or quality == EXACT_QUALITY,
            "acceptance_rate": round(stats.acceptance_rate, 4), "tokens_per_round": round(stats.tokens_per_round, 3)}


def created() -> int:
    return int(time.time())
