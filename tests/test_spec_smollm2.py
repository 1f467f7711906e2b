"""Speculative decoding on the real model: SmolLM2's greedy output with n-gram lookup, with the
distilled draft and with the Medusa heads of `checkpoints/` is the output without speculation,
alone and inside a batch with chunked prefill, preemption and prefix hits; and the shipped draft
and heads are trained ones."""
from __future__ import annotations

import os

import numpy as np
import pytest

from jinfer import LLM, SamplingParams

pytestmark = pytest.mark.slow  # four SmolLM2 engines, ~3 minutes

CHECKPOINTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "checkpoints")
DRAFT = os.path.join(CHECKPOINTS, "smollm2-135m-draft")
MEDUSA = os.path.join(CHECKPOINTS, "smollm2-135m-medusa")
# 39 usable pages (624 tokens) for 16 running sequences of up to ~240 tokens: preemption. Every
# step scanned: each unrolled bucket compiles every layer, which cost this module 4 minutes.
ENGINE = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=64, page_size=16,
              num_pages=40, warmup=False, scan_layers=True)
SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                   "prompt_lookup_max": 4},
         "draft": {"method": "draft_model", "num_speculative_tokens": 4, "model": DRAFT},
         "medusa": {"method": "medusa", "num_speculative_tokens": 4, "model": MEDUSA}}
PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def workload():
  """(watched prompts, filler prompts, greedy outputs of the watched ones without speculation)."""
  llm = LLM(**ENGINE)
  tok = llm.tokenizer
  chats = ["Explain lightning in simple terms.", "Write a Python function that checks whether "
           "two strings are anagrams.", "What are three interesting facts about owls?"]
  system = tok.encode("You are a helpful assistant who answers briefly. " * 6)
  watched = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=True)
             for c in chats] + [system + tok.encode("Hi!")]
  rng = np.random.default_rng(0)
  fillers = [rng.integers(100, 40000, rng.integers(20, 200)).tolist() for _ in range(8)]
  fillers += [system + rng.integers(100, 40000, 5).tolist() for _ in range(4)]  # prefix hits
  want = [o.outputs[0].token_ids for o in llm.generate(watched, PARAMS, use_tqdm=False)]
  return watched, fillers, want


@pytest.mark.parametrize("method", sorted(SPECS))
def test_greedy_output_is_the_same_as_without_speculation(workload, method):
  watched, fillers, want = workload
  llm = LLM(**ENGINE, speculative_config=SPECS[method])
  alone = [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in watched]
  assert alone == want
  first = llm.engine.stats().spec.acceptance_per_position[0]
  if method == "draft":  # a trained draft, not a random one (that would be right ~1/8192)
    assert first > 0.1, llm.engine.stats().spec.summary()
  if method == "medusa":  # trained heads: the first head's candidates are often right
    assert first > 0.3, llm.engine.stats().spec.summary()
  before = llm.engine.stats()
  batch = llm.generate(watched + fillers, PARAMS, use_tqdm=False)
  after = llm.engine.stats()
  assert after.num_preemptions > before.num_preemptions
  assert after.prefix_hit_rate > 0
  assert [o.outputs[0].token_ids for o in batch[:len(watched)]] == want
  assert after.spec.num_draft_tokens > before.spec.num_draft_tokens
  b = llm.engine.blocks
  b.check_consistency()
  assert b.num_free_pages == b.num_usable_pages
