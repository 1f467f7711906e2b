"""How a ragged batch splits into kernel programs: which sequences and query rows each one owns,
and the per-row tables (tree mask, window) the kernels read.

All of it is plain jnp run before the kernels, so the kernels read ready-made tables instead of
searching `cu_q_lens` themselves or carrying a cursor from one grid step to the next.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def sanitize_cu_q_lens(cu_q_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:  # [S+1]
  """Entries past `num_seqs` repeat the live total, so the array is non-decreasing.

  Callers may pad the tail with anything (zeros, stale values); every search below assumes
  sorted offsets, and padding sequences then own zero query rows.
  """
  n = num_seqs[0]
  return jnp.where(jnp.arange(cu_q_lens.shape[0]) <= n, cu_q_lens, cu_q_lens[n])


def q_block_seq_ranges(
    cu_q_lens: jax.Array,  # [S+1] sanitized
    num_seqs: jax.Array,  # [1]
    block_q: int,
    num_q_blocks: int,
) -> tuple[jax.Array, jax.Array]:  # ([NQB], [NQB]) int32
  """Half-open range of sequences whose query rows overlap each block of `block_q` flat tokens."""
  blk_lo = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q  # [NQB]
  # First sequence ending after the block starts; sequences starting before the block ends.
  lo = jnp.searchsorted(cu_q_lens[1:], blk_lo, side="right").astype(jnp.int32)
  hi = jnp.searchsorted(cu_q_lens[:-1], blk_lo + block_q, side="left").astype(jnp.int32)
  n = num_seqs[0]
  return jnp.minimum(lo, n), jnp.minimum(hi, n)


def seq_q_blocks(
    cu_q_lens: jax.Array,  # [S+1] sanitized
    block_q: int,
    num_items: int,
) -> tuple[jax.Array, jax.Array]:  # ([NB], [NB]) int32
  """Work items of at most `block_q` query tokens, each inside one sequence.

  Returns each item's sequence (-1 for the unused tail of the `num_items` slots) and its first
  flat token. `num_items` must bound sum_s cdiv(q_len_s, block_q), e.g. cdiv(T, block_q) + S.
  """
  s = cu_q_lens.shape[0] - 1
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
  nblk = (q_lens + block_q - 1) // block_q  # [S]
  ends = jnp.cumsum(nblk)  # [S]
  b = jnp.arange(num_items, dtype=jnp.int32)  # [NB]
  seq = jnp.searchsorted(ends, b, side="right").astype(jnp.int32)  # [NB]; S past the last item
  seq_c = jnp.minimum(seq, s - 1)
  tok = cu_q_lens[seq_c] + (b - (ends - nblk)[seq_c]) * block_q
  live = seq < s
  return jnp.where(live, seq, -1), jnp.where(live, tok, 0).astype(jnp.int32)


def window_operand(sliding_window: jax.Array | int | None, max_len: int) -> jax.Array:  # [] int32
  """The sliding window as a kernel scalar, clamped to [0, max_len].

  `max_len` bounds every key and query position (the block table's width in tokens), so a wider
  window is no window and the clamp changes nothing; it keeps a "huge means none" window from
  overflowing int32 in the kernels' position arithmetic. 0 (never read) without a window.
  """
  if sliding_window is None:
    return jnp.int32(0)
  return jnp.clip(jnp.asarray(sliding_window, jnp.int32), 0, max_len)


def tree_rows(
    tree_mask: jax.Array,  # [T, W] bool
    cu_q_lens: jax.Array,  # [S+1] sanitized
    num_seqs: jax.Array,  # [1]
) -> tuple[jax.Array, jax.Array]:  # ([T, NW], [T]) int32
  """Each query row's tree mask packed for the kernels, NW = cdiv(W, 32) words.

  Bit j of word w says whether the row sees its sequence's new row 32*w + j. Rows of prefill
  chunks and padding get every bit set, so a kernel applies one rule to all rows: a new key is
  seen iff it is causally before the row and its bit is set.
  Also each row's lag, its index among its sequence's new rows minus its depth: a tree row's
  position for the sliding window is its causal position minus its lag (0 for causal rows).
  """
  t, w = tree_mask.shape
  nw = -(-w // 32)
  n = num_seqs[0]
  rows = jnp.arange(t, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], rows, side="right"), 0,
                 cu_q_lens.shape[0] - 2)  # [T]
  idx = rows - cu_q_lens[seq]  # [T]
  q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]  # [T]
  tree = (q_len <= w) & (rows < cu_q_lens[n])  # [T]: rows of decode and verify sequences
  bits = tree_mask.astype(bool) & (jnp.arange(w)[None, :] < q_len[:, None])  # [T, W]
  depth = jnp.sum(bits, axis=1, dtype=jnp.int32) - 1  # [T]
  bits = jnp.pad(bits, ((0, 0), (0, nw * 32 - w))).reshape(t, nw, 32)
  words = jnp.sum(bits.astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32), axis=2,
                  dtype=jnp.uint32)  # [T, NW]; the bits are disjoint, so the sum is their OR
  words = jnp.where(tree[:, None], lax.bitcast_convert_type(words, jnp.int32), -1)
  return words, jnp.where(tree, idx - depth, 0)


def item_entries(
    item_seq: jax.Array,  # [NB] from `seq_q_blocks`, -1 for unused items
    item_tok: jax.Array,  # [NB]
    cu_q_lens: jax.Array,  # [S+1] sanitized
    kv_lens: jax.Array,  # [S]
    page_pos: jax.Array | None,  # [S, P'] listed pages' indices in their sequence, -1 pads
    *,
    block_q: int,
    page_size: int,
    window: jax.Array | None,  # [] from `window_operand`, None without a window
    tree_width: int | None,  # verify_width when a tree mask is given
) -> tuple[jax.Array, jax.Array]:  # ([NB], [NB]) int32
  """Half-open range of the walked list's entries (block-table columns, or the listed pages)
  each work item reads: the pages from its earliest row's window start (a tree row's window
  counts from the context length) to its last row's key. Unused items read none."""
  seq = jnp.maximum(item_seq, 0)
  q_start, q_end = cu_q_lens[seq], cu_q_lens[seq + 1]
  ctx = kv_lens[seq] - (q_end - q_start)
  qpos0 = ctx + item_tok - q_start
  hi = (qpos0 + jnp.minimum(block_q, q_end - item_tok) + page_size - 1) // page_size
  lo = jnp.zeros_like(hi)
  if window is not None:
    first_pos = qpos0
    if tree_width is not None:
      first_pos = jnp.where(q_end - q_start <= tree_width, ctx, qpos0)
    lo = jnp.maximum(first_pos - window + 1, 0) // page_size
  if page_pos is not None:  # entries before a page index: the listed pages below it
    rows = page_pos[seq]  # [NB, P']
    below = lambda page: jnp.sum((rows >= 0) & (rows < page[:, None]), axis=1, dtype=jnp.int32)
    lo, hi = below(lo), below(hi)
  live = item_seq >= 0
  return jnp.where(live, lo, 0).astype(jnp.int32), jnp.where(live, hi, 0).astype(jnp.int32)
