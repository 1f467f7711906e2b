"""Owns the params and the KV cache on device, and runs the one jitted step."""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jinfer.config import ModelConfig
from jinfer.engine.step_input import Buckets, StepInput, empty_step_input, to_step_input
from jinfer.models import CausalLM
from jinfer.models.kernel_options import KernelOptions
from jinfer.quant.int8 import param_bytes
from jinfer.sample import SampleOutput, sample
from jinfer.sampling_params import MAX_LOGPROBS
from pallas_kernels import KVCacheSpec


@struct.dataclass
class PromptLogprobs:
  target: jax.Array  # [T] float32: logprob of the token each row predicts
  top_ids: jax.Array  # [T, MAX_LOGPROBS] int32
  top_logprobs: jax.Array  # [T, MAX_LOGPROBS] float32


def _step(model: CausalLM, params, kv_caches, inp: StepInput):
  if not inp.prompt_logprobs:
    logits, kv_caches = model.apply({"params": params}, inp.token_ids, inp.positions, kv_caches,
                                    inp.md, inp.logits_indices)  # [S, V]
    return sample(logits, inp.sampling), None, kv_caches
  rows, kv_caches = model.apply({"params": params}, inp.token_ids, inp.positions, kv_caches,
                                inp.md)  # [T, V]
  lp = jax.nn.log_softmax(rows, axis=-1)
  top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
  target = jnp.take_along_axis(lp, inp.target_ids[:, None], axis=-1)[:, 0]
  return (sample(rows[inp.logits_indices], inp.sampling),
          PromptLogprobs(target=target, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_lp),
          kv_caches)


class ModelRunner:

  def __init__(self, config: ModelConfig, params: dict, spec: KVCacheSpec, buckets: Buckets, *,
               kernels: KernelOptions, dtype):
    self.config, self.params, self.spec, self.buckets = config, params, spec, buckets
    self.model = CausalLM(config, kernels, dtype=dtype)
    self.kv_caches = spec.allocate()
    self.cache_resets = 0  # times a failed step consumed the cache and it was rebuilt empty
    # The cache is donated: XLA updates it in place instead of copying it every step.
    self._step = jax.jit(functools.partial(_step, self.model), donate_argnums=(1,))

  def run(self, inp: StepInput) -> tuple[SampleOutput, PromptLogprobs | None]:
    try:
      out, prompt_lp, self.kv_caches = self._step(self.params, self.kv_caches, inp)
    except Exception:
      # The cache was donated to the failed call: if XLA consumed it, start from an empty one
      # (the caller must then treat every cached token as gone).
      if any(c.is_deleted() for c in self.kv_caches):
        self.kv_caches = self.spec.allocate()
        self.cache_resets += 1
      raise
    return jax.tree.map(np.asarray, (out, prompt_lp))

  def warmup(self, with_prompt_logprobs: bool = False) -> float:
    """Compile every bucket by running an all-padding step of each shape; returns seconds."""
    t0 = time.monotonic()
    for t, prompt_lp in self.buckets.shapes(with_prompt_logprobs):
      self.run(to_step_input(empty_step_input(self.buckets, t, prompt_lp), self.buckets))
    return time.monotonic() - t0

  @property
  def weight_bytes(self) -> int:
    return param_bytes(self.params)

  @property
  def kv_cache_bytes(self) -> int:
    return sum(x.size * x.dtype.itemsize for x in self.kv_caches)
