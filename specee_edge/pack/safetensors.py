"""Read and write safetensors files as numpy arrays, through the `safetensors` package (no torch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from specee_edge.errors import SpecEEError


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise SpecEEError(f"cannot read safetensors file {path}: {str(e).splitlines()[0]}") from None


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    save_file({name: np.ascontiguousarray(array) for name, array in tensors.items()}, str(path))
