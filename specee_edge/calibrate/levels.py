"""Stage 5: the quality dial. For each level, every layer's exit (off, verified or head-free) and
threshold, chosen together by what they cost on this machine.

A level q promises that the share of wrong steps (an exit whose token differs from the full model's)
stays within 1 - q over a whole reply. Exits differ in what they buy: a head-free exit skips the rest
of the layers and the full-vocabulary LM head; a verified one pays the head (and another for each
rejected verification) but cannot emit a token the exit head disagrees with; an exit at layer 10 saves
more than one at layer 28. So the error budget is spent where it buys the most time: starting from no
exits, a greedy search repeatedly turns a layer on, lowers its threshold or changes its kind, taking the
move that saves the most milliseconds per added error (runtime/costs.py measured a layer, the head, the
draft, a check, a stop and a fill on this machine), until the lowest level's budget is spent. Each
level is a point on that one path, so a higher level never exits where a lower one does not.

The search scores decisions with every layer that is on checked, through the exit rule itself
(predictor/rule.py): each layer's probability is computed against the previous layer that is on, as
the engine computes it. The engine checks the layers its online schedule picks: each level is replayed
with that schedule and steps back along the path until it holds. Both keep every later token's K/V
exact; the engine itself then runs each level on answers to the same prompts (replay.py), where exits
leave approximate K/V behind, and a level that falls short there steps back too. A level whose
decisions there are not predicted faster than plain decoding beyond the noise of the prediction turns
every layer off (`pays`).

Nothing so far has seen the held-out prompts. The engine runs each level on them once, for the figures
the pack stores, and a level ships under its name only where the low end of its held-out agreement's
95% interval (bootstrapped over prompts) reaches it; else it is renamed after what it holds, or dropped
(`keep_promises`).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specee_edge.calibrate.dataset import Dataset
from specee_edge.calibrate.predictor_fit import Probes, Simulation, offline_layers, simulate
from specee_edge.calibrate.replay import Replay
from specee_edge.exits import ExitKind
from specee_edge.pack.format import OFF, LayerExit, QualityLevel, Schedule
from specee_edge.predictor import MLPPredictor
from specee_edge.predictor.rule import candidate_probs, probe_features
from specee_edge.runtime.costs import TokenCosts

LEVELS = (0.90, 0.95, 0.98, 0.99, 0.995)
GRID = np.round(np.arange(0.99, 0.295, -0.01), 2)  # thresholds a layer moves through, from the top
STRIDES = (1, 2, 4, 8, 16)  # grid steps one move may take (a flat stretch can hide the next gain)
ENGINE_PROBES = 8  # path points a level may step back to when the engine checks it (a bisection over them)
PROMISE_STEP = 0.005  # a level that falls short of its name is renamed to the multiple of this below what it holds


@dataclass(frozen=True)
class Decisions:
    """What one setting of the exits does to each step, every layer that is on checked."""

    exit_layer: np.ndarray  # int [N], n_layer - 1 where no layer stops the step
    kind: np.ndarray        # int [N]: ExitKind of the exit (NONE where none)
    checks: np.ndarray      # int [N]
    rejections: np.ndarray  # int [N]: verified positives whose verification failed
    wrong: np.ndarray       # bool [N]: the exit emits another token than the full model's


class ExitTable:
    """Per step and predictor layer: the predictor's probability against each possible previous check,
    whether verification would pass, and whether each kind of exit would emit the full model's token."""

    def __init__(self, probes: Probes, predictors: dict[int, MLPPredictor], rows: np.ndarray, n_layer: int):
        self.layers = np.array(sorted(predictors))
        self.n_layer = n_layer
        m = len(self.layers)
        # prob[j, i, :]: layer j checked after layer i (i = m: j is the token's first check)
        self.prob = np.zeros((m, m + 1, len(rows)), dtype=np.float32)
        for j, il in enumerate(self.layers):
            for i in [m, *range(j)]:
                prev = None if i == m else candidate_probs(probes.logits[rows, self.layers[i]])
                self.prob[j, i] = predictors[il](probe_features(probes.logits[rows, il], prev)[0])
        self.verified = probes.verified[rows][:, self.layers]
        self.correct = probes.correct[rows][:, self.layers]
        self.head_free = probes.head_free[rows][:, self.layers]

    def decide(self, kinds: np.ndarray, thresholds: np.ndarray) -> Decisions:
        """kinds and thresholds per predictor layer (self.layers order)."""
        n = self.prob.shape[2]
        on = np.flatnonzero(kinds != ExitKind.NONE)
        if not len(on):
            zeros = np.zeros(n, dtype=np.int64)
            return Decisions(np.full(n, self.n_layer - 1), zeros, zeros, zeros, np.zeros(n, dtype=bool))
        prev = np.concatenate([[len(self.layers)], on[:-1]])
        prob = self.prob[on, prev].T                               # [N, checks]
        fire = prob > thresholds[on]
        head_free = kinds[on] == ExitKind.HEAD_FREE
        stop = fire & (head_free | self.verified[:, on])
        stopped = stop.any(axis=1)
        checks = np.where(stopped, np.argmax(stop, axis=1) + 1, len(on))  # up to and with the exit's own
        ran = np.arange(len(on)) < checks[:, None]
        rejections = (fire & ~head_free & ~self.verified[:, on] & ran).sum(axis=1)
        rows = np.arange(n)
        exit_index = on[checks - 1]
        kind = np.where(stopped, kinds[exit_index], ExitKind.NONE)
        emits_final = np.where(kind == ExitKind.HEAD_FREE, self.head_free[rows, exit_index], self.correct[rows, exit_index])
        return Decisions(np.where(stopped, self.layers[exit_index], self.n_layer - 1), kind, checks, rejections,
                         stopped & ~emits_final)


