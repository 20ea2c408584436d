"""Tool calling's pure parts (specee_edge/server/tools.py): a template's call format, the request's tools checked,
the conversation as templates read it, the grammar of a reply made of calls (parsed, and run, by llama.cpp's own
grammar sampler on the default model's vocabulary), a reply split into text and calls, whole and streamed."""

from __future__ import annotations

import ctypes
import json
import math
import random
import re

import llama_cpp
import pytest
from llama_cpp.llama_chat_format import CHATML_CHAT_TEMPLATE, LLAMA3_INSTRUCT_CHAT_TEMPLATE, Jinja2ChatFormatter

from specee_edge.chat_templates import GEMMA_CHAT_TEMPLATE, TOOLS_CHATML_TEMPLATE
from specee_edge.errors import SpecEEError
from specee_edge.runtime.logging import caught_messages
from specee_edge.server.tools import (
    CallStream,
    ToolFormat,
    call_grammar,
    check_tool_choice,
    check_tools,
    messages_for_template,
    parse_calls,
    prefixed_rules,
    request_tools,
    tool_format,
)

HERMES, LLAMA3 = ToolFormat.HERMES, ToolFormat.LLAMA3

# The shape of Qwen2.5-Instruct's template (abridged): tools listed in the system turn, calls as <tool_call> blocks.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}"
    "{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == \"assistant\" and message.tool_calls %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

# The shape of Llama 3.1-Instruct's template (abridged): JSON calls with "parameters", results in ipython turns.
LLAMA31_TEMPLATE = (
    "{{- bos_token }}\n{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}\n"
    "{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}\n"
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}\n"
    "{%- if tools is not none and tools_in_user_message %}\n"
    "    {{- \"Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\\n\\n\" }}\n"
    "    {{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}.' }}\n"
    "    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- \"\\n\\n\" }}{%- endfor %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if 'tool_calls' in message %}\n"
    "        {%- set tool_call = message.tool_calls[0].function %}\n"
    "        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + '<|python_tag|>' + tool_call.name }}\n"
    "        {%- else %}{{- '{\"name\": \"' + tool_call.name + '\", \"parameters\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}' }}{%- endif %}\n"
    "    {%- elif message.role == \"tool\" or message.role == \"ipython\" %}"
    "{{- \"<|start_header_id|>ipython<|end_header_id|>\\n\\n\" }}{{- message.content | tojson }}{{- \"<|eot_id|>\" }}\n"
    "    {%- else %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] "
    "| trim + '<|eot_id|>' }}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)


