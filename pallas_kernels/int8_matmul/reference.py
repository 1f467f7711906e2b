"""Pure-jnp int8 matmul: the CPU path and the oracle for the kernels."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.int8_matmul.quantize import quantize_per_token


def int8_matmul_reference(
    x: jax.Array,  # [M, K] float
    w_int8: jax.Array,  # [K, N] int8
    w_scale: jax.Array,  # [N] float
    *,
    mode: str,
) -> jax.Array:  # [M, N] x.dtype
  ws = w_scale.astype(jnp.float32)[None, :]
  if mode == "w8a16":
    # int8 values are exact in bf16, so this is what a kernel computes with bf16 inputs.
    y = jnp.dot(x, w_int8.astype(x.dtype), preferred_element_type=jnp.float32) * ws
  elif mode == "w8a8":
    xq, xs = quantize_per_token(x)
    m = x.shape[0]
    if m == 1:  # XLA:CPU lowers a one-row integer dot to a slow reduction; two rows to a GEMM
      xq = jnp.pad(xq, ((0, 1), (0, 0)))
    acc = jnp.dot(xq, w_int8, preferred_element_type=jnp.int32)[:m]  # exact integer accumulation
    y = acc.astype(jnp.float32) * xs[:, None] * ws
  else:
    raise ValueError(f"unknown int8 matmul mode {mode!r}; choose 'w8a16' or 'w8a8'")
  return y.astype(x.dtype)
