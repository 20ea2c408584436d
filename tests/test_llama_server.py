"""llama.cpp's llama-server as bench lanes (specee_edge/bench/llama_server.py), on the real program built from the
runtime's vendored llama.cpp (tools/build_llama_server.py; the first run builds it), and the bench's lanes that
fail: dropped with one line, never the whole run."""

from __future__ import annotations

import io
import json
import re
import subprocess
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from llama_cpp import Llama
from typer.testing import CliRunner

from specee_edge import build_runtime
from specee_edge.bench import run as bench_run
from specee_edge.bench.llama_server import (DEFAULT_SPEC_TYPES, DRAFT, DRAFT_SPEC_TYPE, ENV_BINARY, OFFLOAD_FIRST_LOGGED,
                                            PLAIN, SPEC_TYPES, LlamaServer, LlamaServerError, ServerLane, ServerSetup, completion,
                                            find_binary, has_terminal, lane_args, parse_spec_types, request_body,
                                            speculates, why_not_speculating)
from specee_edge.bench.report import LLAMA_CPP_PYTHON, repeat_of
from specee_edge.bench.run import BenchConfig, baseline_notes
from specee_edge.bench.runner import ContextLane, PeerLane, Stopwatch, VanillaLane, run_lanes
from specee_edge.bench.structured import follows
from specee_edge.cli import app
from specee_edge.data.prompts import extract_schema
from specee_edge.default_model import default_model_path
from specee_edge.engine import GREEDY
from specee_edge.engine.constraint import GrammarConstraint
from specee_edge.errors import SpecEEError
from specee_edge.grammar import grammar_from_schema, grammar_from_text
from specee_edge.runtime import Model
from specee_edge.runtime.placement import Placement
from tests import test_rpc
from tests.conftest import CHAT_PROMPT, LLAMA_SERVER_MISSING, tiny_model_path

PROMPTS, TOKENS = 2, 8


def vendored_source(path: str) -> str:
    """A file of the vendored llama.cpp, read from the cached sdist."""
    sdist = build_runtime.fetch_sdist(build_runtime.cache_root() / "sdist")
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(f"vendor/llama.cpp/{path}"))
        return tar.extractfile(member).read().decode()


def test_spec_types_are_the_vendored_llama_cpps():
    """Every lane's --spec-type is one the vendored llama.cpp knows, and every n-gram type it knows is a lane."""
    source = vendored_source("common/speculative.cpp")
    known = set(re.findall(r'\{"(ngram-[a-z0-9-]+)",\s*COMMON_SPECULATIVE_TYPE_', source))
    assert known == set(SPEC_TYPES)
    assert set(DEFAULT_SPEC_TYPES) <= known


def test_the_draft_lane_asks_for_draft_model_speculation_with_the_draft_pinned():
    """-md alone selects only the drafts a GGUF announces (MTP, DFlash, EAGLE): the lane names llama.cpp's classic
    draft-model type, and pins the draft's GPU layers (the target's count) and threads (the bench's)."""
    setup = ServerSetup(Path("llama-server"), Path("model.gguf"), threads=3, n_ctx=512,
                        placement=Placement(n_gpu_layers=7))
    argv = setup.args(8080, lane_args(DRAFT, setup, Path("draft.gguf")))
    flags = dict(zip(argv[-10::2], argv[-9::2]))
    assert flags == {"-md": "draft.gguf", "--spec-type": DRAFT_SPEC_TYPE, "-ngld": "7", "-td": "3", "-tbd": "3"}
    assert DRAFT_SPEC_TYPE == "draft-simple"
    assert argv[argv.index("-ngl") + 1] == "7" and argv[argv.index("-c") + 1] == "512"  # the draft's context: -c
    # each flag is the vendored llama.cpp's own
    assert re.search(r'\{"draft-simple",\s*COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE\}',
                     vendored_source("common/speculative.cpp"))
    arg_source = vendored_source("common/arg.cpp")
    for flag in ("-md", "--spec-type", "-ngld", "-td", "-tbd"):
        assert re.search(rf'\{{[^}}]*"{flag}"[^}}]*\}}', arg_source), flag


