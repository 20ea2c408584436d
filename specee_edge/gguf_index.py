"""A lean, read-only index of a GGUF file's header (versions 2 and 3).

`gguf.GGUFReader` builds numpy objects for every element of every metadata array: seconds for a
49K-token vocabulary.  This index walks the header once with `struct` over a memory map and keeps
only what is cheap: scalars and strings as Python values, numeric arrays as numpy views of the map,
string arrays as their length plus a lazy reader (`strings(key)` decodes them on request), and per
tensor its name, shape, ggml type, offset and a numpy view of its data shaped like gguf-py's.

Pure Python (gguf-py and numpy): the commands that only read files (`info`, `convert`) work where the
patched runtime is not built.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from specee_edge.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

# scalar value types: (struct code, numpy dtype code)
_SCALARS = {
    GGUFValueType.UINT8: ("B", "u1"),
    GGUFValueType.INT8: ("b", "i1"),
    GGUFValueType.UINT16: ("H", "u2"),
    GGUFValueType.INT16: ("h", "i2"),
    GGUFValueType.UINT32: ("I", "u4"),
    GGUFValueType.INT32: ("i", "i4"),
    GGUFValueType.FLOAT32: ("f", "f4"),
    GGUFValueType.BOOL: ("?", "?"),
    GGUFValueType.UINT64: ("Q", "u8"),
    GGUFValueType.INT64: ("q", "i8"),
    GGUFValueType.FLOAT64: ("d", "f8"),
}

# ggml types gguf-py exposes as numbers; every other type is exposed as raw bytes [rows..., row_bytes]
_NUMERIC_TENSORS = {
    GGMLQuantizationType.F32: "f4",
    GGMLQuantizationType.F16: "f2",
    GGMLQuantizationType.F64: "f8",
    GGMLQuantizationType.I8: "i1",
    GGMLQuantizationType.I16: "i2",
    GGMLQuantizationType.I32: "i4",
    GGMLQuantizationType.I64: "i8",
}


def check_gguf_file(path: str | os.PathLike) -> Path:
    """Fail with a one-line message unless `path` is a readable file that starts like a GGUF."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {path}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"not a GGUF file: {path}")
    return path


class _Corrupt(Exception):
    """Internal: the header is inconsistent (turned into a one-line ModelLoadError)."""


class GGUFStrings(Sequence):
    """A metadata array of strings, decoded only on request (`list(...)`, indexing, `tolist()`)."""

    __slots__ = ("_buf", "_start", "_count", "_fmt", "_offsets")

    def __init__(self, buf: memoryview, start: int, count: int, fmt: struct.Struct):
        self._buf, self._start, self._count, self._fmt = buf, start, count, fmt
        self._offsets: list[int] | None = None

    def __len__(self) -> int:
        return self._count

    def _string_offsets(self) -> list[int]:
        if self._offsets is None:
            unpack, buf, off, offsets = self._fmt.unpack_from, self._buf, self._start, []
            append = offsets.append
            for _ in range(self._count):
                append(off)
                off += 8 + unpack(buf, off)[0]
            self._offsets = offsets
        return self._offsets

    def _decode(self, off: int) -> str:
        n = self._fmt.unpack_from(self._buf, off)[0]
        return str(self._buf[off + 8 : off + 8 + n], "utf-8", errors="replace")

    def __getitem__(self, index):
        offsets = self._string_offsets()
        if isinstance(index, slice):
            return [self._decode(off) for off in offsets[index]]
        return self._decode(offsets[index])

    def __iter__(self) -> Iterator[str]:
        return (self._decode(off) for off in self._string_offsets())

    def tolist(self) -> list[str]:
        return list(self)

    def __repr__(self) -> str:
        return f"GGUFStrings(len={self._count})"


@dataclass(frozen=True)
class GGUFField:
    """One metadata key: its GGUF type (and for arrays the item type) and its value (see `GGUFIndex.value`)."""

    name: str
    type: GGUFValueType
    value: Any
    item_type: GGUFValueType | None = None  # arrays only


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """A tensor's header entry, with the same meanings as gguf-py's `ReaderTensor`.

    `shape`: uint64 dims in GGUF order (ne0, ne1, ...); `data`: a read-only view of the file's memory map,
    for F32/F16/F64/I8..I64 the numbers in reversed shape, otherwise uint8 shaped [rows..., row_bytes].
    """

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute, in the file
    data: np.ndarray


