"""Owns the params and the KV cache on device, and runs the one jitted step."""
from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jinfer.config import ModelConfig
from jinfer.engine import compilation_cache
from jinfer.engine.step_input import Buckets, StepInput, empty_step_input, to_step_input
from jinfer.models import CausalLM, unstack_layers
from jinfer.models.kernel_options import KernelOptions
from jinfer.quant.qarray import param_bytes
from jinfer.sample import SampleOutput, sample
from jinfer.sampling_params import MAX_LOGPROBS
from pallas_kernels import KVCacheSpec

log = logging.getLogger(__name__)


@struct.dataclass
class PromptLogprobs:
  target: jax.Array  # [T] float32: logprob of the token each row predicts
  top_ids: jax.Array  # [T, MAX_LOGPROBS] int32
  top_logprobs: jax.Array  # [T, MAX_LOGPROBS] float32


@struct.dataclass
class StepOutput:
  sample: SampleOutput  # one token per sequence
  hidden: jax.Array | None  # [S, E]: final hidden states of the sampled rows, when asked for
  prompt_logprobs: PromptLogprobs | None  # when the step carries prompt_logprobs requests


def _step(model: CausalLM, return_hidden: bool, params, kv_cache, inp: StepInput) -> tuple:
  apply = functools.partial(model.apply, {"params": params}, inp.token_ids, inp.positions,
                            kv_cache, inp.md, return_hidden=return_hidden)
  if not inp.prompt_logprobs:
    logits, hidden, kv_cache = apply(inp.logits_indices)  # [S, V]
    return StepOutput(sample(logits, inp.sampling), hidden, None), kv_cache
  rows, hidden, kv_cache = apply()  # [T, V]
  lp = jax.nn.log_softmax(rows, axis=-1)
  top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
  target = jnp.take_along_axis(lp, inp.target_ids[:, None], axis=-1)[:, 0]
  return StepOutput(
      sample(rows[inp.logits_indices], inp.sampling),
      None if hidden is None else hidden[inp.logits_indices],
      PromptLogprobs(target=target, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_lp),
  ), kv_cache


class ModelRunner:
  """`params` in the stacked layout. Steps of at most `unrolled_max_tokens` tokens run the
  unrolled stack over per-layer arrays (views of the stacked ones on the CPU, see
  `unstack_layers`), larger steps the scanned stack: `model`, `params` and `_step` are the
  scanned ones when any step runs scanned, `_small` the unrolled (step, params) beside them."""

  def __init__(self, config: ModelConfig, params: dict, spec: KVCacheSpec, buckets: Buckets, *,
               kernels: KernelOptions, dtype, unrolled_max_tokens: int,
               return_hidden: bool = False):
    self.config, self.spec, self.buckets = config, spec, buckets
    self.unrolled_max_tokens = unrolled_max_tokens
    # The cache is donated: XLA updates it in place instead of copying it every step.
    jit = lambda model: jax.jit(functools.partial(_step, model, return_hidden),
                                donate_argnums=(1,))
    scanned = buckets.token_buckets[-1] > unrolled_max_tokens
    self.model = CausalLM(config, kernels, dtype=dtype, scan_layers=scanned)
    self.params = params if scanned else unstack_layers(params, config.num_layers)
    self._step = jit(self.model)
    self._small = None
    if scanned and buckets.token_buckets[0] <= unrolled_max_tokens:
      small = CausalLM(config, kernels, dtype=dtype, scan_layers=False)
      self._small = (jit(small), unstack_layers(params, config.num_layers), small)
    self.kv_cache = spec.allocate()
    self.cache_resets = 0  # times a failed step consumed the cache and it was rebuilt empty
    self._shapes_run: set[tuple[int, bool]] = set()

  def run(self, inp: StepInput) -> StepOutput:
    shape = (inp.token_ids.shape[0], inp.prompt_logprobs)
    if shape in self._shapes_run:
      return self._run(inp)
    # A shape's first run compiles it (or loads it from the persistent cache): say so, since it
    # takes seconds.
    log.info("compiling the %d-token step%s (kept in the compilation cache) ...", shape[0],
             " with prompt logprobs" if shape[1] else "")
    t0, hits = time.monotonic(), compilation_cache.cache_hits()
    out = self._run(inp)
    self._shapes_run.add(shape)
    log.info("%d-token step %s in %.1f s", shape[0], "compiled" if hits ==
             compilation_cache.cache_hits() else "loaded from the compilation cache",
             time.monotonic() - t0)
    return out

  def variant(self, num_tokens: int) -> tuple[CausalLM, dict]:
    """The model and params a step of `num_tokens` (a bucket) runs."""
    if self._small is not None and num_tokens <= self.unrolled_max_tokens:
      return self._small[2], self._small[1]
    return self.model, self.params

  def _run(self, inp: StepInput) -> StepOutput:
    try:
      if self._small is not None and inp.token_ids.shape[0] <= self.unrolled_max_tokens:
        out, self.kv_cache = self._small[0](self._small[1], self.kv_cache, inp)
      else:
        out, self.kv_cache = self._step(self.params, self.kv_cache, inp)
    except Exception:
      # The cache was donated to the failed call: if XLA consumed it, start from an empty one
      # (the caller must then treat every cached token as gone).
      if self.kv_cache.is_deleted():
        self.kv_cache = self.spec.allocate()
        self.cache_resets += 1
      raise
    return jax.tree.map(np.asarray, out)

  def warmup(self, with_prompt_logprobs: bool = False) -> float:
    """Compile every bucket by running an all-padding step of each shape; returns seconds."""
    t0 = time.monotonic()
    for t, prompt_lp in self.buckets.shapes(with_prompt_logprobs):
      self.run(to_step_input(empty_step_input(self.buckets, t, prompt_lp), self.buckets))
    return time.monotonic() - t0

  @property
  def weight_bytes(self) -> int:
    # On the CPU the unrolled layers are views of `params`: one copy of the weights.
    return param_bytes(self.params)

  @property
  def kv_cache_bytes(self) -> int:
    return self.kv_cache.nbytes
