"""Grouped matmul in plain XLA ops for the CPU.

XLA:CPU computes `ragged_dot` densely, every row against every group's weights masked afterwards
(measured ~10x a dense matmul of the same active rows with 8 groups). Here a loop visits only the
non-empty groups; each multiplies its rows, `block_m` at a time, by its own weights, so a group's
weights are read once and the work is the rows it holds (plus at most `block_m - 1` rows of
tile padding per group). int8 weights are widened one group at a time, so memory traffic stays
int8.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.int8_matmul.quantize import quantize_per_token


def default_block_m(m: int, num_groups: int) -> int:
  """Rows per tile: the mean group size as a power of two in [8, 128]: decode-sized groups waste
  few rows, prefill-sized ones run few large matmuls."""
  mean = max(1, -(-m // num_groups))
  return min(128, max(8, 1 << (mean - 1).bit_length()))


def grouped_matmul_xla(
    lhs: jax.Array,  # [M, K] float
    rhs: jax.Array,  # [G, K, N] float or int8
    group_sizes: jax.Array,  # [G] int32
    scale: jax.Array | None,  # [G, N] float32 for int8 rhs
    *,
    mode: str,
    block_m: int | None = None,
) -> jax.Array:  # [M, N] lhs.dtype
  m, k = lhs.shape
  g, _, n = rhs.shape
  bm = block_m or default_block_m(m, g)
  w8a8 = scale is not None and mode == "w8a8"
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  # Non-empty groups first: the loop runs over them only.
  visit = jnp.argsort(group_sizes == 0, stable=True).astype(jnp.int32)  # [G]
  if w8a8:
    x, xs = quantize_per_token(lhs)
    xs = jnp.pad(xs, (0, bm))  # [M + bm]
  else:
    x = lhs
  x = jnp.pad(x, ((0, bm), (0, 0)))  # [M + bm, K]: a group's last tile may run past row M
  acc_dtype = jnp.int32 if w8a8 else jnp.float32

  def group(i, out):
    e = visit[i]
    w = rhs[e] if w8a8 else rhs[e].astype(lhs.dtype)  # [K, N]
    start, end = starts[e], ends[e]

    def tile(t, out):
      r0 = start + t * bm
      y = jnp.dot(lax.dynamic_slice_in_dim(x, r0, bm), w, preferred_element_type=acc_dtype)
      if scale is not None:
        y = y.astype(jnp.float32) * scale[e].astype(jnp.float32)[None, :]
      if w8a8:
        y = y * lax.dynamic_slice_in_dim(xs, r0, bm)[:, None]
      mine = (r0 + jnp.arange(bm) < end)[:, None]  # rows past the group belong to the next
      old = lax.dynamic_slice_in_dim(out, r0, bm)
      return lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y.astype(out.dtype), old), r0, 0)

    return lax.fori_loop(0, (end - start + bm - 1) // bm, tile, out)

  out = jnp.zeros((m + bm, n), lhs.dtype)  # rows no group holds stay zero
  return lax.fori_loop(0, jnp.count_nonzero(group_sizes), group, out)[:m]
