"""Group-wise quantized weights as a pytree leaf type: the model's int4 weight.

`GroupwiseArray` holds a linear kernel in the format of `pallas_kernels/groupwise_matmul/
packing.py`, flattened to one contracting axis K and one output axis N:

    w[..., k, n] = q[..., k, n] * scale[..., k // g, n] + offset[..., k // g, n]

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
from pallas_kernels.groupwise_matmul.packing import dequantize


@struct.dataclass
class GroupwiseArray:
  q: jax.Array  # [lead..., K/2, N] uint8 packed per group (bits 4); [lead..., K, N] int8 (bits 8)
  scale: jax.Array  # [lead..., K/g, N] float32
  offset: jax.Array  # [lead..., K/g, N] float32
  bits: int = struct.field(pytree_node=False)
  group_size: int = struct.field(pytree_node=False)
  # [lead..., K] int32 or None: rows stored in act-order groups (a GPTQ checkpoint's desc_act),
  # stored row i being the weight's row perm[i]; the layer reads x[..., perm] against them.
  perm: jax.Array | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    """The float weight's flattened shape [lead..., K, N]."""
    *lead, g, n = self.scale.shape
    return (*lead, g * self.group_size, n)

  @property
  def nbytes(self) -> int:
    return self.q.nbytes + self.scale.nbytes + self.offset.nbytes

  def dequantize(self) -> jax.Array:
    """The float32 weight [lead..., K, N] it stands for (rows in stored order)."""
    return dequantize(self.q, self.scale, self.offset, bits=self.bits, group_size=self.group_size)

  def dequantize_columns(self, ids: jax.Array) -> jax.Array:
    """Columns `ids` [T] of the float32 weight, [K, T]: rows of a tied embedding stored as the
    head's [K=E, N=V], looked up without dequantizing the rest."""
    assert self.q.ndim == 2 and self.perm is None
    return dequantize(self.q[:, ids], self.scale[:, ids], self.offset[:, ids], bits=self.bits,
                      group_size=self.group_size)


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
