"""Symmetric float8 (e4m3) quantization: per output channel for weights, per token for
activations. The scale maps each channel's (token's) absmax onto e4m3's largest finite value,
448, and rounding to float8 is round-to-nearest-even, as vLLM's and compressed-tensors' FP8."""
from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448


def _quantize(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  scale = jnp.where(amax == 0.0, 1.0, amax / FP8_MAX)  # an all-zero channel quantizes to zeros
  # The clip keeps a value that rounds past 448 finite (e4m3fn has no infinity: it would be NaN).
  q = jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(FP8)
  return q, jnp.squeeze(scale, axis)


def quantize_per_channel_fp8(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """w [K, N] -> (w_fp8 [K, N] float8_e4m3fn, scale [N] float32) with w ~= w_fp8 * scale."""
  return _quantize(w, axis=0)


def quantize_per_token_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [M, K] -> (x_fp8 [M, K], scale [M] float32): FP8-dynamic's activation quantization."""
  return _quantize(x, axis=1)
