"""How long a calibration takes on this machine, and how large a run fits in a given number of minutes.

Each stage's time is its work (tokens decoded, hidden states through the LM head, rows trained on) times what
one unit of that work costs here, measured before the run starts (speed.py): a decode step with every layer
captured, a plain token through the engine, a prompt pass, and one hidden state through the logit lens (numpy's
matrix throughput on this machine, which also prices the other numpy stages). The few constants below say how
much work a stage does per row or per token beyond what the measurement covers; they come from the runs that
made the shipped packs (docs/calibrate.md), and each is a ratio of work, not a time on one machine.

Everything here is pure: the pipeline measures, then asks for an estimate, a size, or what is left.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from specee_edge.calibrate.draft_fit import DRAFT_EPOCHS
from specee_edge.data.prompts import CALIBRATION_SPLIT
from specee_edge.runtime.costs import ROUNDS, stop_layers

# (key, label) of the nine stages, in the order they run
STAGES = (("answers", "answers"), ("lens", "logit lens"), ("draft", "draft head"), ("predictors", "predictors"),
          ("costs", "costs on this machine"), ("levels", "quality levels"), ("engine", "levels in the engine"),
          ("exact", "exact mode"), ("temperatures", "temperatures"))

COST_ANSWERS = 3   # calibration-split greedy answers the cost lanes decode ...
COST_TOKENS = 32   # ... steps of each, in each of the cost rounds
CHEAP_ROUNDS = 3   # the fewest cost rounds a sized run falls back to
ANSWER_SHARE = 0.75  # an answer's length against --max-answer (the shipped models' runs: 0.70-1.0)
# A cost lane's token against a plain one: 4 lanes run every layer, 12 stop at a quarter to three quarters of
# the depth (the shipped models' runs: 0.47 gemma-3-270m, whose head is 60 % of a token; 0.58 SmolLM2; 0.99 Qwen).
COST_LANE_SHARE = 0.65
# An exact-mode trial's token against a plain one, prompt passes and verification batches included (0.9-1.4).
EXACT_SHARE = 1.15
# Multiply-adds, in units of the lens's own throughput, per training row and predictor layer: scikit-learn's
# 12->512->1 MLP over its epochs (about 25 with early stopping), whose small matrices run far below the lens's
# rate; and per calibration-split row and layer in the level search. From gemma-3-270m's run (153 s and 23 s).
MLP_WORK = 2.5e7
SEARCH_WORK = 1.5e7
DRAFT_EFFICIENCY = 1.6  # the draft head's fit against its matrix products alone (gemma-3-270m's run)
EXITING_SHARE = 0.5  # levels assumed to exit (replayed, checked and tried as drafts); after the search it is known


@dataclass(frozen=True)
class RunSize:
    """What a run collects and measures: the sizes --minutes chooses."""

    tokens: int            # answer steps to collect
    replay_tokens: int     # calibration-split steps the engine replays per candidate level
    heldout_tokens: int    # held-out steps behind each level's stored agreement
    identical_tokens: int  # tokens of each greedy answer compared with the full model's
    exact_tokens: int      # tokens of each answer exact mode's candidates decode
    cost_rounds: int       # rounds of the cost lanes, each on a freshly loaded model


DEFAULT_SIZE = RunSize(tokens=65000, replay_tokens=2000, heldout_tokens=4000, identical_tokens=64, exact_tokens=48,
                       cost_rounds=ROUNDS)
# the smallest run --minutes sizes: about 20 answers of 256 tokens, a few prompts per split
SMALLEST_SIZE = RunSize(tokens=4000, replay_tokens=500, heldout_tokens=1000, identical_tokens=32, exact_tokens=24,
                        cost_rounds=CHEAP_ROUNDS)


@dataclass(frozen=True)
class MachineSpeed:
    """Seconds per unit of work on this machine, for this model (speed.py measures them)."""

    step_s: float      # one collection step: a token decoded with every layer's output captured
    prompt_s: float    # one prompt's pass
    plain_s: float     # one plain token through the engine
    lens_row_s: float  # one hidden state through the final norm and the LM head (numpy)
    lens_head_s: float  # transposing the LM head, once per answer in the lens


@dataclass(frozen=True)
class RunShape:
    """What the run's work depends on besides its size."""

    n_layer: int
    first_layer: int   # the lowest predictor layer (the lens runs from here up)
    n_embd: int
    n_vocab: int
    draft_vocab: int
    levels: int        # quality levels asked for
    lookup: bool       # prompt lookup: two more exact-mode candidates
    prompts: int       # prompts in the set
    code_share: float  # of them, code prompts (their greedy answers are compared whole)
    max_answer: int
    exact_prompts: int
    cached_steps: int = 0      # answer steps already in the work dir
    lens_cached: bool = False  # the lens of exactly those answers is there too
    exiting: int | None = None  # levels with exits, once the search has chosen them (None: EXITING_SHARE of them)

    @property
    def answer_tokens(self) -> float:
        return ANSWER_SHARE * self.max_answer

    @property
    def predictor_layers(self) -> int:
        return self.n_layer - self.first_layer


