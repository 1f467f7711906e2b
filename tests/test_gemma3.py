"""Gemma-3's text stack vs HF transformers on tiny random models: local and global layers (each
with its own rope), prompts longer than the window, GQA and MQA, a head dim that is not
hidden / heads, soft-capped logits; through the scanned and unrolled stacks, the engine, and a
GGUF file written the way llama.cpp writes Gemma-3."""
from __future__ import annotations

import os

import jax
import numpy as np
import pytest
import torch
import transformers

from jinfer.config import ModelConfig
from jinfer.models import CausalLM
from jinfer.models.llama import unstack_layers
from jinfer.weights.safetensors_dir import load_safetensors_dir
from tests.paged_batch import PagedBatch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WINDOW = 8
PAGE_SIZE = 4
CONFIGS = {
    # GQA, head_dim 32 != 64 / 4, the global layers' rope linearly scaled, logits soft-capped,
    # sm_scale from query_pre_attn_scalar.
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                query_pre_attn_scalar=24, final_logit_softcapping=5.0,
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                    "rope_theta": 50000.0},
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 10000.0}}),
    # MQA, untied head, transformers' default layer pattern and rope bases.
    "mqa-untied": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                       num_hidden_layers=2, sliding_window_pattern=2, tie_word_embeddings=False,
                       query_pre_attn_scalar=16),
}
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               max_position_embeddings=256, sliding_window=WINDOW)


def _hf_model(name: str):
  torch.manual_seed(0)
  cfg = transformers.Gemma3TextConfig(**{**_COMMON, **CONFIGS[name]})
  hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
  with torch.no_grad():  # transformers initializes Gemma's norms at 0 (a scale of 1): vary them
    for n, p in hf.named_parameters():
      if "norm" in n:
        p.normal_(0.0, 0.3)
  return hf


def _saved(name: str, tmp_path_factory):
  hf = _hf_model(name)
  path = str(tmp_path_factory.mktemp(name))
  hf.save_pretrained(path)
  config = ModelConfig.from_hf_dir(path)
  return hf, config, load_safetensors_dir(path, config), path


@pytest.fixture(scope="module", params=[
    "gqa", pytest.param("mqa-untied", marks=pytest.mark.slow)])
def tiny(request, tmp_path_factory):
  return _saved(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory):  # for the costlier paths, one config is enough
  return _saved("gqa", tmp_path_factory)


def _hf_logits(hf, ids: list[int]) -> np.ndarray:  # [len(ids), V]
  with torch.no_grad():
    return hf(torch.tensor([ids])).logits[0].numpy()


def _prefill_then_decode(hf, config, params, scan_layers: bool = True, steps: int = 2) -> float:
  """Worst logit error over a ragged prefill of prompts shorter and longer than the window, then
  greedy decode steps (one padded shape for all: one compile)."""
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 23)]
  model = CausalLM(config, scan_layers=scan_layers)
  batch = PagedBatch(model, params if scan_layers else unstack_layers(params, config.num_layers),
                     len(prompts), PAGE_SIZE, 40)
  logits = batch.step(prompts, pad_to=32)
  seqs, worst = [list(p) for p in prompts], 0.0
  for step in range(steps + 1):
    for s, seq in enumerate(seqs):
      worst = max(worst, float(np.abs(logits[s] - _hf_logits(hf, seq)[-1]).max()))
    if step == steps:
      return worst
    nxt = [int(np.argmax(row)) for row in logits]
    for seq, tok in zip(seqs, nxt):
      seq.append(tok)
    logits = batch.step([[t] for t in nxt], pad_to=32)


def test_matches_hf(tiny):
  hf, config, params, _ = tiny
  assert config.local_rope == tuple(t == "sliding_attention" for t in hf.config.layer_types)
  assert any(config.local_rope) and not all(config.local_rope)
  worst = _prefill_then_decode(hf, config, params)
  assert worst <= 1e-4, f"max abs logit error {worst:.2e}"


@pytest.mark.slow
def test_unrolled_stack_matches_hf(tiny_gqa):
  hf, config, params, _ = tiny_gqa
  worst = _prefill_then_decode(hf, config, params, scan_layers=False, steps=1)
  assert worst <= 1e-4, f"max abs logit error {worst:.2e}"


