"""Ragged paged attention as a Mosaic TPU kernel.

Grid: one program per block of `block_q` flat query tokens, all heads at once. A block may hold
rows of several sequences (decode batches put one row per sequence in it), so each program walks
the sequences overlapping its block and, for each, the blocks of `pages_per_block` pages its rows
need; rows of other sequences are masked out of that step's online-softmax update. Why this shape:
- output blocks are fixed, aligned tiles of the flat token axis, so plain BlockSpecs pipeline q and
  the output and no two programs ever write the same rows;
- a page holds every KV head (`[2, Hkv, page_size, D]` contiguous in the layout), so one DMA per
  page brings K and V of all heads: few large copies instead of 2*Hkv small ones;
- the walk is precomputed per block (`schedule.q_block_seq_ranges`), so nothing is carried from one
  grid step to the next and the grid axis is "parallel" (megacore may split it).
Queries are regrouped outside the kernel to `[Hkv, T*G, D]` (row t*G+g is query head h*G+g of token
t), so a KV head's whole query group is one 2-D `[R, D]` operand of the MXU, R = block_q*G.

The KV cache (every layer, one array) stays in HBM (`pl.ANY`); pages are DMA'd from
`kv_cache.at[layer, page]`, the layer a scalar-prefetch value (traced under a layer scan; no layer
is ever sliced out), a block at a time into a two-slot VMEM buffer: the next block (possibly of the
next sequence) is in flight while the current one is computed. Online-softmax state (`acc`, `m`,
`l`) lives in f32 VMEM scratch.

The rest of the contract (`AttentionMetadata`):
- What a sequence's rows read: the pages from the one holding the earliest row's window start
  (a page, not an aligned block: a decode row reads at most window / page_size + 1 pages) to the
  one holding the last row's key, in block-table order, or with `md.context_pages` down that
  list (the two ends found by a binary search of the listed positions), so a context-parallel
  rank walks its own pages alone. Pages outside are never copied or walked.
- Absent pages (negative entries) are never copied; their keys are masked and V is zeroed there
  (the buffer holds stale VMEM). A KV block with no page to read skips its compute; it is still
  walked, for a few scalar reads.
- Tree mask: each row's bits come packed into int32 words with the row's window lag
  (`schedule.tree_rows`), expanded to the kernel's rows as an `[NW+1, R, 1]` block per program;
  a new key is seen iff causal and its bit is set. Cost: a few `[R, BK]` integer ops per KV block
  per 32 columns of `verify_width`, shared by all heads, and a window walk for tree sequences that
  starts at their context length. Without a tree mask none of this is emitted.
- The sliding window is a scalar-prefetch value, so it may be traced; `None` (static) emits no
  window code at all.
- With `return_softmax_state`, a second output holds each row's m + log(l) (`[Hkv, R, 1]` blocks,
  f32), -inf for rows that saw no key.

A quantized cache (`kv_cache_layout.QuantizedKVCache`, int8 or fp8 values with a float32 scale
per token and KV head) travels the same way: each page's `[2, Hkv, page_size]` scales are a second
DMA on the page's semaphore, into a `[2 slots, pages_per_block, 2, Hkv, page_size]` VMEM buffer.
The tile is dequantized in VMEM by folding the row scales into the products rather than into the
`[BK, D]` tiles: K's scales multiply the score columns (q.(s k) = s (q.k)) and V's the
probability columns before p @ v, each one `[1, BK]` row of a KV head's scales (its pages' rows
side by side), so the values feed the MXU as they are (int8 and e4m3 convert to bf16 exactly).
`page_size` should be a multiple of 32 with int8 values (their sublane tiling), and ideally of
128, so each page's scales fill whole lanes.

Written within the interpreter's limits so it runs on CPU with `interpret=True` and
`interpret=pltpu.InterpretParams(detect_races=True)`: no ref reshapes or bitcasts, no strided
loads, no masked stores, nothing written to scalar-prefetch refs.
"""
from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.kv_cache_layout import KVCache, split_cache
from pallas_kernels.ragged_paged_attention.schedule import (q_block_seq_ranges, sanitize_cu_q_lens,
                                                            tree_rows, window_operand)

