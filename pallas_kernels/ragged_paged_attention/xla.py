"""Ragged paged attention in tuned pure jnp: the path that runs on XLA:CPU.

Every row's keys split in two, each with its own online softmax, merged at the end:
  * this step's keys (the last `q_len` of each sequence): they sit in the flat batch beside the
    queries, so tiles of rows attend to earlier tiles block-causally (or by the tree mask), from
    the tile where the row's sequence starts. No page is gathered and no padding row is computed.
  * the context (keys cached by earlier steps): decode and verify rows (`q_len <= verify_width`)
    read it a block of pages at a time for all those sequences at once, `verify_width` row slots
    each; a prefill chunk's rows read it per sequence, tile by tile. Loops stop at the longest
    context, so cost follows the batch, not `max_model_len`.
On XLA:CPU (2 cores, SmolLM2 heads) this took one layer's 512-token prefill from 20.5 ms to
5.6 ms and a step of 448 prefill rows beside 63 decodes from 23.9 to 10.5 ms, against padding
every prefill chunk to `T` rows over all of its keys.
A quantized cache (int8 / fp8 values, a scale per token and KV head) is read as its values
converted to float32, with the scales folded into the context loops' scores (K) and probabilities
(V) instead of multiplied into every value: with SmolLM2's heads that is 1/21 of the multiplies,
and it took a 32-sequence decode over 192 keys each from 1.45 ms a layer (values scaled) to
0.65 ms, against 0.8 ms over float32 pages. This step's own keys are dequantized as they are read.

Decode-only form: when the step statically holds no prefill chunk (`md.max_q_len <=
verify_width`, or `T <= verify_width`: the engine's one-token step, a verify step of at most
k + 1 rows, a draft model's decode pass), every sequence's new keys sit among its own
`verify_width` row slots, so they start the context pass's softmax directly (by the tree mask,
else causally) and the row tiles' loops, the scatter of the context state to rows and the merge
are not built: one loop per layer instead of four (the binary search of rows' sequences becomes
a comparison of every row with every start, cheap where T <= S * verify_width). On the CPU the
one-token step's layers are unrolled and its attention was ~10 of its ~16 s to compile;
SmolLM2's one-token step compiled in a median 11.0 s against 16.2 s (three rounds each, loaded
2-core CPU; docs/performance.md), though its optimized HLO is no smaller (~30k instructions:
XLA:CPU fuses the integer bookkeeping into every kernel that reads it, and that copy dominates).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.kv_cache_layout import KVCache, split_cache

_NEG_INF = -1e30


def _update(state, s, mask, pv):
  """One online-softmax step. state = (m, l, acc); s: scores with keys last; mask broadcasts
  against s; pv(p) multiplies probabilities by values (whose invalid rows must be zero, as
  0 * NaN = NaN)."""
  m, l, acc = state
  s = jnp.where(mask, s, _NEG_INF)
  m_new = jnp.maximum(m, s.max(axis=-1))
  p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
  alpha = jnp.exp(m - m_new)
  return m_new, l * alpha + p.sum(axis=-1), acc * alpha[..., None] + pv(p)


def _merge(a, b):
  """Combine two partial softmax states over disjoint key sets."""
  m = jnp.maximum(a[0], b[0])
  wa, wb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
  return m, a[1] * wa + b[1] * wb, a[2] * wa[..., None] + b[2] * wb[..., None]


# Jitted with the layer and the window as traced values: a model whose layers are unrolled calls
# this once per layer, and every call after the first reuses the first one's trace instead of
# tracing it again (it took SmolLM2's unrolled one-token step from 2.2 to ~0.7 s to trace and
# lower when loaded from the compilation cache). XLA inlines the calls; the program is the same.
@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "soft_cap", "k_scale", "v_scale", "return_softmax_state", "block_q",
    "pages_per_block"))
def ragged_paged_attention_xla(
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
    block_q: int = 256,
    pages_per_block: int | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [T, Hq, D] (, lse [T, Hq] float32)
  """`block_q` is the row tile (256 measured best on XLA:CPU); `pages_per_block` how many pages
  of each sequence one step of the context loops reads (default: by batch size)."""
  t, hq, d = q.shape
  page_indices = md.block_table
  s_max, p_max = page_indices.shape
  values, kv_scales = split_cache(kv_cache)
  _, _, _, hkv, page_size, _ = values.shape
  gq = hq // hkv
  w = md.verify_width
  max_q = md.max_q_len
  multi_query = t > w and (max_q is None or max_q > w)  # else no prefill chunk exists
  sp = s_max if md.max_prefill_seqs is None else min(md.max_prefill_seqs, s_max)
  f32 = jnp.float32

  def scores(qt, k, spec, key_scales=None):  # key_scales: a quantized cache's, keys last
    x = jnp.einsum(spec, qt, k)
    x = (x if key_scales is None else x * key_scales) * sm_scale
    return x if soft_cap is None else soft_cap * jnp.tanh(x / soft_cap)

  def load_raw(pages, *rest):
    """K and V at kv_cache[layer, page, {0, 1}, *rest] as float32, and a quantized cache's
    scales of them (which index like the values, less head_dim), else None."""
    # K and V are gathered apart: gathering whole pages and slicing them apart costs a copy.
    # Absent pages (negative ids) read page 0; callers mask their keys. No index is negative,
    # so none is wrapped (the wrapping's selects end up in every kernel the gather feeds).
    pages = jnp.maximum(pages, 0)
    at = [(layer, pages, i) + rest for i in (0, 1)]
    get = lambda x, a: x.at[a].get(wrap_negative_indices=False)
    k, v = (get(values, a).astype(f32) for a in at)
    k, v = (k if k_scale is None else k * k_scale), (v if v_scale is None else v * v_scale)
    return k, v, *((None, None) if kv_scales is None else (get(kv_scales, a) for a in at))

  def load(pages, *rest):  # K and V, dequantized
    k, v, ks, vs = load_raw(pages, *rest)
    return (k, v) if ks is None else (k * ks[..., None], v * vs[..., None])

  def window(kpos, qpos):  # keys a query at qpos may see, besides causality
    return True if sliding_window is None else kpos > qpos - sliding_window

  # The pages the context loops walk, and each one's index among its sequence's pages (None:
  # the block table's entries in order, whose index is their column).
  if md.context_pages is None:
    ctx_table, ctx_pos = page_indices, None
  else:
    ctx_table, ctx_pos = md.context_pages, md.context_page_pos

  def blocked_table(ppb):
    """ppb clipped to the table, the tables padded to whole blocks of ppb pages, keys per block."""
    ppb = min(ppb, ctx_table.shape[1])
    pad = lambda x: None if x is None else jnp.pad(
        x, ((0, 0), (0, -x.shape[1] % ppb)), constant_values=-1)
    return ppb, pad(ctx_table), pad(ctx_pos), ppb * page_size

  def key_positions(pos_table, first, ppb):  # [S or 1, ppb, page_size] of the block at `first`
    if pos_table is None:
      return (first * page_size + jnp.arange(ppb * page_size)).reshape(1, ppb, page_size)
    pos = jax.lax.dynamic_slice_in_dim(pos_table, first, ppb, axis=1)  # [S, ppb]
    return pos[:, :, None] * page_size + jnp.arange(page_size)

  empty = lambda *lead: (jnp.full(lead, _NEG_INF, f32), jnp.zeros(lead, f32),
                         jnp.zeros(lead + (d,), f32))  # (m, l, acc) of rows that saw no key

  # Per sequence and per row bookkeeping; entries past num_seqs may hold junk.
  n = md.num_seqs[0]
  live = jnp.arange(s_max) < n
  cu = md.cu_q_lens
  total = cu[n]
  starts = jnp.where(live, cu[:-1], total)  # [S]
  q_lens = jnp.where(live, cu[1:] - cu[:-1], 0)  # [S]
  ctx_lens = jnp.where(live, md.kv_lens - q_lens, 0)  # [S] keys cached before this step
  is_short = live & (q_lens <= w)  # [S] decode and verify sequences
  rows = jnp.arange(t)
  row_live = rows < total  # [T]
  # Without a prefill chunk T <= S * w, and comparing every row with every start costs nothing
  # beside the binary search's loop, which is one more program to compile per layer.
  seg = jnp.clip(jnp.searchsorted(starts, rows, side="right",
                                  method="scan" if multi_query else "compare_all") - 1,
                 0, s_max - 1)  # [T]
  idx = rows - starts[seg]  # [T] index among the sequence's new rows
  slot_pos = jnp.where(row_live, ctx_lens[seg] + idx, 0)  # [T] where the row's K/V is stored
  # [S] context pages to walk per sequence: those holding its cached keys (all in the first
  # entries, the tables being in position order)
  if ctx_pos is None:
    ctx_pages_n = jax.lax.div(ctx_lens + page_size - 1, page_size)
  else:
    ctx_pages_n = jnp.sum((ctx_pos >= 0) & (ctx_pos * page_size < ctx_lens[:, None]), axis=1)
  if sliding_window is not None:
    # Keys before a sequence's earliest window are masked anyway: its walk starts at the first
    # page its first new row (at position ctx_len) can see, so a windowed layer's context work
    # follows the window, not the context.
    n_cols = ctx_table.shape[1]
    first_page = jnp.maximum(ctx_lens - sliding_window + 1, 0) // page_size  # [S]
    if ctx_pos is None:
      skip, listed_pos = first_page, jnp.broadcast_to(jnp.arange(n_cols), ctx_table.shape)
    else:
      skip = jnp.sum((ctx_pos >= 0) & (ctx_pos < first_page[:, None]), axis=1)
      listed_pos = ctx_pos
    col = skip[:, None] + jnp.arange(n_cols)  # [S, P]
    shift = lambda x: jnp.where(col < n_cols, jnp.take_along_axis(
        x, jnp.minimum(col, n_cols - 1), axis=1), -1)
    ctx_table, ctx_pos = shift(ctx_table), shift(listed_pos).astype(jnp.int32)
    ctx_pages_n = jnp.maximum(ctx_pages_n - skip, 0)
  tree = None if md.tree_mask is None else md.tree_mask.astype(bool)  # [T, W]
  if tree is None:
    pos = slot_pos
  else:  # a tree row's position is its depth past the context
    in_seq = jnp.arange(w)[None, :] < q_lens[seg][:, None]
    depth = jnp.where(is_short[seg], jnp.sum(tree & in_seq, axis=1) - 1, idx)
    pos = jnp.where(row_live, ctx_lens[seg] + depth, 0)  # [T]
  qf = q.astype(f32).reshape(t, hkv, gq, d)

  def finish(state, by_row):
    """The output [T, Hq, D] (and log-sum-exp [T, Hq]) of a softmax state; `by_row(x, fill)`
    lays x out by row, [T, Hkv, Gq, ...] (`fill` for rows the state does not hold). Rows that
    saw no key come out 0."""
    m, l, acc = state
    o = by_row(acc / jnp.where(l == 0.0, 1.0, l)[..., None], 0.0)
    o = o.reshape(t, hq, d).astype(q.dtype)
    if not return_softmax_state:
      return o
    lse = jnp.where(l > 0.0, m + jnp.log(jnp.where(l > 0.0, l, 1.0)), -jnp.inf)
    return o, by_row(lse, -jnp.inf).reshape(t, hq)

  # This step's keys, read back from the slots the step wrote them to (so a quantized cache
  # is seen exactly as later steps will see it). Positions are never negative: lax.div and
  # lax.rem, not the floor division's sign fix-ups.
  page = page_indices[seg, jax.lax.div(slot_pos, page_size)]  # [T]
  k_new, v_new = load(page, slice(None), jax.lax.rem(slot_pos, page_size))  # [T, Hkv, D] each
  key_live = row_live & (page >= 0)  # [T] keys on absent pages are skipped
  v_new = jnp.where(key_live[:, None, None], v_new, 0.0)

  # -- 1. this step's keys, when a prefill chunk may be present: row tile i attends to tiles
  # j <= i from its first row's sequence. (Without one they join the decode context pass.)
  if multi_query:
    bq = min(block_q, t)
    n_tiles = -(-t // bq)
    pad = n_tiles * bq - t
    padded = lambda x, fill=0: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1),
                                       constant_values=fill)
    # Heads lead, so each tile's products are plain batched matmuls over [Gq*bq, D] rows.
    q_p = padded(qf).transpose(1, 2, 0, 3)  # [Hkv, Gq, T', D]
    k_p, v_p = padded(k_new).transpose(1, 0, 2), padded(v_new).transpose(1, 0, 2)  # [Hkv, T', D]
    seg_p, idx_p, pos_p = padded(seg, -1), padded(idx), padded(pos)
    live_p, key_live_p = padded(row_live, False), padded(key_live, False)
    short_p = padded(is_short[seg], False)
    tree_p = None if tree is None else padded(tree, False)  # [T', W]

    def self_tile(i, out):
      sl = lambda x, axis=0: jax.lax.dynamic_slice_in_dim(x, i * bq, bq, axis)
      qt, seg_q, idx_q, pos_q, live_q = sl(q_p, 2), sl(seg_p), sl(idx_p), sl(pos_p), sl(live_p)
      first = starts[seg_q[0]] // bq

      def body(c):
        j, st = c
        sk = lambda x, axis=0: jax.lax.dynamic_slice_in_dim(x, j * bq, bq, axis)
        idx_k = sk(idx_p)
        sees = idx_k[None, :] <= idx_q[:, None]  # [bq, bq] causal
        if tree_p is not None:
          bit = jnp.take_along_axis(sl(tree_p), jnp.broadcast_to(
              jnp.clip(idx_k, 0, w - 1)[None, :], (bq, bq)), axis=1)
          sees = jnp.where(sl(short_p)[:, None], bit, sees)
        mask = ((seg_q[:, None] == sk(seg_p)[None, :]) & sees & live_q[:, None]
                & sk(key_live_p)[None, :] & window(sk(pos_p)[None, :], pos_q[:, None]))
        return j + 1, _update(st, scores(qt, sk(k_p, 1), "hxqd,hkd->hxqk"), mask,
                              lambda p: jnp.einsum("hxqk,hkd->hxqd", p, sk(v_p, 1)))

      _, st = jax.lax.while_loop(lambda c: (c[0] <= i) & live_q[0], body,
                                 (first, empty(hkv, gq, bq)))
      return tuple(jax.lax.dynamic_update_slice_in_dim(o, x, i * bq, axis=2)
                   for o, x in zip(out, st))

    self_state = jax.lax.fori_loop(0, n_tiles, self_tile, empty(hkv, gq, t + pad))

  # -- 2. context of decode and verify rows: w row slots per sequence, a block of pages of all
  # sequences at once. Measured on XLA:CPU: ~1024 keys per block over all sequences balances loop
  # overhead against the size of each gathered block (32 keys per sequence for 64 sequences, 128
  # for 8).
  ppb, table, pos_table, bk = blocked_table(
      pages_per_block or max(1, max(32, min(128, 1024 // s_max)) // page_size))
  short_ctx = jnp.where(is_short, ctx_lens, 0)  # [S]
  srow = starts[:, None] + jnp.arange(w)[None, :]  # [S, W]
  srow_live = is_short[:, None] & (jnp.arange(w)[None, :] < q_lens[:, None])
  srow_c = jnp.minimum(srow, t - 1)
  # A sequence's w rows see the same pages: they join its query group, [S, Hkv, W*Gq, D], so a
  # block is one batched matmul per sequence and KV head (for decodes, w = 1, exactly the old
  # decode pass).
  qs = qf[srow_c].transpose(0, 2, 1, 3, 4).reshape(s_max, hkv, w * gq, d)
  spos = pos[srow_c]  # [S, W]

  def short_block(c):
    blk, st = c
    pages = jax.lax.dynamic_slice_in_dim(table, blk * ppb, ppb, axis=1)  # [S, Pb]
    # Values [S, Pb, Hkv, ps, D]; a quantized cache's scales [S, Pb, Hkv, ps] are folded into
    # the scores and probabilities, not into the values (3-24x fewer multiplies on XLA:CPU, and
    # the int8 gather feeds the matmul through its convert alone).
    k, v, ks, vs = load_raw(pages)
    kpos = key_positions(pos_table, blk * ppb, ppb)  # [S|1, Pb, ps]
    valid = (kpos < short_ctx[:, None, None]) & (pages >= 0)[:, :, None]  # [S, Pb, ps]
    v = jnp.where(valid[:, :, None, :, None], v, 0.0)
    if ks is not None:  # -> [S, Hkv, 1, Pb, ps], keys last like the scores
      ks, vs = (jnp.where(valid[:, :, None], x, 0.0).transpose(0, 2, 1, 3)[:, :, None]
                for x in (ks, vs))
    mask = valid[:, None] & window(kpos[:, None], spos[:, :, None, None])  # [S, W|1, Pb, ps]
    if mask.shape[1] == 1:  # the same keys for all of a sequence's rows
      mask = mask.reshape(s_max, 1, 1, bk)
    else:  # per-row windows: each row's mask repeated over its query group
      mask = jnp.repeat(mask.reshape(s_max, w, 1, bk), gq, axis=2).reshape(s_max, 1, -1, bk)
    sc = scores(qs, k, "shxd,sphkd->shxpk", ks)  # [S, Hkv, W*Gq, Pb, ps]
    pv = lambda p: jnp.einsum("shxpk,sphkd->shxd",
                              p.reshape(sc.shape) * (1.0 if vs is None else vs), v)
    return blk + 1, _update(st, sc.reshape(s_max, hkv, w * gq, bk), mask, pv)

  if multi_query:
    init = empty(s_max, hkv, w * gq)
  else:
    # Decode-only: every sequence's new keys are among its own w row slots, so they start the
    # context pass's softmax (by the tree mask, else causally) with no tile loop; see the
    # module docstring.
    k_s, v_s = k_new[srow_c], v_new[srow_c]  # [S, W, Hkv, D]
    sees = (jnp.arange(w)[None, :] <= jnp.arange(w)[:, None] if tree is None
            else tree[srow_c])  # [W | S, W(rows), W(keys)]
    mask = (sees & (srow_live & key_live[srow_c])[:, None, :]
            & window(spos[:, None, :], spos[:, :, None]))  # [S, W, W]
    mask = jnp.broadcast_to(mask[:, :, None], (s_max, w, gq, w)).reshape(s_max, 1, w * gq, w)
    init = _update(empty(s_max, hkv, w * gq), scores(qs, k_s, "shxd,skhd->shxk"), mask,
                   lambda p: jnp.einsum("shxk,skhd->shxd", p, v_s))
  n_blk = jax.lax.div(jnp.max(jnp.where(is_short, ctx_pages_n, 0), initial=0) + ppb - 1, ppb)
  _, short = jax.lax.while_loop(lambda c: c[0] < n_blk, short_block, (jnp.int32(0), init))
  if not multi_query:  # each row's state from its sequence's slots; padding rows come out 0
    def by_row(x, fill):  # [S, Hkv, W*Gq, ...] -> [T, Hkv, Gq, ...]
      x = x.reshape((s_max, hkv, w, gq) + x.shape[3:])[seg, :, jnp.minimum(idx, w - 1)]
      return jnp.where(row_live.reshape((t,) + (1,) * (x.ndim - 1)), x, fill)
    return finish(short, by_row)

  # Scatter to rows [Hkv, Gq, T']; rows of other sequences keep an empty state.
  tgt = jnp.where(srow_live, srow, t + pad).reshape(-1)  # [S*W]
  ctx_state = tuple(
      base.at[:, :, tgt].set(jnp.moveaxis(x.reshape((s_max, hkv, w, gq) + x.shape[3:]), 2, 1)
                             .reshape((s_max * w, hkv, gq) + x.shape[3:])
                             .transpose((1, 2, 0) + tuple(range(3, x.ndim))), mode="drop")
      for base, x in zip(empty(hkv, gq, t + pad), short))

  # -- 3. context of prefill chunks: per sequence with more than w queries and a cached context,
  # row tiles of it against blocks of its pages.
  if multi_query:
    (multi,) = jnp.nonzero((q_lens > w) & (ctx_lens > 0), size=sp, fill_value=s_max)
    n_multi = jnp.sum(multi < s_max)
    pbq, table_q, pos_q, bkq = blocked_table(pages_per_block or max(1, 128 // page_size))

    def seq_body(c):
      i_seq, st_all = c
      sq = multi[i_seq]
      start, ql, cl, n_pages = starts[sq], q_lens[sq], ctx_lens[sq], ctx_pages_n[sq]

      def tile_body(c2):
        ti, st_all = c2
        r0 = start + ti * bq
        r0c = jnp.minimum(r0, t + pad - bq)  # a tile may start late to stay in bounds
        qt = jax.lax.dynamic_slice_in_dim(q_p, r0c, bq, axis=2)
        in_seq = (r0c + jnp.arange(bq) >= start) & (r0c + jnp.arange(bq) < start + ql)
        qpos_t = cl + r0c + jnp.arange(bq) - start  # [bq]

        def kv_body(c3):
          kb, st = c3
          pages = jax.lax.dynamic_slice_in_dim(table_q[sq], kb * pbq, pbq)  # [Pb]
          k, v, ks, vs = load_raw(pages)  # [Pb, Hkv, ps, D], scales [Pb, Hkv, ps] or None
          kpos = key_positions(None if pos_q is None else pos_q[sq][None], kb * pbq,
                               pbq).reshape(bkq)
          valid = (kpos < cl) & jnp.repeat(pages >= 0, page_size)
          k = k.transpose(1, 0, 2, 3).reshape(hkv, bkq, d)
          v = jnp.where(valid[:, None], v.transpose(1, 0, 2, 3).reshape(hkv, bkq, d), 0.0)
          if ks is not None:  # folded into scores and probabilities: [Hkv, 1, 1, BK]
            ks, vs = (jnp.where(valid, x.transpose(1, 0, 2).reshape(hkv, bkq), 0.0)[:, None, None]
                      for x in (ks, vs))
          mask = valid[None, :] & in_seq[:, None] & window(kpos[None, :], qpos_t[:, None])
          return kb + 1, _update(st, scores(qt, k, "hxqd,hkd->hxqk", ks), mask,
                                 lambda p: jnp.einsum("hxqk,hkd->hxqd",
                                                      p * (1.0 if vs is None else vs), v))

        _, st = jax.lax.while_loop(lambda c3: c3[0] * pbq < n_pages, kv_body,
                                   (jnp.int32(0), empty(hkv, gq, bq)))
        keep = lambda new, old: jnp.where(in_seq.reshape((1, 1, bq) + (1,) * (new.ndim - 3)),
                                          new, old)
        st_all = tuple(
            jax.lax.dynamic_update_slice_in_dim(
                o, keep(x, jax.lax.dynamic_slice_in_dim(o, r0c, bq, axis=2)), r0c, axis=2)
            for o, x in zip(st_all, st))
        return ti + 1, st_all

      _, st_all = jax.lax.while_loop(lambda c2: c2[0] * bq < ql, tile_body, (jnp.int32(0), st_all))
      return i_seq + 1, st_all

    _, ctx_state = jax.lax.while_loop(lambda c: c[0] < n_multi, seq_body,
                                      (jnp.int32(0), ctx_state))

  # The state is [Hkv, Gq, T', ...]; padding rows in it saw no key.
  return finish(_merge(self_state, ctx_state),
                lambda x, fill: x[:, :, :t].transpose((2, 0, 1) + tuple(range(3, x.ndim))))
