"""Stage 4: per-layer exit predictors, the offline schedule, and a simulation of the engine's decisions.

Features are computed by predictor.rule.probe_features, the code the engine runs, on the step's
candidates (the prompt-lookup one, then the draft's) read through each layer's final-normed hidden
state. The delta feature is taken against a randomly chosen earlier layer (or none), as the online
schedule leaves gaps of varying size.

Label of (step, layer): the candidates' argmax at the layer is the full model's token, which is what a
head-free exit emits. A verified exit emits the layer's own top-1 when it is a candidate, and whenever
that is right the candidates' argmax is too, so one predictor per layer serves both kinds; the last
layer's says whether the output head can be skipped. Each level's kinds and thresholds are chosen,
all layers together, in levels.py.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPClassifier

from specee_edge.calibrate.dataset import Dataset
from specee_edge.draft import LinearDraft
from specee_edge.exits import ExitKind
from specee_edge.pack.format import LayerExit, Schedule
from specee_edge.predictor import MLPPredictor
from specee_edge.predictor.rule import candidate_argmax, candidate_probs, decide, probe_features
from specee_edge.predictor.schedule import OnlineSchedule
from specee_edge.runtime.weights import TargetWeights

GAPS = (0, 1, 2, 3, 4)  # 0: the first checked layer of a token (no previous probs)
MIN_POSITIVES = 10
OFFLINE_COVERAGE = 0.8


@dataclass
class Probes:
    """Per step: the draft's candidates and every layer's candidate logits."""

    candidates: np.ndarray  # int [N, k]
    logits: np.ndarray      # float32 [N, n_layer, k]
    verified: np.ndarray    # bool [N, n_layer]: the layer's top-1 is a candidate (verification passes)
    correct: np.ndarray     # bool [N, n_layer]: the layer's top-1 is the final top-1
    head_free: np.ndarray   # bool [N, n_layer]: the candidates' argmax at the layer is the final top-1 (the label)

    def exit_correct(self, kind: ExitKind) -> np.ndarray:
        """Whether an exit of `kind` at (step, layer) emits the full model's token."""
        return self.head_free if kind == ExitKind.HEAD_FREE else self.correct


def probe_all(ds: Dataset, draft: LinearDraft, weights: TargetWeights, lookup: np.ndarray) -> Probes:
    """lookup: each row's prompt-lookup candidate (-1: none), merged with the draft's as the engine does."""
    emb = weights.embeddings(ds.token)
    candidates = draft.merged_top_k(draft.scores(emb, ds.prev_final.astype(np.float32)), lookup)
    rows = weights.lm_head[candidates]  # [N, k, n_embd]
    logits = np.empty((len(ds.token), ds.n_layer, draft.k), dtype=np.float32)
    for il in range(ds.n_layer):
        logits[:, il] = weights.capped(np.einsum("nd,nkd->nk", weights.final_norm(ds.hidden[:, il].astype(np.float32)), rows))
    verified = (ds.top1[:, :, None] == candidates[:, None, :]).any(axis=2)
    correct = ds.top1 == ds.final[:, None]
    head_free = np.take_along_axis(candidates, candidate_argmax(logits), axis=1) == ds.final[:, None]
    return Probes(candidates, logits, verified, correct, head_free)


def layer_features(probes: Probes, rows: np.ndarray, layer: int, gaps: np.ndarray) -> np.ndarray:
    """Features of `layer` for `rows`, each against the layer `gap` below it (gap 0: no previous check)."""
    prev_layer = layer - gaps
    has_prev = ((gaps > 0) & (prev_layer >= 0))[:, None]
    prev_probs = candidate_probs(probes.logits[rows, np.maximum(prev_layer, 0)])
    # zeros as the previous probs make the delta equal p, exactly as at a token's first check
    return probe_features(probes.logits[rows, layer], np.where(has_prev, prev_probs, np.float32(0)))[0]


