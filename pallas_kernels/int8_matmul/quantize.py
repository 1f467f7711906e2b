"""Symmetric int8 quantization: per output channel for weights, per token for activations."""
from __future__ import annotations

import jax
import jax.numpy as jnp

QMAX = 127.0  # symmetric range [-127, 127]: -128 is never produced, so negation is exact


def _quantize(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  scale = jnp.where(amax == 0.0, 1.0, amax / QMAX)  # an all-zero channel quantizes to zeros
  q = jnp.clip(jnp.round(x / scale), -QMAX, QMAX).astype(jnp.int8)
  return q, jnp.squeeze(scale, axis)


def quantize_per_channel(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """w [K, N] -> (w_int8 [K, N], scale [N] float32) with w ~= w_int8 * scale."""
  return _quantize(w, axis=0)


def quantize_per_token(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [M, K] -> (x_int8 [M, K], scale [M] float32): W8A8's dynamic activation quantization."""
  return _quantize(x, axis=1)
