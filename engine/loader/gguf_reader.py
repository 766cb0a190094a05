"""A GGUF file's header, read straight from its memory mapping.

``gguf.GGUFReader`` keeps several numpy views for every value of the header (each of a vocabulary's
tokens and merges): about 160 MB of small objects for the default model's 49,152-token vocabulary
while the file is open, and once they are freed, 25 MB of the interpreter's object arenas stay
resident, pinned by what the loader allocated meanwhile. Here the metadata is parsed on demand into
plain Python values (one ``str`` per token, as ``ReaderField.contents()`` gives them) and the reader
keeps only the tensors' descriptions, with their data as views of the copy-on-write mapping.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = 0x46554747  # "GGUF", little-endian
_DEFAULT_ALIGNMENT = 32
_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# GGML types whose data is typed elements; every other type's is rows of blocks (uint8)
_ELEMENT_TYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GgufTensor:
    """One tensor, with the fields of ``gguf.ReaderTensor`` that the loader reads."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    """GGUF's order: the innermost (row) dimension first."""
    n_bytes: int
    data_offset: int
    """Byte offset of the data in the file."""
    data: np.ndarray
    """A view of the mapping: typed elements in PyTorch's order for float and integer types, else
    uint8 rows of blocks (gguf's ``quant_shape_to_byte_shape``)."""


class _Cursor:
    """Reads little-endian values from a buffer, front to back."""

    def __init__(self, buffer: Any, offset: int = 0) -> None:
        self.buffer, self.offset = buffer, offset

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        start, self.offset = self.offset, self.offset + size
        return str(self.buffer[start : self.offset], encoding="utf-8")

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            return self.scalar(_SCALARS[kind])
        item, count = GGUFValueType(self.scalar("<I")), self.scalar("<Q")
        if item in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            return [self.value(item) for _ in range(count)]
        dtype = np.dtype(_SCALARS[item])
        values = np.frombuffer(self.buffer, dtype, count, self.offset)
        self.offset += count * dtype.itemsize
        return values.tolist()


class GgufFile:
    """A GGUF file mapped copy-on-write (``mode="c"``: writable views, the file never written) or
    read-only (``"r"``): :attr:`tensors` now, :meth:`metadata` when asked."""

    def __init__(self, path: str | Path, mode: Literal["r", "c"] = "c") -> None:
        self.data: np.memmap = np.memmap(path, dtype=np.uint8, mode=mode)
        self._mapped = self.data.data  # a memoryview of the mapping: the header is parsed from it
        cursor = _Cursor(self._mapped)
        if cursor.scalar("<I") != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        self.version = cursor.scalar("<I")
        if self.version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {self.version} (or byte order) is not supported")
        num_tensors, num_values = cursor.scalar("<Q"), cursor.scalar("<Q")
        self._metadata_offset, alignment = cursor.offset, _DEFAULT_ALIGNMENT
        for _ in range(num_values):
            key, kind = cursor.string(), GGUFValueType(cursor.scalar("<I"))
            if key == "general.alignment":
                alignment = cursor.value(kind)
            else:
                _skip(cursor, kind)
        infos = []
        for _ in range(num_tensors):
            name, dims = cursor.string(), cursor.scalar("<I")
            shape = tuple(cursor.scalar("<Q") for _ in range(dims))
            infos.append((name, shape, GGMLQuantizationType(cursor.scalar("<I")), cursor.scalar("<Q")))
        start = -(-cursor.offset // alignment) * alignment
        self.num_values = num_values
        self.tensors = [self._tensor(name, shape, kind, start + at) for name, shape, kind, at in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError(f"{path} names a tensor twice")

    def metadata(self) -> dict[str, Any]:
        """Every key/value of the header as Python values, as ``ReaderField.contents()`` gives them
        (strings, numbers, lists), plus gguf's ``GGUF.version`` / ``tensor_count`` / ``kv_count``."""
        cursor = _Cursor(self._mapped, self._metadata_offset)
        out: dict[str, Any] = {
            "GGUF.version": self.version,
            "GGUF.tensor_count": len(self.tensors),
            "GGUF.kv_count": self.num_values,
        }
        for _ in range(self.num_values):
            key = cursor.string()
            out[key] = cursor.value(GGUFValueType(cursor.scalar("<I")))
        return out

    def _tensor(
        self, name: str, shape: tuple[int, ...], kind: GGMLQuantizationType, offset: int
    ) -> GgufTensor:
        elements = int(np.prod(shape))
        block_elements, block_bytes = GGML_QUANT_SIZES[kind]
        n_bytes = elements * block_bytes // block_elements
        dims = tuple(reversed(shape))
        view = self.data[offset : offset + n_bytes]
        if view.size != n_bytes:
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        if kind in _ELEMENT_TYPES:
            data = view.view(_ELEMENT_TYPES[kind]).reshape(dims)
        else:
            data = view.reshape(quant_shape_to_byte_shape(dims, kind))
        return GgufTensor(name, kind, shape, n_bytes, offset, data)


def _skip(cursor: _Cursor, kind: GGUFValueType) -> None:
    """Past one value without building it (the vocabulary's strings are read only by ``metadata``)."""
    if kind == GGUFValueType.STRING:
        size = cursor.scalar("<Q")  # read first: it moves the cursor
        cursor.offset += size
    elif kind != GGUFValueType.ARRAY:
        cursor.offset += struct.calcsize(_SCALARS[kind])
    else:
        item, count = GGUFValueType(cursor.scalar("<I")), cursor.scalar("<Q")
        if item in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            for _ in range(count):
                _skip(cursor, item)
        else:
            cursor.offset += count * struct.calcsize(_SCALARS[item])
