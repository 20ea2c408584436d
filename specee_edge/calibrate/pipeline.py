"""`specee-edge calibrate`: answers -> lens -> draft head -> predictors -> costs -> quality levels ->
the levels in the engine -> exact mode -> temperatures -> pack.

The prompts are split three ways: the draft head and the predictors are trained on the first part;
every choice after that is made on the second (each level's exits, whether it pays, the lossy default,
the temperatures, the costs' timed text); the figures the pack stores for each level come from the
engine on the third, prompts nothing was chosen on, and so does the name a level ships under: the
agreement the low end of its held-out interval reaches.

Collection, the lens and the predictors keep their results in the work directory; a rerun with the
same settings skips them (collection resumes prompt by prompt).

Before any of it, `plan` times a few units of the run's work on this machine (speed.py), prints what each stage
should take (budget.py), and with `minutes` first sizes the run to fit.
"""

from __future__ import annotations

import hashlib
import json
import os
import dataclasses
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from threadpoolctl import threadpool_limits

from specee_edge.calibrate import dataset as dataset_stage
from specee_edge.calibrate.budget import (COST_ANSWERS, COST_TOKENS, DEFAULT_SIZE, STAGES, MachineSpeed, RunShape,
                                          RunSize, estimate, fit_minutes, given_up, size_of, with_sizes)
from specee_edge.calibrate.collect import Collector, Shard, round_sampling, shard_path
from specee_edge.calibrate.draft_fit import DRAFT_RIDGE, fit_draft
from specee_edge.calibrate.exact import ExactReport, choose_exact, part_tokens, with_exact
from specee_edge.calibrate.levels import (LEVELS, LevelChoice, LevelSearch, check_with_engine, choose_levels,
                                          keep_promises, pays, shipped_quality, turned_off)
from specee_edge.calibrate.predictor_fit import Probes, layer_features, probe_all, simulate, train_predictors
from specee_edge.calibrate.progress import RunProgress, clock
from specee_edge.calibrate.replay import identical_answers, pick_answers, replay
from specee_edge.calibrate.report import CalibrationReport, LayerReport, LevelReport
from specee_edge.calibrate.speed import measure_speed
from specee_edge.calibrate.temperature import fit_temperatures
from specee_edge.data.prompts import CALIBRATION_SPLIT, Prompt, load_prompts, split
from specee_edge.draft import LinearDraft
from specee_edge.draft.lookup import LOOKUP_MAX_N
from specee_edge.engine import Engine, EngineConfig
from specee_edge.errors import SpecEEError
from specee_edge.pack import Pack, QualityLevel, Schedule, target_identity, write_pack
from specee_edge.pack.format import EXACT_QUALITY, IDENTICAL_FLOOR, DraftHead
from specee_edge.pack.convert import predictors_from_npz, predictors_to_npz
from specee_edge.predictor import MLPPredictor
from specee_edge.runtime import Model
from specee_edge.runtime.costs import DraftSetup, TokenCosts, measure_costs
from specee_edge.runtime.weights import TargetWeights
from specee_edge.threads import default_threads

CACHE = Path.home() / ".cache" / "specee-edge" / "calibrate"
COLLECTION = 2  # how answers are collected: a work dir from another version is not reused
MAX_ROUNDS = 16  # answers per prompt at most (the first greedy, the others sampled)
# the lossy default, unless --quality names one: the fastest whose agreement on the calibration split reaches AGREEMENT_FLOOR
# and, for models that chat, whose greedy answers to code prompts stay identical to the full model's in at
# least IDENTICAL_FLOOR of them (one wrong token can break a program)
AGREEMENT_FLOOR = 0.98


@dataclass
class CalibrateConfig:
    model: Path
    output: Path
    workdir: Path | None = None
    tokens: int = DEFAULT_SIZE.tokens  # answer tokens (steps) to collect
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
    replay_tokens: int = DEFAULT_SIZE.replay_tokens  # calibration-split steps the engine replays per candidate level
    heldout_tokens: int = DEFAULT_SIZE.heldout_tokens  # test-split steps behind each level's stored agreement
    identical_tokens: int = DEFAULT_SIZE.identical_tokens  # tokens of each held-out greedy answer compared with the full model's
    exact_prompts: int = 4              # prompts per split that exact mode's candidates decode (calibration, held out)
    exact_tokens: int = DEFAULT_SIZE.exact_tokens  # ... tokens each
    cost_rounds: int = DEFAULT_SIZE.cost_rounds  # rounds of the cost lanes, each on a freshly loaded model
    minutes: float | None = None        # size the run (the sizes above but the prompts) to take about this long
    first_layer: int = 0      # no predictor below it; 0: n_layer // 4 (shallow layers hardly ever agree)
    command: str = ""


