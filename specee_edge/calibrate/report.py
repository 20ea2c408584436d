"""The calibration report: printed as rich tables (they fit 80 columns) and stored in the pack's provenance."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rich.console import Group
from rich.table import Table

from specee_edge.calibrate.draft_fit import DraftReport
from specee_edge.calibrate.exact import ExactReport
from specee_edge.calibrate.levels import LevelChoice
from specee_edge.exits import ExitKind
from specee_edge.pack.format import QualityLevel
from specee_edge.runtime.costs import split_text


@dataclass
class LayerReport:
    layer: int
    positive_rate: float  # share of held-out steps whose label is 1 (the candidates' argmax is the full model's token)
    kind: str             # its exit at the default level
    threshold: float
    precision: float      # of the predictor alone at that threshold, on held-out steps
    recall: float
    temperature: float


@dataclass
class LevelReport:
    """One quality level: the engine on held-out prompts (its KV mode's approximate K/V after exits
    included), and on the calibration split the decisions alone with K/V exact."""

    asked: float              # the agreement its exits were chosen for
    quality: float            # the name it ships under (0: dropped, its held-out figures fell short)
    verified_layers: list[int]
    head_free_layers: list[int]
    offline_layers: list[int]
    agreement: float          # the engine's on held-out prompts, against the full model on the same prefix
    agreement_low: float      # 95% interval, bootstrapped over the held-out prompts
    agreement_high: float
    steps: int
    calibration_speedup: float  # predicted on the calibration split, and the low end of its 95% interval:
    calibration_speedup_low: float  # the level's layers are on only where it is above 1
    exact_agreement: float    # calibration split, K/V exact: the exits' own errors
    exit_rate: float
    head_free_rate: float
    layer_speedup: float      # n_layer / mean layers run, overheads excluded
    speedup: float            # predicted from the measured costs of the engine's decisions
    verify_fail_rate: float
    identical: float          # held-out greedy answers identical to the full model's (-1: not measured)
    identical_code: float
    predictor_calls_per_token: float
    exit_histogram: dict[int, int]  # calibration split, K/V exact

    @classmethod
    def of(cls, choice: LevelChoice, level: QualityLevel, shipped: QualityLevel | None, n_layer: int) -> LevelReport:
        """level: as measured on held-out prompts; shipped: as it ships (None: dropped)."""
        sim = choice.simulated
        low, high = level.agreement_interval()
        of_kind = lambda kind: [il for il in level.on_layers if level.exits[il].kind == kind]  # noqa: E731
        calib = choice.engine
        return cls(choice.level.quality, shipped.quality if shipped else 0.0, of_kind(ExitKind.VERIFIED),
                   of_kind(ExitKind.HEAD_FREE), level.offline, level.agreement, low, high, int(level.steps),
                   calib.speedup if calib else 1.0, calib.speedup_low if calib else 1.0,
                   sim.agreement, level.exit_rate, level.head_free_rate,
                   level.layer_speedup, level.speedup, level.verify_fail_rate, level.identical, level.identical_code,
                   sim.predictor_calls_per_token, {int(k): int(v) for k, v in sorted(sim.layer_hits.items())})


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
    costs: dict               # runtime/costs.py TokenCosts, ms
    oracle_avg_exit_layer: float
    oracle_layer_speedup: float
    nll_raw: float          # held-out cross-entropy of exits against the full model's distribution
    nll_temperature: float  # the same with the fitted temperatures
    seconds: dict[str, float]
    exact: ExactReport | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def render(self) -> Group:
        summary = Table(title=f"calibration of {self.model}", show_header=False)
        summary.add_column(style="bold")
        summary.add_column(justify="right")
        d, c = self.draft, self.costs
        plain = c["plain_ms"]
        rows = [
            ("prompts / answers", f"{self.prompts} / {self.answers}"),
            ("steps / train steps", f"{self.tokens} / {self.train_tokens}"),
            ("draft vocabulary (coverage)", f"{d.vocab} ({d.vocab_coverage:.2f})"),
            ("recall@1 / @k / after an exit", f"{d.recall_at_1:.3f} / {d.recall_at_k:.3f} / {d.recall_at_k_after_exit:.3f}"),
            ("recall@k with prompt lookup", f"{d.recall_at_k_merged:.3f}"),
            *([("where the layers ran", c["placement"])] if c.get("placement") else []),
            ("a token, plain decoding", f"{plain:.2f} ms"),
            ("a layer / its depth mask / the LM head",
             f"{c['layer_ms']:.3f} / {c.get('mask_ms', 0.0):.3f} / {c['head_ms']:.3f} ms"),
            *([("past the split", split_text(c))] if c.get("split") is not None else []),
            ("the draft (in the graph)", f"{c['draft_ms']:.3f} ms ({c['draft_ms'] / plain:.1%})"),
            ("a check / a stop / a fill", f"{c['check_ms'] * 1e3:.0f} / {c['stop_ms'] * 1e3:.0f} / {c['fill_ms'] * 1e3:.0f} us"),
            ("oracle exit layer (layers)", f"{self.oracle_avg_exit_layer:.2f} ({self.oracle_layer_speedup:.3f}x)"),
            ("exit cross-entropy, T = 1 / fit", f"{self.nll_raw:.3f} / {self.nll_temperature:.3f}"),
            ("time (s)", ", ".join(f"{k} {v:.0f}" for k, v in self.seconds.items())),
        ]
        for label, value in rows:
            summary.add_row(label, value)

        levels = Table(title="quality levels: the engine on held-out prompts",
                       caption="a level ships under the agreement the low end of its interval reaches")
        for column in ("asked", "ships as", "agreement (95%)", "exit", "speed", "identical (code)"):
            levels.add_column(column, justify="right")
        layers_on = Table(title="quality levels: layers on, and the calibration split's figures that decided it",
                          caption="speed: predicted, with the low end of its 95% interval (on only above 1)")
        for column in ("quality", "verified", "head-free", "exact", "checks", "speed (low)"):
            layers_on.add_column(column, justify="right")
        for r in self.levels:
            mark = "*" if r.quality == self.default_quality else ""
            identical = "-" if r.identical < 0 else f"{r.identical:.2f}" + ("" if r.identical_code < 0 else f" ({r.identical_code:.2f})")
            ships = "dropped" if not r.quality else f"{r.quality:g}{mark}"
            levels.add_row(f"{r.asked:g}", ships, f"{r.agreement:.3f} ({r.agreement_low:.3f}-{r.agreement_high:.3f})",
                           f"{r.exit_rate:.2f}", f"{r.speedup:.3f}x", identical)
            layers_on.add_row(ships, _span(r.verified_layers), _span(r.head_free_layers),
                              f"{r.exact_agreement:.3f}", f"{r.predictor_calls_per_token:.1f}",
                              f"{r.calibration_speedup:.2f}x ({r.calibration_speedup_low:.2f})")
        layers = Table(title=f"predictors (held-out steps; exits at quality {self.default_quality:g})")
        for column in ("layer", "positives", "exit", "threshold", "precision", "recall", "T"):
            layers.add_column(column, justify="right")
        for r in self.layers:
            layers.add_row(str(r.layer), f"{r.positive_rate:.3f}", r.kind, f"{r.threshold:.2f}", f"{r.precision:.3f}",
                           f"{r.recall:.3f}", f"{r.temperature:.2f}")
        sources = Table(title="candidate recall by prompt category")
        for column in ("category", "steps", "vocab", "draft", "lookup", "merged"):
            sources.add_column(column, justify="right")
        for name, r in d.by_category.items():
            sources.add_row(name, str(r.steps), f"{r.vocab_coverage:.3f}", f"{r.draft:.3f}", f"{r.lookup:.3f}", f"{r.merged:.3f}")
        return Group(summary, sources, levels, layers_on, layers, *([self.exact.render()] if self.exact else []))


def _span(layers: list[int]) -> str:
    """`12-15, 20` for [12, 13, 14, 15, 20]; `-` for none."""
    if not layers:
        return "-"
    runs = [[layers[0]]]
    for il in layers[1:]:
        if il == runs[-1][-1] + 1:
            runs[-1].append(il)
        else:
            runs.append([il])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
