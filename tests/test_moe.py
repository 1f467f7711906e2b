"""MoE models vs HF transformers on tiny random Mixtral, Qwen2-MoE and Qwen3-MoE: logits over
ragged batches with chunked prefill and decode, greedy tokens, expert load, both weight
layouts, int8 experts, and the errors bad configs and files raise."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from jinfer.config import ModelConfig
from jinfer.engine.weight_quantization import check_config, quantize_weights
from jinfer.errors import ParameterError
from jinfer.models import CausalLM, linear_kernels, unstack_layers
from jinfer.models.kernel_options import KernelOptions
from jinfer.quant.qarray import QArray, quantize_params
from jinfer.weights.hf_layout import WeightError
from jinfer.weights.safetensors_dir import load_safetensors_dir
from pallas_kernels import AttentionMetadata, KVCacheSpec
from tests.paged_batch import PagedBatch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Odd sizes throughout: hidden 40 (5 heads of 8), expert widths 24 and 20, vocab 97.
_COMMON = dict(vocab_size=97, hidden_size=40, intermediate_size=56, num_hidden_layers=3,
               num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=256)
CONFIGS = {
    # top-2 of 5, always renormalized; a sliding window shorter than the longer prompts
    "mixtral-top2-window": (transformers.MixtralConfig, dict(
        num_local_experts=5, num_experts_per_tok=2, sliding_window=12)),
    # top-4 of 6 unnormalized plus the gated shared expert; MoE on layer 1 only (step 2)
    "qwen2moe-top4-shared-step2": (transformers.Qwen2MoeConfig, dict(
        num_experts=6, num_experts_per_tok=4, moe_intermediate_size=24,
        shared_expert_intermediate_size=36, decoder_sparse_step=2)),
    # top-1 of 7 renormalized (weight 1); layer 0 dense
    "qwen3moe-top1-mlp-only-0": (transformers.Qwen3MoeConfig, dict(
        num_experts=7, num_experts_per_tok=1, moe_intermediate_size=20, norm_topk_prob=True,
        mlp_only_layers=[0], head_dim=16)),
    # top-2 of 4 unnormalized, every layer MoE
    "qwen3moe-top2": (transformers.Qwen3MoeConfig, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20)),
}
FAST = "qwen2moe-top4-shared-step2"  # mixed layers, shared expert, top-4: the fast tier's model
PROMPT_LENS = (5, 23, 40)
PREFILL_ROWS = 80  # a prefill step's rows: the prompts plus padding
DECODE_STEPS = 8  # decode steps whose logits are compared
GREEDY_TOKENS = 24
PAGE_SIZE = 4


def _hf_model(name: str):
  cls, extra = CONFIGS[name]
  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_config(cls(**_COMMON, **extra),
                                                     dtype=torch.float32).eval()
  with torch.no_grad():  # sharper routing and logits than the 0.02 init: clear choices
    hf.model.embed_tokens.weight.mul_(20.0)
    hf.lm_head.weight.mul_(20.0)
    for layer in hf.model.layers:
      if hasattr(layer.mlp, "gate"):
        layer.mlp.gate.weight.mul_(30.0)
  return hf


def _saved(name: str, path) -> tuple:
  """(HF model, our config, our params, directory) of a tiny model saved by transformers."""
  hf = _hf_model(name)
  hf.save_pretrained(path)
  config = ModelConfig.from_hf_dir(str(path))
  return hf, config, load_safetensors_dir(str(path), config), str(path)


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=[] if name == FAST else [pytest.mark.slow]) for name in CONFIGS])
def tiny_moe(request, tmp_path_factory):
  return _saved(request.param, tmp_path_factory.mktemp(request.param))


def _hf_logits(hf, ids: list[int]) -> np.ndarray:  # [len(ids), V]
  with torch.no_grad():
    return hf(torch.tensor([ids])).logits[0].numpy()


def _prompts(config, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, config.vocab_size, n).tolist() for n in PROMPT_LENS]


def test_config_reads_the_layer_kinds(tiny_moe):
  hf, config, _, _ = tiny_moe
  kinds = tuple(type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers)
  assert config.moe_layers == kinds and any(kinds)
  assert config.num_experts == len(hf.model.layers[config.moe_layer_ids[0]].mlp.experts.down_proj)


@pytest.mark.slow
def test_ragged_prefill_and_decode_match_hf(tiny_moe):
  """A ragged prefill of three prompts (padded), then greedy decode steps of all three: the
  logits of the prefill and the first decode steps, and 24 greedy tokens each, against
  transformers (its forward over the whole sequence, and its own `generate`)."""
  hf, config, params, _ = tiny_moe
  prompts = _prompts(config, 1)
  batch = PagedBatch(CausalLM(config), params, len(prompts), PAGE_SIZE,
                     max(PROMPT_LENS) + GREEDY_TOKENS)
  logits = batch.step(prompts, pad_to=PREFILL_ROWS)
  seqs = [list(p) for p in prompts]
  worst = 0.0
  for step in range(GREEDY_TOKENS):
    if step <= DECODE_STEPS:
      for s, seq in enumerate(seqs):
        worst = max(worst, float(np.abs(logits[s] - _hf_logits(hf, seq)[-1]).max()))
    nxt = [int(np.argmax(row)) for row in logits]
    for s, tok in enumerate(nxt):
      seqs[s].append(tok)
    logits = batch.step([[t] for t in nxt], pad_to=4)
  assert worst <= 1e-4, f"max abs logit error {worst:.2e}"
  for s, prompt in enumerate(prompts):
    with torch.no_grad():
      out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=GREEDY_TOKENS,
                        eos_token_id=None, pad_token_id=0)
    assert seqs[s][len(prompt):] == out[0, len(prompt):].tolist(), f"prompt {s}"


@pytest.mark.slow
def test_chunked_prefill_matches_hf(tiny_moe):
  hf, config, params, _ = tiny_moe
  rng = np.random.default_rng(2)
  prompt = rng.integers(0, config.vocab_size, 37).tolist()
  other = rng.integers(0, config.vocab_size, 9).tolist()
  batch = PagedBatch(CausalLM(config), params, 2, PAGE_SIZE, 64, seed=3)
  # One padded shape for the three steps, so one compile.
  batch.step([prompt[:16], other], pad_to=32, max_q_len=16)
  batch.step([prompt[16:32], [5]], pad_to=32, max_q_len=16)
  logits = batch.step([prompt[32:], [7]], pad_to=32, max_q_len=16)
  np.testing.assert_allclose(logits[0], _hf_logits(hf, prompt)[-1], atol=1e-4, rtol=0)
  np.testing.assert_allclose(logits[1], _hf_logits(hf, other + [5, 7])[-1], atol=1e-4, rtol=0)


def _prefill(model, params, prompts: list[list[int]], pad_to: int):
  """One ragged prefill of `prompts` (pages in order, padded to `pad_to` rows); returns
  (logits of every row [pad_to, V], expert load [MoE layers, experts])."""
  c = model.config
  lens = [len(p) for p in prompts]
  pages = [-(-n // PAGE_SIZE) for n in lens]
  table = np.zeros((len(prompts), max(pages)), np.int32)
  slots, first = [], 1  # page 0 is the sink
  for s, n in enumerate(lens):
    table[s, :pages[s]] = np.arange(first, first + pages[s])
    slots += [first * PAGE_SIZE + j for j in range(n)]
    first += pages[s]
  t = sum(lens)
  ids = np.zeros(pad_to, np.int32)
  ids[:t] = np.concatenate(prompts)
  positions = np.zeros(pad_to, np.int32)
  positions[:t] = np.concatenate([np.arange(n) for n in lens])
  md = AttentionMetadata(
      slot_mapping=jnp.asarray(slots + [0] * (pad_to - t), jnp.int32),
      block_table=jnp.asarray(table), kv_lens=jnp.asarray(lens, jnp.int32),
      cu_q_lens=jnp.asarray(np.cumsum([0] + lens), jnp.int32),
      num_seqs=jnp.asarray([len(prompts)], jnp.int32), max_q_len=max(lens))
  spec = KVCacheSpec(num_layers=c.num_layers, num_pages=first, page_size=PAGE_SIZE,
                     num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
  fwd = jax.jit(lambda *a: model.apply(*a, mutable=["expert_load"]))
  (logits, _, _), state = fwd({"params": params}, jnp.asarray(ids), jnp.asarray(positions),
                              spec.allocate(), md, jnp.arange(pad_to))
  return np.asarray(logits), np.asarray(state["expert_load"]["tokens_per_expert"][0])


def test_expert_load_counts_live_tokens_as_hf_routes_them(tiny_moe):
  """Tokens per expert per MoE layer equal the top-k of transformers' own router logits over
  the live tokens; the padding rows of the step are routed nowhere."""
  hf, config, params, _ = tiny_moe
  prompts = _prompts(config, 4)
  _, load = _prefill(CausalLM(config), params, prompts, pad_to=PREFILL_ROWS)
  want = np.zeros((len(config.moe_layer_ids), config.num_experts), np.int64)
  for prompt in prompts:
    with torch.no_grad():
      routers = hf(torch.tensor([prompt]), output_router_logits=True).router_logits
    for j, r in enumerate(routers):
      top = torch.topk(r, config.num_experts_per_tok, dim=-1).indices
      want[j] += np.bincount(top.reshape(-1).numpy(), minlength=config.num_experts)
  np.testing.assert_array_equal(load, want)
  assert load.sum() == sum(PROMPT_LENS) * config.num_experts_per_tok * len(config.moe_layer_ids)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "qwen3moe-top2"])  # mixed, or not
def test_scanned_and_unrolled_stacks_agree(name, tmp_path):
  _, config, params, _ = _saved(name, tmp_path)
  prompts = _prompts(config, 5)
  scanned = _prefill(CausalLM(config), params, prompts, pad_to=PREFILL_ROWS)
  unrolled = _prefill(CausalLM(config, scan_layers=False),
                      unstack_layers(params, config.num_layers), prompts, pad_to=PREFILL_ROWS)
  np.testing.assert_allclose(scanned[0], unrolled[0], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(scanned[1], unrolled[1])


def test_fused_expert_layout_loads_the_same(tiny_moe, tmp_path):
  """transformers 5 keeps experts fused in memory (`experts.gate_up_proj [E, 2I, H]`,
  `experts.down_proj [E, H, I]`); a file in that layout loads into the same params, and
  transformers reads it back into the same model."""
  hf, config, params, path = tiny_moe
  save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
            str(tmp_path / "model.safetensors"))
  with open(os.path.join(path, "config.json")) as fh:
    (tmp_path / "config.json").write_text(fh.read())
  with open(tmp_path / "model.safetensors", "rb") as fh:  # the file really is fused
    header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
  assert any(k.endswith("experts.gate_up_proj") for k in header)
  fused = load_safetensors_dir(str(tmp_path), config)
  jax.tree.map(np.testing.assert_array_equal, fused, params)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
  want = hf.state_dict()
  for name, value in back.state_dict().items():
    torch.testing.assert_close(value, want[name], rtol=0, atol=0)
  # torch may sum in another order over the reloaded tensors' memory layout: the last bits differ.
  ids = _prompts(config, 6)[1]
  np.testing.assert_allclose(_hf_logits(back, ids), _hf_logits(hf, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_int8_experts_per_expert_scales(tmp_path):
  """Expert kernels quantize with one scale per layer, expert and output channel; the model
  runs on them close to float, the CPU loop and ragged_dot agreeing."""
  _, config, params, _ = _saved(FAST, tmp_path)
  q = quantize_params(params, linear_kernels(config))
  moe = q["moe_layers"]
  gate_up, n_moe = moe["gate_up"]["kernel"], len(config.moe_layer_ids)
  assert isinstance(gate_up, QArray) and gate_up.values.dtype == jnp.int8
  assert gate_up.scale.shape == (n_moe, config.num_experts, 2, config.moe_intermediate_size)
  assert not isinstance(moe["router"], QArray)  # routing stays in float
  prompts = _prompts(config, 7)
  want, _ = _prefill(CausalLM(config), params, prompts, pad_to=PREFILL_ROWS)
  got = {backend: _prefill(CausalLM(config, KernelOptions(quantization="int8",
                                                          grouped_matmul=backend)),
                           q, prompts, pad_to=PREFILL_ROWS)
         for backend in ("xla", "ragged_dot")}
  np.testing.assert_allclose(got["xla"][0], got["ragged_dot"][0], atol=1e-4, rtol=1e-4)
  live = sum(PROMPT_LENS)
  assert np.abs(got["xla"][0][:live] - want[:live]).max() < 0.05 * np.abs(want[:live]).max()


def test_missing_expert_tensor_names_it(tmp_path):
  hf = _hf_model("qwen3moe-top2")
  hf.save_pretrained(tmp_path)
  from safetensors.numpy import load_file, save_file as save_np
  tensors = load_file(str(tmp_path / "model.safetensors"))
  del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
  save_np(tensors, str(tmp_path / "model.safetensors"))
  config = ModelConfig.from_hf_dir(str(tmp_path))
  with pytest.raises(WeightError, match=r"missing tensor 'model\.layers\.2\.mlp\.experts\.3\."
                                        r"up_proj\.weight'"):
    load_safetensors_dir(str(tmp_path), config)


@pytest.mark.parametrize("cls", [transformers.Qwen2MoeConfig, transformers.Qwen3MoeConfig])
def test_sliding_windows_follow_transformers(cls):
  """Which layers slide, from a config without `layer_types` (older files)."""
  hf = cls(num_hidden_layers=6, use_sliding_window=True, sliding_window=32, max_window_layers=4)
  d = {k: v for k, v in hf.to_dict().items() if k != "layer_types"}
  if hasattr(hf, "layer_types"):  # Qwen2-MoE: every other layer below max_window_layers
    want = tuple(32 if t == "sliding_attention" else None for t in hf.layer_types)
    assert len(set(want)) == 2
  else:  # Qwen3-MoE's attention takes config.sliding_window on every layer
    want = (hf.sliding_window,) * 6
  assert ModelConfig.from_hf_dict(d).sliding_windows == want


@pytest.mark.parametrize("change,match", [
    (dict(hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok <= num_experts"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step must be >= 1"),
])
def test_unsupported_moe_configs_raise(change, match):
  d = dict(model_type="qwen3_moe", vocab_size=97, hidden_size=40, intermediate_size=56,
           num_hidden_layers=3, num_attention_heads=5, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=20)
  ModelConfig.from_hf_dict(d)
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf_dict({**d, **change})


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_pallas_tpu_grouped_matmul_in_the_model(quantization, tmp_path):
  """The model on the TPU kernel (interpreted) gives the CPU path's logits and expert load."""
  _, config, params, _ = _saved(FAST, tmp_path)
  if quantization:
    params = quantize_params(params, linear_kernels(config))
  prompts = _prompts(config, 8)
  want = _prefill(CausalLM(config, KernelOptions(quantization=quantization, matmul="reference")),
                  params, prompts,
                  pad_to=PREFILL_ROWS)
  tpu = KernelOptions(quantization=quantization, matmul="pallas_tpu",
                      grouped_matmul="pallas_tpu", interpret=True)
  got = _prefill(CausalLM(config, tpu), params, prompts, pad_to=PREFILL_ROWS)
  np.testing.assert_allclose(got[0], want[0], atol=1e-4, rtol=1e-4)
  np.testing.assert_array_equal(got[1], want[1])


def test_fp8_refuses_moe_experts(tmp_path):
  """No float8 grouped matmul yet: quantization="fp8" of an MoE model says so."""
  _, config, params, _ = _saved(FAST, tmp_path)
  with pytest.raises(ParameterError, match="MoE experts have no float8 grouped matmul") as e:
    quantize_weights(config, params, "fp8", check_config("fp8", None), int8_transposed=False)
  assert e.value.param == "quantization"
