"""`speculative_config`: what proposes draft tokens and how many, as vLLM spells it."""
from __future__ import annotations

import dataclasses
import json
import numbers
import os
from typing import Any

from jinfer.weights.builtin import is_builtin

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
  method: str  # "ngram" (prompt lookup, no model) or "draft_model"
  num_speculative_tokens: int  # k: drafts verified per sequence and step
  model: str | None = None  # draft_model: a draft checkpoint, HF directory, .gguf or built-in
  # ngram: the longest and shortest suffix of the sequence looked up in its earlier tokens.
  prompt_lookup_max: int | None = None
  prompt_lookup_min: int | None = None
  # Speculate only in steps whose running batch has at most this many sequences (None: always).
  # Verifying k+1 rows per sequence pays where a step's cost hardly grows with its rows (one
  # sequence, a memory-bound accelerator); on a compute-bound one a large batch loses.
  disable_by_batch_size: int | None = None

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, "
                       f"got {self.method!r}")
    _int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
    if self.method == "ngram":
      if self.model is not None:
        raise ValueError("speculative_config: model is for method 'draft_model', not 'ngram'")
      lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
      # As in vLLM: one bound given sets both.
      lo, hi = (lo if lo is not None else hi), (hi if hi is not None else lo)
      lo, hi = (2, 4) if lo is None else (lo, hi)
      _int("prompt_lookup_min", lo, 1)
      _int("prompt_lookup_max", hi, 1)
      if lo > hi:
        raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) exceeds "
                         f"prompt_lookup_max ({hi})")
      object.__setattr__(self, "prompt_lookup_min", lo)
      object.__setattr__(self, "prompt_lookup_max", hi)
    else:
      if not isinstance(self.model, str) or not self.model:
        raise ValueError("speculative_config: method 'draft_model' needs model, the draft's "
                         "path or built-in name")
      if not (is_builtin(self.model) or os.path.isdir(self.model)
              or (os.path.isfile(self.model) and self.model.endswith(".gguf"))):
        raise ValueError(f"speculative_config: model {self.model!r} is not a built-in name, a "
                         f"directory (a draft checkpoint or HF model) or a .gguf file")
      for name in ("prompt_lookup_min", "prompt_lookup_max"):
        if getattr(self, name) is not None:
          raise ValueError(f"speculative_config: {name} is for method 'ngram'")
    if self.disable_by_batch_size is not None:
      _int("disable_by_batch_size", self.disable_by_batch_size, 1)

  @classmethod
  def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str") -> "SpeculativeConfig":
    """From a config, a dict, or JSON text (the CLI's --speculative-config)."""
    if isinstance(value, cls):
      return value
    if isinstance(value, str):
      try:
        value = json.loads(value)
      except json.JSONDecodeError as e:
        raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
      raise ValueError(f"speculative_config must be a dict (JSON object), got "
                       f"{type(value).__name__}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - fields)
    if unknown:
      raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; known keys: "
                       f"{', '.join(sorted(fields))}")
    for name in ("method", "num_speculative_tokens"):
      if name not in value:
        raise ValueError(f"speculative_config needs {name!r}")
    return cls(**value)

  def to_dict(self) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def _int(name: str, v, lo: int, hi: int | None = None) -> None:
  if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo or (hi and v > hi):
    bound = f"in [{lo}, {hi}]" if hi else f">= {lo}"
    raise ValueError(f"speculative_config: {name} must be an integer {bound}, got {v!r}")