def weather_tools() -> list[dict]:
    """Two functions with nested object parameters."""
    return check_tools([
        {"type": "function", "function": {
            "name": "get_weather", "description": "The weather at a place.",
            "parameters": {"type": "object", "properties": {
                "location": {"type": "object", "properties": {"city": {"type": "string"},
                                                              "country": {"type": "string"}},
                             "required": ["city"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"}},
                "required": ["location"]}}},
        {"type": "function", "function": {
            "name": "send_email",
            "parameters": {"type": "object", "properties": {
                "to": {"type": "array", "items": {"type": "string"}},
                "body": {"type": "object", "properties": {"subject": {"type": "string"}, "text": {"type": "string"},
                                                          "urgent": {"type": "boolean"}},
                         "required": ["subject", "text"]}},
                "required": ["to", "body"]}}},
    ])


TOOLS = weather_tools()
PARIS = {"location": {"city": "Paris", "country": "FR"}, "unit": "celsius"}
MAIL = {"to": ["a@b.c"], "body": {"subject": "Hi; there", "text": "See {you} <b>soon</b>"}}


def hermes(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def llama3(name: str, arguments: dict) -> str:
    return json.dumps({"name": name, "parameters": arguments})


def named(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


# --- which format a template uses ----------------------------------------------------------------------------------

def test_the_format_is_read_from_the_template(default_model):
    assert tool_format(QWEN25_TEMPLATE) is HERMES
    assert tool_format(LLAMA31_TEMPLATE) is LLAMA3
    assert tool_format(TOOLS_CHATML_TEMPLATE) is HERMES
    smollm2 = default_model.meta("tokenizer.chat_template")
    assert "im_start" in smollm2 and tool_format(smollm2) is None
    # none of these reads `tools`: tools given to them would vanish from the prompt. llama-cpp-python's "llama3" is
    # Llama 3's turn format without 3.1's tool turns
    for template in (GEMMA_CHAT_TEMPLATE, CHATML_CHAT_TEMPLATE, LLAMA3_INSTRUCT_CHAT_TEMPLATE):
        assert tool_format(template) is None


def test_only_a_template_that_reads_tools_has_a_format():
    # "tools" and "<tool_call>" only in the text it writes
    assert tool_format("{{ 'You have tools: answer in <tool_call>' }}{% for m in messages %}{{ m.content }}{% endfor %}"
                       ) is None
    assert tool_format("{% for t in message.tools %}<tool_call>{% endfor %}") is None  # an attribute, not the variable
    assert tool_format("{% if tools %}{{ tools | tojson }}<tool_call>{% endif %}") is HERMES
    assert tool_format("{% if tools %}{{ tools | tojson }}{% endif %}") is None  # a format it cannot read back


# --- the request's tools and tool_choice ---------------------------------------------------------------------------

def tool(name: str = "f", **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


@pytest.mark.parametrize("tools, message", [
    ({"type": "function"}, r"^tools must be a list of function tools, got \{\"type\": \"function\"\}$"),
    ([tool(), {"type": "retrieval"}], r"^tools\[1\] is not a function tool: \{\"type\": \"retrieval\"\}$"),
    (["f"], r"^tools\[0\] is not a function tool: \"f\"$"),
    ([{"type": "function", "function": "f"}], r"^tools\[0\]\.function must be an object, got \"f\"$"),
    ([tool("get weather")], r"^tools\[0\]\.function\.name must be 1 to 64 letters, digits, underscores or dashes, "
                            r"got \"get weather\"$"),
    ([tool("x" * 65)], r"tools\[0\]\.function\.name must be 1 to 64"),
    ([{"type": "function", "function": {}}], r"tools\[0\]\.function\.name must be .*, got null$"),
    ([tool(description=3)], r"^tools\[0\]\.function\.description must be a string, got 3$"),
    ([tool(parameters="{}")], r"^tools\[0\]\.function\.parameters must be a JSON schema \(an object\), got \"\{\}\"$"),
    ([tool(parameters={"type": "string"})], r"^tools\[0\]\.function\.parameters must describe an object \(the "
                                            r"arguments\), got type \"string\"$"),
    ([tool(strict="yes")], r"^tools\[0\]\.function\.strict must be true or false, got \"yes\"$"),
    ([tool("f"), tool("g"), tool("f")], r"^tools\[2\] defines the function 'f' a second time$"),
])
def test_tools_that_are_not_openai_function_tools_are_refused(tools, message):
    with pytest.raises(SpecEEError, match=message):
        check_tools(tools)


def test_tools_are_kept_as_templates_read_them():
    given = [tool("a_b-9", description="d", parameters={"type": "object", "properties": {"x": {"type": "string"}}},
                  strict=True, extra="dropped")]
    assert check_tools(given) == [{"type": "function", "function": {
        "name": "a_b-9", "description": "d", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        "strict": True}}]
    # no parameters: an empty parameter list, as OpenAI has it
    assert check_tools([tool("g")])[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert check_tools(None) == [] and check_tools([]) == []


@pytest.mark.parametrize("choice, message", [
    ("sometimes", r"^tool_choice must be 'auto', 'none', 'required' or a function, got 'sometimes'$"),
    ({"type": "function", "function": {"name": "foo"}},
     r"^tool_choice\.function\.name names the function 'foo', which is not in tools$"),
    ({"type": "function", "function": {}}, r"^tool_choice\.function\.name must name a function, got null$"),
    ({"type": "code_interpreter"}, r"^tool_choice must be 'auto', 'none', 'required' or \{\"type\": \"function\", "
                                   r"\"function\": \{\"name\": \.\.\.\}\}, got \{\"type\": \"code_interpreter\"\}$"),
    (3, r"^tool_choice must be 'auto'.*, got 3$"),
])
def test_a_tool_choice_that_is_not_one_of_the_tools_is_refused(choice, message):
    with pytest.raises(SpecEEError, match=message):
        check_tool_choice(choice, TOOLS)


def test_tool_choice_defaults_as_openai_has_it():
    assert check_tool_choice(None, TOOLS) == "auto" and check_tool_choice(None, []) == "none"
    assert [check_tool_choice(c, TOOLS) for c in ("auto", "none", "required")] == ["auto", "none", "required"]
    assert check_tool_choice("auto", []) == "none"
    with pytest.raises(SpecEEError, match=r"^tool_choice is 'required', but the request gives no tools$"):
        check_tool_choice("required", [])
    chosen = {"type": "function", "function": {"name": "send_email", "ignored": 1}}
    assert check_tool_choice(chosen, TOOLS) == {"type": "function", "function": {"name": "send_email"}}


def test_the_legacy_functions_become_tools():
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {}}}]
    tools, choice = request_tools(functions=functions, function_call={"name": "get_weather"})
    assert tools == [{"type": "function", "function": functions[0]}]
    assert choice == {"type": "function", "function": {"name": "get_weather"}}
    assert request_tools(functions=functions) == (tools, "auto")
    assert request_tools(functions=functions, function_call="none")[1] == "none"
    assert request_tools() == ([], "none")
    assert request_tools(tools=[tool("f")], tool_choice="required") == (check_tools([tool("f")]), "required")
    for kwargs, message in [
        ({"functions": [{"name": "a b"}]}, r"^functions\[0\]\.name must be 1 to 64 letters"),
        ({"functions": {"name": "f"}}, r"^functions must be a list of functions"),
        ({"functions": functions, "function_call": {"name": "other"}},
         r"^function_call\.name names the function 'other', which is not in tools$"),
        ({"functions": functions, "function_call": "always"}, r"^function_call must be 'auto', 'none' or"),
        ({"functions": functions, "tools": [tool("f")]}, r"^give tools and tool_choice, or the legacy functions"),
    ]:
        with pytest.raises(SpecEEError, match=message):
            request_tools(**kwargs)


# --- the conversation as templates read it -------------------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(PARIS)}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


def test_arguments_reach_the_template_as_objects():
    original = json.loads(json.dumps(CONVERSATION))
    messages = messages_for_template(CONVERSATION)
    assert CONVERSATION == original  # a copy: the request is untouched
    assert messages[1]["content"] == ""
    assert messages[1]["tool_calls"] == [{"id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": PARIS}}]
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}',
                           "name": "get_weather"}  # named after the call it answers
    assert messages[0] == CONVERSATION[0]


def test_the_legacy_function_messages_become_tool_calls():
    messages = messages_for_template([
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{\"a\": 1}"}},
        {"role": "function", "name": "f", "content": "2"}])
    assert messages[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
    assert "function_call" not in messages[0]
    assert messages[1] == {"role": "tool", "name": "f", "content": "2"}
    with pytest.raises(SpecEEError, match=r"^messages\[0\]\.function_call\.arguments is not valid JSON: "):
        messages_for_template([{"role": "assistant", "function_call": {"name": "f", "arguments": "{a}"}}])


@pytest.mark.parametrize("calls, message", [
    ([{"function": {"name": "f", "arguments": "{\"a\": "}}],
     r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments is not valid JSON: Expecting value at column 7$"),
    ([{"function": {"name": "f", "arguments": "{}"}}, {"function": {"name": "g", "arguments": "[1]"}}],
     r"^messages\[1\]\.tool_calls\[1\]\.function\.arguments must be a JSON object, got \[1\]$"),
    ([{"function": {"name": "f", "arguments": 3}}],
     r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments must be a JSON string, got 3$"),
    ([{"name": "f"}], r"^messages\[1\]\.tool_calls\[0\]\.function must be an object, got null$"),
    (["f"], r"^messages\[1\]\.tool_calls\[0\] must be a function call, got \"f\"$"),
    ("f", r"^messages\[1\]\.tool_calls must be a list, got \"f\"$"),
])
def test_arguments_that_are_not_a_json_object_are_refused(calls, message):
    with pytest.raises(SpecEEError, match=message):
        messages_for_template([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}])


# --- the grammar ---------------------------------------------------------------------------------------------------

def rules_of(grammar: str) -> dict[str, str]:
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())
    assert len(rules) == len(grammar.splitlines()), "a rule is defined twice"
    return rules


def test_every_rule_the_grammar_names_it_defines_once():
    for fmt in ToolFormat:
        rules = rules_of(call_grammar(TOOLS, "required", fmt))
        names = {name for body in rules.values()
                 for name in re.findall(r"[a-zA-Z][a-zA-Z0-9-]*", re.sub(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]', "",
                                                                         body))}
        assert names <= set(rules)
        assert {"call0-args", "call1-args", "space", "string"} <= set(rules)  # each schema's root, renamed; shared ones


