"""Bench results: dataclasses, the JSON document, rich tables, the exit-layer histogram and the
speed/quality trade-off (text and PNG)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from specee_edge.runtime.costs import TokenCosts, split_text

# the "vanilla" lane: llama-cpp-python's Llama.eval one token at a time with specee-edge's draw (runner.VanillaLane),
# not llama-cpp-python's own decoding loop (create_completion, generate): named for what it runs
LLAMA_CPP_PYTHON = "llama-cpp-python Llama.eval"
BARE_CONTEXT = "specee-edge Context (bare)"
TIME_PARTS = ("draft", "layers", "predictor", "verify", "batch", "other", "sample")  # batch: exact mode's verification
HISTOGRAM_WIDTH = 48  # text cells shared by the histogram's bars (80-column terminals)
REPEAT = " (repeat)"  # a repeat lane's name: its twin's, then this
# equal lanes read 1.0x each other: a repeat outside this band of its twin, or whose interval leaves out 1, drifted
STEADY = (0.98, 1.02)


def repeat_of(name: str) -> str:
    """The name of the repeat lane of `name`: a fresh equal twin of it, run in the same pass."""
    return name + REPEAT


def twin_of(name: str) -> str | None:
    """The lane a repeat lane repeats; None for a lane that is no repeat."""
    return name[: -len(REPEAT)] if name.endswith(REPEAT) else None


def drifts(ratio: float, interval: tuple[float, float] | None) -> bool:
    """Whether a repeat's ratio to its equal twin says the machine moved under the run: the ratio outside STEADY,
    or its interval (where it has one) without 1.0."""
    low, high = STEADY
    return not low <= ratio <= high or (interval is not None and not interval[0] <= 1.0 <= interval[1])


@dataclass
class ExactChoices:
    """What exact mode's controller chose in a lane, and what it measured on this machine."""

    shares: dict[str, float]          # decoded tokens by the controller's choice: plain steps, lookup rounds, exit
    #                                   rounds (an exit round whose first step did not exit gave one token: an exit round's)
    mean_drafts: float                # drafts per verification batch
    explore_rounds: int               # rounds taken to measure a choice again
    explore_ms_per_token: float       # ... their cost beyond the choices they displaced, per decoded token
    controller: dict                  # its cost and acceptance estimates at the end of the lane (ms)
    by_category: dict[str, dict[str, float]] = field(default_factory=dict)  # acceptance_rate, tokens_per_round,
    #                                                                         verify_cost (batch / vanilla step), plain


@dataclass
class SampledResult:
    """A lane with chat's default sampling (seeded per prompt, the same seeds in every lane)."""

    speedup: float                    # speedup_sampled: against the baseline sampling the same prompts and seeds
    identical: float                  # answers identical to vanilla's sampled ones (exact mode: up to near-ties)
    acceptance_rate: float = 0.0      # exact mode: drafts accepted under sampling
    tokens_per_round: float = 0.0
    speedup_no_loop: float | None = None  # greedy lanes: the speed-up on the answers that do not loop
    speedup_by_category: dict[str, float] = field(default_factory=dict)
    exact: ExactChoices | None = None     # exact mode: what its controller chose
    round_trips: RoundTrips | None = None  # with --rpc: what its sampled steps waited for from the workers
    # 95% intervals of the speed-ups, bootstrapped over the prompts (those of the category, those that do not loop)
    speedup_interval: tuple[float, float] | None = None
    speedup_no_loop_interval: tuple[float, float] | None = None
    speedup_by_category_interval: dict[str, tuple[float, float] | None] = field(default_factory=dict)


@dataclass
class ToolLane:
    """A lane of another tool: llama-server (plain, or with its speculation; under llama.cpp's names) or
    llama-cpp-python's Llama.eval. Speed-ups are against the run's baseline (llama-server plain where it ran)."""

    tok_s: float                      # greedy decode tokens per second
    speedup: float
    identical: float                  # whole greedy answers equal to the Llama.eval lane's
    drafted: int = 0                  # greedy: tokens its speculation drafted (llama-server's draft_n)
    accepted: int = 0                 # ... and the model accepted (draft_n_accepted)
    speculates: bool = False          # a llama-server lane whose server reported speculative decoding set up
    tok_s_sampled: float | None = None
    speedup_sampled: float | None = None
    drafted_sampled: int = 0
    accepted_sampled: int = 0
    speedup_by_category: dict[str, float] = field(default_factory=dict)
    speedup_by_category_sampled: dict[str, float] = field(default_factory=dict)
    # 95% intervals of the speed-ups, bootstrapped over the prompts (those of the category)
    speedup_interval: tuple[float, float] | None = None
    speedup_sampled_interval: tuple[float, float] | None = None
    speedup_by_category_interval: dict[str, tuple[float, float] | None] = field(default_factory=dict)
    speedup_by_category_sampled_interval: dict[str, tuple[float, float] | None] = field(default_factory=dict)


@dataclass
class RepeatResult:
    """A repeat lane against its twin in one pass. Both run the same program with the same settings, each fresh,
    in the same shuffled order as every lane: whatever the ratio reads besides 1.0 is this run's noise, which every
    other ratio of the run carries too."""

    lane: str                         # the repeat's name: its twin's and " (repeat)"
    twin: str
    decoding: str                     # the pass: greedy or sampled
    ratio: float                      # the repeat's tok/s over its twin's, over every prompt
    interval: tuple[float, float] | None  # 95%, bootstrapped over the prompts, paired (None for a single prompt)
    drifted: bool = field(init=False)  # drifts(ratio, interval)

    def __post_init__(self) -> None:
        self.drifted = drifts(self.ratio, self.interval)

    def reading(self) -> str:
        """What it read, for the drift line: `llama-server (repeat) read 0.95x its twin (0.93-0.97)`."""
        sampled = "" if self.decoding == "greedy" else f" {self.decoding}"
        spread = f" ({self.interval[0]:.2f}-{self.interval[1]:.2f})" if self.interval else ""
        return f"{self.lane} read {self.ratio:.2f}x its twin{sampled}{spread}"


