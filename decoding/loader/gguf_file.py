"""A GGUF file's header read in a fraction of a second; its tensors as views of one memory map.

gguf-py's ``GGUFReader`` builds a numpy view (several, with their Python objects)
for every metadata item: a 151k-token vocabulary and its 151k merges cost ~25 s
and ~0.5 GB before a model can even say its config. Nothing here reads those
arrays again (transformers converts the tokenizer from the file itself, once, and
it is cached), so this reader walks over them without building anything: string
arrays by their length prefixes, numeric arrays by their size. Scalars and short
arrays become plain Python values. The tensors are views of a single read-only
``np.memmap`` of the file, shaped and typed exactly as ``ReaderTensor.data`` is
(the dequantiser and the integer kernels take them as they are).

Only little-endian GGUF v2/v3 is read (what llama.cpp writes on every machine we
run on); anything else, and a truncated or corrupt file, is a ``ModelLoadError``
naming the file and the byte where reading stopped.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from decoding.errors import ModelLoadError

SUPPORTED_VERSIONS = (2, 3)
#: Arrays with more items than this (the vocabulary's tokens, scores, types and merges) are
#: skipped; ``GGUFFile.field`` answers its default for them.
KEEP_ARRAYS_UP_TO = 4096
_MAX_NESTING = 8  # arrays of arrays deeper than this are corruption, not metadata

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_V = GGUFValueType
# Scalar value types: (struct format, numpy dtype for arrays of them).
_SCALARS: dict[GGUFValueType, tuple[struct.Struct, np.dtype]] = {
    t: (struct.Struct("<" + c), np.dtype("<" + d)) for t, c, d in (
        (_V.UINT8, "B", "u1"), (_V.INT8, "b", "i1"), (_V.UINT16, "H", "u2"), (_V.INT16, "h", "i2"),
        (_V.UINT32, "I", "u4"), (_V.INT32, "i", "i4"), (_V.FLOAT32, "f", "f4"), (_V.UINT64, "Q", "u8"),
        (_V.INT64, "q", "i8"), (_V.FLOAT64, "d", "f8"), (_V.BOOL, "?", "?"))
}
# Tensor types stored as plain elements (gguf-py gives these their element dtype; every other
# type is quantised blocks, given as uint8 rows of bytes).
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class _Skipped:
    """An array too long to keep (a sentinel distinct from every value a file can hold)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<skipped>"


SKIPPED = _Skipped()


class _Corrupt(Exception):
    """Raised inside the parser; turned into a ModelLoadError naming the file and the offset."""


@dataclass(frozen=True, eq=False)
class TensorInfo:
    """One tensor as the header describes it, with its bytes mapped (no copy).

    The attribute names are ``gguf.ReaderTensor``'s, so code written against either reads both.
    ``shape`` is in GGUF order (the row length first); ``data`` is shaped the numpy way.
    """

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute, in the file
    data: np.ndarray = field(repr=False)


try:  # Linux and the BSDs: hand a mapping's read pages back (GGUFFile.release_pages)
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):
    _madvise = None