def train_predictors(probes: Probes, train: np.ndarray, layers: range, *, hidden: int, seed: int,
                     progress: Callable[[int], None] = lambda il: None) -> dict[int, MLPPredictor]:
    """One MLP for each of `layers` with enough positive and negative steps."""
    rng = np.random.default_rng(seed)
    predictors = {}
    for il in layers:
        y = probes.head_free[train, il]
        if y.sum() >= MIN_POSITIVES and (~y).sum() >= MIN_POSITIVES:
            x = layer_features(probes, train, il, rng.choice(GAPS, len(train)))
            predictors[il] = fit_mlp(x, y, hidden=hidden, seed=seed)
        progress(il)
    return predictors


def fit_mlp(x: np.ndarray, y: np.ndarray, *, hidden: int, seed: int) -> MLPPredictor:
    """scikit-learn's MLP on standardized features, the scaling folded into the first layer."""
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
    batch = min(1024, max(1, len(x) * 9 // 10))  # early stopping holds out 10%
    clf = MLPClassifier(hidden_layer_sizes=(hidden,), learning_rate_init=1e-3, batch_size=batch, max_iter=100,
                        early_stopping=True, n_iter_no_change=8, random_state=seed)
    with warnings.catch_warnings():  # early stopping ends most fits before max_iter: not a failure
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit((x - mean) / std, y)
    w0 = clf.coefs_[0].T / std  # [hidden, n_in]
    b0 = clf.intercepts_[0] - w0 @ mean
    weights = [w0, *(w.T for w in clf.coefs_[1:])]
    biases = [b0, *clf.intercepts_[1:]]
    return MLPPredictor([np.asarray(w, np.float32) for w in weights], [np.asarray(b, np.float32) for b in biases])


@dataclass
class Simulation:
    """The engine's decisions replayed on held-out steps, with K/V exact."""

    n_steps: int
    exit_layers: list[int | None]
    agreement: float
    predictor_calls_per_token: float
    verify_fail_rate: float
    layer_hits: Counter = field(default_factory=Counter)
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # the step of each exit_layers entry

    def avg_exit_layer(self, n_layer: int) -> float:
        return float(np.mean([n_layer - 1 if e is None else e for e in self.exit_layers]))

    @property
    def exit_rate(self) -> float:
        return float(np.mean([e is not None for e in self.exit_layers]))

    def exit_rows(self) -> dict[int, np.ndarray]:
        """Per exit layer, the steps that left there."""
        layers = np.array([-1 if e is None else e for e in self.exit_layers])
        return {int(il): self.rows[layers == il] for il in np.unique(layers) if il >= 0}


def simulate(ds: Dataset, probes: Probes, predictors: dict[int, MLPPredictor], exits: dict[int, LayerExit],
             rows: np.ndarray, schedule: Schedule | None) -> Simulation:
    """Replay steps answer by answer through the exit rule; schedule None checks every layer that is on."""
    on = sorted(il for il in predictors if exits[il].on)
    exit_layers, order, correct, calls, verified_positives, rejections = [], [], 0, 0, 0, 0
    for answer in np.unique(ds.answer[rows]):
        online = OnlineSchedule(schedule, set(on)) if schedule else None
        for row in rows[ds.answer[rows] == answer]:
            layers = online.layers() if online else on
            d = decide(layers, probes.logits[row, layers], probes.verified[row, layers], predictors, exits)
            if online:
                online.record_exit(d.exit_layer)
            calls += d.probes
            rejections += d.rejections
            verified_positives += d.rejections + (d.kind == ExitKind.VERIFIED)
            exit_layers.append(d.exit_layer)
            order.append(row)
            correct += d.exit_layer is None or bool(probes.exit_correct(d.kind)[row, d.exit_layer])
    n = len(exit_layers)
    return Simulation(n, exit_layers, correct / n, calls / n, rejections / verified_positives if verified_positives else 0.0,
                      Counter(e for e in exit_layers if e is not None), np.array(order, dtype=np.int64))


def offline_layers(sim: Simulation, n_layer: int) -> list[int]:
    """The fewest most-frequent exit layers that cover OFFLINE_COVERAGE of the exits, at most n_layer // 4."""
    total = sum(sim.layer_hits.values())
    chosen, covered = [], 0
    for il, hits in sim.layer_hits.most_common(max(1, n_layer // 4)):
        if total and covered >= OFFLINE_COVERAGE * total:
            break
        chosen.append(il)
        covered += hits
    return sorted(chosen)
