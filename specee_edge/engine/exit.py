"""The early-exit side of one token: draft candidates, probes, predictor, verification.

The runtime calls `on_probe` after each scheduled layer with the candidates' logits. A positive
prediction is verified on the spot: the layer's full exit logits must put one of the candidates
first, otherwise the token keeps going (so a stopped token never needs a resume).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specee_edge.draft import LinearDraft
from specee_edge.errors import SpecEEError
from specee_edge.pack import Pack, check_target, read_pack, target_identity
from specee_edge.predictor import MLPPredictor
from specee_edge.predictor.features import probe_features
from specee_edge.predictor.schedule import OnlineSchedule
from specee_edge.runtime import Context
from specee_edge.runtime.weights import TargetWeights
from specee_edge.shipped import shipped_dir

SHIPPED_PACKS = shipped_dir()
PACK_SUFFIX = ".specee.gguf"


def find_pack(model_path: Path) -> Path | None:
    """MODEL.specee.gguf beside the model, else a pack of that name shipped in models/."""
    name = Path(model_path).name.removesuffix(".gguf") + PACK_SUFFIX
    for candidate in (Path(model_path).with_name(name), SHIPPED_PACKS / name):
        if candidate.is_file():
            return candidate
    return None


@dataclass
class ExitPolicy:
    pack: Pack
    pack_path: Path
    draft: LinearDraft
    predictors: dict[int, MLPPredictor]
    thresholds: dict[int, float]
    schedule: OnlineSchedule

    @classmethod
    def load(cls, pack_path: Path, model_path: Path, *, threshold: float | None = None) -> ExitPolicy:
        pack = read_pack(pack_path)
        weights = TargetWeights(model_path)
        check_target(pack.target, target_identity(model_path, weights.reader), pack_path, model_path)
        if pack.draft is None:
            raise SpecEEError(f"{pack_path.name} has no draft head: the engine needs one to propose candidates")
        thresholds = {il: threshold if threshold is not None else pack.thresholds.get(il, pack.threshold)
                      for il in pack.predictors}
        return cls(pack, pack_path, LinearDraft(pack.draft, weights, pack.k), pack.predictors,
                   thresholds, OnlineSchedule(pack.schedule, set(pack.predictors)))

    @property
    def k(self) -> int:
        return self.pack.k

    def attach(self, ctx: Context) -> None:
        self.ctx = ctx
        self.last_layer = ctx.model.info.n_layer - 1
        self.candidates = np.zeros(self.k, dtype=np.int64)
        self._probe_layers: list[int] | None = None

    def set_active(self, on: bool) -> None:
        """Off: no probe calls into Python and no captures, so the context decodes like a plain one."""
        self.ctx.set_probe_callback(self.on_probe if on else None)
        self.ctx.set_capture_layers([])
        self._probe_layers = None

    # --- per token ---------------------------------------------------------------------------

    def begin_prompt(self) -> None:
        """Prompt batches never stop; only the last layer is captured, for the first draft."""
        self.ctx.set_capture_layers([self.last_layer])
        self._probe_layers = None

    def begin_token(self, candidates: np.ndarray) -> None:
        self.candidates = candidates
        self.ctx.set_candidates(candidates.tolist())
        layers = self.schedule.layers()
        if layers != self._probe_layers:  # the schedule changes only after an exit
            self.ctx.set_probe_layers(layers)
            self.ctx.set_capture_layers([*layers, self.last_layer])
            self._probe_layers = layers
        self._prev_probs = None
        self.probes = 0
        self.verify_failures = 0
        self.predictor_s = 0.0
        self.verify_s = 0.0

    def on_probe(self, layer: int, cand_logits: np.ndarray) -> bool:
        """After `layer`: True stops the token here (its exit logits become the step's logits)."""
        t0 = time.perf_counter()
        features, self._prev_probs = probe_features(cand_logits, self._prev_probs)
        self.probes += 1
        positive = self.predictors[layer](features) > self.thresholds[layer]
        t1 = time.perf_counter()
        self.predictor_s += t1 - t0
        if not positive:
            return False
        top1 = int(np.argmax(self.ctx.probe_logits()))
        self.verify_s += time.perf_counter() - t1
        if top1 in self.candidates:
            return True
        self.verify_failures += 1
        return False

    def hidden_after(self, exit_layer: int | None) -> np.ndarray:
        """The last position's hidden state at the layer it left (the draft's input for the next token)."""
        return self.ctx.captured(self.last_layer if exit_layer is None else exit_layer)[-1]
