"""Stop strings in streamed text: hold back what could still become a stop string."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to show now, whether a stop string was reached; the stop string itself is dropped)."""
        held = self._held + text
        for stop in self.stops:
            i = held.find(stop)
            if i >= 0:
                self._held = ""
                return held[:i], True
        keep = max((n for stop in self.stops for n in range(1, len(stop)) if held.endswith(stop[:n])), default=0)
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
