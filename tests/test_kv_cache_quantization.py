"""A quantized KV cache (`kv_cache_dtype` "int8" / "fp8"): the quantizer's error bound, every
attention backend against the reference over the same quantized pages (and against the float
oracle within the quantization error), lowering with int8 pages, the engine with an int8 cache
(zero compiles after warmup, batch invariance with preemption and prefix hits, bytes per token),
and in the slow tier: closeness to the float cache, speculative decoding, ring attention, MoE,
and the real SmolLM2's perplexity and answer."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pydoc_data.topics import topics

from jinfer.engine.engine_config import EngineConfig
from jinfer.errors import ParameterError
from jinfer.sampling.params import SamplingParams
from pallas_kernels import AttentionMetadata, KVCacheSpec, QuantizedKVCache, write_kv
from pallas_kernels.kv_cache_layout import (copy_slots, dequantize, key_rotation, quantize,
                                            quantize_pages, rotate_keys)
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from tests.engine_fixtures import (CompileCounter, make_engine, prefix_sharing_prompts,
                                   random_prompts, run_tokens)
from tests.test_ragged_paged_attention import CASES, LAYER, make_batch, metadata, oracle

INT8, FP8 = jnp.int8, jnp.float8_e4m3fn
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


# -- the quantizer ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
def test_quantize_error_bound(dtype):
  """Per row: int8 within half a step (absmax / 254); e4m3 within 2^-4 of each value (3 mantissa
  bits), or 2^-10 of the scale for values in its subnormal range. An all-zero row stays zero."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 4, 128)) * np.exp(rng.uniform(-6, 6, (64, 4, 1)))
  x[3, 2] = 0.0
  x = jnp.asarray(x, jnp.float32)
  values, scales = quantize(x, dtype)
  assert values.dtype == dtype and scales.shape == (64, 4) and scales.dtype == jnp.float32
  err = np.abs(np.asarray(dequantize(values, scales) - x))
  s, ax = np.asarray(scales)[..., None], np.abs(np.asarray(x))
  bound = s / 2 if dtype == INT8 else np.maximum(ax * 2.0 ** -4, s * 2.0 ** -10)
  assert (err <= bound * (1 + 1e-5) + 1e-30).all()
  assert (np.asarray(dequantize(values, scales))[3, 2] == 0).all()
  # The row's absmax maps onto the dtype's largest value: no step is wasted.
  top = np.asarray(values.astype(jnp.float32)).__abs__().max(-1)
  np.testing.assert_allclose(np.delete(top.reshape(-1), 3 * 4 + 2),
                             127.0 if dtype == INT8 else 448.0)


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_key_rotation_is_orthonormal_and_spreads_outliers(head_dim):
  r = key_rotation(head_dim)
  np.testing.assert_allclose(r @ r, np.eye(head_dim), atol=1e-6)  # its own inverse
  np.testing.assert_array_equal(r, r.T)
  # Keys with an outlier channel (as RoPE'd keys have): rotated, int8 loses far less of them.
  rng = np.random.default_rng(0)
  k = rng.standard_normal((256, head_dim)).astype(np.float32)
  k[:, 3] *= 30.0
  err = lambda x: np.abs(np.asarray(dequantize(*quantize(jnp.asarray(x), INT8))) - x).mean()
  assert err(np.asarray(rotate_keys(k))) < 0.3 * err(k)


def test_write_kv_and_copy_slots_carry_the_scales():
  spec = KVCacheSpec(num_layers=2, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8,
                     dtype=INT8)
  cache = spec.allocate()
  assert isinstance(cache, QuantizedKVCache) and cache.nbytes == spec.nbytes
  assert spec.bytes_per_token == 2 * 2 * 2 * (8 + 4)
  rng = np.random.default_rng(1)
  k, v = (jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32) for _ in range(2))
  slots = jnp.asarray([5, 6, 13], jnp.int32)  # page 1 offsets 1, 2; page 3 offset 1
  cache = jax.jit(write_kv)(cache, 1, k, v, slots)
  got = dequantize(cache.values[1, 3, :, :, 1], cache.scales[1, 3, :, :, 1])  # [2, Hkv, D]
  want = dequantize(*quantize(jnp.stack([rotate_keys(k[2]), v[2]]), INT8))  # K stored rotated
  np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(jnp.stack([rotate_keys(got[0]), got[1]]), jnp.stack([k[2], v[2]]),
                             atol=0.05)
  moved = copy_slots(cache, jnp.asarray([13, 5]), jnp.asarray([18, -1]))  # 13 -> page 4 offset 2
  for x in (moved.values, moved.scales):
    np.testing.assert_array_equal(np.asarray(x)[:, 4, :, :, 2], np.asarray(x)[:, 3, :, :, 1])


