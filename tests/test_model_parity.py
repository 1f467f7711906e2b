"""Model stack vs HF transformers on tiny random models of every supported architecture."""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch
import transformers

from jinfer.config import ModelConfig
from jinfer.models import CausalLM
from jinfer.weights.safetensors_dir import load_safetensors_dir
from tests.paged_batch import PagedBatch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               max_position_embeddings=256)
CONFIGS = {
    "llama2-mha-untied": (transformers.LlamaConfig, dict(num_attention_heads=4,
                                                         num_key_value_heads=4)),
    "llama3-gqa-rope-scaled": (transformers.LlamaConfig, dict(
        num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama-mqa-tied": (transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=1,
                                                      tie_word_embeddings=True)),
    "mistral-sliding-window": (transformers.MistralConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=12)),
    "qwen2-bias": (transformers.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3-qknorm": (transformers.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2,
                                                     head_dim=32)),
}
PROMPT_LENS = (5, 23, 40)  # Mistral's window is 12: the longer prompts exceed it
DECODE_STEPS = 8
PAGE_SIZE = 4  # sequences span many pages


# The fast tier checks these two (GQA + llama3 rope scaling, sliding windows); all run in full.
FAST = ("llama3-gqa-rope-scaled", "mistral-sliding-window")


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=() if name in FAST else pytest.mark.slow) for name in sorted(CONFIGS)])
def tiny_model(request, tmp_path_factory):
  cls, extra = CONFIGS[request.param]
  torch.manual_seed(0)
  hf_config = cls(**_COMMON, **extra)
  hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  config = ModelConfig.from_hf_dir(str(path))
  return hf, config, load_safetensors_dir(str(path), config)


def _hf_logits(hf, ids: list[int]) -> np.ndarray:  # [len(ids), V]
  with torch.no_grad():
    return hf(torch.tensor([ids])).logits[0].numpy()


def test_ragged_prefill_then_decode_matches_hf(tiny_model):
  hf, config, params = tiny_model
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in PROMPT_LENS]
  batch = PagedBatch(CausalLM(config), params, len(prompts), PAGE_SIZE, max(PROMPT_LENS) + 16)

  # Prefill: all three prompts in one ragged call, padded past the real token count.
  logits = batch.step(prompts, pad_to=128)
  seqs = [list(p) for p in prompts]
  worst = 0.0
  for step in range(DECODE_STEPS + 1):
    for s, seq in enumerate(seqs):
      ref = _hf_logits(hf, seq)[-1]
      worst = max(worst, float(np.abs(logits[s] - ref).max()))
    if step == DECODE_STEPS:
      break
    nxt = [int(np.argmax(logits[s])) for s in range(len(seqs))]
    for s, tok in enumerate(nxt):
      seqs[s].append(tok)
    logits = batch.step([[t] for t in nxt], pad_to=8)
  assert worst <= 1e-4, f"max abs logit error {worst:.2e}"


def test_chunked_prefill_matches_hf(tiny_model):
  hf, config, params = tiny_model
  rng = np.random.default_rng(2)
  prompt = rng.integers(0, config.vocab_size, 37).tolist()
  other = rng.integers(0, config.vocab_size, 9).tolist()
  batch = PagedBatch(CausalLM(config), params, 2, PAGE_SIZE, 64, seed=3)
  # Chunks of 16 for the long prompt while the short one prefills then decodes beside it; one
  # padded shape for the three steps, so one compile.
  step = functools.partial(batch.step, pad_to=32, max_q_len=16)
  step([prompt[:16], other])
  step([prompt[16:32], [5]])
  logits = step([prompt[32:], [7]])
  np.testing.assert_allclose(logits[0], _hf_logits(hf, prompt)[-1], atol=1e-4, rtol=0)
  np.testing.assert_allclose(logits[1], _hf_logits(hf, other + [5, 7])[-1], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_engine_sliding_window_model_pages_its_window(tmp_path_factory):
  """Mistral, every layer windowed: the engine's one KV group gives back the pages that left
  the window (never holding more than the window and a step's rows need), and greedy tokens
  still equal transformers'."""
  from jinfer.sampling.params import SamplingParams
  from tests.engine_fixtures import make_engine
  cls, extra = CONFIGS["mistral-sliding-window"]
  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_config(cls(**_COMMON, **extra),
                                                     dtype=torch.float32).eval()
  path = tmp_path_factory.mktemp("mistral-engine")
  hf.save_pretrained(path)
  config = ModelConfig.from_hf_dir(str(path))
  engine = make_engine((config, load_safetensors_dir(str(path), config), None), warmup=False,
                       max_model_len=64, page_size=PAGE_SIZE, max_num_seqs=2,
                       max_num_batched_tokens=8)
  assert engine.config.kv_groups.windows == (12,)
  most_pages = -(-(12 - 1 + 8) // PAGE_SIZE) + 1
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (40, 23)]
  sp = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS, ignore_eos=True)
  rids = [engine.add_request(None, p, sp) for p in prompts]
  final, given_back = {}, 0
  while engine.has_unfinished_requests():
    final.update((o.request_id, o) for o in engine.step())
    for seq in engine.scheduler.running:
      assert sum(p >= 0 for p in seq.pages[0]) <= most_pages
      given_back = max(given_back, seq.pages[0].count(-1))
  assert given_back >= 6
  for prompt, rid in zip(prompts, rids):
    seq = list(prompt)
    for _ in range(DECODE_STEPS):
      seq.append(int(np.argmax(_hf_logits(hf, seq)[-1])))
    assert final[rid].outputs[0].token_ids == seq[len(prompt):]
