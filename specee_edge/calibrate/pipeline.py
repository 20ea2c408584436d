"""`specee-edge calibrate`: answers -> lens -> draft head -> predictors -> schedule -> pack.

Every stage keeps its result in the work directory; a rerun with the same settings skips what is
done (collection resumes prompt by prompt).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specee_edge.calibrate import dataset as dataset_stage
from specee_edge.calibrate.collect import Collector, Shard, forward_ms, shard_path
from specee_edge.calibrate.draft_fit import fit_draft
from specee_edge.calibrate.predictor_fit import (
    Probes,
    layer_features,
    offline_layers,
    probe_all,
    set_thresholds,
    simulate,
    train_predictors,
)
from specee_edge.calibrate.report import CalibrationReport, LayerReport
from specee_edge.data.prompts import load_prompts, split
from specee_edge.draft import LinearDraft
from specee_edge.errors import SpecEEError
from specee_edge.pack import Pack, Schedule, target_identity, write_pack
from specee_edge.pack.convert import predictors_from_npz, predictors_to_npz
from specee_edge.predictor import MLPPredictor
from specee_edge.runtime.weights import TargetWeights
from specee_edge.threads import default_threads

CACHE = Path.home() / ".cache" / "specee-edge" / "calibrate"
SPLIT = (0.6, 0.2, 0.2)  # prompts: train / threshold calibration / test


@dataclass
class CalibrateConfig:
    model: Path
    output: Path
    workdir: Path | None = None
    tokens: int = 16000       # answer tokens to collect
    prompts: Path | None = None
    k: int = 4
    threads: int = field(default_factory=default_threads)
    seed: int = 0
    max_answer: int = 256     # tokens per answer
    draft_vocab: int = 4096
    hidden: int = 512         # predictor MLP width
    quality: float = 0.99     # per-layer precision of exits, after verification
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
               "max_answer": self.config.max_answer}
        path = self.workdir / "collect.json"
        if path.exists() and json.loads(path.read_text()) != key:
            raise SpecEEError(f"work dir {self.workdir} holds answers for another model or prompt set: "
                              "pass another --work-dir or delete it")
        path.write_text(json.dumps(key))

    # --- stages ------------------------------------------------------------------------------

    def collect(self, progress: Progress) -> list[Shard]:
        prompts = load_prompts(self.config.prompts)
        task = progress.add_task("1/4 answers (tokens)", total=self.config.tokens)
        shards: list[Shard] = []
        collector = None
        t0 = time.perf_counter()
        try:
            for index, prompt in enumerate(prompts):
                if sum(len(s.hidden) - 1 for s in shards) >= self.config.tokens:
                    break
                path = shard_path(self.workdir, index)
                if path.exists():
                    shard = Shard.load(path)
                else:
                    collector = collector or Collector(self.config.model, n_threads=self.config.threads,
                                                       max_answer=self.config.max_answer)
                    shard = collector.answer(prompt)
                    shard.save(path)
                shards.append(shard)
                progress.update(task, advance=len(shard.hidden) - 1)
                progress.refresh()
        finally:
            if collector:
                collector.close()
        self.seconds["answers"] = time.perf_counter() - t0
        if len(shards) < 5:
            raise SpecEEError(f"only {len(shards)} prompts answered: calibration needs at least 5 (more --tokens or prompts)")
        return shards

    def dataset(self, shards: list[Shard], weights: TargetWeights, progress: Progress) -> dataset_stage.Dataset:
        path = self.workdir / f"dataset-{len(shards)}-from{self.first_layer}.npz"
        t0 = time.perf_counter()
        if path.exists():
            ds = dataset_stage.load(path)
        else:
            task = progress.add_task("2/4 logit lens (steps)", total=sum(len(s.hidden) for s in shards))

            def advance(n: float) -> None:
                progress.update(task, advance=n)
                progress.refresh()

            ds = dataset_stage.build(shards, weights, self.first_layer, advance)
            dataset_stage.save(ds, path)
        self.seconds["lens"] = time.perf_counter() - t0
        return ds

    def predictors(self, probes: Probes, train: np.ndarray, n_shards: int, advance) -> dict[int, MLPPredictor]:
        """Trained once per data and settings: --quality only moves the thresholds."""
        c = self.config
        path = self.workdir / f"predictors-{n_shards}-from{self.first_layer}-k{c.k}-v{c.draft_vocab}-h{c.hidden}-s{c.seed}.npz"
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
            train_p, calib_p, test_p = split(len(shards), config.seed, SPLIT)
            train, calib, test = ds.rows(train_p), ds.rows(calib_p), ds.rows(test_p)

            task = progress.add_task("3/4 draft head", total=1)
            t0 = time.perf_counter()
            head, draft_report = fit_draft(ds, weights, train, test, k=config.k, vocab=config.draft_vocab,
                                           forward_ms=forward_ms(config.model, config.threads))
            draft = LinearDraft(head, weights, config.k)
            self.seconds["draft"] = time.perf_counter() - t0
            progress.update(task, advance=1)
            progress.refresh()

            task = progress.add_task("4/4 predictors (layers)", total=ds.n_layer - 1)
            t0 = time.perf_counter()
            probes = probe_all(ds, draft, weights)

            def advance(_layer: int) -> None:
                progress.update(task, advance=1)
                progress.refresh()

            predictors = self.predictors(probes, train, len(shards), advance)
            thresholds = set_thresholds(probes, predictors, calib, config.quality)
            # layers that cannot reach the quality never exit: leave them out of the pack
            predictors = {il: p for il, p in predictors.items() if thresholds[il] < 1.0}
            thresholds = {il: thresholds[il] for il in predictors}
            every_layer = simulate(ds, probes, predictors, thresholds, calib, None)
            schedule = Schedule(offline=offline_layers(every_layer, ds.n_layer))
            sim = simulate(ds, probes, predictors, thresholds, test, schedule)
            self.seconds["predictors"] = time.perf_counter() - t0

        report = self._report(ds, shards, train, test, draft_report, probes, predictors, thresholds, schedule, sim)
        pack = Pack(
            target=self.target, k=config.k, threshold=0.5, schedule=schedule, predictors=predictors, draft=head,
            thresholds=thresholds,
            provenance={
                "tool": f"specee-edge {version('specee-edge')}",
                "command": config.command,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "model_file": config.model.name,
                "predictor": f"MLP {3 * config.k}->{config.hidden}->1 (scikit-learn), per-layer thresholds at quality {config.quality}",
                "draft": f"linear ridge head over {config.draft_vocab} tokens, q8_0",
                "settings": {k: v for k, v in asdict(config).items() if k not in ("model", "output", "workdir", "command")}
                | {"prompts": str(config.prompts or "built-in")},
                "report": report.to_dict(),
            },
        )
        return pack, report

    def _report(self, ds, shards, train, test, draft_report, probes, predictors, thresholds, schedule, sim) -> CalibrationReport:
        layers = []
        for il in sorted(predictors):
            p = predictors[il](layer_features(probes, test, il, np.full(len(test), 1)))
            y = probes.label[test, il]
            said = p > thresholds[il]
            layers.append(LayerReport(il, float(y.mean()), thresholds[il],
                                      float(y[said].mean()) if said.any() else 0.0,
                                      float(said[y].mean()) if y.any() else 0.0))
        n_layer = ds.n_layer
        oracle = float(ds.oracle_exit()[test].mean())
        avg = sim.avg_exit_layer(n_layer)
        return CalibrationReport(
            model=self.config.model.name, n_layer=n_layer, prompts=len(shards), tokens=len(ds.token),
            train_tokens=len(train), draft=draft_report, layers=layers, offline_layers=schedule.offline,
            avg_exit_layer=avg, exit_rate=sim.exit_rate, agreement=sim.agreement,
            predictor_calls_per_token=sim.predictor_calls_per_token, verify_fail_rate=sim.verify_fail_rate,
            oracle_avg_exit_layer=oracle, expected_layer_speedup=n_layer / (avg + 1),
            oracle_layer_speedup=n_layer / (oracle + 1),
            exit_histogram={int(k): int(v) for k, v in sorted(sim.layer_hits.items())}, seconds=dict(self.seconds),
        )


def calibrate(config: CalibrateConfig, console: Console | None = None) -> CalibrationReport:
    console = console or Console(stderr=True)
    pack, report = Calibration(config, console).run()
    write_pack(config.output, pack)
    return report
