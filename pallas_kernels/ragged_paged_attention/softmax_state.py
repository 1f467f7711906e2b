"""Merging attention computed over disjoint key sets, from each part's softmax state.

An implementation asked for its softmax state returns, beside the normalized output `o`, the
log-sum-exp of each row's scaled scores (`lse`, -inf for a row that saw no key). Two parts of
the same rows' keys merge exactly: the weights of each part are exp(lse_part - lse_total).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_attention(o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array,
                    lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """o_*: [T, H, D]; lse_*: [T, H] float32. Returns the merged (o [T, H, D], lse [T, H])."""
  lse = jnp.logaddexp(lse_a, lse_b)  # -inf only where neither part saw a key
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  w_a = jnp.exp(lse_a - safe)[..., None]  # exp(-inf) = 0 for a part that saw nothing
  w_b = jnp.exp(lse_b - safe)[..., None]
  o = o_a.astype(jnp.float32) * w_a + o_b.astype(jnp.float32) * w_b
  return o.astype(o_a.dtype), lse
