"""Pure-jnp ragged paged attention: the CPU path and the oracle for every kernel.

Queries of all sequences are packed flat (`q [T, Hq, D]`, sequence s owns rows
`cu_q_lens[s]:cu_q_lens[s+1]`). Each sequence's queries are the last `q_len` positions of its
`kv_len` tokens, so prefill, chunked prefill and decode are one case. Cost follows the batch's
shapes, not `max_model_len`: queries are regrouped per sequence into `[S, max_q_len]` and keys are
gathered only for the `P` pages the caller passes (the engine passes a bucketed width).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array,  # [num_pages, 2, Hkv, page_size, D]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, P] int32
    cu_q_lens: jax.Array,  # [S+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    max_q_len: int | None = None,
) -> jax.Array:  # [T, Hq, D]
  t, hq, d = q.shape
  s, p = page_indices.shape
  _, _, hkv, page_size, _ = kv_cache.shape
  g = hq // hkv
  qb = t if max_q_len is None else min(max_q_len, t)
  kl = p * page_size

  valid_seq = jnp.arange(s) < num_seqs[0]  # [S]
  q_lens = jnp.where(valid_seq, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
  kv_lens = jnp.where(valid_seq, kv_lens, 0)

  # Queries regrouped per sequence.
  qi = jnp.arange(qb)  # [Qb]
  rows = jnp.clip(cu_q_lens[:-1, None] + qi[None, :], 0, t - 1)  # [S, Qb]
  qp = q[rows].astype(jnp.float32).reshape(s, qb, hkv, g, d)  # [S, Qb, Hkv, G, D]

  # Keys/values of each sequence's pages, flattened to positions.
  pages = kv_cache[page_indices]  # [S, P, 2, Hkv, page_size, D]
  kv = pages.transpose(0, 2, 3, 1, 4, 5).reshape(s, 2, hkv, kl, d).astype(jnp.float32)
  k, v = kv[:, 0], kv[:, 1]  # [S, Hkv, L, D]
  if k_scale is not None:
    k = k * k_scale
  if v_scale is not None:
    v = v * v_scale
  kpos = jnp.arange(kl)  # [L]
  k_valid = kpos[None, :] < kv_lens[:, None]  # [S, L]
  # Unused slots may hold anything (NaN included): zero them so 0 * NaN never reaches the output.
  k = jnp.where(k_valid[:, None, :, None], k, 0.0)
  v = jnp.where(k_valid[:, None, :, None], v, 0.0)

  scores = jnp.einsum("sqhgd,shld->shgql", qp, k) * sm_scale  # [S, Hkv, G, Qb, L]
  if soft_cap is not None:
    scores = soft_cap * jnp.tanh(scores / soft_cap)

  qpos = (kv_lens - q_lens)[:, None] + qi[None, :]  # [S, Qb]
  mask = (kpos[None, None, :] <= qpos[:, :, None]) & k_valid[:, None, :]  # [S, Qb, L]
  mask &= (qi[None, :] < q_lens[:, None])[:, :, None]
  if sliding_window is not None:
    mask &= kpos[None, None, :] > qpos[:, :, None] - sliding_window
  mask = mask[:, None, None]  # [S, 1, 1, Qb, L]
  scores = jnp.where(mask, scores, _NEG_INF)
  m = jnp.max(scores, axis=-1, keepdims=True)
  e = jnp.where(mask, jnp.exp(scores - m), 0.0)
  denom = jnp.sum(e, axis=-1, keepdims=True)
  probs = e / jnp.where(denom == 0.0, 1.0, denom)
  out = jnp.einsum("shgql,shld->sqhgd", probs, v).reshape(s, qb, hq, d)  # [S, Qb, Hq, D]

  # Back to the flat token order; rows past the last sequence are padding and come out zero.
  tok = jnp.arange(t)
  seq_of_tok = jnp.clip(jnp.searchsorted(cu_q_lens[1:], tok, side="right"), 0, s - 1)  # [T]
  pos_in_seq = tok - cu_q_lens[seq_of_tok]
  live = (tok < cu_q_lens[num_seqs[0]]) & (pos_in_seq < qb)
  res = out[seq_of_tok, jnp.clip(pos_in_seq, 0, qb - 1)]  # [T, Hq, D]
  return jnp.where(live[:, None, None], res, 0.0).astype(q.dtype)
