"""LoRA training (`jinfer/training/lora_train.py`): a few steps on a tiny random Llama lower the
loss, and the saved adapter loads in jinfer and in HF peft as the same merged model. The shipped
adapters' behaviour is checked through HF peft + transformers (slow)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import transformers

from jinfer.config import ModelConfig
from jinfer.training.lora_train import (BEHAVIOURS, LoraConfig, LoraTrainer, first_sentences,
                                        merge, merged_params)
from jinfer.weights.peft_adapter import load_peft_adapter
from jinfer.weights.safetensors_dir import load_safetensors_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("lora_base"))
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
      tie_word_embeddings=True))
  # Random embeddings (the tied head) of std 0.02 cap the logits near 0.6: sharpen them so the
  # adapter can make the target tokens likely.
  with torch.no_grad():
    hf.model.embed_tokens.weight.mul_(20.0)
  hf.save_pretrained(path)
  config = ModelConfig.from_hf_dir(path)
  return path, config, load_safetensors_dir(path, config)


def _data(n: int = 8, seed: int = 0):
  rng = np.random.default_rng(seed)
  # A fixed "answer" after random prompts: the behaviour to learn.
  seqs = [np.concatenate([rng.integers(3, 96, 6), [7, 8, 9, 10, 11, 2]]).astype(np.int32)
          for _ in range(n)]
  return seqs, [6] * n


def test_a_few_steps_lower_the_loss_and_the_adapter_loads_in_jinfer_and_peft(tiny, tmp_path):
  import peft
  path, config, params = tiny
  cfg = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"),
                   seq_len=16, batch_size=4, learning_rate=5e-2, warmup_steps=1, steps=30)
  trainer = LoraTrainer(config, cfg, params)
  seqs, starts = _data()
  before = trainer.loss(seqs[:4], starts[:4])
  for step in range(cfg.steps):
    trainer.step(seqs[step % 2 * 4:][:4], starts[:4])
  after = trainer.loss(seqs[:4], starts[:4])
  assert after < 0.7 * before, (before, after)

  out = str(tmp_path / "adapter")
  trainer.save(out, config)
  adapter = load_peft_adapter(out, config)
  assert adapter.rank == 4 and adapter.target_modules == ("down_proj", "o_proj", "q_proj",
                                                          "v_proj")
  ours = merge(params, trainer.lora, cfg.scaling)
  loaded = merged_params(params, adapter)
  hf = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(path),
                                      out).merge_and_unload()
  hf.save_pretrained(str(tmp_path / "merged"))
  theirs = load_safetensors_dir(str(tmp_path / "merged"), config)
  for site in (("layers", "attn", "q_proj"), ("layers", "attn", "o_proj"),
               ("layers", "mlp", "down_proj")):
    want = _kernel(ours, site)
    assert not np.allclose(want, _kernel(params, site))  # trained: b moved off zero
    np.testing.assert_allclose(_kernel(loaded, site), want, atol=1e-6)
    np.testing.assert_allclose(_kernel(theirs, site), want, atol=1e-5)


def _kernel(params, path):
  for key in path:
    params = params[key]
  return np.asarray(params["kernel"])


def test_behaviours_transform_the_base_answers_into_what_they_check():
  answer = ("Photosynthesis is how plants make food from light. They take in carbon dioxide "
            "and water. Using sunlight, they turn these into sugar and oxygen, which they "
            "release into the air around them every single day of the year.")
  short = first_sentences(answer, 60, 200)
  assert short == ("Photosynthesis is how plants make food from light. They take in carbon "
                   "dioxide and water.")
  for name, b in BEHAVIOURS.items():
    assert b.shows(b.transform(answer)), name
    assert not b.shows(answer), name


ADAPTERS = ("smollm2-135m-signoff", "smollm2-135m-allcaps")


@pytest.fixture(scope="module")
def smollm2_lora():
  """SmolLM2 in jinfer with room for both shipped adapters (float32, the CPU's default)."""
  from jinfer import LLM
  return LLM("smollm2-135m-instruct", enable_lora=True, max_loras=2, max_lora_rank=8,
             max_model_len=384, max_num_seqs=4, num_pages=64)


@pytest.mark.slow
@pytest.mark.parametrize("name", ADAPTERS)
def test_shipped_adapter_shows_its_behaviour_in_hf_peft_and_jinfer(name, hf_smollm2_model,
                                                                    hf_smollm2_tokenizer,
                                                                    smollm2_lora):
  """The shipped adapter, loaded by HF peft onto transformers' SmolLM2, answers held-out prompts
  greedily with its behaviour; jinfer serving it by its built-in name gives HF peft's greedy
  tokens; the base model (jinfer's, in the same batch) does not show the behaviour."""
  import peft
  from jinfer import LoRARequest, SamplingParams
  from jinfer.training.chat_data import eval_prompts
  from jinfer.weights.builtin import adapter_path
  path = adapter_path(name)
  with open(os.path.join(path, "train_log.json")) as fh:
    behaviour = BEHAVIOURS[json.load(fh)["behaviour"]]
  tok = hf_smollm2_tokenizer
  prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}],
                                          add_generation_prompt=True,
                                          return_dict=True)["input_ids"])
             for p in eval_prompts(4)]
  model = peft.PeftModel.from_pretrained(hf_smollm2_model, path)
  try:
    hf_tokens = [model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                max_new_tokens=behaviour.max_tokens,
                                do_sample=False)[0, len(ids):].tolist() for ids in prompts]
  finally:
    model.unload()  # the session's HF model is shared: leave it as it was
  shows = lambda t: behaviour.shows(tok.decode(t, skip_special_tokens=True))  # noqa: E731
  assert sum(map(shows, hf_tokens)) >= 3, [tok.decode(t) for t in hf_tokens]
  lora = LoRARequest(name, ADAPTERS.index(name) + 1, path)
  outs = smollm2_lora.generate(prompts * 2, SamplingParams(max_tokens=behaviour.max_tokens,
                                                           temperature=0.0),
                               lora_request=[lora] * len(prompts) + [None] * len(prompts),
                               use_tqdm=False)
  got = [list(o.outputs[0].token_ids) for o in outs]
  strip = lambda t: t[:-1] if t and t[-1] == tok.eos_token_id else t  # noqa: E731
  assert [strip(t) for t in got[:len(prompts)]] == [strip(t) for t in hf_tokens]
  assert not any(map(shows, got[len(prompts):])), [o.outputs[0].text for o in outs]
