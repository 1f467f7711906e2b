"""Grouped matmul in plain XLA ops for the CPU.

XLA:CPU computes `ragged_dot` densely, every row against every group's weights, masked afterwards
(measured ~10x a dense matmul of the same active rows with 8 groups). And a dot never reads a
slice of a stacked array in place: `rhs[g]` is copied first, which for a grouped matmul means
copying every group's weights on every call. Two ways around both, picked by shape:

  * blocks (float weights, at least one row per group on average): each group's rows are
    gathered into a `[G, C, K]` block, C the smallest of a few capacities that holds the
    largest group, and one batched dot `[G, C, K] x [G, K, N]` reads every group's weights in
    place. Work is G x C rows: the capacities step by 1.5x, so at most ~1.5x the rows of the
    largest group, per group.
  * a loop over the non-empty groups (few rows per group, or int8 / group-wise quantized
    weights): each group multiplies its rows, `block_m` at a time, by its own weights (copied
    out, or widened from int8 / dequantized from group-wise int4 or int8 one group at a time, so
    memory traffic stays quantized). Empty groups cost nothing.

Both are dropless: every row is computed, whatever the group sizes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.groupwise_matmul.xla import dequantize_f32
from pallas_kernels.int8_matmul.quantize import quantize_per_token


def default_block_m(m: int, num_groups: int) -> int:
  """Rows per tile of the loop: the mean group size as a power of two in [8, 128]."""
  mean = max(1, -(-m // num_groups))
  return min(128, max(8, 1 << (mean - 1).bit_length()))


def capacities(m: int) -> list[int]:
  """Block capacities for m rows: multiples of 8 growing by 1.5x, then m."""
  out, c = [], 8
  while c < m:
    out.append(c)
    c = -(-c * 3 // 2 // 8) * 8
  return out + [m]


def grouped_matmul_xla(
    lhs: jax.Array,  # [M, K] float
    rhs: jax.Array,  # [G, K, N] float or int8 ([G, K/2, N] uint8: group-wise int4)
    group_sizes: jax.Array,  # [G] int32
    scale: jax.Array | None,  # [G, N] float32 for int8 rhs; [G, K/qg, N] group-wise
    *,
    mode: str,
    block_m: int | None = None,
    offset: jax.Array | None = None,  # [G, K/qg, N] float32, group-wise
    bits: int = 8,
    quant_group_size: int | None = None,
) -> jax.Array:  # [M, N] lhs.dtype
  m, g = lhs.shape[0], rhs.shape[0]
  if scale is None and block_m is None and m >= g:
    return _blocks(lhs, rhs, group_sizes)
  if quant_group_size is not None:
    groups_scale = scale.astype(jnp.float32)  # [G, K/qg, N]

    def weight(e):  # [K, N] lhs.dtype: expert e dequantized, its scales applied
      return dequantize_f32(rhs[e], groups_scale[e], offset[e].astype(jnp.float32), bits=bits,
                            group_size=quant_group_size).astype(lhs.dtype)
    scale = None  # applied inside the weights
  else:
    def weight(e):  # [K, N]: int8 kept for W8A8, else in lhs.dtype
      return rhs[e] if scale is not None and mode == "w8a8" else rhs[e].astype(lhs.dtype)
  return _loop(lhs, weight, rhs.shape[2], group_sizes, scale, mode=mode,
               block_m=block_m or default_block_m(m, g))


def _blocks(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  m, g = lhs.shape[0], rhs.shape[0]
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  rows = jnp.arange(m)
  row_group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), g - 1)  # [M]
  slot = rows - starts[row_group]  # [M]: a row's place in its group's block

  def with_capacity(c: int):
    def run(x):
      src = starts[:, None] + jnp.arange(c)[None, :]  # [G, C]: the row each block slot holds
      blocks = jnp.where((jnp.arange(c)[None, :] < group_sizes[:, None])[..., None],
                         x[jnp.minimum(src, m - 1)], 0)  # [G, C, K]
      out = jnp.einsum("gck,gkn->gcn", blocks, rhs.astype(x.dtype),
                       preferred_element_type=jnp.float32)  # [G, C, N]
      return out[row_group, jnp.minimum(slot, c - 1)]  # [M, N]
    return run

  caps = capacities(m)
  pick = jnp.minimum(jnp.searchsorted(jnp.asarray(caps), jnp.max(group_sizes)), len(caps) - 1)
  out = lax.switch(pick, [with_capacity(c) for c in caps], lhs)
  return jnp.where((rows < ends[-1])[:, None], out, 0).astype(lhs.dtype)


def _loop(lhs: jax.Array, weight, n: int, group_sizes: jax.Array, scale: jax.Array | None, *,
          mode: str, block_m: int) -> jax.Array:
  """`weight(e)`: expert e's [K, N] weight as the dot takes it; `scale` [G, N] applied after."""
  m, bm = lhs.shape[0], block_m
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
    w = weight(e)  # [K, N]
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
