"""Group-wise quantized weights as a pytree leaf type: the model's int4 weight.

`GroupwiseArray` holds a linear kernel in the format of `pallas_kernels/groupwise_matmul/
packing.py`, flattened to one contracting axis K and one output axis N:

    w[..., k, n] = q[..., k, n] * scale[..., k // g, n] + offset[..., k // g, n]

or, in the codebook form (`table` set: MXFP4, NVFP4, GGUF's IQ4_NL / IQ4_XS), 4-bit codes that
index a table of 16 values, with no offset:

    w[..., k, n] = table[..., q[..., k, n]] * scale[..., k // g, n]

Leading axes (a stacked `layers` axis, an `expert` axis) are batch axes, as in `QArray`: every
layer and expert has its own groups. The flattening drops the kernel's logical in/out axes
(`[embed, q_heads, head_dim]` becomes `[K, N]`); the layer that reads it knows its own shape
(`dequantize_like` restores it from a float kernel's shape).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jinfer.quant.qarray import QArray
from pallas_kernels.groupwise_matmul.packing import dequantize, dequantize_codebook


@struct.dataclass
class GroupwiseArray:
  q: jax.Array  # [lead..., K/2, N] uint8 packed per group (bits 4); [lead..., K, N] int8 (bits 8)
  scale: jax.Array  # [lead..., K/g, N] float32
  offset: jax.Array | None  # [lead..., K/g, N] float32; None in the codebook form
  bits: int = struct.field(pytree_node=False)
  group_size: int = struct.field(pytree_node=False)
  # [lead..., K] int32 or None: rows stored in act-order groups (a GPTQ checkpoint's desc_act),
  # stored row i being the weight's row perm[i]; the layer reads x[..., perm] against them.
  perm: jax.Array | None = None
  table: jax.Array | None = None  # [lead..., 16] float32: the codebook form's values

  @property
  def shape(self) -> tuple[int, ...]:
    """The float weight's flattened shape [lead..., K, N]."""
    *lead, g, n = self.scale.shape
    return (*lead, g * self.group_size, n)

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in (self.q, self.scale, self.offset, self.table) if a is not None)

  def dequantize(self) -> jax.Array:
    """The float32 weight [lead..., K, N] it stands for (rows in stored order)."""
    return _dequantize(self.q, self.scale, self.offset, self.table, self.bits, self.group_size)

  def dequantize_columns(self, ids: jax.Array) -> jax.Array:
    """Columns `ids` [T] of the float32 weight, [K, T]: rows of a tied embedding stored as the
    head's [K=E, N=V], looked up without dequantizing the rest."""
    assert self.q.ndim == 2 and self.perm is None
    return _dequantize(self.q[:, ids], self.scale[:, ids],
                       None if self.offset is None else self.offset[:, ids], self.table,
                       self.bits, self.group_size)

  def affine(self) -> GroupwiseArray:
    """The same weight in the affine form, exactly where the table holds integers in int8's
    range (every format here: e2m1 doubled, IQ4's table): 8-bit codes table[q], offset -0.0
    (x + -0.0 == x for every x). For kernels without the codebook form (MoE experts)."""
    if self.table is None:
      return self
    codes = dequantize_codebook(self.q, jnp.ones_like(self.scale), self.table,
                                group_size=self.group_size)  # [lead..., K, N] table values
    return GroupwiseArray(q=codes.astype(jnp.int8), scale=self.scale,
                          offset=jnp.full_like(self.scale, -0.0), bits=8,
                          group_size=self.group_size, perm=self.perm)


def _dequantize(q, scale, offset, table, bits, group_size):
  if table is not None:
    return dequantize_codebook(q, scale, table, group_size=group_size)
  return dequantize(q, scale, offset, bits=bits, group_size=group_size)


def dequantize_like(qparams, like):
  """Every `GroupwiseArray` in `qparams` back to a float32 array of the shape of the same leaf
  of `like` (the float params or their shapes), and every `QArray` stored in its weight's layout
  (an int8 embedding); other leaves as they are."""
  def restore(q, ref):
    if isinstance(q, QArray):
      w = q.dequantize()
      if w.shape != tuple(ref.shape):
        raise ValueError(f"an int8 kernel stored as {w.shape} for a weight of {ref.shape}")
      return w
    if not isinstance(q, GroupwiseArray):
      return q
    w = q.dequantize()  # [lead..., K, N], rows as stored
    if q.perm is not None:  # stored row i is row perm[i]: back in the weight's own order
      w = jnp.take_along_axis(w, jnp.argsort(q.perm, axis=-1)[..., None], axis=-2)
    assert int(np.prod(w.shape)) == int(np.prod(ref.shape)), (w.shape, ref.shape)
    return w.reshape(ref.shape)
  return jax.tree.map(restore, qparams, like, is_leaf=lambda x: isinstance(x, (GroupwiseArray, QArray)))
