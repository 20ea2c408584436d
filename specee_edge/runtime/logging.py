"""Silence llama.cpp's log output (it writes to stderr and would garble a terminal UI), and catch what it says
when a call fails, for the one line the user gets instead."""

from __future__ import annotations

import ctypes
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from llama_cpp import llama_cpp as _llama

_callback = None
_caught: list[str] | None = None  # while caught_messages() runs: the log lines llama.cpp writes


def quiet_llama_logs() -> None:
    """Drop llama.cpp's logs unless SPECEE_LLAMA_LOG=1; idempotent."""
    global _callback
    if _callback is not None or os.environ.get("SPECEE_LLAMA_LOG") == "1":
        return

    @_llama.llama_log_callback
    def _drop(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if _caught is not None:
            _caught.append(text.decode(errors="replace"))

    _callback = _drop
    _llama.llama_log_set(_callback, ctypes.c_void_p(0))


@contextmanager
def caught_messages() -> Iterator[list[str]]:
    """What llama.cpp says during the block, line by line: its log, and what it prints to stderr itself (some
    parsers do, as the grammar parser with its errors). The process's stderr goes to a file meanwhile, so keep the
    block to one native call."""
    global _caught
    quiet_llama_logs()
    lines: list[str] = []
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        _caught = lines
        try:
            yield lines
        finally:
            _caught = None
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            printed = sink.read().decode(errors="replace")
        lines[:0] = printed.splitlines()
