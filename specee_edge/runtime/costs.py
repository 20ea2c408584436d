"""What the parts of a token cost on this machine, measured with the runtime itself.

Lanes decode the same tokens one at a time, in turns (a change in machine speed hits all of them
alike); each forces a known mix of parts, and the parts follow from differences of their times
(n layers; stops after layer l at a quarter, half and three quarters of the depth):

    plain            P                            our context, early exit off: the stock graph
    checked_one      F + n L + H + D + C          the draft and one native check that never fires
    checked_all      F + n L + H + D + n C        ... a check after every layer
    draft            D                            the in-graph timer of the draft (its own lane: timing
                                                  adds a scheduler split)
    stop_mask(l)     F + (l+1)(L + M) + D + C + S a native check that always fires, head-free, mask mode:
                                                  a stop as the engine stops
    stop_fill(l)     F + (l+1) L + D + C + S      the same in fill mode
                       + (n-1-l) K
    stop_free(l)     X(l)                         a head-free stop forced by a Python probe callback (its
                                                  graph probes every layer and calls back: X is not a part)
    stop_head(l)     X(l) + H                     the same stop paying the exit head

P is a token of plain decoding. F is what every token with early exit on pays whatever it does (its
graph is hooked: the scheduler asks at each node whether a probe needs it, which plain decoding never
does), L a layer of that graph, M what the depth mask adds to a layer (in mask mode, once a token has
stopped early, every layer's attention masks the cells it skipped; in fill mode and while no token has
stopped there is nothing to mask), H the full-vocabulary LM head, D the in-graph draft, C one check
(probe, read-back, predictor), S a stop, K rebuilding one skipped layer's K/V. Every lane that runs x
layers also pays x^2 Q (not written above): each further layer costs a little more than the one before,
as fewer of the layers' weights stay in the caches. On SmolLM2 (30 layers) on a 2-core machine, a stop
after 30 layers cost 0.67 ms more than the line through the stops after 8, 15 and 22 said (6.7 % of a
plain token), after 28 layers 0.52 ms more, and a parabola through the same three stops came within
0.07 ms everywhere from 8 to 30 layers (tools/stop_curve.py measures it). The mask and fill stops are
two parabolas in the layers run that share that curvature: their slopes are L + M and L - K, and their
intercepts differ by n K, which separates the three.

A model split between two devices (-ngl with a GPU or RPC workers; --offload-first puts the first layers on the
device) has layers that cost one thing on one side and another on the other, and a token that runs past the split
hands its hidden state over once. Its stops are placed on both sides (the middle and last layer before the split,
the first, middle and last stoppable one after it) and both stop lines get two more terms, shared: P' per layer
run past the split beyond L (split_layer_ms) and X once a token crosses (crossing_ms). So an exit before the split
is worth the other side's layers and the crossing it skips, whichever side is the slow one. A side with fewer than
two stoppable layers is priced with the other's layers; on a model split further (several GPUs), only the first
crossing is priced apart.

A lane's time is the median of its tokens (one token slowed by the machine moves it little), and the
lanes take their turns in a new random order at every token, so that no lane always runs first after the
caches were cooled by another. A measurement is several rounds, each on a freshly loaded model and fresh
contexts (new weight and KV buffers, wherever they land) timing the same tokens: the 95% interval of
every part is a bootstrap that draws rounds, then tokens within each (each token with all of its lanes),
so that it holds what changes from one load to the next as well as from token to token. Such a bootstrap
sees only as much of that change as its rounds show: in simulation (tests/test_bootstrap.py), with parts
that drift by 3 % between rounds, the intervals of 3 rounds held the true costs 0.87 of the time
(averaged over the parts, 0.75 for the worst), those of 6 rounds 0.97 (0.85). A difference of medians
can come out below zero where a part is too small to see (a tiny model's layers): it is kept as
measured, never clipped, and its interval says how far it can be trusted. Calibration prices its
decisions with these (TokenCosts.token_ms), turns a level on only where its predicted gain stands clear
of that interval, and stores them in the pack; the bench measures them in its own run for the oracles.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from functools import partial

import numpy as np

from specee_edge.bootstrap import RESAMPLES, resampled_rows
from specee_edge.exits import ExitKind
from specee_edge.runtime.context import Context
from specee_edge.runtime.model import Model
from specee_edge.runtime.placement import Placement, first_crossing
from specee_edge.runtime.rpc import Replies

STOP_FRACTIONS = (0.25, 0.5, 0.75)


@dataclass
class Timing:
    steps: int = 0
    seconds: float = 0.0
    by_prompt: list[list[float]] = field(default_factory=list)  # [steps, seconds] of each prompt begun
    replies: Replies = field(default_factory=Replies)  # what the steps waited for from RPC workers (--rpc)

    def begin_prompt(self) -> None:
        self.by_prompt.append([0, 0.0])

    def add(self, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        if self.by_prompt:
            self.by_prompt[-1][0] += 1
            self.by_prompt[-1][1] += seconds

    def add_span(self, steps: int, seconds: float) -> None:
        """Many steps timed together (a llama-server answer: its own timings)."""
        self.steps += steps
        self.seconds += seconds
        if self.by_prompt:
            self.by_prompt[-1][0] += steps
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
    """One context decoding the fed tokens one at a time (the forced parts: its name). Its context is `ctx`, or,
    where that is None, made by `opener` at the lane's first start: time_rounds then holds only a group's contexts
    at once (their K/V on a GPU) and closes them before the next group's."""

    name: str
    ctx: Context | None
    layers_run: int
    timing: Timing = field(default_factory=Timing)
    samples: list[float] = field(default_factory=list)  # ms of each timed token
    in_graph_draft: bool = False  # samples are the in-graph draft timer's, not the decode's wall time
    split: int | None = None  # the plain lane: the first layer on another device (the stops are on both sides)
    placement: str = ""  # ... and where the layers ran (Model.placement_text())
    opener: Callable[[], Context] | None = None

    def start(self, prompt: Sequence[int]) -> None:
        if self.ctx is None:
            self.ctx = self.opener()
        self.ctx.clear()
        self.ctx.decode(list(prompt))

    def step(self, token: int) -> None:
        start = time.perf_counter()
        self.ctx.decode([token])  # waits for the step on any backend
        seconds = time.perf_counter() - start
        self.timing.add(seconds)
        self.samples.append(self.ctx.step_info().draft_ms if self.in_graph_draft else seconds * 1e3)

    def restart_timing(self) -> None:
        self.timing, self.samples = Timing(), []

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.close()


