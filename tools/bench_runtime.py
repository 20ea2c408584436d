"""Benchmark the patched runtime on the default model: what early exit costs when it does not fire,
and the forced-stop speed-ups.

In one process, interleaved token by token, greedy, same threads:
  vanilla     stock llama_cpp.Llama on the same (patched) library, early exit never enabled
  plain       our Context without early exit (the wrapper's own overhead)
  idle        early exit enabled, no probe layer set: graphs are the stock ones
  draft       the shipped pack's draft head in the graph, one native check that never fires, after the
              pack's deepest predictor layer below the last (a verified exit after the last layer would
              be the output head itself: the runtime allows it head-free or off only)
  native_all  the draft and a native check after every layer but the last, none firing (threshold above 1)
  python_all  the draft and the Python callback after every layer, never stopping
  stopNN      every generated token stops at NN% depth, for each KV mode (candidates set from Python)
Decode tokens/s counts generated tokens only: the time inside llama_decode per token (the prompt
and the Python argmax are excluded).

    python tools/bench_runtime.py --json bench_runtime.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import llama_cpp
from llama_cpp import Llama
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from specee_edge.default_model import default_model_path
from specee_edge.draft import LinearDraft
from specee_edge.engine.exit import find_pack
from specee_edge.exits import ExitKind
from specee_edge.pack import read_pack
from specee_edge.runtime import KV_MODES, Context, Model
from specee_edge.runtime.weights import TargetWeights

PROMPTS = [
    "Explain how a bicycle works to a ten-year-old.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What are the main causes of the French Revolution?",
    "Summarise the water cycle in a few sentences.",
]
STOP_DEPTHS = (50, 75)
NEVER = 2.0  # a threshold no sigmoid exceeds


def chat_prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Timing:
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class Session(Protocol):
    """One variant's greedy decode: start() evaluates a prompt, step() times one generated token."""

    def start(self, prompt: list[int]) -> None: ...

    def step(self) -> float: ...


@dataclass
class Variant:
    name: str
    session: Session
    timing: Timing = field(default_factory=Timing)


class VanillaSession:
    """Stock llama_cpp.Llama."""

    def __init__(self, llm: Llama):
        self.llm = llm

    def start(self, prompt: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(prompt)

    def step(self) -> float:
        # Llama.eval keeps no scores without logits_all: the last token's logits come from llama.cpp
        logits = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        token = int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),))))
        start = time.perf_counter()
        self.llm.eval([token])
        return time.perf_counter() - start


class ContextSession:
    """Our Context; with `stop_layer`, every generated token stops there (a forced exit); with
    `drafted`, the candidates come from the draft head in the graph, else from the last logits."""

    def __init__(self, ctx: Context, stop_layer: int | None = None, drafted: bool = False):
        self.ctx = ctx
        self.drafted = drafted
        if stop_layer is not None:
            ctx.set_probe_layers([stop_layer])
            ctx.set_probe_callback(lambda il, cand_logits: True)

    def start(self, prompt: list[int]) -> None:
        self.ctx.clear()
        self.ctx.decode(prompt)

    def step(self) -> float:
        logits = self.ctx.logits()
        token = int(np.argmax(logits))
        if self.ctx.n_cand and not self.drafted:
            self.ctx.set_candidates(np.argpartition(logits, -self.ctx.n_cand)[-self.ctx.n_cand :].tolist())
        start = time.perf_counter()
        self.ctx.decode([token])
        return time.perf_counter() - start


