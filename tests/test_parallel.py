"""Sharding over the 8 CPU devices the test session makes (conftest.py): ring attention against
one device, tensor / context / data parallel engines against one device (logprobs <= 1e-4,
greedy tokens identical), bytes per device, compiles, errors, and two processes on loopback."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jinfer.config import ModelConfig
from jinfer.engine.data_parallel import DataParallelEngine
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.errors import ParameterError
from jinfer.loader import load_model
from jinfer.models import param_shapes
from jinfer.parallel import sharding
from jinfer.parallel.attention import paged_attention
from jinfer.parallel.mesh import ParallelConfig, make_mesh
from jinfer.quant.groupwise import GroupwiseArray
from jinfer.sampling.params import SamplingParams
from pallas_kernels import AttentionMetadata
from tests.engine_fixtures import SMOLLM2, CompileCounter, kill_the_follower_once_it_ran
from tests.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8,
                                reason="needs 8 devices (conftest.py sets jax_num_cpu_devices)")


# -- ring attention against one device ------------------------------------------------------
def _ragged_batch(rng, cp: int, hq: int, hkv: int, d: int = 16, ps: int = 8, t: int = 64,
                  slots_s: int = 8, pages_per_seq: int = 12):
  """A random ragged step (decodes, chunks on cached context, fresh prefills) of fixed shapes
  over a page pool split into `cp` runs; each sequence's pages drawn from the whole pool."""
  n = int(rng.integers(2, slots_s - 1))
  q_lens = rng.multinomial(t - n - int(rng.integers(0, 8)), np.ones(n) / n) + 1  # some padding
  q_lens[rng.random(n) < 0.3] = 1  # decodes
  ctx = rng.integers(0, 30, n) * (rng.random(n) < 0.7)
  kv_lens = q_lens + ctx
  num_pages = cp * -(-(1 + slots_s * pages_per_seq) // cp)
  pool = iter(rng.permutation(np.arange(1, num_pages)))
  table = np.full((slots_s, pages_per_seq), -1, np.int32)  # unused rows: padding sequences
  cache = rng.standard_normal((1, num_pages, 2, hkv, ps, d)).astype(np.float32)
  slots = np.zeros(t, np.int32)  # padding rows write into the sink page 0
  cu = np.zeros(slots_s + 1, np.int32)
  cu[1:n + 1] = np.cumsum(q_lens)
  cu[n + 1:] = cu[n]
  for s in range(n):
    used = -(-kv_lens[s] // ps)
    table[s, :used] = [next(pool) for _ in range(used)]
    pos = np.arange(ctx[s], kv_lens[s])
    slots[cu[s]:cu[s + 1]] = table[s, pos // ps] * ps + pos % ps
  md = AttentionMetadata(slot_mapping=jnp.asarray(slots), block_table=jnp.asarray(table),
                         kv_lens=jnp.asarray(np.r_[kv_lens, [0] * (slots_s - n)].astype(np.int32)),
                         cu_q_lens=jnp.asarray(cu), num_seqs=jnp.asarray([n], jnp.int32))
  q, k, v = (rng.standard_normal((t, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
  return q, k, v, cache, md


@pytest.mark.parametrize("cp,tp,layout,backend", [
    (2, 2, "zigzag", "xla"), pytest.param(4, 1, "plain", "xla", marks=pytest.mark.slow),
    pytest.param(8, 1, "zigzag", "xla", marks=pytest.mark.slow),
    pytest.param(4, 2, "zigzag", "xla", marks=pytest.mark.slow),
    pytest.param(2, 4, "plain", "xla", marks=pytest.mark.slow),
    # The Pallas kernels run per shard too (interpreted here).
    pytest.param(2, 2, "zigzag", "pallas_tpu", marks=pytest.mark.slow),
    pytest.param(2, 1, "plain", "pallas_gpu", marks=pytest.mark.slow)])
def test_ring_attention_matches_one_device(cp, tp, layout, backend):
  """Random ragged batches: the ring's output and written cache equal one device's."""
  mesh = make_mesh(ParallelConfig(tensor_parallel_size=tp, context_parallel_size=cp))
  kw = dict(layer=jnp.int32(0), sliding_window=None, sm_scale=0.25, backend=backend,
            interpret=backend != "xla")
  one = jax.jit(lambda q, k, v, c, md: paged_attention(q, k, v, c, md, **kw))
  ring = jax.jit(lambda q, k, v, c, md: paged_attention(q, k, v, c, md, mesh=mesh,
                                                         context_layout=layout, **kw))
  rng = np.random.default_rng(cp * 10 + tp)
  for _ in range(3):
    q, k, v, cache, md = _ragged_batch(rng, cp, hq=2 * tp, hkv=tp)
    want_o, want_cache = one(q, k, v, cache, md)
    got_o, got_cache = ring(q, k, v, jax.device_put(cache, sharding.kv_cache_sharding(mesh)), md)
    n_real = int(md.cu_q_lens[md.num_seqs[0]])
    np.testing.assert_allclose(np.asarray(got_o)[:n_real], np.asarray(want_o)[:n_real],
                               atol=1e-5, rtol=1e-5)
    # Every page but the sink (padding rows' scratch) holds the same K/V.
    np.testing.assert_array_equal(np.asarray(got_cache)[:, 1:], np.asarray(want_cache)[:, 1:])
    assert got_cache.sharding.is_equivalent_to(sharding.kv_cache_sharding(mesh), 6)


# -- engines against one device --------------------------------------------------------------
# The second layer has a sliding window shorter than the longer prompts, so every parallel
# engine here runs the hybrid KV cache: a full group and a window group giving back pages.
CFG = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16,
                  max_position_embeddings=8192, rope_theta=100000.0, sliding_windows=(None, 100))


@pytest.fixture(scope="module")
def params():
  rng = np.random.default_rng(0)
  p = jax.tree_util.tree_map_with_path(
      lambda path, s: (np.ones(s.shape) if path[-1].key == "scale"  # norms
                       else rng.standard_normal(s.shape) * 0.2).astype(np.float32),
      param_shapes(CFG))
  p["embedding"] *= 20  # clear greedy winners
  return jax.tree.map(jnp.asarray, p)


def _prompts(lengths, seed=1):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


SHORT = _prompts((5, 37, 120, 260, 9, 70))
LONG = _prompts((3000, 1800, 40))
BASE = dict(max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=128, page_size=16,
            compilation_cache=False)


def _generate(engine, prompts, max_tokens=6):
  sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3)
  rids = [engine.add_request(None, p, sp) for p in prompts]
  final = {}
  while engine.has_unfinished_requests():
    final.update((o.request_id, o) for o in engine.step() if o.finished)
  return [final[r].outputs[0] for r in rids]


def _engine(params, warmup=False, **options):
  config = EngineConfig.of(**{**BASE, **options})
  cls = DataParallelEngine if config.parallel.data_parallel_size > 1 else LLMEngine
  return cls.from_parts(CFG, params, None, config=config, warmup=warmup)


@pytest.fixture(scope="module")
def reference(params):
  """One device's outputs for the short prompts."""
  return _generate(_engine(params), SHORT)


@pytest.fixture(scope="module")
def reference_long(params):
  return _generate(_engine(params, max_num_batched_tokens=512), LONG)


def _assert_same(got, want, rtol: float = 0.0):
  for g, w in zip(got, want):
    assert g.token_ids == w.token_ids
    for gl, wl in zip(g.logprobs, w.logprobs):
      assert gl.keys() == wl.keys()
      np.testing.assert_allclose([gl[t] for t in wl], list(wl.values()), atol=1e-4, rtol=rtol)


# int8 weights on the CPU round activations to 16-bit digits per token: the last-bit differences
# of a sharded float reduction can move a digit by one step (~1.5e-5 of the row's largest value),
# and steps add up over layers and positions. A misplaced scale shard is off by far more.
QUANTIZED_RTOL = 1e-3


# Slow tier, all: an engine on a mesh compiles its steps (18 s for TP 2 alone); the quick tier
# keeps the parts (sharding rules, ring attention, split matmuls, bytes per device).
@pytest.mark.parametrize("options", [
    pytest.param(dict(tensor_parallel_size=2), marks=pytest.mark.slow),
    pytest.param(dict(tensor_parallel_size=8), marks=pytest.mark.slow),  # KV heads x4
    pytest.param(dict(tensor_parallel_size=2, data_parallel_size=2), marks=pytest.mark.slow),
    # TP 4 x CP 2 runs int4 weights in test_int4_parallel_matches_one_device, TP 2 x CP 2
    # GGUF blocks in test_gguf_kept_parallel_matches_one_device.
], ids=lambda o: "-".join(f"{k.split('_')[0]}{v}" for k, v in o.items()))
def test_parallel_engine_matches_one_device(params, reference, options):
  # Data parallel: each rank compiles its startup buckets and runs in them alone ("never": the
  # rest are left uncompiled), nothing compiled on the serving path.
  dp = options.get("data_parallel_size", 1) > 1
  engine = _engine(params, warmup="never" if dp else False, **options)
  _assert_same(_generate(engine, SHORT), reference)
  if dp:
    s = engine.stats()
    assert s.compiles_after_startup == 0 and s.buckets_compiled == 2 < s.buckets_total


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    dict(context_parallel_size=8), dict(context_parallel_size=8, context_layout="plain"),
    dict(context_parallel_size=4, tensor_parallel_size=2),
], ids=lambda o: "-".join(f"{k.split('_')[0]}{v}" for k, v in o.items()))
def test_context_parallel_long_prompts(params, reference_long, options):
  _assert_same(_generate(_engine(params, max_num_batched_tokens=512, **options), LONG),
               reference_long)


def test_bytes_per_device(params):
  """TP 4 x CP 2: sharded weights 1/4 each; a long sequence's KV spread 1/8 each."""
  engine = _engine(params, tensor_parallel_size=4, context_parallel_size=2)
  runner = engine.runner
  per = runner.bytes_per_device()
  assert len(per) == 8
  sharded = [w for w in jax.tree.leaves(runner.params) if "tensor" in w.sharding.spec]
  replicated = [w for w in jax.tree.leaves(runner.params) if "tensor" not in w.sharding.spec]
  want = (sum(w.nbytes for w in sharded) // 4 + sum(w.nbytes for w in replicated))
  assert {w for w, _ in per.values()} == {want}
  # With KV heads duplicated to 4, the cache is [L, pages, 2, 4, ps, D] over 8 devices.
  assert {kv for _, kv in per.values()} == {runner.kv_cache.nbytes // 8}
  assert runner.kv_cache.nbytes == engine.runner.spec.nbytes
  # One long sequence's pages fall evenly over the two context ranks (as the scheduler places
  # them: no step needs to run).
  engine.add_request(None, LONG[0], SamplingParams(max_tokens=1))
  engine.scheduler.schedule()
  seq = engine.scheduler.running[0]
  per_rank = engine.blocks.num_pages // 2
  ranks = np.bincount(np.asarray(seq.pages[0]) // per_rank, minlength=2)
  assert abs(ranks[0] - ranks[1]) <= 1, ranks


INT4 = dict(quantization="int4", quantization_config={"method": "rtn", "group_size": 32})


def _groupwise(engine) -> dict:
  return {path: w for path, w in jax.tree_util.tree_leaves_with_path(
      engine.runner.params, is_leaf=lambda x: isinstance(x, GroupwiseArray))
          if isinstance(w, GroupwiseArray)}


def _q_spec(engine, *path) -> P:
  w = engine.runner.params
  for key in path:
    w = w[key]
  return w.q.sharding.spec


def test_int4_kernels_split_over_tensor(params):
  """Group-wise kernels split as their float kernels do, 1/TP of their bytes on each device;
  where a shard would not hold whole groups (g=128 of o_proj's and down's K=128 over 2) that
  axis stays whole rather than failing (run in test_int4_parallel_matches_one_device). No step
  compiles here."""
  engine = _engine(params, tensor_parallel_size=2, **INT4)
  kernels = _groupwise(engine)
  assert len(kernels) == 7  # q, k, v, o, gate, up, down
  assert _q_spec(engine, "layers", "attn", "q_proj", "kernel") == P(None, None, "tensor")  # N
  assert _q_spec(engine, "layers", "attn", "o_proj", "kernel") == P(None, "tensor", None)  # K
  assert _q_spec(engine, "layers", "mlp", "down_proj", "kernel") == P(None, "tensor", None)
  per = sharding.bytes_per_device(list(kernels.values()))
  total = sum(w.nbytes for w in kernels.values())
  assert set(per.values()) == {total // 2}

  whole = _engine(params, tensor_parallel_size=2, quantization="int4",
                  quantization_config={"method": "rtn", "group_size": 128})
  assert _q_spec(whole, "layers", "attn", "q_proj", "kernel") == P(None, None, "tensor")
  assert _q_spec(whole, "layers", "attn", "o_proj", "kernel") == P(None, None, None)
  assert _q_spec(whole, "layers", "mlp", "down_proj", "kernel") == P(None, None, None)


def test_groupwise_kv_heads_duplicate_as_floats(params):
  """KV heads < TP: a group-wise k/v kernel's columns repeat per head, as a float kernel's."""
  from jinfer.engine.weight_quantization import check_config, quantize_weights
  q = quantize_weights(CFG, params, "int4", check_config("int4", INT4["quantization_config"]),
                       int8_transposed=False)
  config, dup = sharding.duplicate_kv_heads(CFG, q, 8)
  assert config.num_kv_heads == 8
  for name in ("k_proj", "v_proj"):
    w, got = q["layers"]["attn"][name]["kernel"], dup["layers"]["attn"][name]["kernel"]
    want = jnp.repeat(w.dequantize().reshape(2, 64, 2, 16), 4, axis=-2).reshape(2, 64, 128)
    np.testing.assert_array_equal(got.dequantize(), want)


def test_act_order_kernel_splits_with_its_perm():
  """A GPTQ act-order kernel (stored row i is row perm[i], perm across all of K) split along K
  with its perm multiplies as on one device."""
  from jinfer.models.kernel_options import KernelOptions
  from jinfer.models.llama import _groupwise
  from pallas_kernels.groupwise_matmul import pack_int4
  rng = np.random.default_rng(4)
  k, n, g = 128, 64, 32  # o_proj-like: K = [q_heads 8, head_dim 16]
  w = GroupwiseArray(q=pack_int4(jnp.asarray(rng.integers(0, 16, (k, n))), g),
                     scale=jnp.asarray(rng.random((k // g, n)), jnp.float32),
                     offset=jnp.asarray(rng.standard_normal((k // g, n)), jnp.float32),
                     bits=4, group_size=g, perm=jnp.asarray(rng.permutation(k), jnp.int32))
  mesh = make_mesh(ParallelConfig(tensor_parallel_size=2))
  axes = {"o": {"kernel": ("q_heads", "head_dim", "embed")}}
  split = sharding.shard_params({"o": {"kernel": w}}, axes, mesh,
                                linear={"o": {"kernel": (2, 1, False, False)}})["o"]["kernel"]
  assert split.q.sharding.spec == P("tensor", None) and split.perm.sharding.spec == P("tensor")
  x = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
  matmul = jax.jit(lambda x, w: _groupwise(x, w, KernelOptions(groupwise="xla")))
  np.testing.assert_allclose(np.asarray(matmul(x, split)), np.asarray(matmul(x, w)),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("quantization,options", [
    # W8A8 runs the XLA int8 kernel per shard; int8 the TPU's Pallas one, interpreted.
    ("w8a8", dict(quantization_config={"smoothquant": False})),
    ("int4", dict(quantization_config={"method": "rtn", "group_size": 16})),
    ("int8", dict(matmul_backend="pallas_tpu", interpret=True)),
], ids=["w8a8", "int4", "int8-pallas"])
def test_quantized_tensor_parallel_8_matches_one_device(params, quantization, options):
  """Each weight mode at TP 8 (KV heads duplicated x4) on 8 host devices runs its kernels per
  shard (jinfer/parallel/linear.py: q/k/v/gate/up column parallel, o/down row parallel with
  one all-reduce, the LM head over the vocabulary): the same greedy tokens as one device, the
  logprobs within the mode's own tolerance. int4's groups of 16 let o/down split their K.
  W8A8's row-parallel layers quantize each shard's slice of a token's activations with its own
  scale, a different rounding of the same accuracy: there the sharded logprobs stay as close to
  the float model's as one device's are (within 1.5x of its largest gap)."""
  make = lambda **o: _engine(params, quantization=quantization, **options, **o)
  want = _generate(make(), SHORT[:3], max_tokens=4)
  got = _generate(make(tensor_parallel_size=8), SHORT[:3], max_tokens=4)
  if quantization != "w8a8":
    _assert_same(got, want, QUANTIZED_RTOL)
    return
  exact = _generate(_engine(params), SHORT[:3], max_tokens=4)

  def error(outs, ref):  # largest logprob gap over the positions whose tokens so far agree
    gaps = []
    for out, r in zip(outs, ref):
      for i, (o, w) in enumerate(zip(out.logprobs, r.logprobs)):
        gaps += [abs(o[t] - w[t]) for t in w if t in o]
        if out.token_ids[i] != r.token_ids[i]:
          break
    return max(gaps)

  assert [g.token_ids[0] for g in got] == [w.token_ids[0] for w in want]
  assert error(got, exact) <= 1.5 * error(want, exact), (error(got, exact), error(want, exact))


@pytest.mark.slow
def test_int4_parallel_matches_one_device(params, tmp_path):
  """int4 under TP 4 x CP 2 (KV heads duplicated x2) runs as on one device. Groups of 64:
  q/k/v/gate/up split their N, 1/4 on each device; o_proj's and down's K=128 holds 2 groups,
  too few for 4 shards, so they stay whole (the fallback, at run time). The tied embedding
  (int8, quantized as the LM head's kernel `[vocab, embed]`) has its per-row scales follow the
  rows' vocabulary split."""
  tied = dataclasses.replace(CFG, tie_word_embeddings=True)
  p = {k: v for k, v in params.items() if k != "lm_head"}
  make = lambda **o: LLMEngine.from_parts(tied, p, None, warmup=False, config=EngineConfig.of(
      **BASE, quantization="int4", quantization_config={"method": "rtn", "group_size": 64}, **o))
  want = _generate(make(), SHORT[:2], max_tokens=3)
  engine = make(tensor_parallel_size=4, context_parallel_size=2)
  _assert_same(_generate(engine, SHORT[:2], max_tokens=3), want, QUANTIZED_RTOL)
  for path, w in _groupwise(engine).items():
    whole = path[-2].key in ("o_proj", "down_proj")
    assert set(sharding.bytes_per_device(w).values()) == {w.nbytes // (1 if whole else 4)}, path
  embed = engine.runner.params["embedding"]
  assert embed.transposed and embed.scale.sharding.spec == P("tensor")
  # Its KV heads are held twice: not the model's layout to save.
  with pytest.raises(ParameterError, match="holds each KV head 2 times") as e:
    engine.save_quantized(str(tmp_path), source="model")
  assert e.value.param == "tensor_parallel_size" and not os.listdir(tmp_path)


@pytest.mark.slow
def test_int4_experts_split_over_tensor(moe_params):
  """int4 MoE experts: with expert parallelism whole experts (the lead `expert` axis) split;
  without it the fused gate_up, whose N is `[2, mlp]`, stays whole (its chunks would hold gate
  and up, not both halves of an `mlp` slice) and down splits its K. No step compiles here."""
  make = lambda **o: LLMEngine.from_parts(MOE, moe_params, None, warmup=False,
                                          config=EngineConfig.of(**BASE, **{**INT4, **o}))
  spec = lambda engine, name: engine.runner.params["moe_layers"][name]["kernel"].q.sharding.spec
  ep = make(tensor_parallel_size=4, enable_expert_parallel=True)
  assert spec(ep, "gate_up") == spec(ep, "down") == P(None, "tensor", None, None)
  tp = make(tensor_parallel_size=2,
            quantization_config={"method": "rtn", "group_size": 16})  # down: K = 32, 2 groups
  assert spec(tp, "gate_up") == P(None, None, None, None)
  assert spec(tp, "down") == P(None, None, "tensor", None)


@pytest.mark.slow
def test_gguf_kept_parallel_matches_one_device(tmp_path):
  """A GGUF file's blocks (every type jinfer re-encodes: 4- and 8-bit, groups of 16 and 32, an
  untied group-wise embedding) under TP 2 x CP 2 run as on one device, each kernel split."""
  path = str(tmp_path / "tiny.gguf")
  write_tiny_gguf(path, "llama")
  config, p, _ = load_model(path, load_tokenizer=False, keep_gguf_quantized=True)
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 11)]
  make = lambda config, p, **o: LLMEngine.from_parts(
      config, p, None, warmup=False, config=EngineConfig.of(
          max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, page_size=16,
          compilation_cache=False, quantization="gguf", **o))
  want = _generate(make(config, p), prompts, max_tokens=4)
  engine = make(config, p, tensor_parallel_size=2, context_parallel_size=2)
  _assert_same(_generate(engine, prompts, max_tokens=4), want, QUANTIZED_RTOL)
  kernels = _groupwise(engine)
  # o, gate, up, down (layer 1 stores q, k, v as floats, so their stacks load as floats), the
  # embedding and the LM head
  assert len(kernels) == 6
  assert all("tensor" in w.q.sharding.spec for w in kernels.values())
  per = sharding.bytes_per_device(list(kernels.values()))
  assert len(per) == 4 and set(per.values()) == {sum(w.nbytes for w in kernels.values()) // 2}
  # A tied embedding (the LM head's kernel too) splits its vocabulary the same way.
  write_tiny_gguf(path, "qwen2", tied=True)
  tied, p, _ = load_model(path, load_tokenizer=False, keep_gguf_quantized=True)
  assert tied.tie_word_embeddings and isinstance(p["embedding"], GroupwiseArray)
  embed = make(tied, p, tensor_parallel_size=2).runner.params["embedding"]
  assert embed.q.sharding.spec == P(None, "tensor")


@pytest.mark.slow
def test_no_compiles_after_warmup(params):
  engine = _engine(params, warmup=True, tensor_parallel_size=2, context_parallel_size=2)
  counter = CompileCounter()
  _generate(engine, SHORT[:3], max_tokens=4)
  assert counter.count == 0


def test_data_parallel_routes_by_prefix_and_load(params):
  engine = _engine(params, data_parallel_size=2)
  shared = SHORT[3][:100]
  first = engine.add_request(None, shared + [1, 2, 3], SamplingParams(max_tokens=2))
  rank = engine._rank_of[first]
  # Same prefix, light load: the same rank (its pages are, or will be, cached there).
  again = engine.add_request(None, shared + [4, 5], SamplingParams(max_tokens=2))
  assert engine._rank_of[again] == rank
  # Unrelated prompts go to the least-loaded rank.
  other = engine.add_request(None, SHORT[2], SamplingParams(max_tokens=2))
  assert engine._rank_of[other] == 1 - rank
  # Past the balance slack, even a matching prefix goes elsewhere.
  for _ in range(engine.router.balance_slack + 1):
    engine.add_request(None, shared + [9], SamplingParams(max_tokens=2))
  loads = [engine.load(r) for r in (0, 1)]
  assert max(loads) - min(loads) <= engine.router.balance_slack + 1
  for rid in list(engine._rank_of):
    assert engine.abort(rid)
  assert engine.stats().num_running == 0 and not engine.has_unfinished_requests()


@pytest.mark.slow
def test_async_engine_serves_data_parallel_ranks(params, reference):
  """The server's engine loop drives the DP front end like one engine: DP 2's outputs are one
  device's."""
  import asyncio
  from jinfer.engine.async_engine import AsyncLLMEngine, collect
  engine = _engine(params, data_parallel_size=2)

  async def main():
    aeng = AsyncLLMEngine(engine)
    aeng.start()
    try:
      sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
      return await asyncio.gather(*(collect(aeng.generate(p, sp)) for p in SHORT[:3]))
    finally:
      await aeng.shutdown()

  outs = asyncio.run(main())
  _assert_same([o.outputs[0] for o in outs], reference)
  assert all(e.blocks.num_free_pages == e.blocks.num_usable_pages for e in engine.engines)


def test_tensor_parallel_size_that_does_not_divide():
  smol = dataclasses.replace(CFG, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_heads=9, num_kv_heads=3, head_dim=64)  # SmolLM2-135M's shapes
  assert sharding.valid_tensor_parallel_sizes(smol, 8) == [1, 3]
  with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*9 query heads.*valid sizes: "
                                       r"1, 3$"):
    sharding.check_tensor_parallel(smol, 2)


def test_parallel_config_errors(params):
  with pytest.raises(ValueError, match="power of two"):
    EngineConfig.of(context_parallel_size=3)
  with pytest.raises(ValueError, match="needs 16 devices; 8 are available"):
    _engine(params, tensor_parallel_size=4, context_parallel_size=4)
  with pytest.raises(ValueError, match="need 16 devices"):
    _engine(params, tensor_parallel_size=8, data_parallel_size=2)


@pytest.mark.slow
def test_smollm2_tensor_parallel_3(smollm2_gguf):
  """The real model's 9 query / 3 KV heads split over 3 devices: same greedy tokens."""
  from jinfer import LLM
  prompts = ["The capital of France is", "def fibonacci(n):"]
  sp = SamplingParams(max_tokens=12, temperature=0.0)
  opts = dict(SMOLLM2, warmup=False)  # one device's steps come from the compilation cache
  want = [o.outputs[0].token_ids for o in LLM(smollm2_gguf, **opts).generate(prompts, sp)]
  got = [o.outputs[0].token_ids
         for o in LLM(smollm2_gguf, tensor_parallel_size=3, **opts).generate(prompts, sp)]
  assert got == want


# -- expert parallelism -------------------------------------------------------------------------
MOE = dataclasses.replace(CFG, architecture="qwen2_moe", num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32, shared_expert_intermediate_size=48,
                          norm_topk_prob=False, moe_layers=(False, True))


@pytest.fixture(scope="module")
def moe_params():
  rng = np.random.default_rng(2)
  p = jax.tree_util.tree_map_with_path(
      lambda path, s: (np.ones(s.shape) if path[-1].key == "scale"
                       else rng.standard_normal(s.shape) * 0.2).astype(np.float32),
      param_shapes(MOE))
  p["embedding"] *= 20
  return jax.tree.map(jnp.asarray, p)


@pytest.fixture(scope="module")
def moe_reference(moe_params):
  """quantization -> the one-device outputs for SHORT[:4], each computed once."""
  @functools.cache
  def outputs(quantization=None):
    return _generate(LLMEngine.from_parts(MOE, moe_params, None, warmup=False, config=EngineConfig.of(
        **BASE, quantization=quantization)), SHORT[:4])
  return outputs


@pytest.mark.parametrize("options", [
    # one whole expert on each device, quantized
    pytest.param(dict(tensor_parallel_size=8, enable_expert_parallel=True, quantization="int8"),
                 marks=pytest.mark.slow),
    pytest.param(dict(tensor_parallel_size=2), marks=pytest.mark.slow),  # experts' MLP split
], ids=lambda o: "-".join(f"{k.split('_')[0]}{v}" for k, v in o.items()))
def test_expert_parallel_matches_one_device(moe_params, moe_reference, options):
  one = {k: v for k, v in options.items() if k == "quantization"}
  want = moe_reference(**one)
  engine = LLMEngine.from_parts(MOE, moe_params, None, warmup=False,
                                config=EngineConfig.of(**BASE, **options))
  _assert_same(_generate(engine, SHORT[:4]), want, QUANTIZED_RTOL if one else 0.0)
  experts = jax.tree.leaves(engine.runner.params["moe_layers"]["gate_up"])[0]  # [1, X, ...]
  tp = options["tensor_parallel_size"]
  if options.get("enable_expert_parallel"):  # whole experts, X / TP on each device
    assert {s.data.shape for s in experts.addressable_shards} == {
        (1, MOE.num_experts // tp) + experts.shape[2:]}


def test_expert_parallel_needs_experts_to_divide(moe_params):
  with pytest.raises(ValueError, match=r"number of experts \(6\) to be a multiple of 4"):
    LLMEngine.from_parts(dataclasses.replace(MOE, num_experts=6), moe_params, None, warmup=False,
                         config=EngineConfig.of(**BASE, tensor_parallel_size=4,
                                             enable_expert_parallel=True))


# -- two processes on loopback ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tiny_model_path, tiny_model):
  """An HF directory each process loads, and its params loaded here."""
  return tiny_model_path, tiny_model


MP_SPEC = dict(options=dict(BASE, max_model_len=512, max_num_batched_tokens=64,
                            tensor_parallel_size=4, context_parallel_size=2),
               prompts=[[7, 300, 12, 9000, 5], list(range(100, 180)), [42] * 20], max_tokens=6)


@pytest.mark.slow
def test_two_processes_match_one_and_a_killed_peer_is_an_error(tiny_dir):
  """Two processes of 4 devices run one TP 4 x CP 2 mesh: the tokens and logprobs of one
  device. Then, generating again, the other process is killed: process 0 stops with an error
  naming the lost task instead of hanging in a collective (a 10 s heartbeat instead of the
  default 30 s to wait out)."""
  path, loaded = tiny_dir
  leader, _ = kill_the_follower_once_it_ran(
      path, dict(MP_SPEC, heartbeat_timeout_s=10, then_killed=True))
  t0 = time.monotonic()
  out, err = leader.communicate(timeout=120)
  assert leader.returncode != 0 and time.monotonic() - t0 < 120
  assert "heartbeat" in err or "task" in err.lower(), err[-3000:]

  got = json.loads(out.splitlines()[-1])  # gloo logs its connections on stdout too
  one = LLMEngine.from_parts(*loaded, warmup=False, config=EngineConfig.of(
      **{k: v for k, v in MP_SPEC["options"].items() if not k.endswith("parallel_size")}))
  want = _generate(one, MP_SPEC["prompts"], MP_SPEC["max_tokens"])
  assert got["tokens"] == [o.token_ids for o in want]
  for g, w in zip(got["logprobs"], want):  # each token's logprob
    np.testing.assert_allclose(g, [lp[t] for lp, t in zip(w.logprobs, w.token_ids)], atol=1e-4)