def test_schemas_rules_are_prefixed_and_the_shared_ones_kept():
    grammar = ('root ::= "{" space opts-kv "}" space\nopts-kv ::= "\\"opts\\"" space ":" space opts\n'
               'opts ::= string\nspace ::= " "?\nstring ::= "\\"" char* "\\"" space\n'
               'char ::= [^"\\\\] | "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])')
    from specee_edge.server.tools import _shared_rules

    rules = prefixed_rules(grammar, "p", _shared_rules())
    assert rules["p"] == '"{" space p-opts-kv "}" space'
    assert rules["p-opts-kv"] == '"\\"opts\\"" space ":" space p-opts'  # the name inside the literal is left alone
    assert rules["p-opts"] == "string" and "string" in rules and "space" in rules
    # a rule named as a shared one but defined otherwise is the schema's own
    rules = prefixed_rules('root ::= space\nspace ::= "  "', "p", _shared_rules())
    assert rules == {"p": "p-space", "p-space": '"  "'}


def test_auto_and_none_need_no_grammar():
    assert call_grammar(TOOLS, "auto", HERMES) is None and call_grammar(TOOLS, "none", LLAMA3) is None


def test_a_schema_the_grammar_cannot_enforce_is_refused_in_one_line():
    tools = check_tools([tool("f", parameters={"type": "object", "properties": {"n": {"type": "integer",
                                                                                     "minimum": 1}}})])
    with pytest.raises(SpecEEError, match=r"^tools\[0\]\.function\.parameters: #/properties/n: 'minimum' is not "
                                          r"enforced"):
        call_grammar(tools, "required", HERMES)
    assert call_grammar(tools, "auto", HERMES) is None  # nothing to enforce without a grammar


