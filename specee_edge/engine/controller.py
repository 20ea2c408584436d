"""Exact mode's choice for each round, made from what it costs on the machine it runs on.

After each emitted token, exact mode can spend the next round in one of three ways:

    plain   one step through every layer: one token, the model's own
    lookup  m drafts that prompt lookup copies from the context, checked in one batch of m + 1 rows
    exit    m drafts from early exits (a pack's draft head and predictors), checked alike

Whether drafting pays is a property of the machine and of the text, not of the model: on a 2-core CPU a batch
of 4 rows costs 1.75-2.5 single steps, on an H200 running models of 135M-1.5B parameters 1.7-1.8 (their steps
wait on kernel launches, docs/gpu_h200_costs.txt; on a GPU, a model whose steps read its weights should cost
less per row, not yet timed); a looping answer accepts most drafts, a fresh one few. So the controller measures
both while it decodes and prices each choice in milliseconds per emitted token. A round of m drafts, each
accepted with probability a once those before it were, emits

    E(m) = 1 + a + a^2 + ... + a^m      tokens (the accepted drafts, then one correction or bonus)

at the cost of its batch (and, for exit drafts, of the drafting steps), and the cheapest choice and draft
length win, as DEL picks a speculation length per context from the acceptance it tracks.

- Costs (a plain step, a batch by its kind and row count, a drafting step, and the graph the plain step after a
  drafting round builds again, which that round is charged) are the medians of the last COST_WINDOW
  times the engine's own rounds took, each with its sampling: they follow the machine when its speed moves,
  and one hiccup (a page fault, another process) never stands for a cost once it has been measured again.
  On a model split between devices (split_layer: the first layer on another device than layer 0, which the
  engine reads from llama.cpp's layer map), drafting steps that exit before the split and past it are two
  clusters, up to ten times apart where one side is a GPU and the other a CPU: a median of both would be one
  cluster's or the other's. So each side keeps its own median, and a drafting step is priced at their mean
  weighed by the share of exits past the split (a moving average). Without a split, one side: the median. A
  row count not measured yet is interpolated between measured ones, or extrapolated beyond them
  (BatchCosts.curve); before any batch has run, an extra row is guessed at a quarter of a step: an optimistic
  start, so that the first chance to draft measures what batches really cost here.
- Acceptance is counted per kind of draft and per kind of decoding (greedy, sampled), over the recent rounds
  of the request (older rounds fade), starting from what earlier requests on this engine accepted. Lookup's is
  counted twice: over all its rounds, and per bucket of the length of the match the drafts were copied after
  (draft/lookup.py: after a match of 8 tokens or more, 93 % of first drafts were right on the default model,
  after one of a single token 26 %); a round is priced with the mean of the two. The bucket tells a long copy
  from a chance match; the recent rounds of all lookups tell that the answer is copying right now, which a copy
  that has just begun (its matches still short) needs. Replaying the controller over the default model's
  answers with fixed costs, the mean beat either alone at every batch cost tried.
- Lookup drafts are offered at every round, taken or not: while the controller decodes plainly it checks them
  against the tokens that follow (shadow rounds), so lookup's acceptance stays current at no cost. A drawn
  token equals a draft exactly as often as in a real round, greedy or sampled.
- A choice not taken for a while is tried once (exploration), so that a dropped choice that starts to pay is
  noticed (a machine whose batches got cheaper, exits that now pay, a cost that a hiccup inflated); so is the
  cheapest choice at another draft length, whose batch size was measured longer ago than its own. Exploring
  spends from a budget that grows by EXPLORE_SHARE of each round's time and pays what a round lost against the
  choice it displaced; a round is explored only when the budget covers its worst case (every draft rejected),
  and among the lengths it covers, the one whose batch was measured longest ago: so a batch size that a bad
  measurement priced out is measured again. The budget carries over from one request to the next, up to
  EXPLORE_CARRY plain steps' worth, so that short requests explore too. Explorations cost at most about
  EXPLORE_SHARE of the time, and on a machine where drafting loses much they are rare. One that loses again
  waits twice as long for the next one, at most MAX_EXPLORE_WAIT rounds. What they cost is counted
  (explore_ms).

- Most rounds are plain steps, and between two of them little moves: the plain step's median, and acceptance,
  which shadow rounds raise or lower. So a drafting choice's prices are kept with what they were computed from,
  for every draft length up to the longest any round asked (a price does not depend on how many drafts the round
  was offered, so a round offered 3 drafts reads what one offered 8 computed), and a lower bound of the price
  computed now is derived from them (_bound): with the same batch measurements, the
  kept price; where acceptance rose from a_k to a, that price times (a_k / a) ** m for drafts up to m (a round's
  expected tokens grow by at most that); where a term of the price reads the plain step (a batch size not
  measured, interpolated from a plain step), only while the plain step is within REPRICE_SHARE. Plain decoding
  that beats such a bound needs no new price; a round in which drafting might win or an exploration might be
  due is priced afresh. Where no term reads the plain step, or its cost holds still, the plans are exactly those
  of pricing every round afresh (tests/test_controller.py checks both round by round); otherwise a kept price
  stands for one computed with a plain step up to 2 % off. Such a round, where no exploration may be due either,
  is found by a short path (_settled_plain) that reads the kept prices in place and builds nothing: it runs
  after every token, on caches the decode has just filled with weights, where each object built and each call
  cost several times what they cost in a warm loop.

- Rounds that cannot draft profitably need no plan at all. Where drafting prices read only measured batches (no
  plain step), they hold while plain steps run, and only lookup's acceptance moves; so the controller can grant a
  plain streak (plain_streak): the coming rounds whose every exit round costs more than a ceiling a little above the
  plain step, and whose lookup offer, at the acceptance its shadow rounds keep current, would not pay either, until
  an exploration could be due or a step costs more than the ceiling. The engine decodes those rounds without a plan
  (lookup, a step, a draw, the shadow) and tells the rest afterwards (end_streak): the controller ends where
  planning every round would have left it (tests/test_controller.py checks both, round by round).

`always_draft` replaces the choice with classic speculative decoding's: draft at every chance, as many as allowed
(lookup where the context matches, else exits), which is what llama.cpp's speculation does; still measured.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

COST_WINDOW = 5             # a cost is the median of its last this many measurements
SHARE_WEIGHT = 0.15         # a new round's weight in a share's moving average
ACCEPT_DECAY = 0.8          # a round's weight in the acceptance counts shrinks by this at every later round
PRIOR_ROUNDS = 2.0          # a request starts with this many rounds' worth of what earlier requests accepted
PRIOR_ACCEPTANCE = 0.5      # ... and with this rate where there were none
# ... for lookup drafts, by the bucket of their match (draft/lookup.py MATCH_BUCKETS): about what the default model's
# greedy answers accepted (a draft after the one before it was right)
LOOKUP_PRIOR = {1: 0.25, 2: 0.5, 4: 0.7, 8: 0.9}
MAX_ACCEPTANCE = 0.97       # E(m) stays finite: no draft is ever certain
PRIOR_ROW_COST = 0.25       # an extra row in a batch, in plain steps, before any batch was measured
EXPLORE_WAIT = 16           # rounds a choice waits before it is tried again
MAX_EXPLORE_WAIT = 256
EXPLORE_SHARE = 0.02        # of the decoding time, what explorations may spend beyond the choices they displace
EXPLORE_CARRY = 8.0         # plain steps' worth of exploration budget a request hands to the next at most
REPRICE_SHARE = 0.02        # a kept drafting price holds while the plain step's cost moves less than this share
STREAK_JITTER = 0.1         # a plain streak lasts while no step costs more than this share above the plain step's median


class Choice(str, Enum):
    PLAIN = "plain"
    LOOKUP = "lookup"
    EXIT = "exit"


@dataclass(frozen=True, slots=True)
class Plan:
    choice: Choice
    drafts: int              # the round's most drafts (0 for a plain step)
    ms_per_token: float      # what the controller expected the choice to cost per emitted token
    explore: bool = False    # taken to measure it again, not because it was the cheapest
    best_ms_per_token: float = 0.0  # the cheapest choice's price (what an exploration displaced)
    other_length: bool = False  # an exploration of the cheapest choice at another draft length
    match: int = 0           # a lookup round: the bucket of the match its drafts were copied after


STREAK_PLAN = Plan(Choice.PLAIN, 0, 0.0)  # a plain streak's rounds, as their shadow rounds and steps are told


@dataclass(frozen=True, slots=True)
class PlainStreak:
    """Rounds to come that plan() would make plain steps without exploring (Controller.plain_streak): the engine
    decodes them without planning, checking each lookup offer against `most_tokens`, and tells them afterwards."""

    rounds: int          # at most this many rounds ...
    ceiling_ms: float    # ... and none after a step dearer than this (the plain step's median may then pass it)
    # by a lookup round's draft length m (index 0 unused): the most tokens it may be expected to emit and still cost
    # at least ceiling_ms per token (its cost over the ceiling)
    most_tokens: tuple[float, ...]

    def keeps(self, drafts: int, acceptance: float) -> bool:
        """Whether a round offered `drafts` lookup drafts, each accepted with chance `acceptance` once those before it
        were, is one of the streak's: no round of up to that many drafts expects more tokens than it may."""
        a = min(max(acceptance, 0.0), MAX_ACCEPTANCE)  # as prices hold it
        tokens, term = 1.0, 1.0
        for m in range(1, drafts + 1):
            term *= a
            tokens += term  # E(m)
            if tokens > self.most_tokens[m]:
                return False
        return True


