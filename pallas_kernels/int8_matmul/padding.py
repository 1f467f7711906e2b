"""Padding operands up to whole tiles, shared by the int8 matmul kernels."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def pad_to(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Zero-pad the trailing edge of every axis; a no-op (no copy) when already that shape.

  Zero rows of x and zero rows/columns of w add nothing to the products, so padding is exact.
  """
  if a.shape == shape:
    return a
  return jnp.pad(a, [(0, s - d) for d, s in zip(a.shape, shape)])
