"""specee-edge bench under a grammar: the flags reach the run, the extract set brings its schema, every lane answers
under the one GBNF, and the report checks the answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from llama_cpp import Llama
from typer.testing import CliRunner

import specee_edge.bench as bench
from specee_edge.bench.report import LLAMA_CPP_PYTHON, GrammarAnswers
from specee_edge.bench.run import BenchConfig
from specee_edge.bench.runner import ContextLane, PeerLane, SpecEELane, VanillaLane, run_lanes
from specee_edge.bench.structured import follows, grammar_answers, grammar_run, schema_validator
from specee_edge.cli import app
from specee_edge.data.prompts import extract_schema
from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.engine.constraint import GrammarConstraint
from specee_edge.engine.sampling import SamplingParams
from specee_edge.errors import SpecEEError
from specee_edge.grammar import grammar_from_schema, grammar_from_text
from specee_edge.runtime import Context
from tests.conftest import CHAT_PROMPT

YES_NO = 'root ::= ("yes" | "no") "."\n'
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


def bench_config(monkeypatch, *args: str) -> BenchConfig:
    """The BenchConfig `specee-edge bench ARGS` would run (the run itself stopped at run_bench)."""
    seen = []

    def run_bench(config, reporter):
        seen.append(config)
        raise SpecEEError("stopped")

    monkeypatch.setattr(bench, "run_bench", run_bench)
    result = CliRunner().invoke(app, ["bench", "--no-llama-server", *args])
    assert "stopped" in result.output, result.output
    return seen[0]


def test_each_grammar_flag_reaches_the_config(monkeypatch, tmp_path):
    config = bench_config(monkeypatch, "--grammar", YES_NO)
    assert (config.grammar.text, config.grammar.origin, config.schema) == (YES_NO, "--grammar", None)
    (tmp_path / "g.gbnf").write_text(YES_NO)
    config = bench_config(monkeypatch, "--grammar-file", str(tmp_path / "g.gbnf"))
    assert config.grammar.text == YES_NO and config.schema is None
    made = grammar_from_schema(SCHEMA).text
    config = bench_config(monkeypatch, "-j", json.dumps(SCHEMA))
    assert (config.grammar.text, config.schema) == (made, SCHEMA)
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    config = bench_config(monkeypatch, "--json-schema", f"@{tmp_path / 's.json'}")
    assert (config.grammar.text, config.schema) == (made, SCHEMA)
    assert bench_config(monkeypatch).grammar is None  # the free-text sets run without one


def test_the_extract_set_runs_under_its_schema_unless_a_grammar_is_given(monkeypatch):
    config = bench_config(monkeypatch, "--prompts", "extract")
    assert config.grammar.text == grammar_from_schema(extract_schema()).text and config.schema == extract_schema()
    assert "extract" in config.grammar.origin
    config = bench_config(monkeypatch, "--prompts", "extract", "-j", json.dumps(SCHEMA))
    assert config.schema == SCHEMA
    config = bench_config(monkeypatch, "--prompts", "extract", "--grammar", YES_NO)
    assert config.grammar.text == YES_NO and config.schema is None


@pytest.mark.parametrize("args, message", [
    (["--grammar", YES_NO, "-j", "{}"], "--grammar and -j/--json-schema: give one grammar"),
    (["-j", '{"type": "string", "format": "email"}'], "format 'email' is not enforced"),
    (["--grammar", "ws ::= \" \""], "no 'root ::=' rule"),
])
def test_a_grammar_the_bench_cannot_run_is_one_line(args, message):
    result = CliRunner().invoke(app, ["bench", "--no-llama-server", *args])
    assert result.exit_code == 1 and result.output.strip().count("\n") == 0
    assert message in result.output


def test_answers_are_checked_against_the_grammar_and_the_schema(default_model):
    """A lane's answers: whether each kept to the grammar (replayed through llama.cpp's grammar sampler), and whether
    the finished ones parse and fit the schema; masked draws per token where the lane counted them."""
    grammar = grammar_from_schema(SCHEMA)
    eog = next(iter(default_model.eog_ids))
    tokens = lambda text: default_model.tokenize(text, add_special=False)  # noqa: E731

    class Answered:
        name = "lane"
        outputs = [tokens('{"n": 3}') + [eog],   # whole, in the grammar, valid
                   tokens('{"n": 3, "m": 4}') + [eog],  # JSON, but neither the grammar's nor the schema's
                   tokens('{"n": ')]              # cut by -n: not checked as JSON
        masked_draws = 2

    answers = grammar_answers(Answered(), default_model, grammar, schema_validator(SCHEMA))
    n_tokens = sum(map(len, Answered.outputs))
    assert answers == GrammarAnswers(answers=3, finished=2, in_grammar=pytest.approx(2 / 3), parsed=1.0, valid=0.5,
                                     masked_draws_per_token=pytest.approx(2 / n_tokens))
    assert not follows(default_model, grammar, tokens("hello"))
    run = grammar_run(grammar, None, default_model, [("greedy", [Answered()])])
    assert (run.schema, run.validated, run.chars) == (False, False, len(grammar.text))
    assert run.lanes["lane"]["greedy"].valid is None  # no schema: only parsed
    assert run.rules == grammar.text.count("::=")


def test_every_python_lane_answers_under_the_grammar(default_model):
    """The Llama.eval lane, the bare Context, an engine and the peer, greedy and sampled, under one small grammar:
    each answer is one the grammar takes, whole (it ends where the grammar does), and the lanes that draw with
    specee-edge's Sampler count the draws the grammar refused."""
    grammar = grammar_from_text(YES_NO)
    path = str(default_model.info.path)
    prompt = default_model.tokenize(CHAT_PROMPT)
    constrain = lambda: GrammarConstraint(default_model, grammar)  # noqa: E731
    for sampling in (GREEDY, SamplingParams(seed=1)):
        llm = Llama(model_path=path, n_ctx=256, n_threads=1, verbose=False)
        ctx = Context(default_model, n_ctx=256, n_threads=1)
        engine = Engine(default_model.info.path, config=EngineConfig(n_ctx=256, n_threads=1))
        peer = PeerLane(path, 256, 1, 8, default_model.is_eog, sampling, grammar=grammar)
        lanes = [VanillaLane(llm, 8, default_model.is_eog, sampling, constrain),
                 ContextLane(ctx, 8, default_model.is_eog, sampling, constrain=constrain),
                 SpecEELane("fill", engine, 8, sampling, grammar), peer]
        try:
            assert run_lanes([prompt, prompt], lanes, np.random.default_rng(0), workers=()).failed == {}
        finally:
            peer.close()
            engine.close()
            ctx.close()
            llm.close()
        for lane in lanes:
            for answer in lane.outputs:
                assert follows(default_model, grammar, answer) and default_model.is_eog(answer[-1]), lane.name
        if sampling.greedy:  # the full model's best answer the grammar allows, in every lane
            assert all(lane.outputs == lanes[0].outputs for lane in lanes), [lane.outputs for lane in lanes]
        # the model would open with "The": refused, drawn again over "yes" and "no"
        assert peer.masked_draws is None and all(lane.masked_draws > 0 for lane in lanes[:3])
    assert lanes[0].name == LLAMA_CPP_PYTHON


def test_a_grammar_llama_cpp_refuses_ends_the_run_in_one_line(monkeypatch, tmp_path):
    """Parsed once before any lane runs (not every lane's first answer failing)."""
    result = CliRunner().invoke(app, ["bench", "--no-llama-server", "--greedy-only", "-p", "1", "-n", "2",
                                      "--grammar", "root ::= missing", "--json", str(tmp_path / "b.json")])
    assert result.exit_code == 1 and result.output.strip().count("\n") == 0, result.output
    assert "--grammar: the grammar does not parse" in result.output
    assert not Path(tmp_path / "b.json").exists()