def test_config_forms_agree():
  """transformers 5's per-layer-type rope_parameters, the older flat keys, and a multimodal
  config's nested text_config (listing only what differs from the defaults) read the same."""
  new = ModelConfig.from_hf_dict({
      "model_type": "gemma3_text", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
      "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2,
      "head_dim": 32, "sliding_window": 16, "query_pre_attn_scalar": 32,
      "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
      "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                             "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
  old = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 7,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "sliding_window": 16, "query_pre_attn_scalar": 32, "sliding_window_pattern": 6,
         "rope_theta": 1e6, "rope_local_base_freq": 1e4,
         "rope_scaling": {"type": "linear", "factor": 8.0}}
  assert ModelConfig.from_hf_dict({"model_type": "gemma3_text", **old}) == new
  nested = ModelConfig.from_hf_dict({"model_type": "gemma3", "text_config": {
      "model_type": "gemma3_text", **old}, "vision_config": {"model_type": "siglip_vision_model"}})
  assert nested == new
  assert new.sliding_windows == (16,) * 5 + (None, 16) and new.local_rope_theta == 1e4
  assert dict(new.rope_scaling) == {"rope_type": "linear", "factor": 8.0}


def test_multimodal_checkpoint_loads_its_text_stack(tiny, tmp_path):
  """A Gemma3ForConditionalGeneration file keeps the text model under `model.language_model.`
  (transformers 5) or `language_model.model.` (older files)."""
  from safetensors.numpy import save_file
  hf, config, params, _ = tiny
  for prefix in ("model.language_model.", "language_model.model."):
    tensors = {prefix + k.removeprefix("model.") if k.startswith("model.") else k:
               v.numpy() for k, v in hf.state_dict().items()}
    folder = tmp_path / prefix.replace(".", "_")
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    loaded = load_safetensors_dir(str(folder), config)
    assert (np.asarray(loaded["layers"]["attn"]["q_proj"]["kernel"])
            == np.asarray(params["layers"]["attn"]["q_proj"]["kernel"])).all()


@pytest.mark.slow
def test_engine_greedy_matches_hf(tiny_gqa):
  """Through the engine's hybrid KV cache (a full group and two window groups, each window
  group giving back pages that left its window) under chunked prefill of prompts longer than
  the window, a pool small enough to preempt, and prefix-cache hits that need a window group's
  pages: greedy tokens equal transformers' greedy generation, and no window group ever holds
  more pages than its window and one step's rows need."""
  from jinfer.sampling.params import SamplingParams
  from tests.engine_fixtures import make_engine
  hf, config, params, _ = tiny_gqa
  budget = 16
  # One sequence of max_model_len needs 16 pages in the full group and 7 in each window group.
  engine = make_engine((config, params, None), warmup=False, max_model_len=64, page_size=4,
                       num_pages=31, max_num_seqs=4, max_num_batched_tokens=budget)
  assert engine.config.kv_groups.windows == (None, WINDOW, WINDOW)
  window_pages = -(-(WINDOW - 1 + budget) // 4) + 1
  rng = np.random.default_rng(3)
  first = [rng.integers(0, config.vocab_size, n).tolist() for n in (29, 6, 33, 25)]
  # Then prompts sharing the first one's first 24 tokens (6 pages: the window groups' hit needs
  # pages 4 and 5, long given back by the first prompt's sequence) and a fresh one.
  second = [first[0][:24] + rng.integers(0, config.vocab_size, n).tolist() for n in (3, 9)]
  second.append(rng.integers(0, config.vocab_size, 30).tolist())
  params_ = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
  for prompts in (first, second):
    rids = [engine.add_request(None, p, params_) for p in prompts]
    final, most = {}, 0.0
    while engine.has_unfinished_requests():
      for o in engine.step():
        final[o.request_id] = o
      stats = engine.stats()
      assert max(stats.kv_bytes_per_seq[1:], default=0) <= window_pages * (
          stats.kv_bytes_per_token * 4 // 3)  # a page of one group holds one of 3 layers
      most = max(most, stats.kv_bytes_per_seq[0] - stats.kv_bytes_per_seq[1])
    assert most > 0, "the full group was meant to hold more than a window group"
    for prompt, rid in zip(prompts, rids):
      seq = list(prompt)
      for _ in range(6):  # transformers' greedy choice, EOS included (the engine ignores EOS)
        seq.append(int(np.argmax(_hf_logits(hf, seq)[-1])))
      assert final[rid].outputs[0].token_ids == seq[len(prompt):]
  stats = engine.stats()
  assert stats.num_preemptions > 0, "the pool was meant to force preemption"
  assert engine.blocks.prefix_hits >= 2 * 24
  engine.blocks.check_consistency()
  assert engine.blocks.num_free_pages == engine.blocks.num_usable_pages


def _sentencepiece_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
  """A Gemma-like GGUF vocabulary: control tokens, a user-defined one, a run of spaces (stored
  as spaces, as llama.cpp writes Gemma's), the 256 byte-fallback tokens, then pieces."""
  tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n", "  "]
  types = [3, 3, 3, 3, 3, 3, 4, 4]
  tokens += [f"<0x{b:02X}>" for b in range(256)]
  types += [6] * 256
  pieces = ["▁", "e", "t", "h", "o", "a", "n", "s", "r", "l", "i", "d", "▁t", "he", "▁the",
            "▁a", "in", "er", "on", "▁o", "▁s", "at", "en", "▁of", "re", "is", "▁is", "or",
            "an", "nd", "▁and", "ll", "lo", "ello", "▁h", "▁he", "▁hello", "w", "▁w", "ld",
            "▁wor", "▁world", "c", "p", "▁ca", "▁cap", "it", "al", "ital", "▁capital", "F",
            "▁F", "ra", "nce", "▁France", "é", "ö", "日", "本", "x", "y", "z", "2", "0", "1"]
  tokens += pieces
  types += [1] * len(pieces)
  rng = np.random.default_rng(0)
  while len(tokens) < size:  # unused filler pieces
    tokens.append("▁" + "".join(rng.choice(list("qjvkxz"), 4)))
    types.append(1)
  scores = [-float(i) if t == 1 else 0.0 if t == 6 else -1000.0 for i, t in enumerate(types)]
  return tokens, scores, types


@pytest.mark.slow
def test_gguf_matches_hf(tmp_path):
  """A Gemma-3 GGUF (norms stored plus one, no layer pattern, no local rope base): jinfer's
  model from it matches the transformers model it was written from, and its SentencePiece
  tokenizer encodes as transformers' tokenizer from the same file."""
  from jinfer.tokenizer import Tokenizer
  from jinfer.weights.gguf_file import load_gguf
  from jinfer.weights.gguf_quantized import read_gguf_groupwise
  from jinfer.weights.hf_layout import hf_to_params
  from tests.hf_to_gguf import write_gemma3_as_gguf
  vocab = 400
  torch.manual_seed(0)
  # transformers' defaults for what the file leaves out: 6-layer pattern, local rope base 1e4.
  cfg = transformers.Gemma3TextConfig(
      vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
      num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
      max_position_embeddings=256, sliding_window=WINDOW,
      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
  hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
  with torch.no_grad():
    for n, p in hf.named_parameters():
      if "norm" in n:
        p.normal_(0.0, 0.3)
  file = str(tmp_path / "tiny-gemma3.gguf")
  write_gemma3_as_gguf(file, hf, *_sentencepiece_vocab(vocab))

  config, params = load_gguf(file)
  assert config.local_rope == (True,) * 5 + (False, True)
  assert config.sliding_windows == (WINDOW,) * 5 + (None, WINDOW)
  worst = _prefill_then_decode(hf, config, params, steps=1)
  assert worst <= 1e-4, f"max abs logit error {worst:.2e}"
  # quantization="gguf"'s reader (blocks kept quantized, floats as they are) gives the same
  _, weights = read_gguf_groupwise(file)
  jax.tree.map(np.testing.assert_array_equal, hf_to_params(config, weights.get, source=file),
               params)

  ours = Tokenizer.from_gguf(file)
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path),
                                                      gguf_file="tiny-gemma3.gguf")
  for text in ["The capital of France is", "hello  world\n\nthe end", " héllo wörld 日本 qq",
               "<start_of_turn>user\nhi<end_of_turn>", "x   y\tz 2012"]:
    assert ours.encode(text) == theirs.encode(text), text
    assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text),
                                                           skip_special_tokens=True)
