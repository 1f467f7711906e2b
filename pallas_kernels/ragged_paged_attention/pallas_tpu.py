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

The KV cache stays in HBM (`pl.ANY`); pages are DMA'd a block at a time into a two-slot VMEM buffer:
the next block (possibly of the next sequence) is in flight while the current one is computed.
Online-softmax state (`acc`, `m`, `l`) lives in f32 VMEM scratch.

Written within the interpreter's limits so it runs on CPU with `interpret=True` and
`interpret=pltpu.InterpretParams(detect_races=True)`: no ref reshapes or bitcasts, no strided
loads, no masked stores, nothing written to scalar-prefetch refs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.schedule import q_block_seq_ranges, sanitize_cu_q_lens

_NEG_INF = -1e30


def _cdiv(a: jax.Array, b: int) -> jax.Array:
  # Operands are non-negative, so truncating division is exact; jnp's floor division would emit
  # a sign fix-up whose Mosaic lowering queries the chip.
  return lax.div(a + b - 1, b)


def _kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,  # [S]
    page_indices_ref,  # [S*P] (flat: 2-D SMEM arrays pad their last axis)
    cu_q_lens_ref,  # [S+1]
    seq_lo_ref,  # [NQB]
    seq_hi_ref,  # [NQB]
    # Inputs.
    q_ref,  # [Hkv, R, D] VMEM block
    kv_hbm,  # [num_pages, 2, Hkv, page_size, D] in HBM
    # Output.
    o_ref,  # [Hkv, R, D] VMEM block
    # Scratch.
    kv_buf,  # [2 slots, 2, Hkv, BK, D]
    sems,  # DMA [2 slots]
    acc_ref,  # [Hkv, R, D] f32
    m_ref,  # [Hkv, R, 1] f32
    l_ref,  # [Hkv, R, 1] f32
    *,
    block_q: int,
    pages_per_block: int,
    pages_per_seq: int,
    num_seq_slots: int,
    group: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale: float | None,
    v_scale: float | None,
):
  hkv, rows, _ = q_ref.shape
  page_size = kv_hbm.shape[3]
  bk = pages_per_block * page_size
  i = pl.program_id(0)
  blk_lo = i * block_q
  blk_hi = blk_lo + block_q
  seq_hi = seq_hi_ref[i]

  def seq_info(s):
    # Scalars of sequence s as seen from this block. Query token t sits at position base + t.
    s = jnp.minimum(s, num_seq_slots - 1)  # loop conditions evaluate one index past the end
    q_start, q_end = cu_q_lens_ref[s], cu_q_lens_ref[s + 1]
    t_lo, t_hi = jnp.maximum(q_start, blk_lo), jnp.minimum(q_end, blk_hi)
    base = kv_lens_ref[s] - q_end
    key_end = base + t_hi  # keys at positions >= this are past every query of the block
    kb_end = jnp.where(t_hi > t_lo, _cdiv(key_end, bk), 0)
    if sliding_window is None:
      kb_start = jnp.int32(0)
    else:
      kb_start = lax.div(jnp.maximum(base + t_lo - sliding_window + 1, 0), bk)
    return t_lo, t_hi, base, key_end, kb_start, kb_end

  def first_block_from(s):
    # First sequence at or after s that has rows in this block; seq_hi when none is left.
    def cond(s):
      *_, kb_start, kb_end = seq_info(s)
      return (s < seq_hi) & (kb_start >= kb_end)

    s = lax.while_loop(cond, lambda s: s + 1, s)
    return s, seq_info(s)[4]

  def next_block(s, kb):
    *_, kb_end = seq_info(s)
    return lax.cond(kb + 1 < kb_end, lambda: (s, kb + 1), lambda: first_block_from(s + 1))

  def for_each_page_copy(s, kb, slot, action):
    # One DMA per page the block needs; pages past the last needed key are never touched (their
    # page-table entries may be anything). All copies of a slot count on that slot's semaphore.
    _, _, _, key_end, _, _ = seq_info(s)
    first = kb * pages_per_block
    n = jnp.minimum(pages_per_block, _cdiv(key_end, page_size) - first)

    def one(j, carry):
      page = page_indices_ref[s * pages_per_seq + first + j]
      action(pltpu.make_async_copy(
          kv_hbm.at[page], kv_buf.at[slot, :, :, pl.ds(j * page_size, page_size), :],
          sems.at[slot]))
      return carry

    lax.fori_loop(0, n, one, 0)

  def start_fetch(s, kb, slot):
    for_each_page_copy(s, kb, slot, lambda c: c.start())

  def wait_fetch(s, kb, slot):
    for_each_page_copy(s, kb, slot, lambda c: c.wait())

  def compute(s, kb, slot):
    t_lo, t_hi, base, key_end, _, _ = seq_info(s)
    # Row r is token blk_lo + r // G; compare through r and G so no vector division is needed.
    r = lax.broadcasted_iota(jnp.int32, (rows, bk), 0)
    kpos = kb * bk + lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
    qbase = base + blk_lo  # position of the block's first token
    mask = (r >= (t_lo - blk_lo) * group) & (r < (t_hi - blk_lo) * group)
    mask &= r >= (kpos - qbase) * group  # causal: key pos <= query pos
    if sliding_window is not None:
      mask &= r < (kpos + sliding_window - qbase) * group
    # Slots past key_end were not fetched (stale or uninitialized VMEM) or hold NaN past kv_len:
    # zero V there so 0 * NaN never reaches the accumulator. Masked scores are replaced, so K
    # needs no such care.
    v_live = kb * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0) < key_end

    def head(h, carry):
      q = q_ref[h]  # [R, D]
      k = kv_buf[slot, 0, h].astype(q.dtype)  # [BK, D]
      v = kv_buf[slot, 1, h].astype(q.dtype)  # [BK, D]
      sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)  # [R, BK]
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
      v = jnp.where(v_live, v, jnp.zeros_like(v))
      pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)  # [R, D]
      acc_ref[h] = alpha * acc_ref[h] + pv
      return carry

    lax.fori_loop(0, hkv, head, 0)

  acc_ref[...] = jnp.zeros_like(acc_ref)
  m_ref[...] = jnp.full_like(m_ref, _NEG_INF)
  l_ref[...] = jnp.zeros_like(l_ref)

  s0, kb0 = first_block_from(seq_lo_ref[i])

  @pl.when(s0 < seq_hi)
  def _():
    start_fetch(s0, kb0, 0)

  def body(carry):
    s, kb, slot = carry
    s_next, kb_next = next_block(s, kb)

    @pl.when(s_next < seq_hi)
    def _():
      start_fetch(s_next, kb_next, 1 - slot)

    wait_fetch(s, kb, slot)
    compute(s, kb, slot)
    return s_next, kb_next, 1 - slot

  lax.while_loop(lambda c: c[0] < seq_hi, body, (s0, kb0, jnp.int32(0)))

  # Rows no key reached (padding tokens) have l == 0 and acc == 0: they come out zero.
  l = l_ref[...]
  out = acc_ref[...] / jnp.where(l == 0.0, 1.0, l)
  if v_scale is not None:
    out *= v_scale
  o_ref[...] = out.astype(o_ref.dtype)


