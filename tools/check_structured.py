"""Structured output and tool calls against `specee-edge serve`, as a user's OpenAI client sends them.

    .venv/bin/python tools/check_structured.py qwen2.5-coder-1.5b-instruct [-- extra serve flags]

Starts the server on MODEL, then, greedy: a reply into a JSON schema (validated), a required tool call, the
round trip (call -> the tool's result -> the answer), the same call streamed, and `tool_choice: auto`. Prints each
answer, its finish reason and its time, and exits 1 if a reply does not validate or a call does not parse. Not part
of `make test`: it is for a model people run (the 1.5B takes a minute to load and answer here).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
from openai import OpenAI

CLI = str(Path(sys.executable).with_name("specee-edge"))
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "city": {"type": "string"}, "languages": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city", "languages"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ASK = [{"role": "user", "content": "What's the weather like in Lyon right now, in celsius?"}]


def serve(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([CLI, "serve", model, "--port", str(port), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"the server exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    sys.exit("the server did not answer /health in 5 minutes")


def timed(label: str, call):
    start = time.perf_counter()
    result = call()
    print(f"\n== {label} ({time.perf_counter() - start:.1f} s)")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("serve_flags", nargs="*")
    args = parser.parse_args()
    proc, url = serve(args.model, args.serve_flags)
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    failures = 0
    try:
        reply = timed("json_schema", lambda: client.chat.completions.create(
            model=args.model, temperature=0, max_tokens=128, messages=[{"role": "user", "content": (
                "Extract the person as JSON: Maria Lopez, 34, lives in Valencia and speaks Spanish, Catalan and "
                "English.")}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}))
        content = reply.choices[0].message.content
        print(reply.choices[0].finish_reason, content)
        try:
            jsonschema.validate(json.loads(content), PERSON)
            print("valid")
        except (ValueError, jsonschema.ValidationError) as e:
            failures += 1
            print(f"NOT VALID: {e}")

        reply = timed("tool_choice required", lambda: client.chat.completions.create(
            model=args.model, temperature=0, max_tokens=128, messages=ASK, tools=[WEATHER], tool_choice="required"))
        message = reply.choices[0].message
        print(reply.choices[0].finish_reason, message.tool_calls)
        if not message.tool_calls:
            failures += 1
            return failures
        call = message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        follow_up = [*ASK, message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 14, "sky": "rain"})}]
        answer = timed("the answer after the tool's result", lambda: client.chat.completions.create(
            model=args.model, temperature=0, max_tokens=96, messages=follow_up, tools=[WEATHER]))
        print(answer.choices[0].finish_reason, repr(answer.choices[0].message.content))

        chunks = timed("tool_choice required, streamed", lambda: list(client.chat.completions.create(
            model=args.model, temperature=0, max_tokens=128, messages=ASK, tools=[WEATHER], tool_choice="required",
            stream=True)))
        streamed = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
        print([(c.function.name, c.function.arguments) for c in streamed], chunks[-1].choices[0].finish_reason)
        if [(c.function.name, c.function.arguments) for c in streamed] != [(call.function.name, call.function.arguments)]:
            failures += 1
            print("NOT THE WHOLE REPLY'S CALL")

        reply = timed("tool_choice auto", lambda: client.chat.completions.create(
            model=args.model, temperature=0, max_tokens=128, messages=ASK, tools=[WEATHER]))
        print(reply.choices[0].finish_reason, reply.choices[0].message.tool_calls or repr(reply.choices[0].message.content))
    finally:
        proc.send_signal(2)
        proc.communicate(timeout=60)
    print(f"\n{'every check held' if not failures else f'{failures} check(s) failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