class Calibration:
    def __init__(self, config: CalibrateConfig, console: Console):
        self.config = config
        self.console = console
        self.target = target_identity(config.model)
        self.workdir = config.workdir or CACHE / self.target.fingerprint[:16]
        self.first_layer = config.first_layer or self.target.n_layer // 4
        self.greedy: list[Shard] = []
        # set by plan(): what the run's work depends on, this machine's speed, each stage's estimated seconds
        self.shape: RunShape | None = None
        self.speed: MachineSpeed | None = None
        self.estimates: dict[str, float] = {}
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

    def _answers(self, prompts: list[Prompt]):
        """(round, prompt index, prompt) in the order answers are collected: round by round, each round taking the
        prompts in turns from each category, so that a run shorter than a round still answers every kind."""
        order = interleaved(prompts)
        return ((round_, index, prompts[index]) for round_ in range(MAX_ROUNDS) for index in order)

    def cached(self, prompts: list[Prompt]) -> tuple[int, bool]:
        """(answer steps the work dir already holds, in collection order up to `tokens`; whether the lens of exactly
        the answers the run will use is there too)."""
        steps, n_shards = 0, 0
        for round_, index, _ in self._answers(prompts):
            path = shard_path(self.workdir, round_, index)
            if steps >= self.config.tokens or not path.exists():
                break
            steps += Shard.steps_in(path)
            n_shards += 1
        complete = steps >= self.config.tokens
        return steps, complete and self.dataset_path(n_shards).exists()

    def dataset_path(self, n_shards: int) -> Path:
        return self.workdir / f"dataset-{n_shards}-from{self.first_layer}.npz"

    def plan(self, weights: TargetWeights, prompts: list[Prompt]) -> None:
        """Times this machine, sizes the run where `minutes` asks (replacing the config's sizes), and prints what
        each stage should take (self.estimates)."""
        config = self.config
        self.console.print(f"timing this machine on {config.model.name} ...", highlight=False)
        speed = measure_speed(config.model, weights, prompts[0], threads=config.threads)
        load = os.getloadavg()[0]
        if load > os.cpu_count():
            self.console.print(f"[yellow]this machine is busy (load average {load:.1f} on {os.cpu_count()} cores): the "
                               "estimate holds while the load does, and with fewer threads (-t) llama.cpp's threads "
                               "wait less for each other[/yellow]", highlight=False)
        cached_steps, lens_cached = self.cached(prompts)
        shape = RunShape(n_layer=self.target.n_layer, first_layer=self.first_layer, n_embd=weights.lm_head.shape[1],
                         n_vocab=weights.lm_head.shape[0], draft_vocab=config.draft_vocab, levels=len(config.levels),
                         lookup=config.lookup > 0, prompts=len(prompts),
                         code_share=sum(p.category == "code" for p in prompts) / len(prompts),
                         max_answer=config.max_answer, exact_prompts=config.exact_prompts,
                         cached_steps=cached_steps, lens_cached=lens_cached)
        if config.minutes is not None:
            self.config = config = with_sizes(config, fit_minutes(config.minutes, shape, speed))
            cached_steps, lens_cached = self.cached(prompts)
            shape = dataclasses.replace(shape, cached_steps=cached_steps, lens_cached=lens_cached)
        size = size_of(config)
        self.shape, self.speed = shape, speed
        self.estimates = estimate(size, shape, speed)
        self.console.print(self._plan_table(size, cached_steps, lens_cached))
        # the engine's and exact mode's work depends on how many levels exit, which the search decides
        fewest, most = (sum(estimate(size, dataclasses.replace(shape, exiting=n), speed).values())
                        for n in (0, len(config.levels)))
        self.console.print(f"whole run between {clock(fewest)} (no level exits) and {clock(most)} (every level exits); "
                           "the estimate is redone once the levels are chosen", highlight=False)
        if config.minutes is not None:
            total = sum(self.estimates.values())
            if total > 60 * config.minutes * 1.05:
                self.console.print(f"[yellow]even the smallest run takes about {clock(total)} here, more than "
                                   f"{config.minutes:g} minutes[/yellow]", highlight=False)
            for line in given_up(size, shape):
                self.console.print(f"  gives up: {line}", highlight=False)

    def _plan_table(self, size: RunSize, cached_steps: int, lens_cached: bool) -> Table:
        s = self.speed
        table = Table(title=f"calibration plan: {1 / s.plain_s:.1f} tokens/s plain, {1 / s.step_s:.1f} steps/s collecting, "
                            f"lens {s.lens_row_s * 1e3:.2f} ms a hidden state (measured here just now)")
        table.add_column("stage")
        table.add_column("work")
        table.add_column("estimated", justify="right")
        work = {"answers": f"{size.tokens:,} answer steps" + (f" ({cached_steps:,} in the work dir)" if cached_steps else ""),
                "lens": "in the work dir" if lens_cached else f"{size.tokens:,} steps x {self.shape.predictor_layers} layers",
                "costs": f"{size.cost_rounds} rounds x {COST_ANSWERS} answers x {COST_TOKENS} tokens",
                "engine": f"replays of {size.replay_tokens:,} steps per level, {size.heldout_tokens:,} held out",
                "exact": f"{size.exact_tokens} tokens x {self.config.exact_prompts} prompts per candidate"}
        for number, (key, label) in enumerate(STAGES, 1):
            table.add_row(f"{number} {label}", work.get(key, ""), clock(self.estimates[key]))
        table.add_row("whole run", "", clock(sum(self.estimates.values())), style="bold")
        return table

    def collect(self, progress: RunProgress) -> list[Shard]:
        """Answers until `tokens` steps: every prompt greedily, then again with sampling, round by round
        (self.greedy: the first round's, the full model's greedy answers)."""
        prompts = load_prompts(self.config.prompts)
        shards: list[Shard] = []
        steps = 0
        collector = None
        with progress.stage("answers", "steps", self.config.tokens) as advance:
            try:
                for round_, index, prompt in self._answers(prompts):
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
                    advance(shard.steps)
            finally:
                if collector:
                    collector.close()
        if len(shards) < 5:
            raise SpecEEError(f"only {len(shards)} answers: calibration needs at least 5 (more --tokens or prompts)")
        return shards

    def dataset(self, shards: list[Shard], weights: TargetWeights, progress: RunProgress) -> dataset_stage.Dataset:
        path = self.dataset_path(len(shards))
        with progress.stage("lens", "steps", sum(len(s.hidden) for s in shards)) as advance:
            if path.exists():
                return dataset_stage.load(path)
            ds = dataset_stage.build(shards, weights, self.first_layer, advance)
            dataset_stage.save(ds, path)
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
                                 rounds=self.config.cost_rounds, seed=self.config.seed, advance=advance)

    def run(self) -> tuple[Pack, CalibrationReport]:
        weights = TargetWeights(self.config.model)
        prompts = load_prompts(self.config.prompts)
        self.plan(weights, prompts)
        config = self.config
        with RunProgress(self.console, self.estimates) as progress:
            shards = self.collect(progress)
            ds = self.dataset(shards, weights, progress)
            train_p, calib_p, test_p = split_answered(ds.prompt, config.seed)
            train, calib, test = ds.rows(train_p), ds.rows(calib_p), ds.rows(test_p)
            # the candidates the engine will see: the prompt-lookup one first, then the draft head's
            lookup = dataset_stage.lookup_column(shards, config.lookup)
            categories = np.array([prompts[p].category for p in ds.prompt.tolist()])

            with progress.stage("draft", "", 1) as advance:
                head, draft_report = fit_draft(ds, weights, train, test, k=config.k, vocab=config.draft_vocab,
                                               lookup=lookup, categories=categories,
                                               eog_tokens=Model(config.model).eog_tokens(), ridge=config.draft_ridge)
                draft = LinearDraft(head, weights, config.k)
                advance()

            with progress.stage("predictors", "layers", self.target.n_layer - self.first_layer) as advance:
                probes = probe_all(ds, draft, weights, lookup)
                predictors = self.predictors(probes, train, len(shards), head, advance)

            calib_greedy = [shard for shard in self.greedy if shard.prompt in calib_p]
            heldout_greedy = [shard for shard in self.greedy if shard.prompt in test_p]
            cost_answers = (calib_greedy or self.greedy)[:COST_ANSWERS]
            cost_steps = config.cost_rounds * sum(min(COST_TOKENS, shard.steps) for shard in cost_answers)
            with progress.stage("costs", "steps", cost_steps) as advance:
                costs = self.costs(draft, predictors[max(predictors)], cost_answers, advance)

            provisional = self.workdir / "provisional.specee.gguf"
            write_pack(provisional, self._pack(head, predictors, [], {}, None, {}))
            engine = Engine(config.model, pack=provisional, config=EngineConfig(n_ctx=2048, n_threads=config.threads))
            try:
                with progress.stage("levels", "moves", None) as advance:
                    search = LevelSearch(ds, probes, predictors, calib, costs, Schedule(offline=[]),
                                         1 - min(config.levels), fill=engine.kv_mode == "fill", progress=advance)
                    choices = choose_levels(search, config.levels, advance)
                    # now it is known how many levels exit: the engine's and exact mode's work follows from it
                    known = estimate(size_of(config), dataclasses.replace(
                        self.shape, exiting=sum(choice.index > 0 for choice in choices)), self.speed)
                    for key in ("engine", "exact"):
                        progress.refine(key, known[key])

                # every decision on the calibration split: which levels pay, and the lossy default
                with progress.stage("engine", "runs", None) as advance:
                    calib_answers = pick_answers(shards, calib_p, config.replay_tokens)
                    choices = check_with_engine(search, choices,
                                                lambda level: replay(engine, level, calib_answers, costs),
                                                progress=advance)
                    chosen = [choice.level if pays(choice.engine) else turned_off(choice.level) for choice in choices]
                    code_matters = engine.prompting == "chat" and any(prompts[s.prompt].category == "code"
                                                                      for s in self.greedy)
                    lossy_index = self._default_index(engine, chosen, choices, calib_greedy, prompts, code_matters)

                    # then the held-out prompts, for the figures alone
                    test_answers = pick_answers(shards, test_p, config.heldout_tokens)
                    code = np.array([prompts[shard.prompt].category == "code" for shard in heldout_greedy])
                    measured = []
                    for level in chosen:
                        measured.append(self._held_out(engine, level, test_answers, heldout_greedy, code, costs))
                        advance()
                    kv_mode = engine.kv_mode

                with progress.stage("exact", "runs", None) as advance:
                    as_tokens = lambda part: part_tokens(engine, prompts, part, config.exact_prompts)  # noqa: E731
                    # drafts are checked, so a level's exits may pay as drafts where they did not as answers: the
                    # candidates are the levels as chosen, before the ones that did not pay were turned off
                    exact, exact_report = choose_exact(engine, [choice.level for choice in choices],
                                                       as_tokens(calib_p), as_tokens(test_p), config.exact_tokens,
                                                       advance)
            finally:
                engine.close()

            # a level ships under the agreement its held-out interval's low end reaches (renamed, or dropped)
            shipped = keep_promises(measured)
            levels = sorted((level for level in shipped if level is not None), key=lambda level: level.quality)
            # the lossy default (what --quality picks among the lossy levels) sets the temperatures; the pack's
            # default is exact mode unless --quality names a lossy level
            lossy_quality = shipped_quality(shipped, lossy_index)
            with progress.stage("temperatures", "layers", len(predictors)) as advance:
                exits = chosen[lossy_index].exits
                calib_rows = simulate(ds, probes, predictors, exits, calib, None).exit_rows()
                test_rows = simulate(ds, probes, predictors, exits, test, None).exit_rows()
                temperatures = fit_temperatures(ds, weights, sorted(predictors), calib_rows, test_rows, config.seed,
                                                advance)
            self.seconds = progress.seconds
        self.console.print(f"calibration took {clock(sum(self.seconds.values()))} (estimated "
                           f"{clock(sum(self.estimates.values()))} before it started)", highlight=False)

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
            model=self.config.model.name, n_layer=n_layer, prompts=len(np.unique(ds.prompt)), answers=len(shards),
            tokens=len(ds.token), train_tokens=len(train), draft=draft_report, layers=layers,
            levels=[LevelReport.of(*parts, n_layer) for parts in zip(choices, measured, shipped)],
            default_quality=quality if quality is not None else EXACT_QUALITY, costs=costs.to_dict(),
            oracle_avg_exit_layer=oracle, oracle_layer_speedup=n_layer / (oracle + 1),
            nll_raw=temperatures.nll_raw, nll_temperature=temperatures.nll_fitted, seconds=dict(self.seconds),
            exact=exact,
        )


def split_answered(prompt_ids: np.ndarray, seed: int) -> list[np.ndarray]:
    """The prompts that were answered (their ids, each row's), split three ways by CALIBRATION_SPLIT: a run shorter
    than a round answers only some prompts, of every category. Where the first n prompts were answered, the split
    of range(n)."""
    answered = np.unique(prompt_ids)
    return [answered[part] for part in split(len(answered), seed, CALIBRATION_SPLIT)]


def interleaved(prompts: list[Prompt]) -> list[int]:
    """The prompts' indices taken in turns from each category (in the order categories first appear), each
    category's in file order."""
    by_category: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_category.setdefault(prompt.category, []).append(index)
    columns = list(by_category.values())
    return [column[i] for i in range(max(map(len, columns))) for column in columns if i < len(column)]


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
