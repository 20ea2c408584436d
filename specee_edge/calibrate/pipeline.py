"""`specee-edge calibrate`: answers -> lens -> draft head -> predictors -> costs -> quality levels ->
the levels in the engine -> exact mode -> temperatures -> pack.

The prompts are split three ways: the draft head and the predictors are trained on the first part;
every choice after that is made on the second (each level's exits, whether it pays, the lossy default,
the temperatures, the costs' timed text); the figures the pack stores for each level come from the
engine on the third, prompts nothing was chosen on, and so does the name a level ships under: the
agreement the low end of its held-out interval reaches.

Collection, the lens and the predictors keep their results in the work directory; a rerun with the
same settings skips them (collection resumes prompt by prompt).
"""

from __future__ import annotations

import hashlib
import json
import time
import dataclasses
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from threadpoolctl import threadpool_limits

from specee_edge.calibrate import dataset as dataset_stage
from specee_edge.calibrate.collect import Collector, Shard, round_sampling, shard_path
from specee_edge.calibrate.draft_fit import DRAFT_RIDGE, fit_draft
from specee_edge.calibrate.exact import ExactReport, choose_exact, prompt_tokens, with_exact
from specee_edge.calibrate.levels import (LEVELS, LevelChoice, LevelSearch, check_with_engine, choose_levels,
                                          keep_promises, pays, shipped_quality, turned_off)
from specee_edge.calibrate.predictor_fit import Probes, layer_features, probe_all, simulate, train_predictors
from specee_edge.calibrate.replay import identical_answers, pick_answers, replay
from specee_edge.calibrate.report import CalibrationReport, LayerReport, LevelReport
from specee_edge.calibrate.temperature import fit_temperatures
from specee_edge.data.prompts import CALIBRATION_SPLIT, load_prompts, split
from specee_edge.draft import LinearDraft
from specee_edge.draft.lookup import LOOKUP_MAX_N
from specee_edge.engine import Engine, EngineConfig
from specee_edge.errors import SpecEEError
from specee_edge.pack import Pack, QualityLevel, Schedule, target_identity, write_pack
from specee_edge.pack.format import EXACT_QUALITY, IDENTICAL_FLOOR, DraftHead
from specee_edge.pack.convert import predictors_from_npz, predictors_to_npz
from specee_edge.predictor import MLPPredictor
from specee_edge.runtime import Model
from specee_edge.runtime.costs import ROUNDS, DraftSetup, TokenCosts, measure_costs
from specee_edge.runtime.weights import TargetWeights
from specee_edge.threads import default_threads

