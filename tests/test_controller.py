"""The exact-mode controller's decision rule on synthetic costs and acceptance (engine/controller.py)."""

from __future__ import annotations

import math
import random

import pytest

from specee_edge.engine.controller import (EXPLORE_CARRY, EXPLORE_SHARE, EXPLORE_WAIT, MAX_EXPLORE_WAIT, PRIOR_ROW_COST, AcceptanceCount,
                                           BatchCosts, Choice, Controller, ExitPrior, Outcome, Plan)


def measured(plain_ms: float, batch_ms: dict[int, float]) -> Controller:
    """A controller that has seen a plain step and batches of these row counts cost this much."""
    controller = Controller()
    controller.observe(Outcome(Plan(Choice.PLAIN, 0, 0.0), emitted=1, ms=plain_ms))
    for rows, ms in batch_ms.items():
        controller.batches[Choice.LOOKUP].add(rows, ms)
    return controller


def accept(controller: Controller, choice: Choice, accepted: int, drafts: int, rounds: int, greedy: bool = True,
           match: int = 0) -> None:
    """`rounds` rounds of `choice` that each accepted `accepted` of `drafts` drafts (costs untouched); `match`: lookup's
    match bucket (0: the controller's tests that do not bucket)."""
    for _ in range(rounds):
        for counts in (controller._request, controller._lifetime):
            counts.setdefault((choice, greedy, match), AcceptanceCount()).add(accepted, drafts)
    controller._acceptances.clear()  # as _count does


def plan(controller: Controller, lookup: int = 8, exits: int = 0, limit: int = 8, greedy: bool = True,
         match: int = 0) -> Plan:
    """`exits`: the most drafts the pack's exits may give (0: none)."""
    return controller.plan(lookup_drafts=lookup, exit_drafts=exits, limit=limit, greedy=greedy, lookup_match=match)


def test_a_lookup_round_is_priced_per_expected_token():
    """m drafts accepted with probability a emit 1 + a + ... + a^m tokens for one batch of m + 1 rows."""
    controller = measured(10.0, {2: 15.0, 3: 17.0})
    accept(controller, Choice.LOOKUP, 1, 2, rounds=1)  # acceptance 0.5
    assert controller._best(Choice.LOOKUP, 1, True) == (1, pytest.approx(15.0 / 1.5))
    assert controller._best(Choice.LOOKUP, 2, True) == (2, pytest.approx(17.0 / 1.75))
    accept(controller, Choice.LOOKUP, 4, 4, rounds=50)  # never rejected: still no draft is certain
    assert controller._best(Choice.LOOKUP, 2, True)[1] > 17.0 / 3


def test_batch_costs_interpolate_and_extrapolate():
    costs = BatchCosts()
    assert costs.curve(3, 10.0)[3] == pytest.approx(10.0 + 2 * PRIOR_ROW_COST * 10.0)  # nothing measured: the prior
    costs.add(5, 30.0)
    curve = costs.curve(9, 10.0)
    assert curve[1] == 10.0 and curve[5] == 30.0
    assert curve[3] == pytest.approx(20.0)  # between a plain step (1 row) and 5 rows
    # beyond one measured batch: the prior's quarter step per row, not the steep line from a plain step
    assert curve[9] == pytest.approx(30.0 + 4 * PRIOR_ROW_COST * 10.0)
    costs.add(2, 11.0)
    assert costs.curve(9, 10.0)[9] == pytest.approx(30.0 + 4 * (19.0 / 3))  # the last two batches' slope
    gpu = BatchCosts()  # a batch of 2 rows at about a step: later rows no dearer than that one was
    gpu.add(2, 10.2)
    assert gpu.curve(9, 10.0)[9] == pytest.approx(10.2 + 7 * 0.2)
    cheap = BatchCosts()  # a machine where a batch of 2 rows costs less than a step was measured to (noise, or load)
    cheap.add(2, 8.0)
    assert cheap.curve(4, 10.0)[2:] == [8.0, 8.0, 8.0]  # measured as it is, never extrapolated downwards


def test_a_dear_first_batch_still_tries_a_long_round_where_everything_is_accepted():
    """On a CPU a batch of 2 rows costs much more than a step and later rows little (gemma-3-270m here: 2 rows
    2.5 steps): a looping answer must still get a long round to measure, not be priced off by the first jump."""
    controller = measured(10.0, {2: 25.0})
    accept(controller, Choice.LOOKUP, 8, 8, rounds=10)
    chosen = plan(controller)
    assert chosen.choice == Choice.LOOKUP and chosen.drafts == 8 and not chosen.explore


def test_first_round_is_plain_until_a_step_is_measured():
    controller = Controller()
    assert plan(controller).choice == Choice.PLAIN
    assert plan(measured(10.0, {}), limit=0).choice == Choice.PLAIN  # no room for a batch


def test_dear_batches_decode_plainly():
    """A CPU where every row costs most of a step: even a lookup that is right half the time loses."""
    controller = measured(10.0, {2: 18.0, 3: 26.0, 5: 42.0, 9: 74.0})
    accept(controller, Choice.LOOKUP, 1, 2, rounds=10)  # acceptance 0.5
    assert plan(controller).choice == Choice.PLAIN


def test_cheap_batches_draft_long():
    """A GPU where a batch of 9 rows costs about a step: long lookup rounds win."""
    controller = measured(10.0, {2: 10.5, 5: 11.0, 9: 12.0})
    accept(controller, Choice.LOOKUP, 3, 4, rounds=10)
    chosen = plan(controller)
    assert chosen.choice == Choice.LOOKUP and chosen.drafts >= 6
    assert chosen.ms_per_token < 10.0


def test_draft_length_follows_acceptance():
    controller = measured(10.0, {2: 13.0, 3: 16.0, 5: 22.0, 9: 34.0})
    accept(controller, Choice.LOOKUP, 8, 8, rounds=10)  # a looping answer: everything accepted
    long = plan(controller)
    fresh = measured(10.0, {2: 13.0, 3: 16.0, 5: 22.0, 9: 34.0})
    accept(fresh, Choice.LOOKUP, 1, 2, rounds=10)
    short = plan(fresh)
    assert long.choice == Choice.LOOKUP and long.drafts == 8
    assert short.choice == Choice.PLAIN or short.drafts < long.drafts


