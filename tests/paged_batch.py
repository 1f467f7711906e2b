"""Test helper: run a model over a ragged batch through a paged cache, pages laid out by hand."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import AttentionMetadata
from pallas_kernels import KVCacheSpec


class PagedBatch:
  """Sequences with pages drawn from a shuffled pool, so every sequence spans scattered pages."""

  def __init__(self, model, params, num_seqs: int, page_size: int, max_len: int, seed: int = 0):
    c = model.config
    self.model, self.params, self.page_size = model, params, page_size
    self.pages_per_seq = -(-max_len // page_size)
    num_pages = 1 + num_seqs * self.pages_per_seq  # page 0 is the sink
    rng = np.random.default_rng(seed)
    pool = rng.permutation(np.arange(1, num_pages))
    self.block_table = pool.reshape(num_seqs, self.pages_per_seq).astype(np.int32)
    spec = KVCacheSpec(num_layers=c.num_layers, num_pages=num_pages, page_size=page_size,
                       num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=model.dtype)
    # NaN in never-written slots: any read of an unused slot poisons the logits.
    self.cache = jnp.full(spec.shape, jnp.nan, model.dtype)
    self.lens = np.zeros(num_seqs, np.int32)
    self._fwd = jax.jit(model.apply, static_argnames="return_hidden")

  def step(self, chunks: list[list[int]], pad_to: int | None = None, all_rows: bool = False,
           return_hidden: bool = False, max_q_len: int | None = None):
    """Append `chunks[s]` to sequence s; return logits of each sequence's last new token [S, V]
    (or of every new token, [T, V], with `all_rows`), and their final hidden states [S or T, E]
    with `return_hidden`. `pad_to` and `max_q_len` (a static bound, at least the longest chunk)
    let steps of different chunks share one compiled shape."""
    ids, pos, slots, cu = [], [], [], [0]
    for s, chunk in enumerate(chunks):
      for j, tok in enumerate(chunk):
        p = int(self.lens[s]) + j
        ids.append(tok)
        pos.append(p)
        slots.append(self.block_table[s, p // self.page_size] * self.page_size + p % self.page_size)
      cu.append(cu[-1] + len(chunk))
      self.lens[s] += len(chunk)
    t = len(ids)
    assert max_q_len is None or max_q_len >= max(map(len, chunks))
    pad = (pad_to or t) - t
    ids, pos, slots = ids + [0] * pad, pos + [0] * pad, slots + [0] * pad  # padding -> sink page
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32), block_table=jnp.asarray(self.block_table),
        kv_lens=jnp.asarray(self.lens), cu_q_lens=jnp.asarray(cu, jnp.int32),
        num_seqs=jnp.asarray([len(chunks)], jnp.int32),
        max_q_len=max_q_len or max(map(len, chunks)))
    logits_idx = jnp.arange(t) if all_rows else jnp.asarray(np.array(cu[1:]) - 1, jnp.int32)
    logits, hidden, self.cache = self._fwd(
        {"params": self.params}, jnp.asarray(ids, jnp.int32), jnp.asarray(pos, jnp.int32),
        self.cache, md, logits_idx, return_hidden=return_hidden)
    return (np.asarray(logits), np.asarray(hidden)) if return_hidden else np.asarray(logits)
