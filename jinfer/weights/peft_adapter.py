"""Placeholder until the PEFT adapter format lands (interface only)."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
  path: str
  rank: int
  target_modules: tuple[str, ...]
  weights: dict

  def num_bytes(self) -> int:
    return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_peft_adapter(path, config, *, max_rank=None):
  raise NotImplementedError(path)
