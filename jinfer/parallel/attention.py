"""Paged attention for the model, on one device or per shard of a `(context, tensor)` mesh.

On one device it is `write_kv` then `ragged_paged_attention`. On a mesh it runs under
`jax.shard_map`, every kernel on local arrays:
  * tensor: each shard holds `Hq/TP` query heads, `Hkv/TP` KV heads (KV heads duplicated first
    where `Hkv < TP`, see `sharding.py`) and those heads of every cached page;
  * context: the page pool is split over the ranks (global page `g` lives on rank
    `g // pages_per_rank`) and the page allocator stripes a sequence's pages over them, so a
    sequence's KV spreads over every rank and may exceed one device's pool. Each rank writes the
    step's new K/V that land on its pages, then the step's query rows go round a ring: rank r
    starts with its own block of rows (two zigzag chunks, or one plain chunk), attends it to its
    own pages only (the others are marked absent in the block table) and passes it on with its
    running output and log-sum-exp; after CP hops every block has met every page and is home,
    its partial results merged exactly (`merge_attention`). The KV stays where it is: pages are
    far larger than a step's queries. A rank's attention walks its own pages only (listed with
    their positions, `AttentionMetadata.context_pages`), so CP ranks divide the context's work
    (every backend; tests/test_attention_reads.py counts the pages a Pallas kernel reads).
A quantized cache (int8 / fp8 values and their scales) is split the same way, each scale on the
rank and tensor shard of its values; every rank quantizes the rows it writes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jinfer.parallel.sharding import kv_cache_specs
from pallas_kernels import (AttentionMetadata, QuantizedKVCache, merge_attention,
                            ragged_paged_attention, write_kv)
from pallas_kernels.kv_cache_layout import KVCache


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    kv_cache: KVCache,  # [L, num_pages, 2, Hkv, page_size, D], see kv_cache_layout.py
    md: AttentionMetadata,
    *,
    layer: jax.Array,
    sliding_window: jax.Array | None,
    sm_scale: float,
    soft_cap: float | None = None,
    backend: str,
    interpret: bool,
    mesh: Mesh | None = None,
    context_layout: str = "zigzag",
) -> tuple[jax.Array, jax.Array]:  # o [T, Hq, D], kv_cache
  """Write this step's K/V into the cache and attend the queries to it."""
  attend = lambda q, cache, md, layer, window: ragged_paged_attention(
      q, cache, md, layer=layer, sm_scale=sm_scale, sliding_window=window, soft_cap=soft_cap,
      backend=backend, interpret=interpret, return_softmax_state=True)
  if mesh is None:
    kv_cache = write_kv(kv_cache, layer, k, v, md.slot_mapping)
    return attend(q, kv_cache, md, layer, sliding_window)[0], kv_cache

  cp = mesh.shape["context"]
  t = q.shape[0]
  if md.tree_mask is not None and cp > 1:
    raise ValueError("tree masks are not supported with context parallelism")
  chunks = _layout(t, cp, context_layout)  # [CP, n] chunk ids each rank starts with
  n_chunks = chunks.size
  if t % n_chunks:
    raise ValueError(f"a {t}-token step does not split into {n_chunks} context chunks")
  size = t // n_chunks
  rows = (chunks[:, :, None] * size + np.arange(size)).reshape(-1)  # rank-major row order
  heads = P(None, "tensor", None)

  def body(q, k, v, cache, md, layer, window):
    # Shapes are per shard: q [T/CP, Hq/TP, D] (this rank's chunks), k, v [T, Hkv/TP, D].
    rank = jax.lax.axis_index("context")
    shape = jax.tree.leaves(cache)[0].shape  # [L, pages on this rank, 2, Hkv/TP, ps, D]
    per_rank = shape[1]
    cache = write_kv(cache, layer, k, v, _local_slots(md.slot_mapping, rank, per_rank, shape[4]))
    table = jnp.where(md.block_table // per_rank == rank, md.block_table % per_rank, -1)
    table = jnp.where(md.block_table < 0, -1, table)
    # This rank's pages first, in position order, with their indices in the sequence: the
    # context loops walk these alone, so a hop's work is the rank's share of the context.
    order = jnp.argsort(table < 0, axis=1, stable=True)  # [S, P]
    own = jnp.take_along_axis(table, order, axis=1)
    own_pos = jnp.where(own >= 0, order, -1).astype(jnp.int32)
    qs = q.reshape((chunks.shape[1], size) + q.shape[1:])  # [n, C, Hq/TP, D]

    def hop(i, carry):  # attend the blocks held now to this rank's pages, pass them on
      blocks, o, lse = carry
      origin = (rank - i) % cp  # whose blocks these are
      for j in range(blocks.shape[0]):
        start = jnp.asarray(chunks)[origin, j] * size
        chunk_md = _chunk_metadata(md, table, start, size).replace(
            context_pages=own, context_page_pos=own_pos)
        part = attend(blocks[j], cache, chunk_md, layer, window)
        oj, lj = merge_attention(o[j], lse[j], *part)
        o, lse = o.at[j].set(oj), lse.at[j].set(lj)
      ring = [(r, (r + 1) % cp) for r in range(cp)]
      return tuple(jax.lax.ppermute(x, "context", ring) for x in (blocks, o, lse))

    o0 = jnp.zeros(qs.shape, jnp.float32)
    lse0 = jnp.full(qs.shape[:-1], -jnp.inf, jnp.float32)
    _, o, _ = jax.lax.fori_loop(0, cp, hop, (qs, o0, lse0))
    return o.reshape(q.shape).astype(q.dtype), cache

  cache_specs = kv_cache_specs(isinstance(kv_cache, QuantizedKVCache))
  o, kv_cache = jax.shard_map(
      body, mesh=mesh,
      in_specs=(P("context", "tensor", None), heads, heads, cache_specs, P(), P(), P()),
      out_specs=(P("context", "tensor", None), cache_specs), check_vma=False,
  )(q[rows], k, v, kv_cache, md, layer, sliding_window)
  return o[np.argsort(rows)], kv_cache


def _layout(t: int, cp: int, layout: str) -> np.ndarray:  # [CP, chunks per rank]
  if cp == 1 or layout == "plain":
    return np.arange(cp)[:, None]
  return np.stack([np.arange(cp), 2 * cp - 1 - np.arange(cp)], axis=1)


def _local_slots(slots: jax.Array, rank: jax.Array, per_rank: int, page_size: int) -> jax.Array:
  """Global slots -> this rank's; slots on other ranks point past its pool (dropped)."""
  page = slots // page_size
  mine = page // per_rank == rank
  return jnp.where(mine, (page % per_rank) * page_size + slots % page_size, per_rank * page_size)


def _chunk_metadata(md: AttentionMetadata, table: jax.Array, start: jax.Array,
                    size: int) -> AttentionMetadata:
  """The flat batch's rows [start, start+size) as a ragged batch of their own: each sequence
  keeps the rows it has there; its later rows' keys drop out of `kv_lens` (causality hides
  them anyway) and its earlier rows become cached context."""
  n = md.num_seqs[0]
  cu = jnp.where(jnp.arange(md.cu_q_lens.shape[0]) <= n, md.cu_q_lens, md.cu_q_lens[n])
  end = start + size
  after = jnp.maximum(cu[1:] - jnp.maximum(end, cu[:-1]), 0)  # [S] rows past the chunk
  return AttentionMetadata(
      slot_mapping=jnp.zeros((size,), jnp.int32), block_table=table,
      kv_lens=md.kv_lens - after, cu_q_lens=jnp.clip(cu, start, end) - start,
      num_seqs=md.num_seqs, max_q_len=None if md.max_q_len is None else min(md.max_q_len, size),
      max_prefill_seqs=md.max_prefill_seqs, verify_width=md.verify_width)