def test_a_repeat_lane_runs_its_twins_flags():
    setup = ServerSetup(Path("llama-server"), Path("model.gguf"), threads=2, n_ctx=512)
    assert lane_args(repeat_of(PLAIN), setup) == lane_args(PLAIN, setup) == []
    assert lane_args(repeat_of("ngram-mod"), setup) == lane_args("ngram-mod", setup) == ["--spec-type", "ngram-mod"]
    assert [speculates(name) for name in (PLAIN, repeat_of(PLAIN), "ngram-mod", DRAFT)] == [False, False, True, True]


# GET /slots of the vendored llama-server (tools/server/server-context.cpp, server_slot::to_json), with -np 1
SLOT = {"id": 0, "n_ctx": 2048, "is_processing": False}


def test_slots_decide_whether_a_lane_speculates():
    """A server that set up speculative decoding says so per slot; one that did not (-md without a type it sets up)
    is a lane that would decode plainly, dropped with the reason."""
    assert why_not_speculating([SLOT | {"speculative": True}]) is None
    assert why_not_speculating([SLOT | {"speculative": False}]) == "/slots reports speculative false for slot 0"
    assert "no `speculative` field" in why_not_speculating([SLOT])
    assert why_not_speculating({"error": {"code": 501}}) == "/slots lists no slots"


def test_spec_types_flag():
    assert parse_spec_types(None) == list(DEFAULT_SPEC_TYPES)
    assert parse_spec_types("all") == list(SPEC_TYPES) and parse_spec_types("none") == []
    assert parse_spec_types("ngram-cache, ngram-simple") == ["ngram-cache", "ngram-simple"]
    with pytest.raises(SpecEEError, match="unknown --spec-type ngram-nope"):
        parse_spec_types("ngram-mod,ngram-nope")


def test_every_server_keeps_every_tokens_kv_as_the_other_lanes_do():
    """--swa-full: llama-server's default keeps a window's K/V for a sliding-window model (gemma); our contexts and
    llama-cpp-python's Llama keep every token's (docs/bench.md, the lanes)."""
    assert "--swa-full" in ServerSetup(Path("llama-server"), Path("model.gguf"), threads=2, n_ctx=512).args(8080, [])


@pytest.mark.parametrize("reply", [{"tokens": [1, 2]}, {"tokens": [1, 2], "timings": {"predicted_n": 2}}])
def test_a_reply_without_timings_fails_the_lane(reply):
    """A llama-server of another version that answers without timings: an error for its lane (a dropped line),
    never 0 steps in 0 s, which made every speed-up against it 0."""
    with pytest.raises(LlamaServerError, match="no timings") as error:
        completion(reply)
    assert "\n" not in str(error.value)


def test_a_request_carries_the_runs_grammar():
    """The GBNF as given, in llama-server's own `grammar` field (which the vendored server reads as a user's
    grammar): the very text every other lane decodes under, not a schema llama-server would convert itself."""
    grammar = grammar_from_schema(extract_schema(), "the extract set's schema")
    body = json.loads(json.dumps(request_body([1, 2, 3], 16, GREEDY, grammar)))
    assert body["grammar"] == grammar.text and "json_schema" not in body
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 16
    assert "grammar" not in request_body([1, 2, 3], 16, GREEDY)
    assert 'add_alias("grammar")' in vendored_source("tools/server/server-schema.cpp")


def test_a_reply_with_timings_counts_its_steps():
    done = completion({"tokens": [5, 6, 7], "timings": {"predicted_n": 3, "predicted_ms": 30.0, "draft_n": 4,
                                                        "draft_n_accepted": 1}})
    assert (done.tokens, done.steps, done.seconds, done.drafted, done.accepted) == ([5, 6, 7], 2, 0.03, 4, 1)


