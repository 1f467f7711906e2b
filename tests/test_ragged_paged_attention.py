"""Ragged paged attention: every backend against a per-token numpy oracle, by the contract of
`AttentionMetadata`.

Batches mix decode (q_len=1), verify (1 < q_len <= verify_width, optionally a tree), prefill
(q_len=kv_len) and chunked prefill (0<q_len<kv_len) sequences; pages come from a shuffled pool;
every slot not holding a live token is NaN; the cache has two layers and the other one is
garbage; the batch is padded (num_seqs < S, T past the real tokens, junk in the padded metadata).
The Pallas kernels run in interpret mode, so everything here runs on the CPU.
"""
from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import AttentionMetadata
from pallas_kernels.kv_cache_layout import quantize_pages
from pallas_kernels.ragged_paged_attention import (BACKENDS, default_backend, merge_attention,
                                                   ragged_paged_attention)

LAYER = 1  # of 2: the kernels must read this layer's pages and never the other's


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  hq: int
  hkv: int
  head_dim: int
  page_size: int
  seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len) of each live sequence
  num_slots: int  # S >= len(seqs)
  num_tokens: int  # T >= sum of q_lens
  dtype: str = "float32"
  sliding_window: int | None = None
  soft_cap: float | None = None
  k_scale: float | None = None
  v_scale: float | None = None
  max_q_len: int | None = None
  verify_width: int = 1
  tree: bool = False  # random trees over verify sequences' rows (else causal)
  absent_pages: bool = False  # some context pages marked absent (-1): their keys are skipped
  garbage_padding: bool = True  # padded cu_q_lens/kv_lens entries hold junk, not the total
  xla_kw: tuple = (("block_q", 8), ("pages_per_block", 1))
  tpu_kw: tuple = (("block_q", 8), ("pages_per_block", 2))
  gpu_kw: tuple = (("block_rows", 16), ("pages_per_block", 2))


CASES = [
    Case("mha_d64_p8_f32", 4, 4, 64, 8,
         ((1, 19), (12, 12), (5, 30), (1, 1), (16, 16)), num_slots=7, num_tokens=48),
    Case("gqa4_d128_p16_bf16", 8, 2, 128, 16,
         ((1, 40), (20, 20), (7, 35)), num_slots=4, num_tokens=40, dtype="bfloat16",
         garbage_padding=False),
    Case("gqa8_d64_p16_window", 16, 2, 64, 16,
         ((1, 50), (24, 24), (9, 41), (1, 7)), num_slots=5, num_tokens=40, sliding_window=13),
    Case("mqa_d128_p8_softcap_bf16", 8, 1, 128, 8,
         ((3, 21), (1, 33), (14, 14)), num_slots=4, num_tokens=24, dtype="bfloat16", soft_cap=2.0),
    Case("gqa4_d64_p8_window_softcap_scales", 8, 2, 64, 8,
         ((6, 20), (1, 33), (13, 13), (2, 9)), num_slots=6, num_tokens=32, sliding_window=6,
         soft_cap=3.0, k_scale=0.5, v_scale=2.0),
    Case("decode_only_gqa4_d128_p16", 8, 2, 128, 16,
         ((1, 17), (1, 1), (1, 64), (1, 30), (1, 16)), num_slots=8, num_tokens=8, max_q_len=1,
         tpu_kw=(("block_q", 8), ("pages_per_block", 4)),
         gpu_kw=(("pages_per_block", 8),)),  # wider than the 5-entry table: clamped slots
    Case("prefill_only_mqa_d64_p16_default_blocks", 4, 1, 64, 16,
         ((37, 37), (5, 5)), num_slots=2, num_tokens=48, xla_kw=(), tpu_kw=(), gpu_kw=()),
    # Verify rows: k+1 = 4 rows on a cached context, beside decodes and a prefill chunk.
    Case("verify_chains_gqa2_d64_p8", 4, 2, 64, 8,
         ((4, 23), (1, 9), (4, 4), (3, 30), (10, 18)), num_slots=6, num_tokens=32,
         verify_width=4),
    Case("verify_trees_gqa4_d64_p8", 8, 2, 64, 8,
         ((7, 26), (1, 12), (7, 40), (5, 5), (12, 20)), num_slots=6, num_tokens=40,
         verify_width=8, tree=True),
    Case("verify_trees_window_mqa_d64_p8", 4, 1, 64, 8,
         ((6, 35), (8, 19), (1, 30)), num_slots=4, num_tokens=16, verify_width=8, tree=True,
         sliding_window=9),
    Case("absent_pages_gqa2_d64_p8", 4, 2, 64, 8,
         ((1, 40), (9, 33), (5, 5), (4, 29)), num_slots=5, num_tokens=24, verify_width=4,
         absent_pages=True, sliding_window=20),
    # Steps that statically hold no prefill chunk (max_q_len <= verify_width): the XLA path's
    # decode-only form. A decode's own key may sit on an absent page; (3, 3) is a short prompt
    # with no cached context, a verify-class sequence.
    Case("decode_only_window_softcap_scales_absent", 8, 2, 64, 8,
         ((1, 20), (1, 1), (1, 33), (1, 9)), num_slots=6, num_tokens=8, max_q_len=1,
         sliding_window=6, soft_cap=3.0, k_scale=0.5, v_scale=2.0, absent_pages=True),
    Case("verify_only_chains_window_gqa2_d64_p8", 4, 2, 64, 8,
         ((4, 23), (1, 9), (3, 3), (2, 30)), num_slots=5, num_tokens=16, max_q_len=4,
         verify_width=4, sliding_window=5),
    Case("verify_only_trees_softcap_absent_gqa4_d64_p8", 8, 2, 64, 8,
         ((7, 26), (1, 12), (8, 40), (5, 5), (3, 17)), num_slots=6, num_tokens=32, max_q_len=8,
         verify_width=8, tree=True, soft_cap=2.0, absent_pages=True),
]
CASE_IDS = [c.name for c in CASES]
# The fast tier runs these (mixed rows, windows, GQA, trees, absent pages, a decode-only step);
# the rest are slow.
DECODE_ONLY = "verify_only_trees_softcap_absent_gqa4_d64_p8"
FAST_CASES = ("mha_d64_p8_f32", "gqa8_d64_p16_window", "verify_trees_gqa4_d64_p8",
              "absent_pages_gqa2_d64_p8", DECODE_ONLY)
