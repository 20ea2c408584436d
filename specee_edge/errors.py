"""Exceptions with one-line messages meant for users."""


class SpecEEError(RuntimeError):
    """Base class: the message is a complete, user-facing sentence."""


class ModelLoadError(SpecEEError):
    """A model file is missing, unreadable, not a GGUF, or rejected by llama.cpp."""


class UnsupportedModelError(SpecEEError):
    """The model's architecture (or the context's configuration) cannot exit early."""


class ContextFullError(SpecEEError):
    """The context window has no room for the tokens to decode."""


class DecodeCancelled(SpecEEError):
    """A decode was cancelled between its batches (the tokens decoded so far stay in the cache)."""