def test_a_lane_that_raises_is_dropped_and_the_others_finish(tiny_dir):
    """A peer's bug: llama-cpp-python sizes Llama's token and logit arrays by the n_ctx asked for, while llama.cpp
    pads its context to 256, so a prompt between the two passes llama_decode and breaks Llama.eval (`could not
    broadcast`). The run drops that lane only."""
    model = str(tiny_model_path(tiny_dir, "llama"))
    tokens = 8
    prompt = [0] + [10, 11, 12, 13] * 25  # 101 tokens: more than the peer's 64, less than llama.cpp's 256
    llm = Llama(model_path=model, n_ctx=256, n_threads=1, verbose=False)
    vanilla = VanillaLane(llm, tokens, lambda t: False)
    peer = PeerLane(model, 64, 1, tokens, lambda t: False)
    try:
        failed = run_lanes([prompt] * 2, [vanilla, peer], np.random.default_rng(0), workers=()).failed
    finally:
        peer.close()
        llm.close()
    assert list(failed) == [1] and "\n" not in failed[1]
    assert failed[1].startswith("ValueError: could not broadcast"), failed[1]
    assert [len(answer) for answer in vanilla.outputs] == [tokens, tokens]  # the other lane answered both prompts


def test_a_baseline_that_moved_to_llama_is_a_note():
    """llama-server plain asked for but not run (it failed to build, start or answer): the speed-ups of that pass
    are against the Llama.eval lane, and a line says so; with --no-llama-server that is the baseline, no note."""
    assert baseline_notes(True, PLAIN, PLAIN) == []
    assert baseline_notes(False, LLAMA_CPP_PYTHON, LLAMA_CPP_PYTHON) == []
    notes = baseline_notes(True, PLAIN, LLAMA_CPP_PYTHON)
    assert len(notes) == 1 and notes[0].startswith(f"sampled speed-ups are against {LLAMA_CPP_PYTHON}")
    assert [note.split()[0] for note in baseline_notes(True, LLAMA_CPP_PYTHON, None)] == ["greedy"]


def test_without_a_terminal_bench_does_not_build_llama_server(monkeypatch):
    """CI, `make bench` (stdin from /dev/null): no half-hour build; the lanes are skipped with one line that says
    how to build it ahead or skip it, and the run goes on (here stopped right after, at run_bench)."""
    import specee_edge.bench as bench
    import specee_edge.bench.llama_server as llama_server

    asked = []

    def find_binary(explicit=None, build=True):
        asked.append(build)
        raise LlamaServerError("llama-server is not built")

    def run_bench(config, reporter):
        raise SpecEEError(f"run with dropped={config.dropped}")

    monkeypatch.setattr(llama_server, "find_binary", find_binary)
    monkeypatch.setattr(bench, "run_bench", run_bench)
    result = CliRunner().invoke(app, ["bench"])  # CliRunner's stdin is no terminal
    assert asked == [False]
    assert "llama-server lanes dropped: llama-server is not built" in result.output
    assert "run with dropped=['llama-server: llama-server is not built']" in result.output


def test_an_unbuilt_llama_server_says_how_to_build_or_skip_it(monkeypatch):
    calls = []

    def run(args, **kwargs):
        calls.append(args)
        return subprocess.CompletedProcess(args, 1, stdout="", stderr="")

    monkeypatch.delenv(ENV_BINARY, raising=False)
    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(LlamaServerError) as error:
        find_binary(build=False)
    assert len(calls) == 1 and "--print-path" in calls[0]  # asked where it is, never built
    assert "make llama-server" in str(error.value) and "--no-llama-server" in str(error.value)
    monkeypatch.setattr("sys.stdin", io.StringIO())
    assert not has_terminal()


class FailingVanilla:
    """A vanilla lane whose Llama breaks on the prompt (as llama-cpp-python's eval can)."""

    name = LLAMA_CPP_PYTHON

    def answer(self, prompt, watch):
        raise ValueError("could not broadcast input array\nfrom shape (101,) into shape (64,)")


