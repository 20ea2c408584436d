"""The specee pack: one GGUF holding a model's predictors, draft head, schedule and provenance.

Metadata keys and tensor names are listed here once; docs/packs.md documents them as a table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specee_edge.errors import SpecEEError
from specee_edge.exits import ExitKind
from specee_edge.pack.mlp import MLPPredictor


class PackLevelError(SpecEEError):
    """A quality level the pack does not offer."""

PACK_ARCH = "specee-pack"  # general.architecture of every pack
FORMAT_VERSION = 3  # 3: an exit kind per layer and level; 2 (every exit verified) still reads; 1 must be recalibrated
OLDEST_VERSION = 2
FEATURES = ("logits", "probs", "delta")  # per candidate, in this order: 3k features

KEY_VERSION = "specee.version"
KEY_TARGET_ARCH = "specee.target.arch"
KEY_TARGET_N_LAYER = "specee.target.n_layer"
KEY_TARGET_N_EMBD = "specee.target.n_embd"
KEY_TARGET_N_VOCAB = "specee.target.n_vocab"
KEY_TARGET_FINGERPRINT = "specee.target.fingerprint"
KEY_K = "specee.k"
KEY_THRESHOLD = "specee.threshold"
KEY_FEATURES = "specee.features"
KEY_PREDICTOR_LAYERS = "specee.predictor.layers"
KEY_TEMPERATURES = "specee.predictor.temperatures"  # optional, per predictor layer: exit logits are divided by it
KEY_LEVELS = "specee.quality.levels"  # optional, ascending agreement targets; each has the keys of level_key()
KEY_DEFAULT_QUALITY = "specee.quality.default"  # one of the levels
LEVEL_FIELDS = ("thresholds", "kinds", "offline", "exit_rate", "agreement", "layer_speedup", "verify_fail_rate",
                "speedup", "head_free_rate", "steps", "identical", "identical_code",
                "max_draft", "draft_stop", "acceptance", "tokens_per_round", "verify_cost", "speedup_sampled",
                "speedup_low", "speedup_sampled_low", "agreement_low", "agreement_high")
# exact mode is the level of quality 1: its exits draft tokens that the full model then verifies in batches
EXACT_QUALITY = 1.0
MAX_DRAFT = 16  # drafts in one verification batch (the runtime keeps up to 64 rows for the next draft)
ROUND_MAX_DRAFTS = 8  # exact mode: the most drafts a round checks by default (llama.cpp's --draft-max); the plan picks how many
# whole answers: a level keeps at least this share of held-out greedy answers (to code prompts, for models
# that chat) identical to the full model's, or says that it does not (`chat` banner, `generate`, `info`)
IDENTICAL_FLOOR = 0.75
LEVEL_FIGURES = LEVEL_FIELDS[3:]  # floats measured when the level was chosen (format 2 has only the first four)
KEY_OFFLINE_LAYERS = "specee.schedule.offline"
KEY_WINDOW = "specee.schedule.window"
KEY_OFFSETS = "specee.schedule.offsets"
KEY_DRAFT_KIND = "specee.draft.kind"
KEY_LOOKUP_MAX_N = "specee.candidates.lookup_max_n"  # optional; 0 or missing: the draft head's candidates only
KEY_PROVENANCE = "specee.provenance"  # JSON object


def predictor_tensor(layer: int, j: int, part: str) -> str:
    """`pred.<layer>.fc<j>.weight|bias`: the j-th linear layer of that layer's predictor."""
    return f"pred.{layer}.fc{j}.{part}"


def level_key(index: int, name: str) -> str:
    """`specee.quality.<index>.<name>`: one field of the index-th level (names in LEVEL_FIELDS)."""
    return f"specee.quality.{index}.{name}"


DRAFT_PREFIX = "draft."
DRAFT_VOCAB_MAP = "draft.vocab_map"  # I32 [n_draft_vocab]: target token id of each draft output, if reduced


