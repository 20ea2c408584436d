"""Read and write safetensors files with numpy alone (the format is an 8-byte length, a JSON header, raw data).

Why not the `safetensors` package: its numpy API is a few lines of what follows, and we must not need torch.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from specee_edge.errors import SpecEEError

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "F64": np.float64, "I32": np.int32, "I64": np.int64}
MAX_HEADER = 100 << 20


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    data = Path(path).read_bytes()
    try:
        (n,) = struct.unpack("<Q", data[:8])
        if n > min(MAX_HEADER, len(data) - 8):
            raise ValueError("header length beyond the file")
        header = json.loads(data[8 : 8 + n])
        base = 8 + n
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = info["dtype"]
            start, end = info["data_offsets"]
            if not 0 <= start <= end <= len(data) - base:
                raise ValueError(f"{name}: data offsets outside the file")
            raw = np.frombuffer(data, dtype=np.uint8, count=end - start, offset=base + start)
            if dtype == "BF16":  # bfloat16: the high half of a float32
                array = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif dtype in DTYPES:
                array = raw.view(DTYPES[dtype])
            else:
                raise ValueError(f"{name}: unsupported dtype {dtype}")
            tensors[name] = array.reshape(info["shape"])
        return tensors
    except (ValueError, KeyError, TypeError, struct.error, json.JSONDecodeError) as e:
        raise SpecEEError(f"cannot read safetensors file {path}: {e}") from None


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int32): "I32"}
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": names[array.dtype], "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))
