"""MoE GGUF files written in the test from tiny random HF models: config and params against our
load of the same weights from safetensors, a quantized file against transformers' own GGUF
loader, and the errors unsupported files raise."""
from __future__ import annotations

import dataclasses
import os

import gguf
import jax
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from jinfer.config import ModelConfig
from jinfer.models import CausalLM
from jinfer.weights.gguf_file import load_gguf
from jinfer.weights.hf_layout import WeightError
from jinfer.weights.safetensors_dir import load_safetensors_dir
from tests.hf_to_gguf import write_hf_as_gguf
from tests.paged_batch import PagedBatch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
MODELS = {  # llama.cpp writes Mixtral as its llama architecture, Q/K rows permuted
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
    # shared expert; dense layers 0 and 2 (GGUF has no decoder_sparse_step: read from tensors)
    "qwen2moe": (transformers.Qwen2MoeConfig, dict(
        num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=2)),
    "qwen3moe": (transformers.Qwen3MoeConfig, dict(
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1], head_dim=32)),
}


def _hf(name: str, **override):
  cls, extra = MODELS[name]
  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_config(cls(**{**_COMMON, **extra, **override}),
                                                     dtype=torch.float32).eval()
  with torch.no_grad():
    for layer in hf.model.layers:
      if hasattr(layer.mlp, "gate"):
        layer.mlp.gate.weight.mul_(30.0)
  return hf


@pytest.mark.parametrize("name", sorted(MODELS))
def test_f32_file_loads_the_same_model(name, tmp_path):
  """Every tensor stored unquantized: the config and the params equal our load of the same HF
  weights from safetensors (whose logits match transformers, tests/test_moe.py)."""
  hf = _hf(name)
  hf.save_pretrained(tmp_path / "hf")
  want_config = ModelConfig.from_hf_dir(str(tmp_path / "hf"))
  want = load_safetensors_dir(str(tmp_path / "hf"), want_config)
  path = str(tmp_path / f"{name}.gguf")
  write_hf_as_gguf(path, hf)
  config, params = load_gguf(path)
  assert config == dataclasses.replace(want_config, rms_norm_eps=config.rms_norm_eps)
  assert config.rms_norm_eps == pytest.approx(want_config.rms_norm_eps)  # stored as float32
  jax.tree.map(np.testing.assert_array_equal, params, want)


@pytest.mark.slow
def test_quantized_experts_match_transformers_gguf_loader(tmp_path):
  """Q8_0 experts (3-D stacked tensors) and router: our logits against transformers loading
  the same file. transformers takes the expert width from its config defaults (it does not
  read expert_feed_forward_length) and knows no mlp_only_layers in GGUF, so this model uses
  Qwen3-MoE's default width 768 and MoE on every layer."""
  hf = _hf("qwen3moe", moe_intermediate_size=768, mlp_only_layers=[])
  path = str(tmp_path / "q8.gguf")
  write_hf_as_gguf(path, hf, quantize={k: Q.Q8_0 for k in (
      "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp", "attn_q")})
  config, params = load_gguf(path)
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), gguf_file="q8.gguf", dtype=torch.float32).eval()
  ids = np.random.default_rng(0).integers(0, config.vocab_size, 19).tolist()
  ours = PagedBatch(CausalLM(config), params, 1, 4, 32).step([ids], pad_to=24, all_rows=True)
  with torch.no_grad():
    theirs = ref(torch.tensor([ids])).logits[0].numpy()
  np.testing.assert_allclose(ours[:len(ids)], theirs, atol=1e-4 * np.abs(theirs).max() + 1e-5,
                             rtol=0)


@pytest.mark.parametrize("how,match", [
    (dict(drop=("blk.1.ffn_down_exps.weight",)), r"missing tensor 'blk\.1\.ffn_down_exps\.weight'"),
    (dict(extra=lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)),
     "unsupported llama.expert_gating_func=2"),
    # old llama.cpp files stored Mixtral's experts one tensor each
    (dict(extra=lambda w: w.add_tensor("blk.0.ffn_gate.0.weight", np.zeros((96, 64), np.float32))),
     "one tensor each"),
])
def test_unsupported_files_raise(how, match, tmp_path):
  path = str(tmp_path / "bad.gguf")
  write_hf_as_gguf(path, _hf("mixtral"), **how)
  with pytest.raises(WeightError, match=match):
    load_gguf(path)
