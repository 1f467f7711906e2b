"""Ragged paged attention: the reference and both Pallas kernels against a per-token numpy oracle.

Batches mix decode (q_len=1), prefill (q_len=kv_len) and chunked prefill (0<q_len<kv_len)
sequences; pages come from a shuffled pool; every slot not holding a live token is NaN; the batch
is padded (num_seqs < S, T past the real tokens, garbage in the padded metadata). The kernels run
in interpret mode, so everything here runs on the CPU.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import default_backend, ragged_paged_attention


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
  garbage_padding: bool = True  # padded cu_q_lens/kv_lens entries hold junk, not the total
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
         ((37, 37), (5, 5)), num_slots=2, num_tokens=48, tpu_kw=(), gpu_kw=()),
]
CASE_IDS = [c.name for c in CASES]


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
  cache = np.full((num_pages, 2, case.hkv, ps, d), np.nan, np.float32)
  scale = 2.0 if case.soft_cap else 1.0  # large enough scores that the soft cap bites
  ks, vs = [], []
  for s, kl in enumerate(kv_lens_live):
    k = rng.standard_normal((kl, case.hkv, d)).astype(np.float32)
    v = rng.standard_normal((kl, case.hkv, d)).astype(np.float32)
    k, v = k.astype(dt).astype(np.float32), v.astype(dt).astype(np.float32)
    for j in range(needed[s]):
      page = next(pool)
      page_indices[s, j] = page
      n = min(ps, kl - j * ps)
      cache[page, 0, :, :n] = k[j * ps:j * ps + n].transpose(1, 0, 2)
      cache[page, 1, :, :n] = v[j * ps:j * ps + n].transpose(1, 0, 2)
    ks.append(k)
    vs.append(v)

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
  return dict(q=q, cache=cache, kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu,
              num_seqs=np.array([n_live], np.int32), ks=ks, vs=vs)


def oracle(case: Case, b: dict) -> np.ndarray:  # [T, Hq, D] float64
  """Attention token by token from each sequence's contiguous K/V, never through the page table."""
  g = case.hq // case.hkv
  sm_scale = case.head_dim ** -0.5
  out = np.zeros(b["q"].shape, np.float64)
  for s, (q_len, kv_len) in enumerate(case.seqs):
    k = b["ks"][s].astype(np.float64) * (case.k_scale or 1.0)  # [L, Hkv, D]
    v = b["vs"][s].astype(np.float64) * (case.v_scale or 1.0)
    for i in range(q_len):
      row = b["cu_q_lens"][s] + i
      pos = kv_len - q_len + i
      lo = 0 if case.sliding_window is None else max(0, pos - case.sliding_window + 1)
      for h in range(case.hq):
        kh, vh = k[lo:pos + 1, h // g], v[lo:pos + 1, h // g]  # [L', D]
        sc = kh @ b["q"][row, h].astype(np.float64) * sm_scale
        if case.soft_cap is not None:
          sc = case.soft_cap * np.tanh(sc / case.soft_cap)
        w = np.exp(sc - sc.max())
        out[row, h] = (w / w.sum()) @ vh
  return out


def run(case: Case, b: dict, backend: str, **kw) -> np.ndarray:
  dt = jnp.dtype(case.dtype)
  fn = jax.jit(lambda q, cache, kv_lens, pi, cu, n: ragged_paged_attention(
      q, cache, kv_lens, pi, cu, n, sm_scale=case.head_dim ** -0.5,
      sliding_window=case.sliding_window, soft_cap=case.soft_cap, k_scale=case.k_scale,
      v_scale=case.v_scale, max_q_len=case.max_q_len, backend=backend, **kw))
  out = fn(jnp.asarray(b["q"], dt), jnp.asarray(b["cache"], dt), b["kv_lens"],
           b["page_indices"], b["cu_q_lens"], b["num_seqs"])
  assert out.shape == b["q"].shape and out.dtype == dt
  return np.asarray(out.astype(jnp.float32))


def check(case: Case, got: np.ndarray, want: np.ndarray):
  tol = 3e-2 if case.dtype == "bfloat16" else 1e-4
  assert not np.isnan(got).any()
  np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
  # Padding rows (past the live tokens) come out exactly zero.
  n_real = sum(ql for ql, _ in case.seqs)
  assert (got[n_real:] == 0).all()


@pytest.fixture(scope="module", params=CASES, ids=CASE_IDS)
def case_batch(request):
  case = request.param
  b = make_batch(case)
  return case, b, oracle(case, b)


def test_reference(case_batch):
  case, b, want = case_batch
  check(case, run(case, b, "reference"), want)


@pytest.mark.parametrize("block_q", [8, 16])
def test_reference_small_blocks(case_batch, block_q):
  """Small row tiles straddle sequences (16 also leaves T a partial tile) and context loops
  take one page per step, so every tiling path of the reference runs."""
  case, b, want = case_batch
  check(case, run(case, b, "reference", block_q=block_q, pages_per_block=1), want)


def test_pallas_tpu_interpret(case_batch):
  case, b, want = case_batch
  check(case, run(case, b, "pallas_tpu", interpret=True, **dict(case.tpu_kw)), want)


def test_pallas_gpu_interpret(case_batch):
  case, b, want = case_batch
  check(case, run(case, b, "pallas_gpu", interpret=True, **dict(case.gpu_kw)), want)


RACE_CASES = [
    Case("race_mixed_gqa2", 4, 2, 64, 8, ((1, 11), (6, 6), (3, 14)), num_slots=4, num_tokens=16),
    Case("race_decode_window", 2, 1, 64, 8, ((1, 20), (1, 3), (1, 9)), num_slots=4, num_tokens=8,
         sliding_window=5, max_q_len=1),
]


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
  check(case, got, oracle(case, b))


@pytest.mark.parametrize("backend,platform", [("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")])
def test_lowers_for_device(backend, platform):
  """Lowering to Mosaic / Triton IR runs on the CPU and catches unsupported ops and block shapes."""
  t, s, p, hq, hkv, d = 64, 8, 16, 32, 8, 128
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  fn = jax.jit(lambda *a: ragged_paged_attention(
      *a, sm_scale=d ** -0.5, sliding_window=64, soft_cap=30.0, backend=backend))
  fn.trace(jax.ShapeDtypeStruct((t, hq, d), jnp.bfloat16),
           jax.ShapeDtypeStruct((100, 2, hkv, 16, d), jnp.bfloat16),
           i32(s), i32(s, p), i32(s + 1), i32(1)).lower(lowering_platforms=(platform,))


@pytest.mark.parametrize("backend,platform", [("pallas_tpu", "tpu"), ("pallas_gpu", "gpu")])
@pytest.mark.parametrize("case", CASES[1:4], ids=CASE_IDS[1:4])
def test_compiled_on_device(backend, platform, case):
  if jax.default_backend() != platform:
    pytest.skip(f"needs a real {platform.upper()}: on {jax.default_backend()} the kernel only "
                "runs interpreted (tested above)")
  b = make_batch(case)
  check(case, run(case, b, backend, **dict(case.tpu_kw if platform == "tpu" else case.gpu_kw)),
        oracle(case, b))


def test_default_backend():
  want = {"cpu": "reference", "tpu": "pallas_tpu", "gpu": "pallas_gpu"}[jax.default_backend()]
  assert default_backend() == want


def test_unknown_backend_raises():
  case = CASES[0]
  with pytest.raises(ValueError, match="unknown attention backend"):
    run(case, make_batch(case), "cuda")


def test_bench_script_smoke(tmp_path):
  """The device benchmark script runs end to end (tiny shapes, kernels interpreted)."""
  script = pathlib.Path(__file__).parents[1] / "examples" / "bench_kernels_device.py"
  main = runpy.run_path(str(script))["main"]
  out = tmp_path / "bench.json"
  report = main(["--smoke", "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(report))
  for r in report["results"]:
    assert r["ms"] > 0 and r.get("max_abs_err_vs_reference", 0.0) < 1e-3
