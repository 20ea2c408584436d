"""Stage 5: the quality dial. For each level, every layer's threshold, chosen together.

A level q promises that the share of wrong steps (an exit whose token differs from the full model's)
stays within 1 - q over a whole reply. An exit at layer 10 saves far more than one at layer 28, so the
error budget is spent where it buys the most depth: starting from no exits, a greedy search lowers
one layer's threshold at a time, taking the move that saves the most compute per added error, until
the lowest level's budget is spent. Each level is a point on that one path (the last within its
budget), so a higher level's thresholds are never below a lower level's: it never exits more.

The search scores decisions with every predictor layer checked; the engine checks the layers its
online schedule picks. Each level is then replayed with that schedule, and if it breaks the budget
there, the level steps back along the path until it holds. Both of these keep every later token's K/V
exact; last, the engine itself runs each level on held-out answers (replay.py), where exits leave
approximate K/V behind, and a level that falls short there steps back too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specee_edge.calibrate.dataset import Dataset
from specee_edge.calibrate.predictor_fit import Probes, Simulation, offline_layers, simulate
from specee_edge.calibrate.replay import Replay
from specee_edge.gguf_index import GGUFIndex
from specee_edge.pack.format import QualityLevel, Schedule
from specee_edge.predictor import MLPPredictor
from specee_edge.predictor.features import probe_features

LEVELS = (0.90, 0.95, 0.98, 0.99, 0.995)
DEFAULT_QUALITY = 0.98
GRID = np.round(np.arange(0.99, 0.295, -0.01), 2)  # thresholds a layer moves through, from the top
STRIDES = (1, 2, 4, 8, 16)  # grid steps one move may take (a flat stretch can hide the next gain)
NEVER = 1.0


@dataclass(frozen=True)
class CostModel:
    """A token's compute in decoder layers, from the model's tensor sizes (2-core CPU decoding is
    compute-bound, so a matmul's cost follows its weight count)."""

    n_layer: int
    head: float  # the LM head: once per token, and once more for each rejected verification
    fill: float  # rebuilding one skipped layer's K/V from the exit hidden state (fill mode)

    @classmethod
    def of(cls, model: GGUFIndex) -> CostModel:
        n_layer = int(model.value(f"{model.value('general.architecture')}.block_count"))
        block = [t for t in model.tensors if t.name.startswith("blk.0.") and len(t.shape) == 2]
        layer = sum(t.n_elements for t in block)
        kv = sum(t.n_elements for t in block if t.name in ("blk.0.attn_k.weight", "blk.0.attn_v.weight"))
        head = model.tensor("output.weight") or model.tensor("token_embd.weight")
        return cls(n_layer, head.n_elements / layer, kv / layer)

    @property
    def full(self) -> float:
        return self.n_layer + self.head

    def token(self, exit_layer: np.ndarray, rejected: np.ndarray) -> np.ndarray:
        """Per token, for exit layers (n_layer - 1: none) and rejected verifications."""
        return exit_layer + 1 + self.head * (1 + rejected) + self.fill * (self.n_layer - 1 - exit_layer)


@dataclass
class Decisions:
    """What a set of thresholds does to each step, every predictor layer checked."""

    exit_layer: np.ndarray  # int [N], n_layer - 1 where no layer stops the step
    wrong: np.ndarray       # bool [N]: stopped with another token than the full model's
    rejected: np.ndarray    # int [N]: positive predictions whose verification failed


class ExitTable:
    """Per step and predictor layer: the predictor's probability (each layer checked after the one below
    it, as the schedule's offline layers are), verification and correctness."""

    def __init__(self, probes: Probes, predictors: dict[int, MLPPredictor], rows: np.ndarray, n_layer: int):
        self.layers = np.array(sorted(predictors))
        self.n_layer = n_layer
        prev = None
        columns = []
        for il in self.layers:
            features, prev = probe_features(probes.logits[rows, il], prev)
            columns.append(predictors[il](features))
        self.prob = np.stack(columns, axis=1).astype(np.float32)
        self.verified = probes.verified[rows][:, self.layers]
        self.correct = probes.correct[rows][:, self.layers]

    def decide(self, thresholds: np.ndarray) -> Decisions:
        fire = self.prob > thresholds
        stop = fire & self.verified
        stopped = stop.any(axis=1)
        first = np.where(stopped, np.argmax(stop, axis=1), len(self.layers))
        before = np.arange(len(self.layers)) < first[:, None]
        rejected = (fire & ~self.verified & before).sum(axis=1)
        exit_layer = np.where(stopped, self.layers[np.minimum(first, len(self.layers) - 1)], self.n_layer - 1)
        wrong = stopped & ~self.correct[np.arange(len(first)), np.minimum(first, len(self.layers) - 1)]
        return Decisions(exit_layer, wrong, rejected)


@dataclass
class PathPoint:
    thresholds: np.ndarray  # per predictor layer, in ExitTable.layers order
    errors: int
    saved: float            # layers of compute saved in all, by the cost model


def greedy_path(table: ExitTable, cost: CostModel, max_errors: int,
                progress: Callable[[], None] = lambda: None) -> list[PathPoint]:
    """Lower one threshold at a time, best saving per added error first, while errors <= max_errors."""
    grid = np.concatenate([[NEVER], GRID])
    index = np.zeros(len(table.layers), dtype=int)  # into grid: every layer at NEVER
    baseline = cost.full * len(table.prob)

    def evaluate(idx: np.ndarray) -> tuple[int, float]:
        d = table.decide(grid[idx])
        return int(d.wrong.sum()), float(baseline - cost.token(d.exit_layer, d.rejected).sum())

    errors, saved = 0, 0.0
    path = [PathPoint(grid[index].copy(), errors, saved)]
    while True:
        best = None
        for j in range(len(index)):
            for stride in STRIDES:
                if index[j] + stride >= len(grid):
                    break
                trial = index.copy()
                trial[j] += stride
                e, s = evaluate(trial)
                if s <= saved or e > max_errors:
                    continue
                score = (s - saved) / (max(e - errors, 0) + 1)
                if best is None or score > best[0]:
                    best = (score, trial, e, s)
        if best is None:
            return path
        _, index, errors, saved = best
        path.append(PathPoint(grid[index].copy(), errors, saved))
        progress()


@dataclass
class LevelChoice:
    level: QualityLevel
    heldout: Simulation  # the decisions at this level on the test split, K/V exact
    index: int           # the point of the search's path it takes
    engine: Replay | None = None  # the engine's own run of it (check_with_engine)


class LevelSearch:
    """The path on the calibration split, and the levels taken from it."""

    def __init__(self, ds: Dataset, probes: Probes, predictors: dict[int, MLPPredictor], calib: np.ndarray,
                 test: np.ndarray, cost: CostModel, schedule: Schedule, max_errors_share: float,
                 progress: Callable[[], None] = lambda: None):
        self.ds, self.probes, self.predictors, self.calib, self.test = ds, probes, predictors, calib, test
        self.schedule = schedule
        table = ExitTable(probes, predictors, calib, ds.n_layer)
        self.layers = table.layers.tolist()
        self.path = greedy_path(table, cost, int(max_errors_share * len(calib)), progress)

    def level_at(self, index: int, quality: float) -> tuple[QualityLevel, Simulation]:
        """The path's point as a level: its offline set covers the exits every-layer checking finds on the
        calibration split; the simulation replays the engine's online schedule there (K/V exact)."""
        thresholds = dict(zip(self.layers, self.path[index].thresholds.tolist()))
        every = simulate(self.ds, self.probes, self.predictors, thresholds, self.calib, None)
        schedule = Schedule(offline_layers(every, self.ds.n_layer), self.schedule.window, list(self.schedule.offsets))
        online = simulate(self.ds, self.probes, self.predictors, thresholds, self.calib, schedule)
        return QualityLevel(quality, thresholds, schedule.offline), online

    def choose(self, quality: float, limit: int) -> int:
        """The furthest point within `quality`'s budget, no further than `limit`, with the online schedule."""
        budget = (1 - quality) * len(self.calib)
        end = min(limit, max(i for i, point in enumerate(self.path) if point.errors <= budget))
        if (1 - self.level_at(end, quality)[1].agreement) * len(self.calib) <= budget:
            return end
        return bisect_last(0, end, lambda i: (1 - self.level_at(i, quality)[1].agreement) * len(self.calib) <= budget)

    def choice(self, index: int, quality: float) -> LevelChoice:
        """The level at `index` with its held-out expectations (test split, K/V exact)."""
        level, _ = self.level_at(index, quality)
        held = simulate(self.ds, self.probes, self.predictors, level.thresholds, self.test,
                        Schedule(level.offline, self.schedule.window, list(self.schedule.offsets)))
        level = dataclasses.replace(level, exit_rate=held.exit_rate, agreement=held.agreement,
                                    layer_speedup=self.ds.n_layer / (held.avg_exit_layer(self.ds.n_layer) + 1),
                                    verify_fail_rate=held.verify_fail_rate)
        return LevelChoice(level, held, index)


def bisect_last(good: int, bad: int, holds: Callable[[int], bool], steps: int | None = None) -> int:
    """The last index in [good, bad) where `holds`, given holds(good) and not holds(bad), assuming one
    boundary; `steps` caps the probes (then the furthest index known to hold)."""
    while bad - good > 1 and steps != 0:
        mid = (good + bad) // 2
        if holds(mid):
            good = mid
        else:
            bad = mid
        steps = None if steps is None else steps - 1
    return good


def choose_levels(search: LevelSearch, levels: tuple[float, ...],
                  progress: Callable[[], None] = lambda: None) -> list[LevelChoice]:
    """Each level's point on the path, K/V exact; a higher level never goes further than a lower one."""
    choices, limit = [], len(search.path) - 1
    for quality in sorted(levels):
        limit = search.choose(quality, limit)
        choices.append(search.choice(limit, quality))
        progress()
    return choices


def check_with_engine(search: LevelSearch, choices: list[LevelChoice], measure: Callable[[QualityLevel], Replay],
                      refine: int = 2, progress: Callable[[], None] = lambda: None) -> list[LevelChoice]:
    """The levels as the engine runs them. Its KV modes approximate (fill) or leave out (mask) the K/V an
    exited token skipped, and later tokens read them, so a reply drifts from the full model by more than
    the exits' own errors. `measure` replays a level through the engine; a level that falls short steps
    back along the path (`refine` bisection steps, else to the last point that held). Each level's
    exit_rate, agreement and layer_speedup are then the engine's."""
    measured: dict[int, Replay] = {}

    def replayed(index: int, quality: float) -> Replay:
        if index not in measured:
            measured[index] = measure(search.level_at(index, quality)[0])
            progress()
        return measured[index]

    def agreement(index: int, quality: float) -> float:
        return 1.0 if index == 0 else replayed(index, quality).agreement  # the path starts with no exits

    checked, limit = [], len(search.path) - 1
    for choice in choices:
        quality = choice.level.quality
        index = min(choice.index, limit)
        if agreement(index, quality) < quality:
            index = bisect_last(0, index, lambda i: agreement(i, quality) >= quality, refine)
        choice = search.choice(index, quality) if index != choice.index else choice
        engine = replayed(index, quality)
        choice.level = dataclasses.replace(choice.level, exit_rate=engine.exit_rate, agreement=engine.agreement,
                                           layer_speedup=search.ds.n_layer / (engine.avg_exit_layer + 1),
                                           verify_fail_rate=engine.verify_fail_rate)
        choice.engine = engine
        checked.append(choice)
        limit = index
    return checked