def estimate(size: RunSize, shape: RunShape, speed: MachineSpeed) -> dict[str, float]:
    """Estimated seconds of each stage (STAGES' keys)."""
    train, calib, test = (share * size.tokens for share in CALIBRATION_SPLIT)
    answers = size.tokens / shape.answer_tokens
    answered = min(shape.prompts, answers)  # prompts with a greedy answer (the first round answers each once)
    exiting = math.ceil(EXITING_SHARE * shape.levels) if shape.exiting is None else shape.exiting
    mac_s = speed.lens_row_s / (shape.n_vocab * shape.n_embd)  # one multiply-add at the lens's rate

    new_steps = max(0, size.tokens - shape.cached_steps)
    collect = new_steps * speed.step_s + new_steps / shape.answer_tokens * speed.prompt_s
    lens = 0.0 if shape.lens_cached else (
        (size.tokens + answers) * shape.predictor_layers * speed.lens_row_s + answers * speed.lens_head_s)
    # a ridge fit on [embedding; hidden] (x'x: 4 n_embd^2 a row) on the training rows and about half as many
    # again after an early exit, then DRAFT_EPOCHS of cross-entropy over the draft vocabulary (forward, backward)
    draft_rows = 1.5 * train
    draft = DRAFT_EFFICIENCY * draft_rows * shape.n_embd * (4 * shape.n_embd + 6 * DRAFT_EPOCHS * shape.draft_vocab) * mac_s
    predictors = MLP_WORK * train * shape.predictor_layers * mac_s
    lanes = 4 + 4 * len(stop_layers(shape.n_layer))
    cost_passes = size.cost_rounds * COST_ANSWERS * lanes
    costs = cost_passes * (COST_TOKENS * COST_LANE_SHARE * speed.plain_s + speed.prompt_s)
    levels = SEARCH_WORK * calib * shape.predictor_layers * mac_s
    # each level with exits replayed, and about as many more points where one falls short; the code answers of
    # the calibration split compared whole for the default; then the held-out steps and greedy answers
    replayed = min(size.replay_tokens, calib)
    heldout = min(size.heldout_tokens, test)
    heldout_answers = CALIBRATION_SPLIT[2] * answered
    code_answers = CALIBRATION_SPLIT[1] * answered * shape.code_share
    engine_steps = exiting * (2 * replayed + code_answers * size.identical_tokens
                              + heldout + heldout_answers * size.identical_tokens)
    engine_passes = exiting * ((2 * replayed + heldout) / shape.answer_tokens + code_answers + heldout_answers)
    engine = engine_steps * speed.plain_s + engine_passes * speed.prompt_s
    # every drafting candidate (4 settings per level with exits, 2 of prompt lookup alone) and the chosen one again:
    # each prompt greedy and sampled, by plain decoding and by exact mode
    trials = 4 * exiting + (2 if shape.lookup else 0) + 1
    exact = trials * 2 * 2 * shape.exact_prompts * size.exact_tokens * EXACT_SHARE * speed.plain_s
    # a scale per layer, fitted on the exit rows of the default level: at most every calibration and test row,
    # each through its exit layer's full head
    temperatures = (calib + test) * speed.lens_row_s
    return dict(answers=collect, lens=lens, draft=draft, predictors=predictors, costs=costs, levels=levels,
                engine=engine, exact=exact, temperatures=temperatures)


def scaled(scale: float, cost_rounds: int, default: RunSize = DEFAULT_SIZE, smallest: RunSize = SMALLEST_SIZE) -> RunSize:
    """The default run with every size but the cost rounds times `scale`, none below the smallest run's."""
    sizes = {name: max(getattr(smallest, name), round(getattr(default, name) * scale))
             for name in ("tokens", "replay_tokens", "heldout_tokens", "identical_tokens", "exact_tokens")}
    return RunSize(**sizes, cost_rounds=cost_rounds)