@dataclass(frozen=True)
class PathPoint:
    kinds: np.ndarray       # per predictor layer, in ExitTable.layers order
    thresholds: np.ndarray
    errors: int
    saved_ms: float         # over every step, against plain decoding (negative: slower than plain)


def greedy_path(table: ExitTable, costs: TokenCosts, max_errors: int, *, fill: bool,
                progress: Callable[[], None] = lambda: None) -> list[PathPoint]:
    """From no exits, the move with the best saving per added error, while errors <= max_errors. A move turns
    a layer on (near the top of the grid), lowers its threshold, or makes a verified exit head-free at the
    same threshold: each lets every step that exited still exit, so a later point exits at least wherever an
    earlier one does. The first move is taken even if it does not pay yet: the draft it switches on is paid
    once for all."""
    m = len(table.layers)
    allowed = [[k for k in (ExitKind.VERIFIED, ExitKind.HEAD_FREE) if not (k == ExitKind.VERIFIED and il == table.n_layer - 1)]
               for il in table.layers]
    plain = costs.plain_ms * table.prob.shape[2]

    def evaluate(kinds: np.ndarray, index: np.ndarray) -> tuple[int, float]:
        d = table.decide(kinds, GRID[index])
        return int(d.wrong.sum()), float(plain - costs.token_ms(d.exit_layer, d.kind, d.checks, d.rejections, fill=fill).sum())

    kinds, index = np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64)
    errors, saved = 0, 0.0
    path = [PathPoint(kinds.copy(), np.ones(m), errors, saved)]
    while True:
        best = None
        for j in range(m):
            for kind in allowed[j]:
                if kinds[j] == ExitKind.NONE:
                    steps = [(kind, s - 1) for s in STRIDES]
                elif kinds[j] == kind:
                    steps = [(kind, index[j] + s) for s in STRIDES if index[j] + s < len(GRID)]
                elif kind == ExitKind.HEAD_FREE:  # verified to head-free: every step that exited still does
                    steps = [(kind, index[j])]
                else:
                    steps = []
                for new_kind, new_index in steps:
                    trial_kinds, trial_index = kinds.copy(), index.copy()
                    trial_kinds[j], trial_index[j] = new_kind, new_index
                    e, s = evaluate(trial_kinds, trial_index)
                    if e > max_errors or (s <= saved and len(path) > 1):
                        continue
                    score = (s - saved) / (max(e - errors, 0) + 1)
                    if best is None or score > best[0]:
                        best = (score, trial_kinds, trial_index, e, s)
        if best is None:
            return path
        _, kinds, index, errors, saved = best
        path.append(PathPoint(kinds.copy(), np.where(kinds != ExitKind.NONE, GRID[index], 1.0), errors, saved))
        progress()


@dataclass(frozen=True)
class LevelChoice:
    level: QualityLevel
    index: int             # the point of the search's path it takes
    simulated: Simulation  # its decisions on the calibration split with the online schedule, K/V exact
    engine: Replay | None = None  # the engine's own run of it (check_with_engine)


class LevelSearch:
    """The path on the calibration split, and the levels taken from it."""

    def __init__(self, ds: Dataset, probes: Probes, predictors: dict[int, MLPPredictor], calib: np.ndarray,
                 costs: TokenCosts, schedule: Schedule, max_errors_share: float, *, fill: bool,
                 progress: Callable[[], None] = lambda: None):
        self.ds, self.probes, self.predictors, self.calib, self.schedule = ds, probes, predictors, calib, schedule
        table = ExitTable(probes, predictors, calib, ds.n_layer)
        self.layers = table.layers.tolist()
        self.path = greedy_path(table, costs, int(max_errors_share * len(calib)), fill=fill, progress=progress)

    def exits_at(self, index: int) -> dict[int, LayerExit]:
        point = self.path[index]
        return {il: LayerExit(ExitKind(int(k)), float(t)) if k != ExitKind.NONE else OFF
                for il, k, t in zip(self.layers, point.kinds, point.thresholds)}

    def level_at(self, index: int, quality: float) -> tuple[QualityLevel, Simulation]:
        """The path's point as a level: its offline set covers the exits every-layer checking finds on the
        calibration split; the simulation replays the engine's online schedule there (K/V exact)."""
        exits = self.exits_at(index)
        every = simulate(self.ds, self.probes, self.predictors, exits, self.calib, None)
        schedule = Schedule(offline_layers(every, self.ds.n_layer), self.schedule.window, list(self.schedule.offsets))
        online = simulate(self.ds, self.probes, self.predictors, exits, self.calib, schedule)
        return QualityLevel(quality, exits, schedule.offline), online

    def holds(self, index: int, quality: float) -> bool:
        """The point keeps `quality`'s error budget with the online schedule."""
        return index == 0 or self.level_at(index, quality)[1].agreement >= quality

    def choose(self, quality: float, limit: int) -> LevelChoice:
        """The furthest point within `quality`'s budget, no further than `limit`; the start (every layer off)
        if that point is predicted no faster than plain decoding."""
        budget = (1 - quality) * len(self.calib)
        end = min(limit, max(i for i, point in enumerate(self.path) if point.errors <= budget))
        index = last_holding(range(end + 1), lambda i: self.holds(i, quality))
        if self.path[index].saved_ms <= 0:
            index = 0
        level, sim = self.level_at(index, quality)
        return LevelChoice(level, index, sim)


