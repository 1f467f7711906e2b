"""Several engines behind the one-engine interface (data parallelism, disaggregated prefill and
decode): the model is loaded once, then the subclass builds its engines from it."""
from __future__ import annotations

import dataclasses
import time

from jinfer.config import ModelConfig
from jinfer.engine import compilation_cache, weight_quantization
from jinfer.engine.engine import EngineStats
from jinfer.engine.engine_config import EngineConfig, default_dtype
from jinfer.engine.speculative.stats import SpecStats
from jinfer.tokenizer import Tokenizer


class FrontEnd:
  """Subclasses define `_check(config)` (raise before anything loads: the devices do not fit)
  and `_build(model_config, params, tokenizer, config, dtype, warmup)`, which sets
  `warmup_seconds`. Pausing and sleeping are the data-parallel engine's (every rank alike);
  the others never pause or sleep."""
  is_paused = is_sleeping = False

  def __init__(self, model: str, *, dtype=None, config: EngineConfig, warmup: bool | str = True,
               skip_tokenizer_init: bool = False):
    self._check(config)
    if config.kernels.compilation_cache:
      compilation_cache.enable()
    t0 = time.monotonic()
    model_config, params, tokenizer, config = weight_quantization.load(
        config, model, dtype or default_dtype(), load_tokenizer=not skip_tokenizer_init)
    self._build(model_config, params, tokenizer, config, dtype, warmup)
    self.load_seconds = time.monotonic() - t0 - self.warmup_seconds

  @classmethod
  def from_parts(cls, model_config: ModelConfig, params: dict, tokenizer: Tokenizer | None, *,
                 config: EngineConfig, dtype=None, warmup: bool | str = True):
    self = cls.__new__(cls)
    self._build(model_config, params, tokenizer, config, dtype, warmup)
    self.load_seconds = 0.0
    return self

  def _check(self, config: EngineConfig) -> None:
    raise NotImplementedError

  def _build(self, model_config: ModelConfig, params: dict, tokenizer: Tokenizer | None,
             config: EngineConfig, dtype, warmup: bool | str) -> None:
    raise NotImplementedError


def combined_stats(per: list[EngineStats], holders: list[EngineStats] | None = None,
                   **override) -> EngineStats:
  """Several engines' stats as one: counts summed (speculation's too), ratios their mean, steps
  the busiest one's, KV bytes per sequence averaged over the running sequences of `holders`
  (default: all)."""
  holders = holders or per
  total = lambda name: sum(getattr(s, name) for s in per)
  mean = lambda name: total(name) / len(per)
  running = max(1, sum(s.num_running for s in holders))
  stats = EngineStats(
      num_running=total("num_running"), num_waiting=total("num_waiting"),
      kv_utilization=mean("kv_utilization"), kv_pages_used=mean("kv_pages_used"),
      prefix_hit_rate=mean("prefix_hit_rate"), num_preemptions=total("num_preemptions"),
      prompt_tokens=total("prompt_tokens"), generation_tokens=total("generation_tokens"),
      num_steps=max(s.num_steps for s in per), weight_bytes=total("weight_bytes"),
      kv_cache_bytes=total("kv_cache_bytes"), kv_bytes_per_token=per[0].kv_bytes_per_token,
      kv_pages_per_gib=per[0].kv_pages_per_gib, kv_group_windows=per[0].kv_group_windows,
      kv_bytes_per_seq=tuple(sum(s.kv_bytes_per_seq[g] * s.num_running for s in holders) / running
                             for g in range(len(per[0].kv_bytes_per_seq))),
      compiles_after_startup=total("compiles_after_startup"),
      buckets_compiled=min(s.buckets_compiled for s in per), buckets_total=per[0].buckets_total,
      spec=SpecStats.total([s.spec for s in per if s.spec is not None]))
  return dataclasses.replace(stats, **override)
