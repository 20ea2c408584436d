"""Exact mode's level: which exits draft, how many drafts one verification batch checks, and when a round
stops drafting.

Exact mode cannot change an answer, so its settings are chosen for speed alone, and speed is measured, not
predicted: each candidate decodes the calibration prompts beside plain decoding, greedy and sampled, in the
same run, each prompt by both in turn (in alternating order, so that a drift of the machine's speed falls on
both). A candidate drafts with the exits of one of the pack's lossy levels (a maximum draft length, a stop on
the drafts' confidence) and from prompt lookup where the context offers a continuation, or from prompt lookup
alone (every exit off: no drafting step costs anything, and a round without a continuation is a plain token).
The best mean of the two speed-ups wins, and its figures are then measured again on held-out prompts, with a
95% bootstrap interval over the prompts (QualityLevel.drafts: whether that interval lies above 1, for the
report). Where neither does, the exact level keeps every layer off, and drafts by prompt lookup alone.

Each candidate is measured drafting at every chance (speculation "always"): what its exits give. At run time
the engine's controller (engine/controller.py) decides round by round whether drafting pays on the machine
it runs on, starting from the acceptance and exit rate stored here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from rich.table import Table
from threadpoolctl import threadpool_limits

from specee_edge.bootstrap import interval
from specee_edge.data.prompts import CALIBRATION_SPLIT, Prompt, load_prompts, split
from specee_edge.engine import Engine, EngineConfig
from specee_edge.engine.records import GenerationStats
from specee_edge.engine.sampling import GREEDY, SamplingParams
from specee_edge.exits import ExitKind
from specee_edge.pack import OFF, LayerExit, Pack, QualityLevel, read_pack, write_pack
from specee_edge.pack.format import EXACT_QUALITY, MAX_DRAFT

MAX_DRAFTS = (3, 6)           # the longest rounds tried
DRAFT_STOPS = (0.0, 0.6)       # confidence floors tried (0: a round drafts until a step runs every layer or max_draft)
LOOKUP_DRAFTS = (2, 4)        # the longest rounds tried with prompt lookup alone (2: llama-cpp-python's advice for CPUs)
SAMPLED = SamplingParams(seed=0)  # chat's defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05
FALLBACK_EXIT = LayerExit(ExitKind.HEAD_FREE, 0.5)  # where no lossy level has a layer on


@dataclass
class Speedup:
    """Tokens per second against plain decoding's on the same prompts: the point, and a 95% bootstrap interval
    that resamples the prompts (each keeps its pair of timings)."""

    point: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.point:.3f}x ({self.low:.2f}-{self.high:.2f})"


def speedup_of(plain: Sequence[tuple[int, float]], exact: Sequence[tuple[int, float]], seed: int = 0) -> Speedup:
    """`plain` and `exact`: (tokens, seconds) per prompt, in the same order."""
    (n_plain, s_plain), (n_exact, s_exact) = (np.array(lane, dtype=float).T for lane in (plain, exact))

    def ratio(rows: np.ndarray) -> np.ndarray:
        return (n_exact[rows].sum(-1) / s_exact[rows].sum(-1)) / (n_plain[rows].sum(-1) / s_plain[rows].sum(-1))

    return Speedup(float(ratio(np.arange(len(plain)))), *interval(ratio, len(plain), seed))


@dataclass
class ExactTrial:
    """One candidate's speed-ups against plain decoding of the same prompts in the same run."""

    source_quality: float | None  # the lossy level whose exits draft (None: none, prompt lookup alone)
    max_draft: int
    draft_stop: float
    speedup: Speedup        # greedy
    speedup_sampled: Speedup
    acceptance: float       # drafted tokens the full model accepted, greedy
    tokens_per_round: float
    verify_cost: float      # one verification batch against one plain token, greedy

    @property
    def score(self) -> float:
        return (self.speedup.point + self.speedup_sampled.point) / 2

    @property
    def pays(self) -> bool:
        """Faster than plain decoding beyond the noise, greedy or sampled (the engine drafts for each kind of
        decoding only where it paid: QualityLevel.drafts)."""
        return self.speedup.low > 1.0 or self.speedup_sampled.low > 1.0


