"""Speculative sampling is lossless, end to end: through the engine, with a random draft model
that often disagrees with the target, the first k+1 tokens of thousands of seeded requests are
the tokens the same seeds give without speculation, and distributed as other seeds' (chi-squared
per position, at temperature 1 and with top-k and top-p); a deliberately wrong acceptance rule
fails the same test. Likewise for Medusa trees, whose typical acceptance (not lossless) fails
it. And on the same model (distributions neither flat nor one-hot), seeded requests in a batch
with prefix hits and preemption emit what each emits alone without speculation, per proposer."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from scipy import stats

from jinfer.sampling import accept as accept_mod
from jinfer.config import ModelConfig
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.sampling.params import SamplingParams
from jinfer.engine.speculative import medusa_heads as medusa_heads_mod
from jinfer.weights.safetensors_dir import load_safetensors_dir

V, K, N = 64, 3, 2000  # vocabulary, drafts per step, samples per distribution
PROMPT = [5]



@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """A random Llama over V tokens (its LM head scaled so next-token distributions have an
  entropy of 1-2 nats) and, as its draft, the same model without its last layer: they agree on
  roughly half the tokens."""
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
      tie_word_embeddings=False))
  with torch.no_grad():
    hf.lm_head.weight.mul_(40.0)
  target = str(tmp_path_factory.mktemp("target"))
  hf.save_pretrained(target)
  draft = str(tmp_path_factory.mktemp("draft"))
  hf.model.layers = hf.model.layers[:1]
  hf.config.num_hidden_layers = 1
  hf.save_pretrained(draft)
  config = ModelConfig.from_hf_dir(target)
  return (config, load_safetensors_dir(target, config)), draft


def sample(models, params: SamplingParams, speculate: bool, first_seed: int = 0) -> np.ndarray:
  """[N, K+2] tokens: N requests with seeds 0..N-1, all in flight at once. The first token comes
  from the prefill, the next k+1 from one verify step when every draft is accepted."""
  (config, weights), draft = models
  spec = {"method": "draft_model", "num_speculative_tokens": K, "model": draft}
  eng = LLMEngine.from_parts(config, weights, None, warmup=False, config=EngineConfig.of(
      max_model_len=16, page_size=4, num_pages=4 * N + 1, max_num_seqs=N,
      max_num_batched_tokens=8192, max_prefill_seqs=N, enable_prefix_caching=False,
      speculative_config=spec if speculate else None))
  rids = [eng.add_request(None, PROMPT, dataclasses.replace(params, seed=first_seed + i))
          for i in range(N)]
  final = eng.run_to_completion(rids)
  if speculate:
    s = eng.stats().spec
    assert 0.1 < s.acceptance_rate < 0.8, "the draft should often, not always, disagree"
  return np.array([final[r].outputs[0].token_ids for r in rids])


def min_pvalue(a: np.ndarray, b: np.ndarray) -> float:
  """The smallest over positions of a two-sample chi-squared test of the token distributions
  (bins with fewer than 10 samples in both merged)."""
  out = 1.0
  for pos in range(K + 2):
    table = np.stack([np.bincount(a[:, pos], minlength=V), np.bincount(b[:, pos], minlength=V)])
    big = table.sum(0) >= 10
    table = np.concatenate([table[:, big], table[:, ~big].sum(1, keepdims=True)], axis=1)
    table = table[:, table.sum(0) > 0]
    out = min(out, stats.chi2_contingency(table).pvalue)
  return out


BASE = dict(temperature=1.0, max_tokens=K + 2, ignore_eos=True)
CASES = {"temperature 1": SamplingParams(**BASE),
         "top-k 8": SamplingParams(**BASE, top_k=8),
         "top-p 0.8": SamplingParams(**BASE, top_p=0.8)}


@pytest.mark.slow  # thousands of requests: a few large buckets compiled
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_keeps_the_distribution(models, case):
  params = CASES[case]
  spec, plain = sample(models, params, True), sample(models, params, False)
  # Each token is the sampler's own draw: the same seeds give the very same tokens ...
  assert np.array_equal(spec, plain)
  # ... distributed as the target's samples of other seeds (K+2 positions, each at 1e-3; a
  # fixed seed set: the outcome is fixed, not flaky).
  assert min_pvalue(spec, sample(models, params, False, first_seed=N)) > 1e-3


@pytest.mark.slow  # thousands of requests: a few large buckets compiled
def test_a_wrong_acceptance_rule_fails_it(models, monkeypatch):
  # Every verify row drawing with its step's first key ties the tokens of a step together.
  real = accept_mod.row_tensors
  monkeypatch.setattr(accept_mod, "row_tensors", lambda st, vt, *a, **kw: real(
      st, vt, *a, **kw).replace(gen_idx=st.gen_idx[vt.row_seq]))
  params = CASES["temperature 1"]
  assert min_pvalue(sample(models, params, True), sample(models, params, False)) < 1e-6


# -- Medusa: a candidate tree verified by the tree walk ---------------------------------------
@pytest.fixture(scope="module")
def medusa_heads(models, tmp_path_factory) -> str:
  """Three identity heads over the target's own LM head: each guesses the *next* token's likely
  values one step early. On this random model that is right for a few percent of the trees'
  candidates (hundreds of accepted tokens over the run), so both outcomes of the walk occur."""
  (config, weights), _ = models
  e = config.hidden_size
  head = np.asarray(weights["lm_head"]["kernel"], np.float32).T  # [V, E]
  params = {"w": np.zeros((3, 1, e, e), np.float32), "b": np.zeros((3, 1, e), np.float32),
            "lm_head": np.stack([head] * 3)}
  path = str(tmp_path_factory.mktemp("medusa"))
  medusa_heads_mod.save_heads(path, params, {"hidden_size": e, "vocab_size": V},
                              dtype=np.float32)
  return path


def medusa_sample(models, heads: str, params: SamplingParams, first_seed: int = 0,
                  **spec) -> np.ndarray:
  """As `sample`, verifying Medusa trees (seeds first_seed..first_seed+N-1)."""
  (config, weights), _ = models
  eng = LLMEngine.from_parts(config, weights, None, warmup=False, config=EngineConfig.of(
      max_model_len=16, page_size=4, num_pages=4 * N + 1, max_num_seqs=N,
      max_num_batched_tokens=8192, max_prefill_seqs=N, enable_prefix_caching=False,
      speculative_config={"method": "medusa", "num_speculative_tokens": 3, "model": heads,
                          "medusa_choices": MEDUSA_TREE, **spec}))
  rids = [eng.add_request(None, PROMPT, dataclasses.replace(params, seed=first_seed + i))
          for i in range(N)]
  final = eng.run_to_completion(rids)
  s = eng.stats().spec
  assert s.num_verified > N // 2 and s.num_accepted_tokens > 200, s
  return np.array([final[r].outputs[0].token_ids for r in rids])


MEDUSA_TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0], [1, 0, 0]]


@pytest.mark.slow  # thousands of requests: a few large buckets compiled
@pytest.mark.parametrize("case", ["temperature 1", "top-k 8"])
def test_a_medusa_tree_keeps_the_distribution(models, medusa_heads, case):
  params = CASES[case]
  tree = medusa_sample(models, medusa_heads, params)
  # The walk draws with the sampler's own keys: the same seeds give the very same tokens ...
  assert np.array_equal(tree, sample(models, params, False))
  # ... and they are distributed as the target's samples of other seeds.
  assert min_pvalue(tree, sample(models, params, False, first_seed=N)) > 1e-3


@pytest.mark.slow  # thousands of requests: a few large buckets compiled
def test_typical_acceptance_fails_it(models, medusa_heads):
  """Medusa's typical acceptance at a low threshold accepts unlikely candidates: not lossless."""
  params = CASES["temperature 1"]
  typical = medusa_sample(models, medusa_heads, params,
                          acceptance_method="typical_acceptance_sampler",
                          posterior_threshold=0.01, posterior_alpha=0.01)
  assert min_pvalue(typical, sample(models, params, False)) < 1e-6