# -- the attention backends ---------------------------------------------------------------------
@functools.cache
def _batch(case, dtype: str) -> tuple:
  """The test batch, its cache quantized (never-written slots, NaN, get NaN scales), and the
  reference's output over those pages."""
  b = make_batch(case)
  cache = quantize_pages(jnp.asarray(b["cache"]), {"int8": INT8, "fp8": FP8}[dtype])
  return b, cache, _attend(case, b, cache, "reference")


_KW = {"reference": {}, "xla": "xla_kw", "pallas_tpu": "tpu_kw", "pallas_gpu": "gpu_kw"}


def _attend(case, b, cache, backend: str) -> np.ndarray:
  kw = {} if backend == "reference" else dict(getattr(case, _KW[backend]))
  if backend.startswith("pallas"):
    kw["interpret"] = True
  fn = jax.jit(lambda q, cache, md: ragged_paged_attention(
      q, cache, md, layer=jnp.int32(LAYER), sm_scale=case.head_dim ** -0.5,
      sliding_window=case.sliding_window, soft_cap=case.soft_cap, k_scale=case.k_scale,
      v_scale=case.v_scale, backend=backend, **kw))
  return np.asarray(fn(jnp.asarray(b["q"]), cache, metadata(case, b)))


RICH = next(c for c in CASES if c.name == "absent_pages_gqa2_d64_p8")  # window, verify rows
TREES = next(c for c in CASES if c.name == "verify_trees_gqa4_d64_p8")
# Max |error| against the float oracle over unit-normal K/V: int8 measured 0.02, e4m3 0.14.
ORACLE_TOL = {"int8": 0.06, "fp8": 0.35}


@pytest.mark.parametrize("dtype", [
    "int8", pytest.param("fp8", marks=pytest.mark.slow)])
@pytest.mark.parametrize("backend", [
    "xla", *[pytest.param(b, marks=pytest.mark.slow) for b in ("pallas_tpu", "pallas_gpu")]])
@pytest.mark.parametrize("case", [
    RICH, pytest.param(TREES, marks=pytest.mark.slow),
    *[pytest.param(c, marks=pytest.mark.slow) for c in CASES if c not in (RICH, TREES)
      and c.dtype == "float32"]], ids=lambda c: getattr(c, "name", None))
def test_backends_match_reference_on_quantized_pages(case, backend, dtype):
  """The kernels dequantize in VMEM / registers by folding the row scales into the products;
  the reference dequantizes whole pages: equal to float rounding. Unused slots hold NaN scales."""
  b, cache, want = _batch(case, dtype)
  got = _attend(case, b, cache, backend)
  assert not np.isnan(got).any()
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  n_real = sum(ql for ql, _ in case.seqs)
  assert (got[n_real:] == 0).all()
  exact, _ = oracle(case, b)
  assert np.abs(want - exact).max() < ORACLE_TOL[dtype] * (case.v_scale or 1.0)


@pytest.mark.parametrize("backend,platform,dtype", [
    ("pallas_tpu", "tpu", INT8), ("pallas_gpu", "cuda", INT8),
    pytest.param("pallas_gpu", "cuda", FP8, marks=pytest.mark.slow)])
def test_lowers_for_device_with_quantized_pages(backend, platform, dtype):
  """As test_ragged_paged_attention.test_lowers_for_device, over int8 / fp8 pages and scales."""
  t, s, p, hq, hkv, d, ps = 64, 8, 16, 32, 8, 128, 32
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)

  def fn(q, cache, slots, table, lens, cu, n, layer, window):
    md = AttentionMetadata(slot_mapping=slots, block_table=table, kv_lens=lens, cu_q_lens=cu,
                           num_seqs=n)
    return ragged_paged_attention(q, cache, md, layer=layer, sm_scale=d ** -0.5,
                                  sliding_window=window, soft_cap=30.0,
                                  return_softmax_state=True, backend=backend)

  cache = QuantizedKVCache(jax.ShapeDtypeStruct((2, 100, 2, hkv, ps, d), dtype),
                           jax.ShapeDtypeStruct((2, 100, 2, hkv, ps), jnp.float32))
  jax.jit(fn).trace(jax.ShapeDtypeStruct((t, hq, d), jnp.bfloat16), cache, i32(t), i32(s, p),
                    i32(s), i32(s + 1), i32(1), i32(), i32()).lower(lowering_platforms=(platform,))


