"""A small GGUF reader: a file's metadata and tensor infos, without its tensor data. gguf-py's
`GGUFReader` builds numpy views of every field, which takes seconds over a tokenizer's 100k
strings; this reads the same header in a fraction of one (little-endian files, GGUF v2 and v3)."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType


def _padded(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align


_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class MetaValue:
    """A metadata value with its GGUF type (and its elements' type for an array)."""

    vtype: GGUFValueType
    value: Any
    sub_type: GGUFValueType | None = None


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor's info: its name, ne (row length first), type, and absolute byte offset."""

    name: str
    ne: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int


@dataclass(frozen=True, slots=True)
class GGUFContents:
    metadata: dict[str, MetaValue]
    tensors: list[TensorEntry]
    path: Path | None = None  # the file read


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def peek_u32(self) -> int:
        return int(struct.unpack_from("<I", self.buf, self.pos)[0])

    def string(self) -> str:
        n = self.unpack("<Q")
        self.pos += n
        return self.buf[self.pos - n : self.pos].decode("utf-8")

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype != GGUFValueType.ARRAY:
            return self.unpack(_SCALARS[vtype])
        sub, n = GGUFValueType(self.unpack("<I")), self.unpack("<Q")
        if sub in _SCALARS:  # numbers in one read
            fmt = _SCALARS[sub]
            values = np.frombuffer(self.buf, np.dtype(fmt), n, self.pos).tolist()
            self.pos += n * struct.calcsize(fmt)
            return values
        return [self.value(sub) for _ in range(n)]


def read_gguf(path: str | Path) -> GGUFContents:
    """The metadata and tensor infos of a GGUF file (little-endian), without its tensor data."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf)
        if c.unpack("<I") != GGUF_MAGIC or c.unpack("<I") not in (2, 3):
            raise ValueError(f"{path} is not a little-endian GGUF v2/v3 file")
        n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
        metadata = {}
        for _ in range(n_kv):
            key, vtype = c.string(), GGUFValueType(c.unpack("<I"))
            sub = GGUFValueType(c.peek_u32()) if vtype == GGUFValueType.ARRAY else None
            metadata[key] = MetaValue(vtype, c.value(vtype), sub)
        infos = []
        for _ in range(n_tensors):
            name, n_dims = c.string(), c.unpack("<I")
            ne = tuple(c.unpack("<Q") for _ in range(n_dims))
            infos.append((name, ne, GGMLQuantizationType(c.unpack("<I")), c.unpack("<Q")))
        align = metadata["general.alignment"].value if "general.alignment" in metadata else GGUF_DEFAULT_ALIGNMENT
        start = _padded(c.pos, align)
    return GGUFContents(metadata, [TensorEntry(name, ne, t, start + off) for name, ne, t, off in infos], Path(path))