class GrammarRun:
    """A grammar run by llama.cpp's grammar sampler over the default model's vocabulary, a token at a time."""

    def __init__(self, model, grammar: str):
        self.model = model
        self.vocab = getattr(model, "vocab_handle", None) or model._vocab
        with caught_messages() as said:
            self.sampler = llama_cpp.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        assert self.sampler, f"llama.cpp refused the grammar: {said}\n{grammar}"

    def allows(self, token: int) -> bool:
        data = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(token, 0.0, 0.0))
        array = llama_cpp.llama_token_data_array(data, 1, -1, False)
        llama_cpp.llama_sampler_apply(self.sampler, ctypes.byref(array))
        return math.isfinite(data[0].logit)

    def takes(self, reply: str) -> bool:
        """The grammar takes `reply` whole, and then its end."""
        try:
            for token in self.model.tokenize(reply, add_special=False, parse_special=False):
                if not self.allows(token):
                    return False
                llama_cpp.llama_sampler_accept(self.sampler, token)
            return self.allows(llama_cpp.llama_vocab_eos(self.vocab))
        finally:
            llama_cpp.llama_sampler_free(self.sampler)


@pytest.mark.parametrize("fmt, call", [(HERMES, hermes), (LLAMA3, llama3)])
def test_llama_cpp_runs_the_grammar_of_any_tool(default_model, fmt, call):
    grammar = call_grammar(TOOLS, "required", fmt)
    join = "\n" if fmt is HERMES else "; "
    for reply, ok in [
        (call("get_weather", PARIS), True),
        (call("send_email", MAIL), True),
        (call("get_weather", {"location": {"city": "Oslo"}, "days": 3}), True),
        (call("get_weather", PARIS) + join + call("send_email", MAIL), True),        # parallel calls
        (call("get_weather", {"unit": "celsius"}), False),                          # a required property missing
        (call("get_weather", {"location": {"country": "FR"}}), False),              # nested: its required city
        (call("get_weather", {"location": {"city": "Paris"}, "unit": "kelvin"}), False),  # not in the enum
        (call("send_email", {"to": "a@b.c", "body": MAIL["body"]}), False),         # a string for an array
        (call("get_time", {}), False),                                              # no such tool
        ("Sure! " + call("get_weather", PARIS), False),                             # nothing but calls
        (call("get_weather", PARIS) + " Done.", False),
        ("", False),
    ]:
        assert GrammarRun(default_model, grammar).takes(reply) is ok, reply
    if fmt is LLAMA3:
        assert GrammarRun(default_model, grammar).takes("<|python_tag|>" + call("get_weather", PARIS))