@dataclass(frozen=True)
class TargetIdentity:
    """What a pack is bound to: checked against the model before anything runs."""

    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    fingerprint: str
    # A model's identity also knows the fingerprint's legacy form (pack/target.py), to accept packs that
    # hold it. Not part of a pack and not compared: identities are equal when the current forms are.
    legacy_fingerprint: str | None = field(default=None, compare=False, repr=False)

    def accepts(self, pack_target: TargetIdentity) -> bool:
        """A pack made for this model: the same shape, and a fingerprint in the current or the legacy form."""
        shape = (self.arch, self.n_layer, self.n_embd, self.n_vocab)
        return (shape == (pack_target.arch, pack_target.n_layer, pack_target.n_embd, pack_target.n_vocab)
                and pack_target.fingerprint in (self.fingerprint, self.legacy_fingerprint))

    def describe(self) -> str:
        return f"{self.arch}, {self.n_layer} layers, n_embd {self.n_embd}, vocab {self.n_vocab}, fingerprint {self.fingerprint[:12]}"


@dataclass
class Schedule:
    """Offline layer set plus the online window: offsets around each of the last `window` exit layers."""

    offline: list[int]
    window: int = 5
    offsets: list[int] = field(default_factory=lambda: [-2, 0, 2])


@dataclass(frozen=True)
class LayerExit:
    """How a layer lets a token leave at a quality level: its exit kind, above which probability."""

    kind: ExitKind
    threshold: float

    @property
    def on(self) -> bool:
        return self.kind != ExitKind.NONE


OFF = LayerExit(ExitKind.NONE, 1.0)


@dataclass
class QualityLevel:
    """One setting of the quality dial: every predictor layer's exit (kind and threshold) and the offline
    schedule. Its promise, `quality` q: at each step, the token it emits is the one the full model would
    pick on the same text, in at least q of the steps. Calibration chose its exits on one set of prompts and
    measured it on others that played no other part; q is at most the low end of that agreement's 95%
    interval (a level that fell short was renamed after what it holds, or dropped)."""

    quality: float                 # the agreement promised
    exits: dict[int, LayerExit]    # per predictor layer; OFF: the layer never exits at this level
    offline: list[int]             # the offline schedule at this level
    exit_rate: float = 0.0         # expected, held out
    agreement: float = 1.0
    layer_speedup: float = 1.0     # n_layer / layers run, overheads excluded
    verify_fail_rate: float = 0.0  # of verified positive predictions
    speedup: float = 1.0           # predicted from the measured costs of its decisions, against plain decoding
    head_free_rate: float = 0.0    # tokens emitted from the candidates' logits
    steps: float = 0.0             # held-out steps behind agreement (0: not measured)
    identical: float = -1.0        # held-out greedy answers identical to the full model's (-1: not measured)
    identical_code: float = -1.0   # ... of code prompts
    # exact mode (quality 1): an exit is a draft; at most max_draft of them go to one verification batch
    max_draft: float = 0.0         # 0: a lossy level, whose exits are the answer
    draft_stop: float = 0.0        # a round stops drafting once the product of its drafts' confidences is below it
    acceptance: float = 0.0        # measured: drafted tokens the full model accepted
    tokens_per_round: float = 0.0  # measured: tokens emitted per verification batch
    verify_cost: float = 0.0       # measured: one verification batch against one plain token
    speedup_sampled: float = 0.0   # measured: exact mode's speed with chat's default sampling (speedup: greedy)
    speedup_low: float = 0.0       # measured: the low ends of the speed-ups' 95% intervals (bootstrapped over
    speedup_sampled_low: float = 0.0  # held-out prompts); calibration keeps the exits on only where one is above 1
    agreement_low: float = 0.0     # lossy levels: the held-out agreement's 95% interval, bootstrapped over
    agreement_high: float = 0.0    # prompts (0: a pack from before it was; agreement_interval then falls back)

    @property
    def exact(self) -> bool:
        """Exits draft and the full model checks them: the answers are the full model's own."""
        return self.max_draft > 0

    def drafts(self, greedy: bool) -> bool:
        """Calibration measured exact mode faster than plain decoding for this kind of decoding, beyond the noise of
        its measurement (sampling accepts fewer drafts than greedy decoding, so the two are measured apart). A record,
        not a switch: the engine's controller decides every round on the machine it runs on, by prompt lookup
        alone where every layer is off."""
        return self.exact and (self.speedup_low if greedy else self.speedup_sampled_low) > 1.0

    @property
    def thresholds(self) -> dict[int, float]:
        return {il: e.threshold for il, e in self.exits.items()}

    @property
    def whole_answers(self) -> float:
        """The share of held-out greedy answers identical to the full model's that the level is judged by:
        code answers where they were measured, else all (-1: not measured)."""
        return self.identical_code if self.identical_code >= 0 else self.identical

    @property
    def off(self) -> bool:
        """Every layer off: a lossy level decodes plainly; exact mode drafts by prompt lookup alone."""
        return not self.on_layers

    def agreement_interval(self, z: float = 1.96) -> tuple[float, float]:
        """The held-out agreement's 95% interval: bootstrapped over prompts where calibration stored it; for
        packs from before, Wilson's over steps, which takes a reply's steps as independent and is too narrow
        (the point itself if no steps were counted)."""
        if self.agreement_high > 0:
            return self.agreement_low, self.agreement_high
        n = self.steps
        if n <= 0:
            return self.agreement, self.agreement
        p = self.agreement
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return float(centre - half), float(min(centre + half, 1.0))

    @property
    def on_layers(self) -> list[int]:
        """The layers that can exit at this level, ascending."""
        return sorted(il for il, e in self.exits.items() if e.on)


