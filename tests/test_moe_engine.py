"""Engine invariants on a tiny MoE model (Qwen3-MoE with a dense layer 0, so both kinds of layer
run under the scan): batch invariance, zero compiles after warmup, expert load in stats."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
import transformers

from jinfer.bench.offline import RandomWorkload, run_offline
from jinfer.config import ModelConfig
from jinfer.models import param_shapes
from jinfer.sampling.params import SamplingParams
from jinfer.weights.safetensors_dir import load_safetensors_dir
from tests.engine_fixtures import CompileCounter, make_engine, run_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
VOCAB = 512


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
  torch.manual_seed(0)
  cfg = transformers.Qwen3MoeConfig(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0],
      max_position_embeddings=512)
  hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
  with torch.no_grad():  # clear greedy winners and routes (see tests/test_moe.py)
    hf.model.embed_tokens.weight.mul_(40.0)
    for layer in hf.model.layers[1:]:
      layer.mlp.gate.weight.mul_(30.0)
  path = str(tmp_path_factory.mktemp("moe"))
  hf.save_pretrained(path)
  config = ModelConfig.from_hf_dir(path)
  assert config.moe_layers == (False, True, True)
  return config, load_safetensors_dir(path, config), None


@pytest.fixture(scope="module")
def engine(loaded):  # warmup compiles 3 buckets: the tests using it are slow-tier
  # Small budget and pool: long prompts are chunked and the pool forces preemption.
  return make_engine(loaded, max_model_len=256, page_size=8, num_pages=48, max_num_seqs=8,
                     max_num_batched_tokens=32, max_prefill_seqs=2)


def _prompts(n: int, seed: int, lo: int = 5, hi: int = 100) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, VOCAB, rng.integers(lo, hi)).tolist() for _ in range(n)]


_run = run_tokens


@pytest.fixture
def live_rows(engine, monkeypatch) -> list[int]:
  """The live (not padding) rows of every step the engine runs from now on."""
  rows = []
  run = engine.runner.run

  def counting_run(inp, drafts=None):
    rows.append(int(np.asarray(inp.md.cu_q_lens)[int(np.asarray(inp.md.num_seqs)[0])]))
    return run(inp, drafts)

  monkeypatch.setattr(engine.runner, "run", counting_run)
  return rows


@pytest.mark.slow
def test_greedy_output_same_alone_and_in_a_batch_and_load_counts_live_rows(engine, live_rows):
  prompts = _prompts(10, seed=0)
  alone = [_run(engine, [p], GREEDY)[0] for p in prompts]
  live_rows.clear()  # count the batch's steps only
  before = engine.stats()
  together = _run(engine, prompts, GREEDY)
  after = engine.stats()
  assert after.num_preemptions > before.num_preemptions, "the pool was meant to force preemption"
  for i, (a, b) in enumerate(zip(alone, together)):
    assert a == b, f"request {i} differs in a batch"
  # Every live row went to k experts in each MoE layer; the padding of every bucket to none.
  load = after.expert_load.since(before.expert_load)
  assert load.layers == [1, 2]
  k = engine.model_config.num_experts_per_tok
  assert [sum(row) for row in load.tokens_per_expert] == [k * sum(live_rows)] * 2
  assert all(m >= 1.0 for m in load.imbalance)


@pytest.mark.slow
def test_no_compiles_after_warmup(engine):
  counter = CompileCounter()
  prompts = _prompts(8, seed=1, lo=1, hi=150)
  params = [SamplingParams(temperature=t, top_p=tp, max_tokens=m, seed=i, logprobs=lp, n=n)
            for i, (t, tp, m, lp, n) in enumerate(zip([0, 0.7, 1.0, 0.5] * 2, [1, 0.9] * 4,
                                                      [2, 7, 30, 55] * 2, [None, 3] * 4,
                                                      [1, 1, 2, 1] * 2))]
  rids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
  engine.abort(rids[3])
  engine.run_to_completion()
  assert counter.count == 0, f"{counter.count} compiles after warmup"
  assert sum(map(sum, engine.stats().expert_load.tokens_per_expert)) > 0


@pytest.mark.slow
def test_offline_benchmark_reports_the_runs_expert_load(engine, live_rows):
  """The benchmark JSON's expert load is this run's: k assignments per live row per MoE layer,
  none for padding, whatever the engine ran before."""
  report = run_offline(engine, RandomWorkload(num_prompts=5, input_len_min=3, input_len_max=40,
                                              output_len=6, seed=3))
  load = report["expert_load"]
  k = engine.model_config.num_experts_per_tok
  assert load["layers"] == [1, 2]
  assert [sum(row) for row in load["tokens_per_expert"]] == [k * sum(live_rows)] * 2
  assert len(load["max_over_mean"]) == 2 and all(m >= 1.0 for m in load["max_over_mean"])
  assert json.loads(json.dumps(report)) == report


def test_dense_model_reports_no_expert_load():
  config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
  params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), param_shapes(config))
  eng = make_engine((config, params, None), warmup=False, max_model_len=64, max_num_seqs=2,
                    max_num_batched_tokens=16, compilation_cache=False)
  assert eng.stats().expert_load is None


@pytest.mark.slow
def test_int4_experts_run_their_own_weights_exactly(loaded):
  """Mixed dense and MoE layers, experts 4-bit group-wise through the grouped matmul: the same
  tokens as a float engine over the int4 weights dequantized."""
  from jinfer.engine.engine import LLMEngine
  from jinfer.engine.engine_config import EngineConfig
  from jinfer.engine.weight_quantization import check_config, quantize_weights
  from jinfer.quant.groupwise import GroupwiseArray
  from tests.test_quantized_engine import _float_like
  config, params, _ = loaded
  qc = {"method": "rtn", "group_size": 32}
  q = quantize_weights(config, params, "int4", check_config("int4", qc), int8_transposed=False)
  is_gw = lambda x: isinstance(x, GroupwiseArray)
  assert sum(map(is_gw, jax.tree.leaves(q["moe_layers"], is_leaf=is_gw))) == 2  # gate_up, down
  options = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
  got = make_engine(loaded, warmup=False, quantization="int4", quantization_config=qc, **options)
  want = LLMEngine.from_parts(config, _float_like(q, params), None, warmup=False,
                              config=EngineConfig.of(**options))
  prompts = _prompts(4, seed=5, hi=40)
  sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
  assert run_tokens(got, prompts, sp) == run_tokens(want, prompts, sp)
