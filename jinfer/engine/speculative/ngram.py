"""N-gram prompt lookup: guess that the text continues as it did after the last time its latest
tokens appeared (Saxena's prompt lookup decoding; vLLM's `ngram` method). No model, host only.

The longest suffix of `prompt_lookup_max` down to `prompt_lookup_min` tokens that occurs earlier
in the sequence (prompt and output) wins; among its occurrences the most recent, whose context
is closest to what is being written.
"""
from __future__ import annotations

import numpy as np

from jinfer.engine.scheduler import ScheduledBatch
from jinfer.engine.speculative.config import SpeculativeConfig
from jinfer.engine.speculative.proposer import Proposer, Target


def lookup(tokens: np.ndarray, lo: int, hi: int, k: int) -> np.ndarray:
  """k tokens following the latest earlier occurrence of the longest matching suffix (none if no
  suffix of at least `lo` tokens recurs)."""
  last = len(tokens) - 1
  ends = np.nonzero(tokens[:last] == tokens[last])[0]  # [C] where a match of length 1 ends
  if len(ends) == 0:
    return tokens[:0]
  length = np.ones(len(ends), np.int64)
  for d in range(1, min(hi, last + 1)):  # extend matches backwards one token at a time
    at = ends - d
    grow = (length == d) & (at >= 0)
    grow[grow] = tokens[at[grow]] == tokens[last - d]
    length += grow
  best = length.max()
  if best < lo:
    return tokens[:0]
  end = ends[length == best][-1]
  # What followed the match runs into the present: past that, the guess copies itself (a
  # repeating pattern goes on repeating), as LZ77's overlapping copies do.
  return np.resize(tokens[end + 1:], k)


class NgramProposer(Proposer):

  def __init__(self, k: int, prompt_lookup_min: int, prompt_lookup_max: int):
    super().__init__(k)
    self.lo, self.hi = prompt_lookup_min, prompt_lookup_max

  @classmethod
  def create(cls, spec: SpeculativeConfig, target: Target) -> "NgramProposer":
    return cls(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

  def fill(self, batch: ScheduledBatch) -> None:
    for i, (seq, m) in enumerate(zip(batch.seqs, batch.num_drafts)):
      if m == 0:
        continue
      found = lookup(np.asarray(seq.token_ids, np.int32), self.lo, self.hi, m).tolist()
      batch.draft_tokens[i] = found
      batch.num_new_tokens[i] -= m - len(found)
      batch.num_drafts[i] = len(found)
