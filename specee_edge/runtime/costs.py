"""What the parts of a token cost on this machine, measured with the runtime itself.

Lanes decode the same tokens one at a time, in turns (a change in machine speed hits all of them
alike); each forces a known mix of parts, and the parts follow from differences of their mean times
(n layers; stops after layer l at a quarter, half and three quarters of the depth):

    plain            F + n L + H                  our context, early exit off
    checked_one      F + n L + H + D + C          the draft and one native check that never fires
    checked_all      F + n L + H + D + n C        ... a check after every layer
    stop_free(l)     F + (l+1) L + S              a head-free stop after layer l (mask mode)
    stop_head(l)     F + (l+1) L + S + H          the same stop paying the exit head
    stop_fill(l)     stop_free(l) + (n-1-l) K     a head-free stop in fill mode

F is what every token pays whatever it does, L a layer, H the full-vocabulary LM head, D the in-graph
draft, C one check (probe, read-back, predictor), S a stop, K rebuilding one skipped layer's K/V.
Calibration prices its decisions with these (TokenCosts.token_ms) and stores them in the pack; the
bench measures them in its own run for the oracles.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from specee_edge.exits import ExitKind
from specee_edge.runtime.context import Context
from specee_edge.runtime.model import Model

STOP_FRACTIONS = (0.25, 0.5, 0.75)


@dataclass
class Timing:
    steps: int = 0
    seconds: float = 0.0
    by_prompt: list[list[float]] = field(default_factory=list)  # [steps, seconds] of each prompt begun

    def begin_prompt(self) -> None:
        self.by_prompt.append([0, 0.0])

    def add(self, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        if self.by_prompt:
            self.by_prompt[-1][0] += 1
            self.by_prompt[-1][1] += seconds

    def tok_s_on(self, prompts: Sequence[int]) -> float:
        """Tokens per second over the given prompts (indices in the order they were begun)."""
        steps = sum(self.by_prompt[i][0] for i in prompts)
        seconds = sum(self.by_prompt[i][1] for i in prompts)
        return steps / seconds if seconds else 0.0

    @property
    def ms(self) -> float:
        return self.seconds / self.steps * 1e3 if self.steps else 0.0

    @property
    def tok_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0


@dataclass
class DraftSetup:
    """What the checked lanes load: the pack's draft head (Context.set_draft's arguments) and one
    predictor (weights and biases, as Context.set_predictor takes them)."""

    draft: dict
    predictor: tuple[list[np.ndarray], list[np.ndarray]]


@dataclass
class CostLane:
    """One context decoding the fed tokens one at a time (the forced parts: its name)."""

    name: str
    ctx: Context
    layers_run: int
    timing: Timing = field(default_factory=Timing)

    def start(self, prompt: Sequence[int]) -> None:
        self.ctx.clear()
        self.ctx.decode(list(prompt))

    def step(self, token: int) -> None:
        start = time.perf_counter()
        self.ctx.decode([token])
        self.timing.add(time.perf_counter() - start)


def stop_layers(n_layer: int) -> list[int]:
    return sorted({max(0, round(n_layer * f) - 1) for f in STOP_FRACTIONS})


def cost_lanes(model: Model, setup: DraftSetup, *, n_ctx: int, n_threads: int, k: int) -> list[CostLane]:
    """The lanes of the module docstring, on fresh contexts."""
    n_layer = model.info.n_layer

    def context(kv_mode: str | None) -> Context:
        ctx = Context(model, n_ctx=n_ctx, n_threads=n_threads)
        if kv_mode:
            ctx.enable_early_exit(k, kv_mode)
        return ctx

    def checked(layers: list[int]) -> Context:
        ctx = context("mask")
        ctx.set_draft(**setup.draft)
        weights, biases = setup.predictor
        for il in layers:
            ctx.set_predictor(il, weights, biases)
            ctx.set_exit(il, ExitKind.HEAD_FREE, 1.0)  # a sigmoid never exceeds 1: checked, never fired
        ctx.set_probe_layers(layers)
        return ctx

    def stopping(layer: int, kind: ExitKind, kv_mode: str) -> Context:
        ctx = context(kv_mode)
        ctx.set_candidates(list(range(k)))
        ctx.set_probe_layers([layer])
        ctx.set_probe_callback(lambda il, cand_logits: kind)
        return ctx

    lanes = [CostLane("plain", context(None), n_layer),
             CostLane("checked_one", checked([n_layer - 1]), n_layer),
             CostLane("checked_all", checked(list(range(n_layer))), n_layer)]
    for layer in stop_layers(n_layer):
        lanes += [CostLane(f"stop_free@{layer}", stopping(layer, ExitKind.HEAD_FREE, "mask"), layer + 1),
                  CostLane(f"stop_head@{layer}", stopping(layer, ExitKind.VERIFIED, "mask"), layer + 1),
                  CostLane(f"stop_fill@{layer}", stopping(layer, ExitKind.HEAD_FREE, "fill"), layer + 1)]
    return lanes


@dataclass(frozen=True)
class TokenCosts:
    """Milliseconds per part of a token (see the module docstring)."""

    n_layer: int
    fixed_ms: float
    layer_ms: float
    head_ms: float
    draft_ms: float
    check_ms: float
    stop_ms: float
    fill_ms: float  # per skipped layer

    @classmethod
    def fit(cls, lanes: Sequence[CostLane]) -> TokenCosts:
        ms = {lane.name: lane.timing.ms for lane in lanes}
        n = next(lane.layers_run for lane in lanes if lane.name == "plain")
        layers = stop_layers(n)
        free = np.array([ms[f"stop_free@{il}"] for il in layers])
        slope, intercept = np.polyfit(np.array(layers) + 1, free, 1)  # intercept: F + S
        layer = max(float(slope), 0.0)
        head = max(float(np.mean([ms[f"stop_head@{il}"] for il in layers]) - free.mean()), 0.0)
        fixed = ms["plain"] - n * layer - head
        check = max((ms["checked_all"] - ms["checked_one"]) / (n - 1), 0.0)
        draft = max(ms["checked_one"] - ms["plain"] - check, 0.0)
        fill = max(float(np.mean([(ms[f"stop_fill@{il}"] - ms[f"stop_free@{il}"]) / (n - 1 - il) for il in layers])), 0.0)
        # each part is clipped at 0: on a tiny model (or a busy machine) a difference can fall below it
        return cls(n, max(fixed, 0.0), layer, head, draft, check, max(float(intercept) - fixed, 0.0), fill)

    @property
    def plain_ms(self) -> float:
        """A token that runs every layer and the output head, with early exit off."""
        return self.fixed_ms + self.n_layer * self.layer_ms + self.head_ms

    def token_ms(self, exit_layer: np.ndarray, kind: np.ndarray, checks: np.ndarray, rejections: np.ndarray,
                 *, fill: bool) -> np.ndarray:
        """Per token with early exit on (the draft runs): exit_layer n_layer - 1 where none, kind the
        ExitKind of each, checks and rejected verifications counted per token."""
        exit_layer = np.asarray(exit_layer)
        exited = np.asarray(kind) != ExitKind.NONE
        heads = np.where(np.asarray(kind) == ExitKind.HEAD_FREE, 0, 1) + np.asarray(rejections)
        skipped = np.where(exited, self.n_layer - 1 - exit_layer, 0)
        return (self.fixed_ms + self.draft_ms + (exit_layer + 1) * self.layer_ms + np.asarray(checks) * self.check_ms
                + heads * self.head_ms + exited * self.stop_ms + (skipped * self.fill_ms if fill else 0.0))

    def head_free_ms(self, depth: np.ndarray) -> np.ndarray:
        """A token that leaves after `depth` layers with no head and no other cost: the head-free oracle's."""
        return self.fixed_ms + np.asarray(depth) * self.layer_ms + np.where(np.asarray(depth) < self.n_layer, self.stop_ms, 0.0)

    def verified_ms(self, depth: np.ndarray) -> np.ndarray:
        """The same paying one head, as a verified exit (or the full path) does: the verified oracle's."""
        return self.head_free_ms(depth) + self.head_ms

    def to_dict(self) -> dict:
        return asdict(self)


def measure_costs(model: Model, setup: DraftSetup, tokens: Sequence[int], *, n_prompt: int, n_threads: int, k: int,
                  rounds: int = 2, advance: Callable[[int], None] = lambda n: None) -> TokenCosts:
    """Every lane decodes `tokens` (the first n_prompt as a prompt, the rest one at a time), in turns; a first
    untimed round builds what each lane builds once (graphs, the exit head, the fill graphs)."""
    lanes = cost_lanes(model, setup, n_ctx=len(tokens) + 8, n_threads=n_threads, k=k)
    try:
        for round_ in range(rounds + 1):
            for lane in lanes:
                lane.start(tokens[:n_prompt])
                lane.timing = Timing() if round_ == 1 else lane.timing
            for token in tokens[n_prompt:]:
                for lane in lanes:
                    lane.step(token)
                advance(1)
    finally:
        for lane in lanes:
            lane.ctx.close()
    return TokenCosts.fit(lanes)
