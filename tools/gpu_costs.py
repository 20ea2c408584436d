"""What a token's parts cost on this machine's GPU (or its CPU), and the speed-ups they predict there.

Writes random-weight GGUFs with the shapes of the three shipped models and of Llama-2-7B (the paper's model,
f16 as the paper ran it) and times each through the patched runtime, all layers offloaded (--gpu-layers): the
lanes of specee_edge/runtime/costs.py (a plain token, a layer, the LM head, the draft, a check, a stop, a
skipped layer's K/V rebuilt), plus a stop halfway and its resume, and verification batches of 1-8 rows (exact
mode's). Weights do not change a step's time, only shapes and types do: the shipped models' own types where
gguf-py can write them (SmolLM2 Q4_1), Q4_1 for the two Q4_K_M ones too (gguf-py cannot write Q4_K; Q4_1's 5
bits a weight are the nearest to Q4_K_M's 4.9 of what it writes; specee_edge/runtime/quantize.py requantizes
into any type with llama.cpp itself).

How often tokens exit, and how many drafts the full model accepts, does not depend on the hardware: the
predictions take them from the shipped packs' levels (calibration's held-out figures on the real models, on
CPU; Llama-2-7B has no pack and borrows SmolLM2's, the same architecture, at the same relative depths). A
lossy level's token mixes full tokens with exits at the depth its layer speed-up implies (head-free or paying
the head as its head-free rate says), priced by TokenCosts.token_ms in fill mode, the engine's default. An
exact-mode round drafts D = (tokens per round - 1) / acceptance tokens, each a head-free stop at its exits'
depth, then verifies D + 1 rows in one batch, and emits tokens-per-round tokens.

    python tools/gpu_costs.py                      # on the GPU machine (tools/gpu_check.sh runs it)
    python tools/gpu_costs.py --llama2-layers 2    # a cut-down Llama-2-7B that a CPU times in a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.tiny_gguf writes the models

from specee_edge.exits import ExitKind  # noqa: E402
from specee_edge.pack import Pack, QualityLevel, read_pack  # noqa: E402
from specee_edge.runtime.costs import (  # noqa: E402
    CostLane, DraftSetup, TokenCosts, checked_context, cost_lanes, time_rounds,
)
from specee_edge.runtime.model import Model  # noqa: E402
from specee_edge.runtime.placement import Placement  # noqa: E402
from specee_edge.shipped import shipped_dir  # noqa: E402
from tests.tiny_gguf import TinyConfig, write_tiny_model  # noqa: E402

BATCH_ROWS = range(1, 9)
PROMPT = "Explain how a hash map works, with an example in Python."


@dataclass(frozen=True)
class Shape:
    name: str
    config: TinyConfig
    pack: str  # the shipped pack whose levels' rates predict the speed-ups


SHAPES = (
    Shape("SmolLM2-135M", TinyConfig("llama", n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536,
                                     n_vocab=49152, n_ctx_train=4096, tied_embeddings=True, weight_type="q4_1"),
          "SmolLM2-135M-Instruct.Q4_1.specee.gguf"),
    Shape("gemma-3-270m", TinyConfig("gemma3", n_layer=18, n_embd=640, n_head=4, n_head_kv=1, n_embd_head=256,
                                     n_ff=2048, n_vocab=262144, n_ctx_train=4096, tied_embeddings=True,
                                     weight_type="q4_1", n_swa=512, swa_pattern=6),
          "gemma-3-270m-q4_k_m.specee.gguf"),
    Shape("Qwen2.5-Coder-1.5B", TinyConfig("qwen2", n_layer=28, n_embd=1536, n_head=12, n_head_kv=2, n_ff=8960,
                                           n_vocab=151936, n_ctx_train=4096, tied_embeddings=True, weight_type="q4_1"),
          "qwen2.5-coder-1.5b-instruct-q4_k_m.specee.gguf"),
    Shape("Llama-2-7B", TinyConfig("llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=32, n_ff=11008,
                                   n_vocab=32000, n_ctx_train=4096, weight_type="f16"),
          "SmolLM2-135M-Instruct.Q4_1.specee.gguf"),
)


def stamp(console: Console, message: str) -> None:
    console.print(f"[{time.strftime('%H:%M:%S')}] {message}", highlight=False)


# --- lanes beyond costs.py's ----------------------------------------------------------------------------------

@dataclass
class ResumeLane(CostLane):
    """A head-free stop after `layers_run` layers, then resume(): the rest of the layers, as when a stopped token
    must be completed."""

    def step(self, token: int) -> None:
        start = time.perf_counter()
        self.ctx.decode([token])
        self.ctx.resume()
        self._record(time.perf_counter() - start)

    def _record(self, seconds: float) -> None:
        self.timing.add(seconds)
        self.samples.append(seconds * 1e3)


@dataclass
class BatchLane(ResumeLane):
    """A verification batch of `rows` rows (every row's logits), then forgotten; the token itself is decoded
    after it, untimed, so that the cache grows as the other lanes' does."""

    rows: int = 1

    def step(self, token: int) -> None:
        n_past = self.ctx.n_past
        start = time.perf_counter()
        self.ctx.decode([token] * self.rows, output_all=True)
        self._record(time.perf_counter() - start)
        self.ctx.truncate(n_past)
        self.ctx.decode([token])


def random_setup(n_embd: int, n_vocab: int, pack: Pack, seed: int = 0) -> DraftSetup:
    """A draft head of the pack's size (at most the vocabulary, in whole q8_0 blocks) with random weights for a
    model `n_embd` wide, and one of its predictors (their values change no step's time)."""
    rng = np.random.default_rng(seed)
    rows = min(n_vocab if pack.draft.vocab_map is None else len(pack.draft.vocab_map), n_vocab // 32 * 32)
    square = lambda: (rng.standard_normal((n_embd, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
    draft = dict(w_embd=square(), w_hidden=square(), bias=np.zeros(n_embd, np.float32),
                 norm=np.ones(n_embd, np.float32), eps=1e-6,
                 head=(rng.standard_normal((rows, n_embd)) / np.sqrt(n_embd)).astype(np.float32),
                 vocab_map=np.arange(rows, dtype=np.int32), quant=pack.draft.quant)
    mlp = pack.predictors[max(pack.predictors)]
    return DraftSetup(draft, (mlp.weights, mlp.biases))


# --- measuring ------------------------------------------------------------------------------------------------

@dataclass
class ShapeCosts:
    name: str
    weight_type: str
    n_layer: int
    file_gb: float
    costs: TokenCosts
    resume_ms: float  # a head-free stop halfway and its resume, whole
    batch_ms: dict[int, float]  # a verification batch of n rows
    predictions: list[dict] = field(default_factory=list)


def measure(path: Path, shape: Shape, pack: Pack, *, placement: Placement, threads: int, rounds: int, tokens: int
            ) -> ShapeCosts:
    config = shape.config
    setup = random_setup(config.n_embd, config.n_vocab, pack)
    probe = Model(path, placement=Placement())
    prompt = probe.tokenize(PROMPT)
    probe.close()
    answer = prompt + np.random.default_rng(1).integers(4, config.n_vocab, tokens + 8).tolist()
    n_ctx = len(answer) + 16
    half = config.n_layer // 2 - 1

    def lanes(model: Model) -> list[CostLane]:
        context = lambda layers, threshold: checked_context(model, setup, layers, threshold=threshold, n_ctx=n_ctx,
                                                            n_threads=threads, k=pack.k)
        return [*cost_lanes(model, setup, n_ctx=n_ctx, n_threads=threads, k=pack.k),
                ResumeLane("resume", context([half], -1.0), config.n_layer),
                *(BatchLane(f"batch{r}", context([config.n_layer - 1], 1.0), config.n_layer, rows=r)
                  for r in BATCH_ROWS)]

    timed = time_rounds(path, lanes, [(answer, len(prompt))], rounds=rounds, seed=0, placement=placement)
    costs = TokenCosts.fit(timed)
    median = lambda name: float(np.median(np.concatenate([[*lane.samples] for lanes_ in timed for lane in lanes_
                                                          if lane.name == name])))
    return ShapeCosts(shape.name, config.weight_type, config.n_layer, path.stat().st_size / 1e9, costs,
                      median("resume"), {r: median(f"batch{r}") for r in BATCH_ROWS})


# --- predicting -----------------------------------------------------------------------------------------------

def exit_depth(level: QualityLevel, n_layer: int) -> float:
    """Layers an exiting token runs at `level`, from its exit rate and layer speed-up (the rest run them all)."""
    mean_run = n_layer / level.layer_speedup
    if level.exit_rate <= 0:
        return float(n_layer)
    return float(np.clip((mean_run - (1 - level.exit_rate) * n_layer) / level.exit_rate, 1, n_layer))


def lossy_token_ms(costs: TokenCosts, level: QualityLevel, pack_layers: int) -> float:
    """A mean token at `level`: full tokens, head-free exits and verified exits in the level's proportions."""
    n = costs.n_layer
    run = round(exit_depth(level, pack_layers) * n / pack_layers)
    on = [round((il + 1) * n / pack_layers) for il in level.on_layers]  # the checks, at the same relative depths
    exit_checks = sum(depth <= run for depth in on)
    e, h = level.exit_rate, min(level.head_free_rate, level.exit_rate)
    weights = np.array([1 - e, h, e - h])
    exit_layer = np.array([n - 1, run - 1, run - 1])
    kind = np.array([ExitKind.NONE, ExitKind.HEAD_FREE, ExitKind.VERIFIED])
    ms = costs.token_ms(exit_layer, kind, np.array([len(on), exit_checks, exit_checks]), np.zeros(3), fill=True)
    return float(weights @ ms)


def source_level(pack: Pack, exact: QualityLevel) -> QualityLevel | None:
    """The lossy level whose exits the exact level drafts with (calibration copies them), if any."""
    return next((lv for lv in pack.levels if not lv.exact and lv.exits == exact.exits and lv.exit_rate > 0), None)


def interpolated_batch(batch_ms: dict[int, float], rows: float) -> float:
    return float(np.interp(rows, list(batch_ms), list(batch_ms.values())))


def predictions(measured: ShapeCosts, pack: Pack) -> list[dict]:
    costs, out = measured.costs, []
    pack_layers = pack.target.n_layer
    for level in pack.levels:
        if level.exact:
            if level.acceptance <= 0 or level.tokens_per_round <= 1:
                continue
            drafts = (level.tokens_per_round - 1) / level.acceptance
            source = source_level(pack, level)
            depth = exit_depth(source, pack_layers) * costs.n_layer / pack_layers if source else 0.0
            draft_ms = float(costs.head_free_ms(np.array(round(depth)))) if source else 0.0  # 0: prompt lookup
            round_ms = drafts * draft_ms + interpolated_batch(measured.batch_ms, drafts + 1)
            out.append(dict(level="exact", cpu=level.speedup, here=level.tokens_per_round * costs.plain_ms / round_ms,
                            rates=f"acceptance {level.acceptance:.2f}, {level.tokens_per_round:.2f} tokens/round, "
                                  f"{drafts:.1f} drafts/round"))
        elif not level.off:
            token_ms = lossy_token_ms(costs, level, pack_layers)
            out.append(dict(level=f"{level.quality:g}", cpu=level.speedup,
                            here=costs.plain_ms / token_ms if token_ms > 0 else float("nan"),  # nan: parts lost in noise
                            rates=f"exits {level.exit_rate:.2f} (head-free {level.head_free_rate:.2f}), "
                                  f"layers {level.layer_speedup:.2f}x"))
    return out


# --- output ---------------------------------------------------------------------------------------------------

def split_cells(c: TokenCosts) -> tuple[str, str]:
    """A layer past the split (from layer c.split on: the other device's) beyond `layer`, and the crossing."""
    if c.split is None:
        return "-", "-"
    return f"{c.split}+: {c.split_layer_ms:+.4f}", f"{c.crossing_ms:.3f}"


def cost_table(rows: list[ShapeCosts], where: str) -> Table:
    table = Table(title=f"the patched runtime on {where}: ms per step (random weights, real shapes)")
    for column in ("model shape", "type", "GB", "plain", "layer", "past split", "crossing", "LM head", "draft",
                   "check", "stop", "stop+resume", *(f"batch {r}" for r in BATCH_ROWS)):
        table.add_column(column, justify="left" if column == "model shape" else "right", no_wrap=True)
    for r in rows:
        c = r.costs
        table.add_row(f"{r.name} ({r.n_layer}L)", r.weight_type, f"{r.file_gb:.2f}", f"{c.plain_ms:.3f}",
                      f"{c.layer_ms:.4f}", *split_cells(c), f"{c.head_ms:.3f}", f"{c.draft_ms:.3f}", f"{c.check_ms:.4f}",
                      f"{c.stop_ms:.3f}", f"{r.resume_ms:.3f}", *(f"{r.batch_ms[n]:.3f}" for n in BATCH_ROWS))
    return table


def prediction_table(rows: list[ShapeCosts], where: str) -> Table:
    table = Table(title=f"predicted speed-ups over plain decoding on {where}, from the table above and the packs' "
                        "rates (measured on CPU)")
    for column in ("model shape", "level", "calibrated on CPU", "predicted here", "rates (from the pack)"):
        table.add_column(column, justify="left" if column in ("model shape", "rates (from the pack)") else "right")
    for r in rows:
        for p in r.predictions:
            table.add_row(r.name, p["level"], f"{p['cpu']:.2f}x", f"{p['here']:.2f}x", p["rates"])
    return table


def device_name(gpu_layers: int) -> str:
    """What the layers run on: the GPU's name where they are offloaded (nvidia-smi's, where there is one)."""
    from llama_cpp import llama_cpp as _llama

    if not (gpu_layers and _llama.llama_supports_gpu_offload()):
        return "the CPU"
    smi = shutil.which("nvidia-smi")
    names = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True).stdout.split("\n") if smi else []
    return names[0].strip() or "the GPU" if names else "the GPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where the models are written (default: /dev/shm if "
                        "it has room, else the system's temporary folder); they are removed after timing")
    parser.add_argument("--gpu-layers", "-ngl", type=int, default=99, help="layers offloaded (llama.cpp's -ngl)")
    parser.add_argument("--offload-first", action="store_true", help="offload the first layers, not the last "
                        "(SpecEE's placement: specee_edge/runtime/placement.py)")
    parser.add_argument("-t", "--threads", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each on a freshly loaded model")
    parser.add_argument("--tokens", type=int, default=16, help="timed tokens per round")
    parser.add_argument("--llama2-layers", type=int, default=32,
                        help="Llama-2-7B's layers (fewer: a cut-down shape that a CPU times quickly)")
    parser.add_argument("--until", type=float, default=None, help="a deadline (seconds since the epoch): a shape "
                        "that would not be timed before it is skipped, so that the tables still print")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here (and the tables, as "
                        "text, beside it with the suffix .txt)")
    args = parser.parse_args()
    console = Console(width=200, record=True)
    where = device_name(args.gpu_layers)
    folder = args.dir or default_dir()
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in SHAPES:
        if shape.name == "Llama-2-7B" and args.llama2_layers != shape.config.n_layer:
            shape = dataclasses.replace(shape, name=f"Llama-2-7B cut to {args.llama2_layers}",
                                        config=dataclasses.replace(shape.config, n_layer=args.llama2_layers))
        path = folder / f"{shape.config.arch}-{shape.config.n_layer}L-{shape.config.n_embd}.gguf"
        if args.until is not None and time.time() + seconds_needed(shape.config) > args.until:
            stamp(console, f"{shape.name}: skipped, too little time left before the deadline")
            continue
        stamp(console, f"{shape.name}: writing {path}")
        write_tiny_model(path, shape.config, tiled=True)
        stamp(console, f"{shape.name}: {path.stat().st_size / 1e9:.2f} GB written; timing on {where}")
        pack = read_pack(shipped_dir() / shape.pack)
        try:
            measured = measure(path, shape, pack, placement=Placement(args.gpu_layers, offload_first=args.offload_first),
                               threads=args.threads,
                               rounds=args.rounds, tokens=args.tokens)
        finally:
            path.unlink()
        measured.predictions = predictions(measured, pack)
        stamp(console, f"{shape.name}: plain token {measured.costs.plain_ms:.3f} ms")
        rows.append(measured)
    for table in (cost_table(rows, where), prediction_table(rows, where)):
        console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"device": where, "shapes": [
            {**{k: v for k, v in dataclasses.asdict(r).items() if k != "costs"}, "costs": r.costs.to_dict()}
            for r in rows]}, indent=2, default=float))
        args.json.with_suffix(".txt").write_text(console.export_text())
        stamp(console, f"wrote {args.json} and the tables as text beside it")
    return 0


def seconds_needed(config: TinyConfig) -> float:
    """A generous guess at writing, loading and timing a shape: a fixed part, and a part per GB of weights."""
    bytes_per_weight = {"f32": 4, "f16": 2, "q8_0": 34 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32}[config.weight_type]
    weights = (config.n_layer * (2 * config.n_embd * config.n_embd_q + 2 * config.n_embd * config.n_embd_kv
                                 + 3 * config.n_embd * config.n_ff)
               + (1 if config.tied_embeddings else 2) * config.n_vocab * config.n_embd)
    return 20 + 5 * weights * bytes_per_weight / 1e9


def default_dir() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 20e9:
        return shm / "specee-shapes"
    return Path(os.environ.get("TMPDIR", "/tmp")) / "specee-shapes"


if __name__ == "__main__":
    sys.exit(main())
