"""OpenAI's tool calling over a model's own chat template: which call format the template teaches, the request's
tools checked, a grammar that makes a reply one or more calls, and a reply split into its text and its calls
(whole, or as it streams).

Two formats cover the templates in use: Hermes's (Qwen2.5 and many fine-tunes: each call is a JSON object with
`name` and `arguments` between `<tool_call>` and `</tool_call>` lines) and Llama 3.1's (the reply is the JSON object
with `name` and `parameters`, after an optional `<|python_tag|>`, several separated by `;`). A template that never
reads `tools` (SmolLM2's, gemma's) would drop them without a word, so it has no format and a request with tools is
refused; chat_templates.TOOLS_CHATML_TEMPLATE (`--chat-template chatml-tools`) gives a ChatML model Hermes's format.

The content around calls loses the whitespace at its ends, with calls or without: a stream cannot know until its
end whether a call follows the newline it is holding, and the whole reply must read the same as its stream.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from specee_edge.errors import SpecEEError
from specee_edge.grammar import JSON_CHAR, ROOT, grammar_from_schema

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's token before a call; its JSON calls may go without it
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
CHOICES = ("auto", "none", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: no parameters is an empty parameter list
HERMES_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + "(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


class ToolFormat(enum.Enum):
    """How a model writes a call, as its chat template taught it."""

    HERMES = "hermes"   # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, a block per call
    LLAMA3 = "llama3"   # [<|python_tag|>]{"name": ..., "parameters": {...}}; several joined by ";"

    @property
    def arguments_key(self) -> str:
        return "arguments" if self is ToolFormat.HERMES else "parameters"


def _shown(value: Any) -> str:
    """A value as an error message quotes it: JSON, cut short."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- which format a template uses ---------------------------------------------------------------------------------

_TAG = re.compile(r"\{[{%](.*?)[%}]\}", re.S)
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.S)
_TOOLS_VARIABLE = re.compile(r"(?<![\w.])tools\b")


def reads_tools(template: str) -> bool:
    """The template's code reads the `tools` variable (its text saying "tools" does not count)."""
    return any(_TOOLS_VARIABLE.search(_STRING.sub("''", code)) for code in _TAG.findall(template))


def tool_format(template: str) -> ToolFormat | None:
    """The call format a Jinja chat template teaches its model; None where it does not render `tools` at all, or
    renders them in a format this server cannot read back."""
    if not reads_tools(template):
        return None
    if TOOL_CALL_OPEN in template:
        return ToolFormat.HERMES
    if PYTHON_TAG in template or ("parameters" in template and "ipython" in template):
        return ToolFormat.LLAMA3
    return None


# --- the request's tools and tool_choice --------------------------------------------------------------------------

