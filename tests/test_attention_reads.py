"""Attention reads what it needs: the Pallas kernels walk only the pages a row may see.

Each kernel's `count_pages` debug output says how many pages a token's program copied (TPU) or
loaded (GPU) for its sequence; here it must equal what the window, the absent pages and the
listed pages (a context-parallel rank's own, `AttentionMetadata.context_pages`) imply, and the
results must stay those of the oracle. The kernels run in interpret mode.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import AttentionMetadata, merge_attention, ragged_paged_attention
from tests.test_ragged_paged_attention import _backend_kw, merge_case_batch, run  # noqa: F401 (a fixture)

PALLAS = ("pallas_tpu", "pallas_gpu")
KW = {"pallas_tpu": dict(block_q=8, pages_per_block=4), "pallas_gpu": dict(pages_per_block=4)}


def _listed(table: np.ndarray) -> dict:
  """A table's present pages first, in position order, with their positions."""
  order = np.argsort(table < 0, axis=1, kind="stable")
  pages = np.take_along_axis(table, order, axis=1)
  return dict(context_pages=jnp.asarray(pages, jnp.int32),
              context_page_pos=jnp.asarray(np.where(pages >= 0, order, -1), jnp.int32))


def _decode_md(table: np.ndarray, kv_lens: np.ndarray, listed: bool) -> AttentionMetadata:
  s = len(kv_lens)
  return AttentionMetadata(
      slot_mapping=jnp.zeros(s, jnp.int32), block_table=jnp.asarray(table, jnp.int32),
      kv_lens=jnp.asarray(kv_lens, jnp.int32), cu_q_lens=jnp.arange(s + 1, dtype=jnp.int32),
      num_seqs=jnp.array([s], jnp.int32), max_q_len=1, **(_listed(table) if listed else {}))


def _attend(q, cache, md, backend, window=None, **kw):
  """(out [T, Hq, D], lse [T, Hq], pages read [T])"""
  return ragged_paged_attention(
      q, cache, md, sm_scale=q.shape[-1] ** -0.5, return_softmax_state=True,
      sliding_window=None if window is None else jnp.int32(window), backend=backend,
      interpret=True, count_pages=True, **kw)


