"""Round-to-nearest group-wise 4-bit quantization, and the quantization grid every int4
quantizer here shares (GPTQ and AWQ search around it, they never change it).

A group of `g` weights along K (for one output channel) gets a scale and an integer zero point:

    q = clip(round(w / scale) + zero, 0, 15),    w ~ (q - zero) * scale

which the group-wise format stores as (q, scale, offset = -zero * scale).

* asymmetric: the range is [min(w_min, 0), max(w_max, 0)] as in GPTQ's quantizer, so the zero
  point is an integer in [0, 15] and 0 is exact. (AWQ's `pseudo_quantize_tensor` takes
  [w_min, w_max] and clamps the zero point, which wrecks a group that lies all on one side of 0.)
* symmetric: zero = 8, scale = max(-w_min / 8, w_max / 7): the grid's -8 step is used when the
  largest magnitude is negative, where AWQ's `absmax / 7` never uses it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jinfer.quant.groupwise import GroupwiseArray
from pallas_kernels.groupwise_matmul.packing import pack_int4

MAXQ = 15  # 4 bits


def grid(w_min: jax.Array, w_max: jax.Array, sym: bool) -> tuple[jax.Array, jax.Array]:
  """(scale, zero) of groups whose weights span [w_min, w_max] (any matching shapes)."""
  lo, hi = jnp.minimum(w_min, 0.0), jnp.maximum(w_max, 0.0)
  if sym:
    scale = jnp.maximum(-lo / 8, hi / 7)
    zero = jnp.full_like(scale, 8.0)
  else:
    scale = (hi - lo) / MAXQ
    zero = jnp.round(-lo / jnp.where(scale == 0, 1.0, scale))
  # An all-zero group: any scale reproduces it (q = zero); 1 keeps the divisions finite.
  return jnp.where(scale == 0, 1.0, scale), zero


def round_to_grid(w: jax.Array, scale: jax.Array, zero: jax.Array) -> jax.Array:
  """q in [0, 15] (float), broadcasting w against scale and zero."""
  return jnp.clip(jnp.round(w / scale) + zero, 0, MAXQ)


def check_group_size(k: int, group_size: int) -> None:
  if group_size < 2 or group_size % 2 or k % group_size:
    raise ValueError(f"group_size must be even and divide K={k}, got {group_size}")


def _rtn(w: jax.Array, group_size: int, sym: bool):
  """w [..., K, N] -> (q [..., K, N] float in [0, 15], scale, zero [..., K/g, N])."""
  *lead, k, n = w.shape
  check_group_size(k, group_size)
  wg = w.astype(jnp.float32).reshape(*lead, k // group_size, group_size, n)
  scale, zero = grid(wg.min(-2), wg.max(-2), sym)  # [..., G, N]
  q = round_to_grid(wg, scale[..., None, :], zero[..., None, :])
  return q.reshape(*lead, k, n), scale, zero


def to_groupwise(q: jax.Array, scale: jax.Array, zero: jax.Array,
                 group_size: int) -> GroupwiseArray:
  """Integer q [..., K, N] on the grid (scale, zero [..., K/g, N]) in the stored format."""
  return GroupwiseArray(q=pack_int4(q.astype(jnp.uint8), group_size), scale=scale,
                        offset=-zero * scale, bits=4, group_size=group_size)


# One compiled program per weight shape (eagerly, each op would compile on its own per shape).
@functools.partial(jax.jit, static_argnames=("group_size", "sym"))
def quantize_rtn(w: jax.Array, group_size: int = 128, sym: bool = False) -> GroupwiseArray:
  """w [lead..., K, N] (K contracts) -> 4-bit group-wise weights, groups of `group_size` along K
  for every output channel and every leading index."""
  return to_groupwise(*_rtn(w, group_size, sym), group_size)


@functools.partial(jax.jit, static_argnames=("group_size", "sym"))
def fake_quantize(w: jax.Array, group_size: int = 128, sym: bool = False) -> jax.Array:
  """w [..., K, N] rounded to its RTN grid and back to float32: what `quantize_rtn` stands for,
  without the packing (AWQ's searches compare many candidates this way)."""
  q, scale, zero = _rtn(w, group_size, sym)
  *lead, k, n = w.shape
  qg = q.reshape(*lead, k // group_size, group_size, n)
  return ((qg - zero[..., None, :]) * scale[..., None, :]).reshape(*lead, k, n)
