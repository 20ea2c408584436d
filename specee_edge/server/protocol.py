"""The OpenAI API's request bodies and response objects, as far as specee-edge serves them.

Request fields the server does not know are ignored, as OpenAI's own API and llama-server do; a known
field of the wrong type is a 400, and so is a field it knows but cannot honour. An explicit null is the field's
default, as in OpenAI's API. Sampling defaults are llama.cpp's (llama-server and llama-cpp-python's server use the
same), not OpenAI's. A reply is constrained by OpenAI's `response_format` (a JSON object, or a JSON schema), or by
llama-server's `grammar` (GBNF) or `json_schema`: one of them. `quality` and the `specee` objects are this server's
extensions.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from specee_edge.engine import GenerationStats, SamplingParams, TokenRecord
from specee_edge.engine.sampling import INT32_MAX, MAX_REPEAT_LAST_N, MAX_SEED, TokenLogprobs
from specee_edge.engine.stops import MAX_STOP_CHARS
from specee_edge.errors import SpecEEError
from specee_edge.exits import ExitKind
from specee_edge.grammar import JSON_OBJECT_GRAMMAR, Grammar, grammar_from_schema, grammar_from_text
from specee_edge.runtime.model import utf8

MAX_STOPS = 4             # OpenAI's limit (the engine takes up to stops.MAX_STOPS)
MAX_TOP_LOGPROBS = 20     # chat's top_logprobs; completions' logprobs goes to 5
BAN = -100.0              # OpenAI: a bias of -100 bans the token (a finite -100 would not, at a head-free exit's 4 candidates)
LOGPROB_FLOOR = -9999.0   # JSON has no -Infinity
TOOL_FIELDS = ("tools", "tool_choice", "functions", "function_call")  # chat's: a completion has no turns to call in


def check_text(value: Any) -> Any:
    """A text field's strings (a string, or a list of strings or of text parts) are text UTF-8 can carry: valid
    JSON can still hold a lone UTF-16 surrogate ("\\ud800"), which the tokenizer cannot take."""
    for item in value if isinstance(value, list) else [value]:
        text = item.text if isinstance(item, TextPart) else item
        if isinstance(text, str):
            try:
                utf8(text)
            except SpecEEError as e:
                raise ValueError(str(e)) from None
    return value


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    # at most the context (n_ctx), checked by the route: no reply is longer
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)  # OpenAI's newer name; it wins
    temperature: float = Field(default=0.8, ge=0.0, le=2.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    top_k: int = Field(default=40, ge=0, le=INT32_MAX)  # llama.cpp's; not in OpenAI's API
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0)  # llama.cpp's penalties, over repeat_last_n tokens
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repeat_last_n: int = Field(default=64, ge=0, le=MAX_REPEAT_LAST_N)  # sizes the penalty sampler's ring
    logit_bias: dict[int, float] | None = None     # token id -> bias in [-100, 100]; -100 bans
    seed: int | None = Field(default=None, le=MAX_SEED)  # negative: a random seed (llama.cpp's -1)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    quality: float | Literal["default", "exact"] | None = None  # the pack's quality level for this request
    response_format: dict[str, Any] | None = None  # OpenAI's: {"type": "text" | "json_object" | "json_schema", ...}
    grammar: str | None = None                     # llama-server's: GBNF text
    json_schema: dict[str, Any] | bool | None = None  # llama-server's: a JSON schema

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        """An explicit null is the field's default."""
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items() if value is not None}

    _stop_is_text = field_validator("stop")(check_text)

    @model_validator(mode="after")
    def _check(self) -> SamplingFields:
        stops = self.stops()
        if len(stops) > MAX_STOPS or any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise ValueError(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters")
        if any(not -100.0 <= bias <= 100.0 for bias in (self.logit_bias or {}).values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return self

    @property
    def grammar_fields(self) -> list[str]:
        """The fields given that constrain the reply."""
        given = [name for name in ("grammar", "json_schema") if getattr(self, name) is not None]
        return (["response_format"] if (self.response_format or {}).get("type", "text") != "text" else []) + given

    def reply_grammar(self) -> Grammar | None:
        """The grammar the reply follows, from whichever of response_format, grammar and json_schema is given (at
        most one); SpecEEError names the field and what is wrong with it."""
        given = self.grammar_fields
        kind = (self.response_format or {}).get("type", "text")
        if len(given) > 1:
            raise SpecEEError(f"{' and '.join(given)}: give one of them")
        if self.grammar is not None:
            return grammar_from_text(self.grammar, "grammar")
        if self.json_schema is not None:
            return grammar_from_schema(self.json_schema, "json_schema")
        if kind == "text":
            return None
        if kind == "json_object":  # llama-server also reads a schema beside the type
            schema = self.response_format.get("schema")
            if schema is not None:
                return grammar_from_schema(schema, "response_format.schema")
            return grammar_from_text(JSON_OBJECT_GRAMMAR, "response_format")
        if kind == "json_schema":
            spec = self.response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise SpecEEError('response_format.json_schema: expected {"name": ..., "schema": {...}}')
            return grammar_from_schema(spec["schema"], "response_format.json_schema.schema")
        raise SpecEEError(f"response_format.type: {kind!r} is not text, json_object or json_schema")

    @property
    def reply_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def sampling(self) -> SamplingParams:
        bias = {token: -math.inf if value <= BAN else value for token, value in (self.logit_bias or {}).items()}
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repeat_penalty=self.repeat_penalty, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty, repeat_last_n=self.repeat_last_n,
                              logit_bias=bias, seed=self.seed if self.seed is None or self.seed >= 0 else None)

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

    # tool: a tool's result, as the template renders it; function: the legacy form of one
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls: checked by tools.messages_for_template
    tool_call_id: str | None = None      # a tool result: the call it answers
    name: str | None = None              # a tool result: the function's name
    function_call: Any = None            # the legacy form of an assistant's one call

    _content_is_text = field_validator("content")(check_text)

    def for_template(self) -> dict[str, Any]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        return message | {key: value for key in ("tool_calls", "tool_call_id", "name", "function_call")
                          if (value := getattr(self, key)) is not None}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # OpenAI's tools (checked by tools.plan_tools, which names the field in its error) and their legacy forms
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: bool = False  # llama-server's default (OpenAI's is true): a small model repeats its call

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def n_logprobs(self) -> int | None:
        """How many alternatives each token's logprobs lists (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    # text or token ids, or a list of one of either (OpenAI's batch form, one prompt long here); list[int] first,
    # so that [] is an empty prompt of ids rather than an empty batch. Strict: true is not token 1
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=5)

    _prompt_is_text = field_validator("prompt")(check_text)

    @model_validator(mode="before")
    @classmethod
    def _no_tools(cls, data: Any) -> Any:
        if isinstance(data, dict) and (given := [name for name in TOOL_FIELDS if data.get(name) is not None]):
            raise ValueError(f"{given[0]}: tools are called in chat turns: use /v1/chat/completions")
        return data

    @property
    def n_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The request's one prompt: text, or token ids, decoded as given (no BOS added, as in llama-server)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("one prompt per request: n and prompt lists are not supported")
            prompt = prompt[0]
        if prompt == []:
            raise ValueError("the prompt holds no token ids")
        return prompt


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(stats: GenerationStats, called: bool = False) -> str:
    """OpenAI's names: a full context ends a reply as max_tokens does; a reply that ended in calls, tool_calls."""
    if stats.finish_reason != "stop":
        return "length"
    return "tool_calls" if called else "stop"


def usage(stats: GenerationStats, n_completion: int) -> dict:
    """Token counts; n_completion: the tokens generated (an end-of-generation token included)."""
    return {"prompt_tokens": stats.n_prompt, "completion_tokens": n_completion,
            "total_tokens": stats.n_prompt + n_completion,
            "prompt_tokens_details": {"cached_tokens": stats.n_cached}}


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR) if not math.isnan(value) else LOGPROB_FLOOR