@dataclass(slots=True)
class Outcome:
    """What one round cost and gave, measured by the engine."""

    plan: Plan
    emitted: int                 # tokens the round emitted
    ms: float                    # the whole round: drafting steps, batch, sampling
    drafts: int = 0              # drafts the batch checked
    accepted: int = 0            # ... that the full model accepted
    batch_ms: float = 0.0        # the verification batch and its rows' sampling
    # exit rounds that drafted: each drafting step, the last one too where it ran every layer (its draft is the full
    # model's token, yet the batch recomputes its cell)
    draft_step_ms: tuple[float, ...] = ()
    draft_exit_layers: tuple[int | None, ...] = ()  # ... each one's exit layer (None: it ran every layer)
    drafting_ended_full: bool = False      # ... the last drafting step ran every layer (it ended the drafting)
    full_step_ms: float | None = None      # exit rounds: the step that ran every layer when the first did not exit
    greedy: bool = True


@dataclass
class RecentCost:
    """A cost: the median of its last COST_WINDOW measurements (None until measured). A median, not a moving
    average, so that one slow round (a hiccup) weighs nothing once the cost has been measured twice more."""

    recent: deque[float] = field(default_factory=lambda: deque(maxlen=COST_WINDOW))
    measured_at: int = -1  # the controller's round count at the last measurement
    value: float | None = None  # the median, kept: every round's plan reads it many times

    def add(self, ms: float, at: int = -1) -> None:
        self.recent.append(ms)
        self.measured_at = at
        # the median, written out: statistics.median's checks run after every plain step, cold after its decode
        ordered = sorted(self.recent)
        middle = len(ordered) // 2
        self.value = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


@dataclass
class MovingShare:
    """How often something happens, a moving average of 0s and 1s (None until seen)."""

    value: float | None = None

    def add(self, happened: bool) -> None:
        x = float(happened)
        self.value = x if self.value is None else self.value + SHARE_WEIGHT * (x - self.value)


