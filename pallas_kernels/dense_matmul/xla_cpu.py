"""The float product shaped for XLA:CPU, on one device.

XLA:CPU computes a one-row dot on one core. So one row runs as two half-length dots batched
together and summed, which XLA:CPU spreads over both cores of a 2-core box (a single stream's
layers read 425 MB at ~25 GB/s instead of ~19). Two rows or more run as one dot: there the
split measures slower. A transposed weight (the tied LM head, [V, E]) takes one row as a
matrix-vector product: XLA:CPU runs `x @ w.T` at one row as a slow loop.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def dense_matmul_xla_cpu(x: jax.Array, w: jax.Array, n_in: int, transpose_w: bool) -> jax.Array:
  lead = x.shape[:x.ndim - n_in]
  rows = int(np.prod(lead))
  if transpose_w:
    return (w @ x.reshape(-1))[None].reshape(lead + w.shape[:1]) if rows == 1 else x @ w.T
  out = w.shape[n_in:]
  k = int(np.prod(w.shape[:n_in]))
  if rows != 1 or k % 2:
    return jnp.tensordot(x, w, axes=n_in)
  halves = jnp.einsum("bk,bkn->bn", x.reshape(2, k // 2), w.reshape(2, k // 2, -1))  # [2, N]
  return halves.sum(0).reshape(lead + out)
