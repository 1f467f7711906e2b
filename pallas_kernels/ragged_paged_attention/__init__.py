"""Ragged paged attention: one entry point, implementations chosen by `backend`."""
from __future__ import annotations

import jax

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

BACKENDS = ("reference",)


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array,  # [num_pages, 2, Hkv, page_size, D]
    kv_lens: jax.Array,  # [S]
    page_indices: jax.Array,  # [S, P]
    cu_q_lens: jax.Array,  # [S+1]
    num_seqs: jax.Array,  # [1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    max_q_len: int | None = None,
    backend: str = "reference",
) -> jax.Array:  # [T, Hq, D]
  """Causal attention of a flat ragged batch of queries over a paged KV cache.

  `max_q_len` is a static upper bound on any sequence's query count in this call (the engine
  passes a bucket; 1 for decode-only steps); kernels may use it to size their work.
  """
  if backend not in BACKENDS:
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
  fn = ragged_paged_attention_reference
  return fn(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
            max_q_len=max_q_len)