def test_no_lookup_match_means_no_lookup_round():
    controller = measured(10.0, {2: 10.1, 9: 10.5})
    accept(controller, Choice.LOOKUP, 8, 8, rounds=10)
    assert plan(controller, lookup=0).choice == Choice.PLAIN
    assert plan(controller, lookup=2).drafts <= 2


def test_exit_rounds_priced_from_their_steps():
    """Exit drafts pay for their drafting steps: cheap exits win, exits that cost a whole step do not."""
    cheap = Controller(ExitPrior(acceptance=0.8, exit_share=0.9))
    cheap.observe(Outcome(Plan(Choice.PLAIN, 0, 0.0), emitted=1, ms=10.0))
    cheap.batches[Choice.EXIT].add(4, 14.0)
    cheap.draft_step.add(4.0)
    assert plan(cheap, lookup=0, exits=8).choice == Choice.EXIT
    dear = Controller(ExitPrior(acceptance=0.8, exit_share=0.9))
    dear.observe(Outcome(Plan(Choice.PLAIN, 0, 0.0), emitted=1, ms=10.0))
    dear.batches[Choice.EXIT].add(4, 14.0)
    dear.draft_step.add(11.0)
    assert plan(dear, lookup=0, exits=8).choice == Choice.PLAIN


def test_acceptance_is_per_kind_and_per_decoding():
    controller = measured(10.0, {2: 12.0, 5: 18.0, 9: 26.0})
    accept(controller, Choice.LOOKUP, 8, 8, rounds=10, greedy=True)
    accept(controller, Choice.LOOKUP, 0, 2, rounds=10, greedy=False)
    assert plan(controller, greedy=True).choice == Choice.LOOKUP
    assert plan(controller, greedy=False).choice == Choice.PLAIN
    assert controller.acceptance(Choice.EXIT, True) == controller.exit_prior.acceptance


def test_a_request_starts_from_what_earlier_ones_accepted_and_then_its_own():
    controller = measured(10.0, {2: 12.0, 5: 18.0, 9: 26.0})
    accept(controller, Choice.LOOKUP, 0, 2, rounds=20)
    controller.begin_request()
    assert controller.acceptance(Choice.LOOKUP, True) == pytest.approx(0.0)
    for _ in range(6):  # this answer loops: its recent rounds outweigh the prior
        controller.observe(Outcome(Plan(Choice.LOOKUP, 4, 0.0), emitted=5, ms=15.0, drafts=4, accepted=4, batch_ms=15.0))
    assert controller.acceptance(Choice.LOOKUP, True) > 0.9


def plain_rounds(controller: Controller, n: int, ms: float = 10.0, lookup: int = 1) -> list[Plan]:
    """n rounds as planned, a plain one costing `ms`, a lookup one of one draft rejected costing 1.9 of it."""
    plans = []
    for _ in range(n):
        chosen = plan(controller, lookup=lookup, limit=1)
        batch_ms = 1.9 * ms if chosen.drafts else 0.0
        controller.observe(Outcome(chosen, emitted=1, ms=batch_ms or ms, drafts=chosen.drafts, batch_ms=batch_ms))
        plans.append(chosen)
    return plans


def test_exploration_spends_a_small_budget_and_backs_off_when_it_loses():
    controller = measured(10.0, {2: 19.0})
    accept(controller, Choice.LOOKUP, 0, 1, rounds=10)
    controller.begin_request()
    worst_loss = 19.0 - 10.0
    # the budget grows by EXPLORE_SHARE of each round: none before it covers a rejected draft's batch
    waited = int(worst_loss / (EXPLORE_SHARE * 10.0))
    assert not any(p.explore for p in plain_rounds(controller, waited - 1))
    plans = plain_rounds(controller, 600)
    explored = [p for p in plans if p.explore]
    assert explored and all(p.choice == Choice.LOOKUP and p.drafts == 1 for p in explored)
    spent = sum(p.explore for p in plans) * worst_loss
    assert spent <= EXPLORE_SHARE * 10.0 * (600 + waited) + worst_loss
    # each exploration lost again: the wait doubled up to MAX_EXPLORE_WAIT
    assert controller._wait[(Choice.LOOKUP, False)] == min(EXPLORE_WAIT * 2 ** len(explored), MAX_EXPLORE_WAIT)
    cost = controller.observe(Outcome(explored[0], emitted=1, ms=19.0, drafts=1, accepted=0, batch_ms=19.0))
    assert cost == pytest.approx(19.0 - 10.0)


def test_an_exploration_is_shortened_to_what_the_budget_covers():
    controller = measured(10.0, {2: 16.0, 9: 30.0})
    accept(controller, Choice.LOOKUP, 1, 2, rounds=10)  # acceptance 0.5: 2 drafts would be lookup's best, 10.3 ms
    controller.begin_request()
    controller._waited[(Choice.LOOKUP, False)] = EXPLORE_WAIT
    controller._explore_budget = 7.0  # covers a rejected batch of 2 rows (16 ms, 6 beyond a step), not of 3 (18)
    chosen = plan(controller)
    assert chosen.explore and chosen.choice == Choice.LOOKUP and chosen.drafts == 1
    controller._waited[(Choice.LOOKUP, False)] = EXPLORE_WAIT
    controller._explore_budget = 5.0  # covers none
    assert not plan(controller).explore


def test_a_new_request_carries_a_capped_budget():
    """Short requests explore too: the budget a request did not spend goes on, up to EXPLORE_CARRY steps."""
    controller = measured(10.0, {2: 19.0})
    accept(controller, Choice.LOOKUP, 0, 1, rounds=10)
    controller._wait[(Choice.LOOKUP, False)] = MAX_EXPLORE_WAIT + 1  # no exploration while the budget grows
    plain_rounds(controller, 2000)
    controller.begin_request()
    assert controller._explore_budget == pytest.approx(EXPLORE_CARRY * 10.0)
    controller._wait[(Choice.LOOKUP, False)] = MAX_EXPLORE_WAIT
    controller._waited[(Choice.LOOKUP, False)] = MAX_EXPLORE_WAIT
    assert plan(controller, lookup=1, limit=1).explore


