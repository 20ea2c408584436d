"""Exact mode's level: which exits draft, how many drafts one verification batch checks, and when a round
stops drafting.

Exact mode cannot change an answer, so its settings are chosen for speed alone, and speed is measured, not
predicted: each candidate decodes the calibration prompts beside plain decoding, greedy and sampled, in the
same run. A candidate drafts with the exits of one of the pack's lossy levels (a maximum draft length, a stop
on the drafts' confidence) and from prompt lookup where the context offers a continuation, or from prompt
lookup alone (every exit off: no drafting step costs anything, and a round without a continuation is a plain
token). The best mean of the two speed-ups wins, and its figures are then measured again on held-out
prompts. The engine drafts greedy or sampled replies only where that beat plain decoding there by more than
the noise (QualityLevel.drafts); where neither did, the exact level keeps every layer off: it decodes
plainly, which is exact too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.table import Table
from threadpoolctl import threadpool_limits

from specee_edge.data.prompts import CALIBRATION_SPLIT, Prompt, load_prompts, split
from specee_edge.engine import Engine, EngineConfig
from specee_edge.engine.sampling import GREEDY, SamplingParams
from specee_edge.exits import ExitKind
from specee_edge.pack import OFF, LayerExit, Pack, QualityLevel, read_pack, write_pack
from specee_edge.pack.format import DRAFT_GAIN, EXACT_QUALITY

MAX_DRAFTS = (3, 6)           # the longest rounds tried
DRAFT_STOPS = (0.0, 0.6)       # confidence floors tried (0: a round drafts until a step runs every layer or max_draft)
LOOKUP_DRAFTS = (2, 4)        # the longest rounds tried with prompt lookup alone (2: llama-cpp-python's advice for CPUs)
SAMPLED = SamplingParams(seed=0)  # chat's defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05
FALLBACK_EXIT = LayerExit(ExitKind.HEAD_FREE, 0.5)  # where no lossy level has a layer on


@dataclass
class ExactTrial:
    """One candidate's speed-ups against plain decoding of the same prompts in the same run."""

    source_quality: float | None  # the lossy level whose exits draft (None: none, prompt lookup alone)
    max_draft: int
    draft_stop: float
    speedup: float          # greedy
    speedup_sampled: float
    acceptance: float       # drafted tokens the full model accepted, greedy
    tokens_per_round: float
    verify_cost: float      # one verification batch against one plain token, greedy

    @property
    def score(self) -> float:
        return (self.speedup + self.speedup_sampled) / 2

    @property
    def pays(self) -> bool:
        """Faster than plain decoding by more than the noise, greedy or sampled (the engine drafts for each kind
        of decoding only where it paid: QualityLevel.drafts)."""
        return max(self.speedup, self.speedup_sampled) > DRAFT_GAIN


@dataclass
class ExactReport:
    chosen: ExactTrial   # its settings, its figures on held-out prompts
    on: bool             # whether the exact level drafts (else it decodes plainly)
    trials: list[ExactTrial] = field(default_factory=list)  # on the calibration prompts

    def to_dict(self) -> dict:
        return asdict(self)

    def render(self) -> Table:
        c = self.chosen
        verdict = ("exact mode decodes plainly: drafting was not faster than plain decoding here" if not self.on else
                   f"exact mode drafts {' and '.join(kind for kind, gain in (('greedy', c.speedup), ('sampled', c.speedup_sampled)) if gain > DRAFT_GAIN)}"
                   f" (faster than plain decoding by more than {DRAFT_GAIN - 1:.0%} on held-out prompts), else decodes plainly")
        table = Table(title="exact mode: speed-ups against plain decoding in the same run, on calibration prompts; "
                            "the chosen candidate again on held-out prompts", caption=verdict)
        for column in ("", "exits of", "max draft", "stop", "greedy", "sampled", "accepted", "tokens/round", "batch cost"):
            table.add_column(column, justify="right", no_wrap=True)
        for trial in self.trials:
            table.add_row("", *_cells(trial))
        table.add_row("held out", *_cells(self.chosen), style="bold")
        return table


def _cells(t: ExactTrial) -> list[str]:
    return ["lookup only" if t.source_quality is None else f"{t.source_quality:g}", str(t.max_draft), f"{t.draft_stop:g}", f"{t.speedup:.3f}x",
            f"{t.speedup_sampled:.3f}x", f"{t.acceptance:.2f}", f"{t.tokens_per_round:.2f}", f"{t.verify_cost:.2f}"]


def exact_level(source: QualityLevel, max_draft: int, draft_stop: float) -> QualityLevel:
    """The exact level drafting with `source`'s exits, greedy and sampled (its speed is not measured yet)."""
    return dataclasses.replace(source, quality=EXACT_QUALITY, max_draft=float(max_draft), draft_stop=draft_stop,
                               agreement=1.0, identical=1.0, identical_code=-1.0, speedup=math.inf,
                               speedup_sampled=math.inf)


def plain_exact(level: QualityLevel) -> QualityLevel:
    """The exact level with every layer off: plain decoding."""
    return dataclasses.replace(level, exits=dict.fromkeys(level.exits, OFF), offline=[], exit_rate=0.0,
                               head_free_rate=0.0, layer_speedup=1.0)