def test_llama_cpp_runs_the_grammar_of_a_named_tool(default_model):
    choice = check_tool_choice({"type": "function", "function": {"name": "send_email"}}, TOOLS)
    grammar = call_grammar(TOOLS, choice, HERMES)
    assert "get_weather" not in grammar
    assert GrammarRun(default_model, grammar).takes(hermes("send_email", MAIL))
    assert GrammarRun(default_model, grammar).takes(hermes("send_email", MAIL) + "\n" + hermes("send_email", MAIL))
    assert not GrammarRun(default_model, grammar).takes(hermes("get_weather", PARIS))
    one = call_grammar(TOOLS, choice, HERMES, parallel=False)
    assert GrammarRun(default_model, one).takes(hermes("send_email", MAIL))
    assert not GrammarRun(default_model, one).takes(hermes("send_email", MAIL) + "\n" + hermes("send_email", MAIL))
    # a function without parameters takes only {}
    bare = check_tools([tool("ping")])
    grammar = call_grammar(bare, "required", LLAMA3)
    assert GrammarRun(default_model, grammar).takes(llama3("ping", {}))
    assert not GrammarRun(default_model, grammar).takes(llama3("ping", {"a": 1}))


# --- calls out of a reply ------------------------------------------------------------------------------------------

def test_a_hermes_reply_splits_into_text_and_calls():
    assert parse_calls("The sky is blue.\n", HERMES, TOOLS) == ("The sky is blue.", [])
    content, calls = parse_calls(hermes("get_weather", PARIS), HERMES, TOOLS)
    assert content == "" and named(calls) == [("get_weather", PARIS)]
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0]["id"]) and calls[0]["type"] == "function"
    content, calls = parse_calls("Let me look.\n" + hermes("get_weather", PARIS) + "\n" + hermes("send_email", MAIL),
                                 HERMES, TOOLS)
    assert content == "Let me look." and named(calls) == [("get_weather", PARIS), ("send_email", MAIL)]
    assert calls[0]["id"] != calls[1]["id"]
    # unknown functions and broken JSON stay in the content, for the client to see
    unknown, broken = hermes("get_time", {}), "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\n</tool_call>"
    content, calls = parse_calls(f"{unknown}\n{hermes('get_weather', PARIS)}\n{broken}", HERMES, TOOLS)
    assert content == f"{unknown}\n\n{broken}" and named(calls) == [("get_weather", PARIS)]
    assert parse_calls("<tool_call>\n{\"name\": \"get_weather\"", HERMES, TOOLS) == (
        "<tool_call>\n{\"name\": \"get_weather\"", [])  # never closed