_NEG_INF = -1e30


def _cdiv(a: jax.Array, b: int) -> jax.Array:
  # Operands are non-negative, so truncating division is exact; jnp's floor division would emit
  # a sign fix-up whose Mosaic lowering queries the chip.
  return lax.div(a + b - 1, b)


def _kernel(
    # Scalar prefetch (SMEM).
    scalars_ref,  # [2]: layer, sliding window (see `schedule.window_operand`)
    kv_lens_ref,  # [S]
    page_indices_ref,  # [S*P] (flat: 2-D SMEM arrays pad their last axis): the walked list
    cu_q_lens_ref,  # [S+1]
    seq_lo_ref,  # [NQB]
    seq_hi_ref,  # [NQB]
    page_pos_ref,  # [S*P] listed pages' indices in their sequence, -1 pads ([1], unread, if not)
    # Inputs.
    q_ref,  # [Hkv, R, D] VMEM block
    kv_hbm,  # [L, num_pages, 2, Hkv, page_size, D] in HBM (int8 / fp8 values if quantized)
    *refs,  # [scales_hbm], [tree_ref], o_ref, [lse_ref], [pages_ref], then the scratch below
    block_q: int,
    pages_per_block: int,
    pages_per_seq: int,
    num_seq_slots: int,
    group: int,
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
  refs = list(refs)
  scales_hbm = refs.pop(0) if quantized else None  # [L, num_pages, 2, Hkv, page_size] f32, HBM
  tree_ref = refs.pop(0) if tree_words else None  # [NW+1, R, 1]: tree words, then lag
  o_ref = refs.pop(0)  # [Hkv, R, D] VMEM block
  lse_ref = refs.pop(0) if return_lse else None  # [Hkv, R, 1] VMEM block
  pages_ref = refs.pop(0) if count_pages else None  # [R, 1] int32 VMEM block
  scale_buf = refs.pop(0) if quantized else None  # [2 slots, PPB, 2, Hkv, page_size] f32
  (kv_buf,  # [2 slots, 2, Hkv, BK, D]
   sems,  # DMA [2 slots]
   acc_ref,  # [Hkv, R, D] f32
   m_ref,  # [Hkv, R, 1] f32
   l_ref,  # [Hkv, R, 1] f32
   *count,  # [R, 1] int32 with count_pages: pages copied for each row's sequence so far
  ) = refs
  count_ref = count[0] if count_pages else None
  hkv, rows, _ = q_ref.shape
  page_size = kv_hbm.shape[4]
  bk = pages_per_block * page_size
  i = pl.program_id(0)
  blk_lo = i * block_q
  blk_hi = blk_lo + block_q
  seq_hi = seq_hi_ref[i]
  layer, window = scalars_ref[0], scalars_ref[1]

  def seq_info(s):
    # Scalars of sequence s as seen from this block. Query token t sits at position base + t.
    s = jnp.minimum(s, num_seq_slots - 1)  # loop conditions evaluate one index past the end
    q_start, q_end = cu_q_lens_ref[s], cu_q_lens_ref[s + 1]
    t_lo, t_hi = jnp.maximum(q_start, blk_lo), jnp.minimum(q_end, blk_hi)
    base = kv_lens_ref[s] - q_end
    key_end = base + t_hi  # keys at positions >= this are past every query of the block
    return s, q_start, q_end, t_lo, t_hi, base, key_end

  def lower_bound(row, page):
    # First listed entry of the sequence at or after page index `page` (pads, -1, sit past all):
    # a binary search of the sorted positions, log2(P) scalar reads.
    def body(c):
      lo, hi = c
      mid = lax.div(lo + hi, 2)
      pos = page_pos_ref[row + mid]
      before = (pos >= 0) & (pos < page)
      return jnp.where(before, mid + 1, lo), jnp.where(before, hi, mid)

    return lax.while_loop(lambda c: c[0] < c[1], body, (jnp.int32(0), jnp.int32(pages_per_seq)))[0]

  def entries(s):
    # Half-open range of the walked list's entries (block-table columns, or listed pages) whose
    # pages hold a key some row of this block of s may see: from the page of the earliest
    # window start among the rows to the page of the last key. Empty when lo >= hi.
    s, q_start, q_end, t_lo, t_hi, base, key_end = seq_info(s)
    hi = jnp.where(t_hi > t_lo, _cdiv(key_end, page_size), 0)
    lo = jnp.int32(0)
    if windowed:
      first_pos = base + t_lo  # the earliest window position among the block's rows of s
      if tree_words:
        # A tree row's window position is the context length plus its depth, at least the former.
        first_pos = jnp.where(q_end - q_start <= verify_width, base + q_start, first_pos)
      lo = lax.div(jnp.maximum(first_pos - window + 1, 0), page_size)
    if listed:
      row = s * pages_per_seq
      return lower_bound(row, lo), lower_bound(row, hi)
    return lo, hi

  def first_block_from(s):
    # (sequence, first entry, end entry) of the first sequence at or after s with keys to read
    # for this block; the sequence is seq_hi when none is left.
    def body(c):
      s = c[0] + 1
      return (s, *entries(s))

    return lax.while_loop(lambda c: (c[0] < seq_hi) & (c[1] >= c[2]), body, (s, *entries(s)))

  def next_block(s, e, e_end):
    return lax.cond(e + pages_per_block < e_end, lambda: (s, e + pages_per_block, e_end),
                    lambda: first_block_from(s + 1))

  def block_pages(s, e, e_end):
    # Page j of the block (entry e + j): its cache page, its index in the sequence, and whether
    # to read it (walked, and present in this cache). Entries past e_end may be anything.
    row = jnp.minimum(s, num_seq_slots - 1) * pages_per_seq

    def page(j):
      at = row + jnp.minimum(e + j, pages_per_seq - 1)
      pg = page_indices_ref[at]
      pos = page_pos_ref[at] if listed else e + j
      return pg, pos, (j < e_end - e) & (pg >= 0)

    return page

  def for_each_page_copy(s, e, e_end, slot, action):
    # One DMA per page read; absent pages and pages outside the walk are never touched.
    # All copies of a slot count on that slot's semaphore.
    page = block_pages(s, e, e_end)

    def one(j, carry):
      pg, _, read = page(j)

      @pl.when(read)
      def _():
        action(pltpu.make_async_copy(
            kv_hbm.at[layer, pg], kv_buf.at[slot, :, :, pl.ds(j * page_size, page_size), :],
            sems.at[slot]))
        if quantized:
          action(pltpu.make_async_copy(scales_hbm.at[layer, pg], scale_buf.at[slot, j],
                                       sems.at[slot]))

      return carry

    lax.fori_loop(0, pages_per_block, one, 0)

  def start_fetch(s, e, e_end, slot):
    for_each_page_copy(s, e, e_end, slot, lambda c: c.start())

  def wait_fetch(s, e, e_end, slot):
    for_each_page_copy(s, e, e_end, slot, lambda c: c.wait())

  def compute(s, e, e_end, slot):
    _, q_start, _, t_lo, t_hi, base, key_end = seq_info(s)
    # Key columns of pages read in this block; the rest of the buffer is stale or uninitialized
    # VMEM, or NaN past kv_len. Masked scores are replaced, but V must be zeroed there too, or
    # 0 * NaN would reach the accumulator.
    page = block_pages(s, e, e_end)
    pages = [page(j) for j in range(pages_per_block)]
    reads = [read for _, _, read in pages]

    def columns_read(col):  # col: key columns of the block, as a row or a column vector
      # An empty range for a page not read: scalar selects, then plain vector compares.
      return functools.reduce(operator.or_, [
          (col >= j * page_size) & (col < jnp.where(read, (j + 1) * page_size, j * page_size))
          for j, read in enumerate(reads)])

    def key_pos(col):  # positions of the block's key columns
      if not listed:  # consecutive pages
        return e * page_size + col
      # Listed pages may be far apart: column c of page j sits at pos_j * page_size + c % ps.
      shift = jnp.zeros_like(col)
      for j, (_, pos, _) in enumerate(pages):
        shift = jnp.where((col >= j * page_size) & (col < (j + 1) * page_size),
                          (pos - j) * page_size, shift)
      return col + shift

    col_v = lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
    col_k = lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    kpos_k = key_pos(col_k)  # [1, BK]
    k_read = columns_read(col_k)  # [1, BK]
    v_read = columns_read(col_v) & (key_pos(col_v) < key_end)  # [BK, 1]
    any_read = functools.reduce(operator.or_, reads)
    r = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    rows_of_s = (r >= (t_lo - blk_lo) * group) & (r < (t_hi - blk_lo) * group)  # [R, 1]
    if count_pages:
      n_read = functools.reduce(operator.add, [read.astype(jnp.int32) for read in reads])
      count_ref[...] += jnp.where(rows_of_s, n_read, 0)

    def scale_row(kv, h):  # [1, BK]: K (kv=0) or V (1) scales of head h, the block's pages in order
      rows = [scale_buf[slot, j, kv, pl.ds(h, 1), :] for j in range(pages_per_block)]  # [1, ps]
      return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1)

    if quantized:  # V's scales as a row: stale or NaN ones outside the keys read would meet p == 0
      vs_read = k_read & (kpos_k < key_end)  # [1, BK]

    # A block of absent pages only: nothing to add.
    @pl.when(any_read)
    def _():
      # Row r is token blk_lo + r // G; compare through r and G so no vector division is needed.
      kpos = jnp.broadcast_to(kpos_k, (rows, bk))
      qbase = base + blk_lo  # position of the block's first token
      mask = rows_of_s & k_read
      mask &= r >= (kpos - qbase) * group  # causal: key pos <= query pos
      if tree_words:
        new = kpos - (base + q_start)  # key index among the sequence's new rows; < 0: context
        seen = (new < 0) | (new >= 32 * tree_words)
        for w in range(tree_words):
          bit = lax.shift_right_logical(tree_ref[w], jnp.clip(new - 32 * w, 0, 31)) & 1
          seen |= (new >= 32 * w) & (new < 32 * w + 32) & (bit != 0)
        mask &= seen
      if windowed:
        edge = kpos + window - qbase  # the window holds the key for rows r < edge * G
        if tree_words:
          edge += tree_ref[tree_words]  # [R, 1] lag: tree rows sit at their depth
        mask &= r < edge * group

      def head(h, carry):
        q = q_ref[h]  # [R, D]
        k = kv_buf[slot, 0, h].astype(q.dtype)  # [BK, D]
        v = kv_buf[slot, 1, h].astype(q.dtype)  # [BK, D]
        sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)  # [R, BK]
        if quantized:
          sc *= scale_row(0, h)  # masked below where a column was not read
        sc *= sm_scale if k_scale is None else sm_scale * k_scale
        if soft_cap is not None:
          sc = soft_cap * jnp.tanh(sc / soft_cap)
        sc = jnp.where(mask, sc, _NEG_INF)
        m_prev, l_prev = m_ref[h], l_ref[h]  # [R, 1]
        m_next = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(sc - m_next), 0.0)  # [R, BK]
        alpha = jnp.exp(m_prev - m_next)
        l_ref[h] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        m_ref[h] = m_next
        v = jnp.where(v_read, v, jnp.zeros_like(v))
        if quantized:  # l above sums the unscaled probabilities
          p = p * jnp.where(vs_read, scale_row(1, h), 0.0)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)  # [R, D]
        acc_ref[h] = alpha * acc_ref[h] + pv
        return carry

      lax.fori_loop(0, hkv, head, 0)

  acc_ref[...] = jnp.zeros_like(acc_ref)
  m_ref[...] = jnp.full_like(m_ref, _NEG_INF)
  l_ref[...] = jnp.zeros_like(l_ref)

  if count_pages:
    count_ref[...] = jnp.zeros_like(count_ref)
  first = first_block_from(seq_lo_ref[i])  # (sequence, entry, end entry)

  @pl.when(first[0] < seq_hi)
  def _():
    start_fetch(*first, 0)

  def body(carry):
    *block, slot = carry
    after = next_block(*block)

    @pl.when(after[0] < seq_hi)
    def _():
      start_fetch(*after, 1 - slot)

    wait_fetch(*block, slot)
    compute(*block, slot)
    return (*after, 1 - slot)

  lax.while_loop(lambda c: c[0] < seq_hi, body, (*first, jnp.int32(0)))
  if count_pages:
    pages_ref[...] = count_ref[...]

  # Rows no key reached (padding tokens, or every key absent) have l == 0 and acc == 0: they come
  # out zero, with lse = -inf.
  l = l_ref[...]
  out = acc_ref[...] / jnp.where(l == 0.0, 1.0, l)
  if v_scale is not None:
    out *= v_scale
  o_ref[...] = out.astype(o_ref.dtype)
  if return_lse:
    lse_ref[...] = jnp.where(l == 0.0, -jnp.inf, m_ref[...] + jnp.log(jnp.where(l == 0.0, 1.0, l)))