def ragged_paged_attention_tpu(
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
    block_q: int = 32,
    pages_per_block: int = 8,
    vmem_limit_bytes: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # [T, Hq, D]
  """Same contract as the reference. `max_q_len` is not needed: cost follows the real rows.

  block_q: flat query tokens per program. block_q * Hq / Hkv should be a multiple of 8 (16 for
    16-bit queries) to tile VMEM; decode-heavy steps waste fewer masked rows with a smaller one.
  pages_per_block: pages per KV block (one DMA each, double-buffered). page_size should be a
    multiple of the KV dtype's sublane tiling (8 for 32-bit, 16 for 16-bit) so each page lands
    on a tile boundary of the VMEM buffer.
  """
  del max_q_len
  t, hq, d = q.shape
  _, _, hkv, page_size, _ = kv_cache.shape
  s, p = page_indices.shape
  g = hq // hkv
  ppb = min(pages_per_block, p)
  nqb = pl.cdiv(t, block_q)
  t_pad = nqb * block_q
  rows = block_q * g

  cu = sanitize_cu_q_lens(cu_q_lens.astype(jnp.int32), num_seqs)
  seq_lo, seq_hi = q_block_seq_ranges(cu, num_seqs, block_q, nqb)
  # [T, Hq, D] -> [Hkv, T_pad*G, D]: a KV head's query group becomes contiguous rows.
  qr = jnp.pad(q, ((0, t_pad - t), (0, 0), (0, 0)))
  qr = qr.reshape(t_pad, hkv, g, d).transpose(1, 0, 2, 3).reshape(hkv, t_pad * g, d)

  kernel = functools.partial(
      _kernel, block_q=block_q, pages_per_block=ppb, pages_per_seq=p, num_seq_slots=s, group=g,
      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
      v_scale=v_scale)
  block = pl.BlockSpec((hkv, rows, d), lambda i, *_: (0, i, 0))
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=5,
          grid=(nqb,),
          in_specs=[block, pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=block,
          scratch_shapes=[
              pltpu.VMEM((2, 2, hkv, ppb * page_size, d), kv_cache.dtype),
              pltpu.SemaphoreType.DMA((2,)),
              pltpu.VMEM((hkv, rows, d), jnp.float32),
              pltpu.VMEM((hkv, rows, 1), jnp.float32),
              pltpu.VMEM((hkv, rows, 1), jnp.float32),
          ],
      ),
      out_shape=jax.ShapeDtypeStruct((hkv, t_pad * g, d), q.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel",), vmem_limit_bytes=vmem_limit_bytes),
      interpret=interpret,
      name="ragged_paged_attention",
  )(kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32).reshape(-1), cu, seq_lo, seq_hi,
    qr, kv_cache)
  out = out.reshape(hkv, t_pad, g, d).transpose(1, 0, 2, 3).reshape(t_pad, hq, d)
  return out[:t]