@dataclass
class ExactReport:
    chosen: ExactTrial   # its settings, its figures on held-out prompts
    on: bool             # whether the exact level's exits are on (else it drafts by prompt lookup alone)
    trials: list[ExactTrial] = field(default_factory=list)  # on the calibration prompts

    def to_dict(self) -> dict:
        return asdict(self)

    def render(self) -> Table:
        c = self.chosen
        verdict = ("exact mode's exits stay off (prompt lookup alone): drafting was not faster than plain decoding "
                   "beyond the noise here" if not self.on else
                   f"exact mode with exits was faster {' and '.join(kind for kind, gain in (('greedy', c.speedup), ('sampled', c.speedup_sampled)) if gain.low > 1)}"
                   " (on held-out prompts, the whole 95% interval above 1)")
        verdict += "; at run time the controller decides each round on the machine it runs on"
        table = Table(title="exact mode: speed-ups against plain decoding in the same run, on calibration prompts; "
                            "the chosen candidate again on held-out prompts", caption=verdict)
        for column in ("", "exits of", "max draft", "stop", "greedy", "sampled", "accepted", "tokens/round", "batch cost"):
            table.add_column(column, justify="right", no_wrap=True)
        for trial in self.trials:
            table.add_row("", *_cells(trial))
        table.add_row("held out", *_cells(self.chosen), style="bold")
        return table


def _cells(t: ExactTrial) -> list[str]:
    return ["lookup only" if t.source_quality is None else f"{t.source_quality:g}", str(t.max_draft), f"{t.draft_stop:g}",
            str(t.speedup), str(t.speedup_sampled), f"{t.acceptance:.2f}", f"{t.tokens_per_round:.2f}", f"{t.verify_cost:.2f}"]


def exact_level(source: QualityLevel, max_draft: int, draft_stop: float) -> QualityLevel:
    """The exact level drafting with `source`'s exits, greedy and sampled (its speed is not measured yet)."""
    return dataclasses.replace(source, quality=EXACT_QUALITY, max_draft=float(max_draft), draft_stop=draft_stop,
                               agreement=1.0, identical=1.0, identical_code=-1.0, speedup=math.inf,
                               speedup_sampled=math.inf, speedup_low=math.inf, speedup_sampled_low=math.inf)


def plain_exact(level: QualityLevel) -> QualityLevel:
    """The exact level with every layer off: no exit drafts (the engine still drafts by prompt lookup, where its
    controller finds it pays)."""
    return dataclasses.replace(level, exits=dict.fromkeys(level.exits, OFF), offline=[], exit_rate=0.0,
                               head_free_rate=0.0, layer_speedup=1.0)


def _decode(engine: Engine, prompt: list[int], tokens: int, sampling: SamplingParams, exact: bool,
            level: QualityLevel) -> tuple[int, float, GenerationStats]:
    """One answer, plain or exact: tokens decoded, seconds of decoding (the prompt pass excluded), its stats."""
    engine.set_early_exit(exact)
    if exact:
        engine.policy.set_level(level)
    engine.reset()
    engine.generate(prompt, max_tokens=tokens, sampling=sampling)
    return engine.stats.n_decode, engine.stats.decode_s, engine.stats


def measure(engine: Engine, level: QualityLevel, prompts: Sequence[list[int]], tokens: int) -> ExactTrial:
    """`level` (exact) against plain decoding of the same prompts, greedy then sampled (prompt i seeded i); each
    prompt by both, first plain then exact, then the other way round for the next."""
    speed: dict[str, Speedup] = {}
    greedy_stats: list[GenerationStats] = []
    plain_ms = 0.0
    for name, sampling in (("greedy", GREEDY), ("sampled", SAMPLED)):
        plain, exact = [], []
        for i, prompt in enumerate(prompts):
            seeded = sampling if sampling.greedy else dataclasses.replace(sampling, seed=i)
            for is_exact in ((False, True) if i % 2 == 0 else (True, False)):
                n, seconds, stats = _decode(engine, prompt, tokens, seeded, is_exact, level)
                (exact if is_exact else plain).append((n, seconds))
                if is_exact and name == "greedy":
                    greedy_stats.append(stats)
        speed[name] = speedup_of(plain, exact)
        if name == "greedy":
            plain_ms = sum(s for _, s in plain) * 1e3 / sum(n for n, _ in plain)
    accepted, drafts = sum(s.accepted for s in greedy_stats), sum(s.drafts for s in greedy_stats)
    rounds, round_tokens = sum(s.rounds for s in greedy_stats), sum(s.round_tokens for s in greedy_stats)
    batch_ms = sum(s.time_ms["batch"] for s in greedy_stats)
    return ExactTrial(level.quality, int(level.max_draft), level.draft_stop, speed["greedy"], speed["sampled"],
                      accepted / drafts if drafts else 0.0, round_tokens / rounds if rounds else 0.0,
                      batch_ms / rounds / plain_ms if rounds else 0.0)


