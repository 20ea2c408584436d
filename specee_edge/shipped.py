"""The shipped `models/` folder: the model registry (registry.json) and the packs made for known models.

The repository keeps it at its top level; a wheel carries it inside the package as specee_edge/models
(pyproject.toml maps it there). An editable install or a source checkout reads the repository's.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def shipped_dir() -> Path:
    """specee_edge/models when installed from a wheel, else the repository's models/."""
    installed = _PACKAGE / "models"
    return installed if installed.is_dir() else _PACKAGE.parent / "models"
