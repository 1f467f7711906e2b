"""Rollout logprobs: each sampled token's processed logprob equals a teacher-forced forward pass
over the same sequence (the trainer's own, `jinfer.training.online.sequence_logits`) under
vLLM's `processed_logprobs` definition, whatever the batch: greedy and sampled rows with
temperature, top-k, top-p, min-p and penalties, a prompt chunked over steps, LoRA rows. And the
n samples of a request prefill its prompt once. (Raw logprobs against the same pass:
tests/test_smollm2.py, on the real model.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.engine.lora_slots import LoRARequest
from jinfer.errors import ParameterError
from jinfer.models import CausalLM
from jinfer.models.kernel_options import KernelOptions
from jinfer.sampling.params import SamplingParams
from jinfer.training.lora_train import init_lora, lora_sites
from jinfer.training.online import sequence_logits, split_params
from jinfer.weights.peft_adapter import save_peft_adapter
from tests.engine_fixtures import ROLLOUT, make_engine

RANK, ALPHA = 4, 8.0
# float32: a sampled token's logprob within 1e-5; a top-N token's within 1e-5 of its magnitude
# (a logprob of -20 carries the logits' own rounding, ~1e-6 relative, times 20).
TOL = 1e-5


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
  """(LoRARequest, the trainer-layout factors) of a random rank-4 adapter on q/v/down."""
  config, params, _ = tiny_model
  lora = init_lora(params, lora_sites(config, ("q_proj", "v_proj", "down_proj")), RANK, seed=3)
  rng = np.random.default_rng(3)
  lora = {p: (np.asarray(a), rng.normal(0, 0.3, b.shape).astype(np.float32))
          for p, (a, b) in lora.items()}
  path = str(tmp_path_factory.mktemp("rollout_adapter"))
  save_peft_adapter(path, config, lora, rank=RANK, alpha=ALPHA)
  return LoRARequest("rollout", 1, path), lora


@pytest.fixture(scope="module")
def teacher(tiny_model, adapter):
  """tokens, lora -> float64 logits [len, V] of the trainer's teacher-forced forward (one
  compile: every sequence padded to max_model_len, the base as the adapter with b = 0)."""
  config, params, _ = tiny_model
  model = CausalLM(config, KernelOptions(attention="reference"), dtype=jnp.float32)
  frozen = split_params(params)
  fwd = jax.jit(lambda lora, frozen, tokens: sequence_logits(model, 4, lora, ALPHA / RANK,
                                                             *frozen, tokens))
  zero = {p: (a, np.zeros_like(b)) for p, (a, b) in adapter[1].items()}

  def logits(tokens: list[int], lora: dict | None) -> np.ndarray:
    padded = np.zeros((1, ROLLOUT["max_model_len"]), np.int32)
    padded[0, :len(tokens)] = tokens
    out = fwd(zero if lora is None else lora, frozen, padded)
    return np.asarray(out[0, :len(tokens)], np.float64)
  return logits


def _processed(x: np.ndarray, p: SamplingParams, history: list[int], n_prompt: int) -> np.ndarray:
  """vLLM's processed log-probabilities of one row, float64: penalties (repetition over prompt
  and output, frequency and presence over the output), then for a sampled row temperature and
  top-k, top-p (over the top-k renormalized), min-p (-inf where filtered); a greedy row's at
  temperature 1, unfiltered."""
  x = x.copy()
  seen = np.unique(history)
  x[seen] = np.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
  counts = np.bincount(history[n_prompt:], minlength=len(x)).astype(np.float64)
  x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
  if p.temperature == 0:
    return x - np.logaddexp.reduce(x)
  y = x / p.temperature
  order = np.argsort(-y, kind="stable")
  k = len(y) if p.top_k == -1 else p.top_k
  srt = y[order]
  probs = np.exp(srt[:k] - np.logaddexp.reduce(srt[:k]))
  keep = np.zeros(len(y), bool)
  keep[:k] = True
  if p.top_p < 1:
    keep[:k] &= np.cumsum(probs) - probs < p.top_p
  keep[:k] &= probs >= p.min_p * probs[0]
  keep[0] = True
  out = np.full(len(y), -np.inf)
  kept = order[keep]
  out[kept] = y[kept] - np.logaddexp.reduce(y[kept])
  return out


def _check(out, prompt, params, lora, teacher):
  """Every sampled token's logprob (and the top ones) against the teacher-forced reference."""
  tokens = out.token_ids
  logits = teacher(prompt + tokens, lora)
  n = len(prompt)
  assert len(out.logprobs) == len(tokens)
  for j, (tok, entry) in enumerate(zip(tokens, out.logprobs)):
    row = logits[n - 1 + j]
    want = _processed(row, params, prompt + tokens[:j], n)
    assert abs(entry[tok] - want[tok]) <= TOL, (j, tok, entry[tok], want[tok])
    for t, lp in entry.items():  # the top ones, where the reference has them finite
      if np.isfinite(want[t]):
        assert abs(lp - want[t]) <= TOL * max(1.0, abs(want[t])), (j, t, lp, want[t])
      else:
        assert lp == -np.inf, (j, t, lp)