def exact_candidates(sources: Sequence[QualityLevel]) -> list[tuple[QualityLevel, int, float]]:
    """(exits, max_draft, draft_stop) to try: every lossy level with a layer on, each with every setting, then
    every exit off, drafting from prompt lookup alone (which exact mode does whatever the pack's candidates)."""
    drafting = [source for source in sources if not source.off and not source.exact]
    if not drafting:  # no level exits at all; drafts are checked, so every predictor may draft at an even threshold
        drafting = [dataclasses.replace(sources[0], exits=dict.fromkeys(sources[0].exits, FALLBACK_EXIT),
                                        offline=sorted(sources[0].exits))]
    exits = [(source, max_draft, stop) for source in drafting for max_draft in MAX_DRAFTS for stop in DRAFT_STOPS]
    no_exits = plain_exact(sources[0])
    return exits + [(no_exits, max_draft, 0.0) for max_draft in LOOKUP_DRAFTS]


def choose_exact(engine: Engine, sources: Sequence[QualityLevel], calibration: Sequence[list[int]],
                 heldout: Sequence[list[int]], tokens: int, advance: Callable[[], None] = lambda: None,
                 ) -> tuple[QualityLevel, ExactReport]:
    """The exact level: the fastest candidate on the calibration prompts, measured again on the held-out ones,
    and every layer turned off unless it pays there (prompt lookup then drafts alone)."""
    candidates = exact_candidates(sources)
    trials = []
    for source, max_draft, stop in candidates:
        trial = measure(engine, exact_level(source, max_draft, stop), calibration, tokens)
        trials.append(dataclasses.replace(trial, source_quality=_exits_of(source)))
        advance()
    best = max(range(len(trials)), key=lambda i: trials[i].score)
    source, max_draft, stop = candidates[best]
    level = exact_level(source, max_draft, stop)
    chosen = dataclasses.replace(measure(engine, level, heldout, tokens), source_quality=_exits_of(source))
    advance()
    level = dataclasses.replace(level, speedup=chosen.speedup.point, speedup_sampled=chosen.speedup_sampled.point,
                                speedup_low=chosen.speedup.low, speedup_sampled_low=chosen.speedup_sampled.low,
                                acceptance=chosen.acceptance, tokens_per_round=chosen.tokens_per_round,
                                verify_cost=chosen.verify_cost)
    return (level if chosen.pays else plain_exact(level)), ExactReport(chosen, chosen.pays, trials)


def _exits_of(source: QualityLevel) -> float | None:
    return None if source.off else source.quality


def with_exact(pack: Pack, level: QualityLevel) -> Pack:
    """`pack` with `level` as its exact level (replacing any) and its default: exact mode keeps the answers, and
    where drafting by exits does not pay the level turns every layer off and drafts by prompt lookup alone."""
    lossy = [lv for lv in pack.levels if not lv.exact]
    return dataclasses.replace(pack, levels=[*lossy, level], default_quality=EXACT_QUALITY)


def part_tokens(engine: Engine, prompts: Sequence[Prompt], part: Sequence[int], n: int) -> list[list[int]]:
    """The first n prompts of a split's part, as the engine is prompted with them."""
    return [engine.prompt_tokens(prompts[i].text) for i in sorted(part)[:n]]


def exact_prompts(engine: Engine, prompts_path: Path | None, seed: int, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """Up to n prompts of the calibration split and n of the held-out split, as the pipeline splits them."""
    prompts = load_prompts(prompts_path)
    _, calibration, heldout = split(len(prompts), seed, CALIBRATION_SPLIT)
    return part_tokens(engine, prompts, calibration, n), part_tokens(engine, prompts, heldout, n)


def add_exact_level(model: Path, pack_path: Path, output: Path, *, prompts_path: Path | None = None, seed: int = 0,
                    n_prompts: int = 6, tokens: int = 64, threads: int = 2,
                    advance: Callable[[], None] = lambda: None) -> ExactReport:
    """calibrate --exact-only: choose the exact level of an existing pack and write the pack with it as default."""
    pack = read_pack(pack_path)
    # each candidate drafts at every chance with its own max_draft: what it gives, not what the controller would pick
    engine = Engine(model, pack=pack_path, config=EngineConfig(n_ctx=2048, n_threads=threads, speculation="always",
                                                               draft_max=MAX_DRAFT))
    try:
        calibration, heldout = exact_prompts(engine, prompts_path, seed, n_prompts)
        with threadpool_limits(limits=1, user_api="blas"):
            level, report = choose_exact(engine, pack.levels, calibration, heldout, tokens, advance)
    finally:
        engine.close()
    provenance = {**pack.provenance, "exact": {"command": "calibrate --exact-only", "tokens": tokens,
                                               "prompts": n_prompts, "report": report.to_dict()}}
    write_pack(output, dataclasses.replace(with_exact(pack, level), provenance=provenance))
    return report


def n_trials(pack: Pack) -> int:
    """Engine runs choose_exact makes for `pack` (for a progress bar): each candidate, then the chosen one again."""
    return len(exact_candidates(pack.levels)) + 1
