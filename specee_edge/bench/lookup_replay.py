"""Prompt lookup replayed over finished answers: what exact mode's lookup drafts would accept, on any machine.

Acceptance depends on the text, not on the hardware: replaying lookup over vanilla's own answers (greedy, or
sampled, whose tokens are draws from the same distribution exact mode draws from) counts the rounds a machine
would run if it drafted at every match. Where a batch of up to ROUND_MAX_DRAFTS + 1 rows costs about one step
(a GPU, Apple silicon), the speed-up is then the tokens over the rounds and plain steps together.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass

from specee_edge.draft.lookup import DRAFT_MATCH_N, PromptLookup, lookup_drafts
from specee_edge.pack.format import ROUND_MAX_DRAFTS
from specee_edge.engine.engine import ends_round, row_source
from specee_edge.engine.records import TokenSource


@dataclass
class LookupReplay:
    tokens: int = 0      # decode steps' tokens (each answer's first comes from the prompt pass)
    rounds: int = 0      # verification batches: positions where lookup had a match
    plain: int = 0       # positions without a match: a plain step
    drafts: int = 0
    accepted: int = 0

    def add(self, other: LookupReplay) -> None:
        for name in ("tokens", "rounds", "plain", "drafts", "accepted"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafts if self.drafts else 0.0

    @property
    def tokens_per_round(self) -> float:
        return (self.tokens - self.plain) / self.rounds if self.rounds else 0.0

    @property
    def speedup_at_unit_batch(self) -> float:
        """Tokens per unit of time where a batch costs what a plain step costs."""
        return self.tokens / (self.rounds + self.plain) if self.rounds + self.plain else 1.0

    def to_dict(self) -> dict[str, float]:
        return {"acceptance_rate": self.acceptance_rate, "tokens_per_round": self.tokens_per_round,
                "speedup_at_unit_batch": self.speedup_at_unit_batch, "rounds": self.rounds, "tokens": self.tokens}


def replay_lookup(prompt: Sequence[int], answer: Sequence[int], eog: Set[int], max_tokens: int,
                  max_drafts: int = ROUND_MAX_DRAFTS, max_n: int = DRAFT_MATCH_N) -> LookupReplay:
    """Exact mode's lookup rounds along `answer`, drafting at every match: the engine's own drafts (lookup_drafts,
    cut after an end of generation), at most `max_drafts` and, as in the engine, no more than the tokens the
    request (`max_tokens`, which the answer was decoded with) has left after the round's last one; each row's
    token judged by the engine's rules (row_source, ends_round), the answer's token being the one drawn there."""
    index = PromptLookup(max_n)
    index.extend(prompt)
    out = LookupReplay(tokens=max(len(answer) - 1, 0))
    i = 0  # answer[i] is the last emitted token, not in the index yet
    while i < len(answer) - 1:
        drafts = lookup_drafts(index, answer[i], min(max_drafts, max_tokens - 2 - i), eog).tokens
        emitted = accepted = 0
        for row, token in enumerate(answer[i + 1 : i + 2 + len(drafts)]):  # the tokens drawn at the batch's rows
            source = row_source(drafts, row, token)
            emitted += 1
            accepted += source == TokenSource.ACCEPTED
            if ends_round(source, token, eog.__contains__):
                break
        if drafts:
            out.rounds += 1
            out.drafts += len(drafts)
            out.accepted += accepted
        else:
            out.plain += 1
        index.extend(answer[i : i + emitted])
        i += emitted
    return out


def replay_by_category(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], categories: Sequence[str],
                       eog: Set[int], max_tokens: int,
                       max_n: int = DRAFT_MATCH_N) -> dict[str, dict[str, float]]:
    totals: dict[str, LookupReplay] = {}
    for prompt, answer, category in zip(prompts, answers, categories):
        totals.setdefault(category, LookupReplay()).add(replay_lookup(prompt, answer, eog, max_tokens, max_n=max_n))
    return {c: r.to_dict() for c, r in sorted(totals.items())}
