"""Exceptions with one-line messages meant for users."""


class SpecEEError(RuntimeError):
    """Base class: the message is a complete, user-facing sentence."""


# What to run where llama_cpp is missing or is the stock build: the command builds the patched one.
SETUP_HINT = "run `specee-edge setup` (CMAKE_ARGS=\"-DGGML_CUDA=on\" before it for a CUDA build, as for llama-cpp-python)"


class RuntimeMissingError(SpecEEError):
    """llama_cpp is not installed, or it is a build without the patches' API (the stock llama-cpp-python)."""


class ModelLoadError(SpecEEError):
    """A model file is missing, unreadable, not a GGUF, or rejected by llama.cpp."""


class UnsupportedModelError(SpecEEError):
    """The model's architecture (or the context's configuration) cannot exit early."""


class ContextFullError(SpecEEError):
    """The context window has no room for the tokens to decode."""


class DecodeCancelled(SpecEEError):
    """A decode was cancelled between its batches (the tokens decoded so far stay in the cache)."""
