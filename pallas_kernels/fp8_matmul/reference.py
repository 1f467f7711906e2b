"""Pure-jnp float8 matmul: the oracle. Every e4m3 value is exact in float32, and so is the
product of two, so this dequantizes both operands to float32 and multiplies there."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_matmul.quantize import quantize_per_token_fp8


def fp8_matmul_reference(
    x: jax.Array,  # [M, K] float
    w_fp8: jax.Array,  # [K, N] float8_e4m3fn ([N, K] with transpose_w)
    w_scale: jax.Array,  # [N] float
    *,
    mode: str,
    transpose_w: bool = False,
) -> jax.Array:  # [M, N] x.dtype
  dims = (((1,), (1 if transpose_w else 0,)), ((), ()))
  w = w_fp8.astype(jnp.float32)
  if mode == "w8a8":
    xq, xs = quantize_per_token_fp8(x)
    y = jax.lax.dot_general(xq.astype(jnp.float32), w, dims,
                            precision=jax.lax.Precision.HIGHEST) * xs[:, None]
  else:
    y = jax.lax.dot_general(x.astype(jnp.float32), w, dims, precision=jax.lax.Precision.HIGHEST)
  return (y * w_scale.astype(jnp.float32)[None, :]).astype(x.dtype)