class GGUFIndex:
    """The header of a GGUF file; `fields` and `tensors` in file order, `data_offset` where tensor data starts.

    Besides the file's own keys, `fields` holds gguf-py's pseudo-keys `GGUF.version`, `GGUF.tensor_count`
    and `GGUF.kv_count`.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = check_gguf_file(path)
        try:
            self._map = np.memmap(self.path, mode="r", dtype=np.uint8)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {self.path}: {e}") from None
        self._buf = memoryview(self._map)
        self.fields: dict[str, GGUFField] = {}
        self.tensors: list[GGUFTensor] = []
        try:
            self._parse()
        except (_Corrupt, struct.error, UnicodeDecodeError, ValueError, OverflowError) as e:
            detail = str(e) if isinstance(e, _Corrupt) else f"{type(e).__name__}: {e}"
            raise ModelLoadError(f"cannot read {self.path}: corrupt or truncated GGUF ({detail})") from None
        self._by_name = {t.name: t for t in self.tensors}

    # ---------------------------------------------------------------- queries

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def value(self, key: str) -> Any:
        """A key's value, None when missing: int/float/bool/str for scalars and strings, a read-only numpy
        view for numeric arrays, a lazy `GGUFStrings` for string arrays, a list for arrays of arrays."""
        field = self.fields.get(key)
        return None if field is None else field.value

    def array_len(self, key: str) -> int | None:
        """The length of an array-valued key; None when the key is missing or not an array."""
        field = self.fields.get(key)
        return None if field is None or field.type != GGUFValueType.ARRAY else len(field.value)

    def strings(self, key: str) -> list[str] | None:
        """A string array decoded to a list (None when missing); TypeError for any other kind of value."""
        field = self.fields.get(key)
        if field is None:
            return None
        if not isinstance(field.value, GGUFStrings):
            raise TypeError(f"GGUF key {key} is not an array of strings")
        return field.value.tolist()

    def tensor(self, name: str) -> GGUFTensor | None:
        return self._by_name.get(name)

    def __repr__(self) -> str:
        return f"GGUFIndex({str(self.path)!r}, {len(self.fields)} fields, {len(self.tensors)} tensors)"

    # ---------------------------------------------------------------- parsing

    def _parse(self) -> None:
        buf, size = self._buf, len(self._buf)
        if size < 24:
            raise _Corrupt(f"{size} bytes, too short for a header")
        version = struct.unpack_from("<I", buf, 4)[0]
        e = "<"
        if version & 0xFFFF == 0:  # written with the other byte order (as gguf-py detects it)
            e = ">"
            version = struct.unpack_from(">I", buf, 4)[0]
        if version not in SUPPORTED_VERSIONS:
            raise _Corrupt(f"GGUF version {version} is not supported (only {SUPPORTED_VERSIONS})")
        self.version, self.byte_order = version, e
        self._u32, self._u64 = struct.Struct(e + "I"), struct.Struct(e + "Q")
        n_tensors, n_kv = struct.unpack_from(e + "QQ", buf, 8)
        self.fields["GGUF.version"] = GGUFField("GGUF.version", GGUFValueType.UINT32, version)
        self.fields["GGUF.tensor_count"] = GGUFField("GGUF.tensor_count", GGUFValueType.UINT64, n_tensors)
        self.fields["GGUF.kv_count"] = GGUFField("GGUF.kv_count", GGUFValueType.UINT64, n_kv)
        off = 24
        for _ in range(n_kv):
            key, off = self._string(off)
            if key in self.fields:
                raise _Corrupt(f"duplicate key {key}")
            raw_type = self._u32.unpack_from(buf, off)[0]
            off += 4
            field, off = self._field(key, raw_type, off)
            self.fields[key] = field

        infos = []
        for _ in range(n_tensors):
            name, off = self._string(off)
            n_dims = self._u32.unpack_from(buf, off)[0]
            off += 4
            dims = self._numbers(off, e + "u8", n_dims)
            off += 8 * n_dims
            raw_type, rel_offset = struct.unpack_from(e + "IQ", buf, off)
            off += 12
            infos.append((name, np.array(dims, dtype=np.uint64), raw_type, rel_offset))

        self.alignment = GGUF_DEFAULT_ALIGNMENT
        align = self.fields.get("general.alignment")
        if align is not None:
            if align.type != GGUFValueType.UINT32:
                raise _Corrupt(f"general.alignment has type {align.type.name}, not UINT32")
            if align.value == 0 or align.value & (align.value - 1):
                raise _Corrupt(f"general.alignment {align.value} is not a power of two")
            self.alignment = align.value
        self.data_offset = off + (-off % self.alignment)
        names = set()
        for info in infos:
            tensor = self._tensor(*info)
            if tensor.name in names:
                raise _Corrupt(f"duplicate tensor {tensor.name}")
            names.add(tensor.name)
            self.tensors.append(tensor)

    def _string(self, off: int) -> tuple[str, int]:
        n = self._u64.unpack_from(self._buf, off)[0]
        end = off + 8 + n
        if end > len(self._buf):
            raise _Corrupt(f"a string of {n} bytes at offset {off} runs past the end of the file")
        return str(self._buf[off + 8 : end], "utf-8"), end

    def _numbers(self, off: int, dtype: str, count: int) -> np.ndarray:
        dtype = np.dtype(dtype)
        if off + count * dtype.itemsize > len(self._buf):
            raise _Corrupt(f"{count} values of {dtype.itemsize} bytes at offset {off} run past the end of the file")
        return self._map[off : off + count * dtype.itemsize].view(dtype)

    def _field(self, key: str, raw_type: int, off: int) -> tuple[GGUFField, int]:
        value, item_type, off = self._value(raw_type, off)
        return GGUFField(key, GGUFValueType(raw_type), value, item_type), off

    def _value(self, raw_type: int, off: int) -> tuple[Any, GGUFValueType | None, int]:
        """(value, array item type, offset after it)."""
        buf, e = self._buf, self.byte_order
        try:
            gtype = GGUFValueType(raw_type)
        except ValueError:
            raise _Corrupt(f"unknown value type {raw_type} at offset {off}") from None
        if gtype == GGUFValueType.STRING:
            s, off = self._string(off)
            return s, None, off
        if gtype in _SCALARS:
            code = _SCALARS[gtype][0]
            return struct.unpack_from(e + code, buf, off)[0], None, off + struct.calcsize(code)
        # an array: item type, count, items
        raw_item, count = struct.unpack_from(e + "IQ", buf, off)
        off += 12
        try:
            item_type = GGUFValueType(raw_item)
        except ValueError:
            raise _Corrupt(f"unknown array item type {raw_item} at offset {off}") from None
        if item_type in _SCALARS:
            values = self._numbers(off, e + _SCALARS[item_type][1], count)
            return values, item_type, off + values.nbytes
        if item_type == GGUFValueType.STRING:
            start, unpack = off, self._u64.unpack_from
            for _ in range(count):  # only the lengths: hops from string to string
                off += 8 + unpack(buf, off)[0]
            if off > len(buf):
                raise _Corrupt(f"the string array at offset {start} runs past the end of the file")
            return GGUFStrings(buf, start, count, self._u64), item_type, off
        items = []  # arrays of arrays: rare and small
        for _ in range(count):
            item, _, off = self._value(raw_item, off)
            items.append(item)
        return items, item_type, off

    def _tensor(self, name: str, dims: np.ndarray, raw_type: int, rel_offset: int) -> GGUFTensor:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise _Corrupt(f"tensor {name} has unknown type {raw_type}") from None
        ne = [int(d) for d in dims]
        n_elements = math.prod(ne)
        n_bytes = n_elements * type_size // block_size
        start = self.data_offset + rel_offset
        if start + n_bytes > len(self._buf):
            raise _Corrupt(f"tensor {name} ({n_bytes} bytes at offset {start}) runs past the end of the file")
        shape = tuple(reversed(ne))
        if ggml_type in _NUMERIC_TENSORS:
            dtype = np.dtype(self.byte_order + _NUMERIC_TENSORS[ggml_type])
        else:
            dtype = np.dtype(np.uint8)
            if ne and ne[0] % block_size:
                raise _Corrupt(f"tensor {name} has rows of {ne[0]}, not a multiple of {ggml_type.name} blocks")
            shape = (*shape[:-1], shape[-1] // block_size * type_size) if shape else shape
        data = self._map[start : start + n_bytes].view(dtype).reshape(shape)
        return GGUFTensor(name, ggml_type, dims, n_elements, n_bytes, start, data)
