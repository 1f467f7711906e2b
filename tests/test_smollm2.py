"""The real model: SmolLM2-135M-Instruct from its GGUF vs HF transformers on the same file."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from jinfer import LLM, SamplingParams
from tests.engine_fixtures import SMOLLM2
from tests.paged_batch import PagedBatch

pytestmark = pytest.mark.slow  # HF transformers on the real model

PROMPTS = [
    "The history of the Roman Empire",
    "def quicksort(arr):",
    "Here is a list of the planets in the solar system:",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def llm():
  return LLM(**SMOLLM2)


def _hf_greedy_picks(hf_model, ids: list[int], new: list[int]) -> list[int]:
  """HF's greedy choice after `ids + new[:i]` for every i, with EOS suppressed as HF's
  min_new_tokens does: one forward pass over the whole sequence. It equals `new` exactly when
  HF's own greedy generation of len(new) tokens would (each step's input is then the same prefix),
  at the cost of one pass instead of a token-by-token decode."""
  with torch.no_grad():
    logits = hf_model(torch.tensor([ids + new[:-1]])).logits[0, len(ids) - 1:]  # [len(new), V]
  logits[:, hf_model.generation_config.eos_token_id] = -float("inf")
  return logits.argmax(-1).tolist()


def test_logits_match_hf(llm, hf_smollm2_model):
  eng = llm.engine
  ids = [eng.tokenize(p) for p in PROMPTS]
  model = eng.runner.model.clone(kv_groups=None)  # for one table, as PagedBatch builds
  batch = PagedBatch(model, eng.runner.params, len(ids), 16, 64)
  ours = batch.step(ids)  # [S, V]
  worst = 0.0
  for s, seq in enumerate(ids):
    with torch.no_grad():
      ref = hf_smollm2_model(torch.tensor([seq])).logits[0, -1].numpy()
    worst = max(worst, float(np.abs(ours[s] - ref).max()))
  print(f"SmolLM2 max abs logit error vs HF: {worst:.2e}")
  assert worst < 2e-3


def test_greedy_tokens_match_hf_plain_and_chat(llm, hf_smollm2_model):
  tok = llm.tokenizer
  prompts = [tok.encode(p) for p in PROMPTS] + [
      tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
      for c in CHATS]
  # min_tokens suppresses EOS exactly as HF's min_new_tokens does.
  outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                              min_tokens=NEW_TOKENS))
  for ids, out in zip(prompts, outs):
    got = out.outputs[0].token_ids
    assert len(got) == NEW_TOKENS and got == _hf_greedy_picks(hf_smollm2_model, ids, got)


def test_chat_answer_is_coherent(llm):
  out = llm.chat(CHATS[0], SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
  assert "Paris" in out.text and out.finish_reason == "stop"


def test_batch_invariance_with_chunking_preemption_and_prefix_hits(llm):
  rng = np.random.default_rng(0)
  system = llm.tokenizer.encode("You are a helpful assistant who answers briefly. " * 6)
  watched = [llm.tokenizer.encode(p) for p in PROMPTS] + [system + llm.tokenizer.encode("Hi!")]
  fillers = [rng.integers(100, 40000, rng.integers(20, 200)).tolist() for _ in range(12)]
  fillers += [system + rng.integers(100, 40000, 5).tolist() for _ in range(4)]
  params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
  alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in watched]
  before = llm.engine.stats()
  batch = llm.generate(watched + fillers, params)
  after = llm.engine.stats()
  # 59 usable pages (944 tokens) for 8 running sequences of up to ~240: preemption happens.
  assert after.num_preemptions > before.num_preemptions
  assert after.prefix_hit_rate > 0
  assert [o.outputs[0].token_ids for o in batch[:len(watched)]] == alone


def test_rollout_logprobs_equal_a_teacher_forced_pass(llm):
  """Each sampled token's logprob (the default raw_logprobs) equals the trainer's teacher-forced
  forward over the same sequence (jinfer.training.online) in a batch with a prompt chunked over
  three steps, greedy and sampled rows: within 5e-5 (measured up to 1.24e-5 on one 2-core CPU and
  2.34e-5 on another, and up to 5e-5 over the online loop's sampled tails: thirty float32
  layers summed in two orders, the engine's paged attention and the trainer's dense one, over
  logits of magnitude ~35; the tiny model's test holds 1e-5)."""
  import jax
  import jax.numpy as jnp
  from jinfer.models import CausalLM
  from jinfer.models.kernel_options import KernelOptions
  from jinfer.training.online import sequence_logits, split_params
  eng = llm.engine
  model = CausalLM(eng.model_config, KernelOptions(attention="reference"), dtype=jnp.float32)
  frozen = split_params(eng.runner.stacked_params)
  fwd = jax.jit(lambda frozen, tokens: sequence_logits(model, 16, {}, 1.0, *frozen, tokens))
  rng = np.random.default_rng(3)
  prompts = [rng.integers(3, 49000, n).tolist() for n in (70, 9, 20)]
  params = [SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True),
            SamplingParams(temperature=0.8, max_tokens=10, logprobs=1, seed=1, ignore_eos=True),
            SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, logprobs=1, seed=2,
                           ignore_eos=True)]
  outs = llm.generate(prompts, params, use_tqdm=False)
  tokens = np.zeros((3, 96), np.int32)
  for i, (p, o) in enumerate(zip(prompts, outs)):
    tokens[i, :len(p) + 10] = p + o.outputs[0].token_ids
  logits = np.asarray(fwd(frozen, tokens), np.float64)
  for i, (p, o) in enumerate(zip(prompts, outs)):
    rows = logits[i, len(p) - 1:len(p) + 9]
    want = rows - np.logaddexp.reduce(rows, axis=-1, keepdims=True)
    got = [entry[t] for t, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
    gap = np.abs(np.asarray(got) - want[np.arange(10), o.outputs[0].token_ids]).max()
    assert gap <= 5e-5, (i, gap)
