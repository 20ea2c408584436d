"""Draft heads: propose k candidates for the next position from the current token and the last hidden state."""

from specee_edge.draft.linear import LINEAR_DRAFT_KIND, LinearDraft

__all__ = ["LINEAR_DRAFT_KIND", "LinearDraft"]
