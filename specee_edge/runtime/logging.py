"""Silence llama.cpp's log output (it writes to stderr and would garble a terminal UI)."""

from __future__ import annotations

import ctypes
import os

from llama_cpp import llama_cpp as _llama

_callback = None


def quiet_llama_logs() -> None:
    """Drop llama.cpp's logs unless SPECEE_LLAMA_LOG=1; idempotent."""
    global _callback
    if _callback is not None or os.environ.get("SPECEE_LLAMA_LOG") == "1":
        return

    @_llama.llama_log_callback
    def _drop(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        return None

    _callback = _drop
    _llama.llama_log_set(_callback, ctypes.c_void_p(0))