def drift_line(repeats: Sequence[RepeatResult]) -> str | None:
    """One line for the top of the report where a repeat drifted (None where none did): a reader weighs every
    ratio of the run by it."""
    readings = [repeat.reading() for repeat in repeats if repeat.drifted]
    if not readings:
        return None
    return f"the run drifted: {', '.join(readings)}; ratios in this run carry that much noise"


def repeat_rows(repeats: Sequence[RepeatResult]) -> list[tuple[str, str]]:
    """A row per repeat lane for the run's table: its ratio to its twin in each pass, with the interval."""
    by_lane: dict[str, list[RepeatResult]] = {}
    for repeat in repeats:
        by_lane.setdefault(repeat.lane, []).append(repeat)
    return [("repeat", f"{lane} against {passes[0].twin}: "
                       + ", ".join(f"{ratio(r.ratio, r.interval, sep=' ')} {r.decoding}" for r in passes))
            for lane, passes in by_lane.items()]


@dataclass
class RoundTrips:
    """What a lane's decode steps waited for from the RPC workers (--rpc), per step: the replies, and the
    time waiting for them (the worker's compute of the graph sent before each reply included)."""

    per_step: float
    wait_ms_per_step: float


@dataclass
class RpcResult:
    """The run's RPC workers: a bare round trip, and vanilla's round trips (the lanes' are in their ModeResult)."""

    workers: list[str]
    bare_round_trip_ms: float         # median of a device-memory query: the least a stop after a remote layer adds
    vanilla: RoundTrips
    vanilla_sampled: RoundTrips | None = None  # ... in the sampled pass (None with --greedy-only)


@dataclass
class ModeResult:
    """SpecEE with one KV mode at one quality level; names from SPEC.md §5."""

    kv_mode: str                      # `MODE/python` for the Python exit policy
    quality: float | None             # the pack's quality level (None: a pack without levels)
    steps: int                        # timed decode steps (each prompt's first token comes from the prompt pass)
    specee_tok_s: float
    speedup: float
    speedup_no_loop: float | None     # ... on the prompts whose vanilla answer does not loop (None: every one loops)
    gain_captured: float | None       # of the head-free oracle's gain; None when it is 1 (nothing to capture)
    agreement: float
    exact_prefix: float
    identical: float                  # answers identical to vanilla's (greedy, whole answers)
    identical_by_category: dict[str, float]
    ppl_specee: float                 # with the pack's temperatures on exit logits
    ppl_specee_raw: float             # without them
    avg_exit_layer: float
    exit_rate: float
    head_free_rate: float             # steps emitted from the candidates' logits (no full-vocabulary head)
    candidate_mass: float | None      # at those steps, the full model's probability mass on the candidates
    predictor_calls_per_token: float
    verify_fail_rate: float
    draft_recall_at_k: float          # the emitted token was a candidate (any source)
    recall_draft_head: float          # ... one of the draft head's
    recall_lookup: float              # ... the prompt-lookup one
    # per prompt category: {"steps", "draft_recall_at_k", "recall_draft_head", "recall_lookup"}
    recall_by_category: dict[str, dict[str, float]]
    ms_per_token: dict[str, float]    # TIME_PARTS; sample is outside the decode time
    exit_histogram: list[int]         # index = exit layer; the last = ran every layer; sums to steps
    exact: bool = False               # exact mode: exits draft, the full model verifies
    acceptance_rate: float = 0.0      # exact mode, greedy: drafted tokens the full model accepted
    tokens_per_round: float = 0.0     # ... tokens emitted per verification batch
    lookup_round_share: float = 0.0   # ... batches whose drafts came from prompt lookup (the rest: from exits)
    verify_cost: float | None = None  # ... one verification batch against one vanilla step (measured)
    divergences: int = 0              # answers that depart from vanilla greedy
    near_ties: int = 0                # ... where vanilla's top-2 logits differed by less than quality.NEAR_TIE
    largest_divergence_margin: float | None = None
    # exact mode, greedy: answers whose tokens are not llama.cpp's own evaluation of their rounds (batched_replay:
    # each batch as one batch of its rows); 0 unless exact mode is broken. None: a lossy lane
    off_replay: int | None = None
    sampled: SampledResult | None = None
    # the pack's figures for the level, beside which the bench's measured ones stand: a lossy level's speed-up is
    # predicted from measured costs, exact mode's measured against plain decoding at calibration (None: no level)
    calibrated_speedup: float | None = None
    calibrated_speedup_sampled: float | None = None
    calibrated_agreement: tuple[float, float] | None = None  # lossy levels: the stored 95% interval
    agreement_interval: tuple[float, float] | None = None  # the bench's own 95% interval, over its prompts
    speedup_by_category: dict[str, float] = field(default_factory=dict)  # greedy
    choices: ExactChoices | None = None  # exact mode, greedy
    pack: bool = True                 # False: the engine without a pack (exact mode drafting by prompt lookup only)
    round_trips: RoundTrips | None = None  # with --rpc
    # 95% intervals of the greedy speed-ups, bootstrapped over the prompts (all, those that do not loop, a category's)
    speedup_interval: tuple[float, float] | None = None
    speedup_no_loop_interval: tuple[float, float] | None = None
    speedup_by_category_interval: dict[str, tuple[float, float] | None] = field(default_factory=dict)


