"""The early-exit side of one token: draft candidates, probes, predictor, verification.

By default all of it runs inside llama_decode (the native policy): the pack's draft head proposes the
candidates at the start of the graph, each scheduled layer's predictor runs in C on the probe's
candidate logits, and a positive prediction leaves as the layer's exit says: head-free at once, with
the candidates' logits, or verified (the layer's exit logits must put a candidate first, otherwise the
token keeps going). Python only loads the pack, sets the schedule and the exits, and reads one StepInfo
per token.

The Python policy (`native=False`) makes the same decisions in `on_probe` through the same exit rule
(predictor/rule.py), called by the runtime after each scheduled layer: slower, for research on other
exit rules.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specee_edge.draft import LinearDraft
from specee_edge.errors import SpecEEError
from specee_edge.exits import ExitKind
from specee_edge.pack import Pack, QualityLevel, check_target, read_pack, target_identity
from specee_edge.pack.format import OFF, LayerExit
from specee_edge.pack.locate import SHIPPED_PACKS, find_pack  # noqa: F401  (where the engine and its tests import them)
from specee_edge.predictor import MLPPredictor
from specee_edge.predictor.rule import Outcome, TokenChecks
from specee_edge.predictor.schedule import OnlineSchedule
from specee_edge.runtime import Context
from specee_edge.runtime.context import StepInfo
from specee_edge.runtime.weights import TargetWeights

NO_EXIT = 2.0  # a threshold no predictor's probability exceeds


@dataclass
class ExitPolicy:
    pack: Pack
    pack_path: Path
    draft: LinearDraft
    predictors: dict[int, MLPPredictor]
    level: QualityLevel | None  # the quality level in use (None: a pack without levels)
    threshold: float | None     # one threshold for every layer, overriding the level's
    native: bool = True
    candidates: tuple[int, ...] = field(default=(), init=False)  # the last step's, for the next token
    lookup: int | None = field(default=None, init=False)  # the last step's prompt-lookup candidate (its first slot)
    held: bool = field(default=False, init=False)  # exits impossible for now (an exit guard withholds them)
    ctx: Context | None = field(default=None, init=False)

    @classmethod
    def load(cls, pack_path: Path, model_path: Path, *, quality: float | None = None, threshold: float | None = None,
             native: bool = True, eog_tokens: Sequence[int] = ()) -> ExitPolicy:
        """eog_tokens: the model's end-of-generation tokens, which the draft vocabulary must hold (a head-free
        exit chooses among the draft's candidates: without them it could never end a reply)."""
        pack = read_pack(pack_path)
        weights = TargetWeights(model_path)
        check_target(pack.target, target_identity(model_path, weights.reader), pack_path, model_path)
        if pack.draft is None:
            raise SpecEEError(f"{pack_path.name} has no draft head: the engine needs one to propose candidates")
        if missing := sorted(set(eog_tokens) - set(pack.draft.vocab_map.tolist())):
            raise SpecEEError(f"{pack_path.name}: its draft vocabulary lacks the model's end-of-generation tokens"
                              f" {missing}, so a head-free exit could never end a reply; calibrate the pack again")
        policy = cls(pack, pack_path, LinearDraft(pack.draft, weights, pack.k), pack.predictors,
                     pack.level(quality), threshold, native)
        policy._configure()
        return policy

    def _configure(self) -> None:
        """Exits and schedule from the level (or the overriding threshold); the context follows."""
        level = self.level
        if self.threshold is not None:
            self.exits = {il: LayerExit(self._override_kind(il), self.threshold) for il in self.predictors}
        elif level is not None:
            self.exits = dict(level.exits)
        else:
            self.exits = {il: LayerExit(self._override_kind(il), self.pack.threshold) for il in self.predictors}
        if level is not None and self.threshold is None:
            offline = level.offline
        else:  # one threshold everywhere: every layer any level checks from the start (every predictor's where
            # none does, as in a pack whose levels calibration all turned off)
            offline = sorted({il for lv in self.pack.levels for il in lv.offline} | set(self.pack.schedule.offline)
                             or set(self.predictors))
        schedule = dataclasses.replace(self.pack.schedule, offline=offline)
        # a level turns a layer off (its exit NONE): the schedule never checks it. An explicit threshold
        # keeps every layer on (above 1 that measures the machinery with exits impossible).
        self.schedule = OnlineSchedule(schedule, {il for il, e in self.exits.items() if e.on})
        self._probe_layers: list[int] | None = None  # what the context holds; None: set it at the next token
        self.held = False
        if self.ctx is not None and self.native:
            self._set_exits()

    def _set_exits(self) -> None:
        for layer, exit in self.exits.items():
            self.ctx.set_exit(layer, exit.kind, NO_EXIT if self.held and exit.on else exit.threshold)

    def hold(self, held: bool) -> None:
        """Held: no token may exit, though the draft and the probes still run (the next token's candidates are
        drafted from this one's last hidden state as usual); released: the level's exits again."""
        if held != self.held:
            self.held = held
            if self.native:
                self._set_exits()

    def _override_kind(self, layer: int) -> ExitKind:
        """A layer's kind under --threshold: the default level's where it has one on, else verified (the
        last layer, whose exit head is the output head, head-free)."""
        default = self.pack.level()
        if default is not None and default.exits.get(layer, OFF).on:
            return default.exits[layer].kind
        return ExitKind.HEAD_FREE if layer == self.pack.target.n_layer - 1 else ExitKind.VERIFIED

    @property
    def idle(self) -> bool:
        """No layer can ever be checked (a level that turns every layer off): tokens decode plainly."""
        return not self.schedule.predictor_layers

    @property
    def max_draft(self) -> int:
        """Exact mode's longest round of drafts (0: the level's exits are the answer)."""
        return int(self.level.max_draft) if self.level is not None and self.threshold is None else 0

    @property
    def draft_stop(self) -> float:
        """Exact mode: a round stops drafting once the product of its drafts' confidences falls below this."""
        return self.level.draft_stop if self.max_draft else 0.0

    @property
    def quality(self) -> float | None:
        return self.level.quality if self.level is not None else None

    def temperature(self, layer: int | None) -> float:
        """The exit logits of `layer` are divided by it (1 for the last layer and uncalibrated packs)."""
        return self.pack.temperatures.get(layer, 1.0) if layer is not None else 1.0

    @property
    def k(self) -> int:
        return self.pack.k

    def attach(self, ctx: Context) -> None:
        """Load the draft head (and, natively, the predictors) into the context's early-exit state."""
        self.ctx = ctx
        ctx.set_draft(**self.draft.runtime_args())
        if self.native:
            for layer, mlp in self.predictors.items():
                ctx.set_predictor(layer, mlp.weights, mlp.biases)
            self._set_exits()

    def set_active(self, on: bool) -> None:
        """Off: no probe layers and no callback, so the context decodes like a plain one."""
        self.ctx.set_probe_callback(self.on_probe if on and not self.native else None)
        self.ctx.set_probe_layers([])
        self._probe_layers = []

    def set_threshold(self, threshold: float | None) -> None:
        """One threshold for every layer; None: the quality level's own per-layer ones."""
        self.threshold = threshold
        self._configure()

    def set_quality(self, quality: float | None) -> None:
        """Another quality level (None: the pack's default); drops a --threshold override."""
        self.set_level(self.pack.level(quality))

    def set_level(self, level: QualityLevel | None) -> None:
        """Thresholds and offline schedule from `level`, which need not be one of the pack's (calibration
        tries candidates this way); drops a --threshold override."""
        self.level = level
        self.threshold = None
        self._configure()

    # --- per token ---------------------------------------------------------------------------

    def begin_prompt(self, probes: bool = True) -> None:
        """A new prompt: the schedule starts over. Batches never stop, but with probe layers set their
        graph leaves the last hidden state where the first draft reads it."""
        self.schedule.reset()
        self.candidates = ()
        self.lookup = None
        if probes:
            self._set_probe_layers()
        else:
            self.ctx.set_probe_layers([])
            self._probe_layers = []

    def begin_full_token(self) -> None:
        """A token that runs every layer whatever its predictors say (exact mode with no room for a batch): no
        probe layers, so its graph is the stock one; the next begin_token sets them again."""
        if self._probe_layers != []:
            self.ctx.set_probe_layers([])
            self._probe_layers = []
        self.lookup = None

    def begin_verify(self) -> bool:
        """Exact mode's verification batch: with probe layers set, its graph keeps the draft head, which keeps
        every output row's hidden state for the next draft (batches never stop). Returns whether it does: with
        no layer to check right now (a level whose offline set is empty) the graph has no draft head."""
        self._set_probe_layers()
        return bool(self._probe_layers)

    def begin_token(self, lookup: int | None = None) -> None:
        """`lookup`: the prompt-lookup candidate for this step (None: the draft head fills every slot)."""
        self._set_probe_layers()  # the schedule changes only after an exit
        self.lookup = lookup
        self.ctx.set_lookup([] if lookup is None else [lookup])
        self.verify_failures = 0
        self.predictor_s = 0.0
        self.verify_s = 0.0
        self._checks = TokenChecks()

    def end_token(self) -> StepInfo:
        """What the step did; the schedule learns where it left."""
        info = self.ctx.step_info()
        self.candidates = info.candidates
        self.schedule.record_exit(info.exit_layer)
        if not self.native:  # the Python policy counts and times its own work
            info = dataclasses.replace(info, probes=self._checks.probes, verify_failures=self.verify_failures,
                                       predictor_ms=self.predictor_s * 1e3, verify_ms=self.verify_s * 1e3)
        return info

    def _set_probe_layers(self) -> None:
        layers = self.schedule.layers()
        if layers != self._probe_layers:
            self.ctx.set_probe_layers(layers)
            self._probe_layers = layers

    def on_probe(self, layer: int, cand_logits: np.ndarray) -> ExitKind:
        """The Python policy after `layer`: how the token leaves here (NONE: it goes on)."""
        t0 = time.perf_counter()
        outcome, _ = self._checks.check(cand_logits, self.predictors[layer], self.exits[layer])
        t1 = time.perf_counter()
        self.predictor_s += t1 - t0
        if outcome == Outcome.GO_ON or self.held:
            return ExitKind.NONE
        if outcome == Outcome.HEAD_FREE:
            return ExitKind.HEAD_FREE
        try:
            hit = int(np.argmax(self.ctx.probe_logits())) in self.ctx.step_info().candidates
        except SpecEEError:  # no memory for the exit head: no exit
            hit = False
        self.verify_s += time.perf_counter() - t1
        self.verify_failures += not hit
        return ExitKind.VERIFIED if hit else ExitKind.NONE