def priced_split(split: int | None, n_layer: int) -> int | None:
    """The first layer on another device (placement.first_crossing) where the costs can price its side apart: two
    stops before it, two after it short of the last layer; else None (one side's few layers priced as the other's)."""
    return split if split is not None and 2 <= split <= n_layer - 3 else None


def stop_layers(n_layer: int, split: int | None = None) -> list[int]:
    """The layers the stop lanes stop after: at a quarter, half and three quarters of the depth; with a split
    (priced_split), the middle and the last layer before it, and its first, middle and last stoppable layer after
    it, so that each side's line and the step at the crossing can be told apart."""
    split = priced_split(split, n_layer)
    if split is None:
        return sorted({max(0, round(n_layer * f) - 1) for f in STOP_FRACTIONS})
    return sorted({(split - 1) // 2, split - 1, split, (split + n_layer - 2) // 2, n_layer - 2})


def lane_context(model: Model, *, n_ctx: int, n_threads: int, k: int, kv_mode: str | None,
                 flash_attn: str = "auto") -> Context:
    """A fresh context; early exit on (k candidates, `kv_mode`) unless kv_mode is None."""
    ctx = Context(model, n_ctx=n_ctx, n_threads=n_threads, flash_attn=flash_attn)
    if kv_mode:
        ctx.enable_early_exit(k, kv_mode)
    return ctx


def checked_context(model: Model, setup: DraftSetup, layers: list[int], *, threshold: float = 1.0,
                    kv_mode: str = "mask", n_ctx: int, n_threads: int, k: int, flash_attn: str = "auto") -> Context:
    """The draft and a native check after each of `layers` (threshold 1: a sigmoid never exceeds it, so
    checked and never fired; below 0: every check stops the token, head-free)."""
    ctx = lane_context(model, n_ctx=n_ctx, n_threads=n_threads, k=k, kv_mode=kv_mode, flash_attn=flash_attn)
    ctx.set_draft(**setup.draft)
    weights, biases = setup.predictor
    for il in layers:
        ctx.set_predictor(il, weights, biases)
        ctx.set_exit(il, ExitKind.HEAD_FREE, threshold)
    ctx.set_probe_layers(layers)
    return ctx


def cost_lanes(model: Model, setup: DraftSetup, *, n_ctx: int, n_threads: int, k: int,
               flash_attn: str = "auto") -> list[CostLane]:
    """The lanes of the module docstring, each opening a fresh context at its first start; their stops on both sides
    of the model's split."""
    n_layer = model.info.n_layer
    split = first_crossing(model.layer_devices())

    def context(kv_mode: str | None) -> Context:
        return lane_context(model, n_ctx=n_ctx, n_threads=n_threads, k=k, kv_mode=kv_mode, flash_attn=flash_attn)

    def checked(layers: list[int], threshold: float = 1.0, kv_mode: str = "mask") -> Context:
        return checked_context(model, setup, layers, threshold=threshold, kv_mode=kv_mode, n_ctx=n_ctx,
                               n_threads=n_threads, k=k, flash_attn=flash_attn)

    def timed_draft() -> Context:
        ctx = checked([n_layer - 1])
        ctx.set_timing(True)
        return ctx

    def stopping(layer: int, kind: ExitKind) -> Context:
        ctx = context("mask")
        ctx.set_candidates(list(range(k)))
        ctx.set_probe_layers([layer])
        ctx.set_probe_callback(lambda il, cand_logits: kind)
        return ctx

    def lane(name: str, opener: Callable[[], Context], layers_run: int, **kwargs) -> CostLane:
        return CostLane(name, None, layers_run, opener=opener, **kwargs)

    lanes = [lane("plain", lambda: context(None), n_layer, split=split, placement=model.placement_text()),
             lane("checked_one", lambda: checked([n_layer - 1]), n_layer),
             lane("checked_all", lambda: checked(list(range(n_layer))), n_layer),
             lane("draft", timed_draft, n_layer, in_graph_draft=True)]
    for layer in stop_layers(n_layer, split):
        lanes += [lane(f"stop_mask@{layer}", partial(checked, [layer], threshold=-1.0), layer + 1),
                  lane(f"stop_fill@{layer}", partial(checked, [layer], threshold=-1.0, kv_mode="fill"), layer + 1),
                  lane(f"stop_free@{layer}", partial(stopping, layer, ExitKind.HEAD_FREE), layer + 1),
                  lane(f"stop_head@{layer}", partial(stopping, layer, ExitKind.VERIFIED), layer + 1)]
    return lanes


PARTS = ("plain_ms", "fixed_ms", "layer_ms", "mask_ms", "head_ms", "draft_ms", "check_ms", "stop_ms", "fill_ms",
         "curve_ms", "split_layer_ms", "crossing_ms")


def split_terms(layers_run: np.ndarray, split: int | None) -> tuple[np.ndarray, np.ndarray]:
    """What a token that ran `layers_run` layers pays of a split at layer `split`: its layers past the split, and
    whether it crossed (0 and False on one device)."""
    layers_run = np.asarray(layers_run)
    if split is None:
        return np.zeros(layers_run.shape), np.zeros(layers_run.shape)
    return np.maximum(layers_run - split, 0).astype(float), (layers_run > split).astype(float)


def stop_curves(x: np.ndarray, mask: np.ndarray, fill: np.ndarray, split: int | None = None) -> tuple[np.ndarray, ...]:
    """Least squares of the mask and fill stops' times (points on the last axis, any leading axes) against the
    layers run x, as two parabolas that share their curvature and, with a split, the same change of slope past it
    and the same step where a token crosses it: each line's intercept and slope, the curvature (ms per layer
    squared), then the change of slope and the step (0 without a split)."""
    zero, one = np.zeros_like(x), np.ones_like(x)
    past, crossed = split_terms(x, split)
    design = np.concatenate([np.stack([one, x, zero, zero, x * x, past, crossed], axis=-1),
                             np.stack([zero, zero, one, x, x * x, past, crossed], axis=-1)])
    coefficients = np.concatenate([mask, fill], axis=-1) @ np.linalg.pinv(design).T
    return tuple(np.moveaxis(coefficients, -1, 0))


def fit_parts(ms: dict[str, np.ndarray], n_layer: int, split: int | None = None) -> np.ndarray:
    """The parts (PARTS order, on the last axis) from each lane's time; the lanes' times may carry leading
    axes (one per bootstrap resample), and so does the result. `split`: the first layer on another device."""
    split = priced_split(split, n_layer)
    layers = stop_layers(n_layer, split)
    x = np.array(layers, dtype=float) + 1
    at_0, masked_layer, fill_at_0, layer_less_fill, curve, split_layer, crossing = stop_curves(
        x, np.stack([ms[f"stop_mask@{il}"] for il in layers], axis=-1),
        np.stack([ms[f"stop_fill@{il}"] for il in layers], axis=-1), split)
    fill = (fill_at_0 - at_0) / n_layer
    layer = layer_less_fill + fill
    head = np.mean([ms[f"stop_head@{il}"] - ms[f"stop_free@{il}"] for il in layers], axis=0)
    check = (ms["checked_all"] - ms["checked_one"]) / (n_layer - 1)
    draft = ms["draft"]
    past, crossed = split_terms(np.array(n_layer), split)
    fixed = (ms["checked_one"] - n_layer * layer - n_layer**2 * curve - past * split_layer - crossed * crossing
             - head - draft - check)
    stop = at_0 - fixed - draft - check
    return np.stack([ms["plain"], fixed, layer, masked_layer - layer, head, draft, check, stop, fill, curve,
                     split_layer, crossing], axis=-1)


def resampled_tokens(rounds: int, tokens: int, seed: int) -> np.ndarray:
    """[RESAMPLES, rounds * tokens] indices into `rounds` rounds of `tokens` timed tokens laid end to end:
    each resample draws rounds with replacement, then tokens with replacement within each drawn round."""
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, rounds, (RESAMPLES, rounds))
    within = rng.integers(0, tokens, (RESAMPLES, rounds, tokens))
    return (drawn[..., None] * tokens + within).reshape(RESAMPLES, rounds * tokens)


@dataclass(frozen=True)
class TokenCosts:
    """Milliseconds per part of a token (see the module docstring), each the median estimate with its 95%
    interval, and each part's share of a plain token with its own 95% interval (the ratio taken within every
    bootstrap resample, so that it holds the plain token's noise too); `resampled` holds the parts of each
    resample (not stored in the pack)."""

    n_layer: int
    plain_ms: float  # a token that runs every layer and the output head, with early exit off
    fixed_ms: float
    layer_ms: float
    mask_ms: float  # per layer run under the depth mask
    head_ms: float
    draft_ms: float
    check_ms: float
    stop_ms: float
    fill_ms: float  # per skipped layer
    curve_ms: float  # per layer run, squared: each further layer costs more (fewer layers' weights stay in caches)
    split_layer_ms: float = 0.0  # per layer run past the split, beyond layer_ms (the other device's layers)
    crossing_ms: float = 0.0  # a token that runs past the split: its hidden state handed to the other device
    split: int | None = None  # the first layer on another device than layer 0, where its side is priced apart
    # where the layers ran while timed (Model.placement_text()): the costs, and the levels a pack chose with them,
    # hold for that placement ("" where not recorded)
    placement: str = ""
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)  # per part, 95%
    # per part but the plain token, 95%: what the decisions price, since a speed-up is a ratio of costs (a
    # machine that runs faster for a whole run moves the parts in ms together, and these far less)
    share_intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    resampled: np.ndarray | None = field(default=None, repr=False, compare=False)  # [resamples, len(PARTS)]

    @classmethod
    def fit(cls, rounds: Sequence[Sequence[CostLane]], seed: int = 0) -> TokenCosts:
        """From rounds of lanes that timed the same tokens (their samples are aligned token by token, and every
        round timed as many); the plain lane names the depth and the split the stops were placed for."""
        plain = next(lane for lane in rounds[0] if lane.name == "plain")
        n, split, placement = plain.layers_run, priced_split(plain.split, plain.layers_run), plain.placement
        by_name = [{lane.name: lane.samples for lane in lanes} for lanes in rounds]
        samples = {name: np.concatenate([round_[name] for round_ in by_name]) for name in by_name[0]}
        parts = fit_parts({name: np.median(ms) for name, ms in samples.items()}, n, split)
        rows = resampled_tokens(len(rounds), len(rounds[0][0].samples), seed)
        resampled = fit_parts({name: np.median(ms[rows], axis=-1) for name, ms in samples.items()}, n, split)
        low, high = np.percentile(resampled, [2.5, 97.5], axis=0)
        intervals = {part: (float(lo), float(hi)) for part, lo, hi in zip(PARTS, low, high)}
        plain = PARTS.index("plain_ms")
        low, high = np.percentile(resampled / resampled[:, plain:plain + 1], [2.5, 97.5], axis=0)
        share_intervals = {part: (float(lo), float(hi)) for part, lo, hi in zip(PARTS, low, high) if part != "plain_ms"}
        return cls(n, *map(float, parts), split=split, placement=placement, intervals=intervals,
                   share_intervals=share_intervals, resampled=resampled)

    @property
    def parts(self) -> np.ndarray:
        return np.array([getattr(self, part) for part in PARTS])

    def plain_features(self) -> np.ndarray:
        """What a plain token pays of each part (PARTS order): plain_ms = plain_features() @ parts."""
        return np.eye(len(PARTS))[PARTS.index("plain_ms")]

    def token_features(self, exit_layer: np.ndarray, kind: np.ndarray, checks: np.ndarray, rejections: np.ndarray,
                       *, fill: bool) -> np.ndarray:
        """[tokens, len(PARTS)]: how many of each part a token pays with early exit on (the draft runs):
        exit_layer n_layer - 1 where none, kind the ExitKind of each, checks and rejected verifications
        counted per token. In mask mode every layer run pays the mask (once any token stopped early, the
        cells it skipped are masked at every later step)."""
        exit_layer = np.asarray(exit_layer)
        exited = np.asarray(kind) != ExitKind.NONE
        heads = np.where(np.asarray(kind) == ExitKind.HEAD_FREE, 0, 1) + np.asarray(rejections)
        skipped = np.where(exited, self.n_layer - 1 - exit_layer, 0) if fill else np.zeros(len(exit_layer))
        layers_run = exit_layer + 1
        none, every = np.zeros(len(exit_layer)), np.ones(len(exit_layer))
        past, crossed = split_terms(layers_run, self.split)
        return np.stack([none, every, layers_run, none if fill else layers_run, heads, every, np.asarray(checks),
                         exited, skipped, layers_run**2, past, crossed], axis=-1).astype(float)

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
        depth = np.asarray(depth)
        past, crossed = split_terms(depth, self.split)
        return (self.fixed_ms + depth * self.layer_ms + depth**2 * self.curve_ms + past * self.split_layer_ms
                + crossed * self.crossing_ms + np.where(depth < self.n_layer, self.stop_ms, 0.0))

    def verified_ms(self, depth: np.ndarray) -> np.ndarray:
        """The same paying one head, as a verified exit (or the full path) does: the verified oracle's."""
        return self.head_free_ms(depth) + self.head_ms

    def to_dict(self) -> dict:
        return {field_.name: getattr(self, field_.name) for field_ in fields(self) if field_.name != "resampled"}