def test_one_hiccup_never_stands_for_a_cost():
    """A cost is the median of its recent measurements: a slow first batch is outvoted once measured again."""
    costs = BatchCosts()
    costs.add(2, 40.0)
    costs.add(2, 13.0)
    costs.add(2, 13.2)
    assert costs.curve(2, 10.0)[2] == pytest.approx(13.2)


def test_exploring_a_plain_step_is_priced_as_a_plain_step():
    """A stale plain cost is measured again as soon as the budget covers one plain step beyond the best price."""
    controller = measured(10.0, {2: 10.5, 9: 12.0})
    accept(controller, Choice.LOOKUP, 8, 8, rounds=10)  # lookup wins: about 1.4 ms a token
    controller._waited[(Choice.PLAIN, False)] = EXPLORE_WAIT
    best = plan(controller)
    assert best.choice == Choice.LOOKUP and not best.explore
    controller._waited[(Choice.PLAIN, False)] = EXPLORE_WAIT
    controller._explore_budget = 10.0 - best.ms_per_token + 0.01  # one plain step beyond the best price, no more
    chosen = plan(controller)
    assert chosen == Plan(Choice.PLAIN, 0, 10.0, True, best.ms_per_token)


def test_an_exploration_measures_the_stalest_batch_again():
    controller = measured(10.0, {})
    controller.batches[Choice.LOOKUP].add(2, 40.0, at=1)  # long ago, and dear
    controller.batches[Choice.LOOKUP].add(3, 15.0, at=50)
    controller.batches[Choice.LOOKUP].add(4, 17.0, at=60)
    accept(controller, Choice.LOOKUP, 0, 3, rounds=10)
    controller._waited[(Choice.LOOKUP, False)] = EXPLORE_WAIT
    controller._explore_budget = 100.0
    chosen = plan(controller, lookup=3, limit=3)
    assert chosen.explore and chosen.choice == Choice.LOOKUP and chosen.drafts == 1


def simulate(seed: int, hiccup_ms: float, requests: int, tokens: int = 48,
             acceptance: float = 0.6) -> tuple[Controller, int, float]:
    """The engine's calls (plan, observe, watch_lookup; begin_request between requests) on a machine where a plain
    step costs 10 ms and a batch of r rows 13 + 2 (r - 2) ms, on a text whose token k is k: lookup offers 8 drafts
    at every position, each right with probability `acceptance` once those before it were. The very first batch
    takes `hiccup_ms` instead. Returns the controller, the rows of that first batch and the ms per token over the
    last half of the requests."""
    rng = random.Random(seed)
    controller = Controller()
    first_batch, first_rows = True, 0
    spent = emitted_total = 0.0
    for request in range(requests):
        controller.begin_request()
        last = 0  # the last emitted token (= its position)
        while last < tokens - 1:
            right = 0
            while right < 8 and rng.random() < acceptance:
                right += 1
            offered = [last + 1 + j if j < right else -1 for j in range(8)]
            chosen = plan(controller, lookup=8, limit=min(8, tokens - 2 - last))
            if chosen.choice == Choice.PLAIN:
                outcome = Outcome(chosen, emitted=1, ms=10.0)
            else:
                accepted = min(right, chosen.drafts)
                ms = 13.0 + 2.0 * (chosen.drafts - 1)
                if first_batch:
                    ms, first_batch, first_rows = hiccup_ms, False, chosen.drafts + 1
                outcome = Outcome(chosen, emitted=accepted + 1, ms=ms, drafts=chosen.drafts, accepted=accepted,
                                  batch_ms=ms)
            controller.observe(outcome)
            emitted = list(range(last + 1, last + 1 + outcome.emitted))
            controller.watch_lookup(chosen, offered, emitted, greedy=True)
            last = emitted[-1]
            if request >= requests // 2:
                spent += outcome.ms
                emitted_total += outcome.emitted
    return controller, first_rows, spent / emitted_total


@pytest.mark.parametrize("seed", range(5))
def test_a_hiccup_on_the_first_batch_is_unlearned(seed):
    """Requests of 48 tokens, begin_request() between them as the engine calls it: a 40 ms hiccup on the very
    first batch (true cost 13) must not keep drafting priced out."""
    hit, rows, hit_ms = simulate(seed, hiccup_ms=40.0, requests=100)
    _, _, clean_ms = simulate(seed, hiccup_ms=13.0 + 2.0 * (rows - 2), requests=100)
    assert hit.batches[Choice.LOOKUP].curve(rows, 10.0)[rows] <= 13.0 + 2.0 * (8 - 1)  # no dearer than the longest batch
    assert hit_ms <= 1.03 * clean_ms


def test_exploration_notices_cheaper_batches_across_short_requests():
    """The same machine change, seen by requests of 32-44 rounds with begin_request() between them."""
    controller = measured(10.0, {2: 19.0})
    accept(controller, Choice.LOOKUP, 1, 2, rounds=3)
    rng = random.Random(0)
    for _ in range(40):
        controller.begin_request()
        rounds_on_cheap_batches(controller, rng.randint(32, 44))
    assert plan(controller, lookup=1, limit=1).choice == Choice.LOOKUP


def test_exploration_notices_a_choice_that_starts_to_pay():
    """Batches were dear, then the machine changed (a GPU took over): exploring finds it and drafting resumes."""
    controller = measured(10.0, {2: 19.0})
    accept(controller, Choice.LOOKUP, 1, 2, rounds=3)  # acceptance 0.5: 12.7 ms a token, plain steps win
    assert plan(controller, lookup=1, limit=1).choice == Choice.PLAIN
    rounds_on_cheap_batches(controller, EXPLORE_WAIT * 8)
    assert plan(controller, lookup=1, limit=1).choice == Choice.LOOKUP


def rounds_on_cheap_batches(controller: Controller, n: int) -> None:
    """n rounds as planned where a plain step costs 10 ms and a lookup round of one draft, accepted, 10.5."""
    for _ in range(n):
        chosen = plan(controller, lookup=1, limit=1)
        if chosen.choice == Choice.LOOKUP:
            controller.observe(Outcome(chosen, emitted=2, ms=10.5, drafts=1, accepted=1, batch_ms=10.5))
        else:
            controller.observe(Outcome(chosen, emitted=1, ms=10.0))


