"""Pure-jnp ragged paged attention: the CPU path and the oracle for every kernel.

Queries of all sequences are packed flat (`q [T, Hq, D]`, sequence s owns rows
`cu_q_lens[s]:cu_q_lens[s+1]`). Each sequence's queries are the last `q_len` positions of its
`kv_len` tokens, so prefill, chunked prefill and decode are one case.

Cost follows the batch, not `max_model_len`: keys are visited a block of pages at a time with an
online softmax in a while loop that stops at the longest sequence's last page (gathering every
page of the table at once allocated a fresh copy of the whole KV, which dominated a decode step
on the CPU). Queries are regrouped per sequence in two groups: every sequence's first query row
(all that a decode has), then the sequences with more than one query, padded to `max_q_len`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


def _attend(
    qg: jax.Array,  # [G, Qb, Hkv, Gq, D] float32, queries of G sequences
    kv_cache: jax.Array,  # [num_pages, 2, Hkv, page_size, D]
    pages: jax.Array,  # [G, P] int32, P a multiple of pages_per_block
    kv_lens: jax.Array,  # [G]
    q_lens: jax.Array,  # [G]
    *,
    pages_per_block: int | None,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale: float | None,
    v_scale: float | None,
) -> jax.Array:  # [G, Qb, Hkv, Gq, D] float32
  g, qb, hkv, gq, d = qg.shape
  page_size = kv_cache.shape[3]
  if pages_per_block is None:
    # Measured on XLA:CPU: ~1024 keys per sequence-group per block balances loop overhead
    # against the size of each gathered block (128 keys for 8 sequences, 32 for 64).
    pages_per_block = max(1, min(128, max(32, 1024 // g)) // page_size)
  pages_per_block = min(pages_per_block, pages.shape[1])
  if pages.shape[1] % pages_per_block:  # pad so blocks tile the table; never valid keys
    pages = jnp.pad(pages, ((0, 0), (0, pages_per_block - pages.shape[1] % pages_per_block)))
  bk = pages_per_block * page_size
  qi = jnp.arange(qb)
  qpos = (kv_lens - q_lens)[:, None] + qi[None, :]  # [G, Qb]
  q_live = qi[None, :] < q_lens[:, None]  # [G, Qb]

  def body(carry):
    blk, m, l, acc = carry
    ids = jax.lax.dynamic_slice_in_dim(pages, blk * pages_per_block, pages_per_block, axis=1)
    kv = kv_cache[ids].astype(jnp.float32)  # [G, Pb, 2, Hkv, ps, D]
    k, v = kv[:, :, 0], kv[:, :, 1]  # [G, Pb, Hkv, ps, D]
    if k_scale is not None:
      k = k * k_scale
    if v_scale is not None:
      v = v * v_scale
    kpos = blk * bk + jnp.arange(bk)  # [Bk]
    k_valid = kpos[None, :] < kv_lens[:, None]  # [G, Bk]
    # Slots past kv_len may hold anything, NaN included: 0 * NaN must never reach the output.
    v = jnp.where(k_valid.reshape(g, pages_per_block, 1, page_size, 1), v, 0.0)
    s = jnp.einsum("gqhxd,gphsd->ghxqps", qg, k).reshape(g, hkv, gq, qb, bk) * sm_scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & k_valid[:, None, :] & q_live[:, :, None]
    if sliding_window is not None:
      mask &= kpos[None, None, :] > qpos[:, :, None] - sliding_window
    mask = mask[:, None, None]  # [G, 1, 1, Qb, Bk]
    s = jnp.where(mask, s, _NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=-1))  # [G, Hkv, Gq, Qb]
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l = l * alpha + p.sum(axis=-1)
    pv = jnp.einsum("ghxqk,gkhd->ghxqd", p,
                    v.transpose(0, 1, 3, 2, 4).reshape(g, bk, hkv, d))
    return blk + 1, m_new, l, acc * alpha[..., None] + pv

  n_blocks = (jnp.max(kv_lens, initial=0) + bk - 1) // bk
  init = (jnp.int32(0), jnp.full((g, hkv, gq, qb), _NEG_INF, jnp.float32),
          jnp.zeros((g, hkv, gq, qb), jnp.float32), jnp.zeros((g, hkv, gq, qb, d), jnp.float32))
  _, _, l, acc = jax.lax.while_loop(lambda c: c[0] < n_blocks, body, init)
  out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]  # rows with no keys come out 0
  return out.transpose(0, 3, 1, 2, 4)  # [G, Qb, Hkv, Gq, D]


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
    max_prefill_seqs: int | None = None,
    pages_per_block: int | None = None,
) -> jax.Array:  # [T, Hq, D]
  """`max_q_len` bounds any sequence's query count (static; default T) and `max_prefill_seqs`
  how many sequences have more than one query (static; default S)."""
  t, hq, d = q.shape
  s, p = page_indices.shape
  _, _, hkv, page_size, _ = kv_cache.shape
  gq = hq // hkv
  qb = t if max_q_len is None else min(max_q_len, t)
  sp = s if max_prefill_seqs is None else min(max_prefill_seqs, s)
  kw = dict(pages_per_block=pages_per_block, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)

  live = jnp.arange(s) < num_seqs[0]  # [S]
  q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
  kv_lens = jnp.where(live, kv_lens, 0)
  qf = q.astype(jnp.float32).reshape(t, hkv, gq, d)
  out = jnp.zeros((t + 1, hkv, gq, d), jnp.float32)  # row t swallows writes of padding rows

  def scatter(out, seqs, group_q_lens, group_out):  # group_out [G, Qb', Hkv, Gq, D]
    qi = jnp.arange(group_out.shape[1])
    rows = cu_q_lens[seqs][:, None] + qi[None, :]  # [G, Qb']
    rows = jnp.where(qi[None, :] < group_q_lens[:, None], rows, t)
    return out.at[rows].set(group_out)

  # Group 1: the first query of every sequence (a decode's only one).
  first = jnp.minimum(cu_q_lens[:-1], t - 1)
  q1 = jnp.minimum(q_lens, 1)
  o1 = _attend(qf[first][:, None], kv_cache, page_indices, kv_lens - q_lens + q1, q1, **kw)
  out = scatter(out, jnp.arange(s), q1, o1)

  # Group 2: sequences with several queries (prefill chunks), each padded to qb rows.
  if qb > 1:
    (multi,) = jnp.nonzero(q_lens > 1, size=sp, fill_value=0)
    valid = q_lens[multi] > 1  # fill entries are dead
    mq_lens = jnp.where(valid, q_lens[multi], 0)
    rows = jnp.minimum(cu_q_lens[multi][:, None] + jnp.arange(qb)[None, :], t - 1)  # [Sp, Qb]
    o2 = _attend(qf[rows], kv_cache, page_indices[multi], jnp.where(valid, kv_lens[multi], 0),
                 mq_lens, **kw)
    out = scatter(out, multi, mq_lens, o2)
  return out[:t].reshape(t, hq, d).astype(q.dtype)
