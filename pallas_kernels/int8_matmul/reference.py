"""Pure-jnp int8 matmul: the CPU path and the oracle for the kernels.

W8A16 dequantizes the weights a tile at a time inside a scan: XLA:CPU fuses each tile's
int8 -> float conversion with the slice it reads and reuses one small buffer for it, so the
float weights never exist whole (converting a whole weight writes a fresh buffer the size of the
float weights every step, which measured slower than reading float weights outright).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.int8_matmul.quantize import quantize_per_token

TILE_BYTES = 1 << 20  # float bytes of weights dequantized at a time: a tile stays in L2


def _num_tiles(rows: int, row_bytes: int) -> int:
  """The fewest tiles of whole rows, dividing `rows` evenly, of at most TILE_BYTES each."""
  want = -(-rows * row_bytes // TILE_BYTES)
  return next(c for c in range(want, rows + 1) if rows % c == 0)


def _w8a16(x: jax.Array, w: jax.Array, transpose_w: bool) -> jax.Array:  # [M, N] float32
  m = x.shape[0]
  if transpose_w:  # w [N, K]: tiles of output rows, each one dot
    n, k = w.shape
    c = _num_tiles(n, k * 4)
    tiles = jax.lax.map(
        lambda wt: jnp.dot(x, wt.astype(x.dtype).T, preferred_element_type=jnp.float32),
        w.reshape(c, n // c, k))  # [C, M, N/C]
    return tiles.transpose(1, 0, 2).reshape(m, n)
  k, n = w.shape  # w [K, N]: tiles of the contraction, accumulated
  c = _num_tiles(k, n * 4)
  if c == 1:
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
  xs = x.reshape(m, c, k // c).transpose(1, 0, 2)  # [C, M, K/C]
  acc, _ = jax.lax.scan(
      lambda acc, a: (acc + jnp.dot(a[0], a[1].astype(x.dtype),
                                    preferred_element_type=jnp.float32), None),
      jnp.zeros((m, n), jnp.float32), (xs, w.reshape(c, k // c, n)))
  return acc


def int8_matmul_reference(
    x: jax.Array,  # [M, K] float
    w_int8: jax.Array,  # [K, N] int8 ([N, K] with transpose_w)
    w_scale: jax.Array,  # [N] float
    *,
    mode: str,
    transpose_w: bool = False,
) -> jax.Array:  # [M, N] x.dtype
  ws = w_scale.astype(jnp.float32)[None, :]
  if mode == "w8a16":
    # int8 values are exact in bf16, so this is what a kernel computes with bf16 inputs.
    y = _w8a16(x, w_int8, transpose_w) * ws
  elif mode == "w8a8":
    xq, xs = quantize_per_token(x)
    m = x.shape[0]
    if m == 1:  # XLA:CPU lowers a one-row integer dot to a slow reduction; two rows to a GEMM
      xq = jnp.pad(xq, ((0, 1), (0, 0)))
    acc = jax.lax.dot_general(xq, w_int8, (((1,), (1 if transpose_w else 0,)), ((), ())),
                              preferred_element_type=jnp.int32)[:m]  # exact integer accumulation
    y = acc.astype(jnp.float32) * xs[:, None] * ws
  else:
    raise ValueError(f"unknown int8 matmul mode {mode!r}; choose 'w8a16' or 'w8a8'")
  return y.astype(x.dtype)
