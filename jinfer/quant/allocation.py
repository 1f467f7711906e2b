"""Mixed precision's allocator: from each unit's measured loss increase and bytes at every
precision, the precisions that meet a budget of bytes.

A unit is what takes one precision (a decoder layer's linears, or one linear across the layers;
see `jinfer/quant/mixed.py`). Precisions are indexed as `mixed.PRECISIONS`: 0 float, 1 int8,
2 int4. The allocation minimizes the predicted loss, the sum of the units' losses, over every
assignment whose bytes fit: a multiple-choice knapsack, solved exactly by dynamic programming
over bytes counted in `STEPS` quanta of the largest possible upgrade (each unit's extra bytes
over int4 rounded up, so the result always fits). A larger budget only adds assignments to choose
from, so the predicted loss never grows with it. (A greedy walk by loss saved per byte stops at
the first upgrade that does not fit, or, skipping it, loses that guarantee.)

The prediction adds the units' losses, each measured with that unit quantized alone: it ignores
how errors of different layers interact, which is why `mixed.py` measures the final allocation.
"""
from __future__ import annotations

import math

import numpy as np

FLOAT, INT8, INT4 = 0, 1, 2
STEPS = 4096


def monotone(loss: np.ndarray) -> np.ndarray:
  """loss [U, 3] made to grow with fewer bits: float 0 <= int8 <= int4. A measured increase can
  come out below zero, or int8 above int4, by the noise of a short text; neither is real."""
  out = np.zeros_like(loss, dtype=np.float64)
  out[:, INT8] = np.maximum(loss[:, INT8], 0.0)
  out[:, INT4] = np.maximum(loss[:, INT4], out[:, INT8])
  return out


def predicted(loss: np.ndarray, choice: np.ndarray) -> float:
  """The predicted loss increase of `choice` [U]: the sum of its units' (monotone) losses."""
  return float(monotone(loss)[np.arange(len(choice)), choice].sum())


def cost(choice: np.ndarray, nbytes: np.ndarray) -> int:
  return int(nbytes[np.arange(len(choice)), choice].sum())


def within_bytes(loss: np.ndarray, nbytes: np.ndarray, budget: float) -> np.ndarray:
  """The precisions [U] of least predicted loss whose bytes fit `budget` (loss, nbytes: [U, 3];
  at least every unit's int4 bytes: the caller checks that the budget holds them). Of equal
  predicted losses the more bytes: a unit measured insensitive is so within the noise of the
  measurement, and more bits are never worse in fact."""
  loss = monotone(loss)
  extra = nbytes - nbytes[:, INT4:INT4 + 1]  # [U, 3] over int4
  quantum = max(extra.max(1).sum() / STEPS, 1.0)
  steps = np.ceil(extra / quantum).astype(np.int64)
  room = budget - nbytes[:, INT4].sum()
  if room < 0:
    raise ValueError(f"a budget of {budget} bytes does not hold every unit at int4")
  cap = min(int(math.floor(room / quantum)), int(steps.max(1).sum()))
  best = np.zeros(cap + 1)  # least loss of the units so far within c quanta
  picks = np.zeros((len(loss), cap + 1), np.int8)
  for u in range(len(loss)):
    new = np.full(cap + 1, np.inf)
    for p in (FLOAT, INT8, INT4):  # most bits first: a tie spends the budget on them
      k = steps[u, p]
      if k > cap:
        continue
      cand = np.full(cap + 1, np.inf)
      cand[k:] = best[:cap + 1 - k] + loss[u, p]
      better = cand < new
      new[better], picks[u, better] = cand[better], p
    best = new
  choice, c = np.zeros(len(loss), np.int32), cap
  for u in reversed(range(len(loss))):
    choice[u] = picks[u, c]
    c -= steps[u, choice[u]]
  return choice