def test_shadow_rounds_track_lookup_while_decoding_plainly():
    """Drafts offered at plain steps are checked against what follows: an answer that starts copying its prompt
    raises lookup's acceptance with no lookup round run, greedy and sampled apart."""
    controller = measured(10.0, {2: 19.0})
    controller.begin_request()
    plain = Plan(Choice.PLAIN, 0, 10.0)
    controller.watch_lookup(plain, [5, 6, 7], [9], greedy=True)  # the first draft was wrong
    assert controller.acceptance(Choice.LOOKUP, True) == pytest.approx(0.0)
    for _ in range(5):  # now each offer of three drafts comes true, one plain step at a time
        controller.watch_lookup(plain, [1, 2, 3], [1], greedy=True)
        controller.watch_lookup(plain, [7, 7], [2], greedy=True)  # a shadow pends: this offer is not taken
        controller.watch_lookup(plain, [], [3], greedy=True)
    assert controller.acceptance(Choice.LOOKUP, True) > 0.9
    assert controller.acceptance(Choice.LOOKUP, False) == 0.5  # sampled requests: nothing seen, the prior
    controller.watch_lookup(plain, [4, 5], [4, 6], greedy=False)  # a round's tokens all count
    assert controller.acceptance(Choice.LOOKUP, False) == pytest.approx(0.5)


def test_a_drafting_round_drops_the_pending_shadow():
    """Shadow [1, 2, 3] offered at a plain step that emitted 1, then a lookup round accepting [2, 3]: the round
    counts its two drafts once, the shadow nothing more."""
    controller = measured(10.0, {2: 19.0})
    controller.begin_request()
    controller.watch_lookup(Plan(Choice.PLAIN, 0, 10.0), [1, 2, 3], [1], greedy=True)
    lookup = Plan(Choice.LOOKUP, 2, 8.0)
    controller.observe(Outcome(lookup, emitted=3, ms=15.0, drafts=2, accepted=2, batch_ms=15.0))
    controller.watch_lookup(lookup, [2, 3], [2, 3, 4], greedy=True)
    count = controller._request[(Choice.LOOKUP, True, 0)]
    assert (count.accepted, count.rejected) == (2.0, 0.0)


def test_lookup_acceptance_is_counted_by_the_length_of_the_match():
    """A long match's drafts are priced with what long matches accepted, a one-token match's with its own: the
    first drafts at once (its prior, then its record), the second stays plain."""
    controller = measured(10.0, {2: 16.0, 5: 24.0, 9: 36.0})
    controller.begin_request()
    # LOOKUP_PRIOR: 8+ matches were right 9 times in 10, 1-token ones a quarter of the time (each mixed with 0.5)
    assert plan(controller, match=8).choice == Choice.LOOKUP
    assert plan(controller, match=1).choice == Choice.PLAIN
    accept(controller, Choice.LOOKUP, 0, 8, rounds=10, match=8)  # this machine's texts disagree: long matches fail
    accept(controller, Choice.LOOKUP, 8, 8, rounds=10, match=1)  # ... and short ones come true
    assert plan(controller, match=8).choice == Choice.PLAIN
    assert plan(controller, match=1).choice == Choice.LOOKUP
    plain = Plan(Choice.PLAIN, 0, 10.0)
    controller.watch_lookup(plain, [1, 2], [1], greedy=True, match=4)  # a shadow round counts in its own bucket ...
    controller.watch_lookup(plain, [], [2], greedy=True)
    for key in ((Choice.LOOKUP, True, 4), (Choice.LOOKUP, True, 0)):  # ... and among all lookup rounds
        count = controller._request[key]
        assert (count.accepted, count.rejected) == (2.0, 0.0)
    assert controller.acceptance(Choice.LOOKUP, True, 4) == pytest.approx(1.0)
    assert {"lookup/greedy", "lookup after 4+/greedy"} <= set(controller.snapshot()["accept_chance"])


def test_a_copy_that_has_just_begun_drafts_on_short_matches():
    """Rounds of every bucket accepted whole (the answer copies now) raise a short match's price of acceptance too:
    half its rate is lookup's over all rounds."""
    controller = measured(10.0, {2: 16.0, 5: 24.0, 9: 36.0})
    controller.begin_request()
    assert plan(controller, match=2).choice == Choice.PLAIN
    for _ in range(6):
        controller.observe(Outcome(Plan(Choice.LOOKUP, 4, 0.0, match=8), emitted=5, ms=24.0, drafts=4, accepted=4,
                                   batch_ms=24.0))
    assert plan(controller, match=2).choice == Choice.LOOKUP


def test_exit_rounds_draft_no_longer_than_the_level_allows():
    """Cheap exits that are always right would draft as long as a round may; the level's max_draft caps them."""
    controller = Controller(ExitPrior(acceptance=0.95, exit_share=1.0))
    controller.observe(Outcome(Plan(Choice.PLAIN, 0, 0.0), emitted=1, ms=10.0))
    controller.batches[Choice.EXIT].add(9, 12.0)
    controller.draft_step.add(1.0)
    assert plan(controller, lookup=0, exits=8).drafts == 8
    assert plan(controller, lookup=0, exits=3).drafts == 3
    assert plan(controller, lookup=0, exits=0).choice == Choice.PLAIN


def test_the_graph_a_plain_step_builds_again_after_a_batch_is_charged_to_drafting():
    """A plain step right after a drafting round builds its graph again: that surcharge is not a plain step's
    cost, and it makes a drafting round that barely paid a loss."""
    controller = measured(10.0, {2: 14.0})
    accept(controller, Choice.LOOKUP, 1, 2, rounds=10)  # acceptance 0.5: 14 / 1.5 = 9.3 ms a token against 10
    assert plan(controller, lookup=1, limit=1).choice == Choice.LOOKUP
    lookup = Plan(Choice.LOOKUP, 1, 9.3)
    for _ in range(3):
        controller.observe(Outcome(lookup, emitted=1, ms=14.0, drafts=1, accepted=0, batch_ms=14.0))
        controller.observe(Outcome(Plan(Choice.PLAIN, 0, 10.0), emitted=1, ms=12.0))  # 2 ms to build its graph
        controller.observe(Outcome(Plan(Choice.PLAIN, 0, 10.0), emitted=1, ms=10.0))
    assert controller.plain.value == 10.0 and controller.regraph.value == pytest.approx(2.0)
    assert plan(controller, lookup=1, limit=1).choice == Choice.PLAIN  # (14 + 2) / 1.5 = 10.7 ms a token


