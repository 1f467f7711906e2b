"""A GGUF file's header parsed in one pass over the memory-mapped file.

gguf-py's GGUFReader builds a numpy view for every value, so a 50k-token vocabulary and its
merges take seconds to open. Here scalars come from `struct`, strings are decoded straight from
the mapped bytes, and each numeric array is one numpy view. Values and tensor data are what
GGUFReader gives (`ReaderField.types` / `.contents()`, `ReaderTensor.data`), so
`gguf.quants.dequantize` reads the tensors unchanged.
"""
from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType
from gguf import GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_V, _Q = GGUFValueType, GGMLQuantizationType
_SCALARS = {_V.UINT8: "B", _V.INT8: "b", _V.UINT16: "H", _V.INT16: "h", _V.UINT32: "I",
            _V.INT32: "i", _V.UINT64: "Q", _V.INT64: "q", _V.FLOAT32: "f", _V.FLOAT64: "d",
            _V.BOOL: "?"}
# Tensor types GGUFReader views as numbers; every other type is viewed as rows of raw blocks.
_ELEMENT_TENSORS = {_Q.F16: "f2", _Q.F32: "f4", _Q.F64: "f8", _Q.I8: "i1", _Q.I16: "i2",
                    _Q.I32: "i4", _Q.I64: "i8"}
SUPPORTED_VERSIONS = (2, 3)


class GGUFField(NamedTuple):
  """A metadata value. `types` is the value's type and, for a non-empty array, its first
  element's types (GGUFReader's ReaderField.types)."""
  types: tuple[GGUFValueType, ...]
  value: Any  # int | float | bool | str; arrays: a numpy view (numbers) or a tuple

  def contents(self) -> Any:
    """The value as Python, arrays as a new list (nested arrays flattened, as GGUFReader does)."""
    if isinstance(self.value, np.ndarray):
      return self.value.tolist()
    return list(self.value) if isinstance(self.value, tuple) else self.value


class GGUFTensor(NamedTuple):
  name: str
  tensor_type: GGMLQuantizationType
  shape: tuple[int, ...]  # GGUF order: the innermost (row) dimension first
  n_elements: int
  n_bytes: int
  data_offset: int  # from the start of the file
  # [shape reversed] of the element type for F16/F32/F64/I8..I64; block types are uint8
  # [shape reversed][:-1] + [bytes per row], the layout `gguf.quants.dequantize` takes.
  data: np.ndarray


