"""The default number of CPU threads, shared by the engine, bench and calibrate."""

from __future__ import annotations

import os


def default_threads() -> int:
    """The cores, at most 8 (more rarely helps a single decode stream)."""
    return max(1, min(8, os.cpu_count() or 1))
