"""Pure-jnp group-wise quantized matmul: the oracle for the other backends. Dequantizes the
whole weight to float32 and multiplies in float32, the plainest reading of the format (the
codebook form's table looked up by a gather)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.groupwise_matmul.packing import dequantize, dequantize_codebook


def groupwise_matmul_reference(
    x: jax.Array,  # [M, K] float
    q: jax.Array,  # [K/2, N] uint8 (bits 4) or [K, N] int8 (bits 8)
    scale: jax.Array,  # [K/g, N] float32
    offset: jax.Array | None,  # [K/g, N] float32; None with a table
    *,
    bits: int,
    group_size: int,
    table: jax.Array | None = None,  # [16] float32: the codebook form
) -> jax.Array:  # [M, N] x.dtype
  if table is not None:
    w = dequantize_codebook(q, scale.astype(jnp.float32), table, group_size=group_size)
  else:
    w = dequantize(q, scale.astype(jnp.float32), offset.astype(jnp.float32), bits=bits,
                   group_size=group_size)  # [K, N] f32
  y = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST,
              preferred_element_type=jnp.float32)
  return y.astype(x.dtype)
