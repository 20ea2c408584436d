"""Bench results: dataclasses, the JSON document, rich tables and the exit-layer histogram (text and PNG)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.console import Group
from rich.table import Table

from specee_edge.bench.oracle import TimeModel

TIME_PARTS = ("draft", "layers", "predictor", "verify", "other", "sample")
HISTOGRAM_WIDTH = 48  # text cells shared by the histogram's bars (80-column terminals)


@dataclass
class ModeResult:
    """SpecEE with one KV mode; names from SPEC.md §5."""

    kv_mode: str
    steps: int                        # timed decode steps (each prompt's first token comes from the prompt pass)
    specee_tok_s: float
    speedup: float
    gain_captured: float | None       # None when oracle_speedup is 1 (nothing to capture)
    agreement: float
    exact_prefix: float
    ppl_specee: float
    avg_exit_layer: float
    exit_rate: float
    predictor_calls_per_token: float
    verify_fail_rate: float
    draft_recall_at_k: float
    ms_per_token: dict[str, float]    # TIME_PARTS; sample is outside the decode time
    exit_histogram: list[int]         # index = exit layer; the last = ran every layer; sums to steps


@dataclass
class BenchResult:
    model: str
    pack: str
    n_layer: int
    threads: int
    k: int
    prompt_set: str
    prompts: int
    tokens: int
    vanilla_steps: int
    vanilla_tok_s: float
    oracle_speedup: float
    oracle_avg_exit_layer: float
    oracle_histogram: list[int]
    time_model: TimeModel
    ppl_full: float
    ppl_tokens: int
    modes: list[ModeResult]
    seconds: float
    command: str

    @property
    def main(self) -> ModeResult:
        return self.modes[0]

    def to_json(self) -> dict:
        """The first KV mode's figures at the top level; every mode's under `modes`."""
        shared = asdict(self)
        del shared["modes"]
        main = asdict(self.main)
        head = {key: shared.pop(key) for key in ("model", "pack", "n_layer", "threads", "k", "prompt_set", "prompts", "tokens")}
        return {
            **head,
            "kv_mode": main.pop("kv_mode"),
            "vanilla_tok_s": shared.pop("vanilla_tok_s"),
            **main,
            "oracle_tok_s": self.vanilla_tok_s * self.oracle_speedup,
            **shared,
            "modes": {m.kv_mode: asdict(m) for m in self.modes},
        }

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    # --- terminal ----------------------------------------------------------------------------

    def render(self) -> Group:
        return Group(self._run(), self._modes(), self._time_split(), self._histogram())

    def _run(self) -> Table:
        table = Table(title=f"specee-edge bench: {self.model}", show_header=False)
        table.add_column(style="bold")
        table.add_column()
        tm = self.time_model
        rows = [
            ("run", f"{self.prompts} prompts ({self.prompt_set}) x {self.tokens} tokens, greedy, "
                    f"{self.threads} thread{'s' if self.threads != 1 else ''}, {self.seconds:.0f} s"),
            ("pack", f"{self.pack} (k = {self.k})"),
            ("vanilla", f"{self.vanilla_tok_s:.1f} tok/s ({1e3 / self.vanilla_tok_s if self.vanilla_tok_s else 0:.2f} ms per step)"),
            ("oracle_speedup", f"{self.oracle_speedup:.3f}x (avg_exit_layer {self.oracle_avg_exit_layer:.2f})"),
            ("time model", f"{tm.intercept_ms:.2f} ms + {tm.per_layer_ms:.3f} ms per layer run"),
            ("ppl_full", f"{self.ppl_full:.2f} ({self.ppl_tokens} held-out tokens)"),
        ]
        for label, value in rows:
            table.add_row(label, value)
        return table

    def _modes(self) -> Table:
        table = Table(title="SpecEE")
        table.add_column("kv_mode", style="bold")
        for m in self.modes:
            table.add_column(m.kv_mode, justify="right")
        rows = [
            ("specee tok/s", lambda m: f"{m.specee_tok_s:.1f}"),
            ("speedup", lambda m: f"{m.speedup:.3f}x"),
            ("gain_captured", lambda m: "-" if m.gain_captured is None else f"{m.gain_captured:+.2f}"),
            ("agreement", lambda m: f"{m.agreement:.3f}"),
            ("exact_prefix", lambda m: f"{m.exact_prefix:.1f} / {self.tokens}"),
            ("ppl_specee", lambda m: f"{m.ppl_specee:.2f}"),
            ("avg_exit_layer", lambda m: f"{m.avg_exit_layer:.2f}"),
            ("exit_rate", lambda m: f"{m.exit_rate:.3f}"),
            ("predictor_calls_per_token", lambda m: f"{m.predictor_calls_per_token:.2f}"),
            ("verify_fail_rate", lambda m: f"{m.verify_fail_rate:.3f}"),
            (f"draft_recall@{self.k}", lambda m: f"{m.draft_recall_at_k:.3f}"),
        ]
        for label, cell in rows:
            table.add_row(label, *(cell(m) for m in self.modes))
        return table

    def _time_split(self) -> Table:
        table = Table(title="ms per decode step")
        table.add_column("part", style="bold")
        for m in self.modes:
            table.add_column(m.kv_mode, justify="right")
        for part in TIME_PARTS:
            table.add_row(part, *(f"{m.ms_per_token[part]:.3f}" for m in self.modes))
        table.add_row("decode (all but sample)", *(f"{1e3 / m.specee_tok_s:.3f}" if m.specee_tok_s else "-" for m in self.modes))
        return table

    def _histogram(self) -> Table:
        table = Table(title=f"exit layers (layers without exits left out; {self.n_layer - 1} = ran every layer)")
        table.add_column("layer", justify="right")
        columns = {"oracle": self.oracle_histogram, **{m.kv_mode: m.exit_histogram for m in self.modes}}
        width = max(4, HISTOGRAM_WIDTH // len(columns))
        for name in columns:
            table.add_column(name, no_wrap=True)
        for il in range(self.n_layer):
            if any(counts[il] for counts in columns.values()):
                table.add_row(str(il), *(bar(counts[il], max(counts), width) for counts in columns.values()))
        return table


def bar(count: int, largest: int, width: int) -> str:
    """A text bar of `count` scaled so that `largest` fills `width` cells, then the count."""
    cells = round(width * count / largest) if largest else 0
    return f"{'█' * cells}{' ' * (width - cells)} {count}" if count else ""


def plot_histogram(result: BenchResult, path: Path) -> None:
    """Exit layers of each KV mode beside the oracle's, as shares of the decode steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = {"oracle": result.oracle_histogram, **{f"SpecEE ({m.kv_mode})": m.exit_histogram for m in result.modes}}
    colors = ["0.6", *(f"C{i}" for i in range(len(result.modes)))]
    layers = np.arange(result.n_layer)
    width = 0.8 / len(columns)
    fig, ax = plt.subplots(figsize=(10, 4.5), layout="constrained")
    for i, ((name, counts), color) in enumerate(zip(columns.items(), colors)):
        counts = np.asarray(counts, dtype=float)
        ax.bar(layers + (i - (len(columns) - 1) / 2) * width, counts / max(counts.sum(), 1), width, label=name, color=color)
    ax.set_xlabel(f"exit layer (0-based; {result.n_layer - 1} = ran every layer)")
    ax.set_ylabel("share of decode steps")
    ax.set_xticks(layers[:: max(1, result.n_layer // 15)])
    m = result.main
    ax.set_title(f"{result.model}: speedup ({m.kv_mode}) {m.speedup:.3f}x (oracle {result.oracle_speedup:.3f}x), "
                 f"agreement {m.agreement:.3f}, {result.prompts} prompts x {result.tokens} tokens")
    ax.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)
