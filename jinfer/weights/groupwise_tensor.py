"""One weight re-encoded into the group-wise quantized format, held on the host (numpy).

The format is `pallas_kernels.groupwise_matmul.packing`'s: a weight `w [..., K, N]` (K contracts
with the input, N is the output) is `q * scale + offset` per group of `group_size` rows of K,
`q` 4-bit packed per group or int8. Checkpoint readers (`gguf_quantized`, `hf_quantized`)
produce this record without going through float weights; the model integration places it on a
device later. Packing and dequantizing call the format's own functions on the CPU backend, so
the layout has one definition. The codebook form (`table` set, no offset: w = table[q] * scale)
holds GGUF's IQ4_NL / IQ4_XS / MXFP4 / NVFP4 blocks.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.quant.groupwise import GroupwiseArray
from pallas_kernels.groupwise_matmul import packing


def _on_host(fn, *args, **kwargs) -> np.ndarray:
  """`fn` (a jnp function of the format) evaluated on the CPU backend, as numpy."""
  with jax.default_device(jax.local_devices(backend="cpu")[0]):
    return np.asarray(fn(*args, **kwargs))


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class GroupwiseTensor:
  """A weight `w [..., K, N]` in the group-wise format (see `packing`)."""
  q: np.ndarray  # bits 4: [..., K/2, N] uint8, packed per group; bits 8: [..., K, N] int8
  scale: np.ndarray  # [..., K/g, N] float32
  offset: np.ndarray | None  # [..., K/g, N] float32; None in the codebook form
  bits: int
  group_size: int
  # [..., K] row order (GPTQ's act-order): stored row i is the weight's row perm[i], so
  # x @ w == x[..., perm] @ w_stored and the caller permutes the activations. None: in order.
  perm: np.ndarray | None = None
  # [..., 16] float32: the codebook form's values, integers in int8's range (every format
  # jinfer reads), so that the codes widen exactly to 8-bit affine ones (`_as`)
  table: np.ndarray | None = None

  def __post_init__(self):
    bits, g = self.bits, self.group_size
    if bits not in packing.BITS:
      raise ValueError(f"bits must be one of {packing.BITS}, got {bits}")
    want = np.uint8 if bits == 4 else np.int8
    if self.q.dtype != want:
      raise ValueError(f"bits={bits} stores q as {np.dtype(want).name}, got {self.q.dtype}")
    *lead, rows, n = self.q.shape
    k = 2 * rows if bits == 4 else rows
    if g <= 0 or k % g or (bits == 4 and g % 2):
      raise ValueError(f"group size {g} must divide K={k} (and be even for 4 bits)")
    if self.table is not None:
      t = self.table
      if bits != 4 or self.offset is not None:
        raise ValueError("the codebook form takes 4-bit codes and no offset")
      if t.dtype != np.float32 or t.shape != (*lead, packing.CODES):
        raise ValueError(f"table must be float32 {(*lead, packing.CODES)}, got {t.dtype} "
                         f"{t.shape}")
      if not np.array_equal(t, np.clip(np.round(t), -128, 127)):
        raise ValueError("a codebook table must hold integers in int8's range")
    elif self.offset is None:
      raise ValueError("offset is needed unless a codebook table is given")
    for name in ("scale", "offset"):
      arr = getattr(self, name)
      if arr is None:
        continue
      if arr.dtype != np.float32 or arr.shape != (*lead, k // g, n):
        raise ValueError(f"{name} must be float32 {(*lead, k // g, n)}, got {arr.dtype} "
                         f"{arr.shape}")
    if self.perm is not None and self.perm.shape != (*lead, k):
      raise ValueError(f"perm must have shape {(*lead, k)}, got {self.perm.shape}")

  @classmethod
  def from_codes(cls, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, *,
                 bits: int, group_size: int, perm: np.ndarray | None = None,
                 table: np.ndarray | None = None) -> GroupwiseTensor:
    """codes [..., K, N]: integers in 0..15 (bits 4, packed here) or -128..127 (bits 8)."""
    if bits == 4:
      q = _on_host(packing.pack_int4, codes.astype(np.uint8), group_size)
    else:
      q = codes.astype(np.int8)
    return cls(q=q, scale=np.ascontiguousarray(scale, np.float32),
               offset=None if offset is None else np.ascontiguousarray(offset, np.float32),
               bits=bits, group_size=group_size, perm=perm, table=table)

  @property
  def shape(self) -> tuple[int, ...]:  # (..., K, N) of the weight
    *lead, rows, n = self.q.shape
    return (*lead, 2 * rows if self.bits == 4 else rows, n)

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in (self.q, self.scale, self.offset, self.perm, self.table)
               if a is not None)

  def codes(self) -> np.ndarray:  # [..., K, N] uint8 (bits 4) or int8, in stored row order
    return _on_host(packing.unpack_int4, self.q, self.group_size) if self.bits == 4 else self.q

  def dequantize(self) -> np.ndarray:
    """The float32 weight [..., K, N] in the checkpoint's row order (tests and fallbacks; the
    kernels read q, scale and offset)."""
    if self.table is not None:
      w = _on_host(packing.dequantize_codebook, self.q, self.scale, self.table,
                   group_size=self.group_size)
    else:
      w = _on_host(packing.dequantize, self.q, self.scale, self.offset, bits=self.bits,
                   group_size=self.group_size)
    if self.perm is None:
      return w
    inverse = np.argsort(self.perm, axis=-1)
    return np.take_along_axis(w, inverse[..., :, None], axis=-2)


  @classmethod
  def stack(cls, parts: list["GroupwiseTensor"]) -> "GroupwiseTensor":
    """Weights of one shape on a new leading axis (the layers of a stack). Parts stored in
    different forms (a GGUF file with Q4_K and Q6_K layers) meet exactly in the widest: 8 bits
    if any part has them (4-bit codes are int8 values too, with the same scale and offset), and
    the smallest group size (a group splits into smaller ones with its scale and offset).
    Codebook parts stay so when every part is (each layer keeps its table); among affine ones
    they widen to 8-bit codes, table[q] with offset -0.0, which is exact."""
    g = min(p.group_size for p in parts)
    if any(p.group_size % g for p in parts):
      raise ValueError(f"group sizes {sorted({p.group_size for p in parts})} do not nest")
    if {p.perm is None for p in parts} == {True, False}:
      raise ValueError("some parts have a row permutation and some do not")
    codebook = all(p.table is not None for p in parts)
    bits = 4 if codebook else max(8 if p.table is not None else p.bits for p in parts)
    same = [p if (p.bits, p.group_size, p.table is not None) == (bits, g, codebook)
            else p._as(bits, g) for p in parts]
    st = lambda field: None if getattr(same[0], field) is None else np.stack(
        [getattr(p, field) for p in same])
    return cls(q=st("q"), scale=st("scale"), offset=st("offset"), bits=bits, group_size=g,
               perm=st("perm"), table=st("table"))

  def _as(self, bits: int, group_size: int) -> "GroupwiseTensor":
    """The same weight, exactly, with wider codes and/or smaller groups (a codebook weight:
    8-bit affine codes)."""
    r = self.group_size // group_size
    codes = self.codes()
    offset = self.offset
    if self.table is not None and bits == 4:  # smaller groups only
      return GroupwiseTensor.from_codes(codes, np.repeat(self.scale, r, axis=-2), None, bits=4,
                                        group_size=group_size, perm=self.perm, table=self.table)
    if self.table is not None:  # table[q] * scale + -0.0 == table[q] * scale, for every value
      codes = np.take_along_axis(self.table[..., None, :],
                                 codes.reshape(*codes.shape[:-2], 1, -1).astype(np.intp),
                                 axis=-1).reshape(codes.shape)
      offset = np.full(self.scale.shape, -0.0, np.float32)
    return GroupwiseTensor.from_codes(
        codes if bits == self.bits and self.table is None else codes.astype(np.int8),
        np.repeat(self.scale, r, axis=-2), np.repeat(offset, r, axis=-2), bits=bits,
        group_size=group_size, perm=self.perm)

  def to_device(self) -> GroupwiseArray:
    """The model's weight type, on the default device."""
    on = lambda a, dtype=None: None if a is None else jnp.asarray(a, dtype)
    return GroupwiseArray(q=jnp.asarray(self.q), scale=jnp.asarray(self.scale),
                          offset=on(self.offset), bits=self.bits, group_size=self.group_size,
                          perm=on(self.perm, jnp.int32), table=on(self.table))


