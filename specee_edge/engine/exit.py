"""The early-exit side of one token: draft candidates, probes, predictor, verification.

By default all of it runs inside llama_decode (the native policy): the pack's draft head proposes the
candidates at the start of the graph, each scheduled layer's predictor runs in C on the probe's
candidate logits, and a positive prediction is verified there (the layer's exit logits must put a
candidate first, otherwise the token keeps going). Python only loads the pack, sets the schedule and
thresholds, and reads one StepInfo per token.

The Python policy (`native=False`) makes the same decisions in `on_probe`, called by the runtime after
each scheduled layer: slower, for research on other exit rules.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specee_edge.draft import LinearDraft
from specee_edge.errors import SpecEEError
from specee_edge.pack import Pack, check_target, read_pack, target_identity
from specee_edge.predictor import MLPPredictor
from specee_edge.predictor.features import probe_features
from specee_edge.predictor.schedule import OnlineSchedule
from specee_edge.runtime import Context
from specee_edge.runtime.context import StepInfo
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
    native: bool = True
    candidates: tuple[int, ...] = field(default=(), init=False)  # the last step's, for the next token

    @classmethod
    def load(cls, pack_path: Path, model_path: Path, *, threshold: float | None = None,
             native: bool = True) -> ExitPolicy:
        pack = read_pack(pack_path)
        weights = TargetWeights(model_path)
        check_target(pack.target, target_identity(model_path, weights.reader), pack_path, model_path)
        if pack.draft is None:
            raise SpecEEError(f"{pack_path.name} has no draft head: the engine needs one to propose candidates")
        thresholds = {il: threshold if threshold is not None else pack.thresholds.get(il, pack.threshold)
                      for il in pack.predictors}
        return cls(pack, pack_path, LinearDraft(pack.draft, weights, pack.k), pack.predictors,
                   thresholds, OnlineSchedule(pack.schedule, set(pack.predictors)), native)

    @property
    def k(self) -> int:
        return self.pack.k

    def attach(self, ctx: Context) -> None:
        """Load the draft head (and, natively, the predictors) into the context's early-exit state."""
        self.ctx = ctx
        d = self.draft
        ctx.set_draft(w_embd=d.w_embd, w_hidden=d.w_hidden, bias=d.bias, norm=d.gamma, eps=d.eps, head=d.head,
                      vocab_map=d.vocab_map, quant=d.quant)
        if self.native:
            for layer, mlp in self.predictors.items():
                ctx.set_predictor(layer, mlp.weights, mlp.biases, self.thresholds[layer])
        self._probe_layers: list[int] | None = None

    def set_active(self, on: bool) -> None:
        """Off: no probe layers and no callback, so the context decodes like a plain one."""
        self.ctx.set_probe_callback(self.on_probe if on and not self.native else None)
        self.ctx.set_probe_layers([])
        self._probe_layers = []

    def set_threshold(self, threshold: float | None) -> None:
        """One threshold for every layer; None: the pack's own per-layer ones."""
        for layer in self.thresholds:
            self.thresholds[layer] = threshold if threshold is not None else self.pack.thresholds.get(layer, self.pack.threshold)
            if self.native:
                self.ctx.set_threshold(layer, self.thresholds[layer])

    # --- per token ---------------------------------------------------------------------------

    def begin_prompt(self, probes: bool = True) -> None:
        """A new prompt: the schedule starts over. Batches never stop, but with probe layers set their
        graph leaves the last hidden state where the first draft reads it."""
        self.schedule.reset()
        self.candidates = ()
        if probes:
            self._set_probe_layers()
        else:
            self.ctx.set_probe_layers([])
            self._probe_layers = []

    def begin_token(self) -> None:
        self._set_probe_layers()  # the schedule changes only after an exit
        self.probes = 0
        self.verify_failures = 0
        self.predictor_s = 0.0
        self.verify_s = 0.0
        self._prev_probs = None

    def end_token(self) -> StepInfo:
        """What the step did; the schedule learns where it left."""
        info = self.ctx.step_info()
        self.candidates = info.candidates
        self.schedule.record_exit(info.exit_layer)
        if not self.native:  # the Python policy counts and times its own work
            info = dataclasses.replace(info, probes=self.probes, verify_failures=self.verify_failures,
                                       predictor_ms=self.predictor_s * 1e3, verify_ms=self.verify_s * 1e3)
        return info

    def _set_probe_layers(self) -> None:
        layers = self.schedule.layers()
        if layers != self._probe_layers:
            self.ctx.set_probe_layers(layers)
            self._probe_layers = layers

    def on_probe(self, layer: int, cand_logits: np.ndarray) -> bool:
        """The Python policy after `layer`: True stops the token here (its exit logits become the step's)."""
        t0 = time.perf_counter()
        features, self._prev_probs = probe_features(cand_logits, self._prev_probs)
        self.probes += 1
        positive = self.predictors[layer](features) > self.thresholds[layer]
        t1 = time.perf_counter()
        self.predictor_s += t1 - t0
        if not positive:
            return False
        top1 = int(np.argmax(self.ctx.probe_logits()))
        hit = top1 in self.ctx.step_info().candidates
        self.verify_s += time.perf_counter() - t1
        self.verify_failures += not hit
        return hit
