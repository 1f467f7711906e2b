"""Grouped matmul through `jax.lax.ragged_dot`: the oracle, and the GPU path (XLA lowers
ragged_dot natively there)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.groupwise_matmul.packing import dequantize
from pallas_kernels.int8_matmul.quantize import quantize_per_token


def row_groups(group_sizes: jax.Array, m: int) -> jax.Array:  # [m] int32
  """The group each of m rows belongs to; rows past the last group get the last group."""
  ends = jnp.cumsum(group_sizes)
  rows = jnp.arange(m, dtype=group_sizes.dtype)
  return jnp.minimum(jnp.searchsorted(ends, rows, side="right"),
                     group_sizes.shape[0] - 1).astype(jnp.int32)


def grouped_matmul_reference(
    lhs: jax.Array,  # [M, K] float
    rhs: jax.Array,  # [G, K, N] float or int8 ([G, K/2, N] uint8: group-wise int4)
    group_sizes: jax.Array,  # [G] int32
    scale: jax.Array | None,  # [G, N] float32 for int8 rhs; [G, K/qg, N] group-wise
    *,
    mode: str,
    offset: jax.Array | None = None,  # [G, K/qg, N] float32, group-wise
    bits: int = 8,
    quant_group_size: int | None = None,
) -> jax.Array:  # [M, N] lhs.dtype
  if quant_group_size is not None:  # every expert dequantized to f32, one f32 ragged_dot
    w = dequantize(rhs, scale.astype(jnp.float32), offset.astype(jnp.float32), bits=bits,
                   group_size=quant_group_size)  # [G, K, N]
    y = jax.lax.ragged_dot(lhs.astype(jnp.float32), w, group_sizes,
                           precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
    return y.astype(lhs.dtype)
  if scale is None:
    y = jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes,
                           preferred_element_type=jnp.float32)
    return y.astype(lhs.dtype)
  row_scale = scale.astype(jnp.float32)[row_groups(group_sizes, lhs.shape[0])]  # [M, N]
  if mode == "w8a16":
    y = jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes,
                           preferred_element_type=jnp.float32) * row_scale
  else:
    xq, xs = quantize_per_token(lhs)
    acc = jax.lax.ragged_dot(xq, rhs, group_sizes, preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * xs[:, None] * row_scale
  return y.astype(lhs.dtype)