def concat_columns(parts: list[GroupwiseTensor], name: str) -> GroupwiseTensor:
  """Join weights along N (a fused projection such as gate_up); `name` is for the error."""
  first = parts[0]
  for p in parts[1:]:
    if (p.bits, p.group_size, p.shape[:-1]) != (first.bits, first.group_size, first.shape[:-1]):
      raise ValueError(f"{name}: parts of bits/group/shape {(first.bits, first.group_size)} "
                       f"{first.shape} and {(p.bits, p.group_size)} {p.shape} cannot be joined")
    if p.perm is not None:
      raise ValueError(f"{name}: parts with a row permutation cannot be joined")
    if (p.table is None) != (first.table is None) or (
        p.table is not None and not np.array_equal(p.table, first.table)):
      raise ValueError(f"{name}: parts with different codebook tables cannot be joined")
  cat = lambda field: None if getattr(first, field) is None else np.concatenate(
      [getattr(p, field) for p in parts], axis=-1)
  return GroupwiseTensor(q=cat("q"), scale=cat("scale"), offset=cat("offset"), bits=first.bits,
                         group_size=first.group_size, table=first.table)


class GroupwiseWeights(NamedTuple):
  """A checkpoint read into the group-wise format."""
  # HF module name (e.g. "model.layers.0.self_attn.q_proj", no ".weight") or fused HF parameter
  # name ("model.layers.0.mlp.experts.gate_up_proj") -> its weight [..., K, N]
  linears: dict[str, GroupwiseTensor]
  # every other tensor under its HF name, in HF layout: embeddings, norms, biases, float layers
  floats: dict[str, np.ndarray]
  # names in `floats` the file stored quantized, dequantized because asked to -> why
  dequantized: dict[str, str]

  def get(self, name: str) -> GroupwiseTensor | np.ndarray:
    """An HF tensor by name (`hf_layout`'s `get`): a quantized linear's `.weight` is its
    group-wise weight. KeyError for a missing one."""
    module = name.removesuffix(".weight")
    return self.linears.get(module) or self.linears.get(name) or self.floats[name]
