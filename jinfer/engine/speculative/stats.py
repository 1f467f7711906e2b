"""Counters of speculative decoding, and what they say about the theory.

With a per-draft acceptance probability alpha, independent of position, a step that verifies k
drafts yields E = (1 - alpha^(k+1)) / (1 - alpha) tokens on average (Leviathan et al., eq. 1).
`alpha` here is estimated the way that model defines it: accepted drafts over drafts tested, a
draft being tested when every draft before it was accepted; `tokens_per_full_step` is the
measured E over the steps that verified all k drafts, `expected_tokens_per_full_step` the
formula's at the estimated alpha.
"""
from __future__ import annotations

import dataclasses
import functools
import operator


@dataclasses.dataclass
class SpecStats:
  num_speculative_tokens: int  # k
  num_verified: int = 0  # sequence-steps that verified at least one draft
  num_draft_tokens: int = 0  # drafts verified
  num_accepted_tokens: int = 0
  num_tested: int = 0  # drafts tested: up to and including the first rejection
  drafted_per_position: list[int] = None  # [k]: times an i-th draft was verified
  accepted_per_position: list[int] = None  # [k]: times an i-th draft was accepted
  num_full: int = 0  # sequence-steps that verified all k drafts
  full_tokens: int = 0  # tokens those steps yielded (accepted + 1 each)
  proposer_seconds: float = 0.0  # proposing drafts (host lookups, or the draft model's passes)
  step_seconds: float = 0.0  # whole engine steps, the proposer's time included

  def __post_init__(self):
    k = self.num_speculative_tokens
    self.drafted_per_position = self.drafted_per_position or [0] * k
    self.accepted_per_position = self.accepted_per_position or [0] * k

  def record(self, num_drafts: int, num_accepted: int):
    if num_drafts == 0:
      return
    self.num_verified += 1
    self.num_draft_tokens += num_drafts
    self.num_accepted_tokens += num_accepted
    self.num_tested += min(num_accepted + 1, num_drafts)
    for i in range(num_drafts):
      self.drafted_per_position[i] += 1
      self.accepted_per_position[i] += i < num_accepted
    if num_drafts == self.num_speculative_tokens:
      self.num_full += 1
      self.full_tokens += num_accepted + 1

  def _zip(self, other: "SpecStats", op) -> "SpecStats":
    """`op` of the two field by field (the per-position lists entry by entry)."""
    def combine(name):
      a, b = getattr(self, name), getattr(other, name)
      return [op(x, y) for x, y in zip(a, b)] if isinstance(a, list) else op(a, b)
    return SpecStats(self.num_speculative_tokens, **{
        f.name: combine(f.name) for f in dataclasses.fields(self)
        if f.name != "num_speculative_tokens"})

  @classmethod
  def total(cls, stats: list["SpecStats"]) -> "SpecStats | None":
    """Several engines' counts as one (None if there are none)."""
    return functools.reduce(lambda a, b: a._zip(b, operator.add), stats[1:],
                            stats[0].copy()) if stats else None

  def copy(self) -> "SpecStats":
    return dataclasses.replace(self, drafted_per_position=list(self.drafted_per_position),
                               accepted_per_position=list(self.accepted_per_position))

  def since(self, earlier: "SpecStats") -> "SpecStats":
    """The counts accumulated after `earlier` (a copy taken before)."""
    return self._zip(earlier, operator.sub)

  @property
  def acceptance_rate(self) -> float:
    """Accepted drafts / verified drafts."""
    return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

  @property
  def acceptance_per_position(self) -> list[float]:
    """For each i, how often a verified i-th draft was accepted (its predecessors too)."""
    return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position,
                                                self.drafted_per_position)]

  @property
  def alpha(self) -> float:
    """Accepted drafts / drafts tested: the per-draft acceptance probability of the theory."""
    return self.num_accepted_tokens / self.num_tested if self.num_tested else 0.0

  @property
  def mean_tokens_per_verify(self) -> float:
    """Tokens a sequence gained per step that verified drafts (accepted + 1)."""
    return 1.0 + self.num_accepted_tokens / self.num_verified if self.num_verified else 0.0

  @property
  def tokens_per_full_step(self) -> float:
    return self.full_tokens / self.num_full if self.num_full else 0.0

  @property
  def expected_tokens_per_full_step(self) -> float:
    a, k = self.alpha, self.num_speculative_tokens
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

  @property
  def proposer_time_share(self) -> float:
    return self.proposer_seconds / self.step_seconds if self.step_seconds else 0.0

  def summary(self) -> dict:
    return {"num_speculative_tokens": self.num_speculative_tokens,
            "num_verified": self.num_verified, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position,
            "alpha": self.alpha, "mean_tokens_per_verify": self.mean_tokens_per_verify,
            "tokens_per_full_step": self.tokens_per_full_step,
            "expected_tokens_per_full_step": self.expected_tokens_per_full_step,
            "proposer_time_share": self.proposer_time_share}
