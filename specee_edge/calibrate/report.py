"""The calibration report: printed as rich tables and stored in the pack's provenance."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from rich.console import Group
from rich.table import Table

from specee_edge.calibrate.draft_fit import DraftReport
from specee_edge.calibrate.levels import LevelChoice


@dataclass
class LayerReport:
    layer: int
    positive_rate: float  # share of held-out steps whose label is 1
    threshold: float      # at the default level
    precision: float      # of the predictor alone at that threshold, on held-out steps
    recall: float
    temperature: float


@dataclass
class LevelReport:
    """One quality level: the engine's own run on held-out calibration answers (its KV mode's
    approximate K/V after exits included), and the decisions alone on the test split with K/V exact."""

    quality: float
    active_layers: list[int]  # threshold below 1
    offline_layers: list[int]
    avg_exit_layer: float     # the engine's
    exit_rate: float          # the engine's
    agreement: float          # the engine's, against the full model on the same prefix
    exact_agreement: float    # K/V exact (test split): the exits' own errors
    predictor_calls_per_token: float
    verify_fail_rate: float
    layer_speedup: float      # n_layer / mean layers run, overheads excluded
    # of the failed verifications, the share whose exit top-1 is in the draft vocabulary: a pre-check
    # scoring only those rows of the LM head would have rejected them (a lower bound); None: no failures
    precheck_catch: float | None
    exit_histogram: dict[int, int]  # test split, K/V exact

    @classmethod
    def of(cls, choice: LevelChoice, n_layer: int, top1: np.ndarray, draft_vocab: set[int] | None) -> LevelReport:
        level, sim, engine = choice.level, choice.heldout, choice.engine
        caught = [draft_vocab is None or int(top1[row, il]) in draft_vocab for row, il in sim.rejected]
        return cls(level.quality, [il for il, t in level.thresholds.items() if t < 1.0], level.offline,
                   engine.avg_exit_layer if engine else sim.avg_exit_layer(n_layer), level.exit_rate, level.agreement,
                   sim.agreement, sim.predictor_calls_per_token, level.verify_fail_rate, level.layer_speedup,
                   float(np.mean(caught)) if caught else None,
                   {int(k): int(v) for k, v in sorted(sim.layer_hits.items())})


@dataclass
class CalibrationReport:
    model: str
    n_layer: int
    prompts: int
    answers: int
    tokens: int
    train_tokens: int
    draft: DraftReport
    layers: list[LayerReport]
    levels: list[LevelReport]
    default_quality: float
    oracle_avg_exit_layer: float
    oracle_layer_speedup: float
    nll_raw: float          # held-out cross-entropy of exits against the full model's distribution
    nll_temperature: float  # the same with the fitted temperatures
    seconds: dict[str, float]

    def to_dict(self) -> dict:
        return asdict(self)

    def render(self) -> Group:
        summary = Table(title=f"calibration of {self.model}", show_header=False)
        summary.add_column(style="bold")
        summary.add_column(justify="right")
        d = self.draft
        rows = [
            ("prompts / answers / steps / train steps", f"{self.prompts} / {self.answers} / {self.tokens} / {self.train_tokens}"),
            ("draft vocabulary (held-out coverage)", f"{d.vocab} ({d.vocab_coverage:.2f})"),
            ("draft_recall@1 / @k / @k after an exit", f"{d.recall_at_1:.3f} / {d.recall_at_k:.3f} / {d.recall_at_k_after_exit:.3f}"),
            ("recall@k with prompt lookup", f"{d.recall_at_k_merged:.3f}"),
            ("draft cost per token", f"{d.ms_per_token:.3f} ms ({d.cost_share:.1%} of a forward)"),
            ("oracle avg_exit_layer (layer-only speedup)", f"{self.oracle_avg_exit_layer:.2f} ({self.oracle_layer_speedup:.3f}x)"),
            ("exit cross-entropy, raw / with temperatures", f"{self.nll_raw:.3f} / {self.nll_temperature:.3f}"),
            ("time (s)", ", ".join(f"{k} {v:.0f}" for k, v in self.seconds.items())),
        ]
        for label, value in rows:
            summary.add_row(label, value)
        levels = Table(title="quality levels (the engine on held-out answers; exact: K/V exact, the exits' own errors)")
        for column in ("quality", "agreement", "exact", "exit_rate", "avg_exit_layer", "layer speedup",
                       "verify_fail_rate", "pre-check catch", "checks/token", "active layers", "offline"):
            levels.add_column(column, justify="right")
        for r in self.levels:
            mark = " (default)" if r.quality == self.default_quality else ""
            levels.add_row(f"{r.quality:g}{mark}", f"{r.agreement:.4f}", f"{r.exact_agreement:.4f}", f"{r.exit_rate:.3f}", f"{r.avg_exit_layer:.2f}",
                           f"{r.layer_speedup:.3f}x", f"{r.verify_fail_rate:.3f}", f"{r.precheck_catch:.2f}" if r.precheck_catch is not None else "-",
                           f"{r.predictor_calls_per_token:.2f}",
                           str(len(r.active_layers)), " ".join(map(str, r.offline_layers)) or "-")
        layers = Table(title=f"predictors (held-out steps; thresholds at quality {self.default_quality:g})")
        for column in ("layer", "positives", "threshold", "precision", "recall", "temperature"):
            layers.add_column(column, justify="right")
        for r in self.layers:
            layers.add_row(str(r.layer), f"{r.positive_rate:.3f}", f"{r.threshold:.2f}", f"{r.precision:.3f}",
                           f"{r.recall:.3f}", f"{r.temperature:.3f}")
        sources = Table(title="candidate recall by prompt category (held-out steps)")
        for column in ("category", "steps", "draft vocab coverage", "draft head", "prompt lookup", "merged"):
            sources.add_column(column, justify="right")
        for name, r in d.by_category.items():
            sources.add_row(name, str(r.steps), f"{r.vocab_coverage:.3f}", f"{r.draft:.3f}", f"{r.lookup:.3f}", f"{r.merged:.3f}")
        return Group(summary, sources, levels, layers)