@dataclass
class BatchCosts:
    """A verification batch's time (with its rows' sampling) by row count."""

    by_rows: dict[int, RecentCost] = field(default_factory=dict)
    version: int = 0  # counts the measurements: a price computed from the curve holds while it is unchanged
    _points: tuple[int, list[tuple[int, float]]] = field(default=(-1, []), repr=False, compare=False)  # (version, ...)
    _curve: tuple[tuple, list[float]] = field(default=((), []), repr=False, compare=False)  # the last curve, keyed

    def add(self, rows: int, ms: float, at: int = -1) -> None:
        self.by_rows.setdefault(rows, RecentCost()).add(ms, at)
        self.version += 1

    def measured_at(self, rows: int) -> int:
        """When a batch of `rows` rows was last measured (-1: never)."""
        cost = self.by_rows.get(rows)
        return cost.measured_at if cost else -1

    def curve(self, max_rows: int, plain_ms: float) -> list[float]:
        """The cost of 0 .. max_rows rows (index 0 unused): measured, else on the line between the nearest measured
        row counts (a plain step is one row), each held to at most what a longer one costs. Beyond the last measured batch, the slope of the last two batches;
        with one batch measured, the slope from a plain step to it or a quarter of a step per row, whichever is
        less (on a CPU a batch's second row costs much more than its later ones: the jump from one row to two is
        no guide to the rest); never falling.

        The last curve is kept and serves shorter ones while neither the measurements nor, where a cost from two rows
        on reads it, the plain step changed: most rounds that price drafts price them from the same curve."""
        measured = self.measured_points()
        key = (self.version, plain_ms if self.reads_plain() else None)
        kept_key, kept = self._curve
        if kept_key == key and len(kept) > max_rows:
            costs = kept[: max_rows + 1]
            costs[1] = plain_ms
            return costs
        points = [(1, plain_ms), *measured]
        if len(measured) >= 2:
            (r0, c0), (r1, c1) = measured[-2:]
            beyond = max((c1 - c0) / (r1 - r0), 0.0)
        elif measured:
            (r1, c1), = measured
            beyond = min(max((c1 - plain_ms) / (r1 - 1), 0.0), PRIOR_ROW_COST * plain_ms)
        else:
            beyond = PRIOR_ROW_COST * plain_ms
        costs = [0.0] * (max_rows + 1)
        j = 0  # points[j] is the last point at or below the row count at hand
        for rows in range(1, max_rows + 1):
            while j + 1 < len(points) and points[j + 1][0] <= rows:
                j += 1
            r0, c0 = points[j]
            if j + 1 < len(points):
                r1, c1 = points[j + 1]
                costs[rows] = c0 + (c1 - c0) * (rows - r0) / (r1 - r0)
            else:
                costs[rows] = c0 + beyond * (rows - r0)
        self._curve = (key, costs[:])
        return costs

    def reads_plain(self) -> bool:
        """Whether a cost of two rows or more on the curve reads the plain step: unless batches of two rows and of
        more were measured, the curve runs from a plain step (one row) to the first measured batch, or beyond the only
        one by at most a share of a plain step."""
        points = self.measured_points()
        return len(points) < 2 or points[0][0] != 2

    def measured_points(self) -> list[tuple[int, float]]:
        """The measured (rows, cost) points in order, computed once per version (most rounds price from the same
        ones). A batch costs no more than a longer one measured: a row count measured once, slowly, and not chosen
        since (a hiccup) is held to what the longer batches cost until it is measured again."""
        version, measured = self._points
        if version != self.version:
            measured = sorted((r, c.value) for r, c in self.by_rows.items() if c.value is not None)
            for i in range(len(measured) - 2, -1, -1):
                measured[i] = (measured[i][0], min(measured[i][1], measured[i + 1][1]))
            self._points = (self.version, measured)
        return measured

    def snapshot(self) -> dict[int, float]:
        return {r: round(c.value, 3) for r, c in sorted(self.by_rows.items()) if c.value is not None}


@dataclass
class AcceptanceCount:
    """Accepted and rejected drafts with older rounds fading; a round accepted whole rejects none."""

    accepted: float = 0.0
    rejected: float = 0.0

    def add(self, accepted: int, drafts: int, decay: float = ACCEPT_DECAY) -> None:
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (accepted < drafts)

    def rate(self, default: float = PRIOR_ACCEPTANCE) -> float:
        seen = self.accepted + self.rejected
        return self.accepted / seen if seen > 0 else default


def accept_key(choice: Choice, greedy: bool, match: int) -> str:
    """An acceptance count's name in the snapshot: "lookup after 4+/greedy" (match 0: every round of the kind)."""
    return f"{choice.value}{f' after {match}+' if match else ''}/{'greedy' if greedy else 'sampled'}"


@dataclass
class ExitPrior:
    """What a pack says of its exits, the starting guess until this machine has measured them."""

    acceptance: float = PRIOR_ACCEPTANCE   # drafts the full model accepted at calibration
    exit_share: float = 0.5                # share of drafting steps that exit


@dataclass(frozen=True, slots=True)
class RoundCosts:
    """A drafting round of some draft length, before it runs: the ways it may go when it drafts, each as (chance,
    drafts checked, ms), and what it costs when it does not (an exit round whose first step ran every layer)."""

    drafting: list[tuple[float, int, float]]
    not_drafting: float

    def drafting_ms(self) -> float:
        """What the round costs when it drafts, on average over its ways."""
        return sum(chance * ms for chance, _, ms in self.drafting)

    def worst_ms(self) -> float:
        return max(self.not_drafting, *(ms for _, _, ms in self.drafting))


@dataclass(frozen=True, slots=True)
class KeptPrices:
    """A drafting choice's best round by its longest draft length, with what its prices were computed from."""

    best: list[tuple[int, float]]  # best[d]: for rounds of up to d drafts, the cheapest length and its price
    acceptance: float       # as the prices read it (held within 0 .. MAX_ACCEPTANCE)
    batches: BatchCosts     # the batch costs that priced it (its kind's, or the other kind's) ...
    batches_version: int    # ... as they were
    regraph_ms: float
    plain_ms: float
    plain_free: bool        # no term of the prices read the plain step (_plain_free)
    exit_terms: tuple       # exit rounds: the drafting and full step's cost, the share of first steps that exit