def test_a_llama3_reply_splits_into_text_and_calls():
    assert parse_calls("Paris is sunny.", LLAMA3, TOOLS) == ("Paris is sunny.", [])
    assert parse_calls('{"answer": 42}', LLAMA3, TOOLS) == ('{"answer": 42}', [])  # JSON, but no call
    content, calls = parse_calls(llama3("get_weather", PARIS), LLAMA3, TOOLS)
    assert content == "" and named(calls) == [("get_weather", PARIS)]
    content, calls = parse_calls("<|python_tag|>" + llama3("get_weather", PARIS) + "; " + llama3("send_email", MAIL),
                                 LLAMA3, TOOLS)
    assert content == "" and named(calls) == [("get_weather", PARIS), ("send_email", MAIL)]  # a ";" in a string too
    content, calls = parse_calls(llama3("get_time", {}) + ";" + llama3("send_email", MAIL), LLAMA3, TOOLS)
    assert content == llama3("get_time", {}) and named(calls) == [("send_email", MAIL)]
    broken = '{"name": "get_weather", "parameters": {"location": }'
    assert parse_calls(broken, LLAMA3, TOOLS) == (broken, [])
    text = "Call " + llama3("get_weather", PARIS)
    assert parse_calls(text, LLAMA3, TOOLS) == (text, [])  # only a reply that is calls is calls
    # arguments as JSON text, and under "arguments", are read too
    content, calls = parse_calls(json.dumps({"name": "get_weather", "arguments": json.dumps(PARIS)}), LLAMA3, TOOLS)
    assert named(calls) == [("get_weather", PARIS)]


REPLIES = {
    HERMES: [
        "",
        "  \n",
        "Plain text, no calls at all.\n\n",
        "  leading space < and <tool and <tool_cal",
        hermes("get_weather", PARIS),
        "Let me check.\n" + hermes("get_weather", PARIS) + "\n" + hermes("send_email", MAIL) + "\n",
        "A\n" + hermes("get_weather", PARIS) + "\n\nB <tool_call",
        hermes("get_time", {}) + "\n" + hermes("get_weather", PARIS),
        "<tool_call>\n{broken}\n</tool_call> then " + hermes("send_email", MAIL) + " <tool_call>\n{\"name\"",
        "<tool_call><tool_call>" + json.dumps({"name": "send_email", "arguments": MAIL}) + "</tool_call>",
    ],
    LLAMA3: [
        "",
        "Plain text.\n",
        "<|python_",
        "<b>bold</b>",
        llama3("get_weather", PARIS),
        " <|python_tag|>" + llama3("get_weather", PARIS) + "; " + llama3("send_email", MAIL) + "\n",
        llama3("get_time", {}) + ";" + llama3("send_email", MAIL),
        '{"answer": 42}',
        '{"name": "get_weather", "parameters": {',
    ],
}


def streamed(text: str, fmt: ToolFormat, pieces: list[str]) -> tuple[str, list[dict]]:
    stream = CallStream(fmt, TOOLS)
    events = [event for piece in pieces for event in stream.feed(piece)] + stream.finish()
    content = "".join(event.get("content", "") for event in events)
    calls = [call for event in events for call in event.get("tool_calls", [])]
    assert [call["index"] for call in calls] == list(range(len(calls)))
    assert all(set(event) in ({"content"}, {"tool_calls"}) for event in events)
    assert [call["id"] for call in calls] == [call["id"] for call in stream.calls]
    return content, calls


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_a_stream_says_what_the_whole_reply_says(fmt):
    rng = random.Random(7)
    for text in REPLIES[fmt]:
        content, calls = parse_calls(text, fmt, TOOLS)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 5))) if len(text) > 1 else []
        for pieces in (list(text), [text], [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]):
            assert _same(streamed(text, fmt, pieces), (content, calls)), (text, pieces)


