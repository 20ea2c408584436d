"""The bench under a grammar: one GBNF for every lane, and what each lane's answers made of it.

A lane that ignored the grammar would still answer, and faster: so every answer is replayed through llama.cpp's
grammar sampler (`in_grammar`), and the whole ones (ended at an end of generation) are checked as a user would
check them: parsed as JSON, and validated against the schema where the grammar was made from one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from specee_edge.bench.report import GrammarAnswers, GrammarRun
from specee_edge.bench.runner import Lane
from specee_edge.engine.constraint import GrammarConstraint
from specee_edge.grammar import Grammar
from specee_edge.runtime import Model


def check_grammar(model: Model, grammar: Grammar) -> None:
    """llama.cpp parses the grammar once before any lane runs: one it refuses ends the run in one line
    (SpecEEError), rather than failing every lane's first answer."""
    GrammarConstraint(model, grammar).close()


def schema_validator(schema: Any) -> Callable[[Any], bool] | None:
    """Whether a parsed answer fits `schema`, by jsonschema's validator for the schema's draft; None without a
    schema, or where jsonschema is not installed (answers are then only parsed)."""
    if schema is None:
        return None
    try:
        from jsonschema.validators import validator_for
    except ImportError:
        return None
    return validator_for(schema)(schema).is_valid


def follows(model: Model, grammar: Grammar, tokens: Sequence[int]) -> bool:
    """Whether the grammar takes every token of an answer, in order, from its start."""
    constraint = GrammarConstraint(model, grammar)
    try:
        return constraint.allowed_prefix(tokens) == len(tokens)
    finally:
        constraint.close()


def answer_text(model: Model, tokens: Sequence[int]) -> str:
    """An answer's text, without its end of generation."""
    return b"".join(model.token_to_piece(t) for t in tokens if not model.is_eog(t)).decode("utf-8", errors="replace")


def parse_json(text: str) -> tuple[bool, Any]:
    """(whether `text` is JSON, its value)."""
    try:
        return True, json.loads(text)
    except json.JSONDecodeError:
        return False, None


def grammar_answers(lane: Lane, model: Model, grammar: Grammar,
                    validate: Callable[[Any], bool] | None) -> GrammarAnswers:
    """A lane's answers in one pass, checked: kept to the grammar, and the finished ones JSON (fitting the schema,
    with `validate`)."""
    outputs = lane.outputs
    finished = [answer for answer in outputs if answer and model.is_eog(answer[-1])]
    parsed = [parse_json(answer_text(model, answer)) for answer in finished]
    n = len(finished)
    masked = getattr(lane, "masked_draws", None)
    tokens = sum(map(len, outputs))
    return GrammarAnswers(
        answers=len(outputs), finished=n,
        in_grammar=sum(follows(model, grammar, answer) for answer in outputs) / len(outputs) if outputs else 1.0,
        parsed=sum(ok for ok, _ in parsed) / n if n else None,
        valid=sum(ok and validate(value) for ok, value in parsed) / n if n and validate else None,
        masked_draws_per_token=masked / tokens if masked is not None and tokens else None)


def grammar_run(grammar: Grammar, schema: Any, model: Model,
                passes: Sequence[tuple[str, Sequence[Lane]]]) -> GrammarRun:
    """The run's grammar and each lane's answers under it, per pass (`greedy`, `sampled`)."""
    validate = schema_validator(schema)
    lanes: dict[str, dict[str, GrammarAnswers]] = {}
    for what, done in passes:
        for lane in done:
            lanes.setdefault(lane.name, {})[what] = grammar_answers(lane, model, grammar, validate)
    return GrammarRun(origin=grammar.origin, chars=len(grammar.text),
                      rules=len(re.findall(r"(?m)^\s*[A-Za-z0-9_-]+\s*::=", grammar.text)), schema=schema is not None,
                      validated=validate is not None, lanes=lanes)
