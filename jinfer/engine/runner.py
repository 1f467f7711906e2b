"""Owns the params and the KV cache on device, and runs the one jitted step."""
from __future__ import annotations

import functools
import time

import jax
import numpy as np

from jinfer.config import ModelConfig
from jinfer.engine.step_input import Buckets, StepInput, empty_step_input, to_step_input
from jinfer.models import CausalLM
from jinfer.models.kernel_options import KernelOptions
from jinfer.quant.int8 import param_bytes
from jinfer.sample import SampleOutput, sample
from pallas_kernels import KVCacheSpec


def _step(model: CausalLM, params, kv_caches, inp: StepInput):
  logits, kv_caches = model.apply({"params": params}, inp.token_ids, inp.positions, kv_caches,
                                  inp.md, inp.logits_indices)  # [S, V]
  return sample(logits, inp.sampling), kv_caches


class ModelRunner:

  def __init__(self, config: ModelConfig, params: dict, spec: KVCacheSpec, buckets: Buckets, *,
               kernels: KernelOptions, dtype):
    self.config, self.params, self.spec, self.buckets = config, params, spec, buckets
    self.model = CausalLM(config, kernels, dtype=dtype)
    self.kv_caches = spec.allocate()
    # The cache is donated: XLA updates it in place instead of copying it every step.
    self._step = jax.jit(functools.partial(_step, self.model), donate_argnums=(1,))

  def run(self, inp: StepInput) -> SampleOutput:
    out, self.kv_caches = self._step(self.params, self.kv_caches, inp)
    return jax.tree.map(np.asarray, out)

  def warmup(self) -> float:
    """Compile every bucket by running an all-padding step of each shape; returns seconds."""
    t0 = time.monotonic()
    for t in self.buckets.shapes():
      self.run(to_step_input(empty_step_input(self.buckets, t), self.buckets))
    return time.monotonic() - t0

  @property
  def weight_bytes(self) -> int:
    return param_bytes(self.params)

  @property
  def kv_cache_bytes(self) -> int:
    return sum(x.size * x.dtype.itemsize for x in self.kv_caches)