def chat_logprobs(entries: list[tuple[TokenLogprobs, int]], piece: Callable[[int], bytes]) -> dict:
    """Chat's `logprobs` object for (logprobs, token) pairs; piece(token) is the token's bytes."""
    def item(token: int, logprob: float) -> dict:
        raw = piece(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": _logprob(logprob), "bytes": list(raw)}

    return {"content": [item(token, lp.logprob) | {"top_logprobs": [item(t, v) for t, v in lp.top]}
                        for lp, token in entries]}


def completion_logprobs(entries: list[tuple[TokenLogprobs, int]], piece: Callable[[int], bytes], offset: int = 0) -> dict:
    """The legacy completions' `logprobs` object; offset: the reply's characters before the first entry."""
    tokens = [piece(token).decode("utf-8", errors="replace") for _, token in entries]
    offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [_logprob(lp.logprob) for lp, _ in entries],
            "top_logprobs": [{piece(t).decode("utf-8", errors="replace"): _logprob(v) for t, v in lp.top}
                             for lp, _ in entries],
            "text_offset": offsets}


def token_extension(record: TokenRecord) -> dict:
    """What a streamed token carries beyond OpenAI's chunk: where it left the network."""
    kind = {ExitKind.NONE: None, ExitKind.VERIFIED: "verified", ExitKind.HEAD_FREE: "head_free"}[record.exit_kind]
    return {"exit_layer": record.exit_layer, "exit_kind": kind, "source": record.source.value}


def reply_extension(stats: GenerationStats, quality: float | None) -> dict:
    """The early-exit figures of one reply."""
    return {"early_exit": stats.early_exit, "quality": quality, "n_layer": stats.n_layer,
            "avg_exit_layer": round(stats.avg_exit_layer, 3), "exit_rate": round(stats.exit_rate, 4),
            "head_free_rate": round(stats.head_free_rate, 4), "prompt_tok_s": round(stats.prompt_tok_s, 2),
            "decode_tok_s": round(stats.decode_tok_s, 2), "exact": stats.exact,
            "acceptance_rate": round(stats.acceptance_rate, 4), "tokens_per_round": round(stats.tokens_per_round, 3),
            # exact mode: what its controller chose (shares of the decoded tokens) and the costs it measured
            "choices": {k: round(v, 4) for k, v in stats.choice_shares().items()},
            "mean_drafts": round(stats.mean_drafts, 3), "explore_rounds": stats.explore_rounds,
            "controller": stats.controller}


def created() -> int:
    return int(time.time())
