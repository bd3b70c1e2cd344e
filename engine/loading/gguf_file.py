"""A GGUF file's metadata and tensor table, read in one pass over its header.

The `gguf` package's GGUFReader keeps every element of every array field as a numpy view of its
own, with its byte offsets (for editing files in place). SmolLM2's tokenizer is two such arrays
(49,152 tokens, 48,900 merges): reading them that way took 4.7 s of every start-up on the AMX
Xeon, more than loading the weights. The engine only needs the values, so this reads them with
`struct` from a read-only map of the file (0.19 s). Tensor data stays mapped and is read
when a rank loads its slices.

Layout (GGUF v2 and v3, little-endian): magic b"GGUF", u32 version, u64 tensor count, u64
key-value count; the key-values (string key, u32 type, value); the tensor infos (string name,
u32 dims, u64 per dim, innermost first, u32 ggml type, u64 offset); padding to
`general.alignment` (default 32); the tensor data, at those offsets.
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.errors import ModelLoadError

_MAGIC = b"GGUF"
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# tensor types stored as plain numbers; every other type is blocks of bytes (quantized, bf16)
_PLAIN_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}


class _Truncated(Exception):
    pass


@dataclass(slots=True)
class GGUFTensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: innermost (a row's length) first
    tensor_type: GGMLQuantizationType
    # outermost dim first; a block-quantized (or bf16) tensor as uint8 with its rows in bytes
    data: np.ndarray


class GGUFFile:
    """`metadata`: every key's value (arrays as lists); `tensors`: name -> GGUFTensor, in the
    file's order."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = self.path.stat().st_size
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as e:
            raise ModelLoadError(f"{self.path} is not a readable GGUF file ({e})") from None
        try:
            self._offset = 0
            self._read_header()
        except _Truncated:
            raise ModelLoadError(
                f"{self.path} is not a readable GGUF file (it ends at byte {len(self._map)}, "
                f"inside its header: truncated, e.g. an interrupted download; fetch it again)"
            ) from None
        except (UnicodeDecodeError, ValueError) as e:
            raise ModelLoadError(f"{self.path} is not a readable GGUF file ({e})") from None

    def _read_header(self) -> None:
        magic = bytes(self._map[:4])
        if magic != _MAGIC:
            raise ValueError(f"it starts with {magic!r}, not {_MAGIC!r}")
        self._offset = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (a big-endian file, or not v2/v3); "
                             f"convert it again with a current llama.cpp")
        num_tensors, num_keys = self._scalar("<Q"), self._scalar("<Q")
        self.metadata = {}
        for _ in range(num_keys):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = self.metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            raise ValueError(f"general.alignment={alignment!r} is not a positive integer")
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = {}
        for name, dims, tensor_type, offset in infos:
            if name in self.tensors:
                raise ValueError(f"tensor {name!r} appears twice")
            self.tensors[name] = self._tensor(name, dims, tensor_type, data_start + offset)

    def _take(self, size: int) -> int:
        start, self._offset = self._offset, self._offset + size
        if self._offset > len(self._map):
            raise _Truncated
        return start

    def _scalar(self, fmt: str):
        return struct.unpack_from(fmt, self._map, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        length = self._scalar("<Q")
        start = self._take(length)
        return self._map[start:start + length].decode("utf-8")

    def _value(self, value_type: int):
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            return self._array()
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata value type {value_type}")
        return self._scalar(_SCALAR_FORMATS[value_type])

    def _array(self) -> list:
        item_type, count = self._scalar("<I"), self._scalar("<Q")
        if item_type in (_STRING, _ARRAY):
            return [self._value(item_type) for _ in range(count)]
        if item_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata array item type {item_type}")
        dtype = np.dtype(_SCALAR_FORMATS[item_type])
        start = self._take(count * dtype.itemsize)
        return np.frombuffer(self._map, dtype, count, start).tolist()

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
        raw_type = self._scalar("<I")
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown ggml type {raw_type}") from None
        return name, dims, tensor_type, self._scalar("<Q")

    def _tensor(self, name: str, dims: tuple[int, ...], tensor_type: GGMLQuantizationType,
                start: int) -> GGUFTensor:
        shape = tuple(reversed(dims))
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        dtype = _PLAIN_DTYPES.get(tensor_type, np.uint8)
        if dtype is np.uint8:
            if shape[-1] % block:
                raise ValueError(f"tensor {name!r}: rows of {shape[-1]} values do not fill "
                                 f"{tensor_type.name} blocks of {block}")
            shape = (*shape[:-1], shape[-1] // block * block_bytes)
        count = math.prod(shape)  # a Python int: absurd dims cannot wrap around
        if start + count * np.dtype(dtype).itemsize > len(self._map):
            raise ModelLoadError(
                f"{self.path} is not a readable GGUF file (tensor {name!r} runs past its end at "
                f"byte {len(self._map)}: truncated, e.g. an interrupted download; fetch it again)")
        return GGUFTensor(name, dims, tensor_type,
                          np.frombuffer(self._map, dtype, count, start).reshape(shape))
