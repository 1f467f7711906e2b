"""The oracle: ragged paged attention written densely, to be checked by eye. Tests only.

Every query row gathers all of its sequence's pages, builds one boolean mask from the contract's
rules (`attention_metadata.py`) and takes a plain softmax. Memory is O(T x keys per sequence):
fine for test batches, useless for serving.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.kv_cache_layout import KVCache, dequantize, split_cache


def row_layout(md: AttentionMetadata, t: int):
  """Per row: (sequence, index among its sequence's new rows, live); per sequence: (first row,
  query count, cached context length). Entries past `num_seqs` may hold junk and are ignored."""
  s = md.kv_lens.shape[0]
  n = md.num_seqs[0]
  seq_live = jnp.arange(s) < n
  cu = jnp.where(jnp.arange(s + 1) <= n, md.cu_q_lens, md.cu_q_lens[n])  # non-decreasing
  starts, q_lens = cu[:-1], cu[1:] - cu[:-1]  # [S]
  ctx_lens = jnp.where(seq_live, md.kv_lens - q_lens, 0)  # [S]
  rows = jnp.arange(t)
  seg = jnp.clip(jnp.searchsorted(cu[1:], rows, side="right"), 0, s - 1)  # [T]
  return seg, rows - starts[seg], rows < cu[n], starts, q_lens, ctx_lens


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: KVCache,  # [L, num_pages, 2, Hkv, page_size, D], see kv_cache_layout.py
    md: AttentionMetadata,
    *,
    layer: jax.Array | int = 0,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    return_softmax_state: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [T, Hq, D] (, lse [T, Hq] float32)
  t, hq, d = q.shape
  values, scales = split_cache(kv_cache)
  _, _, _, hkv, page_size, _ = values.shape
  s_max, p_max = md.block_table.shape
  f32 = jnp.float32
  seg, idx, live, _, q_lens, ctx_lens = row_layout(md, t)

  # Each sequence's keys in position order: [S, K, Hkv, D], K = P * page_size.
  pages = md.block_table
  present = jnp.repeat(pages >= 0, page_size, axis=1)  # [S, K]
  at = (layer, jnp.maximum(pages, 0))
  kv = dequantize(values[at], None if scales is None else scales[at])  # [S, P, 2, Hkv, ps, D]
  keys = kv[:, :, 0].transpose(0, 1, 3, 2, 4).reshape(s_max, -1, hkv, d)
  vals = kv[:, :, 1].transpose(0, 1, 3, 2, 4).reshape(s_max, -1, hkv, d)
  keys, vals = keys * (k_scale or 1.0), vals * (v_scale or 1.0)

  kpos = jnp.arange(p_max * page_size)[None, :]  # [1, K]
  ctx, ql = ctx_lens[seg][:, None], q_lens[seg][:, None]  # [T, 1]
  new = kpos - ctx  # [T, K]: index of a key among the sequence's new rows (< 0: cached context)
  short = ql <= md.verify_width  # decode and verify rows
  if md.tree_mask is None:
    sees_new = new <= idx[:, None]
    depth = idx
  else:
    tree = md.tree_mask.astype(bool)  # [T, W]
    bit = jnp.take_along_axis(tree, jnp.clip(new, 0, md.verify_width - 1), axis=1)
    sees_new = jnp.where(short, bit, new <= idx[:, None])
    in_seq = jnp.arange(md.verify_width)[None, :] < ql
    depth = jnp.where(short[:, 0], jnp.sum(tree & in_seq, axis=1) - 1, idx)
  qpos = ctx[:, 0] + depth  # [T]
  mask = (live[:, None] & present[seg] & (kpos < ctx + ql)
          & ((new < 0) | ((new < ql) & sees_new)))
  if sliding_window is not None:
    mask &= kpos > qpos[:, None] - sliding_window

  qf = q.astype(f32).reshape(t, hkv, hq // hkv, d)
  scores = jnp.einsum("thgd,tkhd->thgk", qf, keys[seg]) * sm_scale  # [T, Hkv, G, K]
  if soft_cap is not None:
    scores = soft_cap * jnp.tanh(scores / soft_cap)
  m4 = mask[:, None, None, :]
  scores = jnp.where(m4, scores, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1)  # [T, Hkv, G]; -inf for rows that saw no key
  p = jnp.where(m4, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
  # Masked values are zeroed too: unused slots may hold NaN, and 0 * NaN = NaN.
  o = jnp.einsum("thgk,tkhd->thgd", p, jnp.where(mask[:, :, None, None], vals[seg], 0.0))
  o = o.reshape(t, hq, d).astype(q.dtype)
  return (o, lse.reshape(t, hq)) if return_softmax_state else o
