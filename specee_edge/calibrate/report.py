"""The calibration report: printed as rich tables and stored in the pack's provenance."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rich.console import Group
from rich.table import Table

from specee_edge.calibrate.draft_fit import DraftReport


@dataclass
class LayerReport:
    layer: int
    positive_rate: float  # share of held-out steps whose label is 1
    threshold: float
    precision: float      # of the predictor alone at its threshold, on held-out steps
    recall: float


@dataclass
class CalibrationReport:
    model: str
    n_layer: int
    prompts: int
    tokens: int
    train_tokens: int
    draft: DraftReport
    layers: list[LayerReport]
    offline_layers: list[int]
    avg_exit_layer: float
    exit_rate: float
    agreement: float
    predictor_calls_per_token: float
    verify_fail_rate: float
    oracle_avg_exit_layer: float
    expected_layer_speedup: float  # n_layer / mean layers run, overheads excluded
    oracle_layer_speedup: float
    exit_histogram: dict[int, int]
    seconds: dict[str, float]

    def to_dict(self) -> dict:
        return asdict(self)

    def render(self) -> Group:
        summary = Table(title=f"calibration of {self.model}", show_header=False)
        summary.add_column(style="bold")
        summary.add_column(justify="right")
        d = self.draft
        rows = [
            ("answers (prompts / tokens / train tokens)", f"{self.prompts} / {self.tokens} / {self.train_tokens}"),
            ("draft vocabulary (held-out coverage)", f"{d.vocab} ({d.vocab_coverage:.2f})"),
            ("draft_recall@1 / @k / @k after an exit", f"{d.recall_at_1:.3f} / {d.recall_at_k:.3f} / {d.recall_at_k_after_exit:.3f}"),
            ("draft cost per token", f"{d.ms_per_token:.3f} ms ({d.cost_share:.1%} of a forward)"),
            ("offline layers", " ".join(map(str, self.offline_layers)) or "-"),
            ("expected avg_exit_layer (oracle)", f"{self.avg_exit_layer:.2f} ({self.oracle_avg_exit_layer:.2f})"),
            ("expected exit_rate / agreement", f"{self.exit_rate:.3f} / {self.agreement:.3f}"),
            ("predictor_calls_per_token / verify_fail_rate", f"{self.predictor_calls_per_token:.2f} / {self.verify_fail_rate:.3f}"),
            ("expected layer-only speedup (oracle bound)", f"{self.expected_layer_speedup:.3f}x ({self.oracle_layer_speedup:.3f}x)"),
            ("time (s)", ", ".join(f"{k} {v:.0f}" for k, v in self.seconds.items())),
        ]
        for label, value in rows:
            summary.add_row(label, value)
        layers = Table(title="predictors (held-out steps)")
        for column in ("layer", "positives", "threshold", "precision", "recall", "exits"):
            layers.add_column(column, justify="right")
        for r in self.layers:
            layers.add_row(str(r.layer), f"{r.positive_rate:.3f}", f"{r.threshold:.2f}", f"{r.precision:.3f}",
                           f"{r.recall:.3f}", str(self.exit_histogram.get(r.layer, 0)))
        return Group(summary, layers)