class GGUFFile:
    """A parsed GGUF header and its tensors (one memory map of the file, opened read-only)."""

    def __init__(self, path: str | Path, keep_arrays_up_to: int = KEEP_ARRAYS_UP_TO):
        self.path = Path(path)
        self._keep = keep_arrays_up_to
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
            raise ModelLoadError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        self._buf = memoryview(self._map)
        self._size = len(self._map)
        self._pos = 0
        try:
            self._parse()
        except _Corrupt as exc:
            raise ModelLoadError(f"{self.path}: not a readable GGUF file ({exc})") from None
        except (struct.error, ValueError, IndexError, UnicodeDecodeError, OverflowError) as exc:
            raise ModelLoadError(f"{self.path}: not a readable GGUF file "
                                 f"(corrupt header near byte {self._pos}: {exc})") from None
        finally:
            self._buf = None  # type: ignore[assignment]  # the tensors' views keep the map alive

    # -- what callers read --------------------------------------------------------
    def field(self, key: str, default: Any = None) -> Any:
        """One metadata value as a plain Python value (``default``: absent, or an array too long to keep)."""
        value = self.fields.get(key, default)
        return default if value is SKIPPED else value

    @property
    def skipped(self) -> frozenset[str]:
        """The keys whose arrays were too long to keep."""
        return frozenset(k for k, v in self.fields.items() if v is SKIPPED)

    def release_pages(self) -> None:
        """Drop the file's pages from this process (they stay in the page cache, and come back on the next
        read): a tensor-parallel member that has copied its share out of the file holds its share only."""
        if _madvise is not None and hasattr(mmap, "MADV_DONTNEED") and self._size:
            _madvise(ctypes.c_void_p(self._map.ctypes.data), ctypes.c_size_t(self._size), mmap.MADV_DONTNEED)

    def tensor(self, name: str) -> TensorInfo | None:
        return self._by_name.get(name)

    # -- parsing --------------------------------------------------------------------
    def _need(self, n: int) -> None:
        if n < 0 or self._pos + n > self._size:
            raise _Corrupt(f"truncated: {n} bytes wanted at byte {self._pos} of {self._size}")

    def _u32(self) -> int:
        self._need(4)
        v = _U32.unpack_from(self._buf, self._pos)[0]
        self._pos += 4
        return v

    def _u64(self) -> int:
        self._need(8)
        v = _U64.unpack_from(self._buf, self._pos)[0]
        self._pos += 8
        return v

    def _str(self) -> str:
        n = self._u64()
        self._need(n)
        s = str(self._buf[self._pos:self._pos + n], "utf-8")
        self._pos += n
        return s

    def _parse(self) -> None:
        self._need(8)
        if _U32.unpack_from(self._buf, 0)[0] != GGUF_MAGIC:
            raise _Corrupt(f"bad magic {bytes(self._buf[:4])!r}, expected b'GGUF'")
        self._pos = 4
        version = self._u32()
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in SUPPORTED_VERSIONS:
                raise _Corrupt(f"a big-endian GGUF (v{swapped}); only little-endian files are read")
            raise _Corrupt(f"GGUF version {version} (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        self.version = version
        n_tensors, n_kv = self._u64(), self._u64()
        fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        self.alignment = GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = self._str()
            if key in fields:
                raise _Corrupt(f"duplicate metadata key {key!r}")
            vtype = self._value_type()
            if key == "general.alignment":
                if vtype != _V.UINT32:
                    raise _Corrupt(f"general.alignment is a {vtype.name}, not a UINT32")
                self.alignment = self._value(vtype, 0)
                if self.alignment == 0 or self.alignment & (self.alignment - 1):
                    raise _Corrupt(f"alignment {self.alignment} is not a power of two")
                fields[key] = self.alignment
            else:
                fields[key] = self._value(vtype, 0)
        self.fields: Mapping[str, Any] = fields
        infos = [self._tensor_info() for _ in range(n_tensors)]
        self.data_offset = -(-self._pos // self.alignment) * self.alignment
        self.tensors: tuple[TensorInfo, ...] = tuple(self._tensor(*i) for i in infos)
        self._by_name = {t.name: t for t in self.tensors}
        if len(self._by_name) != len(self.tensors):
            raise _Corrupt("a tensor name appears twice")

    def _value_type(self) -> GGUFValueType:
        raw = self._u32()
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise _Corrupt(f"unknown metadata value type {raw} at byte {self._pos - 4}") from None

    def _value(self, vtype: GGUFValueType, depth: int) -> Any:
        if vtype == _V.STRING:
            return self._str()
        if vtype == _V.ARRAY:
            return self._array(depth)[0]
        fmt = _SCALARS[vtype][0]
        self._need(fmt.size)
        v = fmt.unpack_from(self._buf, self._pos)[0]
        self._pos += fmt.size
        return v

    def _array(self, depth: int) -> tuple[Any, int]:
        """(the array's items, or SKIPPED; how many scalars it holds, nested arrays counted through).

        gguf-py flattens arrays of arrays; they are kept nested here, as they were written.
        """
        if depth >= _MAX_NESTING:
            raise _Corrupt(f"arrays nested deeper than {_MAX_NESTING}")
        itype, n = self._value_type(), self._u64()
        if itype == _V.STRING:
            self._need(8 * n)  # every item has its length prefix at least: a bad count fails here
            if n <= self._keep:
                return [self._str() for _ in range(n)], n
            self._skip_strings(n)
            return SKIPPED, n
        if itype == _V.ARRAY:
            self._need(12 * n)
            items, leaves = [], 0
            for _ in range(n):
                item, count = self._array(depth + 1)
                items.append(item)
                leaves += count
            keep = leaves <= self._keep and not any(i is SKIPPED for i in items)
            return (items if keep else SKIPPED), leaves
        dtype = _SCALARS[itype][1]
        nbytes = n * dtype.itemsize
        self._need(nbytes)
        items = SKIPPED if n > self._keep else np.frombuffer(self._buf, dtype, n, self._pos).tolist()
        self._pos += nbytes
        return items, n

    def _skip_strings(self, n: int) -> None:
        """Past ``n`` length-prefixed strings, touching only their prefixes (the vocabulary: ~150k)."""
        buf, pos, unpack = self._buf, self._pos, _U64.unpack_from
        try:
            for _ in range(n):
                pos += 8 + unpack(buf, pos)[0]
        except (struct.error, OverflowError):
            raise _Corrupt(f"truncated string array (a length prefix at byte {pos} is past the end)") from None
        self._pos = pos
        self._need(0)  # the last string's bytes are in the file too

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._str()
        n_dims = self._u32()
        self._need(8 * n_dims)
        dims = struct.unpack_from(f"<{n_dims}Q", self._buf, self._pos)
        self._pos += 8 * n_dims
        return name, dims, self._u32(), self._u64()

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> TensorInfo:
        try:
            ttype = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[ttype]
        except (ValueError, KeyError):
            raise _Corrupt(f"tensor {name}: unknown type {raw_type}") from None
        n_elements = math.prod(dims)
        n_bytes = n_elements * type_size // block_size
        start = self.data_offset + offset
        if start + n_bytes > self._size:
            raise _Corrupt(f"truncated: tensor {name} ends at byte {start + n_bytes} of {self._size}")
        np_dims = tuple(reversed(dims))
        dtype = _ELEMENT_DTYPES.get(ttype)
        if dtype is None:
            dtype, np_dims = np.uint8, quant_shape_to_byte_shape(np_dims, ttype)
        data = self._map[start:start + n_bytes].view(dtype).reshape(np_dims)
        return TensorInfo(name, ttype, dims, n_elements, n_bytes, start, data)


__all__ = ["GGUFFile", "TensorInfo", "SKIPPED", "KEEP_ARRAYS_UP_TO", "SUPPORTED_VERSIONS"]