def split_text(costs: dict) -> str:
    """The split's parts for people ("" on one device), from TokenCosts.to_dict() or a pack's stored costs."""
    if costs.get("split") is None:
        return ""
    return (f"layers {costs['split']} and up: {costs['split_layer_ms']:+.3f} ms a layer beyond the first "
            f"{costs['split']}'s, {costs['crossing_ms']:.3f} ms to cross to them")


ROUNDS = 6
WARMUP_TOKENS = 4


def measure_costs(model_path: str | os.PathLike, setup: DraftSetup, answers: Sequence[tuple[Sequence[int], int]], *,
                  n_threads: int, k: int, rounds: int = ROUNDS, seed: int = 0,
                  advance: Callable[[int], None] = lambda n: None) -> TokenCosts:
    """Each round loads the model afresh, and fresh lanes decode each answer's tokens (the first n_prompt of
    (tokens, n_prompt) as a prompt, the rest one at a time), all lanes a token before the next, in a new
    random order at each. A few untimed tokens first build what each lane builds once (graphs, the exit head,
    the fill graphs)."""
    n_ctx = max(len(tokens) for tokens, _ in answers) + 8
    make_lanes = lambda model: cost_lanes(model, setup, n_ctx=n_ctx, n_threads=n_threads, k=k)
    return TokenCosts.fit(time_rounds(model_path, make_lanes, answers, rounds=rounds, seed=seed, advance=advance), seed)


