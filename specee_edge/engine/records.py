"""What the engine reports: one record per token, stats per generation (names from SPEC.md §5)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum

from specee_edge.engine.controller import Choice
from specee_edge.engine.sampling import TokenLogprobs
from specee_edge.exits import ExitKind


class TokenSource(str, Enum):
    """Where an emitted token came from. In exact mode every token is the full model's own: a draft it
    accepted, its correction of a draft, or the bonus token after a round it accepted whole."""

    FULL = "full"              # one token decoded through every layer (plain decoding, or a round that did not exit)
    EXIT = "exit"              # a lossy level's early exit: the exit's own token, never checked
    ACCEPTED = "accepted"      # exact mode: a draft the verification batch agreed with
    CORRECTION = "correction"  # exact mode: the full model's token where it disagreed with the draft
    BONUS = "bonus"            # exact mode: the full model's next token after a round it accepted whole


@dataclass(slots=True)
class Round:
    """One round of exact mode, as the controller chose it; the records of the tokens it emitted share it."""

    choice: Choice
    drafts: int = 0            # drafts its verification batch checked (0: no batch, one token decoded alone)
    accepted: int = 0          # ... that the full model accepted
    emitted: int = 0           # tokens it emitted
    batch_ms: float = 0.0      # its verification batch's llama_decode (the rows' sampling is in their records)
    explored: bool = False     # taken to measure that choice again (controller.py)
    explore_ms: float = 0.0    # ... what that cost beyond the choice it displaced
    rows: tuple[int, ...] = () # its verification batch's tokens: the last emitted token, then the drafts


@dataclass(slots=True)
class TokenRecord:
    """One generated token. Times in milliseconds."""

    id: int = -1               # -1 until the token is drawn
    text: str = ""             # the piece this token adds to the reply (may be "" mid-character or held for a stop string)
    exit_layer: int | None = None  # the layer the token left after, its exit's answer; None: the full model's token
    probes: int = 0            # predictors evaluated
    verify_failures: int = 0   # positive predictions whose exit logits' top-1 was not a candidate
    draft_hit: bool | None = None  # the emitted token was among the step's candidates (None: early exit off)
    lookup_hit: bool | None = None  # it was the prompt-lookup candidate (None: there was none)
    exit_kind: ExitKind = ExitKind.NONE  # how the step that gave this token's logits left
    candidates: tuple[int, ...] = ()     # that step's candidates (a head-free exit chose among them)
    draft_ms: float = 0.0      # inside forward_ms: the in-graph draft head (measured with EngineConfig.profile)
    forward_ms: float = 0.0    # llama_decode: draft, layers, probes, predictor, verification, KV handling
    predictor_ms: float = 0.0  # inside forward_ms: features and MLPs
    verify_ms: float = 0.0     # inside forward_ms: exit heads of positive predictions and the top-1 check
    sample_ms: float = 0.0
    source: TokenSource = TokenSource.FULL
    round: Round | None = None  # exact mode: the round that emitted it (None: the prompt's token, or no exact mode)
    draft_layer: int | None = None  # exact mode, an accepted draft: the layer its drafting step exited at
    logprobs: TokenLogprobs | None = None  # when the request asked for them


@dataclass
class GenerationStats:
    n_layer: int
    early_exit: bool
    n_prompt: int = 0
    exact: bool = False           # exact mode: only the full model's tokens, drafts checked in batches
    n_cached: int = 0             # prompt tokens whose K/V the cache already held (not decoded again)
    n_decode: int = 0
    prompt_s: float = 0.0
    decode_s: float = 0.0
    exits: int = 0
    head_free_exits: int = 0      # ... of which left with the candidates' logits (no full-vocabulary head)
    exit_layer_sum: int = 0
    probes: int = 0
    verify_failures: int = 0
    positives: int = 0
    draft_hits: int = 0
    drafted: int = 0              # steps whose graph proposed candidates (the draft ran)
    lookup_proposals: int = 0     # steps with a prompt-lookup candidate
    lookup_hits: int = 0          # ... that was the emitted token
    rounds: int = 0               # exact mode: verification batches
    lookup_rounds: int = 0        # ... whose drafts came from prompt lookup
    drafts: int = 0               # ... drafted tokens they checked, up to where the reply ended (a stop string, an
    #                               end of generation or max_tokens cutting a round leaves out the drafts past it)
    accepted: int = 0             # ... drafts the full model accepted
    round_tokens: int = 0         # ... tokens they emitted (accepted, corrections and bonuses)
    tokens_by_choice: dict[str, int] = field(default_factory=lambda: dict.fromkeys([c.value for c in Choice], 0))
    #                               exact mode: decoded tokens by the controller's choice for their round (an exit
    #                               round whose first step did not exit gave one full-model token: it is an exit's)
    explore_rounds: int = 0       # exact mode: rounds the controller took to measure a choice again
    explore_ms: float = 0.0       # ... what they cost beyond the choices they displaced
    controller: dict = field(default_factory=dict)  # exact mode: the costs and acceptance measured on this machine
    masked_draws: int = 0         # with a grammar: draws it refused, drawn again over the vocabulary it allows
    finish_reason: str = ""       # "stop" (EOS or a stop string), "length", "interrupted"
    exit_layers: list[int | None] = field(default_factory=list)
    time_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("draft", "forward", "predictor", "verify", "batch", "sample"), 0.0))
    _last_round: Round | None = field(default=None, repr=False, compare=False)
    _round_seen: int = field(default=0, repr=False, compare=False)  # the last round's records added so far

    def add(self, record: TokenRecord) -> None:
        """Count one emitted token. Most are plain steps, and this runs after every one of them, on caches a decode
        has just filled: a plain step's record skips what only exits, candidates and verification rounds set."""
        self.n_decode += 1
        self.exit_layers.append(record.exit_layer)
        if record.exit_layer is None:
            self.exit_layer_sum += self.n_layer - 1
        else:
            self.exits += 1
            self.exit_layer_sum += record.exit_layer
        if (record.probes or record.verify_failures or record.exit_kind or record.candidates or record.draft_hit
                or record.lookup_hit is not None):
            self._add_speculation(record)
        if record.source is not TokenSource.FULL and record.source is not TokenSource.EXIT:
            self.accepted += record.source is TokenSource.ACCEPTED
            self.round_tokens += 1  # accepted, a correction or a bonus
        round_ = record.round
        if round_ is not None:
            self.tokens_by_choice[round_.choice._value_] += 1  # _value_: .value is a property, slow on this path
            # the round's first token: the round itself counts once (a plain step that explored nothing adds nothing)
            if round_ is not self._last_round and (round_.drafts or round_.explored):
                self._add_round(round_)
            if round_.drafts:
                self._count_drafts(round_)
        time_ms = self.time_ms  # a record's times (a round's batch is its own), written out: a loop cost more
        time_ms["draft"] += record.draft_ms
        time_ms["forward"] += record.forward_ms
        time_ms["predictor"] += record.predictor_ms
        time_ms["verify"] += record.verify_ms
        time_ms["sample"] += record.sample_ms

    def _add_speculation(self, record: TokenRecord) -> None:
        """What a step whose graph probed, exited or proposed candidates adds."""
        self.head_free_exits += record.exit_kind == ExitKind.HEAD_FREE
        self.probes += record.probes
        self.verify_failures += record.verify_failures
        self.positives += record.verify_failures + (record.exit_kind == ExitKind.VERIFIED)
        self.draft_hits += bool(record.draft_hit)
        self.drafted += bool(record.candidates)
        self.lookup_proposals += record.lookup_hit is not None
        self.lookup_hits += bool(record.lookup_hit)

    def _add_round(self, round_: Round) -> None:
        self._last_round = round_
        self._round_seen = 0
        self.rounds += round_.drafts > 0
        self.lookup_rounds += round_.drafts > 0 and round_.choice == Choice.LOOKUP
        self.explore_rounds += round_.explored
        self.explore_ms += round_.explore_ms
        self.time_ms["batch"] += round_.batch_ms

    def _count_drafts(self, round_: Round) -> None:
        """A round's drafts, as its records arrive: the i-th record's row checked draft i, and the round's last record
        brings the drafts past a correction (rejected with it). A round the reply cut (a stop string, an end of
        generation, max_tokens) counts only the drafts of the rows it emitted: the ones after the cut were never
        offered, and counting them as drafted read acceptance low."""
        self._round_seen += 1
        self.drafts += self._round_seen <= round_.drafts
        if self._round_seen == round_.emitted:
            self.drafts += max(round_.drafts - round_.emitted, 0)

    @property
    def prompt_tok_s(self) -> float:
        return self.n_prompt / self.prompt_s if self.prompt_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.n_decode / self.decode_s if self.decode_s else 0.0

    @property
    def avg_exit_layer(self) -> float:
        return self.exit_layer_sum / self.n_decode if self.n_decode else float(self.n_layer - 1)

    @property
    def exit_rate(self) -> float:
        """Tokens that left before the full path's end: after fewer layers, or without the output head."""
        return self.exits / self.n_decode if self.n_decode else 0.0

    @property
    def head_free_rate(self) -> float:
        """Tokens emitted from the candidates' logits, no full-vocabulary head run."""
        return self.head_free_exits / self.n_decode if self.n_decode else 0.0

    @property
    def predictor_calls_per_token(self) -> float:
        return self.probes / self.n_decode if self.n_decode else 0.0

    @property
    def verify_fail_rate(self) -> float:
        """Share of verified positive predictions that verification rejected."""
        return self.verify_failures / self.positives if self.positives else 0.0

    @property
    def draft_recall_at_k(self) -> float:
        """The emitted token was a candidate (any source)."""
        return self.draft_hits / self.n_decode if self.n_decode and self.early_exit else 0.0

    @property
    def recall_lookup(self) -> float:
        """... the prompt-lookup candidate."""
        return self.lookup_hits / self.n_decode if self.n_decode and self.early_exit else 0.0

    @property
    def recall_draft_head(self) -> float:
        """... one of the draft head's candidates (the slots prompt lookup left it)."""
        return (self.draft_hits - self.lookup_hits) / self.n_decode if self.n_decode and self.early_exit else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Exact mode: drafted tokens the full model accepted."""
        return self.accepted / self.drafts if self.drafts else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Exact mode: tokens emitted per verification batch."""
        return self.round_tokens / self.rounds if self.rounds else 0.0

    @property
    def mean_drafts(self) -> float:
        """Exact mode: drafts per verification batch (the draft length the controller chose)."""
        return self.drafts / self.rounds if self.rounds else 0.0

    def choice_shares(self) -> dict[str, float]:
        """Exact mode: the share of decoded tokens from the controller's plain steps, lookup rounds and exit rounds."""
        return {choice: n / self.n_decode if self.n_decode else 0.0 for choice, n in self.tokens_by_choice.items()}

    def summary(self) -> dict:
        """The SPEC.md §5 names plus counts and the per-token time split (ms per token)."""
        per_token = {k: v / self.n_decode for k, v in self.time_ms.items()} if self.n_decode else dict(self.time_ms)
        out = {k: v for k, v in asdict(self).items() if k not in ("exit_layers", "time_ms", "_last_round")}
        out.update(
            prompt_tok_s=self.prompt_tok_s,
            decode_tok_s=self.decode_tok_s,
            avg_exit_layer=self.avg_exit_layer,
            exit_rate=self.exit_rate,
            head_free_rate=self.head_free_rate,
            predictor_calls_per_token=self.predictor_calls_per_token,
            verify_fail_rate=self.verify_fail_rate,
            draft_recall_at_k=self.draft_recall_at_k,
            recall_lookup=self.recall_lookup,
            recall_draft_head=self.recall_draft_head,
            acceptance_rate=self.acceptance_rate,
            tokens_per_round=self.tokens_per_round,
            mean_drafts=self.mean_drafts,
            choices=self.choice_shares(),
            ms_per_token=per_token,
        )
        return out
