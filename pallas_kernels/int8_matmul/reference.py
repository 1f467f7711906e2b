"""Pure-jnp int8 matmul: the oracle for the kernels (the CPU runs the `xla` backend)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.int8_matmul.quantize import quantize_per_token


def int8_matmul_reference(
    x: jax.Array,  # [M, K] float
    w_int8: jax.Array,  # [K, N] int8 ([N, K] with transpose_w)
    w_scale: jax.Array,  # [N] float
    *,
    mode: str,
    transpose_w: bool = False,
) -> jax.Array:  # [M, N] x.dtype
  ws = w_scale.astype(jnp.float32)[None, :]
  dims = (((1,), (1 if transpose_w else 0,)), ((), ()))
  if mode == "w8a16":
    # int8 values are exact in bf16, so this is what a kernel computes with bf16 inputs.
    y = jax.lax.dot_general(x, w_int8.astype(x.dtype), dims,
                            preferred_element_type=jnp.float32) * ws
  elif mode == "w8a8":
    xq, xs = quantize_per_token(x)
    acc = jax.lax.dot_general(xq, w_int8, dims,
                              preferred_element_type=jnp.int32)  # exact integer accumulation
    y = acc.astype(jnp.float32) * xs[:, None] * ws
  else:
    raise ValueError(f"unknown int8 matmul mode {mode!r}; choose 'w8a16' or 'w8a8'")
  return y.astype(x.dtype)