def parse_quality(value: str | None) -> float | None:
    """--quality and /set quality: `exact`, or a lossy level's agreement with the full model in (0, 1); None or
    `default`: the pack's default. 1 is exact too (an agreement of 1 is what exact mode keeps)."""
    if value is None or value.strip().lower() == "default":
        return None
    if value.strip().lower() == "exact":
        return EXACT_QUALITY
    try:
        quality = float(value)
    except ValueError:
        raise SpecEEError(f"a quality is exact or an agreement with the full model such as 0.95 (or default), got {value!r}") from None
    if not 0.0 < quality <= 1.0:
        raise SpecEEError(f"a quality is an agreement with the full model, in (0, 1]: got {quality:g}")
    return quality


def quality_name(quality: float) -> str:
    """How a level is named: `exact`, or its agreement."""
    return "exact" if quality == EXACT_QUALITY else f"{quality:g}"


@dataclass
class DraftHead:
    """Draft-head weights by name (without the `draft.` prefix), dequantized to float32."""

    kind: str
    tensors: dict[str, np.ndarray]
    vocab_map: np.ndarray | None = None  # reduced vocabulary: target ids of the draft's outputs
    quant: str = "f32"  # how the pack stores its matrices (the runtime keeps them so): f32, f16, q8_0, q4_0


@dataclass
class Pack:
    target: TargetIdentity
    k: int
    threshold: float
    schedule: Schedule
    predictors: dict[int, MLPPredictor]
    draft: DraftHead | None = None
    provenance: dict = field(default_factory=dict)
    levels: list[QualityLevel] = field(default_factory=list)  # ascending quality; none: `threshold` and `schedule`
    default_quality: float | None = None                    # one of the levels' qualities
    temperatures: dict[int, float] = field(default_factory=dict)  # per predictor layer; missing: 1
    # prompt lookup's longest n-gram; its candidate takes the first slot (the predictors were trained so)
    lookup_max_n: int = 0

    def level(self, quality: float | None = None) -> QualityLevel | None:
        """The level for `quality`: the lowest level at or above it (never less quality than asked);
        None: the default level. A pack without levels has none."""
        if not self.levels:
            if quality is not None:
                raise PackLevelError("this pack has no quality levels (it was converted, not calibrated): use --threshold")
            return None
        if quality is None:
            quality = self.default_quality if self.default_quality is not None else self.levels[-1].quality
        for level in self.levels:
            if level.quality >= quality - 1e-9:
                return level
        offered = ", ".join(f"{lv.quality:g}" for lv in self.levels)
        raise PackLevelError(f"no quality level at or above {quality:g} in this pack (it offers {offered})")