@pytest.mark.slow
def test_pallas_tpu_quantized_pages_detect_races():
  """The strict TPU interpreter over int8 pages: the scale copies share the page semaphores, and
  no scale is read before its wait (as test_ragged_paged_attention's race test)."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
  from jax.experimental.pallas import tpu as pltpu
  from tests.test_ragged_paged_attention import RACE_CASES
  case = RACE_CASES[2]  # tree rows, absent pages
  b = make_batch(case, seed=1)
  cache = quantize_pages(jnp.asarray(b["cache"]), INT8)
  want = _attend(case, b, cache, "reference")
  params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
  pltpu.reset_tpu_interpret_mode_state()
  try:
    got = ragged_paged_attention(
        jnp.asarray(b["q"]), cache, metadata(case, b), layer=jnp.int32(LAYER),
        sm_scale=case.head_dim ** -0.5, backend="pallas_tpu", interpret=params, block_q=8,
        pages_per_block=2)
    assert not tpu_interpret.races.races_found
  finally:
    pltpu.reset_tpu_interpret_mode_state()
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


# -- the engine -----------------------------------------------------------------------------------
# Buckets of 1, 2 and 4 tokens, every step scanned (three quick compiles); 32 pages of 4 tokens
# for 4 sequences of up to 64: long prompts are chunked and the pool forces preemption.
QUICK = dict(max_model_len=64, page_size=4, num_pages=17, max_num_seqs=4,
             max_num_batched_tokens=2, max_prefill_seqs=1, scan_layers=True)


@pytest.fixture(scope="module")
def int8_engine(tiny_model):
  return make_engine(tiny_model, kv_cache_dtype="int8", **QUICK)


def test_int8_engine_no_compiles_batch_invariant_and_bytes(int8_engine, tiny_model):
  eng = int8_engine
  assert isinstance(eng.runner.kv_cache, QuantizedKVCache)
  assert eng.runner.kv_cache.values.dtype == jnp.int8
  compiles = CompileCounter()
  prompts = [p[:38] for p in prefix_sharing_prompts()]
  params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
  alone = [run_tokens(eng, [p], params)[0] for p in prompts]
  before = eng.stats()
  together = run_tokens(eng, prompts, params)
  after = eng.stats()
  assert together == alone
  assert after.num_preemptions > before.num_preemptions and after.prefix_hit_rate > 0
  assert compiles.count == 0
  # Bytes per token against the float32 cache the CPU uses by default: (D + 4) / (4 D).
  config = tiny_model[0]
  d = config.head_dim
  float_spec = EngineConfig.of(**QUICK).resolve(config).kv_spec(config)
  assert after.kv_bytes_per_token == 2 * config.num_layers * config.num_kv_heads * (d + 4)
  assert after.kv_bytes_per_token / float_spec.bytes_per_token == (d + 4) / (4 * d)
  assert after.kv_cache_bytes == eng.runner.spec.nbytes
  assert after.kv_pages_per_gib == 2**30 / (after.kv_bytes_per_token * 4)


@pytest.mark.slow
def test_a_step_does_not_copy_the_int8_cache():
  """As test_model_layout's test: the donated values and scales are updated in place, so the
  step's temporaries do not grow with the cache."""
  from jinfer.engine.step_input import empty_step_input, to_step_input
  from tests.test_model_layout import CONFIG, _params
  temps = []
  for num_pages in (64, 8192):  # 3 KV groups of one layer: the cache has one slot
    eng = make_engine((CONFIG, _params(), None), warmup=False, max_model_len=64, page_size=4,
                      num_pages=num_pages, max_num_seqs=4, max_num_batched_tokens=32,
                      scan_layers=True, compilation_cache=False, kv_cache_dtype="int8")
    r, v = eng.runner, eng.runner.variant(32)
    inp = to_step_input(empty_step_input(eng.buckets, 32), eng.buckets)
    mem = v.step.lower(v.params, r.kv_cache, inp, None, None, None).compile().memory_analysis()
    temps.append(mem.temp_size_in_bytes)
  assert r.kv_cache_bytes > 2 * max(temps), "the test needs a cache larger than the temporaries"
  assert temps[0] == temps[1], f"temporaries grew with the cache: {temps}"