def test_batches_are_priced_by_the_kind_of_round_that_ran_them():
    """An exit round's batch also keeps its rows for the next draft: lookup rounds are priced by lookup batches,
    exit rounds by exit batches, each by the other's until it has its own."""
    controller = measured(10.0, {4: 12.0})
    assert controller._batches(Choice.EXIT) is controller.batches[Choice.LOOKUP]  # none of its own yet
    controller.batches[Choice.EXIT].add(4, 30.0)
    assert controller._batches(Choice.EXIT).curve(3, 10.0)[3] > controller._batches(Choice.LOOKUP).curve(3, 10.0)[3]


UNPATCHED = {name: getattr(Controller, name) for name in ("_best", "_settled_plain", "_prices")}


def replay_against_fresh_pricing(monkeypatch, plain_ms, exits: int = 2,
                                 measured: dict[int, float] | None = None) -> tuple[list[bool], dict[str, int], set]:
    """Two controllers fed the same rounds, one always pricing afresh, must plan every round alike. Lookup offers 0-8
    drafts after matches of every length; at first a batch of r rows costs 19 + 2 (r - 2) ms and a draft is right
    30 % of the time (drafting loses), then drafts turn right 85 % of the time, then batches get cheap
    (11 + (r - 2) ms): a price kept past either change would keep plain decoding where drafting now pays.
    plain_ms(rng): a plain step's time; `measured`: lookup batches both controllers have measured before the first
    round. Returns, for the reusing one, whether each round it asked _settled_plain took the short path, and the
    prices each computed (reusing, fresh); and the choices taken."""
    rng = random.Random(3)
    reusing, fresh = Controller(), Controller()
    for controller in (reusing, fresh):
        for rows, ms in (measured or {}).items():
            controller.batches[Choice.LOOKUP].add(rows, ms)
    best = UNPATCHED["_best"]
    monkeypatch.setattr(fresh, "_best", lambda choice, m, greedy, match=0, reuse=False: best(fresh, choice, m, greedy,
                                                                                             match, reuse=False))
    monkeypatch.setattr(fresh, "_settled_plain", lambda *args: None)
    monkeypatch.setattr(fresh, "_priced_alike", lambda *args: False)
    settled_plain = UNPATCHED["_settled_plain"]
    settled = []

    def counted_settled(self, *args):
        plan = settled_plain(self, *args)
        settled.append(plan is not None)
        return plan

    monkeypatch.setattr(reusing, "_settled_plain", lambda *args: counted_settled(reusing, *args))
    computed = {id(reusing): 0, id(fresh): 0}
    prices = UNPATCHED["_prices"]

    def counted(self, *args):
        computed[id(self)] += 1
        return prices(self, *args)

    monkeypatch.setattr(Controller, "_prices", counted)
    chosen_kinds = set()
    for request in range(6):
        reusing.begin_request(), fresh.begin_request()
        p_right = 0.3 if request < 2 else 0.85
        last = 0  # the text's token k is k; a wrong draft is -1
        while last < 150:
            lookup = rng.choice([0, 1, 2, 3, 8])
            match = rng.choice([1, 2, 4, 8]) if lookup else 0
            right = 0
            while right < lookup and rng.random() < p_right:
                right += 1
            offered = [last + 1 + j if j < right else -1 for j in range(lookup)]
            plans = [plan(c, lookup=lookup, match=match, exits=exits) for c in (reusing, fresh)]
            assert plans[0] == plans[1], (request, last)
            chosen = plans[0]
            chosen_kinds.add(chosen.choice)
            if chosen.choice == Choice.PLAIN:
                outcome = Outcome(chosen, emitted=1, ms=plain_ms(rng))
            else:
                accepted = min(right, chosen.drafts) if chosen.choice == Choice.LOOKUP else 0
                batch = (19.0 + 2.0 * (chosen.drafts - 1)) if request < 4 else (11.0 + chosen.drafts - 1)
                steps = (8.0,) * chosen.drafts if chosen.choice == Choice.EXIT else ()
                outcome = Outcome(chosen, emitted=accepted + 1, ms=batch + sum(steps), drafts=chosen.drafts,
                                  accepted=accepted, batch_ms=batch, draft_step_ms=steps)
            for c in (reusing, fresh):
                c.observe(outcome)
                c.watch_lookup(chosen, offered, list(range(last + 1, last + 1 + outcome.emitted)), greedy=True,
                               match=match)
            last += outcome.emitted
    return settled, {"reusing": computed[id(reusing)], "fresh": computed[id(fresh)]}, chosen_kinds


def test_plain_rounds_reuse_drafting_prices_and_plan_as_if_priced_afresh(monkeypatch):
    """Most rounds are plain steps: a lower bound of a drafting price, derived from a kept one, lets plain decoding
    win without computing the batch curve again (most such rounds without the rest of plan() either: _settled_plain),
    and every plan is the one pricing afresh gives. A plain step of 10 ms, exit drafts offered too."""
    settled, computed, chosen_kinds = replay_against_fresh_pricing(monkeypatch, lambda rng: 10.0)
    assert Choice.LOOKUP in chosen_kinds
    assert computed["reusing"] < 0.75 * computed["fresh"], computed
    assert sum(settled) > 0.4 * len(settled)  # plain steps found without the machinery, planned as afresh


