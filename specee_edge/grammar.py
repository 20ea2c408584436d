"""Grammars that constrain a reply: GBNF text as llama.cpp reads it (`--grammar`, `--grammar-file`, a request's
`grammar`), or made from a JSON schema (`-j/--json-schema`, `response_format`, a request's `json_schema`).

Schemas go through the converter llama-cpp-python ships (llama_cpp.llama_grammar.json_schema_to_gbnf). It enforces
only part of JSON Schema and drops the rest without a word (`multipleOf`, `minimum`, most `format`s), or fails on an
assertion (`not`). A reply constrained by a schema must fit it, so a schema that asks for something the grammar does
not enforce is refused in one line, naming the keyword and where it is; only annotations (titles, descriptions,
defaults, examples) are let through unenforced. docs/usage.md lists what holds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from specee_edge.errors import SpecEEError

MAX_GRAMMAR_CHARS = 128 << 10  # far above a real schema's grammar; minItems: 20000 makes hundreds of KB of rules
ROOT = "root"

# JSON Schema's keywords that say nothing about what is valid: let through, unenforced
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "$defs", "definitions"})
# the converter's string formats (STRING_FORMAT_RULES, and uuid)
FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})
PRIMITIVES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})

# A character inside a JSON string. The converter's `char` lets control characters through (a raw newline, which
# no JSON parser takes); this one is JSON's own, as llama.cpp's C++ converter writes it.
JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'

# any JSON object: response_format {"type": "json_object"}, as llama.cpp's json.gbnf has it
JSON_OBJECT_GRAMMAR = r'''root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws     ::= | " " | "\n" [ \t]{0,20}
'''


@dataclass(frozen=True)
class Grammar:
    """GBNF text whose start rule is `root`, and where it came from (the field or flag named in errors)."""

    text: str
    origin: str = "grammar"


def grammar_from_text(text: str, origin: str = "grammar") -> Grammar:
    """GBNF as given; llama.cpp parses it when a reply starts (Sampler), and refuses it then in one line."""
    if not isinstance(text, str) or not text.strip():
        raise SpecEEError(f"{origin}: the grammar is empty")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise SpecEEError(f"{origin}: the grammar is {len(text):,} characters, more than {MAX_GRAMMAR_CHARS:,}")
    if not re.search(rf"(?m)^\s*{ROOT}\s*::=", text):
        raise SpecEEError(f"{origin}: the grammar has no '{ROOT} ::=' rule, where a reply starts")
    return Grammar(text, origin)


def grammar_from_schema(schema: Any, origin: str = "json_schema") -> Grammar:
    """The GBNF of a JSON schema (a dict, or its JSON text), once every keyword it asserts is one the grammar
    enforces."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise SpecEEError(f"{origin}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise SpecEEError(f"{origin}: a schema is a JSON object, got {type(schema).__name__}")
    for path, problem in _everywhere(schema):
        raise SpecEEError(f"{origin}: {path}: {problem}")
    from llama_cpp.llama_grammar import json_schema_to_gbnf  # the native library loads with it

    try:
        text = json_schema_to_gbnf(json.dumps(schema))
    except (AssertionError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise SpecEEError(f"{origin}: the schema cannot be made a grammar ({str(e).splitlines()[0][:200]})") from None
    text = re.sub(r"(?m)^char ::= .*$", lambda _: f"char ::= {JSON_CHAR}", text)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise SpecEEError(f"{origin}: its grammar is {len(text):,} characters, more than {MAX_GRAMMAR_CHARS:,} (a "
                          "minItems, maxItems, minLength or maxLength in the thousands?)")
    return Grammar(text, origin)


def _everywhere(schema: dict) -> Iterator[tuple[str, str]]:
    """unenforced() of the schema and of each definition its references may reach."""
    yield from unenforced(schema)
    for key in ("$defs", "definitions"):
        for name, part in (schema.get(key) or {}).items():
            yield from unenforced(part, f"#/{key}/{name}")


def unenforced(schema: Any, path: str = "#") -> Iterator[tuple[str, str]]:
    """Where `schema` (found at `path`) asks for what the converter would not enforce, and what: the
    converter's branches in its own order (json_schema_to_gbnf's SchemaConverter.visit), each honouring its
    keywords and ignoring the rest."""
    if not isinstance(schema, dict):
        if schema is True:
            return
        yield path, f"a schema is an object or true, got {json.dumps(schema)[:40]}"
        return
    keys = set(schema) - ANNOTATIONS
    kind = schema.get("type")

    def rest(honoured: set[str]) -> Iterator[tuple[str, str]]:
        for key in sorted(keys - honoured):
            yield path, f"'{key}' is not enforced here by the grammar; remove it or check the reply yourself"

    def each(key: str, parts) -> Iterator[tuple[str, str]]:
        for i, part in enumerate(parts):
            yield from unenforced(part, f"{path}/{key}/{i}")

    if "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#/"):
            yield path, f"$ref {ref!r}: only references inside the schema (#/...) are followed"
        yield from rest({"$ref"})
    elif "oneOf" in schema:
        yield path, "'oneOf' is not enforced (a reply could match several branches): use anyOf"
    elif "anyOf" in schema:
        yield from each("anyOf", schema["anyOf"])
        yield from rest({"anyOf", "type"})
    elif isinstance(kind, list):
        if unknown := [t for t in kind if t not in PRIMITIVES]:
            yield path, f"unknown type {unknown[0]!r}"
        yield from rest({"type"})
    elif "const" in schema:
        yield from rest({"const", "type"})
    elif "enum" in schema:
        yield from rest({"enum", "type"})
    elif kind in (None, "object") and ("properties" in schema or schema.get("additionalProperties", True) is not True):
        for name, part in (schema.get("properties") or {}).items():
            yield from unenforced(part, f"{path}/properties/{name}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            yield from unenforced(extra, f"{path}/additionalProperties")
        yield from rest({"type", "properties", "required", "additionalProperties"})
    elif kind in (None, "object") and "allOf" in schema:
        for i, part in enumerate(schema["allOf"]):
            if not isinstance(part, dict) or set(part) - ANNOTATIONS - {"properties", "required", "type", "$ref"}:
                yield f"{path}/allOf/{i}", "allOf is enforced only for parts made of properties and required"
                continue
            for name, inner in (part.get("properties") or {}).items():
                yield from unenforced(inner, f"{path}/allOf/{i}/properties/{name}")
        yield from rest({"type", "allOf"})
    elif kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
        items = schema.get("items") or schema.get("prefixItems")
        if isinstance(items, list):
            yield from each("prefixItems" if "prefixItems" in schema else "items", items)
            yield from rest({"type", "items", "prefixItems"})
        else:
            yield from unenforced(items, f"{path}/items")
            yield from rest({"type", "items", "minItems", "maxItems"})
    elif kind in (None, "string") and "pattern" in schema:
        pattern = schema["pattern"]
        if not (isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$")):
            yield path, "a pattern is enforced only whole, anchored as ^...$"
        yield from rest({"type", "pattern"})
    elif kind in (None, "string") and "format" in schema:
        if schema["format"] not in FORMATS:
            yield path, (f"format {schema['format']!r} is not enforced (these are: "
                         f"{', '.join(sorted(FORMATS - {'uuid1', 'uuid2', 'uuid3', 'uuid4', 'uuid5'}))})")
        yield from rest({"type", "format"})
    elif kind == "string" and ("minLength" in schema or "maxLength" in schema):
        yield from rest({"type", "minLength", "maxLength"})
    elif kind == "object" or not keys:
        yield from rest({"type"})
    elif kind in PRIMITIVES:
        yield from rest({"type"})
    elif kind is not None:
        yield path, f"unknown type {kind!r}"
    else:
        yield from rest(set())
