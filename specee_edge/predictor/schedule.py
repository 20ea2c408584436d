"""Which layers get a predictor for the next token (SpecEE's two-level schedule).

Offline: a fixed set of layers where exits are frequent (chosen at calibration). Online: around
each of the last `window` exit layers e, the layers e + offset. Only layers that have a predictor
are ever checked, so never the last layer.
"""

from __future__ import annotations

from collections import deque

from specee_edge.pack.format import Schedule


class OnlineSchedule:
    def __init__(self, schedule: Schedule, predictor_layers: set[int]):
        self.offline = frozenset(schedule.offline) & predictor_layers
        self.offsets = tuple(schedule.offsets)
        self.predictor_layers = frozenset(predictor_layers)
        self.recent_exits: deque[int] = deque(maxlen=schedule.window)
        self._layers = sorted(self.offline)

    def layers(self) -> list[int]:
        """The layers to check for the next token, ascending."""
        return self._layers

    def record_exit(self, layer: int | None) -> None:
        """Tell the schedule where the last token left (None: it ran every layer)."""
        if layer is None or self.recent_exits.maxlen == 0:
            return
        self.recent_exits.append(layer)
        online = {e + o for e in self.recent_exits for o in self.offsets}
        self._layers = sorted(self.offline | (online & self.predictor_layers))

    def reset(self) -> None:
        self.recent_exits.clear()
        self._layers = sorted(self.offline)