class Controller:
    """Chooses each round of exact mode; one per engine (costs are the machine's and outlive requests)."""

    def __init__(self, exit_prior: ExitPrior | None = None, always_draft: bool = False,
                 split_layer: int | None = None):
        """split_layer: the first layer on another device than layer 0 (placement.first_crossing; None on one
        device), where drafting steps that exit past it are priced apart."""
        self._exit_prior = exit_prior or ExitPrior()
        self.always_draft = always_draft
        self.plain = RecentCost()
        # a plain step right after a drafting round, less a plain step: llama.cpp reuses a step's graph only for the
        # same shape, so the step after a batch builds its graph again; a drafting round pays for that
        self.regraph = RecentCost()
        # verification batches by kind: an exit round's batch also keeps every row's hidden state for the next draft
        self.batches = {Choice.LOOKUP: BatchCosts(), Choice.EXIT: BatchCosts()}
        self.draft_step = RecentCost()   # a drafting step of an exit round that exited (before the split, if any)
        self.split_layer = split_layer
        self.draft_step_past = RecentCost()  # ... that exited past the split
        self.past_split = MovingShare()   # share of the drafting steps that exited past the split
        self.full_step = RecentCost()    # an exit round's step that ran every layer, probes and all
        self.first_exits = MovingShare()  # share of exit rounds whose first step exited
        self.later_exits = MovingShare()  # share of a drafting round's later steps that exited (one that did not ends it)
        self._rounds = 0                 # rounds observed, the clock of measured_at
        # long-run acceptance per (kind, greedy, lookup's match bucket or 0): the prior of each request
        self._lifetime: dict[tuple[Choice, bool, int], AcceptanceCount] = {}
        self._request: dict[tuple[Choice, bool, int], AcceptanceCount] = {}
        # acceptance() by (kind, greedy, match bucket), kept until a count or the prior changes: every round reads it
        # several times, and most rounds count nothing
        self._acceptances: dict[tuple[Choice, bool, int], float] = {}
        # rounds since each exploration was last taken, and how long it waits: by (choice, at another length)
        self._waited: dict[tuple[Choice, bool], int] = {}
        self._wait: dict[tuple[Choice, bool], int] = {}
        self._explore_budget = 0.0       # ms explorations may still lose
        self._shadow: list[int] = []     # lookup drafts offered before a plain step, being checked
        self._shadow_matched = 0         # ... how many of them the tokens decoded since have equalled
        self._shadow_bucket = 0          # ... the bucket of the match they were copied after
        self._graph_changed = False      # the last round ran a batch or probed: the next plain step builds its graph
        # each drafting choice's last computed prices by (choice, greedy, match), kept as the best round for each
        # longest draft length, with what they were computed from: a price does not depend on the longest length
        # offered, so one computation serves every length up to the longest priced
        self._kept_prices: dict[tuple[Choice, bool, int], KeptPrices] = {}
        self._priced_drafts = 0  # the longest draft length asked so far: prices are computed that far

    @property
    def exit_prior(self) -> ExitPrior:
        return self._exit_prior

    @exit_prior.setter
    def exit_prior(self, prior: ExitPrior) -> None:
        self._exit_prior = prior
        self._acceptances.clear()

    # --- a request ---------------------------------------------------------------------------

    def begin_request(self) -> None:
        """Acceptance starts again from what earlier requests accepted (a new answer repeats itself anew); the
        exploration budget carries over, up to EXPLORE_CARRY plain steps."""
        self._request = {}
        self._acceptances.clear()
        if self.plain.value is not None:
            self._explore_budget = min(self._explore_budget, EXPLORE_CARRY * self.plain.value)
        self._shadow, self._shadow_matched = [], 0
        for key, lifetime in self._lifetime.items():
            seen = lifetime.accepted + lifetime.rejected
            if seen > 0:
                share = PRIOR_ROUNDS / seen
                self._request[key] = AcceptanceCount(lifetime.accepted * share, lifetime.rejected * share)

    def acceptance(self, choice: Choice, greedy: bool, match: int = 0) -> float:
        """The chance that a draft is accepted once those before it were; `match`: a lookup draft's match bucket
        (0: over every lookup round). A bucket's is the mean of its own rate and lookup's over all rounds."""
        key = (choice, greedy, match)
        rate = self._acceptances.get(key)
        if rate is None:
            if choice == Choice.LOOKUP and match:
                rate = (self._rate(key, LOOKUP_PRIOR[match]) + self.acceptance(choice, greedy)) / 2
            else:
                rate = self._rate(key, self.exit_prior.acceptance if choice == Choice.EXIT else PRIOR_ACCEPTANCE)
            self._acceptances[key] = rate
        return rate

    def _rate(self, key: tuple[Choice, bool, int], default: float) -> float:
        count = self._request.get(key)
        return count.rate(default) if count else default

    # --- prices ------------------------------------------------------------------------------

    def _batches(self, choice: Choice) -> BatchCosts:
        """The batch costs that price `choice`'s rounds: its own kind's, or the other kind's until one of its own
        was measured (the two differ by the draft head's rows, little beside the batch)."""
        own = self.batches[choice]
        if own.by_rows:
            return own
        return self.batches[Choice.EXIT if choice == Choice.LOOKUP else Choice.LOOKUP]

    def _round_costs(self, choice: Choice, max_drafts: int, batch: list[float]) -> list[RoundCosts]:
        """A drafting round of `choice` by its draft length m (1 .. max_drafts; index 0 unused); `batch` is the batch
        curve. A lookup round checks its m drafts in one batch. An exit round whose first step exited drafts on while
        its steps exit, each later one with the chance later_exits: it checks m drafts, or k < m where its k-th step
        ran every layer (that step's draft, the full model's token, is its last; the step costs a full one). Where its
        first step ran every layer it gives that step's token and drafts nothing. A round that drafts, or steps with
        probes, also pays the graph the next plain step builds again (charged whole: the round after a drafting round
        is mostly a plain step)."""
        regraph = max(self.regraph.value or 0.0, 0.0)
        costs: list[RoundCosts] = [RoundCosts([], float("inf"))]
        if choice == Choice.LOOKUP:  # a lookup round never steps
            for m in range(1, max_drafts + 1):
                drafting = batch[m + 1] + regraph
                costs.append(RoundCosts([(1.0, m, drafting)], drafting))
            return costs
        step, full = self._exit_step_ms()
        later = self._later_exit_share()
        for m in range(1, max_drafts + 1):
            ways, reached = [], 1.0  # reached: the chance that the steps before the k-th all exited
            for k in range(2, m + 1):
                ways.append((reached * (1 - later), k, (k - 1) * step + full + batch[k + 1] + regraph))
                reached *= later
            ways.append((reached, m, m * step + batch[m + 1] + regraph))
            costs.append(RoundCosts(ways, full + regraph))
        return costs

    def _prices(self, choice: Choice, max_drafts: int, a: float) -> list[float]:
        """The price of a round of `choice` (ms per emitted token) by its draft length 0 .. max_drafts (a drafting
        choice's length 0 is no round: infinite), its drafts accepted with chance `a` (_held_acceptance).

        A round of k drafts checked emits E(k) = 1 + a + ... + a^k tokens. An exit-mode round's first step exits with
        probability q and then drafts (_round_costs: its drafts and costs by how its steps go); else it gives one
        token."""
        if choice == Choice.PLAIN:
            return [self.plain.value]
        batch = self._batches(choice).curve(max_drafts + 1, self.plain.value)
        q = 1.0
        if choice == Choice.EXIT:
            q = self.first_exits.value if self.first_exits.value is not None else self.exit_prior.exit_share
        expected, term = [1.0], 1.0  # expected[k] = E(k)
        for _ in range(max_drafts):
            term *= a
            expected.append(expected[-1] + term)
        prices = [float("inf")]
        for round_costs in self._round_costs(choice, max_drafts, batch)[1:]:
            tokens = sum(chance * expected[k] for chance, k, _ in round_costs.drafting)
            prices.append((q * round_costs.drafting_ms() + (1 - q) * round_costs.not_drafting) / (q * tokens + (1 - q)))
        return prices

    def _held_acceptance(self, choice: Choice, greedy: bool, match: int) -> float:
        """acceptance() as a price reads it: within 0 .. MAX_ACCEPTANCE."""
        return min(max(self.acceptance(choice, greedy, match), 0.0), MAX_ACCEPTANCE)

    def _best(self, choice: Choice, max_drafts: int, greedy: bool, match: int = 0,
              reuse: bool = False) -> tuple[int, float]:
        """The draft length, up to `max_drafts`, with the lowest price for `choice`, and that price (computed, and kept
        for reuse).

        reuse: a lower bound of the price computed now, from the kept prices (_bound), where it can be had, else the
        price computed now. A plan in which plain decoding beats such bounds is the plan computed afresh; most
        rounds are plain steps between which only acceptance and the plain step's median have moved."""
        if choice == Choice.PLAIN:
            return 0, self.plain.value
        key = (choice, greedy, match)
        kept = self._kept_prices.get(key)
        if kept is not None and reuse:
            bound = self._bound(kept, choice, max_drafts, greedy, match)
            if bound is not None:
                return kept.best[max_drafts][0], bound
        elif kept is not None and self._priced_alike(kept, choice, max_drafts, greedy, match):
            return kept.best[max_drafts]  # what pricing afresh computes: a round that drafts priced it a moment ago
        # priced as far as any round asked, so that later rounds offering other lengths find them kept
        self._priced_drafts = max(self._priced_drafts, max_drafts)
        prices = self._prices(choice, self._priced_drafts, self._held_acceptance(choice, greedy, match))
        best, cheapest = [(0, prices[0])], (0, prices[0])
        for m in range(1, len(prices)):
            if prices[m] < cheapest[1]:  # the shortest of equal prices, as min() over them picks
                cheapest = (m, prices[m])
            best.append(cheapest)
        batches = self._batches(choice)
        self._kept_prices[key] = KeptPrices(best, self._held_acceptance(choice, greedy, match), batches,
                                            batches.version, max(self.regraph.value or 0.0, 0.0), self.plain.value,
                                            self._plain_free(choice, batches), self._exit_terms(choice))
        return best[max_drafts]

    def _bound(self, kept: KeptPrices, choice: Choice, max_drafts: int, greedy: bool, match: int) -> float | None:
        """A lower bound of the price of rounds of up to `max_drafts` drafts computed now, from kept prices (None
        where none can be had): with prices kept that far, the same batch measurements and exit terms, a regraph no
        cheaper, and a plain step within REPRICE_SHARE of the one they were computed with unless no term read it, the
        kept price lowered by REPRICE_SHARE; and if acceptance rose from a_k to a, lowered again by
        (a_k / a) ** max_drafts. For each draft length m <= max_drafts the expected tokens grow by at most
        (a / a_k) ** m as acceptance rises (each term a ** i, i <= m, by at most that), and the price's costs do not
        move with it. Compared in place: most rounds ask this, and building the inputs anew cost more than the
        check."""
        if not (self._same_batches(kept, choice, max_drafts)
                and max(self.regraph.value or 0.0, 0.0) >= kept.regraph_ms
                and (kept.plain_free or abs(self.plain.value - kept.plain_ms) <= REPRICE_SHARE * kept.plain_ms)
                and (choice != Choice.EXIT or self._exit_terms(choice) == kept.exit_terms)):
            return None
        bound = kept.best[max_drafts][1] * (1 - REPRICE_SHARE)
        acceptance = self._held_acceptance(choice, greedy, match)
        if acceptance > kept.acceptance:
            bound *= (kept.acceptance / acceptance) ** max_drafts
        return bound

    def _same_batches(self, kept: KeptPrices, choice: Choice, max_drafts: int) -> bool:
        """Whether kept prices reach `max_drafts` drafts and were computed from the batch measurements `choice` reads now
        (what both _bound and _priced_alike ask first)."""
        batches = self._batches(choice)
        return max_drafts < len(kept.best) and batches is kept.batches and batches.version == kept.batches_version

    def _priced_alike(self, kept: KeptPrices, choice: Choice, max_drafts: int, greedy: bool, match: int) -> bool:
        """Whether kept prices read exactly what a price computed now would read (then they are that price)."""
        return (self._same_batches(kept, choice, max_drafts)
                and max(self.regraph.value or 0.0, 0.0) == kept.regraph_ms
                and (kept.plain_free or self.plain.value == kept.plain_ms)
                and self._held_acceptance(choice, greedy, match) == kept.acceptance
                and self._exit_terms(choice) == kept.exit_terms)

    def _plain_free(self, choice: Choice, batches: BatchCosts) -> bool:
        """Whether no term of `choice`'s prices reads the plain step's cost: the batch curve begins at a plain step
        (one row) and runs to the first measured batch, and beyond the last with one batch measured it is held by a
        share of a plain step; an exit round's drafting and full steps are guessed from a plain step until measured.
        So: batches of two rows and of more measured, and for exit drafts both steps."""
        if batches.reads_plain():
            return False
        return choice != Choice.EXIT or (self._draft_step_ms() is not None and self.full_step.value is not None)

    def _exit_terms(self, choice: Choice) -> tuple:
        """What an exit round's price reads besides batches and acceptance (nothing for other choices)."""
        if choice != Choice.EXIT:
            return ()
        return *self._exit_step_ms(), self.first_exits.value, self.later_exits.value, self.exit_prior.exit_share

    def _options(self, longest: dict[Choice, int], match: dict[Choice, int], greedy: bool,
                 reuse: bool) -> tuple[dict[Choice, tuple[int, float]], Choice]:
        """Each choice's best (draft length, price), and the cheapest choice."""
        options = {choice: self._best(choice, m, greedy, match.get(choice, 0), reuse) for choice, m in longest.items()}
        return options, min(options, key=lambda c: options[c][1])

    def _exploration_may_be_due(self, choices) -> bool:
        """Whether plan() could explore one of `choices` (drafting choices, plain decoding being the best) this round:
        one has waited its turn and the budget covers the cheapest round it could take (_least_exploration_ms)."""
        plain = self.plain.value
        for choice in choices:
            key = (choice, False)
            if self._waited.get(key, 0) + 1 < self._wait.get(key, EXPLORE_WAIT):
                continue
            if self._least_exploration_ms(choice) - plain <= self._explore_budget:
                return True
        return False

    def _least_exploration_ms(self, choice: Choice) -> float:
        """The least a round exploring `choice` could cost: the least a batch of two rows or more costs on the batch
        curve (its two-row cost, or a measured one: the curve runs straight between them), the regraph, and for exit
        drafts one drafting step."""
        batches = self._batches(choice)
        measured = [cost for _, cost in batches.measured_points()]
        drafting = self._exit_step_ms()[0] if choice == Choice.EXIT else 0.0
        return min([batches.curve(2, self.plain.value)[2], *measured]) + max(self.regraph.value or 0.0, 0.0) + drafting

    def _exit_step_ms(self) -> tuple[float, float]:
        """An exit round's drafting step that exited, and its first step when that ran every layer (guesses from a
        plain step until measured)."""
        plain = self.plain.value
        step = self._draft_step_ms()
        step = step if step is not None else 0.8 * plain
        full = self.full_step.value if self.full_step.value is not None else plain
        return step, full

    def _draft_step_ms(self) -> float | None:
        """A drafting step that exited (None until measured): its median, or on a split model each side's weighed by
        the share of exits past the split. A side never measured has a share of exactly 0 (the moving share starts
        at the first step it counts), so the other side's median alone is that mean."""
        before, past = self.draft_step.value, self.draft_step_past.value
        if past is None:
            return before
        if before is None:
            return past
        return before + self.past_split.value * (past - before)

    def _later_exit_share(self) -> float:
        """The chance that a drafting round's step after its first exits (the level's calibrated share until
        measured)."""
        return self.later_exits.value if self.later_exits.value is not None else self.exit_prior.exit_share

    def _explorable(self, choice: Choice, max_drafts: int, best_price: float, other_than: int | None = None) -> int | None:
        """The draft length of an exploration of `choice` (0 for a plain step), or None: the length, up to
        `max_drafts` and not `other_than`, whose worst case (every draft rejected, one token emitted) the exploration
        budget covers beyond the best price, and among those the one whose batch was measured longest ago (then the
        longest). With `other_than` (the best choice at another length), only a length measured before it."""
        if choice == Choice.PLAIN:
            return 0 if self.plain.value - best_price <= self._explore_budget else None
        batches = self._batches(choice)
        costs = self._round_costs(choice, max_drafts, batches.curve(max_drafts + 1, self.plain.value))
        covered = [m for m in range(1, max_drafts + 1)
                   if m != other_than and costs[m].worst_ms() - best_price <= self._explore_budget]
        if other_than is not None:
            covered = [m for m in covered if batches.measured_at(m + 1) < batches.measured_at(other_than + 1)]
        if not covered:
            return None
        return min(covered, key=lambda m: (batches.measured_at(m + 1), -m))

    # --- a round -----------------------------------------------------------------------------

    def plan(self, *, lookup_drafts: int, exit_drafts: int, limit: int, greedy: bool, lookup_match: int = 0) -> Plan:
        """The next round. lookup_drafts: how many drafts prompt lookup offers now (0: no match), lookup_match: the
        bucket of their match; exit_drafts: the most drafts the pack's exits may give a round (its level's
        calibrated max_draft; 0: they cannot draft); limit: the most drafts the round may check (context, budget,
        n_batch)."""
        exit_drafts = min(exit_drafts, limit)
        if self.always_draft and limit >= 1 and (lookup_drafts or exit_drafts):
            return (Plan(Choice.LOOKUP, min(lookup_drafts, limit), 0.0, match=lookup_match) if lookup_drafts
                    else Plan(Choice.EXIT, exit_drafts, 0.0))
        if self.plain.value is None or limit < 1 or self.always_draft or not (lookup_drafts or exit_drafts):
            return Plan(Choice.PLAIN, 0, self.plain.value or 0.0)  # no price without a plain step measured
        longest = {Choice.PLAIN: 0}
        if lookup_drafts >= 1:
            longest[Choice.LOOKUP] = min(lookup_drafts, limit)
        if exit_drafts >= 1:
            longest[Choice.EXIT] = exit_drafts
        match = {Choice.LOOKUP: lookup_match}
        settled = self._settled_plain(longest, match, greedy)
        if settled is not None:
            return settled
        options, best = self._options(longest, match, greedy, reuse=True)
        if best != Choice.PLAIN or self._exploration_may_be_due([c for c in options if c != Choice.PLAIN]):
            options, best = self._options(longest, match, greedy, reuse=False)
        best_drafts, best_price = options[best]
        chosen = Plan(best, best_drafts, best_price, best_ms_per_token=best_price, match=match.get(best, 0))
        self._waited[(best, False)] = 0
        # what may be explored: each other choice, and the best one at another draft length (a stale batch size)
        for key in [(choice, False) for choice in options if choice != best] + [(best, True)] * (best != Choice.PLAIN):
            choice, other_length = key
            self._waited[key] = self._waited.get(key, 0) + 1
            if chosen.explore or self._waited[key] < self._wait.get(key, EXPLORE_WAIT):
                continue
            drafts = (self._explorable(choice, longest[choice], best_price, other_than=best_drafts) if other_length
                      else self._explorable(choice, max(options[choice][0], 1), best_price))
            if drafts is not None:
                chosen = Plan(choice, drafts, options[choice][1], True, best_price, other_length, match.get(choice, 0))
                self._waited[key] = 0
        return chosen

    def _settled_plain(self, longest: dict[Choice, int], match: dict[Choice, int], greedy: bool) -> Plan | None:
        """The plan of most rounds, found without the machinery that finds it: a plain step, where each drafting
        choice's kept price still bounds its price now and loses to a plain step, and no exploration may be due. It is
        the plan that pricing and exploring would give, and its waiting counts move alike (None: another round, which
        plan() prices)."""
        plain = self.plain.value
        waiting = []
        for choice, drafts in longest.items():
            if choice == Choice.PLAIN:
                continue
            key = (choice, False)
            if (self._waited.get(key, 0) + 1 >= self._wait.get(key, EXPLORE_WAIT)
                    and self._exploration_may_be_due([choice])):
                return None
            bucket = match.get(choice, 0)
            kept = self._kept_prices.get((choice, greedy, bucket))
            bound = self._bound(kept, choice, drafts, greedy, bucket) if kept is not None else None
            if bound is None or bound < plain:
                return None
            waiting.append(key)
        self._waited[(Choice.PLAIN, False)] = 0
        for key in waiting:
            self._waited[key] = self._waited.get(key, 0) + 1
        return Plan(Choice.PLAIN, 0, plain, best_ms_per_token=plain)

    def plain_streak(self, lookup_drafts: int, exit_drafts: int, greedy: bool) -> PlainStreak | None:
        """The coming rounds that cannot draft profitably, as far as can be known now (None: plan the next round).
        lookup_drafts, exit_drafts: the most drafts a round may be offered of each kind (0: exits cannot draft).

        A plain step's price is its median; the streak's rounds are told to the controller (observe_plain) only when it
        ends, so the median may have moved meanwhile: each drafting price is checked against a ceiling instead, at most
        STREAK_JITTER above the median. While no step of the streak costs more than the ceiling, the median stays at
        most that (it is the middle of its window: a value at most the ceiling never lifts the middle past it). Those
        prices must read no plain step (_plain_free), and plain rounds move nothing else they read but lookup's
        acceptance, which its shadow rounds keep current meanwhile: exit rounds must cost at least the ceiling, and
        each round's lookup offer is checked against what its round would have to emit to pay (PlainStreak.keeps). The
        streak ends before any choice could be explored (_unexplored_rounds). So plan() would choose each of its rounds
        plain and explore nothing: the engine decodes them without asking, and tells them afterwards (end_streak)."""
        plain = self.plain.value
        if self.always_draft or plain is None or self._graph_changed or lookup_drafts < 1:
            return None
        longest = {Choice.LOOKUP: lookup_drafts}
        if exit_drafts >= 1:
            longest[Choice.EXIT] = exit_drafts
        if not all(self._plain_free(choice, self._batches(choice)) for choice in longest):
            return None
        ceiling = plain * (1 + STREAK_JITTER)
        if Choice.EXIT in longest:
            exit_acceptance = self._held_acceptance(Choice.EXIT, greedy, 0)  # plain rounds leave it alone
            ceiling = min(ceiling, *self._prices(Choice.EXIT, exit_drafts, exit_acceptance))
            if ceiling < plain:
                return None
        rounds = min(self._unexplored_rounds(choice, ceiling) for choice in longest)
        if rounds < 1:
            return None
        batch = self._batches(Choice.LOOKUP).curve(lookup_drafts + 1, plain)
        costs = self._round_costs(Choice.LOOKUP, lookup_drafts, batch)
        return PlainStreak(rounds, ceiling, (0.0, *(c.drafting_ms() / ceiling for c in costs[1:])))

    def _unexplored_rounds(self, choice: Choice, ceiling_ms: float) -> int:
        """How many rounds to come cannot explore `choice` while no step costs more than `ceiling_ms`: it is explored
        only once it has waited its turn and the budget covers its cheapest round beyond a plain step, and each plain
        round adds EXPLORE_SHARE of its time to the budget."""
        key = (choice, False)
        waits = self._wait.get(key, EXPLORE_WAIT) - self._waited.get(key, 0) - 1
        short = self._least_exploration_ms(choice) - ceiling_ms - self._explore_budget
        return max(waits, math.ceil(short / (EXPLORE_SHARE * ceiling_ms)))

    def end_streak(self, step_ms: Sequence[float], offered: Sequence[int | None], exits: bool,
                   greedy: bool = True) -> None:
        """Tell the controller a plain streak's rounds as plan() and observe_plain() would have been told them: each
        one's step time, and the lookup drafts it was offered (None: it could check none, and plan() was not asked
        to choose); `exits`: exit drafts could be had. Lookup waited a round longer to be explored where it offered
        drafts, exits wherever a round could check drafts. Their shadow rounds were told as they ran (watch_lookup)."""
        for ms, drafts in zip(step_ms, offered):
            if drafts is not None and (drafts or exits):
                self._waited[(Choice.PLAIN, False)] = 0
                for key in [(Choice.EXIT, False)] * exits + [(Choice.LOOKUP, False)] * (drafts > 0):
                    self._waited[key] = self._waited.get(key, 0) + 1
            self.observe_plain(STREAK_PLAN, ms, greedy)

    def observe(self, outcome: Outcome) -> float:
        """Learn from a round; returns what an exploration cost beyond the choice it displaced (0 otherwise)."""
        plan = outcome.plan
        if plan.choice == Choice.PLAIN:
            return self.observe_plain(plan, outcome.ms, outcome.greedy)
        self._rounds += 1
        self._explore_budget += EXPLORE_SHARE * outcome.ms
        if outcome.drafts:
            self.batches[plan.choice].add(outcome.drafts + 1, outcome.batch_ms, self._rounds)
            self._count(plan.choice, outcome.greedy, plan.match, outcome.accepted, outcome.drafts)
        if plan.choice == Choice.EXIT:
            self._observe_exit_steps(outcome)
        # a drafting round ran a batch, an exit round steps with probes: either way the next plain step builds its
        # graph again
        self._graph_changed = outcome.drafts > 0 or plan.choice == Choice.EXIT
        return self._explored(plan, outcome.ms, outcome.emitted, outcome.greedy) if plan.explore else 0.0

    def _observe_exit_steps(self, outcome: Outcome) -> None:
        """An exit round's steps: whether its first exited, what a step that exited and one that ran every layer
        cost, and whether each later drafting step exited (only the last may not have: it ends the drafting)."""
        self.first_exits.add(outcome.full_step_ms is None)
        if outcome.full_step_ms is not None:
            self.full_step.add(outcome.full_step_ms)
        steps = outcome.draft_step_ms
        exited = steps[:-1] if outcome.drafting_ended_full else steps
        layers = outcome.draft_exit_layers
        for i, ms in enumerate(exited):
            self._add_draft_step(ms, layers[i] if i < len(layers) else None)
        if outcome.drafting_ended_full:
            self.full_step.add(steps[-1])
        for later in range(1, len(steps)):
            self.later_exits.add(later < len(exited))

    def _add_draft_step(self, ms: float, layer: int | None) -> None:
        """A drafting step that exited at `layer` (None: not told, counted before the split): its side's cost and,
        on a split model, the share of exits past the split."""
        if self.split_layer is None:
            self.draft_step.add(ms)
            return
        past = layer is not None and layer >= self.split_layer
        (self.draft_step_past if past else self.draft_step).add(ms)
        self.past_split.add(past)

    def observe_plain(self, plan: Plan, ms: float, greedy: bool = True) -> float:
        """observe() of a plain step that took `ms` (the engine's most frequent round, told without an Outcome)."""
        self._rounds += 1
        self._explore_budget += EXPLORE_SHARE * ms
        if self._graph_changed and self.plain.value is not None:
            self.regraph.add(ms - self.plain.value, self._rounds)
        else:
            self.plain.add(ms, self._rounds)
        self._graph_changed = False
        return self._explored(plan, ms, 1, greedy) if plan.explore else 0.0

    def _explored(self, plan: Plan, ms: float, emitted: int, greedy: bool) -> float:
        """An exploration's end: the explored choice (or length)'s new price against the best price it displaced (lost
        again: wait longer); returns what it cost beyond that price, paid from the budget."""
        prices = self._prices(plan.choice, max(plan.drafts, 1), self._held_acceptance(plan.choice, greedy, plan.match))
        price = prices[plan.drafts] if plan.other_length else min(prices)
        key = (plan.choice, plan.other_length)
        lost = price > plan.best_ms_per_token
        self._wait[key] = min(self._wait.get(key, EXPLORE_WAIT) * 2, MAX_EXPLORE_WAIT) if lost else EXPLORE_WAIT
        cost = ms - emitted * plan.best_ms_per_token
        self._explore_budget -= cost
        return cost

    def watch_lookup(self, plan: Plan, offered: list[int], emitted: list[int], greedy: bool, match: int = 0) -> None:
        """Shadow rounds: the lookup drafts offered at a plain step (copied after a match of bucket `match`) are
        checked against the tokens decoded from there on, and counted as the round that was not taken would have
        been (accepted while equal). A drafting round drops the shadow that pends: its drafts are counted by the
        round itself, not twice."""
        if plan.choice != Choice.PLAIN:
            self._shadow, self._shadow_matched = [], 0
            return
        if offered and not self._shadow:
            self._shadow, self._shadow_matched, self._shadow_bucket = list(offered), 0, match
        for token in emitted:
            if not self._shadow:
                return
            equal = token == self._shadow[self._shadow_matched]
            self._shadow_matched += equal
            if not equal or self._shadow_matched == len(self._shadow):
                self._count(Choice.LOOKUP, greedy, self._shadow_bucket, self._shadow_matched, len(self._shadow))
                self._shadow, self._shadow_matched = [], 0

    def _count(self, choice: Choice, greedy: bool, match: int, accepted: int, drafts: int) -> None:
        """Count a round's drafts under its kind (every round) and its match bucket (lookup's)."""
        for key in {(choice, greedy, 0), (choice, greedy, match)}:
            for counts, decay in ((self._request, ACCEPT_DECAY), (self._lifetime, 1.0)):
                counts.setdefault(key, AcceptanceCount()).add(accepted, drafts, decay=decay)
        self._acceptances.clear()

    def snapshot(self) -> dict:
        """What the controller has measured, for stats and the bench (ms)."""
        rounded = lambda cost: round(cost.value, 3) if cost.value is not None else None
        draft_step = self._draft_step_ms()
        # on a split model, also each side's drafting step (before the split, past it) and the share past it
        sides = ({"draft_step_ms_by_side": [rounded(self.draft_step), rounded(self.draft_step_past)],
                  "exits_past_split": rounded(self.past_split)} if self.split_layer is not None else {})
        return {
            "plain_ms": rounded(self.plain),
            "batch_ms": self.batches[Choice.LOOKUP].snapshot(),
            "exit_batch_ms": self.batches[Choice.EXIT].snapshot(),
            "regraph_ms": rounded(self.regraph),
            "draft_step_ms": round(draft_step, 3) if draft_step is not None else None,
            **sides,
            "first_step_exits": rounded(self.first_exits),
            "later_step_exits": rounded(self.later_exits),
            # the chance that a draft is accepted once those before it were: accepted / (accepted + rejections),
            # what prices a round (not acceptance_rate, accepted / drafted, which counts drafts after a rejection)
            "accept_chance": {accept_key(*key): round(count.rate(), 3) for key, count in sorted(self._lifetime.items())},
        }
