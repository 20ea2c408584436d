"""Replies under a grammar: schemas made grammars (and refused where the grammar would not hold them), llama.cpp's
grammar sampler on every path of the engine (plain, exact mode's verification rows, a lossy level's exits), and
the command line's --grammar, --grammar-file and -j/--json-schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from typer.testing import CliRunner

from specee_edge.cli import app
from specee_edge.default_model import default_model_path
from specee_edge.engine import GREEDY, Engine, EngineConfig, SamplingParams
from specee_edge.engine.constraint import GrammarConstraint
from specee_edge.errors import SpecEEError
from specee_edge.grammar import JSON_OBJECT_GRAMMAR, MAX_GRAMMAR_CHARS, grammar_from_schema, grammar_from_text
from tests.conftest import LOOSE, write_two_level_pack

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "city": {"type": "string"}}, "required": ["name", "age", "city"]}
EXTRACT = ["Extract the person as JSON: Alice is 31 and lives in Paris.",
           "Extract the person as JSON: Bob, aged 45, moved to Oslo last year.",
           "Extract the person as JSON: Our new colleague Chen (28) works from Berlin."]


# --- schemas: what the grammar enforces, and what it would drop -------------------------------------------------

@pytest.mark.parametrize("schema, needle", [
    ({"type": "integer", "minimum": 0}, "#: 'minimum' is not enforced"),
    ({"type": "number", "multipleOf": 3}, "#: 'multipleOf' is not enforced"),
    ({"type": "string", "format": "email"}, "#: format 'email' is not enforced"),
    ({"not": {"type": "string"}}, "#: 'not' is not enforced"),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "'oneOf' is not enforced"),
    ({"type": "string", "pattern": "[a-z]+"}, "anchored as ^...$"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}, "'maxLength' is not enforced"),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
     "#/properties/tags: 'uniqueItems' is not enforced"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "number", "maximum": 1}}},
     "#/$defs/n: 'maximum' is not enforced"),
    ({"$ref": "https://example.com/schema.json"}, "only references inside the schema"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 20000}, "more than 131,072"),
    ({"type": "colour"}, "unknown type 'colour'"),
    ("{not json", "not JSON"),
    ([1, 2], "a schema is a JSON object"),
])
def test_a_schema_the_grammar_would_not_hold_is_refused(schema, needle):
    with pytest.raises(SpecEEError, match="^json_schema: ") as refused:
        grammar_from_schema(schema)
    assert needle in str(refused.value) and "\n" not in str(refused.value)


def test_what_the_grammar_enforces_is_accepted():
    schema = {"type": "object", "title": "Order", "description": "an order",
              "properties": {"id": {"type": "string", "format": "uuid"}, "when": {"type": "string", "format": "date"},
                             "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 5},
                             "status": {"enum": ["open", "paid"]}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                             "code": {"type": "string", "pattern": "^[A-Z]{3}$"}, "short": {"type": "string", "maxLength": 8}},
              "required": ["id", "items"], "additionalProperties": False,
              "$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string"}, "n": {"type": "integer"}}}}}
    grammar = grammar_from_schema(json.dumps(schema))
    assert grammar.text.startswith("char ::=") or "root ::=" in grammar.text


def test_grammar_text_is_checked_before_llama_cpp_and_by_it(default_model):
    for text, needle in [("", "empty"), ("start ::= \"a\"", "no 'root ::=' rule"),
                         ("root ::= " + "\"a\" " * MAX_GRAMMAR_CHARS, "more than")]:
        with pytest.raises(SpecEEError, match=needle):
            grammar_from_text(text)
    for text, needle in [("root ::= item", "Undefined rule identifier 'item'"), ('root ::= "open', "unexpected end"),
                         ("root ::= [a-", "unexpected end of input"), ('root ::= "a" %', "expecting newline or end"),
                         ('root ::= root "a"', "left recursion")]:
        with pytest.raises(SpecEEError, match=f"^grammar: the grammar does not parse: .*{needle}"):
            GrammarConstraint(default_model, grammar_from_text(text))


def test_drafts_are_tested_on_a_copy_of_the_grammar(default_model):
    constraint = GrammarConstraint(default_model, grammar_from_text('root ::= "yes" | "no"'))
    yes, no = (default_model.tokenize(word, add_special=False, parse_special=False) for word in ("yes", "no"))
    assert len(yes) == len(no) == 1
    assert constraint.allowed_prefix(yes + no) == 1 and constraint.allowed_prefix(no) == 1
    assert constraint.allows(yes[0]) and constraint.allows(no[0])  # the copy moved; the grammar did not
    constraint.accept(yes[0])
    assert not constraint.allows(no[0]) and constraint.allowed_prefix(no) == 0
    assert all(constraint.allows(t) for t in default_model.eog_tokens())  # "yes" ends the grammar
    constraint.close()


# --- the engine: every path's tokens are the grammar's ---------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    # exact mode drafting at every chance: verification batches on every round, so the rows are drawn under the grammar
    engine = Engine(default_model_path(), config=EngineConfig(n_ctx=1024, n_threads=2, speculation="always"))
    yield engine
    engine.close()


def answer(engine: Engine, message: str, grammar, *, exact: bool, sampling: SamplingParams = GREEDY, n: int = 64):
    engine.set_early_exit(exact)
    engine.reset()
    out = engine.generate(engine.format_chat([{"role": "user", "content": message}]), max_tokens=n,
                          sampling=sampling, grammar=grammar)
    return out


def test_exact_mode_under_a_grammar_is_plain_decoding_under_it(engine):
    """Greedy: token for token what plain decoding under the same grammar gives, with verification batches whose
    drafts the grammar pruned; every reply fits the schema."""
    grammar = grammar_from_schema(PERSON)
    drafted = 0
    for message in EXTRACT:
        plain = answer(engine, message, grammar, exact=False)
        exact = answer(engine, message, grammar, exact=True)
        assert exact.tokens == plain.tokens, (message, plain.text, exact.text)
        jsonschema.validate(json.loads(exact.text), PERSON)
        assert exact.stats.finish_reason == "stop"
        drafted += exact.stats.drafts
    assert drafted > 0  # exact mode did check drafts in batches


def test_sampled_replies_fit_the_grammar_on_every_path(engine):
    grammar = grammar_from_text(JSON_OBJECT_GRAMMAR)
    for exact in (False, True):
        for seed in range(3):
            out = answer(engine, EXTRACT[seed], grammar, exact=exact, sampling=SamplingParams(seed=seed), n=48)
            if out.stats.finish_reason == "stop":
                assert isinstance(json.loads(out.text), dict)
            else:  # cut by max_tokens mid-object: still a prefix the grammar allows
                assert out.stats.finish_reason == "length" and out.text.lstrip().startswith("{")


def test_a_lossy_levels_exits_never_emit_a_token_the_grammar_refuses(tmp_path):
    """At a level whose tokens leave mid-network (head-free at the last layer), the grammar still holds: an exit's
    token it refuses is drawn again, from the exit layer's full head where every candidate is refused."""
    pack = write_two_level_pack(tmp_path / "two.specee.gguf")
    engine = Engine(default_model_path(), pack=pack, config=EngineConfig(n_ctx=1024, n_threads=2, quality=LOOSE))
    try:
        grammar = grammar_from_schema(PERSON)
        exits = 0
        for message in EXTRACT:
            out = answer(engine, message, grammar, exact=True)  # the level's exits are the answer
            exits += out.stats.exits
            if out.stats.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), PERSON)
            else:
                assert out.text.lstrip().startswith('{ "name"')
        assert exits > 0
    finally:
        engine.close()