# -- The batch: seeded requests emit their tokens alone or beside any others --------------------
BATCH = dict(max_model_len=64, page_size=4, num_pages=24, max_num_seqs=8,
             max_num_batched_tokens=16, max_prefill_seqs=2)


def batch_engine(models, spec: dict | None) -> LLMEngine:
  (config, weights), _ = models
  return LLMEngine.from_parts(config, weights, None, warmup=False, config=EngineConfig.of(
      **BATCH, speculative_config=spec))


# Slow: two engines' buckets compiled (~20 s each case). The quick tier keeps the property per
# verify row (test_accept.py) and speculation's stops and logprobs (test_spec_engine.py).
@pytest.mark.slow
# The draft model's case: the distribution tests above and test_spec_smollm2.py.
@pytest.mark.parametrize("method", ["medusa", "ngram"])
def test_seeded_sampling_is_plain_sampling_in_any_batch(models, medusa_heads, method):
  """Seeded requests emit inside a batch the tokens each emits alone without speculation, on a
  model whose distributions are neither flat nor one-hot (so how many drafts a sequence gets
  could change an acceptance's outcome). The batch is where this is hardest: more requests than
  max_prefill_seqs, most sharing a prompt whose prefix-cache hits leave a tail of 2 rows (as few
  as a verify step's, in steps with other sequences' verify rows), drafts trimmed by the token
  budget, preemption."""
  _, draft = models
  spec = {"ngram": {"prompt_lookup_min": 1}, "draft_model": {"model": draft},
          "medusa": {"model": medusa_heads, "medusa_choices": MEDUSA_TREE}}[method]
  rng = np.random.default_rng(0)
  shared = rng.integers(1, V, 10).tolist()  # two full pages of 4, then 2 tokens
  prompts = [rng.integers(1, V, 24).tolist()] + [shared] * 6 + [rng.integers(1, V, 20).tolist()]
  params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True,
                           top_p=0.9 if s % 3 == 2 else 1.0) for s in range(len(prompts))]
  plain = batch_engine(models, None)
  alone = [plain.run_to_completion([r])[r].outputs[0].token_ids
           for r in (plain.add_request(None, p, sp) for p, sp in zip(prompts, params))]
  eng = batch_engine(models, {"method": method, "num_speculative_tokens": K, **spec})
  rids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
  final = eng.run_to_completion(rids)
  assert [final[r].outputs[0].token_ids for r in rids] == alone
  s = eng.stats()
  assert s.prefix_hit_rate > 0 and s.num_preemptions > 0 and s.spec.num_accepted_tokens > 0, s
  eng.blocks.check_consistency()
  assert eng.blocks.num_free_pages == eng.blocks.num_usable_pages
