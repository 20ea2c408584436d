"""Every script in tools/ that no other test runs, run as a user runs it (`python tools/NAME.py ...` in its own
process) with the smallest arguments that still take it through its whole path on the default model: one
thread, a few tokens, one round. Each output is read back and must hold what the script promises (its table's
rows or its JSON's keys, times and rates above 0). The figures themselves are not judged: at this size they are
noise. Tested elsewhere: build_runtime, gpu_bundle and gpu_costs (test_gpu_check), compare_packs
(test_bootstrap), keep_promises (test_levels); gpu_check.sh is the GPU machine's script."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specee_edge.default_model import default_model_path
from specee_edge.runtime import KV_MODES, rpc
from tests.test_rpc import free_port, start_worker, stop

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"[-+]?\d+(?:\.\d+)?"


def run_tool(name: str, *args: str, timeout: float = 300) -> str:
    """tools/NAME.py's stdout; rich tables drawn 200 columns wide, so that no cell is cut."""
    result = subprocess.run([sys.executable, f"tools/{name}.py", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def table_rows(out: str) -> list[list[str]]:
    """The cells of each body row of a rich table in `out`."""
    return [[cell.strip() for cell in line.strip("│ ").split("│")] for line in out.splitlines()
            if line.startswith("│")]


@pytest.mark.slow
def test_bench_runtime_runs_every_variant(tmp_path):
    """It asked a verified exit after the last layer (the pack's deepest predictor) and failed at once."""
    path = tmp_path / "runtime.json"
    run_tool("bench_runtime", "-n", "2", "--rounds", "1", "-t", "1", "--json", str(path))
    result = json.loads(path.read_text())
    assert result["n_layer"] == 30 and result["tokens_per_prompt"] == 2 and result["prompts"] == 4
    for variant in ("vanilla", "plain", "idle", "draft", "native_all", "python_all"):
        assert result[f"{variant}_tok_s"] > 0, variant
    for ratio in ("probe_overhead", "overhead_vs_vanilla", "draft_overhead", "python_probe_overhead"):
        assert ratio in result
    assert set(result["modes"]) == set(KV_MODES)
    for figures in result["modes"].values():
        assert (figures["stop50_layer"], figures["stop75_layer"]) == (14, 21)
        assert figures["stop50_tok_s"] > 0 and figures["stop75_tok_s"] > 0 and figures["stop50_speedup"] > 0
        assert figures["stop50_layer_bound"] == 2.0


def test_batch_logits_compares_every_position_both_decodes_cover():
    out = run_tool("batch_logits", str(default_model_path()), "--tokens", "5", "-t", "1")
    match = re.search(rf"(\d+) positions: largest logit difference median ({NUMBER}), 90th percentile ({NUMBER}), "
                      rf"max ({NUMBER}); bit-identical rows ({NUMBER}); total variation at T=0.8 mean ({NUMBER}), "
                      rf"max ({NUMBER})", out)
    assert match, out
    positions, median, p90, largest, identical, tv_mean, tv_max = map(float, match.groups())
    # 4 prompts, 5 greedy tokens each: 4 positions each (the fifth token's row would be a one-row batch)
    assert 1 <= positions <= 16
    assert 0 <= median <= p90 <= largest and 0 <= identical <= 1 and 0 <= tv_mean <= tv_max <= 1


def test_sampling_overhead_times_the_engine_and_llama():
    out = run_tool("sampling_overhead", str(default_model_path()), "--tokens", "4", "--rounds", "1", "-t", "1")
    match = re.search(rf"engine ({NUMBER}) tok/s, Llama ({NUMBER}) tok/s, ratio ({NUMBER})", out)
    assert match, out
    engine, llama, ratio = map(float, match.groups())
    assert engine > 0 and llama > 0 and abs(ratio - engine / llama) < 0.01 * ratio + 1e-3


def test_stop_curve_times_a_stop_at_each_depth_against_both_fits():
    out = run_tool("stop_curve", "--every", "30", "--rounds", "1", "--tokens", "4", "-t", "1")
    plain = re.search(rf"a\s+plain\s+token\s+({NUMBER})\s+ms", out)  # the title may wrap
    assert plain and float(plain.group(1)) > 0, out
    rows = table_rows(out)
    # --every 30: the last layer, and the quarter, half and three quarters calibration times (starred)
    assert [row[0] for row in rows] == ["8 *", "15 *", "22 *", "30"], out
    for row in rows:
        assert float(row[1]) > 0
        assert all(re.fullmatch(rf"{NUMBER} \({NUMBER}\)", cell) for cell in row[2:]), row
    # the parabola goes through the three stops it is fitted to
    assert all(abs(float(row[3].split()[0])) < 1e-3 for row in rows[:3]), out


def test_bench_serve_times_generate_and_a_streaming_client():
    out = run_tool("bench_serve", "-n", "4", "--rounds", "1", "-t", "1")
    rows = {row[0]: row[1:] for row in table_rows(out)}
    assert set(rows) == {"generate", "serve (client)"}, out
    for tokens, median, low, high, ratio in rows.values():
        assert int(tokens) == 4
        assert 0 < float(low) <= float(median) <= float(high) and float(ratio) > 0
    assert rows["generate"][4] == "1.000"


@pytest.mark.slow
def test_rpc_round_trip_times_checks_on_one_machine_and_across_two_workers(tmp_path):
    ports = [free_port(), free_port()]
    workers = [start_worker(port) for port in ports]
    path = tmp_path / "round_trip.json"
    try:
        run_tool("rpc_round_trip", "--rpc", ",".join(f"{rpc.LOOPBACK}:{port}" for port in ports), "--tokens", "4",
                 "-t", "1", "--json", str(path))
    finally:
        for worker in workers:
            stop(worker)
    result = json.loads(path.read_text())
    assert result["layers"] == {"client": 9, "worker": 20}  # -ngl 20 of 30 layers: 11-29 on the workers
    assert len(result["bare_round_trip_ms"]) == 2 and all(ms > 0 for ms in result["bare_round_trip_ms"])
    lanes = ["plain", "checked@client", "stop@client", "checked@worker", "stop@worker"]
    assert set(result["extra_ms"]) == set(lanes[1:])
    one, split = ({lane["name"]: lane for lane in result["lanes"][key]} for key in ("one machine", "split"))
    assert list(one) == list(split) == lanes
    for name in lanes:
        assert one[name]["ms"] > 0 and split[name]["ms"] > 0
        assert one[name]["replies"] == 0
    for name in ("plain", "checked@client", "checked@worker", "stop@worker"):
        assert split[name]["replies"] >= 1, name  # these run layers on the workers: every token waits for them


def header(patch: bytes) -> list[bytes]:
    lines = patch.splitlines()
    return lines[:next(i for i, line in enumerate(lines) if not line.startswith(b"#"))]


def test_patch_tree_checkout_then_export_gives_back_the_patches(tmp_path):
    """A round trip through the git work tree: the same patch files and sources, each patch applying to the
    same tree. Export writes git's form of a diff; a patch in that form comes back byte for byte."""
    patches = ROOT / "patches"
    before = {path: path.read_bytes() for path in patches.rglob("*") if path.is_file()}
    tree, out = tmp_path / "llama.cpp", tmp_path / "patches"
    try:  # the tree is 230 MB: not left in pytest's kept temporary folders
        run_tool("patch_tree", "checkout", str(tree))
        run_tool("patch_tree", "export", str(tree), "--patches", str(out))
        assert {path: path.read_bytes() for path in patches.rglob("*") if path.is_file()} == before  # untouched

        exported = {path.relative_to(out): path.read_bytes() for path in out.rglob("*") if path.is_file()}
        assert set(exported) == {path.relative_to(patches) for path in before}
        for name, text in exported.items():
            original = (patches / name).read_bytes()
            if name.parts[0] == "src" or b"\ndiff --git " in original:
                assert text == original, name
            else:  # written by hand: the same header, the same change (checked below on the tree)
                assert header(text) == header(original), name

        def git(*args: str, **env: str) -> str:
            return subprocess.run(["git", *args], cwd=tree, check=True, capture_output=True, text=True,
                                  env={**os.environ, **env}).stdout.strip()

        sources = git("log", "--format=%H", "--grep", "^specee sources", "-1")
        index = {"GIT_INDEX_FILE": str(tmp_path / "index")}
        git("read-tree", sources, **index)
        for patch in sorted(out.glob("*.patch")):
            git("apply", "--cached", str(patch), **index)
        assert git("write-tree", **index) == git("rev-parse", "HEAD^{tree}")
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def test_patch_tree_refuses_to_export_what_no_checkout_made(tmp_path):
    other = tmp_path / "other"  # a git repository, but not one checkout made
    other.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=other, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-q", "--allow-empty", "-m",
                    "first"], cwd=other, check=True)
    for tree, reason in ((tmp_path / "none", "is no git work tree"), (other, "has no commit 'specee sources")):
        result = subprocess.run([sys.executable, "tools/patch_tree.py", "export", str(tree), "--patches",
                                 str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 1 and reason in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert not (tmp_path / "out").exists()


def test_python_per_token_counts_each_lane():
    """Bytecodes and calls per token for the bare lane, SpecEE off and exact mode, on the same prompts: the engine's
    stream runs more Python than the bare loop, exact mode more than SpecEE off (lookup and the plan every round)."""
    out = run_tool("python_per_token", "-n", "6", "-p", "2", "--top", "2", "-t", "1")
    rows = {row[0]: row[1:] for row in table_rows(out) if row[0] in ("bare", "off", "exact")}
    assert set(rows) == {"bare", "off", "exact"}, out
    tokens = {lane: int(cells[0]) for lane, cells in rows.items()}
    bytecodes = {lane: float(cells[1]) for lane, cells in rows.items()}
    assert tokens["bare"] == tokens["off"] > 0  # greedy: the same answers
    assert 0 < bytecodes["bare"] < bytecodes["off"] < bytecodes["exact"], rows
    assert "exact: bytecodes per token by function" in out