def test_a_vanilla_lane_that_raises_ends_the_run_with_one_line():
    """Vanilla is the reference every lane is compared with: its failure is not a dropped lane but the run's end,
    in one line (it was a traceback)."""
    with pytest.raises(SpecEEError) as error:
        run_lanes([[0, 1, 2]], [FailingVanilla()], np.random.default_rng(0), workers=())
    assert str(error.value) == (f"the vanilla lane ({LLAMA_CPP_PYTHON}, every lane's reference) failed: "
                                "ValueError: could not broadcast input array")


def test_a_vanilla_lane_that_does_not_load_ends_the_run_with_one_line(monkeypatch):
    """Its Llama is loaded outside run_lanes, at the start of each pass: llama-cpp-python's ValueError there ends
    the run with the same line as a failure to answer (the CLI prints a SpecEEError; it was a traceback)."""
    def broken_llama(**kwargs):
        raise ValueError("Failed to load model from file: broken.gguf\nsecond line")

    monkeypatch.setattr(bench_run, "Llama", broken_llama)
    config = BenchConfig(model=Path("broken.gguf"), threads=1)
    with pytest.raises(SpecEEError) as error:  # the Llama is the pass's first load: nothing else is opened
        bench_run.decode_pass(config, [[0, 1, 2]], None, {}, [], False, GREEDY, np.random.default_rng(0), [],
                              "greedy", bench_run.Silent())
    assert str(error.value) == (f"the vanilla lane ({LLAMA_CPP_PYTHON}, every lane's reference) failed: "
                                "ValueError: Failed to load model from file: broken.gguf")


def test_a_peer_lane_that_does_not_load_is_a_dropped_lane(monkeypatch, tiny_dir):
    """The peer (llama-cpp-python's prompt lookup) is an optional lane: where its Llama does not load, the pass runs
    without it and says so in one line (it was a traceback)."""
    def broken_peer(*args, **kwargs):
        raise ValueError("Failed to create llama_context\nsecond line")

    monkeypatch.setattr(bench_run, "peer_lane", broken_peer)
    path = tiny_model_path(tiny_dir, "llama")
    config = BenchConfig(model=path, threads=1, tokens=4)
    model, dropped = Model(path), []
    result = bench_run.decode_pass(config, [[0, 1, 2]], model, {}, [], True, GREEDY, np.random.default_rng(0),
                                   dropped, "greedy", bench_run.Silent())
    assert result.peer is None and len(result.vanilla.outputs) == 1
    assert dropped == [f"{PeerLane.name}, greedy: ValueError: Failed to create llama_context"]


def test_prompt_lookup_lane_takes_a_prompt_longer_than_its_batch(tiny_dir):
    """llama-cpp-python's prompt lookup keeps every row's logits in an array it sized for n_batch rows unless
    asked for logits_all: a 600-token prompt (a long RAG question) broke Llama.eval before the lane asked."""
    model = str(tiny_model_path(tiny_dir, "llama"))
    llm = Llama(model_path=model, n_ctx=1024, n_threads=1, verbose=False)
    vanilla = VanillaLane(llm, TOKENS, lambda t: False)
    peer = PeerLane(model, 1024, 1, TOKENS, lambda t: False)
    try:
        prompt = [0] + [10, 11, 12, 13] * 150
        assert run_lanes([prompt], [vanilla, peer], np.random.default_rng(0), workers=()).failed == {}
    finally:
        peer.close()
        llm.close()
    assert peer.outputs == vanilla.outputs  # greedy: lossless


@pytest.fixture(scope="module")
def binary():
    """The cached llama-server. Building it takes longer than the rest of `make test` (docs/bench.md), so these
    tests run where it is built (`make llama-server`, `make test-llama-server`) and are skipped elsewhere."""
    try:
        return find_binary(build=False)
    except LlamaServerError as e:
        pytest.skip(f"{e} ({LLAMA_SERVER_MISSING})")


@pytest.fixture(scope="module")
def setup(binary) -> ServerSetup:
    return ServerSetup(binary, default_model_path(), threads=2, n_ctx=512)