def _same(got: tuple[str, list[dict]], want: tuple[str, list[dict]]) -> bool:
    """The same content and calls, ids aside (each parse draws its own)."""
    return got[0] == want[0] and named(got[1]) == named(want[1])


def test_a_stream_holds_back_only_what_may_start_a_call():
    stream = CallStream(HERMES, TOOLS)
    assert stream.feed("Hello") == [{"content": "Hello"}]
    assert stream.feed(" <tool") == []                      # the space may end the content; "<tool" start a call
    assert stream.feed("box>") == [{"content": " <toolbox>"}]
    assert stream.feed("\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": PARIS})) == []
    [event] = stream.feed("\n</tool_call>")
    assert named(event["tool_calls"]) == [("get_weather", PARIS)] and event["tool_calls"][0]["index"] == 0
    assert stream.finish() == [] and len(stream.calls) == 1
    stream = CallStream(LLAMA3, TOOLS)
    assert stream.feed("Sunny") == [{"content": "Sunny"}]   # not a call: streamed as it comes
    stream = CallStream(LLAMA3, TOOLS)
    assert stream.feed('{"name": "get_weather",') == []     # a call: held to the end
    [event] = stream.feed(' "parameters": {"location": {"city": "Oslo"}}}') + stream.finish()
    assert named(event["tool_calls"]) == [("get_weather", {"location": {"city": "Oslo"}})]


# --- the ChatML template with tools --------------------------------------------------------------------------------

def render(template: str, messages: list[dict], tools: list[dict] | None = None) -> str:
    formatter = Jinja2ChatFormatter(template, eos_token="<|im_end|>", bos_token="<|im_start|>")
    return formatter(messages=messages, tools=tools).prompt


def test_the_chatml_template_renders_tools_calls_and_results():
    messages = messages_for_template([{"role": "system", "content": "Be brief."}, *CONVERSATION,
                                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    prompt = render(TOOLS_CHATML_TEMPLATE, messages, TOOLS)
    system, user, assistant, results, generation = prompt.split("<|im_start|>")[1:]
    assert system.startswith("system\nBe brief.\n\n# Tools\n") and system.endswith("<|im_end|>\n")
    listed = re.search(r"<tools>\n(.*)\n</tools>", system, re.S)[1].split("\n")
    assert [json.loads(line) for line in listed] == TOOLS
    assert "<tool_call>" in system and "</tool_call>" in system
    assert user == "user\nWeather in Paris?<|im_end|>\n"
    assert assistant == "assistant\n" + hermes("get_weather", PARIS) + "<|im_end|>\n"
    assert results == ("user\n<tool_response>\n{\"temperature\": 21}\n</tool_response>\n<tool_response>\nsunny\n"
                       "</tool_response><|im_end|>\n")
    assert generation == "assistant\n"
    # what the template shows the model as a call is what parse_calls reads back
    content, calls = parse_calls(assistant.removeprefix("assistant\n").removesuffix("<|im_end|>\n"), HERMES, TOOLS)
    assert content == "" and named(calls) == [("get_weather", PARIS)]


def test_the_chatml_template_without_tools_is_chatml():
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]):
        assert render(TOOLS_CHATML_TEMPLATE, messages) == render(CHATML_CHAT_TEMPLATE, messages)
    # calls with text before them, and arguments still as JSON text
    prompt = render(TOOLS_CHATML_TEMPLATE, [{"role": "assistant", "content": "Checking.", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": json.dumps(PARIS)}},
        {"function": {"name": "send_email", "arguments": MAIL}}]}], TOOLS)
    turn = prompt.split("<|im_start|>")[-2]
    assert turn == f"assistant\nChecking.\n{hermes('get_weather', PARIS)}\n{hermes('send_email', MAIL)}<|im_end|>\n"
