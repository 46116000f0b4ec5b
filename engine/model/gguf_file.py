"""A GGUF file's metadata and tensors, read in one pass with `struct`.

The `gguf` package's reader builds a numpy view per value, so the tokenizer's arrays
(SmolLM2: 49,152 strings, 48,900 merges) cost it about 4 s at every start of a router or
worker. This reader walks the same layout (GGUF v2/v3, little-endian) in tens of
milliseconds and hands out tensors shaped as that reader does, so `gguf.quants.dequantize`
takes them unchanged.

Layout: magic "GGUF", version u32, tensor count u64, metadata count u64; each metadata
entry a string key, a value type u32 and the value (an array: item type u32, count u64,
items); each tensor a string name, dims u32 + u64 each, ggml type u32, offset u64 from the
data section, which starts at the next multiple of `general.alignment` (32 by default).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALARS = {  # GGUF value type -> struct format, numpy dtype
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_PLAIN_TENSOR_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
                        27: np.int64, 28: np.float64}  # ggml types stored as whole numbers


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # ggml order: the fastest-moving dimension first
    data: np.ndarray  # a read-only view of the file: typed for plain types, bytes per row for quantized


class GGUFFile:
    """`metadata`: every key with its value as Python values (strings, numbers, lists);
    `tensors`: in file order."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        self._at = 0
        if self._read(4) != _MAGIC:
            raise GGUFFormatError("not a GGUF file (bad magic)")
        version = self._unpack("<I")
        if version not in _VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 or 3; a big-endian file reads as "
                                  f"a huge number)")
        num_tensors, num_keys = self._unpack("<Q"), self._unpack("<Q")
        self.metadata: dict = {}
        for _ in range(num_keys):
            key = self._string()
            if key in self.metadata:
                raise GGUFFormatError(f"metadata key {key} appears twice")
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment must be a power of two, got {alignment!r}")
        data_start = -(-self._at // alignment) * alignment
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = [self._tensor(whole, data_start, *info) for info in infos]

    def _read(self, n: int) -> memoryview:
        end = self._at + n
        if end > len(self._buf):
            raise GGUFFormatError(f"truncated at byte {self._at} (wanted {n} more)")
        part, self._at = self._buf[self._at:end], end
        return part

    def _unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self._at + size > len(self._buf):
            raise GGUFFormatError(f"truncated at byte {self._at}")
        value, = struct.unpack_from(fmt, self._buf, self._at)
        self._at += size
        return value

    def _string(self) -> str:
        raw = self._read(self._unpack("<Q"))
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:  # llama.cpp's writers have stored invalid bytes in vocabularies
            return bytes(raw).decode("utf-8", errors="replace")

    def _value(self, value_type: int):
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type == _STRING:
                return [self._string() for _ in range(count)]
            if item_type == _ARRAY:
                return [self._value(self._unpack("<I")) for _ in range(count)]
            fmt, dtype = self._scalar(item_type)
            return np.frombuffer(self._read(count * np.dtype(dtype).itemsize), dtype=dtype).tolist()
        fmt, _ = self._scalar(value_type)
        return self._unpack(fmt)

    def _scalar(self, value_type: int):
        try:
            return _SCALARS[value_type]
        except KeyError:
            raise GGUFFormatError(f"unknown value type {value_type} at byte {self._at}") from None

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
        return name, dims, self._unpack("<I"), self._unpack("<Q")

    def _tensor(self, whole: np.ndarray, data_start: int, name: str, dims: tuple[int, ...], ggml_type: int,
                offset: int) -> GGUFTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name}: unknown ggml type {ggml_type}") from None
        rows = tuple(reversed(dims))  # numpy order: the slowest-moving dimension first
        num_elements = int(np.prod(dims, dtype=np.int64))
        dtype = _PLAIN_TENSOR_DTYPES.get(ggml_type)
        if dtype is None:
            if rows and rows[-1] % block_size:
                raise GGUFFormatError(f"tensor {name}: rows of {rows[-1]} are not whole {qtype.name} blocks "
                                      f"of {block_size}")
            shape, num_bytes = (*rows[:-1], rows[-1] // block_size * type_size), num_elements // block_size * type_size
        else:
            shape, num_bytes = rows, num_elements * np.dtype(dtype).itemsize
        start = data_start + offset
        if start + num_bytes > whole.size:
            raise GGUFFormatError(f"tensor {name}: its {num_bytes} bytes at {start} run past the file's end")
        raw = whole[start:start + num_bytes]
        return GGUFTensor(name, qtype, dims, (raw if dtype is None else raw.view(dtype)).reshape(shape))