def test_plain_server_answers_as_llama_does(setup):
    """The same token ids greedy: llama-server's answers are llama-cpp-python's, and its timings count the steps."""
    llm = Llama(model_path=str(setup.model), n_ctx=setup.n_ctx, n_threads=2, flash_attn=setup.flash_attn != "off",
                verbose=False)
    prompts = [llm.tokenize(text.encode()) for text in ("The capital of France is", "def fibonacci(n):")]
    vanilla = VanillaLane(llm, TOKENS, lambda t: t == llm.token_eos())
    with LlamaServer(setup) as server:
        lane = ServerLane(PLAIN, server, TOKENS, GREEDY)
        assert run_lanes(prompts, [vanilla, lane], np.random.default_rng(0), workers=()).failed == {}
    llm.close()
    assert server.proc.poll() is not None  # stopped on leaving the block
    assert lane.outputs == vanilla.outputs
    assert lane.timing.steps == sum(len(answer) - 1 for answer in lane.outputs) and lane.timing.tok_s > 0
    assert lane.drafted == 0


def test_plain_server_answers_under_the_grammar_as_llama_does(binary):
    """The same grammar, greedy: llama-server's answer is the Llama.eval lane's under specee-edge's Sampler (the best
    token the grammar allows at each step), whole and in the grammar."""
    model = Model(default_model_path())
    grammar = grammar_from_text('root ::= ("yes" | "no") "."\n')
    llm = Llama(model_path=str(model.info.path), n_ctx=512, n_threads=1, verbose=False)
    vanilla = VanillaLane(llm, TOKENS, model.is_eog, GREEDY, lambda: GrammarConstraint(model, grammar))
    with LlamaServer(ServerSetup(binary, model.info.path, threads=1, n_ctx=512)) as server:
        lane = ServerLane(PLAIN, server, TOKENS, GREEDY, grammar)
        prompt = model.tokenize(CHAT_PROMPT)
        assert run_lanes([prompt], [vanilla, lane], np.random.default_rng(0), workers=()).failed == {}
    llm.close()
    assert lane.outputs == vanilla.outputs
    assert follows(model, grammar, lane.outputs[0]) and model.is_eog(lane.outputs[0][-1])


def test_server_stops_when_the_block_raises(setup):
    with pytest.raises(KeyboardInterrupt):
        with LlamaServer(setup) as server:
            raise KeyboardInterrupt
    assert server.proc.poll() is not None


def test_the_draft_lane_drafts_and_a_draft_model_alone_does_not(setup):
    """The default model as its own draft (the same vocabulary): -md alone sets up no speculation, and its lane is
    refused with one line; the draft lane's flags set it up, and its answers are drafted and accepted."""
    with pytest.raises(LlamaServerError, match=r"set up no speculative decoding \(/slots reports speculative false"):
        LlamaServer(setup, ["-md", str(setup.model)], speculative=True)
    prompt = Llama(model_path=str(setup.model), vocab_only=True, verbose=False).tokenize(b"one two three one two three")
    with LlamaServer(setup, lane_args(DRAFT, setup, setup.model), speculative=True) as server:
        lane = ServerLane(DRAFT, server, TOKENS, GREEDY)
        lane.answer(prompt, Stopwatch())
    assert lane.speculates and lane.drafted > 0 and 0 < lane.accepted <= lane.drafted


def test_a_server_that_cannot_start_is_one_line(setup, tmp_path):
    not_a_model = tmp_path / "draft.gguf"
    not_a_model.write_text("not a gguf")
    with pytest.raises(LlamaServerError) as error:
        LlamaServer(setup, ["-md", str(not_a_model)])
    assert "\n" not in str(error.value) and "exited" in str(error.value)