CACHE = Path.home() / ".cache" / "specee-edge" / "calibrate"
COLLECTION = 2  # how answers are collected: a work dir from another version is not reused
MAX_ROUNDS = 16  # answers per prompt at most (the first greedy, the others sampled)
STEPS = 9  # the stages, for the progress bars
# the lossy default, unless --quality names one: the fastest whose agreement on the calibration split reaches AGREEMENT_FLOOR
# and, for models that chat, whose greedy answers to code prompts stay identical to the full model's in at
# least IDENTICAL_FLOOR of them (one wrong token can break a program)
AGREEMENT_FLOOR = 0.98
COST_ANSWERS = 3  # calibration-split greedy answers the cost lanes decode ...
COST_TOKENS = 32  # ... steps of each, in each of the cost rounds


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
    levels: tuple[float, ...] = LEVELS  # agreement targets, one set of exits each
    quality: float | None = None        # the default level (one of `levels`); None: chosen by the floors above
    replay_tokens: int = 2000           # calibration-split steps the engine replays per candidate level
    heldout_tokens: int = 4000          # test-split steps behind each level's stored agreement
    identical_tokens: int = 64          # tokens of each held-out greedy answer compared with the full model's
    exact_prompts: int = 4              # prompts per split that exact mode's candidates decode (calibration, held out)
    exact_tokens: int = 48              # ... tokens each
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
        self.greedy: list[Shard] = []
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
        """Answers until `tokens` steps: every prompt greedily, then again with sampling, round by round
        (self.greedy: the first round's, the full model's greedy answers)."""
        prompts = load_prompts(self.config.prompts)
        task = progress.add_task(f"1/{STEPS} answers (tokens)", total=self.config.tokens)
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
                if round_ == 0:
                    self.greedy.append(shard)
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
            task = progress.add_task(f"2/{STEPS} logit lens (steps)", total=sum(len(s.hidden) for s in shards))

            def advance(n: float) -> None:
                progress.update(task, advance=n)
                progress.refresh()

            ds = dataset_stage.build(shards, weights, self.first_layer, advance)
            dataset_stage.save(ds, path)
        self.seconds["lens"] = time.perf_counter() - t0
        return ds

    def settings_key(self, n_shards: int, head: DraftHead) -> str:
        """What the predictors depend on, for the name of their cached file: the data, the settings, and
        the draft head itself (its candidates are their features)."""
        c = self.config
        draft = hashlib.sha256(np.ascontiguousarray(head.tensors["fc.weight"]).tobytes()).hexdigest()[:8]
        return f"{n_shards}-from{self.first_layer}-k{c.k}-d{draft}-l{c.lookup}-h{c.hidden}-s{c.seed}-hf"

    def predictors(self, probes: Probes, train: np.ndarray, n_shards: int, head: DraftHead,
                   advance) -> dict[int, MLPPredictor]:
        """Trained once per data and settings: the levels only choose among them."""
        c = self.config
        path = self.workdir / f"predictors-{self.settings_key(n_shards, head)}.npz"
        if path.exists():
            return predictors_from_npz(path)
        predictors = train_predictors(probes, train, range(self.first_layer, self.target.n_layer),
                                      hidden=c.hidden, seed=c.seed, progress=advance)
        predictors_to_npz(path, predictors)
        return predictors

    def costs(self, draft: LinearDraft, predictor: MLPPredictor, answers: list[Shard], advance) -> TokenCosts:
        """What a layer, the head, the draft, a check, a stop and a fill cost here (runtime/costs.py),
        timed on the first COST_TOKENS steps of a few greedy answers."""
        setup = DraftSetup(draft.runtime_args(), (predictor.weights, predictor.biases))
        timed = [(shard.tokens[: shard.start + 1 + COST_TOKENS].tolist(), shard.start + 1) for shard in answers]
        with threadpool_limits(limits=1, user_api="blas"):
            return measure_costs(self.config.model, setup, timed, n_threads=self.config.threads, k=self.config.k,
                                 seed=self.config.seed, advance=advance)

    def run(self) -> tuple[Pack, CalibrationReport]:
        config = self.config
        weights = TargetWeights(config.model)
        prompts = load_prompts(config.prompts)
        with progress_bar(self.console) as progress:
            def stage(name: str, total: float | None):
                task = progress.add_task(f"{len(progress.tasks) + 1}/{STEPS} {name}", total=total)

                def advance(*_) -> None:
                    progress.update(task, advance=1)
                    progress.refresh()
                return advance

            shards = self.collect(progress)
            ds = self.dataset(shards, weights, progress)
            train_p, calib_p, test_p = split(int(ds.prompt.max()) + 1, config.seed, CALIBRATION_SPLIT)
            train, calib, test = ds.rows(train_p), ds.rows(calib_p), ds.rows(test_p)
            # the candidates the engine will see: the prompt-lookup one first, then the draft head's
            lookup = dataset_stage.lookup_column(shards, config.lookup)
            categories = np.array([prompts[p].category for p in ds.prompt.tolist()])

            advance = stage("draft head", 1)
            t0 = time.perf_counter()
            head, draft_report = fit_draft(ds, weights, train, test, k=config.k, vocab=config.draft_vocab,
                                           lookup=lookup, categories=categories,
                                           eog_tokens=Model(config.model).eog_tokens(), ridge=config.draft_ridge)
            draft = LinearDraft(head, weights, config.k)
            self.seconds["draft"] = time.perf_counter() - t0
            advance()

            advance = stage("predictors (layers)", self.target.n_layer - self.first_layer)
            t0 = time.perf_counter()
            probes = probe_all(ds, draft, weights, lookup)
            predictors = self.predictors(probes, train, len(shards), head, advance)
            self.seconds["predictors"] = time.perf_counter() - t0

            calib_greedy = [shard for shard in self.greedy if shard.prompt in calib_p]
            heldout_greedy = [shard for shard in self.greedy if shard.prompt in test_p]
            cost_answers = (calib_greedy or self.greedy)[:COST_ANSWERS]
            advance = stage("costs on this machine (steps)",
                            ROUNDS * sum(min(COST_TOKENS, shard.steps) for shard in cost_answers))
            t0 = time.perf_counter()
            costs = self.costs(draft, predictors[max(predictors)], cost_answers, advance)
            self.seconds["costs"] = time.perf_counter() - t0

            provisional = self.workdir / "provisional.specee.gguf"
            write_pack(provisional, self._pack(head, predictors, [], {}, None, {}))
            engine = Engine(config.model, pack=provisional, config=EngineConfig(n_ctx=2048, n_threads=config.threads))
            try:
                advance = stage("quality levels (moves)", None)
                t0 = time.perf_counter()
                search = LevelSearch(ds, probes, predictors, calib, costs, Schedule(offline=[]), 1 - min(config.levels),
                                     fill=engine.kv_mode == "fill", progress=advance)
                choices = choose_levels(search, config.levels, advance)
                self.seconds["levels"] = time.perf_counter() - t0

                # every decision on the calibration split: which levels pay, and the lossy default
                advance = stage("levels in the engine (runs)", None)
                t0 = time.perf_counter()
                calib_answers = pick_answers(shards, calib_p, config.replay_tokens)
                choices = check_with_engine(search, choices, lambda level: replay(engine, level, calib_answers, costs),
                                            progress=advance)
                chosen = [choice.level if pays(choice.engine) else turned_off(choice.level) for choice in choices]
                code_matters = engine.prompting == "chat" and any(prompts[s.prompt].category == "code" for s in self.greedy)
                lossy_index = self._default_index(engine, chosen, choices, calib_greedy, prompts, code_matters)

                # then the held-out prompts, for the figures alone
                test_answers = pick_answers(shards, test_p, config.heldout_tokens)
                code = np.array([prompts[shard.prompt].category == "code" for shard in heldout_greedy])
                measured = []
                for level in chosen:
                    measured.append(self._held_out(engine, level, test_answers, heldout_greedy, code, costs))
                    advance()
                kv_mode = engine.kv_mode
                self.seconds["engine"] = time.perf_counter() - t0

                advance = stage("exact mode (runs)", None)
                t0 = time.perf_counter()
                as_tokens = lambda part: prompt_tokens(engine, prompts, part, config.exact_prompts)  # noqa: E731
                # drafts are checked, so a level's exits may pay as drafts where they did not as answers: the
                # candidates are the levels as chosen, before the ones that did not pay were turned off
                exact, exact_report = choose_exact(engine, [choice.level for choice in choices], as_tokens(calib_p),
                                                   as_tokens(test_p), config.exact_tokens, advance)
                self.seconds["exact"] = time.perf_counter() - t0
            finally:
                engine.close()

            # a level ships under the agreement its held-out interval's low end reaches (renamed, or dropped)
            shipped = keep_promises(measured)
            levels = sorted((level for level in shipped if level is not None), key=lambda level: level.quality)
            # the lossy default (what --quality picks among the lossy levels) sets the temperatures; the pack's
            # default is exact mode unless --quality names a lossy level
            lossy_quality = shipped_quality(shipped, lossy_index)
            advance = stage("temperatures (layers)", len(predictors))
            t0 = time.perf_counter()
            exits = chosen[lossy_index].exits
            calib_rows = simulate(ds, probes, predictors, exits, calib, None).exit_rows()
            test_rows = simulate(ds, probes, predictors, exits, test, None).exit_rows()
            temperatures = fit_temperatures(ds, weights, sorted(predictors), calib_rows, test_rows, config.seed, advance)
            self.seconds["temperatures"] = time.perf_counter() - t0

        report = self._report(ds, shards, train, test, draft_report, probes, predictors, choices, measured, shipped,
                              chosen[lossy_index], lossy_quality, temperatures, costs, exact_report)
        pack = self._pack(head, predictors, levels, temperatures.temperatures, lossy_quality, {
            "tool": f"specee-edge {version('specee-edge')}",
            "command": config.command,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model_file": config.model.name,
            "predictor": f"MLP {3 * config.k}->{config.hidden}->1 (scikit-learn), per layer an exit kind and a threshold"
                         f" per quality level {', '.join(f'{q:g}' for q in config.levels)}",
            "draft": f"linear ridge head over {config.draft_vocab} tokens, q8_0"
                     + (f"; prompt lookup up to {config.lookup}-grams in the first slot" if config.lookup else ""),
            "kv_mode": kv_mode,  # the KV mode the levels were checked in: their figures hold for it
            "costs_ms": costs.to_dict(),
            "settings": {k: v for k, v in asdict(config).items() if k not in ("model", "output", "workdir", "command")}
            | {"prompts": str(config.prompts or "built-in")},
            "report": report.to_dict(),
        })
        if config.quality is None or lossy_quality is None:
            pack = with_exact(pack, exact)
        else:
            pack = dataclasses.replace(pack, levels=[*pack.levels, exact])
        return pack, report

    def _default_index(self, engine: Engine, levels: list[QualityLevel], choices: list[LevelChoice],
                       greedy: list[Shard], prompts, code_matters: bool) -> int:
        """Which of `levels` is the lossy default: the one --quality names, else default_quality's pick from
        their figures on the calibration split (the greedy answers there, for identical code answers)."""
        if self.config.quality is not None:
            return [level.quality for level in levels].index(self.config.quality)
        code = np.array([prompts[shard.prompt].category == "code" for shard in greedy], dtype=bool)
        figures = []
        for level, choice in zip(levels, choices):
            if level.off or choice.engine is None:
                figures.append(dataclasses.replace(level, agreement=1.0, speedup=1.0, identical_code=1.0))
                continue
            same = np.array(identical_answers(engine, level, [s for s, c in zip(greedy, code) if c],
                                              self.config.identical_tokens)) if code_matters and code.any() else None
            figures.append(dataclasses.replace(level, agreement=choice.engine.agreement, speedup=choice.engine.speedup,
                                               identical_code=float(same.mean()) if same is not None else -1.0))
        return [level.quality for level in levels].index(default_quality(figures, code_matters=code_matters and code.any()))

    def _held_out(self, engine: Engine, level: QualityLevel, answers: list[Shard], greedy: list[Shard],
                  code: np.ndarray, costs: TokenCosts) -> QualityLevel:
        """The level's figures from prompts that played no part in choosing it (a level with every layer off
        decodes plainly: figures of 1)."""
        if level.off:
            return dataclasses.replace(level, identical=1.0, identical_code=1.0 if code.any() else -1.0)
        run = replay(engine, level, answers, costs)
        same = np.array(identical_answers(engine, level, greedy, self.config.identical_tokens))
        return dataclasses.replace(
            level, exit_rate=run.exit_rate, agreement=run.agreement, verify_fail_rate=run.verify_fail_rate,
            layer_speedup=self.target.n_layer / (run.avg_exit_layer + 1), speedup=run.speedup,
            head_free_rate=run.head_free_rate, steps=run.steps, identical=float(same.mean()),
            identical_code=float(same[code].mean()) if code.any() else -1.0,
            agreement_low=run.agreement_low, agreement_high=run.agreement_high)

    def _pack(self, head, predictors, levels, temperatures, quality, provenance) -> Pack:
        default = next((level for level in levels if level.quality == quality), None)
        return Pack(target=self.target, k=self.config.k, threshold=0.5,
                    schedule=Schedule(offline=default.offline if default else []),
                    predictors=predictors, draft=head, levels=levels, default_quality=quality,
                    temperatures=temperatures, lookup_max_n=self.config.lookup, provenance=provenance)

    def _report(self, ds, shards, train, test, draft_report, probes, predictors, choices, measured, shipped,
                default: QualityLevel, quality, temperatures, costs, exact: ExactReport) -> CalibrationReport:
        layers = []
        for il in sorted(predictors):
            p = predictors[il](layer_features(probes, test, il, np.full(len(test), 1)))
            y = probes.head_free[test, il]
            said = p > default.exits[il].threshold
            layers.append(LayerReport(il, float(y.mean()), default.exits[il].kind.label, default.exits[il].threshold,
                                      float(y[said].mean()) if said.any() else 0.0,
                                      float(said[y].mean()) if y.any() else 0.0,
                                      temperatures.temperatures[il]))
        n_layer = ds.n_layer
        oracle = float(ds.oracle_exit()[test].mean())
        return CalibrationReport(
            model=self.config.model.name, n_layer=n_layer, prompts=int(ds.prompt.max()) + 1, answers=len(shards),
            tokens=len(ds.token), train_tokens=len(train), draft=draft_report, layers=layers,
            levels=[LevelReport.of(*parts, n_layer) for parts in zip(choices, measured, shipped)],
            default_quality=quality if quality is not None else EXACT_QUALITY, costs=costs.to_dict(),
            oracle_avg_exit_layer=oracle, oracle_layer_speedup=n_layer / (oracle + 1),
            nll_raw=temperatures.nll_raw, nll_temperature=temperatures.nll_fitted, seconds=dict(self.seconds),
            exact=exact,
        )


def default_quality(levels: list[QualityLevel], *, code_matters: bool) -> float:
    """The fastest level (by the figures given: calibration's own split) that keeps AGREEMENT_FLOOR and, where
    code matters, the share of identical code answers; the highest level if none does."""
    eligible = [level for level in levels if level.agreement >= AGREEMENT_FLOOR
                and (not code_matters or level.identical_code >= IDENTICAL_FLOOR)]
    if not eligible:
        return max(level.quality for level in levels)
    return max(eligible, key=lambda level: (level.speedup, level.quality)).quality


def calibrate(config: CalibrateConfig, console: Console | None = None) -> CalibrationReport:
    console = console or Console(stderr=True)
    pack, report = Calibration(config, console).run()
    write_pack(config.output, pack)
    return report
