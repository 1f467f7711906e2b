"""The K tile both Pallas kernels use: whole groups, padding K as little as the tile rules allow."""
from __future__ import annotations

from pallas_kernels.int8_matmul.padding import round_up


def k_tile(k: int, block_k: int, candidates: list[int]) -> int:
  """The tile from `candidates` (each a multiple of the group size) that pads K least, the
  largest of those; a tile over `block_k` only when no candidate is within it.

  Weights are padded per call on the device, so the padding saved (K=576 with tiles of 512 pads
  to 1024, with 256 to 768) is weight traffic saved."""
  fit = [c for c in candidates if c <= block_k] or [min(candidates)]
  return min(fit, key=lambda c: (round_up(k, c), -c))
