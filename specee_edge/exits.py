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
