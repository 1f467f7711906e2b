"""Several engines behind the one-engine interface (data parallelism, disaggregated prefill and
decode): the model is loaded once, then the subclass builds its engines from it."""
from __future__ import annotations

import time

from jinfer.config import ModelConfig
from jinfer.engine import compilation_cache, weight_quantization
from jinfer.engine.engine_config import EngineConfig, default_dtype
from jinfer.tokenizer import Tokenizer


class FrontEnd:
  """Subclasses define `_check(config)` (raise before anything loads: the devices do not fit)
  and `_build(model_config, params, tokenizer, config, dtype, warmup)`, which sets
  `warmup_seconds`."""

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