def test_a_price_that_reads_no_plain_step_holds_while_the_plain_step_drifts(monkeypatch):
    """Batches of 2 and 9 rows measured: the batch curve reads no plain step, so a kept lookup price bounds the price
    now however a plain step's median moves (here by up to 8 % a round): the plans stay those of pricing afresh, and
    the short path takes as many rounds as where a plain step holds still."""
    replay = lambda plain_ms: replay_against_fresh_pricing(monkeypatch, plain_ms, exits=0, measured={2: 19.0, 9: 33.0})
    still, _, _ = replay(lambda rng: 10.0)
    drifting, computed, chosen_kinds = replay(lambda rng: 10.0 * rng.uniform(0.92, 1.08))
    assert Choice.LOOKUP in chosen_kinds
    assert computed["reusing"] < 0.85 * computed["fresh"], computed
    assert sum(drifting) >= 0.9 * sum(still) > 0


@pytest.mark.parametrize("choice", [Choice.LOOKUP, Choice.EXIT])
def test_the_bound_from_a_kept_price_is_never_above_the_price_computed_now(choice):
    """As acceptance rises, a kept price lowered by (a_k / a) ** max_drafts stays at or below the price computed
    afresh, for lookup and exit drafts, at any draft length; and it lets a plain step win without a new price
    where a rise leaves drafting dear."""
    rng = random.Random(7)
    for _ in range(200):
        controller = measured(10.0, {2: rng.uniform(11.0, 30.0), 5: rng.uniform(30.0, 60.0)})
        controller.begin_request()
        max_drafts, match = rng.randint(1, 8), rng.choice([0, 1, 2, 4, 8]) if choice == Choice.LOOKUP else 0
        accept(controller, choice, rng.randint(0, 2), 3, rounds=rng.randint(1, 4), match=match)
        controller._best(choice, max_drafts, True, match)  # kept
        kept = controller._kept_prices[(choice, True, match)]
        accept(controller, choice, 3, 3, rounds=rng.randint(1, 3), match=match)  # acceptance rises
        bound = controller._bound(kept, choice, max_drafts, True, match)
        assert controller._held_acceptance(choice, True, match) > kept.acceptance
        assert bound is not None and bound <= controller._best(choice, max_drafts, True, match)[1] + 1e-12
    # 2-row batches at 40 ms against a 10 ms step: drafting stays far dearer after a small rise, and the short path
    # keeps decoding plainly
    controller = measured(10.0, {2: 40.0, 5: 100.0})
    controller.begin_request()
    accept(controller, Choice.LOOKUP, 1, 3, rounds=4)
    assert plan(controller, lookup=4, match=0).choice == Choice.PLAIN
    accept(controller, Choice.LOOKUP, 2, 3, rounds=1)
    assert controller._settled_plain({Choice.PLAIN: 0, Choice.LOOKUP: 4}, {Choice.LOOKUP: 0}, True) is not None


def test_a_kept_curve_gives_what_computing_it_afresh_gives():
    """Batch measurements, plain steps and lengths in a random order: every curve the kept one serves equals the
    curve a BatchCosts without it computes from the same measurements, the plain step's row included."""
    rng = random.Random(11)
    costs = BatchCosts()
    for _ in range(500):
        if rng.random() < 0.2:
            costs.add(rng.randint(2, 9), rng.uniform(10.0, 40.0))
        plain_ms, max_rows = rng.choice([10.0, 10.4, 9.7]), rng.randint(1, 9)
        afresh = BatchCosts(by_rows=costs.by_rows, version=costs.version)
        assert costs.curve(max_rows, plain_ms) == afresh.curve(max_rows, plain_ms)


def test_prices_kept_for_a_long_round_serve_rounds_offered_fewer_drafts(monkeypatch):
    """A price does not depend on how many drafts a round was offered: once a round offered 8 drafts was priced,
    rounds offered 1-7 (same bucket, nothing measured since) are planned from the kept prices, none computed again;
    and what they plan is what pricing each afresh plans."""
    controller = measured(10.0, {2: 40.0, 5: 100.0})
    controller.begin_request()
    assert plan(controller, lookup=8, match=4).choice == Choice.PLAIN
    computed = []
    monkeypatch.setattr(Controller, "_prices", lambda self, *args: computed.append(args))
    for drafts in range(1, 8):
        assert controller._settled_plain({Choice.PLAIN: 0, Choice.LOOKUP: drafts}, {Choice.LOOKUP: 4}, True) is not None
        assert plan(controller, lookup=drafts, match=4).choice == Choice.PLAIN
    assert computed == []


@pytest.mark.parametrize("choice", [Choice.LOOKUP, Choice.EXIT])
def test_the_best_round_read_from_kept_prices_is_the_cheapest_computed_now(choice):
    """Kept prices computed for the longest length asked, read at any shorter one (afresh: reuse off), give the
    draft length and price that min() over the prices of that length alone gives: the shortest of equal prices."""
    rng = random.Random(5)
    for _ in range(200):
        controller = measured(10.0, {2: rng.uniform(11.0, 30.0), 5: rng.uniform(30.0, 60.0)})
        controller.begin_request()
        match = rng.choice([0, 1, 2, 4, 8]) if choice == Choice.LOOKUP else 0
        accept(controller, choice, rng.randint(0, 3), 3, rounds=rng.randint(1, 4), match=match)
        controller._best(choice, 8, True, match)
        drafts = rng.randint(1, 8)
        prices = controller._prices(choice, drafts, controller._held_acceptance(choice, True, match))
        cheapest = min(range(len(prices)), key=prices.__getitem__)
        assert controller._best(choice, drafts, True, match) == (cheapest, prices[cheapest])


def test_a_recent_cost_is_the_median_of_its_window():
    """RecentCost's median, written out, against statistics.median over the same last COST_WINDOW measurements (odd and
    even counts)."""
    import statistics

    from specee_edge.engine.controller import COST_WINDOW, RecentCost

    rng = random.Random(2)
    cost, seen = RecentCost(), []
    for _ in range(40):
        seen.append(rng.choice([rng.uniform(5.0, 50.0), 10.0]))
        cost.add(seen[-1])
        assert cost.value == statistics.median(seen[-COST_WINDOW:])


def controller_state(controller: Controller) -> tuple:
    """What a controller has learnt and will plan from (its caches of prices left out)."""
    costs = lambda cost: (list(cost.recent), cost.value, cost.measured_at)
    counts = lambda table: {key: (c.accepted, c.rejected) for key, c in table.items()}
    return (costs(controller.plain), costs(controller.regraph), controller._rounds, controller._explore_budget,
            controller._waited, controller._wait, counts(controller._request), counts(controller._lifetime),
            controller._shadow, controller._shadow_matched, controller._shadow_bucket, controller._graph_changed)


