"""int8 matmul as one integer GEMM: the CPU path.

XLA:CPU has no fused int8-to-float GEMM: converting int8 weights to float writes a float copy of
them every step, which costs about what the smaller read saves. Its integer GEMM (int8 x int8,
int32 accumulation) is fast instead: on a 2-core x86 box it reads int8 weights at ~11 GB/s for a
few rows, and at 64 rows it runs ~4x faster than the float32 GEMM over the same weights. So the
activations become int8 too, as precisely as the mode needs:

* W8A8: one int8 digit per token (dynamic per-token scale), as the mode defines.
* W8A16: each token's activations become a 16-bit integer written as two int8 digits in base
  254, x ~= s * (q1 + q2 / 254) with s = max|x| / 127: the first digit's rounding error is at
  most half a step, which the second (254 times finer, still within [-127, 127]) encodes. That is
  activations at 16 bits per token (error below max|x| / 64,516), where the accelerator kernels
  use bfloat16 (8 significant bits); perplexity on the pydoc text equals the float-activation
  reference to 5 digits. Both digits of every token are rows of one GEMM (the weights are read
  once) and are recombined per token afterwards. A third digit (`W8A16_DIGITS = 3`) carries float32's 24
  bits, at 1.5x the GEMM's work when it is compute-bound (many rows).

A single row is padded to two: XLA:CPU lowers a one-row integer dot to a slow reduction.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.int8_matmul.quantize import QMAX, quantize_per_token

W8A16_DIGITS = 2
_BASE = 2 * QMAX  # a digit's residual is at most half its step: the next digit's full range


def _digits(x: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
  """x [M, K] float -> (digits [n*M, K] int8, scale [M] float32):
  x ~= scale * sum_d digit_d / BASE^d."""
  q, scale = quantize_per_token(x)  # [M, K] int8, [M]
  qs = [q]
  r = x.astype(jnp.float32) / scale[:, None]  # x in units of the first digit's step
  for _ in range(n - 1):
    r = (r - qs[-1].astype(jnp.float32)) * _BASE  # the residual, in units of the next step
    qs.append(jnp.clip(jnp.round(r), -QMAX, QMAX).astype(jnp.int8))
  return jnp.concatenate(qs), scale


def int8_matmul_xla(
    x: jax.Array,  # [M, K] float
    w_int8: jax.Array,  # [K, N] int8 ([N, K] with transpose_w)
    w_scale: jax.Array,  # [N] float
    *,
    mode: str,
    transpose_w: bool = False,
) -> jax.Array:  # [M, N] x.dtype
  n = 1 if mode == "w8a8" else W8A16_DIGITS
  m = x.shape[0]
  xq, xs = _digits(x, n)  # [n*M, K], [M]
  rows = xq.shape[0]
  if rows == 1:
    xq = jnp.pad(xq, ((0, 1), (0, 0)))
  acc = jax.lax.dot_general(xq, w_int8, (((1,), (1 if transpose_w else 0,)), ((), ())),
                            preferred_element_type=jnp.int32)[:rows]  # exact: [n*M, N]
  # Horner's rule over slices, not a reduction over a digit axis: XLA:CPU hands reductions to a
  # library call far slower than this elementwise loop.
  y = acc[(n - 1) * m:].astype(jnp.float32)
  for d in range(n - 2, -1, -1):
    y = acc[d * m:(d + 1) * m].astype(jnp.float32) + y / _BASE
  y = y * xs[:, None] * w_scale.astype(jnp.float32)[None, :]
  return y.astype(x.dtype)
