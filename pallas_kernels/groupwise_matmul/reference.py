"""Pure-jnp group-wise quantized matmul: the oracle for the other backends. Dequantizes the
whole weight to float32 and multiplies in float32, the plainest reading of the format."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.groupwise_matmul.packing import dequantize


def groupwise_matmul_reference(
    x: jax.Array,  # [M, K] float
    q: jax.Array,  # [K/2, N] uint8 (bits 4) or [K, N] int8 (bits 8)
    scale: jax.Array,  # [K/g, N] float32
    offset: jax.Array,  # [K/g, N] float32
    *,
    bits: int,
    group_size: int,
) -> jax.Array:  # [M, N] x.dtype
  w = dequantize(q, scale.astype(jnp.float32), offset.astype(jnp.float32), bits=bits,
                 group_size=group_size)  # [K, N] f32
  y = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST,
              preferred_element_type=jnp.float32)
  return y.astype(x.dtype)