@dataclass
class GrammarAnswers:
    """One lane's answers in one pass under the run's grammar: whether they kept to it, and whether the whole ones
    are what it was for (JSON that fits the schema)."""

    answers: int                      # answers the lane decoded
    finished: int                     # ... that ended at an end of generation within -n (finish "stop"): whole ones
    in_grammar: float                 # share of the answers whose every token the grammar takes, in order
    parsed: float | None              # share of the finished answers that parse as JSON (None: none finished)
    valid: float | None               # ... that also fit the schema (None: none finished, or no schema checked)
    masked_draws_per_token: float | None  # draws the grammar refused first, drawn again over what it allows, per
    #                                       token; None where llama.cpp's own loop draws (llama-server, the peer)


@dataclass
class GrammarRun:
    """The one grammar every lane decoded under, and what each lane's answers made of it."""

    origin: str                       # the flag it came from, or the extract set's schema
    chars: int                        # its GBNF's size
    rules: int
    schema: bool                      # made from a JSON schema (-j, the extract set's)
    validated: bool                   # finished answers checked against it by jsonschema (False: only parsed)
    lanes: dict[str, dict[str, GrammarAnswers]] = field(default_factory=dict)  # by lane name, then pass


@dataclass
class BenchResult:
    model: str
    pack: str
    n_layer: int
    threads: int
    k: int
    prompt_set: str
    prompts: int
    tokens: int
    vanilla_steps: int
    vanilla_tok_s: float
    # the oracles and costs price exits: None (the histogram empty) for a model without a pack
    oracle_speedup: float | None      # verified exits (each pays a head)
    oracle_avg_exit_layer: float | None
    oracle_head_free_speedup: float | None  # head-free exits (no head)
    oracle_head_free_avg_exit_layer: float | None
    oracle_histogram: list[int]
    costs: TokenCosts | None          # measured in this run (runtime/costs.py)
    ppl_full: float
    ppl_tokens: int
    default_quality: float | None     # the pack's default level (None: a pack without levels)
    modes: list[ModeResult]
    seconds: float
    command: str
    vanilla_sampled_tok_s: float | None = None
    peer: SampledResult | None = None          # llama-cpp-python's prompt-lookup speculative decoding, greedy
    peer_sampled: SampledResult | None = None  # ... sampled
    # per category, the mean share of vanilla greedy's answer tokens inside a 4-gram it already said
    repetition_by_category: dict[str, float] = field(default_factory=dict)
    looping_answers: int = 0                   # vanilla greedy answers at least half repeated (quality.LOOP_SHARE)
    repetition_sampled_by_category: dict[str, float] = field(default_factory=dict)  # ... of vanilla sampled's
    looping_answers_sampled: int = 0
    # prompt lookup replayed over vanilla's answers per category (greedy, sampled): acceptance, tokens per round,
    # and the speed-up where a batch costs one step (bench/lookup_replay.py)
    lookup_replay: dict[str, dict[str, float]] = field(default_factory=dict)
    lookup_replay_sampled: dict[str, dict[str, float]] = field(default_factory=dict)
    rpc: RpcResult | None = None                # layers on RPC workers (--rpc)
    placement: str = ""                         # where every lane's layers ran (runtime.placement; all lanes alike)
    baseline: str = LLAMA_CPP_PYTHON            # the lane every speed-up is against: llama-server plain where it ran
    baseline_sampled: str | None = None         # ... in the sampled pass
    tools: dict[str, ToolLane] = field(default_factory=dict)  # llama-server's lanes and the Llama.eval lane
    bare_ms_per_token: dict[str, float] | None = None  # the bare Context lane's TIME_PARTS (greedy): the floor of other
    vanilla_ms_per_token: dict[str, float] | None = None  # the Llama.eval lane's (greedy): layers is Llama.eval's decode
    dropped: list[str] = field(default_factory=list)  # lanes that failed (to build, start or decode), a line each
    notes: list[str] = field(default_factory=list)    # what those failures changed (the baseline moved), a line each
    # the lanes' order, shuffled per prompt: {seed, greedy, sampled (None with --greedy-only)}, each a list per prompt
    # of lane names in the order they answered
    lane_order: dict = field(default_factory=dict)
    repeats: list[RepeatResult] = field(default_factory=list)  # each repeat lane against its twin, per pass
    grammar: GrammarRun | None = None  # the grammar every lane decoded under (None: none)

    @property
    def vanilla_speedup(self) -> float:
        """The Llama.eval lane against the baseline (the oracle is priced in its steps)."""
        lane = self.tools.get(LLAMA_CPP_PYTHON)
        return lane.speedup if lane else 1.0

    @property
    def baseline_sampled_tok_s(self) -> float | None:
        """The sampled baseline's tok/s (a sampled lane's is its speed-up times this)."""
        base = self.tools.get(self.baseline_sampled or "")
        return base.tok_s_sampled if base else None

    @property
    def main(self) -> ModeResult:
        """The first KV mode at the pack's default level (the first lane if that level was not run)."""
        return next((m for m in self.modes if m.quality == self.default_quality), self.modes[0])

    def lane(self, mode: ModeResult) -> str:
        """A lane's name: its KV mode, and its quality level when the run has several."""
        several = len({m.quality for m in self.modes}) > 1
        return self.level_label(mode) if several else mode.kv_mode

    @property
    def oracle_exit_rate(self) -> float:
        return 1 - self.oracle_histogram[-1] / max(sum(self.oracle_histogram), 1)

    def to_json(self) -> dict:
        """The main lane's figures at the top level; every lane's under `modes`."""
        shared = asdict(self) | {"costs": self.costs.to_dict() if self.costs else None}  # without the bootstrap resamples
        del shared["modes"]
        main = asdict(self.main)
        head = {key: shared.pop(key) for key in ("model", "pack", "n_layer", "threads", "k", "prompt_set", "prompts", "tokens")}
        return {
            **head,
            "kv_mode": main.pop("kv_mode"),
            "vanilla_tok_s": shared.pop("vanilla_tok_s"),
            **main,
            "oracle_tok_s": self.vanilla_tok_s * self.oracle_speedup if self.oracle_speedup else None,
            **shared,
            "modes": {self.lane(m): asdict(m) for m in self.modes},
        }

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    # --- terminal ----------------------------------------------------------------------------

    def render(self) -> Group:
        drift = drift_line(self.repeats)
        parts = [*([Text(drift, style="bold yellow")] if drift else []), self._run(), self._against_llama_cpp(),
                 self._grammar(), self._quality(), self._machinery(), self._exact_choices(), self._by_category(),
                 self._time_split(), self._histogram()]
        return Group(*parts, *([self._round_trips()] if self.rpc else []))

    def _round_trips(self) -> Table:
        """--rpc: per step, greedy and sampled, the replies each lane waited for from the workers and the time spent
        waiting."""
        rpc = self.rpc
        table = Table(title=f"RPC round trips per step: {', '.join(rpc.workers)} (placement above);"
                            f" a bare round trip {rpc.bare_round_trip_ms:.3f} ms", box=box.SIMPLE_HEAD,
                      caption="waiting includes the workers' compute of the graphs sent before each reply")
        for name in ("lane", "speed-up", "round trips", "ms waiting", "share of step"):
            table.add_column(name, justify="right" if name != "lane" else "left")
        vanilla_ms = 1e3 / self.vanilla_tok_s if self.vanilla_tok_s else 0.0
        rows = [("vanilla", 1.0, rpc.vanilla, vanilla_ms)]
        rows += [(self.level_label(m), m.speedup, m.round_trips, 1e3 / m.specee_tok_s if m.specee_tok_s else 0.0)
                 for m in self.modes if m.round_trips]
        if rpc.vanilla_sampled and self.vanilla_sampled_tok_s:
            sampled_ms = 1e3 / self.vanilla_sampled_tok_s
            rows.append(("vanilla, sampled", 1.0, rpc.vanilla_sampled, sampled_ms))
            base = self.baseline_sampled_tok_s
            rows += [(f"{self.level_label(m)}, sampled", m.sampled.speedup, m.sampled.round_trips,
                      1e3 / (m.sampled.speedup * base) if base and m.sampled.speedup else 0.0)
                     for m in self.modes if m.sampled and m.sampled.round_trips]
        for label, speedup, trips, step_ms in rows:
            table.add_row(label, f"{speedup:.3f}x", f"{trips.per_step:.2f}", f"{trips.wait_ms_per_step:.3f}",
                          f"{trips.wait_ms_per_step / step_ms:.2f}" if step_ms else "-")
        return table

    def _against_llama_cpp(self) -> Table:
        """Every lane's decode speed, greedy and sampled, against the baseline (llama-server plain where it ran):
        llama-server's own lanes with what their speculation drafted and had accepted, the Llama.eval lane,
        the peer and each SpecEE lane."""
        sampled = self.baseline_sampled is not None
        caption = f"speed-ups against {self.baseline}"
        if sampled and self.baseline_sampled != self.baseline:
            caption += f" (sampled: against {self.baseline_sampled})"
        caption += (f"; [95% interval, bootstrapped over the {self.prompts} prompts]; every lane timed alike: whole "
                    "answers, decoding only, the lanes in a shuffled order per prompt, each fresh in each pass")
        table = Table(title="decode speed against llama.cpp", box=box.SIMPLE_HEAD, caption=caption)
        for name in ("lane", "tok/s greedy", "speed-up greedy", "tok/s sampled", "speed-up sampled",
                     "accepted / drafted (greedy; sampled)"):
            # a speed-up's interval, [0.98-1.11], on its own line: the column keeps it whole
            table.add_column(name, justify="left" if name == "lane" else "right",
                             min_width=11 if name.startswith("speed-up") else None)
        for name, lane in self.tools.items():
            drafts = (f"{lane.accepted} / {lane.drafted}; {lane.accepted_sampled} / {lane.drafted_sampled}"
                      if lane.speculates or lane.drafted or lane.drafted_sampled else "-")
            table.add_row(name, f"{lane.tok_s:.1f}", ratio(lane.speedup, lane.speedup_interval),
                          fmt_tok_s(lane.tok_s_sampled), ratio(lane.speedup_sampled, lane.speedup_sampled_interval),
                          drafts)
        if self.peer:
            sampled_peer = self.peer_sampled
            table.add_row("peer (llama-cpp-python prompt lookup)", "-", ratio(self.peer.speedup, self.peer.speedup_interval),
                          "-", ratio(sampled_peer.speedup, sampled_peer.speedup_interval) if sampled_peer else "-", "-")
        base_sampled = self.baseline_sampled_tok_s
        for m in self.modes:
            tok_s_sampled = m.sampled.speedup * base_sampled if m.sampled and base_sampled else None
            table.add_row(f"specee-edge {self.level_label(m)}", f"{m.specee_tok_s:.1f}",
                          ratio(m.speedup, m.speedup_interval), fmt_tok_s(tok_s_sampled),
                          ratio(m.sampled.speedup, m.sampled.speedup_interval) if m.sampled else "-", "-")
        return table

    def _grammar(self) -> Table | str:
        """Each lane's answers under the grammar, greedy / sampled: the whole ones, whether every answer kept to the
        grammar, the whole ones that parse (and fit the schema), and what the grammar's mask cost our draws."""
        if self.grammar is None:
            return ""
        table = Table(title="answers under the grammar (greedy / sampled)", box=box.SIMPLE_HEAD,
                      caption="finished: ended at an end of generation within -n; JSON and schema: shares of those")
        for name in ("lane", "finished", "in grammar", "JSON", "schema", "masked draws per token"):
            table.add_column(name, justify="left" if name == "lane" else "right")
        cells = (lambda a: f"{a.finished} of {a.answers}", lambda a: f"{a.in_grammar:.2f}", lambda a: share(a.parsed),
                 lambda a: share(a.valid), lambda a: fmt(a.masked_draws_per_token))
        for name, passes in self.grammar.lanes.items():
            table.add_row(name, *(" / ".join(cell(a) for a in passes.values()) for cell in cells))
        return table

    def _run(self) -> Table:
        table = Table(title=f"specee-edge bench: {self.model}", show_header=False)
        table.add_column(style="bold")
        table.add_column()
        c = self.costs
        rows = [
            ("run", f"{self.prompts} prompts ({self.prompt_set}) x {self.tokens} tokens, greedy"
                    f"{' and sampled (temperature 0.8, seeded)' if self.vanilla_sampled_tok_s else ''}, "
                    f"{self.threads} thread{'s' if self.threads != 1 else ''}, {self.seconds:.0f} s"),
            ("pack", f"{self.pack} (k = {self.k})"),
            ("placement", self.placement),
            ("vanilla", f"{self.vanilla_tok_s:.1f} tok/s ({1e3 / self.vanilla_tok_s if self.vanilla_tok_s else 0:.2f} ms per step)"
                        + (f", sampled {self.vanilla_sampled_tok_s:.1f} tok/s" if self.vanilla_sampled_tok_s else "")),
            ("oracle_speedup", f"verified {self.oracle_speedup:.3f}x, head-free {self.oracle_head_free_speedup:.3f}x"
                               if self.oracle_speedup else "- (no pack: nothing exits)"),
            ("costs (ms)", f"layer {c.layer_ms:.3f} ({c.mask_ms:+.3f} masked), head {c.head_ms:.2f}, draft {c.draft_ms:.3f}, "
                           f"check {c.check_ms:.3f}, fixed {c.fixed_ms:.2f}" if c else "-"),
            *([("costs past the split", split_text(c.to_dict()))] if c and c.split is not None else []),
            ("ppl_full", f"{self.ppl_full:.2f} ({self.ppl_tokens} held-out tokens)"),
            ("repetition", ", ".join(f"{c} {r:.2f}" for c, r in self.repetition_by_category.items())
                           + f" (vanilla greedy's tokens in a repeated 4-gram); {self.looping_answers} of {self.prompts}"
                           " answers loop (half or more)"),
            ("repetition, sampled", ", ".join(f"{c} {r:.2f}" for c, r in self.repetition_sampled_by_category.items())
                                    + f"; {self.looping_answers_sampled} of {self.prompts} answers loop"
                                    if self.repetition_sampled_by_category else "-"),
        ]
        rows += repeat_rows(self.repeats)
        rows += [("grammar", grammar_line(self.grammar))] if self.grammar else []
        rows += [("dropped", line) for line in self.dropped]
        rows += [("note", line) for line in self.notes]
        if self.peer and self.peer.speedup_no_loop is not None:
            no_loop = ratio(self.peer.speedup_no_loop, self.peer.speedup_no_loop_interval, sep=" ")
            rows.append(("peer, no loops", f"{no_loop} greedy on the answers that do not loop"))
        for label, value in rows:
            table.add_row(label, value)
        return table

    def _quality(self) -> Table:
        """Speed against quality: a row per lane (KV mode at a quality level; * the pack's default), vanilla
        and the oracles. Headers break between words, so that the table fits 80 columns."""
        levels = ("* the pack's default level; ppl with the pack's temperatures (without them: the JSON's "
                  "ppl_specee_raw); " if self.default_quality is not None else "")
        table = Table(title="speed and quality", box=box.SIMPLE_HEAD, show_edge=False, padding=0,
                      caption=f"{levels}identical: whole answers equal to vanilla's; speed-ups with their 95% "
                              "interval, bootstrapped over the prompts")
        table.add_column("lane", style="bold", no_wrap=True, vertical="bottom")
        for name in ("speed-\nup\nsam-\npled", "speed-\nup\ngree-\ndy", "agree-\nment", "iden-\ntical", "exact\nprefix",
                     "ppl", "avg\nexit\nlayer", "exit\nrate", "head-\nfree\nrate"):
            table.add_column(name, justify="right", vertical="bottom")
        llama = self.tools.get(LLAMA_CPP_PYTHON)
        table.add_row("vanilla", ratio(llama.speedup_sampled, llama.speedup_sampled_interval)
                      if llama and llama.speedup_sampled else "-",
                      ratio(self.vanilla_speedup, llama.speedup_interval if llama else None), "1.000", "1.00", "-",
                      f"{self.ppl_full:.2f}", f"{self.n_layer - 1:.2f}", "0.000", "0.000")
        for m in self.modes:
            default = "*" if m.quality is not None and m.quality == self.default_quality else " "
            table.add_row(self.level_label(m) + default,
                          ratio(m.sampled.speedup, m.sampled.speedup_interval) if m.sampled else "-",
                          ratio(m.speedup, m.speedup_interval), f"{m.agreement:.3f}", f"{m.identical:.2f}",
                          f"{m.exact_prefix:.1f}", f"{m.ppl_specee:.2f}",
                          f"{m.avg_exit_layer:.2f}", f"{m.exit_rate:.3f}", f"{m.head_free_rate:.3f}")
        if self.peer:
            sampled_peer = self.peer_sampled
            table.add_row("peer", ratio(sampled_peer.speedup, sampled_peer.speedup_interval) if sampled_peer else "-",
                          ratio(self.peer.speedup, self.peer.speedup_interval), "-", f"{self.peer.identical:.2f}",
                          *["-"] * 5)
        if self.oracle_speedup:
            table.add_row("oracle", "-", f"{self.oracle_speedup * self.vanilla_speedup:.3f}x", "1.000", "1.00", "-", "-",
                          f"{self.oracle_avg_exit_layer:.2f}", f"{self.oracle_exit_rate:.3f}", "0.000")
            table.add_row("oracle hf", "-", f"{self.oracle_head_free_speedup * self.vanilla_speedup:.3f}x", "1.000",
                          "1.00", "-", "-", f"{self.oracle_head_free_avg_exit_layer:.2f}", "-", "-")
        return table

    @staticmethod
    def level_label(m: ModeResult) -> str:
        if not m.pack:
            return m.kv_mode  # bench.run.NO_PACK: exact mode without the pack
        if m.quality is None:
            return m.kv_mode
        return f"{m.kv_mode}@exact" if m.exact else f"{m.kv_mode}@{m.quality:g}"

    def _machinery(self) -> Table:
        table = Table(title="SpecEE")
        table.add_column("lane", style="bold", min_width=18)  # the metric names whole, however many lanes
        for m in self.modes:
            table.add_column(self.lane(m), justify="right")
        rows = [
            ("specee tok/s", lambda m: f"{m.specee_tok_s:.1f}"),
            ("calibrated speedup (greedy / sampled)", calibrated_cell),
            ("calibrated agreement: interval, inside; bench's interval, overlap; promise kept", agreement_cell),
            ("speedup greedy, answers that do not loop", lambda m: ratio(m.speedup_no_loop, m.speedup_no_loop_interval)),
            ("gain_captured (head-free oracle)", lambda m: "-" if m.gain_captured is None else f"{m.gain_captured:+.2f}"),
            ("predictor_calls_per_token", lambda m: f"{m.predictor_calls_per_token:.2f}"),
            ("verify_fail_rate", lambda m: f"{m.verify_fail_rate:.3f}"),
            ("candidate_mass (head-free steps)", lambda m: "-" if m.candidate_mass is None else f"{m.candidate_mass:.3f}"),
            (f"draft_recall@{self.k}", lambda m: "-" if m.exact else f"{m.draft_recall_at_k:.3f}"),
            ("  from the draft head", lambda m: "-" if m.exact else f"{m.recall_draft_head:.3f}"),
            ("  from prompt lookup", lambda m: "-" if m.exact else f"{m.recall_lookup:.3f}"),
        ]
        if any(m.exact for m in self.modes):
            rows += [
                ("acceptance_rate (greedy / sampled)", lambda m: exact_cell(m, m.acceptance_rate,
                                                                            m.sampled.acceptance_rate if m.sampled else None)),
                ("tokens_per_round (greedy / sampled)", lambda m: exact_cell(m, m.tokens_per_round,
                                                                             m.sampled.tokens_per_round if m.sampled else None)),
                ("rounds drafted by prompt lookup", lambda m: f"{m.lookup_round_share:.2f}" if m.tokens_per_round else "-"),
                ("verify_cost (batch / vanilla step)", lambda m: "-" if m.verify_cost is None else f"{m.verify_cost:.2f}"),
                ("divergences from vanilla (near-ties)", lambda m: f"{m.divergences} ({m.near_ties})"),
                ("answers off llama.cpp's batched evaluation", lambda m: "-" if m.off_replay is None else str(m.off_replay)),
                ("identical answers, sampled", lambda m: f"{m.sampled.identical:.2f}" if m.sampled else "-"),
            ]
        categories = sorted({c for m in self.modes for c in m.recall_by_category})
        rows += [(f"draft_recall@{self.k} {c} (head + lookup)",
                  lambda m, c=c: "-" if m.exact else recall_cell(m.recall_by_category.get(c))) for c in categories]
        rows += [(f"identical answers, {c}", lambda m, c=c: f"{m.identical_by_category.get(c, 0.0):.2f}")
                 for c in sorted({c for m in self.modes for c in m.identical_by_category})]
        for label, cell in rows:
            table.add_row(label, *(cell(m) for m in self.modes))
        return table

    def _exact_choices(self) -> Table | str:
        """What each exact lane's controller chose (greedy / sampled) and the costs it measured here."""
        lanes = [m for m in self.modes if m.choices is not None]
        if not lanes:
            return ""
        table = Table(title="exact mode: the controller's choices (greedy / sampled)")
        table.add_column("", style="bold")
        for m in lanes:
            table.add_column(self.lane(m), justify="right")
        both = lambda m, cell: " / ".join(cell(c) for c in (m.choices, m.sampled.exact if m.sampled else None) if c)
        batches = lambda key: lambda m: ", ".join(f"{r}:{ms:.1f}" for r, ms in m.choices.controller.get(key, {}).items()) or "-"
        rows = [
            ("tokens from plain steps", lambda m: both(m, lambda c: f"{c.shares['plain']:.2f}")),
            ("... from lookup rounds", lambda m: both(m, lambda c: f"{c.shares['lookup']:.2f}")),
            ("... from exit rounds", lambda m: both(m, lambda c: f"{c.shares['exit']:.2f}")),
            ("mean drafts per batch", lambda m: both(m, lambda c: f"{c.mean_drafts:.2f}")),
            ("explorations (ms per token)", lambda m: both(m, lambda c: f"{c.explore_rounds} ({c.explore_ms_per_token:+.3f})")),
            ("measured: plain step ms", lambda m: fmt(m.choices.controller.get("plain_ms"))),
            ("measured: lookup batch ms by rows", batches("batch_ms")),
            ("measured: exit batch ms by rows", batches("exit_batch_ms")),
            ("measured: plain step after a batch, ms more", lambda m: fmt(m.choices.controller.get("regraph_ms"))),
            ("measured: exit-draft step ms", lambda m: fmt(m.choices.controller.get("draft_step_ms"))),
        ]
        for label, cell in rows:
            table.add_row(label, *(cell(m) for m in lanes))
        return table

    def _by_category(self) -> Table | str:
        """Per prompt category: each exact lane's speed-up (greedy / sampled), its acceptance, tokens per round and
        batch cost, and prompt lookup replayed over vanilla's answers with the speed-up where a batch costs a step."""
        lanes = [m for m in self.modes if m.choices is not None]
        categories = sorted(self.lookup_replay)
        if not lanes or not categories:
            return ""
        table = Table(title="exact mode by category (greedy / sampled)",
                      caption="speed-ups with their 95% interval, bootstrapped over the category's prompts")
        table.add_column("", style="bold")
        for c in categories:
            table.add_column(c, justify="right", min_width=11)
        for m in lanes:
            label = self.lane(m)
            table.add_row(f"{label}: speed-up", *(speedup_pair(m, c) for c in categories))
            for key, name in (("acceptance_rate", "acceptance"), ("tokens_per_round", "tokens per round"),
                              ("verify_cost", "batch / vanilla step")):
                table.add_row(f"  {name}", *(category_pair(m, c, key) for c in categories))
        if self.peer and self.peer.speedup_by_category:
            table.add_row("peer: speed-up", *(" /\n".join(category_ratio(result, c) for result in (self.peer, self.peer_sampled)
                                                         if result) for c in categories))
        for key, name in (("acceptance_rate", "acceptance"), ("tokens_per_round", "tokens per round"),
                          ("speedup_at_unit_batch", "speed-up at 1-step batches")):
            table.add_row(f"lookup replay: {name}", *(
                " / ".join(f"{replay[c][key]:.2f}" for replay in (self.lookup_replay, self.lookup_replay_sampled)
                           if c in replay) for c in categories))
        return table

    def _time_split(self) -> Table:
        captions = [*(["bare: the Context lane, nothing but the decode and the draw"] if self.bare_ms_per_token else []),
                    *(["Llama.eval: layers is its eval, other its token's text and stop strings"]
                      if self.vanilla_ms_per_token else [])]
        table = Table(title="ms per decode step", caption="; ".join(captions) or None)
        table.add_column("part", style="bold")
        parts = [m.ms_per_token for m in self.modes]
        steps = [f"{1e3 / m.specee_tok_s:.3f}" if m.specee_tok_s else "-" for m in self.modes]
        for m in self.modes:
            table.add_column(self.lane(m), justify="right")
        if self.bare_ms_per_token:
            bare = self.tools.get(BARE_CONTEXT)
            table.add_column("bare", justify="right")
            parts.append(self.bare_ms_per_token)
            steps.append(f"{1e3 / bare.tok_s:.3f}" if bare and bare.tok_s else "-")
        if self.vanilla_ms_per_token:
            table.add_column("Llama.eval", justify="right")
            parts.append(self.vanilla_ms_per_token)
            steps.append(f"{1e3 / self.vanilla_tok_s:.3f}" if self.vanilla_tok_s else "-")
        for part in TIME_PARTS:
            table.add_row(part, *(f"{split[part]:.3f}" for split in parts))
        table.add_row("decode step", *steps)
        return table

    def _histogram(self) -> Table:
        table = Table(title=f"exit layers (layers without exits left out; {self.n_layer - 1} = ran every layer)")
        table.add_column("layer", justify="right")
        columns = {**({"oracle": self.oracle_histogram} if self.oracle_histogram else {}),
                   **{self.lane(m): m.exit_histogram for m in self.modes}}
        width = max(4, HISTOGRAM_WIDTH // len(columns))
        for name in columns:
            table.add_column(name, no_wrap=True)
        for il in range(self.n_layer):
            if any(counts[il] for counts in columns.values()):
                table.add_row(str(il), *(bar(counts[il], max(counts), width) for counts in columns.values()))
        return table


def grammar_line(grammar: GrammarRun) -> str:
    """The run's grammar in one line: where it came from, its size, and how whole answers were checked."""
    check = ("validated against the schema (jsonschema)" if grammar.validated else
             "parsed as JSON (jsonschema is not installed: not validated)" if grammar.schema else "parsed as JSON")
    return (f"{grammar.origin}: {grammar.chars:,} characters, {grammar.rules} rules of GBNF, every lane under it; "
            f"whole answers {check}")


def share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def fmt_tok_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def ratio(value: float | None, interval: tuple[float, float] | None, sep: str = "\n") -> str:
    """A speed-up and its 95% interval, below it (an 80-column table keeps its width): 1.046x [0.98-1.11]."""
    if value is None:
        return "-"
    return f"{value:.3f}x" + (f"{sep}[{interval[0]:.2f}-{interval[1]:.2f}]" if interval else "")


def category_ratio(result: ModeResult | SampledResult, category: str) -> str:
    """A category's speed-up with its interval; `(1 prompt)` where the category has a single prompt (no interval)."""
    value = result.speedup_by_category.get(category)
    if value is None:
        return "-"
    interval = result.speedup_by_category_interval.get(category)
    return ratio(value, interval) if interval else f"{value:.3f}x\n(1 prompt)"


def speedup_pair(m: ModeResult, category: str) -> str:
    return " /\n".join(category_ratio(result, category) for result in (m, m.sampled) if result is not None)


def category_pair(m: ModeResult, category: str, key: str) -> str:
    cells = []
    for choices in (m.choices, m.sampled.exact if m.sampled else None):
        value = choices.by_category.get(category, {}).get(key) if choices else None
        if choices is not None:
            cells.append("-" if value is None else f"{value:.2f}")
    return " / ".join(cells) or "-"


def exact_cell(m: ModeResult, greedy: float, sampled: float | None) -> str:
    """Greedy / sampled; `plain` where the lane ran no verification round (its level does not draft there)."""
    if not m.exact:
        return "-"
    cells = [f"{greedy:.2f}" if m.tokens_per_round else "plain"]
    if m.sampled is not None:
        cells.append(f"{sampled:.2f}" if m.sampled.tokens_per_round else "plain")
    return " / ".join(cells)


def calibrated_cell(m: ModeResult) -> str:
    """What the pack says of the level's speed, to read beside what this run measured."""
    if m.calibrated_speedup is None:
        return "-"
    sampled = f" / {m.calibrated_speedup_sampled:.3f}x" if m.calibrated_speedup_sampled else ""
    return f"{m.calibrated_speedup:.3f}x{sampled}"


def agreement_cell(m: ModeResult) -> str:
    if m.calibrated_agreement is None:
        return "-"
    low, high = m.calibrated_agreement
    bench = ""
    if m.agreement_interval is not None:
        bench_low, bench_high = m.agreement_interval
        bench = f"{bench_low:.3f}-{bench_high:.3f}, {'yes' if bench_low <= high and low <= bench_high else 'no'}; "
    return (f"{low:.3f}-{high:.3f}, {'yes' if low <= m.agreement <= high else 'no'}; {bench}"
            f"{'yes' if m.agreement >= m.quality - 1e-9 else 'no'}")


def recall_cell(recall: dict[str, float] | None) -> str:
    if not recall:
        return "-"
    return f"{recall['draft_recall_at_k']:.3f} ({recall['recall_draft_head']:.3f} + {recall['recall_lookup']:.3f})"


def bar(count: int, largest: int, width: int) -> str:
    """A text bar of `count` scaled so that `largest` fills `width` cells, then the count."""
    cells = round(width * count / largest) if largest else 0
    return f"{'█' * cells}{' ' * (width - cells)} {count}" if count else ""


def plot_bench(result: BenchResult, path: Path) -> None:
    """Speedup against agreement and against perplexity (a line per KV mode through its quality levels),
    above the exit layers of every lane beside the oracle's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(11, 8.5), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[1.1, 1])
    agreement_ax, ppl_ax = top.subplots(1, 2, sharey=True)
    _plot_tradeoff(result, agreement_ax, ppl_ax)
    _plot_histogram(result, bottom.subplots())
    m = result.main
    fig.suptitle(f"{result.model}: {result.prompts} prompts x {result.tokens} tokens; {result.lane(m)} "
                 f"{m.speedup:.3f}x against {result.baseline} at agreement {m.agreement:.3f}"
                 + (f" (oracle {result.oracle_speedup * result.vanilla_speedup:.3f}x)" if result.oracle_speedup else ""))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_tradeoff(result: BenchResult, agreement_ax, ppl_ax) -> None:
    """One point per quality level, labelled with it; vanilla at speedup 1, the oracle at agreement 1."""
    by_mode: dict[str, list[ModeResult]] = {}
    for m in result.modes:
        by_mode.setdefault(m.kv_mode, []).append(m)
    for i, (kv_mode, lanes) in enumerate(by_mode.items()):
        lanes.sort(key=lambda m: m.quality or 0.0)
        speedups = [m.speedup for m in lanes]
        agreement_ax.plot([m.agreement for m in lanes], speedups, "o-", color=f"C{i}", label=f"SpecEE ({kv_mode})")
        ppl_ax.plot([m.ppl_specee for m in lanes], speedups, "o-", color=f"C{i}", label=f"SpecEE ({kv_mode})")
        ppl_ax.plot([m.ppl_specee_raw for m in lanes], speedups, "o:", color=f"C{i}", mfc="none",
                    label=f"({kv_mode}) without temperatures")
        for m in lanes:
            if m.quality is not None:
                for ax, x in ((agreement_ax, m.agreement), (ppl_ax, m.ppl_specee)):
                    ax.annotate(f"{m.quality:g}", (x, m.speedup), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for ax, x in ((agreement_ax, 1.0), (ppl_ax, result.ppl_full)):
        ax.plot([x], [result.vanilla_speedup], "s", color="k", label=f"vanilla ({LLAMA_CPP_PYTHON})")
    if result.oracle_speedup:
        oracle = result.oracle_speedup * result.vanilla_speedup
        agreement_ax.plot([1.0], [oracle], "*", color="0.4", markersize=12, label="oracle")
        ppl_ax.axhline(oracle, color="0.4", linestyle="--", linewidth=1, label="oracle")
    agreement_ax.set_xlabel("agreement with the full model")
    agreement_ax.set_ylabel(f"speed-up against {result.baseline}")
    ppl_ax.set_xlabel(f"held-out perplexity ({result.ppl_tokens} tokens)")
    for ax in (agreement_ax, ppl_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def _plot_histogram(result: BenchResult, ax) -> None:
    """Exit layers of each lane beside the oracle's, as shares of the decode steps."""
    columns = {**({"oracle": result.oracle_histogram} if result.oracle_histogram else {}),
               **{f"SpecEE ({result.lane(m)})": m.exit_histogram for m in result.modes}}
    colors = [*(["0.6"] if result.oracle_histogram else []), *(f"C{i}" for i in range(len(result.modes)))]
    layers = np.arange(result.n_layer)
    width = 0.8 / len(columns)
    for i, ((name, counts), color) in enumerate(zip(columns.items(), colors)):
        counts = np.asarray(counts, dtype=float)
        ax.bar(layers + (i - (len(columns) - 1) / 2) * width, counts / max(counts.sum(), 1), width, label=name, color=color)
    ax.set_xlabel(f"exit layer (0-based; {result.n_layer - 1} = ran every layer)")
    ax.set_ylabel("share of decode steps")
    ax.set_xticks(layers[:: max(1, result.n_layer // 15)])
    ax.legend(fontsize=8)