def ragged_paged_attention_tpu(
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
    block_q: int = 32,
    pages_per_block: int = 8,
    vmem_limit_bytes: int | None = None,
    count_pages: bool = False,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array | tuple[jax.Array, ...]:  # [T, Hq, D] (, lse [T, Hq] float32) (, pages [T])
  """Same contract as the reference. `md.max_q_len` is not needed: cost follows the real rows.

  block_q: flat query tokens per program. block_q * Hq / Hkv should be a multiple of 8 (16 for
    16-bit queries) to tile VMEM; decode-heavy steps waste fewer masked rows with a smaller one.
  pages_per_block: pages per KV block (one DMA each, double-buffered). page_size should be a
    multiple of the KV dtype's sublane tiling (8 for 32-bit, 16 for 16-bit, 32 for 8-bit) so
    each page lands on a tile boundary of the VMEM buffer.
  count_pages: also return, per query token, how many pages its program copied for its
    sequence (a debug output: what the walk reads, for tests and the docs' figures).
  """
  t, hq, d = q.shape
  values, scales = split_cache(kv_cache)
  quantized = scales is not None
  _, _, _, hkv, page_size, _ = values.shape
  s, p = md.block_table.shape
  max_len = p * page_size  # bounds every position
  listed = md.context_pages is not None
  if listed:  # the walk goes down the listed pages: [S, P'] each
    pages, page_pos = md.context_pages.astype(jnp.int32), md.context_page_pos.astype(jnp.int32)
    p = pages.shape[1]
  else:
    pages, page_pos = md.block_table.astype(jnp.int32), jnp.zeros((1,), jnp.int32)
  g = hq // hkv
  ppb = min(pages_per_block, p)
  nqb = pl.cdiv(t, block_q)
  t_pad = nqb * block_q
  rows = block_q * g

  cu = sanitize_cu_q_lens(md.cu_q_lens.astype(jnp.int32), md.num_seqs)
  seq_lo, seq_hi = q_block_seq_ranges(cu, md.num_seqs, block_q, nqb)
  scalars = jnp.stack([jnp.asarray(layer, jnp.int32),
                       window_operand(sliding_window, max_len)])

  # [T, Hq, D] -> [Hkv, T_pad*G, D]: a KV head's query group becomes contiguous rows.
  qr = jnp.pad(q, ((0, t_pad - t), (0, 0), (0, 0)))
  qr = qr.reshape(t_pad, hkv, g, d).transpose(1, 0, 2, 3).reshape(hkv, t_pad * g, d)
  block = pl.BlockSpec((hkv, rows, d), lambda i, *_: (0, i, 0))
  inputs, in_specs = [qr, values], [block, pl.BlockSpec(memory_space=pl.ANY)]
  if quantized:
    inputs.append(scales)
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
  tree_words = 0
  if md.tree_mask is not None:
    words, lag = tree_rows(md.tree_mask, cu, md.num_seqs)  # [T, NW], [T]
    tree_words = words.shape[1]
    tree = jnp.pad(jnp.concatenate([words, lag[:, None]], axis=1), ((0, t_pad - t), (0, 0)))
    # [NW+1, T_pad*G, 1], row t*G+g for token t: a leading index picks one [R, 1] column, so
    # the kernel never slices lanes.
    inputs.append(jnp.repeat(tree, g, axis=0).T[:, :, None])
    in_specs.append(pl.BlockSpec((tree_words + 1, rows, 1), lambda i, *_: (0, i, 0)))
  out_shape = [jax.ShapeDtypeStruct((hkv, t_pad * g, d), q.dtype)]
  out_specs = [block]
  if return_softmax_state:
    out_shape.append(jax.ShapeDtypeStruct((hkv, t_pad * g, 1), jnp.float32))
    out_specs.append(pl.BlockSpec((hkv, rows, 1), lambda i, *_: (0, i, 0)))
  if count_pages:
    out_shape.append(jax.ShapeDtypeStruct((t_pad * g, 1), jnp.int32))
    out_specs.append(pl.BlockSpec((rows, 1), lambda i, *_: (i, 0)))

  kernel = functools.partial(
      _kernel, block_q=block_q, pages_per_block=ppb, pages_per_seq=p, num_seq_slots=s, group=g,
      verify_width=md.verify_width, tree_words=tree_words, windowed=sliding_window is not None,
      return_lse=return_softmax_state, sm_scale=sm_scale, soft_cap=soft_cap, k_scale=k_scale,
      v_scale=v_scale, quantized=quantized, listed=listed, count_pages=count_pages)
  scale_scratch = [pltpu.VMEM((2, ppb, 2, hkv, page_size), scales.dtype)] if quantized else []
  count_scratch = [pltpu.VMEM((rows, 1), jnp.int32)] if count_pages else []
  res = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=7,
          grid=(nqb,),
          in_specs=in_specs,
          out_specs=out_specs,
          scratch_shapes=scale_scratch + [
              pltpu.VMEM((2, 2, hkv, ppb * page_size, d), values.dtype),
              pltpu.SemaphoreType.DMA((2,)),
              pltpu.VMEM((hkv, rows, d), jnp.float32),
              pltpu.VMEM((hkv, rows, 1), jnp.float32),
              pltpu.VMEM((hkv, rows, 1), jnp.float32),
          ] + count_scratch,
      ),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel",), vmem_limit_bytes=vmem_limit_bytes),
      interpret=interpret,
      name="ragged_paged_attention",
  )(scalars, md.kv_lens.astype(jnp.int32), pages.reshape(-1), cu, seq_lo, seq_hi,
    page_pos.reshape(-1), *inputs)
  res = list(res)
  out = [res.pop(0).reshape(hkv, t_pad, g, d).transpose(1, 0, 2, 3).reshape(t_pad, hq, d)[:t]]
  if return_softmax_state:
    out.append(res.pop(0).reshape(hkv, t_pad, g).transpose(1, 0, 2).reshape(t_pad, hq)[:t])
  if count_pages:
    out.append(res.pop(0)[::g, 0][:t])  # the rows of a token share their count
  return out[0] if len(out) == 1 else tuple(out)
