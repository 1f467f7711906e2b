"""Expert load of an MoE model: how many tokens each expert of each MoE layer was routed."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class ExpertLoad:
  """Token-to-expert assignments per MoE layer (a token routed to k experts counts once at
  each), summed over the engine's steps; padding rows never count."""
  layers: list[int]  # the model layer of each row
  tokens_per_expert: list[list[int]]  # [MoE layer][expert]

  @classmethod
  def of(cls, layers: tuple[int, ...], counts: np.ndarray) -> "ExpertLoad":
    return cls(list(layers), counts.astype(int).tolist())

  @property
  def imbalance(self) -> list[float]:
    """Per layer, the busiest expert's tokens over the mean (1.0: perfectly balanced; 0.0: no
    tokens yet)."""
    return [max(row) / (sum(row) / len(row)) if sum(row) else 0.0
            for row in self.tokens_per_expert]

  def since(self, before: "ExpertLoad") -> "ExpertLoad":
    """The load accumulated after `before` was taken."""
    return ExpertLoad.of(tuple(self.layers), np.asarray(self.tokens_per_expert)
                         - np.asarray(before.tokens_per_expert))

  def as_dict(self) -> dict:
    return {"layers": self.layers, "tokens_per_expert": self.tokens_per_expert,
            "max_over_mean": self.imbalance}