def fit_minutes(minutes: float, shape: RunShape, speed: MachineSpeed) -> RunSize:
    """The largest run (the default scaled down, never up) whose estimate fits in `minutes`: the cost rounds are
    kept unless even the smallest run does not fit with them. Where nothing fits, the smallest run."""
    budget = 60.0 * minutes

    def total(size: RunSize) -> float:
        return sum(estimate(size, shape, speed).values())

    for rounds in (DEFAULT_SIZE.cost_rounds, CHEAP_ROUNDS):
        if total(scaled(1.0, rounds)) <= budget:
            return scaled(1.0, rounds)
        if total(scaled(0.0, rounds)) <= budget:
            low, high = 0.0, 1.0  # total() grows with the scale: bisect for the largest that fits
            for _ in range(40):
                middle = (low + high) / 2
                low, high = (middle, high) if total(scaled(middle, rounds)) <= budget else (low, middle)
            return scaled(low, rounds)
    return scaled(0.0, CHEAP_ROUNDS)


def given_up(size: RunSize, shape: RunShape, default: RunSize = DEFAULT_SIZE) -> list[str]:
    """What a run of `size` gives up against the default one, one sentence each."""
    lines = []
    if size.tokens < default.tokens:
        answered = min(shape.prompts, size.tokens / shape.answer_tokens)
        lines.append(f"{size.tokens:,} answer steps instead of {default.tokens:,}: fewer rows for the draft head and the "
                     "predictors, so fewer exits pay"
                     + (f"; about {answered:.0f} of the {shape.prompts} prompts answered (in turns from each category), "
                        "so every split holds fewer"
                        if answered < shape.prompts else ""))
    if size.heldout_tokens < default.heldout_tokens:
        wider = math.sqrt(default.heldout_tokens / size.heldout_tokens)
        lines.append(f"held-out figures from {size.heldout_tokens:,} steps instead of {default.heldout_tokens:,}: each "
                     f"level's agreement interval about {wider:.1f}x as wide, so more levels ship renamed below the name "
                     "asked for, or are dropped (the highest first)")
    if size.replay_tokens < default.replay_tokens:
        lines.append(f"each level checked in the engine on {size.replay_tokens:,} steps instead of "
                     f"{default.replay_tokens:,}: wider speed-up intervals, so a level near the edge of paying is turned off")
    if size.identical_tokens < default.identical_tokens:
        lines.append(f"whole answers compared over {size.identical_tokens} tokens instead of {default.identical_tokens}: "
                     "the share of identical answers is measured on shorter ones")
    if size.exact_tokens < default.exact_tokens:
        lines.append(f"exact mode timed on {size.exact_tokens}-token answers instead of {default.exact_tokens}: wider "
                     "intervals, so it drafts only where it gains more")
    if size.cost_rounds < default.cost_rounds:
        lines.append(f"costs timed in {size.cost_rounds} rounds instead of {default.cost_rounds}: in simulation their "
                     "95% intervals held the true costs 0.87 of the time, against 0.97")
    return lines


def remaining(estimates: Mapping[str, float], finished: Mapping[str, float], current: str | None = None,
              current_s: float = 0.0, fraction: float | None = None) -> float:
    """Seconds left in the whole run: the rest of the current stage and the stages not yet run, each estimate
    scaled by the pace of the finished stages (their time against their estimate, kept within 0.5-2). The current
    stage's rest comes from its own progress once a tenth of it is done, else from its estimate."""
    estimated = sum(estimates[key] for key in finished)
    pace = min(2.0, max(0.5, sum(finished.values()) / estimated)) if estimated > 0 else 1.0
    later = sum(seconds for key, seconds in estimates.items() if key not in finished and key != current) * pace
    if current is None:
        return later
    if fraction is not None and fraction >= 0.1:
        return later + current_s * (1 - fraction) / fraction
    return later + max(0.0, estimates[current] * pace - current_s)


def with_sizes(config, size: RunSize):
    """A CalibrateConfig (any dataclass with RunSize's fields) with `size`'s sizes."""
    return dataclasses.replace(config, **dataclasses.asdict(size))


def size_of(config) -> RunSize:
    """The sizes a CalibrateConfig runs with."""
    return RunSize(**{name: getattr(config, name) for name in RunSize.__dataclass_fields__})