def _visible(table_row: np.ndarray, kv_len: int, page_size: int, window: int | None) -> int:
  """Pages present in the table that hold a key a decode row at kv_len - 1 may see."""
  first = 0 if window is None else max(kv_len - window, 0) // page_size
  return int(np.sum(table_row[first:-(-kv_len // page_size)] >= 0))


def _decode_batch(rng, num_seqs, page_size, pages_per_seq, hq=4, hkv=2, d=64, absent=0.0):
  """Decode rows over random contexts in a shuffled pool (unused slots NaN); some pages absent."""
  kv_lens = rng.integers(1, pages_per_seq * page_size, num_seqs)
  num_pages = 1 + num_seqs * pages_per_seq
  table = rng.permutation(np.arange(1, num_pages)).reshape(num_seqs, pages_per_seq)
  cache = rng.standard_normal((1, num_pages, 2, hkv, page_size, d)).astype(np.float32)
  for s, kl in enumerate(kv_lens):  # slots past kv_len: NaN, never read
    for j in range(pages_per_seq):
      cache[0, table[s, j], :, :, max(kl - j * page_size, 0):] = np.nan
  table = np.where(rng.random(table.shape) < absent, -1, table).astype(np.int32)
  q = rng.standard_normal((num_seqs, hq, d)).astype(np.float32)
  return jnp.asarray(q), jnp.asarray(cache), table, kv_lens


@pytest.mark.parametrize("backend", PALLAS)
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("listed", [False, True])
def test_decode_rows_read_exactly_their_visible_pages(backend, window, listed):
  """Each decode row's program reads the present pages from its window's first to its last key,
  no more (the walk starts at a page, not at an aligned block), whichever way they are listed;
  the result is the full-table one."""
  rng = np.random.default_rng(3)
  ps = 8
  q, cache, table, kv_lens = _decode_batch(rng, 6, ps, 12, absent=0.3)
  o, lse, pages = _attend(q, cache, _decode_md(table, kv_lens, listed), backend, window,
                          **KW[backend])
  want = [_visible(table[s], kv_lens[s], ps, window) for s in range(len(kv_lens))]
  np.testing.assert_array_equal(np.asarray(pages), want)
  ref, ref_lse = ragged_paged_attention(
      q, cache, _decode_md(table, kv_lens, False), sm_scale=q.shape[-1] ** -0.5,
      sliding_window=None if window is None else jnp.int32(window), return_softmax_state=True,
      backend="reference")
  np.testing.assert_allclose(np.asarray(o), np.asarray(ref), atol=1e-5, rtol=1e-5)
  live = np.isfinite(np.asarray(ref_lse))
  np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(ref_lse)[live], atol=1e-5)


@pytest.mark.parametrize("backend", PALLAS)
def test_context_parallel_rank_reads_its_share(backend):
  """Pages striped over 4 context ranks (as the allocator deals them): each rank, walking its
  own listed pages, reads at most 0.3x the pages one rank holding all of them reads, and the 4
  partial results merge into the whole."""
  rng = np.random.default_rng(5)
  ps, cp = 8, 4
  q, cache, table, kv_lens = _decode_batch(rng, 8, ps, 16)
  kv_lens = np.maximum(kv_lens, 64)  # contexts of several pages per rank
  whole_o, _, whole_pages = _attend(q, cache, _decode_md(table, kv_lens, False), backend,
                                    **KW[backend])
  col = np.arange(table.shape[1])[None, :]
  o = lse = None
  for rank in range(cp):
    own = np.where(col % cp == rank, table, -1)
    o_r, lse_r, pages_r = _attend(q, cache, _decode_md(own, kv_lens, True), backend,
                                  **KW[backend])
    assert int(pages_r.sum()) <= 0.3 * int(whole_pages.sum()), (rank, pages_r, whole_pages)
    o, lse = (o_r, lse_r) if o is None else merge_attention(o, lse, o_r, lse_r)
  np.testing.assert_allclose(np.asarray(o), np.asarray(whole_o), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", PALLAS)
def test_gemma3_local_layer_at_32k_reads_its_window(backend):
  """A Gemma-3-270M local layer (4 query heads, 1 KV head, head_dim 256, window 512) decoding
  at 32k tokens over 16-token pages: the row reads at most window / page_size + 1 = 33 of its
  2048 pages. The table points far-back entries at pages outside the window's (they would give
  wrong numbers if read); the result matches a dense pass over the window's keys."""
  rng = np.random.default_rng(0)
  ps, window, kv_len, hq, d = 16, 512, 32768, 4, 256
  n_pages = kv_len // ps  # 2048 entries over a pool of 48 pages: entry j -> page 1 + j % 47
  table = (1 + np.arange(n_pages) % 47)[None, :].astype(np.int32)
  cache = rng.standard_normal((1, 48, 2, 1, ps, d)).astype(np.float32)
  q = rng.standard_normal((1, hq, d)).astype(np.float32)
  o, _, pages = _attend(jnp.asarray(q), jnp.asarray(cache),
                        _decode_md(table, np.array([kv_len]), False), backend, window,
                        **KW[backend])
  assert int(pages[0]) <= window // ps + 1
  keys = np.arange(kv_len - window, kv_len)
  k = cache[0, table[0, keys // ps], 0, 0, keys % ps]  # [window, D]
  v = cache[0, table[0, keys // ps], 1, 0, keys % ps]
  sc = q[0] @ k.T * d ** -0.5  # [Hq, window]
  p = np.exp(sc - sc.max(axis=1, keepdims=True))
  np.testing.assert_allclose(np.asarray(o[0]), (p / p.sum(axis=1, keepdims=True)) @ v,
                             atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ("xla",) + PALLAS)
def test_listed_pages_give_the_tables_result(merge_case_batch, backend):
  """Each part of a random split of the pages, listed first with their positions
  (`context_pages`): walking those alone gives the part's result exactly, for mixed batches
  (prefill chunks, verify trees, windows, absent pages)."""
  case, b, _ = merge_case_batch
  pages = b["page_indices"]
  part = np.random.default_rng(7).random(pages.shape) < 0.5
  kw = _backend_kw(case, backend)
  tol = 3e-2 if case.dtype == "bfloat16" else 1e-5
  for table in (np.where(part, pages, -1), np.where(part, -1, pages)):
    o, lse = run(case, b, backend, page_indices=table, softmax_state=True, **kw)
    o_c, lse_c = run(case, b, backend, page_indices=table, softmax_state=True, compact=True, **kw)
    np.testing.assert_allclose(o_c, o, atol=tol, rtol=tol)
    np.testing.assert_allclose(lse_c, lse, atol=10 * tol, rtol=tol)


@pytest.mark.slow
def test_tpu_listed_walk_has_no_races():
  """The strict TPU interpreter over a windowed walk of listed pages (two simulated cores)."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
  from jax.experimental.pallas import tpu as pltpu
  rng = np.random.default_rng(9)
  q, cache, table, kv_lens = _decode_batch(rng, 4, 8, 6, absent=0.3)
  params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
  pltpu.reset_tpu_interpret_mode_state()
  try:
    o, _, pages = ragged_paged_attention(
        q, cache, _decode_md(table, kv_lens, True), sm_scale=0.125, sliding_window=jnp.int32(13),
        return_softmax_state=True, backend="pallas_tpu", interpret=params, count_pages=True,
        block_q=2, pages_per_block=2)
    assert not tpu_interpret.races.races_found
  finally:
    pltpu.reset_tpu_interpret_mode_state()
  np.testing.assert_array_equal(np.asarray(pages),
                                [_visible(table[s], kv_lens[s], 8, 13) for s in range(4)])
  ref = ragged_paged_attention(q, cache, _decode_md(table, kv_lens, False), sm_scale=0.125,
                               sliding_window=jnp.int32(13), backend="reference")
  np.testing.assert_allclose(np.asarray(o), np.asarray(ref), atol=1e-5, rtol=1e-5)