@pytest.mark.slow
def test_bench_against_llama_server(binary, tmp_path):
    """A bench with llama-server plain (the baseline), a speculative type and a draft lane that cannot start:
    that lane is one line, the rest runs, greedy and sampled, every speed-up against llama-server plain."""
    not_a_model = tmp_path / "draft.gguf"
    not_a_model.write_text("not a gguf")
    args = ["bench", "-p", str(PROMPTS), "-n", str(TOKENS), "-t", "2", "--ppl-tokens", "32", "--no-peer",
            "--no-lookup-lane", "--spec-type", "ngram-mod", "--draft-model", str(not_a_model),
            "--llama-server-bin", str(binary), "--json", str(tmp_path / "bench.json")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["baseline"] == data["baseline_sampled"] == PLAIN
    lanes = [PLAIN, repeat_of(PLAIN), "ngram-mod", LLAMA_CPP_PYTHON, ContextLane.name, repeat_of(ContextLane.name)]
    assert set(data["tools"]) == set(lanes)
    assert data["tools"]["ngram-mod"]["speculates"] and not data["tools"][PLAIN]["speculates"]
    for lane in data["tools"].values():
        assert lane["tok_s"] > 0 and lane["tok_s_sampled"] > 0
    plain = data["tools"][PLAIN]
    assert plain["speedup"] == plain["speedup_sampled"] == 1.0 and plain["identical"] == 1.0
    assert data["speedup"] == pytest.approx(data["specee_tok_s"] / plain["tok_s"])
    assert data["tools"][LLAMA_CPP_PYTHON]["speedup"] == pytest.approx(data["vanilla_tok_s"] / plain["tok_s"])
    assert len(data["dropped"]) == 1 and data["dropped"][0].startswith("draft: llama-server exited")
    # every lane, the servers too, answered each prompt whole in its turn; each ratio has its interval
    for order in (*data["lane_order"]["greedy"], *data["lane_order"]["sampled"]):
        assert sorted(order) == sorted([*lanes, "specee-edge fill@exact"])
    # each repeat against its twin, in both passes
    assert [(r["lane"], r["decoding"]) for r in data["repeats"]] == [
        (repeat_of(name), what) for what in ("greedy", "sampled") for name in (PLAIN, ContextLane.name)]
    low, high = data["tools"]["ngram-mod"]["speedup_interval"]
    assert low <= data["tools"]["ngram-mod"]["speedup"] <= high
    assert plain["speedup_interval"] == plain["speedup_sampled_interval"] == [1.0, 1.0]
    assert "decode speed against llama.cpp" in result.output


@pytest.mark.slow
def test_bench_extract_runs_every_lane_under_its_schema(binary, tmp_path):
    """`--prompts extract`: every lane (llama-server's too, and the peer) under the schema's grammar, greedy and
    sampled; each answer keeps to it, and each whole one is JSON that fits the schema."""
    args = ["bench", "--prompts", "extract", "-p", "2", "-n", "200", "-t", "1", "--ppl-tokens", "32",
            "--spec-type", "ngram-mod", "--no-repeat", "--no-lookup-lane", "--llama-server-bin", str(binary),
            "--json", str(tmp_path / "bench.json")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["dropped"] == []
    grammar = data["grammar"]
    assert "extract" in grammar["origin"] and grammar["schema"] and grammar["validated"]
    assert grammar["chars"] == len(grammar_from_schema(extract_schema()).text) and grammar["rules"] > 1
    assert set(grammar["lanes"]) == set(data["lane_order"]["greedy"][0])
    ours = {LLAMA_CPP_PYTHON, ContextLane.name, "specee-edge fill@exact"}
    for name, passes in grammar["lanes"].items():
        assert set(passes) == {"greedy", "sampled"}
        for answers in passes.values():
            assert answers["answers"] == 2 and answers["in_grammar"] == 1.0, name
            if answers["finished"]:
                assert answers["parsed"] == answers["valid"] == 1.0, name
            assert (answers["masked_draws_per_token"] is not None) == (name in ours), name
    assert grammar["lanes"][LLAMA_CPP_PYTHON]["greedy"]["finished"] > 0  # the check above checked something
    # the same grammar on both sides: llama-server's greedy answers are the Llama.eval lane's
    assert data["tools"][PLAIN]["identical"] == 1.0
    # quality against the full model's choices under the grammar: exact mode's answers are its batched evaluation
    assert data["exact"] and data["off_replay"] == 0
    assert "answers under the grammar" in result.output


def test_a_server_split_over_an_rpc_worker_is_checked_from_its_log(binary):
    """The real llama-server given a split over a loopback RPC worker (a second device on this CPU; -ngl 10,
    --offload-first): its log shows the layers offloaded, weights on the worker and the first layers there, and it
    starts; asked for a device it did not use, it is refused with one line naming what its log lacks."""
    port = test_rpc.free_port()
    worker = test_rpc.start_worker(port)
    endpoint = f"127.0.0.1:{port}"
    split = lambda devices, layers=10: ServerSetup(  # noqa: E731
        binary, default_model_path(), threads=1, n_ctx=256, placement=Placement(n_gpu_layers=layers, offload_first=True),
        devices=devices)
    try:
        with LlamaServer(split((f"RPC0[{endpoint}]",)), ["--rpc", endpoint]) as server:
            log = server.log_path.read_text()
        assert OFFLOAD_FIRST_LOGGED in log and "offloaded 10/31 layers to GPU" in log
        with pytest.raises(LlamaServerError, match=r"did not split the model as the other lanes do: it put no weights "
                                                   r"on CUDA0 \(log: "):
            LlamaServer(split((f"RPC0[{endpoint}]", "CUDA0")), ["--rpc", endpoint])
    finally:
        test_rpc.stop(worker)


@pytest.mark.slow
def test_a_bench_split_over_an_rpc_worker_shares_one_copy_and_says_why_llama_server_cannot_run(binary, tmp_path):
    """`bench --rpc WORKER -ngl 20 --offload-first` in a process of its own (ggml keeps a registered worker for the
    life of a process): the worker holds layers 0-18 and the output, the free memory it reports is checked before
    loading, and the Python lanes answer on one loaded copy. ggml's rpc-server serves one client at a time and the
    bench holds the worker, so each llama-server lane is one line saying so (it would wait for the worker until its
    start timed out) and the baseline moves to Llama.eval."""
    port = test_rpc.free_port()
    worker = test_rpc.start_worker(port)
    out = tmp_path / "bench.json"
    try:
        proc = subprocess.run(
            [str(test_rpc.CLI), "bench", "-p", "1", "-n", str(TOKENS), "-t", "1", "--ppl-tokens", "16", "--no-peer",
             "--no-lookup-lane", "--spec-type", "none", "--quality", "exact", "--greedy-only",
             "--rpc", f"127.0.0.1:{port}", "-ngl", "20", "--offload-first", "--llama-server-bin", str(binary),
             "--json", str(out)], capture_output=True, text=True, timeout=600)
    finally:
        test_rpc.stop(worker)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert [line.split(":")[0] for line in data["dropped"]] == [PLAIN, repeat_of(PLAIN)]
    assert all("serve one client at a time" in line for line in data["dropped"])
    assert data["baseline"] == LLAMA_CPP_PYTHON and PLAIN not in data["tools"]
    (order,) = data["lane_order"]["greedy"]
    assert {LLAMA_CPP_PYTHON, ContextLane.name, repeat_of(ContextLane.name)} <= set(order)
    assert "RPC0" in data["placement"]


def test_llama_server_lanes_are_not_run_where_this_process_holds_rpc_workers():
    """ggml's rpc-server serves one client at a time: with the bench's layers on workers, each llama-server lane is
    a line saying so, not a server that waits for them until its start times out."""
    config = BenchConfig(model=default_model_path(), llama_server=Path("llama-server"), spec_types=["ngram-mod"])
    on_workers, on_this_machine = SimpleNamespace(workers=("127.0.0.1:50052",)), SimpleNamespace(workers=())
    dropped: list[str] = []
    assert bench_run.reachable_servers(config, on_this_machine, dropped) == bench_run.server_names(config)
    assert dropped == []
    assert bench_run.reachable_servers(config, on_workers, dropped) == []
    assert dropped == [f"{name}: not run: the RPC workers (127.0.0.1:50052) serve one client at a time, and this "
                       "bench holds them" for name in (PLAIN, repeat_of(PLAIN), "ngram-mod")]