def _function(spec: Any, where: str) -> dict:
    """One function's definition, checked: name, and the optional description, parameters and strict."""
    if not isinstance(spec, dict):
        raise SpecEEError(f"{where} must be an object, got {_shown(spec)}")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise SpecEEError(f"{where}.name must be 1 to 64 letters, digits, underscores or dashes, got {_shown(name)}")
    function: dict[str, Any] = {"name": name}
    if (description := spec.get("description")) is not None:
        if not isinstance(description, str):
            raise SpecEEError(f"{where}.description must be a string, got {_shown(description)}")
        function["description"] = description
    parameters = spec.get("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise SpecEEError(f"{where}.parameters must be a JSON schema (an object), got {_shown(parameters)}")
    if parameters.get("type", "object") != "object":
        raise SpecEEError(f"{where}.parameters must describe an object (the arguments), got type "
                          f"{_shown(parameters.get('type'))}")
    function["parameters"] = parameters
    if (strict := spec.get("strict")) is not None:
        if not isinstance(strict, bool):
            raise SpecEEError(f"{where}.strict must be true or false, got {_shown(strict)}")
        function["strict"] = strict
    return function


def _unique(tools: list[dict], field: str) -> list[dict]:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            raise SpecEEError(f"{field}[{i}] defines the function {name!r} a second time")
        seen.add(name)
    return tools


def check_tools(tools: Any, field: str = "tools") -> list[dict]:
    """OpenAI's `tools`, checked, each as {"type": "function", "function": {...}} with only the keys templates read
    (null: none)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise SpecEEError(f"{field} must be a list of function tools, got {_shown(tools)}")
    checked = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise SpecEEError(f"{field}[{i}] is not a function tool: {_shown(tool)}")
        checked.append({"type": "function", "function": _function(tool.get("function"), f"{field}[{i}].function")})
    return _unique(checked, field)


def check_functions(functions: Any) -> list[dict]:
    """The legacy `functions` list, checked and turned into the tools form."""
    if functions is None:
        return []
    if not isinstance(functions, list):
        raise SpecEEError(f"functions must be a list of functions, got {_shown(functions)}")
    return _unique([{"type": "function", "function": _function(spec, f"functions[{i}]")}
                    for i, spec in enumerate(functions)], "functions")


def tool_names(tools: list[dict]) -> list[str]:
    return [tool["function"]["name"] for tool in tools]


def _named(name: Any, tools: list[dict], field: str) -> dict:
    if not isinstance(name, str):
        raise SpecEEError(f"{field} must name a function, got {_shown(name)}")
    if name not in tool_names(tools):
        raise SpecEEError(f"{field} names the function {name!r}, which is not in tools")
    return {"type": "function", "function": {"name": name}}


def _mode(choice: str, tools: list[dict], field: str) -> str:
    if choice == "required" and not tools:
        raise SpecEEError(f"{field} is 'required', but the request gives no tools")
    return choice if tools else "none"


def check_tool_choice(choice: Any, tools: list[dict]) -> str | dict:
    """OpenAI's `tool_choice`, checked against the checked `tools`: "auto", "none", "required", or
    {"type": "function", "function": {"name": NAME}}. Null is OpenAI's default: "auto" with tools, else "none"."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise SpecEEError(f"tool_choice must be 'auto', 'none', 'required' or a function, got {choice!r}")
        return _mode(choice, tools, "tool_choice")
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise SpecEEError(f"tool_choice must be 'auto', 'none', 'required' or "
                          f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {_shown(choice)}")
    return _named(choice["function"].get("name"), tools, "tool_choice.function.name")


def check_function_call(call: Any, tools: list[dict]) -> str | dict:
    """The legacy `function_call` ("auto", "none" or {"name": NAME}), as a tool_choice."""
    if call is None:
        return "auto" if tools else "none"
    if call in ("auto", "none"):
        return _mode(call, tools, "function_call")
    if not isinstance(call, dict):
        raise SpecEEError(f"function_call must be 'auto', 'none' or {{\"name\": ...}}, got {_shown(call)}")
    return _named(call.get("name"), tools, "function_call.name")


def request_tools(tools: Any = None, tool_choice: Any = None, functions: Any = None,
                  function_call: Any = None) -> tuple[list[dict], str | dict]:
    """A request's tools and tool_choice, from OpenAI's fields or their legacy forms (functions, function_call)."""
    if functions is not None or function_call is not None:
        if tools is not None or tool_choice is not None:
            raise SpecEEError("give tools and tool_choice, or the legacy functions and function_call, not both")
        legacy = check_functions(functions)
        return legacy, check_function_call(function_call, legacy)
    checked = check_tools(tools)
    return checked, check_tool_choice(tool_choice, checked)


@dataclass(frozen=True)
class ToolUse:
    """A request's tools as the server runs them: rendered by the template, its calls read back in `fmt`, and the
    grammar that forces calls where tool_choice requires them (None: the model decides)."""

    tools: list[dict]
    choice: str | dict
    fmt: ToolFormat
    grammar: str | None


def plan_tools(tools: Any, tool_choice: Any, functions: Any, function_call: Any, template: str | None,
               parallel: bool = True) -> ToolUse | None:
    """What a request's tool fields ask of the server: None where it gives no tools or tool_choice is "none" (the
    reply is plain text); SpecEEError where the chat template cannot render tools."""
    checked, choice = request_tools(tools, tool_choice, functions, function_call)
    if choice == "none":
        return None
    fmt = tool_format(template or "")
    if fmt is None:
        raise SpecEEError("tools: this model's chat template does not render tools, or in a call format this server "
                          "cannot read back (Hermes's <tool_call>, Llama 3.1's): start the server with "
                          "--chat-template chatml-tools, or a template of the model's that has tools")
    return ToolUse(checked, choice, fmt, call_grammar(checked, choice, fmt, parallel))


# --- the conversation as templates read it ------------------------------------------------------------------------

def _arguments(value: Any, where: str) -> dict:
    """A call's arguments as an object: OpenAI sends them as JSON text, templates write them with tojson."""
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise SpecEEError(f"{where} must be a JSON string, got {_shown(value)}")
    if not value.strip():
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise SpecEEError(f"{where} is not valid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(parsed, dict):
        raise SpecEEError(f"{where} must be a JSON object, got {_shown(parsed)}")
    return parsed


def _function_call(function: Any, where: str) -> dict:
    """A call's name and arguments (the object at `where`), with the arguments as an object."""
    if not isinstance(function, dict):
        raise SpecEEError(f"{where} must be an object, got {_shown(function)}")
    if not isinstance(name := function.get("name"), str):
        raise SpecEEError(f"{where}.name must be a string, got {_shown(name)}")
    return {"name": name, "arguments": _arguments(function.get("arguments", "{}"), f"{where}.arguments")}


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise SpecEEError(f"{where} must be a list, got {_shown(calls)}")
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise SpecEEError(f"{where}[{j}] must be a function call, got {_shown(call)}")
    return [{**call, "type": "function", "function": _function_call(call.get("function"), f"{where}[{j}].function")}
            for j, call in enumerate(calls)]


def messages_for_template(messages: list[dict]) -> list[dict]:
    """A copy of OpenAI's messages as chat templates read them: calls' arguments as objects, a missing content as
    "", a tool result named after the call it answers where it does not say, and the legacy forms (an assistant's
    function_call, the role "function") as tool calls and tool results."""
    names: dict[str, str] = {}  # call id -> function name
    out = []
    for i, original in enumerate(messages):
        message = dict(original)
        if message.get("content") is None:
            message["content"] = ""
        if message.get("role") == "assistant" and message.get("function_call") is not None:  # legacy: one call
            function = _function_call(message.pop("function_call"), f"messages[{i}].function_call")
            message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": function}]
        elif message.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(message["tool_calls"], f"messages[{i}].tool_calls")
        names.update((call["id"], call["function"]["name"]) for call in message.get("tool_calls") or []
                     if isinstance(call.get("id"), str))
        if message.get("role") == "function":  # legacy: a function's result, named
            message["role"] = "tool"
        if message.get("role") == "tool" and not message.get("name") and message.get("tool_call_id") in names:
            message["name"] = names[message["tool_call_id"]]
        out.append(message)
    return out


# --- the grammar of a reply made of calls --------------------------------------------------------------------------

def _literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") + '"'


def _shared_rules() -> dict[str, str]:
    """The converter's fixed rules (space, string, value, ...) by name: the same text in every schema's grammar, so
    one copy serves them all."""
    from llama_cpp.llama_grammar import DOT, PRIMITIVE_RULES, SPACE_RULE, STRING_FORMAT_RULES

    rules = {name: rule.content for name, rule in {**PRIMITIVE_RULES, **STRING_FORMAT_RULES}.items()}
    return rules | {"space": SPACE_RULE, "dot": DOT, "char": JSON_CHAR}  # grammar_from_schema's char


_RULE = re.compile(r"([a-zA-Z0-9-]+) ::= (.*)")
# a rule body's tokens: literals and character classes (copied as they are), repetition counts, names
_BODY_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\{[0-9,\s]*\}|[a-zA-Z0-9-]+|.', re.S)


def prefixed_rules(grammar: str, prefix: str, shared: dict[str, str]) -> dict[str, str]:
    """The rules of a converter's `grammar`, its root renamed `prefix` and every other rule `prefix-NAME`, but for
    the shared rules it defines exactly as `shared` does (those keep their names), so that several schemas' rules
    can live in one grammar."""
    rules = {}
    for line in grammar.splitlines():
        if line.strip():
            match = _RULE.fullmatch(line.strip())
            if match is None:
                raise SpecEEError(f"the schema converter wrote a rule this server cannot read: {line[:80]!r}")
            rules[match[1]] = match[2]
    renamed = {name: name if shared.get(name) == body else prefix if name == ROOT else f"{prefix}-{name}"
               for name, body in rules.items()}
    rename = lambda token: renamed.get(token.group(0), token.group(0))
    return {renamed[name]: _BODY_TOKEN.sub(rename, body) for name, body in rules.items()}


def call_grammar(tools: list[dict], choice: str | dict, fmt: ToolFormat, parallel: bool = True) -> str | None:
    """GBNF (start rule `root`) for a reply that is nothing but calls, in the model's format: one, or with
    `parallel` one or more; of any tool for tool_choice "required", of the named one for a named choice, each
    call's arguments held to its function's parameters schema. None for "auto" and "none": the reply is free."""
    if choice in ("auto", "none"):
        return None
    wanted = [choice["function"]["name"]] if isinstance(choice, dict) else tool_names(tools)
    if not set(wanted) & set(tool_names(tools)):
        raise SpecEEError(f"tool_choice {_shown(choice)} leaves no function in tools to call")
    shared, rules, calls = _shared_rules(), {}, []
    for i, tool in enumerate(tools):
        function = tool["function"]
        if function["name"] not in wanted:
            continue
        call = f"call{i}"
        schema = grammar_from_schema(function.get("parameters") or NO_PARAMETERS,
                                     f"tools[{i}].function.parameters").text
        rules |= prefixed_rules(schema, f"{call}-args", shared)
        rules[call] = (f'"{{" space {_literal(json.dumps("name"))} space ":" space '
                       f'{_literal(json.dumps(function["name"]))} space "," space '
                       f'{_literal(json.dumps(fmt.arguments_key))} space ":" space {call}-args "}}" space')
        calls.append(call)
    rules["space"] = shared["space"]
    rules["call"] = " | ".join(calls)
    if fmt is ToolFormat.HERMES:
        opener, closer = _literal(TOOL_CALL_OPEN + "\n"), _literal("\n" + TOOL_CALL_CLOSE)  # as the template shows them
        rules["tool-call"] = f"{opener} call {closer}"
        rules[ROOT] = 'tool-call ("\\n" tool-call)*' if parallel else "tool-call"
    else:
        rules["tool-call"] = "call"
        more = ' (";" space tool-call)*' if parallel else ""
        rules[ROOT] = f"{_literal(PYTHON_TAG)}? tool-call{more}"
    first = (ROOT, "tool-call", "call", *calls)
    order = [*first, *sorted(set(rules) - set(first))]
    return "\n".join(f"{name} ::= {rules[name]}" for name in order) + "\n"


# --- calls out of a reply -----------------------------------------------------------------------------------------

def new_call(name: str, arguments: dict) -> dict:
    """A call in OpenAI's shape: its arguments as JSON text."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _call(value: Any, names: set[str]) -> dict | None:
    """The call `value` (a decoded JSON object) makes, if it names a tool and gives its arguments as an object;
    either key serves, "arguments" (Hermes) or "parameters" (Llama 3)."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text, as OpenAI's API sends them
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return new_call(value["name"], arguments) if isinstance(arguments, dict) else None


def _hermes_call(body: str, names: set[str]) -> dict | None:
    try:
        return _call(json.loads(body), names)
    except json.JSONDecodeError:
        return None


def _json_objects(text: str) -> list[tuple[str, Any]] | None:
    """`text` as JSON objects separated by ";" (and whitespace): each one's text and value; None where it is
    anything else."""
    decoder, objects, at = json.JSONDecoder(), [], 0
    skip = lambda i: len(text) - len(text[i:].lstrip())
    while (at := skip(at)) < len(text):
        if text[at] != "{":
            return None
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        objects.append((text[at:end], value))
        at = skip(end)
        if at < len(text):
            if text[at] != ";":
                return None
            at += 1
    return objects or None


def parse_calls(text: str, fmt: ToolFormat, tools: list[dict]) -> tuple[str, list[dict]]:
    """A reply split into its content (without whitespace at its ends) and its calls, in OpenAI's shape. A call
    that names no tool, or whose JSON does not parse, stays in the content for the client to see. A Hermes block
    ends at the first `</tool_call>`, as the model's own parsers read it: one inside an argument's string cuts it."""
    names = set(tool_names(tools))
    if fmt is ToolFormat.HERMES:
        content, calls, last = [], [], 0
        for match in HERMES_CALL.finditer(text):
            if (call := _hermes_call(match[1], names)) is not None:
                content.append(text[last:match.start()])
                calls.append(call)
                last = match.end()
        return ("".join(content) + text[last:]).strip(), calls
    reply = text.strip()
    objects = _json_objects(reply[len(PYTHON_TAG):] if reply.startswith(PYTHON_TAG) else reply)
    calls, rest = [], []
    for raw, value in objects or []:
        call = _call(value, names)
        calls.append(call) if call is not None else rest.append(raw)
    return ("; ".join(rest), calls) if calls else (reply, [])


def _marker_start(text: str, marker: str) -> int:
    """How many characters at the end of `text` may begin `marker` (held back until the next piece says)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class CallStream:
    """A reply's pieces as OpenAI's streamed deltas: {"content": ...} for text outside calls, and for each call,
    once it is whole, {"tool_calls": [{"index": i, "id": ..., "type": "function", "function": {"name": ...,
    "arguments": ...}}]}. Together they say what parse_calls says of the whole reply.

    Text that may begin a call marker, and whitespace that may end the content, wait for the next piece. A Llama 3
    reply that opens as a call is held whole: whether it is calls is known only at its end."""

    def __init__(self, fmt: ToolFormat, tools: list[dict]):
        self.fmt, self.tools = fmt, tools
        self._names = set(tool_names(tools))
        self.calls: list[dict] = []   # the calls sent so far
        self._pending = ""            # text not yet judged
        self._inside = False          # Hermes: within a <tool_call> block
        self._held = ""               # whitespace at the end of the content so far
        self._started = False         # content was sent (whitespace before it is dropped)
        self._calls_first: bool | None = None  # Llama 3: the reply opens as a call (None: not known yet)

    def feed(self, piece: str) -> list[dict]:
        self._pending += piece
        return self._hermes(final=False) if self.fmt is ToolFormat.HERMES else self._llama3()

    def finish(self) -> list[dict]:
        """The deltas of what was held back, at the end of the reply."""
        if self.fmt is ToolFormat.HERMES:
            events = self._hermes(final=True)
        else:
            events = self._llama3_end() if self._calls_first is not False else self._content(self._pending)
        self._pending = self._held = ""
        return events

    def _content(self, text: str) -> list[dict]:
        text = self._held + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._held = text[len(body):]
        if not body:
            return []
        self._started = True
        return [{"content": body}]

    def _call(self, call: dict) -> list[dict]:
        self.calls.append(call)
        return [{"tool_calls": [{"index": len(self.calls) - 1, **call}]}]

    def _hermes(self, final: bool) -> list[dict]:
        events = []
        while True:
            if self._inside:
                end = self._pending.find(TOOL_CALL_CLOSE)
                if end < 0:
                    if final:  # never closed: text after all
                        events += self._content(TOOL_CALL_OPEN + self._pending)
                        self._pending = ""
                    return events
                body, self._pending = self._pending[:end], self._pending[end + len(TOOL_CALL_CLOSE):]
                self._inside = False
                call = _hermes_call(body, self._names)
                events += self._call(call) if call else self._content(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)
            else:
                start = self._pending.find(TOOL_CALL_OPEN)
                if start < 0:
                    cut = len(self._pending) - (0 if final else _marker_start(self._pending, TOOL_CALL_OPEN))
                    events += self._content(self._pending[:cut])
                    self._pending = self._pending[cut:]
                    return events
                events += self._content(self._pending[:start])
                self._pending = self._pending[start + len(TOOL_CALL_OPEN):]
                self._inside = True

    def _llama3(self) -> list[dict]:
        if self._calls_first is None:
            head = self._pending.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return []
            self._calls_first = head.startswith(("{", PYTHON_TAG))
        if self._calls_first:
            return []
        events, self._pending = self._content(self._pending), ""
        return events

    def _llama3_end(self) -> list[dict]:
        content, calls = parse_calls(self._pending, self.fmt, self.tools)
        events = self._content(content)
        for call in calls:
            events += self._call(call)
        return events
