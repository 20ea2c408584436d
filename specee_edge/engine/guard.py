"""Exit guards: a lossy level's exits withheld where one wrong token is likely to cost the whole answer.

A level's promise is token agreement: at most 1 - q of its tokens differ from the full model's. Which tokens
differ matters to a task: a wrong token inside an identifier or a number, or where the exit's own candidates
nearly tie, breaks a program that one wrong word of prose would not. A guard keeps the level's exits and
thresholds and only withholds them at such tokens, which then run every layer:

- `words`: the token just emitted ends inside a word (a letter, digit or underscore), so the next may continue
  an identifier or a number; that next token is decoded with exits impossible (decided before its step, free).
- `margin`: an exit whose top two candidates' logits at the exit layer differ by less than this is undone and
  the token decoded again with exits impossible (decided after the step: the partial step is paid for nothing).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specee_edge.errors import SpecEEError

_WORD_END = re.compile(r"\w\Z")


@dataclass(frozen=True)
class ExitGuard:
    words: bool = False   # no exit for a token that follows one ending inside a word
    margin: float = 0.0   # an exit whose top-2 candidate logits differ by less is undone (0: never)

    @property
    def on(self) -> bool:
        return self.words or self.margin > 0

    @property
    def name(self) -> str:
        """How --guard spells it: words, margin2, words+margin2 ('' when off)."""
        parts = (["words"] if self.words else []) + ([f"margin{self.margin:g}"] if self.margin > 0 else [])
        return "+".join(parts)


NO_GUARD = ExitGuard()


def parse_guard(spec: str) -> ExitGuard:
    """`words`, `marginM` (M a logit difference) or both joined by `+`; `none` or '' for no guard."""
    words, margin = False, 0.0
    for part in (p.strip().lower() for p in spec.split("+")):
        if part in ("", "none"):
            continue
        if part == "words":
            words = True
        elif (match := re.fullmatch(r"margin(\d+(?:\.\d+)?)", part)) and float(match[1]) > 0:
            margin = float(match[1])
        else:
            raise SpecEEError(f"unknown exit guard {part!r}: words, marginM (M > 0, a logit difference), or both"
                              " joined by +, as words+margin2")
    return ExitGuard(words, margin)


def continues_word(piece: bytes) -> bool:
    """The token's text ends inside a word: the next token may continue an identifier or a number."""
    return bool(_WORD_END.search(piece.decode("utf-8", errors="ignore")))


def candidate_margin(logits: np.ndarray, candidates: Sequence[int]) -> float:
    """The best candidate's logit less the second's (inf with fewer than two candidates)."""
    if len(candidates) < 2:
        return float("inf")
    z = np.sort(np.asarray(logits)[list(candidates)].astype(np.float64))
    return float(z[-1] - z[-2])