def last_holding(candidates: range | list[int], holds: Callable[[int], bool]) -> int:
    """The last candidate where `holds`, assuming it holds up to a boundary and not after (the first
    candidate is taken to hold)."""
    position = bisect.bisect_left(candidates, True, lo=1, key=lambda i: not holds(i))
    return candidates[position - 1]


def choose_levels(search: LevelSearch, levels: tuple[float, ...],
                  progress: Callable[[], None] = lambda: None) -> list[LevelChoice]:
    """Each level's point on the path, K/V exact; a higher level never goes further than a lower one."""
    choices, limit = [], len(search.path) - 1
    for quality in sorted(levels):
        choice = search.choose(quality, limit)
        choices.append(choice)
        limit = choice.index
        progress()
    return choices


def check_with_engine(search: LevelSearch, choices: list[LevelChoice], measure: Callable[[QualityLevel], Replay],
                      progress: Callable[[], None] = lambda: None) -> list[LevelChoice]:
    """The levels as the engine runs them. Its KV modes approximate (fill) or leave out (mask) the K/V an
    exited token skipped, and later tokens read them, so a reply drifts from the full model by more than
    the exits' own errors. `measure` replays a level through the engine; a level that falls short steps
    back along the path (to one of ENGINE_PROBES points, by bisection). Returns new choices."""
    replays: dict[int, Replay] = {}

    def replayed(index: int, quality: float) -> Replay:
        if index not in replays:
            replays[index] = measure(search.level_at(index, quality)[0])
            progress()
        return replays[index]

    checked, limit = [], len(search.path) - 1
    for choice in choices:
        quality = choice.level.quality
        index = min(choice.index, limit)
        if index and replayed(index, quality).agreement < quality:
            points = sorted({int(round(x)) for x in np.linspace(0, index, ENGINE_PROBES + 1)})
            index = last_holding(points, lambda i: i == 0 or replayed(i, quality).agreement >= quality)
        level, sim = search.level_at(index, quality)
        checked.append(LevelChoice(level, index, sim, replayed(index, quality) if index else None))
        limit = index
    return checked


def turned_off(level: QualityLevel) -> QualityLevel:
    """The level with every layer off: it decodes plainly."""
    return dataclasses.replace(level, exits=dict.fromkeys(level.exits, OFF), offline=[])


def pays(replay: Replay | None) -> bool:
    """A level's decisions on the calibration split are predicted faster than plain decoding beyond the noise
    of the prediction: the low end of the speed-up's interval (prompts and costs resampled) is above 1."""
    return replay is not None and replay.speedup_low > 1.0


def keep_promises(levels: list[QualityLevel]) -> list[QualityLevel | None]:
    """Each lossy level as it may ship, from its held-out figures: under its own name where the low end of its
    agreement's interval reaches it; else renamed after that low end (floored to a multiple of PROMISE_STEP);
    None (dropped) where that name is another level's or not above 0. A level with every layer off decodes
    plainly and holds any promise."""
    def holds(level: QualityLevel) -> bool:
        return level.off or level.agreement_interval()[0] >= level.quality - 1e-6

    names = {level.quality for level in levels if holds(level)}
    shipped: list[QualityLevel | None] = []
    for level in levels:
        if holds(level):
            shipped.append(level)
            continue
        name = round(math.floor(level.agreement_interval()[0] / PROMISE_STEP + 1e-6) * PROMISE_STEP, 3)
        if name <= 0 or name in names:
            shipped.append(None)
        else:
            names.add(name)
            shipped.append(dataclasses.replace(level, quality=name))
    return shipped


def shipped_quality(shipped: list[QualityLevel | None], index: int) -> float | None:
    """The name the level at `index` ships under (keep_promises' output); dropped, it gives way to the next level
    up (fewer exits). None where no level from there on ships."""
    return next((level.quality for level in shipped[index:] if level is not None), None)