class GGUFFile:
  """A GGUF file (versions 2 and 3, either byte order): `fields` (metadata by key, including
  GGUFReader's GGUF.version / GGUF.tensor_count / GGUF.kv_count), `tensors`, and the mapped
  bytes `data`. A truncated or corrupt file raises ValueError saying where it breaks."""

  def __init__(self, path: str):
    # [file size] uint8. A plain ndarray view of the mapping: views of an np.memmap run Python
    # code for every further view taken of them, and gguf.quants takes hundreds per tensor.
    self.data = np.memmap(path, mode="r").view(np.ndarray)
    self._buf = memoryview(self.data)
    if self.data.size < 4 or struct.unpack_from("<I", self._buf)[0] != GGUF_MAGIC:
      raise ValueError("no GGUF magic number at the start")
    if self.data.size < 24:
      raise ValueError(f"the file's {self.data.size} bytes end inside the 24-byte header")
    # A version with its low half zero was written in the other byte order (GGUFReader decides
    # it the same way), so files from big-endian hosts read too.
    self.byte_order = ">" if struct.unpack_from("<I", self._buf, 4)[0] & 0xFFFF == 0 else "<"
    (version, n_tensors, n_kv), off = self._unpack("IQQ", 4)
    if version not in SUPPORTED_VERSIONS:
      raise ValueError(f"GGUF version {version} is not supported (only "
                       f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
    self.fields: dict[str, GGUFField] = {
        "GGUF.version": GGUFField((_V.UINT32,), version),
        "GGUF.tensor_count": GGUFField((_V.UINT64,), n_tensors),
        "GGUF.kv_count": GGUFField((_V.UINT64,), n_kv)}

    for i in range(n_kv):
      where = f"metadata entry {i}"
      try:
        key, off = self._string(off)
        where = f"metadata {key!r}"
        (vtype,), off = self._unpack("I", off)
        types, value, off = self._value(off, vtype)
      except RecursionError:
        raise ValueError(f"{where}: arrays nested too deeply") from None
      except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
      if key in self.fields:
        raise ValueError(f"metadata key {key!r} appears twice")
      self.fields[key] = GGUFField(types, value)

    infos = []  # (name, dims, raw type, offset in the data section) per tensor
    for i in range(n_tensors):
      where = f"tensor info {i}"
      try:
        name, off = self._string(off)
        where = f"tensor info {name!r}"
        (n_dims,), off = self._unpack("I", off)
        dims, off = self._unpack(f"{n_dims}Q", off)
        (raw_type, rel), off = self._unpack("IQ", off)
      except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
      infos.append((name, dims, raw_type, rel))

    self.alignment = GGUF_DEFAULT_ALIGNMENT
    if (align := self.fields.get("general.alignment")) is not None:
      if align.types != (_V.UINT32,):
        raise ValueError(f"general.alignment has type {align.types[0].name}, not UINT32")
      if align.value == 0 or align.value & (align.value - 1):
        raise ValueError(f"general.alignment {align.value} is not a power of two")
      self.alignment = align.value
    self.data_offset = -(-off // self.alignment) * self.alignment
    self.tensors = self._tensors(infos)

  def _tensors(self, infos: list) -> list[GGUFTensor]:
    tensors, seen = [], set()
    for name, dims, raw_type, rel in infos:
      if name in seen:
        raise ValueError(f"tensor {name!r} appears twice")
      seen.add(name)
      try:
        qtype = GGMLQuantizationType(raw_type)
      except ValueError:
        raise ValueError(f"tensor {name!r} has unknown type {raw_type}") from None
      n_elements = math.prod(dims)
      block, block_bytes = GGML_QUANT_SIZES[qtype]
      n_bytes = n_elements * block_bytes // block
      start = self.data_offset + rel
      if start + n_bytes > self.data.size:
        raise ValueError(f"cannot read tensor {name!r} (bytes {start}..{start + n_bytes}) from "
                         f"the file's {self.data.size} bytes")
      rows = dims[::-1]
      if qtype in _ELEMENT_TENSORS:
        dtype = np.dtype(self.byte_order + _ELEMENT_TENSORS[qtype])
      elif not dims:
        raise ValueError(f"tensor {name!r} of type {qtype.name} has no dimensions")
      else:
        dtype = np.uint8
        try:
          rows = quant_shape_to_byte_shape(rows, qtype)
        except ValueError as e:
          raise ValueError(f"tensor {name!r}: {e}") from None
      data = self.data[start:start + n_bytes].view(dtype).reshape(rows)
      tensors.append(GGUFTensor(name, qtype, dims, n_elements, n_bytes, start, data))
    return tensors

  def _past_end(self, what: str) -> ValueError:
    return ValueError(f"{what} runs past the end of the file's {self.data.size} bytes")

  def _unpack(self, fmt: str, off: int) -> tuple[tuple, int]:
    s = struct.Struct(self.byte_order + fmt)
    if off + s.size > self.data.size:
      raise self._past_end("the entry")
    return s.unpack_from(self._buf, off), off + s.size

  def _string(self, off: int) -> tuple[str, int]:
    (n,), off = self._unpack("Q", off)
    if off + n > self.data.size:
      raise self._past_end(f"a {n}-byte string")
    return str(self._buf[off:off + n], "utf-8"), off + n

  def _value(self, off: int, vtype: int) -> tuple[tuple[GGUFValueType, ...], Any, int]:
    """(types, value, offset past it) of the value at `off`."""
    vtype = GGUFValueType(vtype)
    if vtype in _SCALARS:
      (value,), off = self._unpack(_SCALARS[vtype], off)
      return (vtype,), value, off
    if vtype == _V.STRING:
      value, off = self._string(off)
      return (vtype,), value, off
    (itype, n), off = self._unpack("IQ", off)
    itype = GGUFValueType(itype)
    types = (_V.ARRAY, itype) if n else (_V.ARRAY,)
    if itype in _SCALARS:
      dtype = np.dtype(self.byte_order + _SCALARS[itype])
      if off + n * dtype.itemsize > self.data.size:
        raise self._past_end(f"an array of {n} {itype.name}")
      return types, np.frombuffer(self._buf, dtype, n, off), off + n * dtype.itemsize
    if itype == _V.STRING:
      strings, off = self._strings(off, n)
      return types, strings, off
    # Arrays of arrays come flattened, as GGUFReader gives them. Each element is at least an
    # array header (12 bytes), which bounds a corrupt length before the loop trusts it.
    if off + 12 * n > self.data.size:
      raise self._past_end(f"an array of {n} arrays")
    flat = []
    for i in range(n):
      inner, value, off = self._value(off, itype)
      types = (_V.ARRAY,) + inner if i == 0 else types
      flat += value.tolist() if isinstance(value, np.ndarray) else value
    return types, tuple(flat), off

  def _strings(self, off: int, n: int) -> tuple[tuple[str, ...], int]:
    """`n` strings from `off` in one tight loop: vocabularies hold tens of thousands."""
    buf, size = self._buf, self.data.size
    if off + 8 * n > size:  # each string has at least its 8-byte length
      raise self._past_end(f"an array of {n} strings")
    length = struct.Struct(self.byte_order + "Q").unpack_from
    out = []
    for i in range(n):
      if off + 8 > size:
        raise self._past_end(f"string {i} of {n}")
      (k,) = length(buf, off)
      start, off = off + 8, off + 8 + k
      if off > size:
        raise self._past_end(f"string {i} of {n}")
      out.append(str(buf[start:off], "utf-8"))
    return tuple(out), off