def test_kv_cache_dtype_resolves():
  from jinfer.config import ModelConfig
  config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       max_position_embeddings=128)
  for name, dtype in (("auto", jnp.float32), ("int8", INT8), ("fp8", FP8)):
    spec = EngineConfig.of(kv_cache_dtype=name).resolve(config, platform="cpu").kv_spec(config)
    assert spec.dtype == dtype and spec.quantized == (name != "auto")
  # A TPU's quantized cache takes 128-token pages (its scales then fill whole lane tiles), and
  # refuses pages that would make every layer relayout them; other platforms keep 16.
  for name in ("int8", "fp8"):
    assert EngineConfig.of(kv_cache_dtype=name).resolve(config, platform="tpu").cache.page_size \
        == 128
    assert EngineConfig.of(kv_cache_dtype=name, attention_backend="xla").resolve(
        config, platform="gpu").cache.page_size == 16  # head_dim 8: not the Triton kernel's
    with pytest.raises(ParameterError, match="page_size a multiple of 128"):
      EngineConfig.of(kv_cache_dtype=name, page_size=16).resolve(config, platform="tpu")
  assert EngineConfig.of().resolve(config, platform="tpu").cache.page_size == 16
  with pytest.raises(ParameterError, match="kv_cache_dtype must be one of"):
    EngineConfig.of(kv_cache_dtype="int4")


def _logprobs(eng, prompts) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
  """Greedy tokens, and each step's top-5 logprobs (the chosen token's is ~0 on this model)."""
  params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
  rids = [eng.add_request(None, p, params) for p in prompts]
  final = eng.run_to_completion(rids)
  outs = [final[r].outputs[0] for r in rids]
  return [o.token_ids for o in outs], [o.logprobs for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_cache_close_to_float(tiny_model, int8_engine, kv_dtype):
  """Greedy tokens of the float cache for most prompts; the chosen tokens' logprobs close."""
  float_eng = make_engine(tiny_model, **QUICK)
  quant = int8_engine if kv_dtype == "int8" else make_engine(tiny_model, kv_cache_dtype="fp8",
                                                             **QUICK)
  prompts = random_prompts(12, seed=4, hi=40)
  want, want_lp = _logprobs(float_eng, prompts)
  got, got_lp = _logprobs(quant, prompts)
  same = sum(a == b for a, b in zip(got, want))
  # Compared while the tokens agree (after a different token the contexts differ), over the
  # tokens in both top-5s.
  deltas = []
  for g, w, gl, wl in zip(got, want, got_lp, want_lp):
    for x, y, a, b in zip(g, w, gl, wl):
      if x != y:
        break
      deltas += [abs(a[t] - b[t]) for t in set(a) & set(b)]
  print(f"{kv_dtype}: {same}/{len(prompts)} prompts' tokens identical, max |logprob delta| "
        f"{max(deltas):.4f}, mean {np.mean(deltas):.5f}")
  assert same >= 0.8 * len(prompts)
  assert max(deltas) < (0.02 if kv_dtype == "int8" else 0.1)


# -- speculative decoding and prefix caching --------------------------------------------------
SPEC = dict(max_model_len=128, page_size=8, num_pages=17, max_num_seqs=8,
            max_num_batched_tokens=16, max_prefill_seqs=2, kv_cache_dtype="int8")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_with_int8_cache(tiny_model, tiny_model_path, method):
  """Greedy speculation over an int8 cache (rejected drafts rolled back, the draft's own cache
  int8 too) gives the tokens of plain decoding over it, in a batch with preemption and prefix
  hits."""
  spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
          if method == "ngram" else
          {"method": "draft_model", "num_speculative_tokens": 3, "model": tiny_model_path})
  plain = make_engine(tiny_model, warmup=False, **SPEC)
  prompts = prefix_sharing_prompts()
  params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
  want = run_tokens(plain, prompts, params)
  eng = make_engine(tiny_model, warmup=False, speculative_config=spec, **SPEC)
  if method == "draft_model":
    assert isinstance(eng.proposer.kv_cache, QuantizedKVCache)
  assert run_tokens(eng, prompts, params) == want
  st = eng.stats()
  assert st.num_preemptions > 0 and st.prefix_hit_rate > 0 and st.spec.num_accepted_tokens > 0


