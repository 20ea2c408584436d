"""`specee-edge calibrate`: answers -> lens -> draft head -> predictors -> quality levels -> temperatures -> pack.

Every stage keeps its result in the work directory; a rerun with the same settings skips what is
done (collection resumes prompt by prompt).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from threadpoolctl import threadpool_limits

from specee_edge.calibrate import dataset as dataset_stage
from specee_edge.calibrate.collect import Collector, Shard, forward_ms, round_sampling, shard_path
from specee_edge.calibrate.draft_fit import DRAFT_RIDGE, fit_draft
from specee_edge.calibrate.levels import DEFAULT_QUALITY, LEVELS, CostModel, LevelSearch, check_with_engine, choose_levels
from specee_edge.calibrate.predictor_fit import (
    Probes,
    layer_features,
    probe_all,
    train_predictors,
)
from specee_edge.calibrate.replay import Replay, pick_answers, replay
from specee_edge.calibrate.report import CalibrationReport, LayerReport, LevelReport
from specee_edge.calibrate.temperature import fit_temperatures
from specee_edge.data.prompts import load_prompts, split
from specee_edge.draft import LinearDraft
from specee_edge.draft.lookup import LOOKUP_MAX_N
from specee_edge.engine import Engine, EngineConfig
from specee_edge.errors import SpecEEError
from specee_edge.pack import Pack, QualityLevel, Schedule, target_identity, write_pack
from specee_edge.pack.format import DraftHead
from specee_edge.pack.convert import predictors_from_npz, predictors_to_npz
from specee_edge.predictor import MLPPredictor
from specee_edge.runtime.weights import TargetWeights
from specee_edge.threads import default_threads

CACHE = Path.home() / ".cache" / "specee-edge" / "calibrate"
SPLIT = (0.6, 0.2, 0.2)  # prompts: train / threshold calibration / test
COLLECTION = 2  # how answers are collected: a work dir from another version is not reused
MAX_ROUNDS = 16  # answers per prompt at most (the first greedy, the others sampled)


@dataclass
class CalibrateConfig:
    model: Path
    output: Path
    workdir: Path | None = None
    tokens: int = 65000       # answer tokens (steps) to collect
    prompts: Path | None = None
    k: int = 4
    threads: int = field(default_factory=default_threads)
    seed: int = 0
    max_answer: int = 256     # tokens per answer
    draft_vocab: int = 4096
    draft_ridge: float = DRAFT_RIDGE
    lookup: int = LOOKUP_MAX_N  # prompt lookup's longest n-gram (its candidate takes the first slot); 0: none
    hidden: int = 512         # predictor MLP width
    levels: tuple[float, ...] = LEVELS  # agreement targets, one set of thresholds each
    quality: float = DEFAULT_QUALITY    # the default level (one of `levels`)
    replay_tokens: int = 2000           # held-out steps the engine replays per candidate level
    first_layer: int = 0      # no predictor below it; 0: n_layer // 4 (shallow layers hardly ever agree)
    command: str = ""


def progress_bar(console: Console) -> Progress:
    # auto_refresh=False: a refresh thread contends for the GIL with the decode loop
    return Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, auto_refresh=False)


class Calibration:
    def __init__(self, config: CalibrateConfig, console: Console):
        self.config = config
        self.console = console
        self.target = target_identity(config.model)
        self.workdir = config.workdir or CACHE / self.target.fingerprint[:16]
        self.first_layer = config.first_layer or self.target.n_layer // 4
        self.seconds: dict[str, float] = {}
        self._check_workdir()

    def _check_workdir(self) -> None:
        """Collected answers are only reusable for the same model, prompts and answer length."""
        (self.workdir / "collect").mkdir(parents=True, exist_ok=True)
        key = {"fingerprint": self.target.fingerprint, "prompts": str(self.config.prompts or "built-in"),
               "max_answer": self.config.max_answer, "collection": COLLECTION}
        path = self.workdir / "collect.json"
        if path.exists() and json.loads(path.read_text()) != key:
            raise SpecEEError(f"work dir {self.workdir} holds answers for another model or prompt set: "
                              "pass another --work-dir or delete it")
        path.write_text(json.dumps(key))

    # --- stages ------------------------------------------------------------------------------

    def collect(self, progress: Progress) -> list[Shard]:
        """Answers until `tokens` steps: every prompt greedily, then again with sampling, round by round."""
        prompts = load_prompts(self.config.prompts)
        task = progress.add_task("1/7 answers (tokens)", total=self.config.tokens)
        shards: list[Shard] = []
        steps = 0
        collector = None
        t0 = time.perf_counter()
        answers = ((round_, index, prompt) for round_ in range(MAX_ROUNDS) for index, prompt in enumerate(prompts))
        try:
            for round_, index, prompt in answers:
                if steps >= self.config.tokens:
                    break
                path = shard_path(self.workdir, round_, index)
                if path.exists():
                    shard = Shard.load(path)
                else:
                    collector = collector or Collector(self.config.model, n_threads=self.config.threads,
                                                       max_answer=self.config.max_answer)
                    with threadpool_limits(limits=1, user_api="blas"):  # numpy's threads would fight the decode's
                        shard = collector.answer(index, prompt, round_sampling(round_, index))
                    shard.save(path)
                shards.append(shard)
                steps += shard.steps
                progress.update(task, advance=shard.steps)
                progress.refresh()
        finally:
            if collector:
                collector.close()
        self.seconds["answers"] = time.perf_counter() - t0
        if len(shards) < 5:
            raise SpecEEError(f"only {len(shards)} answers: calibration needs at least 5 (more --tokens or prompts)")
        return shards

    def dataset(self, shards: list[Shard], weights: TargetWeights, progress: Progress) -> dataset_stage.Dataset:
        path = self.workdir / f"dataset-{len(shards)}-from{self.first_layer}.npz"
        t0 = time.perf_counter()
        if path.exists():
            ds = dataset_stage.load(path)
        else:
            task = progress.add_task("2/7 logit lens (steps)", total=sum(len(s.hidden) for s in shards))

            def advance(n: float) -> None:
                progress.update(task, advance=n)
                progress.refresh()

            ds = dataset_stage.build(shards, weights, self.first_layer, advance)
            dataset_stage.save(ds, path)
        self.seconds["lens"] = time.perf_counter() - t0
        return ds

    def settings_key(self, n_shards: int, head: DraftHead) -> str:
        """What the predictors (and so the levels' engine runs) depend on, for the names of cached
        results: the data, the settings, and the draft head itself (its candidates are their features)."""
        c = self.config
        draft = hashlib.sha256(np.ascontiguousarray(head.tensors["fc.weight"]).tobytes()).hexdigest()[:8]
        return f"{n_shards}-from{self.first_layer}-k{c.k}-d{draft}-l{c.lookup}-h{c.hidden}-s{c.seed}"

    def predictors(self, probes: Probes, train: np.ndarray, n_shards: int, head: DraftHead,
                   advance) -> dict[int, MLPPredictor]:
        """Trained once per data and settings: the levels only move the thresholds."""
        c = self.config
        path = self.workdir / f"predictors-{self.settings_key(n_shards, head)}.npz"
        if path.exists():
            return predictors_from_npz(path)
        predictors = train_predictors(probes, train, hidden=c.hidden, seed=c.seed, progress=advance)
        predictors_to_npz(path, predictors)
        return predictors

    def run(self) -> tuple[Pack, CalibrationReport]:
        config = self.config
        weights = TargetWeights(config.model)
        with progress_bar(self.console) as progress:
            shards = self.collect(progress)
            ds = self.dataset(shards, weights, progress)
            train_p, calib_p, test_p = split(int(ds.prompt.max()) + 1, config.seed, SPLIT)
            train, calib, test = ds.rows(train_p), ds.rows(calib_p), ds.rows(test_p)
            # the candidates the engine will see: the prompt-lookup one first, then the draft head's
            lookup = dataset_stage.lookup_column(shards, config.lookup)
            prompts = load_prompts(config.prompts)
            categories = np.array([prompts[p].category for p in ds.prompt.tolist()])

            task = progress.add_task("3/7 draft head", total=1)
            t0 = time.perf_counter()
            head, draft_report = fit_draft(ds, weights, train, test, k=config.k, vocab=config.draft_vocab,
                                           forward_ms=forward_ms(config.model, config.threads), lookup=lookup,
                                           categories=categories, ridge=config.draft_ridge)
            draft = LinearDraft(head, weights, config.k)
            self.seconds["draft"] = time.perf_counter() - t0
            progress.update(task, advance=1)
            progress.refresh()

            task = progress.add_task("4/7 predictors (layers)", total=ds.n_layer - 1)
            t0 = time.perf_counter()
            probes = probe_all(ds, draft, weights, lookup)

            def advance_task(task_id):
                def advance(*_) -> None:
                    progress.update(task_id, advance=1)
                    progress.refresh()
                return advance

            predictors = self.predictors(probes, train, len(shards), head, advance_task(task))
            self.seconds["predictors"] = time.perf_counter() - t0

            task = progress.add_task("5/7 temperatures (layers)", total=len(predictors))
            t0 = time.perf_counter()
            temperatures = fit_temperatures(ds, weights, sorted(predictors), train, test, config.seed, advance_task(task))
            self.seconds["temperatures"] = time.perf_counter() - t0

            task = progress.add_task("6/7 quality levels (moves)", total=None)
            t0 = time.perf_counter()
            search = LevelSearch(ds, probes, predictors, calib, test, CostModel.of(weights.reader), Schedule(offline=[]),
                                 1 - min(config.levels), advance_task(task))
            choices = choose_levels(search, config.levels, advance_task(task))
            self.seconds["levels"] = time.perf_counter() - t0

            task = progress.add_task("7/7 levels in the engine (runs)", total=None)
            t0 = time.perf_counter()
            provisional = self.workdir / "provisional.specee.gguf"
            write_pack(provisional, self._pack(head, predictors, choices, temperatures.temperatures, {}))
            engine = Engine(config.model, pack=provisional, config=EngineConfig(n_ctx=2048, n_threads=config.threads))
            try:
                answers = pick_answers(shards, calib_p, config.replay_tokens)
                choices = check_with_engine(search, choices, self._cached_replay(engine, answers, self.settings_key(len(shards), head)),
                                            progress=advance_task(task))
            finally:
                engine.close()
            self.seconds["engine"] = time.perf_counter() - t0

        report = self._report(ds, shards, train, test, draft_report, head.vocab_map, probes, predictors, choices,
                              temperatures)
        pack = self._pack(head, predictors, choices, temperatures.temperatures, {
            "tool": f"specee-edge {version('specee-edge')}",
            "command": config.command,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model_file": config.model.name,
            "predictor": f"MLP {3 * config.k}->{config.hidden}->1 (scikit-learn), thresholds per quality level"
                         f" {', '.join(f'{q:g}' for q in config.levels)}",
            "draft": f"linear ridge head over {config.draft_vocab} tokens, q8_0"
                     + (f"; prompt lookup up to {config.lookup}-grams in the first slot" if config.lookup else ""),
            "settings": {k: v for k, v in asdict(config).items() if k not in ("model", "output", "workdir", "command")}
            | {"prompts": str(config.prompts or "built-in")},
            "report": report.to_dict(),
        })
        return pack, report

    def _cached_replay(self, engine: Engine, answers: list[Shard], key: str) -> Callable[[QualityLevel], Replay]:
        """Engine replays are the slow part of the levels: a rerun that only picks another default
        --quality (the same data and settings, so the same candidate levels) reads them back."""
        path = self.workdir / f"engine-replays-{key}.json"
        cache = json.loads(path.read_text()) if path.exists() else {}

        def measure(level: QualityLevel) -> Replay:
            key = json.dumps([self.config.seed, self.config.replay_tokens, sorted(level.thresholds.items()),
                              level.offline, len(answers)])
            if key not in cache:
                cache[key] = asdict(replay(engine, level, answers))
                path.write_text(json.dumps(cache))
            return Replay(**cache[key])

        return measure

    def _pack(self, head, predictors, choices, temperatures, provenance) -> Pack:
        levels = [choice.level for choice in choices]
        default = next(level for level in levels if level.quality == self.config.quality)
        return Pack(target=self.target, k=self.config.k, threshold=0.5, schedule=Schedule(offline=default.offline),
                    predictors=predictors, draft=head, levels=levels, default_quality=self.config.quality,
                    temperatures=temperatures, lookup_max_n=self.config.lookup, provenance=provenance)

    def _report(self, ds, shards, train, test, draft_report, draft_vocab, probes, predictors, choices,
                temperatures) -> CalibrationReport:
        default = next(c.level for c in choices if c.level.quality == self.config.quality)
        layers = []
        for il in sorted(predictors):
            p = predictors[il](layer_features(probes, test, il, np.full(len(test), 1)))
            y = probes.label[test, il]
            said = p > default.thresholds[il]
            layers.append(LayerReport(il, float(y.mean()), default.thresholds[il],
                                      float(y[said].mean()) if said.any() else 0.0,
                                      float(said[y].mean()) if y.any() else 0.0,
                                      temperatures.temperatures[il]))
        n_layer = ds.n_layer
        oracle = float(ds.oracle_exit()[test].mean())
        vocab = set(draft_vocab.tolist()) if draft_vocab is not None else None
        return CalibrationReport(
            model=self.config.model.name, n_layer=n_layer, prompts=int(ds.prompt.max()) + 1, answers=len(shards),
            tokens=len(ds.token), train_tokens=len(train), draft=draft_report, layers=layers,
            levels=[LevelReport.of(c, n_layer, ds.top1, vocab) for c in choices],
            default_quality=self.config.quality,
            oracle_avg_exit_layer=oracle, oracle_layer_speedup=n_layer / (oracle + 1),
            nll_raw=temperatures.nll_raw, nll_temperature=temperatures.nll_fitted, seconds=dict(self.seconds),
        )


def calibrate(config: CalibrateConfig, console: Console | None = None) -> CalibrationReport:
    console = console or Console(stderr=True)
    pack, report = Calibration(config, console).run()
    write_pack(config.output, pack)
    return report