@pytest.mark.parametrize("seed", range(4))
def test_a_plain_streak_leaves_the_controller_where_planning_every_round_would(seed):
    """Twin controllers with the same past: one plans every round (plan, observe_plain, watch_lookup), the other grants a
    plain streak, checks each round's lookup offer against it, tells the shadow rounds as they run and the rest when the
    streak ends. Each round the streak keeps, plan() chose plain without exploring, and the two end alike. Batches of
    two rows and more are measured (the prices read no plain step); steps cost up to 15 % more than the median, past the
    streak's ceiling; exit drafts sometimes; acceptance moving with the shadows."""
    from copy import deepcopy

    from specee_edge.engine.controller import STREAK_PLAN

    rng = random.Random(seed)
    granted = kept = ended_by_offer = 0
    for _ in range(150):
        streaking = measured(10.0, {2: rng.uniform(11.0, 30.0), 3: rng.uniform(13.0, 40.0), 5: rng.uniform(20.0, 60.0)})
        exits = rng.choice([0, 0, 3])
        if exits:
            streaking.observe(Outcome(Plan(Choice.EXIT, 2, 0.0), emitted=2, ms=30.0, drafts=2, accepted=1,
                                      batch_ms=rng.uniform(12.0, 40.0), draft_step_ms=(8.0, 8.0)))
            streaking.observe(Outcome(Plan(Choice.EXIT, 2, 0.0), emitted=1, ms=12.0, full_step_ms=12.0))
            streaking.observe_plain(Plan(Choice.PLAIN, 0, 0.0), 10.0)  # the step after a batch: the regraph
        streaking.begin_request()
        for bucket in (0, 1, 2, 4, 8):
            accept(streaking, Choice.LOOKUP, rng.randint(0, 3), 3, rounds=rng.randint(0, 3), match=bucket)
        streaking._waited[(Choice.LOOKUP, False)] = rng.randint(0, EXPLORE_WAIT)
        streaking._explore_budget = rng.choice([0.0, rng.uniform(0.0, 40.0), 1000.0])  # explorations unaffordable or not
        planning = deepcopy(streaking)
        streak = streaking.plain_streak(8, exits, greedy=True)
        if streak is None:
            continue
        granted += 1
        step_ms, offered = [], []
        while len(step_ms) < streak.rounds:
            limit = rng.choice([8, 8, 8, 3, 0])
            drafts = rng.randint(0, limit)
            bucket = rng.choice([1, 2, 4, 8]) if drafts else 0
            if drafts and not streak.keeps(drafts, streaking.acceptance(Choice.LOOKUP, True, bucket)):
                ended_by_offer += 1
                break
            chosen = planning.plan(lookup_drafts=drafts, exit_drafts=exits, limit=limit, greedy=True, lookup_match=bucket)
            assert chosen.choice == Choice.PLAIN and not chosen.explore
            kept += 1
            ms = planning.plain.value * rng.uniform(0.85, 1.15)
            planning.observe_plain(chosen, ms)
            tokens, emitted = [rng.randrange(3) for _ in range(drafts)], [rng.randrange(3)]
            planning.watch_lookup(chosen, tokens, emitted, True, bucket)
            streaking.watch_lookup(STREAK_PLAN, tokens, emitted, True, bucket)
            step_ms.append(ms)
            offered.append(drafts if limit else None)
            if ms > streak.ceiling_ms:
                break
        streaking.end_streak(step_ms, offered, exits > 0)
        assert controller_state(streaking) == controller_state(planning)
        following = dict(lookup_drafts=rng.randint(1, 8), exit_drafts=exits, limit=8, greedy=True, lookup_match=4)
        assert streaking.plan(**following) == planning.plan(**following)
    assert granted >= 30 and kept >= 100 and ended_by_offer >= 5, (granted, kept, ended_by_offer)


def test_no_plain_streak_where_a_price_reads_the_plain_step_or_an_exploration_is_due():
    """A streak needs drafting prices that hold while plain steps run (batches of two rows and more measured) and ends
    before an exploration could be due; where drafting at any acceptance loses, every offer is the streak's."""
    assert measured(10.0, {4: 40.0}).plain_streak(8, 0, greedy=True) is None  # one batch size: the curve reads the step
    dear = measured(10.0, {2: 100.0, 9: 400.0})
    streak = dear.plain_streak(8, 0, greedy=True)
    assert all(streak.keeps(drafts, 1.0) for drafts in range(9))
    # an exploration of 2 rows costs 100 - 10 ms beyond the step; the budget grows by 2 % of each step (11 ms at most)
    assert streak.rounds == math.ceil((100.0 - 11.0 - dear._explore_budget) / (EXPLORE_SHARE * 11.0))
    dear._explore_budget = 1000.0  # every exploration affordable: the streak ends where lookup's turn comes
    assert dear.plain_streak(8, 0, greedy=True).rounds == EXPLORE_WAIT - 1
    dear._waited[(Choice.LOOKUP, False)] = EXPLORE_WAIT - 1
    assert dear.plain_streak(8, 0, greedy=True) is None
    cheap = measured(10.0, {2: 12.0, 9: 20.0})  # a batch about a step: drafts pay from a low acceptance on
    streak = cheap.plain_streak(8, 0, greedy=True)
    assert streak.keeps(8, 0.0) and not streak.keeps(1, 0.2) and not streak.keeps(8, 0.5)
    assert Controller(always_draft=True).plain_streak(8, 0, greedy=True) is None


def exit_round(drafts: int, step_ms: tuple[float, ...], ended_full: bool, batch_ms: float = 6.0) -> Outcome:
    """An exit round that drafted `drafts` with these drafting steps (the last ran every layer where `ended_full`)."""
    return Outcome(Plan(Choice.EXIT, drafts, 0.0), emitted=1, ms=sum(step_ms) + batch_ms, drafts=drafts,
                   batch_ms=batch_ms, draft_step_ms=step_ms, drafting_ended_full=ended_full)