CASE_PARAMS = [pytest.param(c, id=c.name,
                            marks=() if c.name in FAST_CASES else pytest.mark.slow)
               for c in CASES]
# The default blocks run in the fast tier on its two richest cases (tree rows, absent pages and
# a window), the split-context merge on the one with absent pages and on a decode-only step;
# every case in the slow tier.
RICH_CASES = ("verify_trees_gqa4_d64_p8", "absent_pages_gqa2_d64_p8")
RICH_CASE_PARAMS = [pytest.param(c, id=c.name,
                                 marks=() if c.name in RICH_CASES else pytest.mark.slow)
                    for c in CASES]
MERGE_CASE_PARAMS = [pytest.param(c, id=c.name,
                                  marks=() if c.name in (RICH_CASES[1], DECODE_ONLY)
                                  else pytest.mark.slow)
                     for c in CASES]


def random_tree(rng, n: int) -> np.ndarray:  # [n, n] bool: row i sees its ancestors and itself
  parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
  bits = np.zeros((n, n), bool)
  for i in range(n):
    j = i
    while j >= 0:
      bits[i, j] = True
      j = parent[j]
  return bits


def make_batch(case: Case, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  dt = jnp.dtype(case.dtype)
  ps, d = case.page_size, case.head_dim
  n_live = len(case.seqs)
  q_lens = np.array([ql for ql, _ in case.seqs])
  kv_lens_live = np.array([kl for _, kl in case.seqs])
  assert (q_lens <= kv_lens_live).all() and q_lens.sum() <= case.num_tokens
  pages_per_seq = -(-kv_lens_live.max() // ps) + 1  # a spare column of unused entries
  needed = [-(-kl // ps) for kl in kv_lens_live]
  num_pages = 1 + sum(needed) + 3  # sink page 0, the live pages, a few never-used ones
  pool = iter(rng.permutation(np.arange(1, num_pages)))

  # Unused entries (past each sequence's pages, and every padded row) point at random pages.
  page_indices = rng.integers(0, num_pages, (case.num_slots, pages_per_seq)).astype(np.int32)
  # Layer 0 holds finite garbage: reading the wrong layer gives wrong numbers, not NaN.
  cache = np.full((2, num_pages, 2, case.hkv, ps, d), np.nan, np.float32)
  cache[0] = rng.standard_normal(cache[0].shape)
  scale = 2.0 if case.soft_cap else 1.0  # large enough scores that the soft cap bites
  ks, vs, absent = [], [], []
  for s, kl in enumerate(kv_lens_live):
    k = rng.standard_normal((kl, case.hkv, d)).astype(np.float32)
    v = rng.standard_normal((kl, case.hkv, d)).astype(np.float32)
    k, v = k.astype(dt).astype(np.float32), v.astype(dt).astype(np.float32)
    gone = set()
    for j in range(needed[s]):
      page = next(pool)
      page_indices[s, j] = page
      n = min(ps, kl - j * ps)
      cache[LAYER, page, 0, :, :n] = k[j * ps:j * ps + n].transpose(1, 0, 2)
      cache[LAYER, page, 1, :, :n] = v[j * ps:j * ps + n].transpose(1, 0, 2)
      if case.absent_pages and rng.random() < 0.4:
        page_indices[s, j] = -1
        gone.add(j)
    ks.append(k)
    vs.append(v)
    absent.append(gone)

  q = (scale * rng.standard_normal((case.num_tokens, case.hq, d))).astype(dt).astype(np.float32)
  cu = np.zeros(case.num_slots + 1, np.int32)
  cu[1:n_live + 1] = np.cumsum(q_lens)
  kv_lens = np.zeros(case.num_slots, np.int32)
  kv_lens[:n_live] = kv_lens_live
  if case.garbage_padding:
    cu[n_live + 1:] = rng.integers(0, case.num_tokens, case.num_slots - n_live)
    kv_lens[n_live:] = rng.integers(0, 100, case.num_slots - n_live)
  else:
    cu[n_live + 1:] = cu[n_live]
  tree = None
  if case.verify_width > 1:  # causal bits by default; random trees where the case asks
    tree = rng.random((case.num_tokens, case.verify_width)) < 0.5  # junk outside short seqs
    for s, ql in enumerate(q_lens):
      if ql <= case.verify_width:
        bits = random_tree(rng, ql) if case.tree else np.tril(np.ones((ql, ql), bool))
        tree[cu[s]:cu[s] + ql] = False
        tree[cu[s]:cu[s] + ql, :ql] = bits
  return dict(q=q, cache=cache, kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu,
              num_seqs=np.array([n_live], np.int32), tree_mask=tree, ks=ks, vs=vs, absent=absent)


def oracle(case: Case, b: dict) -> tuple[np.ndarray, np.ndarray]:  # [T, Hq, D], lse [T, Hq]
  """Token by token from each sequence's contiguous K/V, never through the page table."""
  g = case.hq // case.hkv
  sm_scale = case.head_dim ** -0.5
  out = np.zeros(b["q"].shape, np.float64)
  lse = np.full(b["q"].shape[:2], -np.inf)
  for s, (q_len, kv_len) in enumerate(case.seqs):
    k = b["ks"][s].astype(np.float64) * (case.k_scale or 1.0)  # [L, Hkv, D]
    v = b["vs"][s].astype(np.float64) * (case.v_scale or 1.0)
    ctx = kv_len - q_len
    for i in range(q_len):
      row = b["cu_q_lens"][s] + i
      if b["tree_mask"] is not None and q_len <= case.verify_width:
        sees_new = b["tree_mask"][row, :q_len]
      else:
        sees_new = np.arange(q_len) <= i
      pos = ctx + sees_new.sum() - 1
      keys = [kp for kp in range(kv_len)
              if (kp < ctx or sees_new[kp - ctx])
              and kp // case.page_size not in b["absent"][s]
              and (case.sliding_window is None or kp > pos - case.sliding_window)]
      if not keys:
        continue
      for h in range(case.hq):
        kh, vh = k[keys, h // g], v[keys, h // g]  # [L', D]
        sc = kh @ b["q"][row, h].astype(np.float64) * sm_scale
        if case.soft_cap is not None:
          sc = case.soft_cap * np.tanh(sc / case.soft_cap)
        w = np.exp(sc - sc.max())
        out[row, h] = (w / w.sum()) @ vh
        lse[row, h] = sc.max() + np.log(w.sum())
  return out, lse


def metadata(case: Case, b: dict, page_indices=None, compact: bool = False) -> AttentionMetadata:
  """`compact`: the present pages also listed first with their positions (`context_pages`)."""
  table = b["page_indices"] if page_indices is None else page_indices
  context = {}
  if compact:  # present pages first, in order; the rest -1
    order = np.argsort(table < 0, axis=1, kind="stable")
    pages = np.take_along_axis(table, order, axis=1)
    context = dict(context_pages=jnp.asarray(pages, jnp.int32),
                   context_page_pos=jnp.asarray(np.where(pages >= 0, order, -1), jnp.int32))
  return AttentionMetadata(
      slot_mapping=jnp.zeros(case.num_tokens, jnp.int32), block_table=jnp.asarray(table),
      kv_lens=jnp.asarray(b["kv_lens"]), cu_q_lens=jnp.asarray(b["cu_q_lens"]),
      num_seqs=jnp.asarray(b["num_seqs"]),
      tree_mask=None if b["tree_mask"] is None else jnp.asarray(b["tree_mask"]),
      max_q_len=case.max_q_len, verify_width=case.verify_width, **context)


@functools.cache
def _jitted(case: Case, backend: str, softmax_state: bool, kw: tuple):
  """One jitted call per case and options: runs that differ only in their arrays (the split
  context's page tables) share its compile."""
  return jax.jit(lambda q, cache, md, window: ragged_paged_attention(
      q, cache, md, layer=jnp.int32(LAYER), sm_scale=case.head_dim ** -0.5,
      sliding_window=window, soft_cap=case.soft_cap, k_scale=case.k_scale,
      v_scale=case.v_scale, return_softmax_state=softmax_state, backend=backend, **dict(kw)))


def run(case: Case, b: dict, backend: str, *, page_indices=None, softmax_state=False,
        compact=False, **kw):
  dt = jnp.dtype(case.dtype)
  md = metadata(case, b, page_indices, compact)
  # The window goes in traced, as a layer scan passes it.
  window = None if case.sliding_window is None else jnp.int32(case.sliding_window)
  fn = _jitted(case, backend, softmax_state, tuple(sorted(kw.items())))
  res = fn(jnp.asarray(b["q"], dt), jnp.asarray(b["cache"], dt), md, window)
  o, lse = res if softmax_state else (res, None)
  assert o.shape == b["q"].shape and o.dtype == dt
  o = np.asarray(o.astype(jnp.float32))
  return (o, np.asarray(lse)) if softmax_state else o


def check(case: Case, got: np.ndarray, want: np.ndarray):
  tol = 3e-2 if case.dtype == "bfloat16" else 1e-4
  assert not np.isnan(got).any()
  np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
  # Padding rows (past the live tokens) come out exactly zero.
  n_real = sum(ql for ql, _ in case.seqs)
  assert (got[n_real:] == 0).all()


@functools.cache
def _batch(case: Case) -> tuple:
  b = make_batch(case)
  return case, b, oracle(case, b)


@pytest.fixture(scope="module", params=CASE_PARAMS)
def case_batch(request):
  return _batch(request.param)


@pytest.fixture(scope="module", params=RICH_CASE_PARAMS)
def rich_case_batch(request):
  return _batch(request.param)


@pytest.fixture(scope="module", params=MERGE_CASE_PARAMS)
def merge_case_batch(request):
  return _batch(request.param)


def _backend_kw(case: Case, backend: str) -> dict:
  return {"reference": {}, "xla": dict(case.xla_kw),
          "pallas_tpu": dict(case.tpu_kw, interpret=True),
          "pallas_gpu": dict(case.gpu_kw, interpret=True)}[backend]


@pytest.mark.parametrize("backend", BACKENDS)
def test_against_oracle(case_batch, backend):
  case, b, (want, _) = case_batch
  check(case, run(case, b, backend, **_backend_kw(case, backend)), want)


def test_xla_default_blocks(rich_case_batch):
  """The CPU path with its own block choices (the other tests use tiles that straddle
  sequences and one page per context step, so every tiling path runs)."""
  case, b, (want, _) = rich_case_batch
  check(case, run(case, b, "xla"), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_softmax_state_merges_split_context(merge_case_batch, backend):
  """Each sequence's pages split at random in two parts, each part attended alone with the other
  marked absent: the merged result equals one pass, and so does the log-sum-exp."""
  case, b, (want, want_lse) = merge_case_batch
  rng = np.random.default_rng(7)
  pages = b["page_indices"]
  part = rng.random(pages.shape) < 0.5
  kw = _backend_kw(case, backend)
  o_a, lse_a = run(case, b, backend, page_indices=np.where(part, pages, -1), softmax_state=True,
                   **kw)
  o_b, lse_b = run(case, b, backend, page_indices=np.where(part, -1, pages), softmax_state=True,
                   **kw)
  o, lse = merge_attention(jnp.asarray(o_a), jnp.asarray(lse_a), jnp.asarray(o_b),
                           jnp.asarray(lse_b))
  whole, whole_lse = run(case, b, backend, softmax_state=True, **kw)
  tol = 3e-2 if case.dtype == "bfloat16" else 1e-5
  np.testing.assert_allclose(np.asarray(o), whole, atol=tol, rtol=tol)
  n_real = sum(ql for ql, _ in case.seqs)
  live = np.isfinite(want_lse[:n_real])
  np.testing.assert_array_equal(np.isfinite(whole_lse[:n_real]), live)
  np.testing.assert_allclose(whole_lse[:n_real][live], want_lse[:n_real][live],
                             atol=10 * tol, rtol=tol)
  np.testing.assert_allclose(np.asarray(lse)[:n_real][live], whole_lse[:n_real][live],
                             atol=10 * tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_xla_decode_only_over_quantized_pages(dtype):
  """The decode-only form over int8 / fp8 pages (every case there in the slow tier of
  tests/test_kv_cache_quantization.py): equal to the reference over the same pages to float
  rounding, the softmax state too."""
  case = next(c for c in CASES if c.name == DECODE_ONLY)
  b = make_batch(case)
  cache = quantize_pages(jnp.asarray(b["cache"]), {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[dtype])
  fn = lambda backend: jax.jit(lambda q, cache, md: ragged_paged_attention(
      q, cache, md, layer=jnp.int32(LAYER), sm_scale=case.head_dim ** -0.5,
      soft_cap=case.soft_cap, return_softmax_state=True, backend=backend))(
          jnp.asarray(b["q"]), cache, metadata(case, b))
  (o, lse), (want, want_lse) = fn("xla"), fn("reference")
  np.testing.assert_allclose(o, want, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=2e-5)


def test_engine_decode_buckets_take_the_decode_only_form():
  """The engine's steps that can hold no prefill chunk (one token, and a verify step of at most
  k + 1 rows) say so in their static metadata, and the XLA path then lowers to one loop (the
  context's) instead of the row tiles' loops and the prefill chunks' nest of them."""
  from jinfer.engine.step_input import Buckets, empty_step_input, to_step_input
  b = Buckets(max_num_seqs=8, max_num_batched_tokens=16, max_prefill_seqs=2,
              max_pages_per_seq=4, max_model_len=64, num_speculative_tokens=3)

  def loops(t: int, verify: bool) -> int:
    md = to_step_input(empty_step_input(b, t, verify=verify), b).md
    md = md.replace(slot_mapping=md.slot_mapping[0], block_table=md.block_table[0])  # group 0
    attend = lambda q, cache, md: ragged_paged_attention(q, cache, md, sm_scale=0.125)
    text = jax.jit(attend).lower(jnp.zeros((t, 4, 64)), jnp.zeros((1, 9, 2, 2, 8, 64)),
                                 md).as_text()
    return text.count("stablehlo.while")

  assert b.token_buckets == [1, 2, 4, 8, 16]
  assert loops(1, False) == loops(1, True) == loops(4, True) == 1
  assert loops(2, False) > 3 and loops(8, True) > 3  # these may hold a prefill chunk


RACE_CASES = [
    Case("race_mixed_gqa2", 4, 2, 64, 8, ((1, 11), (6, 6), (3, 14)), num_slots=4, num_tokens=16),
    Case("race_decode_window", 2, 1, 64, 8, ((1, 20), (1, 3), (1, 9)), num_slots=4, num_tokens=8,
         sliding_window=5, max_q_len=1),
    Case("race_tree_absent", 4, 2, 64, 8, ((4, 20), (1, 9), (6, 6)), num_slots=4, num_tokens=16,
         verify_width=4, tree=True, absent_pages=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", RACE_CASES, ids=[c.name for c in RACE_CASES])
def test_pallas_tpu_detect_races(case):
  """The strict TPU interpreter: fails on DMA races, out-of-bounds reads, reads before a wait."""
  b = make_batch(case, seed=1)
  # Two simulated cores: the "parallel" grid axis is split between them, as on a megacore chip.
  params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
  pltpu.reset_tpu_interpret_mode_state()
  try:
    got = run(case, b, "pallas_tpu", interpret=params, block_q=8, pages_per_block=2)
    # The race detector only prints and raises a flag; the flag lives in private module state.
    assert not tpu_interpret.races.races_found
  finally:
    pltpu.reset_tpu_interpret_mode_state()
  check(case, got, oracle(case, b)[0])


@pytest.mark.parametrize("backend,platform", [("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")])
@pytest.mark.parametrize("tree", [False, True])
def test_lowers_for_device(backend, platform, tree):
  """Lowering to Mosaic / Triton IR runs on the CPU and catches unsupported ops and block shapes."""
  t, s, p, hq, hkv, d, w = 64, 8, 16, 32, 8, 128, 8
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)

  def fn(q, cache, slots, table, lens, cu, n, tree_mask, layer, window):
    md = AttentionMetadata(slot_mapping=slots, block_table=table, kv_lens=lens, cu_q_lens=cu,
                           num_seqs=n, tree_mask=tree_mask, verify_width=w if tree else 1)
    return ragged_paged_attention(q, cache, md, layer=layer, sm_scale=d ** -0.5,
                                  sliding_window=window, soft_cap=30.0,
                                  return_softmax_state=True, backend=backend)

  jax.jit(fn).trace(
      jax.ShapeDtypeStruct((t, hq, d), jnp.bfloat16),
      jax.ShapeDtypeStruct((2, 100, 2, hkv, 16, d), jnp.bfloat16),
      i32(t), i32(s, p), i32(s), i32(s + 1), i32(1),
      jax.ShapeDtypeStruct((t, w), jnp.bool_) if tree else None, i32(), i32(),
  ).lower(lowering_platforms=(platform,))


@pytest.mark.parametrize("backend,platform", [("pallas_tpu", "tpu"), ("pallas_gpu", "gpu")])
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[8]], ids=lambda c: c.name)
def test_compiled_on_device(backend, platform, case):
  if jax.default_backend() != platform:
    pytest.skip(f"needs a real {platform.upper()}: on {jax.default_backend()} the kernel only "
                "runs interpreted (tested above)")
  b = make_batch(case)
  check(case, run(case, b, backend, **dict(case.tpu_kw if platform == "tpu" else case.gpu_kw)),
        oracle(case, b)[0])


def test_default_backend():
  want = {"cpu": "xla", "tpu": "pallas_tpu", "gpu": "pallas_gpu"}[jax.default_backend()]
  assert default_backend() == want


def test_unknown_backend_raises():
  case = CASES[0]
  with pytest.raises(ValueError, match="unknown attention backend"):
    run(case, make_batch(case), "cuda")


@pytest.mark.slow
def test_bench_script_smoke(tmp_path):
  """The device benchmark script runs end to end (tiny shapes, kernels interpreted)."""
  from jinfer.bench.kernels import main
  out = tmp_path / "bench.json"
  # The grouped matmul part runs in tests/test_grouped_matmul.py (slow tier).
  report = main(["--smoke", "--skip", "grouped_matmul", "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(report))
  for r in report["results"]:
    assert r["ms"] > 0 and r.get("max_abs_err_vs_reference", 0.0) < 1e-3