def build_variants(model: Model, threads: int, n_ctx: int) -> list[Variant]:
    n_layer = model.info.n_layer
    llm = Llama(model_path=str(model.info.path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    variants = [
        Variant("vanilla", VanillaSession(llm)),
        Variant("plain", ContextSession(Context(model, n_ctx=n_ctx, n_threads=threads))),
    ]
    idle = Context(model, n_ctx=n_ctx, n_threads=threads)
    idle.enable_early_exit(4, "fill")
    variants.append(Variant("idle", ContextSession(idle)))

    pack = read_pack(find_pack(model.info.path))
    draft = LinearDraft(pack.draft, TargetWeights(model.info.path), pack.k)
    mlp = next(iter(pack.predictors.values()))
    every_layer = range(n_layer - 1)  # a verified check may follow any layer but the last
    deepest = max(il for il in pack.predictors if il in every_layer)
    for name, layers, native in (("draft", [deepest], True), ("native_all", every_layer, True),
                                 ("python_all", every_layer, False)):
        ctx = Context(model, n_ctx=n_ctx, n_threads=threads)
        ctx.enable_early_exit(pack.k, "fill")
        ctx.set_draft(w_embd=draft.w_embd, w_hidden=draft.w_hidden, bias=draft.bias, norm=draft.gamma,
                      eps=draft.eps, head=draft.head, vocab_map=draft.vocab_map, quant=draft.quant)
        if native:
            for il in layers:
                ctx.set_predictor(il, mlp.weights, mlp.biases)
                ctx.set_exit(il, ExitKind.VERIFIED, NEVER)
        else:
            ctx.set_probe_callback(lambda il, cand_logits: False)
        ctx.set_probe_layers(layers)
        variants.append(Variant(name, ContextSession(ctx, drafted=True)))
    for mode in KV_MODES:
        for depth in STOP_DEPTHS:
            ctx = Context(model, n_ctx=n_ctx, n_threads=threads)
            ctx.enable_early_exit(4, mode)
            variants.append(Variant(f"stop{depth}_{mode}", ContextSession(ctx, stop_layer=stop_layer(n_layer, depth))))
    return variants


def stop_layer(n_layer: int, depth_percent: int) -> int:
    """The 0-based layer after which `depth_percent` of the layers have run."""
    return round(n_layer * depth_percent / 100) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("-n", "--n-predict", type=int, default=128, help="generated tokens per prompt")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompt set")
    args = parser.parse_args()

    console = Console()
    model = Model(default_model_path())
    n_layer = model.info.n_layer
    variants = build_variants(model, args.threads, n_ctx=512)
    prompts = [model.tokenize(chat_prompt(p)) for p in PROMPTS]

    # no auto-refresh thread: it steals the GIL from the timed loops (it slowed Llama.eval 10x)
    with Progress(console=console, transient=True, auto_refresh=False) as progress:
        task = progress.add_task("benchmarking", total=args.rounds * len(prompts) * args.n_predict)
        for _ in range(args.rounds):
            for prompt in prompts:
                for v in variants:
                    v.session.start(prompt)
                # interleaved token by token: drift in machine speed hits every variant alike
                for _ in range(args.n_predict):
                    for v in variants:
                        v.timing.seconds += v.session.step()
                        v.timing.tokens += 1
                    progress.advance(task)
                    progress.refresh()

    tok_s = {v.name: v.timing.tok_s for v in variants}
    vanilla = tok_s["vanilla"]
    results = {
        "model": model.info.path.name,
        "n_layer": n_layer,
        "threads": args.threads,
        "prompts": len(prompts) * args.rounds,
        "tokens_per_prompt": args.n_predict,
        "vanilla_tok_s": vanilla,
        **{f"{name}_tok_s": tok_s[name] for name in ("plain", "idle", "draft", "native_all", "python_all")},
        # checking every layer natively, none firing, on top of the draft
        "probe_overhead": tok_s["draft"] / tok_s["native_all"] - 1,
        # everything early exit costs when nothing fires: draft and every layer checked
        "overhead_vs_vanilla": vanilla / tok_s["native_all"] - 1,
        "draft_overhead": vanilla / tok_s["draft"] - 1,
        "python_probe_overhead": tok_s["draft"] / tok_s["python_all"] - 1,
        "modes": {
            mode: {
                f"stop{d}_{key}": value
                for d in STOP_DEPTHS
                for key, value in (
                    ("layer", stop_layer(n_layer, d)),
                    ("tok_s", tok_s[f"stop{d}_{mode}"]),
                    ("speedup", tok_s[f"stop{d}_{mode}"] / vanilla),
                    ("layer_bound", n_layer / (stop_layer(n_layer, d) + 1)),
                )
            }
            for mode in KV_MODES
        },
    }

    table = Table(title=f"runtime on {model.info.path.name} ({args.threads} threads, greedy, {args.n_predict} tokens x {len(prompts) * args.rounds} prompts)")
    for column in ("variant", "tok/s", "vs vanilla", "layers run", "layer-only bound"):
        table.add_column(column, justify="right" if column != "variant" else "left")
    for v in variants:
        depth = next((d for d in STOP_DEPTHS if v.name.startswith(f"stop{d}_")), None)
        layers = stop_layer(n_layer, depth) + 1 if depth else n_layer
        bound = f"{n_layer / layers:.2f}x" if depth else ""
        table.add_row(v.name, f"{v.timing.tok_s:.1f}", f"{v.timing.tok_s / vanilla:.3f}x", f"{layers}/{n_layer}", bound)
    console.print(table)
    console.print(
        f"probe_overhead (every layer checked natively, on top of the draft) = {results['probe_overhead']:+.3f}; "
        f"Python callback instead {results['python_probe_overhead']:+.3f}; draft with one check "
        f"{results['draft_overhead']:+.3f}; all of it against vanilla {results['overhead_vs_vanilla']:+.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