def test_a_drafting_step_that_ran_every_layer_is_charged_as_a_full_step():
    """Drafting steps that exited price the next rounds' steps; the one that ran every layer (it ends the drafting) is
    a full step, and how often later steps exit weighs the ways a round may end. Steps of 2, 2, 2 ms and a full
    one of 10 were priced at 4 x 2 ms, as though the round had cost 8 ms where it cost 16."""
    controller = Controller(ExitPrior(acceptance=0.5, exit_share=0.9))
    controller.observe(Outcome(Plan(Choice.PLAIN, 0, 0.0), emitted=1, ms=10.0))
    for _ in range(5):
        controller.observe(exit_round(4, (2.0, 2.0, 2.0, 10.0), ended_full=True))
    assert controller.draft_step.value == 2.0 and controller.full_step.value == 10.0
    later = controller.later_exits.value
    assert 0.5 < later < 0.8  # 2 of every 3 later steps exited
    # by hand: a round of up to 4 drafts ends at its k-th step where that one ran every layer, or drafts all 4
    a, batch = 0.5, controller._batches(Choice.EXIT).curve(5, 10.0)
    tokens = lambda k: sum(a ** i for i in range(k + 1))
    ways = [((1 - later) * later ** (k - 2), k, (k - 1) * 2.0 + 10.0 + batch[k + 1]) for k in (2, 3, 4)]
    ways.append((later ** 3, 4, 4 * 2.0 + batch[5]))
    regraph = max(controller.regraph.value or 0.0, 0.0)
    cost = sum(p * (ms + regraph) for p, _, ms in ways)
    expected = sum(p * tokens(k) for p, k, _ in ways)
    q = controller.first_exits.value
    price = (q * cost + (1 - q) * (10.0 + regraph)) / (q * expected + 1 - q)
    assert controller._prices(Choice.EXIT, 4, a)[4] == pytest.approx(price)
    assert price > (4 * 2.0 + batch[5]) / tokens(4)  # the old price, every step at an exit's cost
    # rounds whose drafting steps all exit raise the share back
    for _ in range(20):
        controller.observe(exit_round(3, (2.0, 2.0, 2.0), ended_full=False))
    assert controller.later_exits.value > 0.9 and controller.draft_step.value == 2.0


def test_the_graph_a_plain_step_builds_again_after_probing_steps_is_charged_to_exit_rounds():
    """An exit round whose first step ran every layer drafted nothing, but its step ran the probing graph: the plain
    step after it builds its graph again, which is the exit round's cost, not a plain step's."""
    controller = Controller(ExitPrior(acceptance=0.5, exit_share=0.5))
    controller.observe(Outcome(Plan(Choice.PLAIN, 0, 0.0), emitted=1, ms=10.0))
    for _ in range(3):
        controller.observe(Outcome(Plan(Choice.EXIT, 2, 0.0), emitted=1, ms=11.0, full_step_ms=11.0))
        controller.observe(Outcome(Plan(Choice.PLAIN, 0, 10.0), emitted=1, ms=13.0))  # 3 ms to build its graph
        controller.observe(Outcome(Plan(Choice.PLAIN, 0, 10.0), emitted=1, ms=10.0))
    assert controller.plain.value == 10.0 and controller.regraph.value == pytest.approx(3.0)
    assert controller._round_costs(Choice.EXIT, 1, [0.0, 10.0, 14.0])[1].not_drafting == pytest.approx(11.0 + 3.0)


def split_controller(split_layer: int | None, steps: list[tuple[int, float]], rounds: int = 4) -> Controller:
    """A controller (split at `split_layer`, None: one device) that has seen a plain step of 10 ms and, `rounds`
    times over, an exit round per (exit layer, ms) of `steps`: two drafts, both accepted, both drafting steps
    exiting at that layer at that cost, then a plain step."""
    controller = Controller(ExitPrior(acceptance=0.8, exit_share=0.9), split_layer=split_layer)
    controller.observe(Outcome(Plan(Choice.PLAIN, 0, 0.0), emitted=1, ms=10.0))
    for _ in range(rounds):
        for layer, ms in steps:
            controller.observe(Outcome(Plan(Choice.EXIT, 2, 0.0), emitted=3, ms=2 * ms + 14.0, drafts=2, accepted=2,
                                       batch_ms=14.0, draft_step_ms=(ms, ms), draft_exit_layers=(layer, layer)))
            controller.observe(Outcome(Plan(Choice.PLAIN, 0, 0.0), emitted=1, ms=10.0))
    return controller


def test_a_split_models_drafting_steps_are_priced_per_side_not_by_one_median():
    """Three of every five drafting steps exit before the split at 1 ms, two past it at 20 ms (the CPU's layers after
    the GPU's): the median of the last five steps is 1 ms, which prices exit rounds far below a plain step. Priced per
    side, the two are weighed by the share of exits past the split, about 8 ms a step, and plain decoding wins."""
    steps = [(4, 1.0), (20, 20.0), (4, 1.0), (20, 20.0), (4, 1.0)]
    one, split = split_controller(None, steps), split_controller(10, steps)
    assert one.draft_step.value == 1.0 and plan(one, lookup=0, exits=8).choice == Choice.EXIT
    share = split.past_split.value
    assert 0.3 < share < 0.5 and (split.draft_step.value, split.draft_step_past.value) == (1.0, 20.0)
    assert split._exit_step_ms()[0] == pytest.approx(1.0 + share * 19.0)
    assert plan(split, lookup=0, exits=8).choice == Choice.PLAIN
    assert split.snapshot()["draft_step_ms_by_side"] == [1.0, 20.0]


@pytest.mark.parametrize("layer", [4, 20])
def test_drafting_steps_all_on_one_side_of_a_split_are_priced_as_on_one_device(layer):
    steps = [(layer, 3.0), (layer, 1.0), (layer, 2.0)]
    one, split = split_controller(None, steps), split_controller(10, steps)
    assert split._exit_step_ms() == one._exit_step_ms()
    assert split._prices(Choice.EXIT, 8, 0.8) == one._prices(Choice.EXIT, 8, 0.8)
    assert plan(split, lookup=0, exits=8) == plan(one, lookup=0, exits=8)
