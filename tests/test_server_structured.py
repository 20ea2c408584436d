"""`specee-edge serve` answering what agents send: JSON schemas (OpenAI's response_format, llama-server's
json_schema and grammar) and tools, through the official `openai` client, on the default model with a chat template
that renders tools (`--chat-template chatml-tools`)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.test_server import MODEL, Server, assert_refused, client_of

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server() -> Iterator[Server]:
    server = Server("--speculation", "always", "--chat-template", "chatml-tools")
    yield server
    out = server.stop()
    assert server.proc.returncode == 0 and "Traceback" not in out, out


@pytest.fixture(scope="module")
def client(tool_server: Server) -> OpenAI:
    return client_of(tool_server)


def test_a_json_schema_reply_parses_and_validates(client: OpenAI):
    reply = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=64,
        messages=[{"role": "user", "content": "Extract the person as JSON: Alice is 31 and lives in Paris."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    # sampled, streamed: the pieces join into JSON that fits
    chunks = client.chat.completions.create(
        model=MODEL, temperature=0.8, seed=5, max_tokens=64, stream=True,
        messages=[{"role": "user", "content": "Make up a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    pieces = [c for c in chunks if c.choices]
    if pieces[-1].choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in pieces)), PERSON)


def test_json_object_and_llama_servers_fields(tool_server: Server, client: OpenAI):
    reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=48, messages=ASK,
                                           response_format={"type": "json_object"})
    content = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # this model writes long objects: cut by max_tokens, still one begun
        assert reply.choices[0].finish_reason == "length" and content.startswith("{")
    for extra in ({"json_schema": PERSON}, {"grammar": 'root ::= "yes" | "no"'}):
        body = {"model": MODEL, "temperature": 0, "max_tokens": 48, "messages": ASK} | extra
        response = httpx.post(f"{tool_server.url}/v1/chat/completions", json=body, timeout=120)
        content = response.json()["choices"][0]["message"]["content"]
        if "grammar" in extra:
            assert content in ("yes", "no")
        else:
            jsonschema.validate(json.loads(content), PERSON)
    # the legacy completions route takes them too
    response = httpx.post(f"{tool_server.url}/v1/completions", timeout=120, json={
        "prompt": "The answer, yes or no:", "max_tokens": 4, "temperature": 0, "grammar": 'root ::= "yes" | "no"'})
    assert response.json()["choices"][0]["text"] in ("yes", "no")


def test_a_reply_cut_mid_json_says_length(client: OpenAI):
    reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=5, messages=ASK,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "person", "schema": PERSON}})
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_tool_call_round_trips(client: OpenAI, choice):
    """call -> the tool's result -> the answer, as an agent runs it."""
    reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=96, messages=ASK,
                                           tools=[WEATHER, TIME], tool_choice=choice)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    schema = next(t for t in (WEATHER, TIME) if t["function"]["name"] == call.function.name)["function"]["parameters"]
    jsonschema.validate(arguments, schema)
    follow_up = [*ASK, message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "cloudy", "celsius": 18})}]
    answer = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=48, messages=follow_up,
                                            tools=[WEATHER, TIME])
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def test_a_streamed_tool_call_is_the_whole_replys(client: OpenAI):
    kwargs = {"model": MODEL, "temperature": 0, "max_tokens": 96, "messages": ASK, "tools": [WEATHER],
              "tool_choice": "required"}
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    deltas = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert [d.index for d in deltas] == list(range(len(deltas))) and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_answers_in_text(client: OpenAI):
    reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=ASK, tools=[WEATHER],
                                           tool_choice="none")
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.tool_calls is None


ON_HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("extra, needle, param", [
    ({"grammar": "root ::= answer"}, "grammar: the grammar does not parse: Undefined rule identifier 'answer'", None),
    ({"grammar": "start ::= \"a\""}, "grammar: the grammar has no 'root ::=' rule", "grammar"),
    ({"json_schema": {"type": "number", "multipleOf": 2}}, "json_schema: #: 'multipleOf' is not enforced", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "array", "items": {"type": "integer"}, "minItems": 20000}}}},
     "response_format.json_schema.schema: its grammar is", "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema: expected", "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type: 'xml' is not", "response_format"),
    ({"grammar": 'root ::= "a"', "json_schema": PERSON}, "grammar and json_schema: give one of them", "grammar"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name names the function 'nope', which is not in tools", "tools"),
    ({"tools": "get_weather"}, "tools must be a list of function tools", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name must be", "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "constrains the reply to calls", "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]},
        {"role": "user", "content": "hi"}], "tools": [WEATHER]},
     "messages[0].tool_calls[0].function.arguments is not valid JSON", "messages"),
])
def test_bad_structured_requests_are_a_400_naming_the_field(tool_server: Server, extra, needle, param):
    error = assert_refused(tool_server, "chat/completions", json.dumps(ON_HI | extra).encode(), 400, needle)
    assert error["param"] == param and "\n" not in error["message"]


def test_tools_on_a_template_without_them_are_a_400(tool_server: Server):
    """The default model's own template drops tools; this server's chatml-tools renders them: a server started
    without it refuses them rather than answer as if none were given."""
    plain = Server("-c", "512")
    try:
        error = assert_refused(plain, "chat/completions", json.dumps(ON_HI | {"tools": [WEATHER]}).encode(), 400,
                               "tools: this model's chat template does not render tools")
        assert "--chat-template chatml-tools" in error["message"]
        assert_refused(plain, "completions", json.dumps({"prompt": "hi", "tools": [WEATHER]}).encode(), 400,
                       "tools: tools are called in chat turns")
    finally:
        plain.stop()