# -- ring attention -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (conftest.py makes 8)")
def test_ring_attention_over_int8_cache():
  """CP 2 x TP 2 over an int8 cache: each rank quantizes the rows it writes exactly as one
  device does, and the ring's merged output equals one device's."""
  from jinfer.parallel import sharding
  from jinfer.parallel.attention import paged_attention
  from jinfer.parallel.mesh import ParallelConfig, make_mesh
  from tests.test_parallel import _ragged_batch
  mesh = make_mesh(ParallelConfig(tensor_parallel_size=2, context_parallel_size=2))
  kw = dict(layer=jnp.int32(0), sliding_window=None, sm_scale=0.25, backend="xla",
            interpret=False)
  one = jax.jit(lambda q, k, v, c, md: paged_attention(q, k, v, c, md, **kw))
  ring = jax.jit(lambda q, k, v, c, md: paged_attention(q, k, v, c, md, mesh=mesh, **kw))
  rng = np.random.default_rng(3)
  for _ in range(2):
    q, k, v, cache, md = _ragged_batch(rng, 2, hq=4, hkv=2)
    cache = quantize_pages(jnp.asarray(cache), INT8)
    want_o, want_cache = one(q, k, v, cache, md)
    got_o, got_cache = ring(q, k, v, jax.device_put(cache, sharding.kv_cache_sharding(mesh, True)),
                            md)
    n_real = int(md.cu_q_lens[md.num_seqs[0]])
    np.testing.assert_allclose(np.asarray(got_o)[:n_real], np.asarray(want_o)[:n_real],
                               atol=1e-5, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
      np.testing.assert_array_equal(np.asarray(got)[:, 1:], np.asarray(want)[:, 1:])


# -- MoE ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_moe_model_with_int8_cache(tmp_path):
  """A tiny Qwen3-MoE (as tests/test_moe_engine.py) gives its float-cache greedy tokens."""
  import torch
  import transformers
  from jinfer.config import ModelConfig
  from jinfer.weights.safetensors_dir import load_safetensors_dir
  torch.manual_seed(0)
  cfg = transformers.Qwen3MoeConfig(
      vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0],
      max_position_embeddings=512)
  hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
  with torch.no_grad():
    hf.model.embed_tokens.weight.mul_(40.0)
    for layer in hf.model.layers[1:]:
      layer.mlp.gate.weight.mul_(30.0)
  hf.save_pretrained(str(tmp_path))
  config = ModelConfig.from_hf_dir(str(tmp_path))
  loaded = config, load_safetensors_dir(str(tmp_path), config), None
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, 512, rng.integers(5, 40)).tolist() for _ in range(6)]
  out = {dt: run_tokens(make_engine(loaded, warmup=False, kv_cache_dtype=dt, **QUICK), prompts,
                        GREEDY) for dt in ("auto", "int8")}
  assert sum(a == b for a, b in zip(out["int8"], out["auto"])) >= 5


# -- the real model ---------------------------------------------------------------------------
def _prompt_perplexity(llm, ids: list[int]) -> float:
  out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
  lps = [lp[t] for t, lp in zip(ids[1:], out.prompt_logprobs[1:])]
  return math.exp(-float(np.mean(lps)))


@pytest.mark.slow
def test_smollm2_int8_cache_perplexity_and_answer():
  """On a fixed 512-token English text, chunked 32 tokens a step (so every chunk reads its
  context back from the quantized pages): int8 within +0.5% of the float cache's perplexity;
  "Paris" answered greedily."""
  from jinfer import LLM
  from tests.engine_fixtures import SMOLLM2
  # Scanned steps only, compiled as they come: what is measured is the cache, and an unrolled
  # SmolLM2 step compiles every layer.
  opts = dict(SMOLLM2, max_model_len=600, enable_prompt_logprobs=True, warmup=False,
              scan_layers=True)
  ppl, answers, per_token = {}, {}, {}
  for dt in ("auto", "int8"):
    llm = LLM(kv_cache_dtype=dt, **opts)
    ids = llm.tokenizer.encode(topics["assignment"])[:512]
    ppl[dt] = _prompt_perplexity(llm, ids)
    per_token[dt] = llm.engine.stats().kv_bytes_per_token
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    answers[dt] = out[0].outputs[0].text
    del llm
  print(f"perplexity float32 KV {ppl['auto']:.4f}, int8 KV {ppl['int8']:.4f} "
        f"({100 * (ppl['int8'] / ppl['auto'] - 1):+.3f}%); KV bytes/token {per_token['auto']} -> "
        f"{per_token['int8']}; answers {answers}")
  assert ppl["int8"] <= 1.005 * ppl["auto"]
  assert "Paris" in answers["int8"]
  assert per_token["int8"] / per_token["auto"] < 0.27