def time_rounds(model: str | os.PathLike | Model, make_lanes: Callable[[Model], list[CostLane]],
                answers: Sequence[tuple[Sequence[int], int]], *, rounds: int, seed: int,
                advance: Callable[[float], None] = lambda n: None, placement: Placement | None = None,
                group: int | None = None) -> list[list[CostLane]]:
    """Rounds of lanes (make_lanes' on a freshly loaded model each, its layers where `placement` puts them; or on
    `model` where it is a loaded Model, left open) that decoded `answers` in turns, timed after a few untimed
    warm-up tokens (see measure_costs); their contexts are closed, their samples kept. group: at most this many
    lanes hold a context at once (where their K/V would not fit a GPU together), the groups one after another over
    the same tokens, each warmed up; None: every lane at once."""
    rng = np.random.default_rng(seed)

    def in_turns(lanes: list[CostLane], answers: Sequence[tuple[Sequence[int], int]], advance) -> None:
        for tokens, n_prompt in answers:
            for lane in lanes:
                lane.start(tokens[:n_prompt])
            for token in tokens[n_prompt:]:
                for i in rng.permutation(len(lanes)):
                    lanes[i].step(token)
                advance(1)

    (first, n_first), *_ = answers
    timed = []
    for _ in range(rounds):
        loaded = model if isinstance(model, Model) else Model(model, placement=placement)
        lanes = []
        try:
            lanes = make_lanes(loaded)
            size = group or len(lanes)
            groups = [lanes[i:i + size] for i in range(0, len(lanes), size)]
            for members in groups:
                in_turns(members, [(first[: n_first + WARMUP_TOKENS], n_first)], lambda n: None)
                for lane in members:
                    lane.restart_timing()
                in_turns(members, answers, lambda n: advance(n / len(groups)))
                for lane in members:
                    lane.close()
        finally:
            for lane in lanes:
                lane.close()
            if loaded is not model:
                loaded.close()
        timed.append(lanes)
    return timed
