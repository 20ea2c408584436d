"""The ways a token can leave the network early, as the runtime, the packs and the exit rule name them.

The values are llama_specee_exit_kind's (patches/src/llama-specee.h).
"""

from __future__ import annotations

from enum import IntEnum


class ExitKind(IntEnum):
    NONE = 0       # the layer never exits
    VERIFIED = 1   # the exit head (the full LM head at the layer) runs; its top-1 must be a candidate
    HEAD_FREE = 2  # the candidates' logits are the step's: no full-vocabulary head runs

    @property
    def label(self) -> str:
        return {ExitKind.NONE: "off", ExitKind.VERIFIED: "verified", ExitKind.HEAD_FREE: "head-free"}[self]


# Exit depths are shown in four bands, by the share of the network a token ran: up to a half, two thirds,
# five sixths, and the rest. The terminal and the server's page each give the bands their own colours.
DEPTH_BAND_SHARES: tuple[float, ...] = (0.5, 0.67, 0.83, 1.0)


def depth_band(exit_layer: int, n_layer: int) -> int:
    """The band of a token that left after `exit_layer` (the last layer, head-free, is in the last band)."""
    share = exit_layer / max(1, n_layer - 1)
    return next((band for band, limit in enumerate(DEPTH_BAND_SHARES) if share <= limit), len(DEPTH_BAND_SHARES) - 1)


def depth_bands(n_layer: int) -> list[tuple[int, int, int]]:
    """(first layer, last layer, band) of each band that has layers below the last one."""
    last = n_layer - 1
    bands = []
    low = 0
    for band, limit in enumerate(DEPTH_BAND_SHARES):
        high = min(int(limit * last), last - 1)
        if high >= low:
            bands.append((low, high, band))
        low = high + 1
    return bands
