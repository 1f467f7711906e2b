"""Ragged paged attention as a Pallas GPU kernel, lowered through Triton.

Why Triton and not Mosaic GPU (the default lowering since jax 0.9) on Hopper:
- The op is a gather: every KV block is `pages_per_block` pages picked at run time from a page
  table. Triton expresses that as one pointer-gather load; Mosaic GPU needs a TMA copy and an
  mbarrier per page plus hand-managed SMEM stages and layouts.
- Mosaic GPU's matmul is wgmma, which wants 64-row operands per warpgroup; a decode step has
  G = Hq/Hkv query rows per KV head (4-8 for GQA models), so most of each wgmma would be padding.
  Triton picks its MMA tiles itself (16-row minimum).
- Testability: Mosaic GPU's async-copy primitives have no rule in the `interpret=True` interpreter
  of jax 0.10 ("No state discharge rule implemented for primitive: copy_gmem_to_smem"), so such a
  kernel could not run in CI on the CPU; this one does, like jax's own `ops.gpu.paged_attention`.
Cost of the choice: the Pallas Triton backend is deprecated as of jax 0.11 (still shipped there,
due to be removed later); when it goes, this kernel needs a Mosaic GPU rewrite.

Grid: (work item, KV head). A work item is up to `block_rows // G` query tokens of one sequence
(`schedule.seq_q_blocks`), so decode steps get one program per (sequence, KV head) and prefill
chunks several. Each program loads its `[R, D]` query group (rows t*G+g, R a power of two >= 16,
the smallest MMA), loops over blocks of pages and keeps the f32 online-softmax state in
registers. The pages it reads run from the one holding its earliest row's window start to the one
holding its last row's key (`schedule.item_entries`), in block-table order, or with
`md.context_pages` down that list, so a context-parallel rank reads its own pages alone and a
decode row of a sliding-window layer at most window / page_size + 1 pages.

The cache holds every layer in one array; the kernel views it as rows
`[L*num_pages*2*Hkv*page_size, D]` (a free reshape) and offsets its row indices by the layer's
first row, so no layer is sliced out and the layer may be traced. Row indices are int32 (the
wrapper checks the row count fits); Triton turns them into 64-bit offsets for caches over 4 GiB.

The rest of the contract (`AttentionMetadata`):
- K and V are masked loads: keys past kv_len and keys of absent pages (negative block-table
  entries) are not loaded and read as 0, so stale or NaN slots never reach the accumulator.
- Tree mask: each row's bits come packed into int32 words with the row's window lag
  (`schedule.tree_rows`), laid out as `[NW+1, T*G]` rows; a new key is seen iff causal and its bit
  is set. Cost: a few `[R, BK]` integer ops per KV block per 32 columns of `verify_width`, and a
  window loop for tree sequences that starts at their context length. Without a tree mask none
  of this is emitted.
- The sliding window is a scalar operand, so it may be traced; `None` (static) emits no window
  code at all.
- With `return_softmax_state`, a second output `[Hkv, T*G]` f32 holds each row's m + log(l),
  -inf for rows that saw no key (it is aliased with -inf, as the output is with zeros, so rows no
  program owns keep that).

A quantized cache (`kv_cache_layout.QuantizedKVCache`: int8 or fp8 values, a float32 scale per
token and KV head) is viewed the same way, its scales as `[L*num_pages*2*Hkv*page_size]`: a key's
scale sits at its value row's index, so one more masked gather of `[BK]` scales per block brings
them. The block is dequantized in registers by folding the row scales into the products: K's
scales multiply the score columns, V's the probability columns before p @ v (the values convert
to the query dtype exactly), which costs `[R, BK]` multiplies instead of `[BK, D]` ones.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.kv_cache_layout import KVCache, split_cache
from pallas_kernels.ragged_paged_attention.schedule import (item_entries, sanitize_cu_q_lens,
                                                            seq_q_blocks, tree_rows,
                                                            window_operand)

_NEG_INF = -1e30


def _kernel(
    item_seq_ref,  # [NB] sequence of each work item, -1 for unused items
    item_tok_ref,  # [NB] first flat token of each work item
    item_lo_ref,  # [NB] first entry of the walked list the item reads
    item_hi_ref,  # [NB] end entry of it
    kv_lens_ref,  # [S]
    page_indices_ref,  # [S*P]: the walked list (block table, or listed pages)
    page_pos_ref,  # [S*P]: listed pages' indices in their sequence ([1], unread, if not listed)
    cu_q_lens_ref,  # [S+1]
    scalars_ref,  # [2]: layer, sliding window (see `schedule.window_operand`)
    q_ref,  # [Hkv, (T+pad)*G, D]
    kv_ref,  # [L*num_pages*2*Hkv*page_size, D]: the cache (its values) viewed as rows
    *refs,  # [scales_ref], [tree_ref], o_in, [lse_in], [pages_in], o_ref, [lse_ref], [pages_ref]
    block_q: int,
    rows: int,
    group: int,
    num_pages: int,
    num_kv_heads: int,
    page_size: int,
    pages_per_block: int,
    pages_per_seq: int,
    verify_width: int,
    tree_words: int,
    windowed: bool,
    return_lse: bool,
    sm_scale: float,
    soft_cap: float | None,
    k_scale: float | None,
    v_scale: float | None,
    quantized: bool,
    listed: bool,
    count_pages: bool,
):
  # Outputs are aliased with their initial values (o 0, lse -inf, pages 0): rows no program owns
  # keep them.
  refs = list(refs)
  scales_ref = refs.pop(0) if quantized else None  # [L*num_pages*2*Hkv*page_size] f32
  tree_ref = refs.pop(0) if tree_words else None  # [NW+1, (T+pad)*G]: tree words, then lag
  pages_ref = refs.pop() if count_pages else None  # [Hkv, (T+pad)*G] int32
  lse_ref = refs.pop() if return_lse else None  # [Hkv, (T+pad)*G] f32
  o_ref = refs.pop()  # [Hkv, (T+pad)*G, D]
  b, h = pl.program_id(0), pl.program_id(1)
  seq = item_seq_ref[b]
  bk = pages_per_block * page_size
  d = q_ref.shape[-1]

  @pl.when(seq >= 0)
  def _():
    tok0 = item_tok_ref[b]
    q_start, q_end, kv_len = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1], kv_lens_ref[seq]
    ctx = kv_len - (q_end - q_start)  # cached context length
    n_tok = jnp.minimum(block_q, q_end - tok0)
    qpos0 = ctx + tok0 - q_start  # position of the item's first token
    r = jnp.arange(rows, dtype=jnp.int32)
    row_live = r < n_tok * group  # [R]
    # Indices here are non-negative: truncating lax.div/rem skip jnp's floor-division fix-ups.
    qpos = qpos0 + lax.div(r, group)  # [R]
    rows_at = pl.ds(tok0 * group, rows)  # padded inputs keep every [R] slice in bounds
    q = q_ref[h, rows_at, :]  # [R, D]
    words = [tree_ref[w, rows_at] for w in range(tree_words)]  # [R] each

    if windowed:
      window = scalars_ref[1]
      wpos = qpos  # [R]: position of each row for the window
      if tree_words:
        wpos -= tree_ref[tree_words, rows_at]  # lag
      win_lo = wpos - window  # [R]: keys at or before this are out of the window
    kcol = jnp.arange(bk, dtype=jnp.int32)
    # The layer's first row; the row count fits int32 (checked by the wrapper).
    layer_row = scalars_ref[0] * (num_pages * 2 * num_kv_heads * page_size)
    lo, hi = item_lo_ref[b], item_hi_ref[b]

    def body(kb, carry):
      acc, m_prev, l_prev, n_read = carry
      entry = lo + kb * pages_per_block + lax.div(kcol, page_size)  # [BK]
      at = seq * pages_per_seq + jnp.minimum(entry, pages_per_seq - 1)
      page = page_indices_ref[at]  # [BK]
      pos = page_pos_ref[at] if listed else entry  # [BK] page index in the sequence
      kpos = pos * page_size + lax.rem(kcol, page_size)  # [BK]
      # Keys outside the walk or past kv_len (their page-table entries may be anything) and keys
      # of absent pages are not loaded: masked loads give 0 there, so NaN never meets the
      # accumulator. Their rows still point into the sink page, in bounds, as the interpreter
      # gathers before it masks.
      k_read = (entry < hi) & (kpos < kv_len) & (page >= 0)  # [BK]
      if count_pages:  # a page is read iff its first key is
        n_read += jnp.sum((k_read & (lax.rem(kcol, page_size) == 0)).astype(jnp.int32))
      krow = layer_row + (jnp.where(k_read, page, 0) * 2 * num_kv_heads + h) * page_size
      krow += lax.rem(kcol, page_size)
      load_mask = jnp.broadcast_to(k_read[:, None], (bk, d))
      dcol = jnp.arange(d, dtype=jnp.int32)[None, :]
      k = plgpu.load(kv_ref.at[krow[:, None], dcol], mask=load_mask,
                     other=0.0).astype(q.dtype)  # [BK, D]
      v = plgpu.load(kv_ref.at[krow[:, None] + num_kv_heads * page_size, dcol], mask=load_mask,
                     other=0.0).astype(q.dtype)  # [BK, D]
      sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)  # [R, BK]
      if quantized:  # scales of keys not read load as 0
        sc *= plgpu.load(scales_ref.at[krow], mask=k_read, other=0.0)[None, :]
        vs = plgpu.load(scales_ref.at[krow + num_kv_heads * page_size], mask=k_read, other=0.0)
      sc *= sm_scale if k_scale is None else sm_scale * k_scale
      if soft_cap is not None:
        sc = soft_cap * jnp.tanh(sc / soft_cap)
      mask = row_live[:, None] & k_read[None, :] & (kpos[None, :] <= qpos[:, None])
      if tree_words:
        new = kpos - ctx  # [BK]: key index among the sequence's new rows; < 0: context
        seen = ((new < 0) | (new >= 32 * tree_words))[None, :]
        for w in range(tree_words):
          bit = lax.shift_right_logical(words[w][:, None],
                                        jnp.clip(new - 32 * w, 0, 31)[None, :]) & 1  # [R, BK]
          seen |= ((new >= 32 * w) & (new < 32 * w + 32))[None, :] & (bit != 0)
        mask &= seen
      if windowed:
        mask &= kpos[None, :] > win_lo[:, None]
      sc = jnp.where(mask, sc, _NEG_INF)
      m_next = jnp.maximum(m_prev, jnp.max(sc, axis=1))  # [R]
      p = jnp.where(mask, jnp.exp(sc - m_next[:, None]), 0.0)  # [R, BK]
      alpha = jnp.exp(m_prev - m_next)
      l_next = alpha * l_prev + jnp.sum(p, axis=1)  # of the unscaled probabilities
      if quantized:
        p = p * vs[None, :]
      pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)  # [R, D]
      return alpha[:, None] * acc + pv, m_next, l_next, n_read

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _NEG_INF, jnp.float32),
            jnp.zeros((rows,), jnp.float32), jnp.int32(0))
    acc, m, l, n_read = lax.fori_loop(0, lax.div(hi - lo + pages_per_block - 1, pages_per_block),
                                      body, init)
    seen_any = l > 0.0  # [R]; rows whose every key was absent or masked come out 0, lse -inf
    l_safe = jnp.where(seen_any, l, 1.0)
    out = acc / l_safe[:, None]
    if v_scale is not None:
      out *= v_scale
    # Rows past the item's tokens belong to the next item or sequence: masked out of the store.
    plgpu.store(o_ref.at[h, rows_at, :], out.astype(o_ref.dtype),
                mask=jnp.broadcast_to(row_live[:, None], (rows, d)))
    if return_lse:
      plgpu.store(lse_ref.at[h, rows_at], jnp.where(seen_any, m + jnp.log(l_safe), -jnp.inf),
                  mask=row_live)
    if count_pages:
      plgpu.store(pages_ref.at[h, rows_at], jnp.full((rows,), n_read, jnp.int32), mask=row_live)


# Keys per KV block: with head_dim 128 in bf16, K and V of 128 keys and their double buffer fit
# the shared memory of every GPU the kernel targets (the compile-only tier builds it for H100).
MAX_BLOCK_KEYS = 128


def ragged_paged_attention_gpu(
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
    block_rows: int = 64,
    pages_per_block: int = 8,
    num_warps: int = 4,
    num_stages: int = 2,
    count_pages: bool = False,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, ...]:  # [T, Hq, D] (, lse [T, Hq] float32) (, pages [T])
  """Same contract as the reference.

  block_rows: query rows (tokens x G) per program; tokens per program = max(1, block_rows // G),
    capped by `md.max_q_len`. head_dim, page_size and pages_per_block must be powers of two with
    head_dim >= 16 and pages_per_block * page_size >= 16 (Triton block shapes, smallest MMA);
    pages_per_block is capped at MAX_BLOCK_KEYS // page_size (shared memory).
  count_pages: also return, per query token, how many pages its program read (a debug output:
    what the walk reads, for tests and the docs' figures).
  """
  t, hq, d = q.shape
  values, scales = split_cache(kv_cache)
  quantized = scales is not None
  num_layers, num_pages, _, hkv, page_size, _ = values.shape
  s, p = md.block_table.shape
  max_len = p * page_size  # bounds every position
  listed = md.context_pages is not None
  if listed:  # the walk goes down the listed pages: [S, P'] each
    pages, page_pos = md.context_pages.astype(jnp.int32), md.context_page_pos.astype(jnp.int32)
    p = pages.shape[1]
  else:
    pages, page_pos = md.block_table.astype(jnp.int32), None
  g = hq // hkv
  # Checked in interpret mode too, so CPU tests catch a model or cache the GPU could not run.
  if d < 16 or d & (d - 1):
    raise ValueError(f"the Triton kernel needs a power-of-two head_dim >= 16, got {d}")
  num_rows = num_layers * num_pages * 2 * hkv * page_size
  if num_rows >= 2**31:
    raise ValueError(f"the cache has {num_rows} rows of head_dim; row indices are int32")
  block_q = max(1, block_rows // g)
  if md.max_q_len is not None:
    block_q = min(block_q, md.max_q_len)
  rows = max(16, pl.next_power_of_2(block_q * g))
  # A power of two even past the table's width: slots past it are clamped and masked as dead.
  # At most MAX_BLOCK_KEYS keys per block (one page if pages are larger): the H100 build of 8
  # pages of 128 tokens asked for 548 KiB of shared memory, where 227 KiB are the limit.
  ppb = min(pages_per_block, pl.next_power_of_2(p), max(1, MAX_BLOCK_KEYS // page_size))
  num_items = pl.cdiv(t, block_q) + s
  if md.max_q_len is not None:
    num_items = min(num_items, s * pl.cdiv(md.max_q_len, block_q))

  cu = sanitize_cu_q_lens(md.cu_q_lens.astype(jnp.int32), md.num_seqs)
  item_seq, item_tok = seq_q_blocks(cu, block_q, num_items)
  window = None if sliding_window is None else window_operand(sliding_window, max_len)
  item_lo, item_hi = item_entries(
      item_seq, item_tok, cu, md.kv_lens.astype(jnp.int32), page_pos, block_q=block_q,
      page_size=page_size, window=window,
      tree_width=None if md.tree_mask is None else md.verify_width)
  scalars = jnp.stack([jnp.asarray(layer, jnp.int32),
                       jnp.int32(0) if window is None else window])
  # Rows t*G+g, plus `rows` spare ones so every [R] slice is in bounds.
  t_pad = t + pl.cdiv(rows, g)
  # [T, Hq, D] -> [Hkv, T_pad*G, D]: a KV head's query group becomes contiguous rows.
  qr = jnp.pad(q, ((0, t_pad - t), (0, 0), (0, 0)))
  qr = qr.reshape(t_pad, hkv, g, d).transpose(1, 0, 2, 3).reshape(hkv, t_pad * g, d)
  inputs = [item_seq, item_tok, item_lo, item_hi, md.kv_lens.astype(jnp.int32),
            pages.reshape(-1), jnp.zeros((1,), jnp.int32) if page_pos is None else
            page_pos.reshape(-1), cu, scalars, qr, values.reshape(num_rows, d)]
  if quantized:
    inputs.append(scales.reshape(num_rows))
  tree_words = 0
  if md.tree_mask is not None:
    words, lag = tree_rows(md.tree_mask, cu, md.num_seqs)  # [T, NW], [T]
    tree_words = words.shape[1]
    tree = jnp.pad(jnp.concatenate([words, lag[:, None]], axis=1), ((0, t_pad - t), (0, 0)))
    inputs.append(jnp.repeat(tree, g, axis=0).T)  # [NW+1, T_pad*G]
  out_shape = [jax.ShapeDtypeStruct(qr.shape, q.dtype)]
  inputs.append(jnp.zeros_like(qr))
  if return_softmax_state:
    out_shape.append(jax.ShapeDtypeStruct((hkv, t_pad * g), jnp.float32))
    inputs.append(jnp.full((hkv, t_pad * g), -jnp.inf, jnp.float32))
  if count_pages:
    out_shape.append(jax.ShapeDtypeStruct((hkv, t_pad * g), jnp.int32))
    inputs.append(jnp.zeros((hkv, t_pad * g), jnp.int32))
  n_out = len(out_shape)

  kernel = functools.partial(
      _kernel, block_q=block_q, rows=rows, group=g, num_pages=num_pages, num_kv_heads=hkv,
      page_size=page_size, pages_per_block=ppb, pages_per_seq=p, verify_width=md.verify_width,
      tree_words=tree_words, windowed=sliding_window is not None,
      return_lse=return_softmax_state, sm_scale=sm_scale, soft_cap=soft_cap, k_scale=k_scale,
      v_scale=v_scale, quantized=quantized, listed=listed, count_pages=count_pages)
  res = pl.pallas_call(
      kernel,
      grid=(num_items, hkv),
      out_shape=out_shape,
      input_output_aliases={len(inputs) - n_out + j: j for j in range(n_out)},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="ragged_paged_attention",
  )(*inputs)
  res = list(res)
  out = [res.pop(0).reshape(hkv, t_pad, g, d).transpose(1, 0, 2, 3).reshape(t_pad, hq, d)[:t]]
  if return_softmax_state:
    out.append(res.pop(0).reshape(hkv, t_pad, g).transpose(1, 0, 2).reshape(t_pad, hq)[:t])
  if count_pages:
    out.append(res.pop(0)[0, ::g][:t])  # every head and row of a token reads the same pages
  return out[0] if len(out) == 1 else tuple(out)