# greedy and sampled rows, the filters, penalties, a LoRA row, a 40-token prompt in chunks
ROWS = [(SamplingParams(temperature=0.0, max_tokens=8, logprobs=2), False, 9),
        (SamplingParams(temperature=0.7, max_tokens=8, logprobs=2, seed=1), False, 12),
        (SamplingParams(temperature=1.3, top_k=20, top_p=0.9, max_tokens=8, logprobs=2, seed=2),
         False, 7),
        (SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.3,
                        frequency_penalty=0.5, presence_penalty=0.2, max_tokens=8, logprobs=2,
                        seed=3), False, 10),
        (SamplingParams(temperature=1.0, max_tokens=8, logprobs=2, seed=4), True, 11),
        (SamplingParams(temperature=0.0, max_tokens=8, logprobs=2), True, 6),
        (SamplingParams(temperature=0.9, top_p=0.8, max_tokens=8, logprobs=2, seed=5), True, 40)]


def _mixed_batch(engine, adapter):
  rng = np.random.default_rng(0)
  lora_request, factors = adapter
  rows = [(rng.integers(5, 1000, size=n).tolist(), p, use) for p, use, n in ROWS]
  ids = [engine.add_request(None, prompt, p, lora_request=lora_request if use else None)
         for prompt, p, use in rows]
  final = engine.run_to_completion(ids)
  return [(final[i].outputs[0], prompt, p, factors if use else None)
          for i, (prompt, p, use) in zip(ids, rows)]


@pytest.fixture(scope="module")
def engine(tiny_model):
  return make_engine(tiny_model, warmup=False, **ROLLOUT)


def test_processed_logprobs_equal_a_teacher_forced_pass(engine, adapter, teacher):
  for out, prompt, p, lora in _mixed_batch(engine, adapter):
    _check(out, prompt, p, lora, teacher)


def test_n_samples_prefill_the_prompt_once(engine):
  """n = 4 of a 30-token prompt: the first sample computes it, the others take its 7 full pages
  from the prefix cache (the same page ids) and compute only the 2 tokens past them."""
  prompt = np.random.default_rng(1).integers(5, 1000, size=30).tolist()
  before = engine.prompt_tokens
  rid = engine.add_request(None, prompt, SamplingParams(n=4, temperature=1.0, max_tokens=6,
                                                        seed=7, logprobs=0))
  shared = None
  while engine.has_unfinished_requests():
    engine.step()
    seqs = [s for s in engine.scheduler.running if s.group_id == rid]
    if len(seqs) == 4 and shared is None:
      shared = {tuple(s.pages[0][:7]) for s in seqs}
  assert len(shared) == 1  # one set of prompt pages, held by all four
  assert engine.prompt_tokens - before == 30 + 3 * 2
  assert engine.blocks.num_free_pages == engine.blocks.num_usable_pages


def test_a_bad_logprobs_mode_is_refused(tiny_model):
  with pytest.raises(ParameterError, match="logprobs_mode must be one of raw_logprobs"):
    make_engine(tiny_model, warmup=False, logprobs_mode="processed")
