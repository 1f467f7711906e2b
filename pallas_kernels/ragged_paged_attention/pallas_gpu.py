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
the smallest MMA), loops over blocks of pages up to its last query's position (from the sliding
window's start when there is one), and keeps the f32 online-softmax state in registers.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention.schedule import sanitize_cu_q_lens, seq_q_blocks

_NEG_INF = -1e30


def _kernel(
    item_seq_ref,  # [NB] sequence of each work item, -1 for unused items
    item_tok_ref,  # [NB] first flat token of each work item
    kv_lens_ref,  # [S]
    page_indices_ref,  # [S*P]
    cu_q_lens_ref,  # [S+1]
    q_ref,  # [Hkv, (T+pad)*G, D]
    kv_ref,  # [num_pages*2*Hkv*page_size, D]: the cache viewed as rows
    o_in_ref,  # aliased with o_ref (zeros: rows no program owns stay zero)
    o_ref,  # [Hkv, (T+pad)*G, D]
    *,
    block_q: int,
    rows: int,
    group: int,
    num_kv_heads: int,
    page_size: int,
    pages_per_block: int,
    pages_per_seq: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale: float | None,
    v_scale: float | None,
):
  del o_in_ref
  b, h = pl.program_id(0), pl.program_id(1)
  seq = item_seq_ref[b]
  bk = pages_per_block * page_size
  d = q_ref.shape[-1]

  @pl.when(seq >= 0)
  def _():
    tok0 = item_tok_ref[b]
    q_end, kv_len = cu_q_lens_ref[seq + 1], kv_lens_ref[seq]
    n_tok = jnp.minimum(block_q, q_end - tok0)
    qpos0 = kv_len - q_end + tok0  # position of the item's first token
    r = jnp.arange(rows, dtype=jnp.int32)
    row_live = r < n_tok * group  # [R]
    # Indices here are non-negative: truncating lax.div/rem skip jnp's floor-division fix-ups.
    qpos = qpos0 + lax.div(r, group)  # [R]
    q = q_ref[h, pl.ds(tok0 * group, rows), :]  # [R, D]; padded input keeps the slice in bounds

    kb_end = (qpos0 + n_tok + bk - 1) // bk
    kb_start = 0 if sliding_window is None else jnp.maximum(qpos0 - sliding_window + 1, 0) // bk
    kcol = jnp.arange(bk, dtype=jnp.int32)

    def body(kb, carry):
      acc, m_prev, l_prev = carry
      kpos = kb * bk + kcol  # [BK]
      k_live = kpos < kv_len
      slot = jnp.minimum(lax.div(kpos, page_size), pages_per_seq - 1)
      # Dead keys read the sink page: their page-table entries may be anything.
      page = jnp.where(k_live, page_indices_ref[seq * pages_per_seq + slot], 0)  # [BK]
      krow = (page * 2 * num_kv_heads + h) * page_size + lax.rem(kpos, page_size)
      k = kv_ref[krow].astype(q.dtype)  # [BK, D]
      v = kv_ref[krow + num_kv_heads * page_size].astype(q.dtype)  # [BK, D]
      sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)  # [R, BK]
      sc *= sm_scale if k_scale is None else sm_scale * k_scale
      if soft_cap is not None:
        sc = soft_cap * jnp.tanh(sc / soft_cap)
      mask = row_live[:, None] & (kpos[None, :] <= qpos[:, None])
      if sliding_window is not None:
        mask &= kpos[None, :] > qpos[:, None] - sliding_window
      sc = jnp.where(mask, sc, _NEG_INF)
      m_next = jnp.maximum(m_prev, jnp.max(sc, axis=1))  # [R]
      p = jnp.where(mask, jnp.exp(sc - m_next[:, None]), 0.0)  # [R, BK]
      alpha = jnp.exp(m_prev - m_next)
      # Slots past kv_len may hold NaN: zero V there so 0 * NaN never reaches acc.
      v = jnp.where(k_live[:, None], v, jnp.zeros_like(v))
      pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)  # [R, D]
      return alpha[:, None] * acc + pv, m_next, alpha * l_prev + jnp.sum(p, axis=1)

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _NEG_INF, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, _, l = lax.fori_loop(kb_start, kb_end, body, init)
    out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
    if v_scale is not None:
      out *= v_scale
    # Rows past the item's tokens belong to the next item or sequence: masked out of the store.
    plgpu.store(o_ref.at[h, pl.ds(tok0 * group, rows), :], out.astype(o_ref.dtype),
                mask=jnp.broadcast_to(row_live[:, None], (rows, d)))


def ragged_paged_attention_gpu(
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
    block_rows: int = 64,
    pages_per_block: int = 8,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]
  """Same contract as the reference.

  block_rows: query rows (tokens x G) per program; tokens per program = max(1, block_rows // G),
    capped by `max_q_len`. head_dim, page_size and pages_per_block must be powers of two with
    head_dim >= 16 and pages_per_block * page_size >= 16 (Triton block shapes, smallest MMA).
  """
  t, hq, d = q.shape
  num_pages, _, hkv, page_size, _ = kv_cache.shape
  s, p = page_indices.shape
  g = hq // hkv
  if d < 16 or d & (d - 1):
    # Checked in interpret mode too, so CPU tests catch a model the GPU could not run.
    raise ValueError(f"the Triton kernel needs a power-of-two head_dim >= 16, got {d}")
  block_q = max(1, block_rows // g)
  if max_q_len is not None:
    block_q = min(block_q, max_q_len)
  rows = max(16, pl.next_power_of_2(block_q * g))
  # A power of two even past the table's width: slots past it are clamped and masked as dead.
  ppb = min(pages_per_block, pl.next_power_of_2(p))
  num_items = pl.cdiv(t, block_q) + s
  if max_q_len is not None:
    num_items = min(num_items, s * pl.cdiv(max_q_len, block_q))

  cu = sanitize_cu_q_lens(cu_q_lens.astype(jnp.int32), num_seqs)
  item_seq, item_tok = seq_q_blocks(cu, block_q, num_items)
  # [T, Hq, D] -> [Hkv, T*G, D] plus `rows` spare rows, so every [R, D] slice is in bounds.
  t_pad = t + pl.cdiv(rows, g)
  qr = jnp.pad(q, ((0, t_pad - t), (0, 0), (0, 0)))
  qr = qr.reshape(t_pad, hkv, g, d).transpose(1, 0, 2, 3).reshape(hkv, t_pad * g, d)

  kernel = functools.partial(
      _kernel, block_q=block_q, rows=rows, group=g, num_kv_heads=hkv, page_size=page_size,
      pages_per_block=ppb, pages_per_seq=p, sm_scale=sm_scale, sliding_window=sliding_window,
      soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)
  out = pl.pallas_call(
      kernel,
      grid=(num_items, hkv),
      out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
      input_output_aliases={7: 0},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="ragged_paged_attention",
  )(item_seq, item_tok, kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32).reshape(-1), cu,
    qr, kv_cache.reshape(num_pages * 2 * hkv * page_size, d), jnp.zeros_like(qr))
  out = out.reshape(hkv, t_pad, g, d).transpose(1, 0, 2, 3).reshape(t_pad, hq, d)
  return out[:t]
