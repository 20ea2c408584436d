"""`specee-edge bench` on a model without a pack (issue 51): the lanes that need none, greedy and sampled, what a
pack would add and calibrate's estimate here; what needs a pack refused, one line each. The model is the default
one requantized to Q4_0 with llama.cpp's quantize API (its own mix): no pack beside it, none shipped for it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specee_edge.bench.run import NO_PACK
from specee_edge.cli import app
from specee_edge.default_model import default_model_path
from specee_edge.runtime.quantize import requantize

PROMPTS, TOKENS = 2, 8


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory):
    return requantize(default_model_path(), tmp_path_factory.mktemp("no-pack") / "smollm2-q4_0.gguf", "Q4_0", pure=False)


@pytest.fixture(scope="module")
def no_pack_run(bare_model) -> tuple[dict, str]:
    out = bare_model.with_name("bench.json")
    args = ["bench", str(bare_model), "-p", str(PROMPTS), "-n", str(TOKENS), "-t", "2", "--ppl-tokens", "32",
            "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.output


@pytest.mark.slow
def test_the_bench_runs_the_lanes_that_need_no_pack(no_pack_run):
    data, output = no_pack_run
    assert list(data["modes"]) == [NO_PACK]
    lane = data["modes"][NO_PACK]
    assert lane["exact"] and not lane["pack"] and lane["steps"] > 0
    # exact mode's controller, greedy and sampled: its choices and what it measured here
    for choices in (lane["choices"], lane["sampled"]["exact"]):
        assert set(choices["shares"]) == {"plain", "lookup", "exit"} and choices["shares"]["exit"] == 0
        assert choices["controller"]
    assert data["vanilla_tok_s"] > 0 and data["vanilla_sampled_tok_s"] > 0 and data["peer"]["speedup"] > 0
    # nothing exits without a pack: no oracle, no cost lanes
    assert data["oracle_speedup"] is None and data["costs"] is None and data["oracle_histogram"] == []
    note = " ".join(output.split())
    assert "no pack: a pack would add exit drafts" in note and "lossy quality levels" in note
    assert "would take" in note and "on this machine (estimated, not run)" in note


def test_what_needs_a_pack_is_one_line_each(bare_model):
    result = CliRunner().invoke(app, ["bench", str(bare_model), "--quality", "0.9,exact,0.95", "--threshold", "0.5"])
    assert result.exit_code != 0
    text = " ".join(result.output.split())  # the terminal wraps long lines
    assert text.count("needs a pack") == 3 and "Traceback" not in text, result.output
    assert text.startswith("error: --quality 0.9: a lossy level needs a pack, and smollm2-q4_0.gguf has none")
    assert "--quality 0.95: a lossy level needs a pack" in text and "--threshold: exits needs a pack" in text
    assert "--quality exact" not in text
