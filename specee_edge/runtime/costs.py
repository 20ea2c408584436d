"""What the parts of a token cost on this machine, measured with the runtime itself.

Lanes decode the same tokens one at a time, in turns (a change in machine speed hits all of them
alike); each forces a known mix of parts, and the parts follow from differences of their times
(n layers; stops after layer l at a quarter, half and three quarters of the depth, m the middle one):

    plain            F + n L + H                  our context, early exit off
    checked_one      F + n L + H + D + C          the draft and one native check that never fires
    checked_all      F + n L + H + D + n C        ... a check after every layer
    draft            D                            the in-graph timer of the draft (its own lane: timing
                                                  adds a scheduler split)
    stop_free(l)     F + (l+1) L + S' + B         a head-free stop after layer l (mask mode), forced by a
                                                  Python probe callback (its cost B, and its stop S')
    stop_head(l)     F + (l+1) L + S' + B + H     the same stop paying the exit head
    stop_fill(l)     stop_free(l) + (n-1-l) K     a head-free stop in fill mode
    stop_native(m)   F + (m+1) L + D + C + S      a native head-free stop, as the engine stops

F is what every token pays whatever it does, L a layer, H the full-vocabulary LM head, D the in-graph
draft, C one check (probe, read-back, predictor), S a stop, K rebuilding one skipped layer's K/V.

A lane's time is the median of its tokens (one token slowed by the machine moves it little), and the
lanes take their turns in a new random order at every token, so that no lane always runs first after
the caches were cooled by another. A difference of medians can come out below zero where a part is too
small to see (a tiny model's layers): it is kept as measured, never clipped, and the 95% interval of
every part (a bootstrap over the timed tokens, each with all of its lanes) says how far it can be
trusted. Calibration prices its decisions with these (TokenCosts.token_ms), turns a level on only
where its predicted gain stands clear of that interval, and stores them in the pack; the bench
measures them in its own run for the oracles.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from specee_edge.bootstrap import resampled_rows
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
    samples: list[float] = field(default_factory=list)  # ms of each timed token
    in_graph_draft: bool = False  # samples are the in-graph draft timer's, not the decode's wall time

    def start(self, prompt: Sequence[int]) -> None:
        self.ctx.clear()
        self.ctx.decode(list(prompt))

    def step(self, token: int) -> None:
        start = time.perf_counter()
        self.ctx.decode([token])
        seconds = time.perf_counter() - start
        self.timing.add(seconds)
        self.samples.append(self.ctx.step_info().draft_ms if self.in_graph_draft else seconds * 1e3)

    def restart_timing(self) -> None:
        self.timing, self.samples = Timing(), []


def stop_layers(n_layer: int) -> list[int]:
    return sorted({max(0, round(n_layer * f) - 1) for f in STOP_FRACTIONS})


def native_stop_layer(n_layer: int) -> int:
    layers = stop_layers(n_layer)
    return layers[len(layers) // 2]


def cost_lanes(model: Model, setup: DraftSetup, *, n_ctx: int, n_threads: int, k: int) -> list[CostLane]:
    """The lanes of the module docstring, on fresh contexts."""
    n_layer = model.info.n_layer

    def context(kv_mode: str | None) -> Context:
        ctx = Context(model, n_ctx=n_ctx, n_threads=n_threads)
        if kv_mode:
            ctx.enable_early_exit(k, kv_mode)
        return ctx

    def checked(layers: list[int], threshold: float = 1.0) -> Context:
        """The draft and a native check after each of `layers` (threshold 1: a sigmoid never exceeds it, so
        checked and never fired; below 0: every check stops the token, head-free)."""
        ctx = context("mask")
        ctx.set_draft(**setup.draft)
        weights, biases = setup.predictor
        for il in layers:
            ctx.set_predictor(il, weights, biases)
            ctx.set_exit(il, ExitKind.HEAD_FREE, threshold)
        ctx.set_probe_layers(layers)
        return ctx

    def timed_draft() -> Context:
        ctx = checked([n_layer - 1])
        ctx.set_timing(True)
        return ctx

    def stopping(layer: int, kind: ExitKind, kv_mode: str) -> Context:
        ctx = context(kv_mode)
        ctx.set_candidates(list(range(k)))
        ctx.set_probe_layers([layer])
        ctx.set_probe_callback(lambda il, cand_logits: kind)
        return ctx

    native = native_stop_layer(n_layer)
    lanes = [CostLane("plain", context(None), n_layer),
             CostLane("checked_one", checked([n_layer - 1]), n_layer),
             CostLane("checked_all", checked(list(range(n_layer))), n_layer),
             CostLane("draft", timed_draft(), n_layer, in_graph_draft=True),
             CostLane(f"stop_native@{native}", checked([native], threshold=-1.0), native + 1)]
    for layer in stop_layers(n_layer):
        lanes += [CostLane(f"stop_free@{layer}", stopping(layer, ExitKind.HEAD_FREE, "mask"), layer + 1),
                  CostLane(f"stop_head@{layer}", stopping(layer, ExitKind.VERIFIED, "mask"), layer + 1),
                  CostLane(f"stop_fill@{layer}", stopping(layer, ExitKind.HEAD_FREE, "fill"), layer + 1)]
    return lanes


PARTS = ("fixed_ms", "layer_ms", "head_ms", "draft_ms", "check_ms", "stop_ms", "fill_ms")


def fit_parts(ms: dict[str, np.ndarray], n_layer: int) -> np.ndarray:
    """The parts (PARTS order, on the last axis) from each lane's time; the lanes' times may carry leading
    axes (one per bootstrap resample), and so does the result."""
    layers = stop_layers(n_layer)
    x = np.array(layers, dtype=float) + 1
    free = np.stack([ms[f"stop_free@{il}"] for il in layers], axis=-1)
    # least squares over the stops: free = intercept + slope * layers run (the callback's B cancels in the
    # slope, in the head's difference and in the fill's)
    slope = ((x - x.mean()) * (free - free.mean(-1, keepdims=True))).sum(-1) / ((x - x.mean()) ** 2).sum()
    head = np.mean([ms[f"stop_head@{il}"] for il in layers], axis=0) - free.mean(-1)
    fixed = ms["plain"] - n_layer * slope - head
    check = (ms["checked_all"] - ms["checked_one"]) / (n_layer - 1)
    draft = ms["draft"]
    native = native_stop_layer(n_layer)
    stop = ms[f"stop_native@{native}"] - fixed - (native + 1) * slope - draft - check
    fill = np.mean([(ms[f"stop_fill@{il}"] - ms[f"stop_free@{il}"]) / (n_layer - 1 - il) for il in layers], axis=0)
    return np.stack([fixed, slope, head, draft, check, stop, fill], axis=-1)


@dataclass(frozen=True)
class TokenCosts:
    """Milliseconds per part of a token (see the module docstring), each the median estimate with its 95%
    interval; `resampled` holds the parts of each bootstrap resample (not stored in the pack)."""

    n_layer: int
    fixed_ms: float
    layer_ms: float
    head_ms: float
    draft_ms: float
    check_ms: float
    stop_ms: float
    fill_ms: float  # per skipped layer
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)  # per part, 95%
    resampled: np.ndarray | None = field(default=None, repr=False, compare=False)  # [resamples, len(PARTS)]

    @classmethod
    def fit(cls, lanes: Sequence[CostLane], seed: int = 0) -> TokenCosts:
        """From lanes that timed the same tokens (their samples are aligned token by token)."""
        n = next(lane.layers_run for lane in lanes if lane.name == "plain")
        samples = {lane.name: np.array(lane.samples) for lane in lanes}
        parts = fit_parts({name: np.median(ms) for name, ms in samples.items()}, n)
        rows = resampled_rows(len(samples["plain"]), seed)
        resampled = fit_parts({name: np.median(ms[rows], axis=-1) for name, ms in samples.items()}, n)
        low, high = np.percentile(resampled, [2.5, 97.5], axis=0)
        intervals = {part: (float(lo), float(hi)) for part, lo, hi in zip(PARTS, low, high)}
        return cls(n, *map(float, parts), intervals=intervals, resampled=resampled)

    @property
    def parts(self) -> np.ndarray:
        return np.array([getattr(self, part) for part in PARTS])

    @property
    def plain_ms(self) -> float:
        """A token that runs every layer and the output head, with early exit off."""
        return self.fixed_ms + self.n_layer * self.layer_ms + self.head_ms

    def plain_features(self) -> np.ndarray:
        """What a plain token pays of each part (PARTS order): plain_ms = plain_features() @ parts."""
        return np.array([1.0, self.n_layer, 1.0, 0.0, 0.0, 0.0, 0.0])

    def token_features(self, exit_layer: np.ndarray, kind: np.ndarray, checks: np.ndarray, rejections: np.ndarray,
                       *, fill: bool) -> np.ndarray:
        """[tokens, len(PARTS)]: how many of each part a token pays with early exit on (the draft runs):
        exit_layer n_layer - 1 where none, kind the ExitKind of each, checks and rejected verifications
        counted per token."""
        exit_layer = np.asarray(exit_layer)
        exited = np.asarray(kind) != ExitKind.NONE
        heads = np.where(np.asarray(kind) == ExitKind.HEAD_FREE, 0, 1) + np.asarray(rejections)
        skipped = np.where(exited, self.n_layer - 1 - exit_layer, 0) if fill else np.zeros(len(exit_layer))
        return np.stack([np.ones(len(exit_layer)), exit_layer + 1, heads, np.ones(len(exit_layer)),
                         np.asarray(checks), exited, skipped], axis=-1).astype(float)

    def token_ms(self, exit_layer: np.ndarray, kind: np.ndarray, checks: np.ndarray, rejections: np.ndarray,
                 *, fill: bool) -> np.ndarray:
        """Per token with early exit on (see token_features)."""
        return self.token_features(exit_layer, kind, checks, rejections, fill=fill) @ self.parts

    def speedup_interval(self, features: np.ndarray, steps: np.ndarray, seed: int = 0) -> tuple[float, float]:
        """95% interval of the predicted speed-up of decisions whose parts are summed per prompt (features
        [prompts, len(PARTS)], steps [prompts]): each resample draws the prompts and the costs' own resample
        together, so that it holds the noise of both (the point itself where no resamples were kept)."""
        def ratio(parts: np.ndarray, rows: np.ndarray | slice) -> np.ndarray:
            plain = steps[rows].sum(-1) * (parts @ self.plain_features())
            return plain / np.einsum("...p,...p->...", features[rows].sum(-2), parts)

        if self.resampled is None:
            point = float(ratio(self.parts, slice(None)))
            return point, point
        rows = resampled_rows(len(steps), seed)[: len(self.resampled)]
        low, high = np.percentile(ratio(self.resampled[: len(rows)], rows), [2.5, 97.5])
        return float(low), float(high)

    def head_free_ms(self, depth: np.ndarray) -> np.ndarray:
        """A token that leaves after `depth` layers with no head and no other cost: the head-free oracle's."""
        return self.fixed_ms + np.asarray(depth) * self.layer_ms + np.where(np.asarray(depth) < self.n_layer, self.stop_ms, 0.0)

    def verified_ms(self, depth: np.ndarray) -> np.ndarray:
        """The same paying one head, as a verified exit (or the full path) does: the verified oracle's."""
        return self.head_free_ms(depth) + self.head_ms

    def to_dict(self) -> dict:
        return {field_.name: getattr(self, field_.name) for field_ in fields(self) if field_.name != "resampled"}


def measure_costs(model: Model, setup: DraftSetup, answers: Sequence[tuple[Sequence[int], int]], *, n_threads: int,
                  k: int, rounds: int = 2, seed: int = 0, advance: Callable[[int], None] = lambda n: None) -> TokenCosts:
    """Every lane decodes each answer's tokens (the first n_prompt of (tokens, n_prompt) as a prompt, the rest
    one at a time), all lanes a token before the next, in a new random order at each; a first untimed
    round builds what each lane builds once (graphs, the exit head, the fill graphs)."""
    rng = np.random.default_rng(seed)
    lanes = cost_lanes(model, setup, n_ctx=max(len(tokens) for tokens, _ in answers) + 8, n_threads=n_threads, k=k)
    try:
        for round_ in range(rounds + 1):
            if round_ == 1:
                for lane in lanes:
                    lane.restart_timing()
            for tokens, n_prompt in answers:
                for lane in lanes:
                    lane.start(tokens[:n_prompt])
                for token in tokens[n_prompt:]:
                    for i in rng.permutation(len(lanes)):
                        lanes[i].step(token)
                    advance(1)
    finally:
        for lane in lanes:
            lane.ctx.close()
    return TokenCosts.fit(lanes, seed)
