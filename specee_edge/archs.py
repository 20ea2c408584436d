"""The architectures early exit runs on, and what specee-edge must know of each, in one place.

The runtime's half of the same table is SPECEE_ARCHS in patches/src/llama-specee.cpp. Every one
of them ends in final_norm (RMS) -> LM head; they differ in what is listed here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    name: str
    # the LM head's logits are soft-capped, cap * tanh(z / cap), with cap = this GGUF key (absent or 0: none)
    softcap_key: str | None = None


ARCHS = {a.name: a for a in (
    Arch("llama"),
    Arch("qwen2"),
    Arch("qwen3"),
    Arch("gemma3", softcap_key="gemma3.final_logit_softcapping"),
)}
SUPPORTED = ", ".join(ARCHS)
