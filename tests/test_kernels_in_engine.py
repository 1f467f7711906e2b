"""The Pallas kernels and int8 weights inside the engine, on the real SmolLM2 model."""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from pydoc_data.topics import topics

from jinfer import LLM, SamplingParams
from jinfer.models import CausalLM, linear_kernels
from jinfer.models.kernel_options import KernelOptions
from jinfer.quant.qarray import quantize_params
from tests.paged_batch import PagedBatch

PROMPTS = ["The capital of France is", "def fib(n):"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


# Every step scanned: an unrolled bucket compiles every layer, and the kernels are what differs.
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=32, warmup=False, scan_layers=True)


@functools.cache  # the default backend's tokens are the reference of both backends' tests
def _greedy(**options) -> list[list[int]]:
  llm = LLM(max_model_len=128, **ENGINE, **options)
  return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_pallas_attention_interpreted_matches_reference(backend):
  assert _greedy(attention_backend=backend, interpret=True) == _greedy()


def _perplexity(model, params, ids: list[int]) -> float:
  batch = PagedBatch(model, params, 1, 16, len(ids))
  logits = batch.step([ids], all_rows=True)[:-1]  # [T-1, V]: row t predicts token t+1
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  nll = lse - logits[np.arange(len(ids) - 1), ids[1:]]
  return math.exp(float(nll.mean()))


@pytest.mark.slow
def test_int8_perplexity_within_two_percent():
  llm = LLM(max_model_len=600, **ENGINE)
  eng = llm.engine
  # A fixed English text that ships with every CPython.
  ids = llm.tokenizer.encode(topics["assignment"])[:512]
  base = _perplexity(eng.runner.model.clone(kv_groups=None), eng.runner.params, ids)
  ppl = {}
  for mode in ("int8", "w8a8"):
    model = CausalLM(eng.model_config, KernelOptions(quantization=mode))
    ppl[mode] = _perplexity(model, quantize_params(eng.runner.params,
                                                   linear_kernels(eng.model_config)), ids)
  print(f"perplexity f32 {base:.3f} int8 {ppl['int8']:.3f} w8a8 {ppl['w8a8']:.3f}")
  assert abs(ppl["int8"] / base - 1) < 0.02
  assert abs(ppl["w8a8"] / base - 1) < 0.05
  out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                 SamplingParams(temperature=0.0, max_tokens=16))
  quant = LLM(max_model_len=128, **ENGINE, quantization="int8")
  assert quant.engine.stats().weight_bytes < 0.5 * eng.stats().weight_bytes
  qout = quant.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0.0, max_tokens=16))
  assert "Paris" in out[0].outputs[0].text and "Paris" in qout[0].outputs[0].text
