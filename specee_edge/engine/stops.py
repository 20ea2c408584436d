"""Stop strings in streamed text: hold back what could still become a stop string.

Each stop string is matched by position, one character at a time (Knuth-Morris-Pratt): a token costs
time in its own length times the number of stops, however long the stops are.
"""

from __future__ import annotations

from collections.abc import Sequence

from specee_edge.errors import SpecEEError

# bounds on what a caller's stops allocate (a failure table per stop) and cost per character (the stops' count)
MAX_STOPS = 64
MAX_STOP_CHARS = 1024


def _failure(pattern: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of pattern[:i + 1] that is also its suffix."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise SpecEEError(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters")
        self.stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # how much of each stop the text ends with
        self._held = ""  # the text not shown yet: as long as the longest partial match

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to show now, whether a stop string was reached; the stop string itself is dropped)."""
        if not self.stops:  # most requests have none: no character to match
            return text, False
        held = self._held + text
        start = len(self._held)
        for i, char in enumerate(text, start):
            found = 0  # the longest stop string ending at this character: the one that starts first
            for j, stop in enumerate(self.stops):
                k = self._matched[j]
                while k and stop[k] != char:
                    k = self._fail[j][k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop):
                    found, k = max(found, k), self._fail[j][k - 1]
                self._matched[j] = k
            if found:
                self._held, self._matched = "", [0] * len(self.stops)
                return held[: i + 1 - found], True
        keep = max(self._matched, default=0)
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        self._matched = [0] * len(self.stops)
        return held
