"""Group-wise quantized matmul for XLA:CPU: the weight dequantized to float32, one f32 dot."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.groupwise_matmul.packing import dequantize


def groupwise_matmul_xla(
    x: jax.Array,  # [M, K] float
    q: jax.Array,  # [K/2, N] uint8 (bits 4) or [K, N] int8 (bits 8)
    scale: jax.Array,  # [K/g, N] float32
    offset: jax.Array,  # [K/g, N] float32
    *,
    bits: int,
    group_size: int,
) -> jax.Array:  # [M, N] x.dtype
  w = dequantize(q, scale, offset, bits=bits, group_size=group_size)  # [K, N] f32
  return jnp.dot(x.astype(jnp.float32), w).astype(x.dtype)