# --- the command line ---------------------------------------------------------------------------------------------

def test_generate_follows_a_json_schema_and_a_grammar(tmp_path):
    runner = CliRunner()
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(PERSON))
    result = runner.invoke(app, ["generate", "-p", EXTRACT[0], "-n", "64", "--temp", "0", "-t", "2", "--json",
                                 "-j", f"@{schema_file}"])
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(json.loads(result.stdout)["text"]), PERSON)
    grammar_file = tmp_path / "yes-no.gbnf"
    grammar_file.write_text('root ::= "yes" | "no"\n')
    result = runner.invoke(app, ["generate", "-p", "Is the sky blue?", "-n", "8", "--temp", "0", "--json",
                                 "--grammar-file", str(grammar_file)])
    assert result.exit_code == 0 and json.loads(result.stdout)["text"] in ("yes", "no"), result.output


@pytest.mark.parametrize("args, needle", [
    (["-j", '{"type": "integer", "minimum": 1}'], "error: --json-schema: #: 'minimum' is not enforced"),
    (["--grammar", "root ::= answer"], "error: --grammar: the grammar does not parse: Undefined rule identifier 'answer'"),
    (["--grammar", 'root ::= "a"', "-j", "{}"], "error: --grammar and -j/--json-schema: give one grammar"),
    (["--grammar-file", "/nonexistent.gbnf"], "error: cannot read the grammar file /nonexistent.gbnf"),
])
def test_a_bad_grammar_is_one_line(args, needle):
    result = CliRunner().invoke(app, ["generate", "-p", "hi", "-n", "4", *args])
    assert result.exit_code == 1 and needle in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output