def _decode(engine: Engine, prompts: Sequence[list[int]], tokens: int, sampling: SamplingParams) -> tuple[float, int, list]:
    """Seconds of decoding (prompt passes excluded), tokens decoded, and each answer's stats."""
    seconds, n, stats = 0.0, 0, []
    for i, prompt in enumerate(prompts):
        engine.reset()
        seeded = sampling if sampling.greedy else dataclasses.replace(sampling, seed=i)
        engine.generate(prompt, max_tokens=tokens, sampling=seeded)
        seconds += engine.stats.decode_s
        n += engine.stats.n_decode
        stats.append(engine.stats)
    return seconds, n, stats


def measure(engine: Engine, level: QualityLevel, prompts: Sequence[list[int]], tokens: int) -> ExactTrial:
    """`level` (exact) against plain decoding of the same prompts, greedy then sampled."""
    speed: dict[str, float] = {}
    accepted = drafts = rounds = round_tokens = 0
    batch_ms = plain_ms = 0.0
    for name, sampling in (("greedy", GREEDY), ("sampled", SAMPLED)):
        engine.set_early_exit(False)
        t_plain, n_plain, _ = _decode(engine, prompts, tokens, sampling)
        engine.set_early_exit(True)
        engine.policy.set_level(level)
        t_exact, n_exact, stats = _decode(engine, prompts, tokens, sampling)
        speed[name] = (n_exact / t_exact) / (n_plain / t_plain)
        if name == "greedy":
            accepted, drafts = sum(s.accepted for s in stats), sum(s.drafts for s in stats)
            rounds, round_tokens = sum(s.rounds for s in stats), sum(s.round_tokens for s in stats)
            batch_ms = sum(s.time_ms["batch"] for s in stats)
            plain_ms = t_plain * 1e3 / n_plain
    return ExactTrial(level.quality, int(level.max_draft), level.draft_stop, speed["greedy"], speed["sampled"],
                      accepted / drafts if drafts else 0.0, round_tokens / rounds if rounds else 0.0,
                      batch_ms / rounds / plain_ms if rounds else 0.0)


def exact_candidates(sources: Sequence[QualityLevel], lookup: bool) -> list[tuple[QualityLevel, int, float]]:
    """(exits, max_draft, draft_stop) to try: every lossy level with a layer on, each with every setting, then
    (with `lookup`, the pack's prompt lookup) every exit off, drafting from prompt lookup alone."""
    drafting = [source for source in sources if not source.off and not source.exact]
    if not drafting:  # no level exits at all; drafts are checked, so every predictor may draft at an even threshold
        drafting = [dataclasses.replace(sources[0], exits=dict.fromkeys(sources[0].exits, FALLBACK_EXIT),
                                        offline=sorted(sources[0].exits))]
    exits = [(source, max_draft, stop) for source in drafting for max_draft in MAX_DRAFTS for stop in DRAFT_STOPS]
    no_exits = plain_exact(sources[0])
    return exits + ([(no_exits, max_draft, 0.0) for max_draft in LOOKUP_DRAFTS] if lookup else [])


def choose_exact(engine: Engine, sources: Sequence[QualityLevel], calibration: Sequence[list[int]],
                 heldout: Sequence[list[int]], tokens: int, advance: Callable[[], None] = lambda: None,
                 ) -> tuple[QualityLevel, ExactReport]:
    """The exact level: the fastest candidate on the calibration prompts, measured again on the held-out ones,
    and left plain (every layer off) unless it pays there."""
    candidates = exact_candidates(sources, lookup=engine.policy.pack.lookup_max_n > 0)
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
    level = dataclasses.replace(level, speedup=chosen.speedup, speedup_sampled=chosen.speedup_sampled,
                                acceptance=chosen.acceptance, tokens_per_round=chosen.tokens_per_round,
                                verify_cost=chosen.verify_cost)
    return (level if chosen.pays else plain_exact(level)), ExactReport(chosen, chosen.pays, trials)


def _exits_of(source: QualityLevel) -> float | None:
    return None if source.off else source.quality


def with_exact(pack: Pack, level: QualityLevel) -> Pack:
    """`pack` with `level` as its exact level (replacing any) and its default: exact mode keeps the answers, and
    where drafting does not pay the level decodes plainly."""
    lossy = [lv for lv in pack.levels if not lv.exact]
    return dataclasses.replace(pack, levels=[*lossy, level], default_quality=EXACT_QUALITY)


def prompt_tokens(engine: Engine, prompts: Sequence[Prompt], part: Sequence[int], n: int) -> list[list[int]]:
    """The first n prompts of a split's part, as the engine is prompted with them."""
    return [engine.tokenize(engine.format_prompt(prompts[i].text)) for i in sorted(part)[:n]]


def exact_prompts(engine: Engine, prompts_path: Path | None, seed: int, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """Up to n prompts of the calibration split and n of the held-out split, as the pipeline splits them."""
    prompts = load_prompts(prompts_path)
    _, calibration, heldout = split(len(prompts), seed, CALIBRATION_SPLIT)
    return prompt_tokens(engine, prompts, calibration, n), prompt_tokens(engine, prompts, heldout, n)


def add_exact_level(model: Path, pack_path: Path, output: Path, *, prompts_path: Path | None = None, seed: int = 0,
                    n_prompts: int = 6, tokens: int = 64, threads: int = 2,
                    advance: Callable[[], None] = lambda: None) -> ExactReport:
    """calibrate --exact-only: choose the exact level of an existing pack and write the pack with it as default."""
    pack = read_pack(pack_path)
    engine = Engine(model, pack=pack_path, config=EngineConfig(n_ctx=2048, n_threads=threads))
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
    return len(exact_candidates(pack.levels, lookup=pack.lookup_max_n > 0)) + 1
