"""The proposer interface: who guesses the draft tokens a verify step checks.

The scheduler gives each decoding sequence up to k verify rows (`ScheduledBatch.num_drafts`,
see `Engine._lookahead`); a proposer then fills them:
  * on the host, before the step input is built (`fill`): n-gram lookup writes its tokens into
    the batch, and gives back rows it has no guess for;
  * on the device, between building the step input and running the target (`propose`): a draft
    model runs its own jitted loop and hands the target its tokens [S, K] as a device array, so
    the host never waits for them.
After the step the engine reports each sequence's outcome (`on_verified`).
"""
from __future__ import annotations

import abc

import jax
import numpy as np

from jinfer.engine.request import Sequence
from jinfer.engine.scheduler import ScheduledBatch
from jinfer.engine.step_input import StepInput


class Proposer(abc.ABC):
  """Proposes up to `k` tokens per speculating sequence and step."""

  def __init__(self, k: int):
    self.k = k

  def fill(self, batch: ScheduledBatch) -> None:
    """Host-side proposals: set `batch.draft_tokens[i]` for each sequence with drafts, trimming
    `num_drafts` (and its rows) where fewer are found. Device proposers leave them empty."""

  def propose(self, batch: ScheduledBatch, inp: StepInput) -> jax.Array | None:
    """Device-side proposals for the batch (None: host proposals, or none speculates)."""
    return None

  def lookahead(self, seq: Sequence, depth: int) -> int:
    """Verify rows `seq` may add to a step in which it can gain at most `depth` drafts."""
    return depth

  def depth(self, num_drafts: int) -> int:
    """The most drafts a sequence verifying `num_drafts` rows can gain (a tree's depth)."""
    return num_drafts

  def on_verified(self, seq: Sequence, num_drafts: int, num_accepted: int,
                  proposals: np.ndarray | None = None) -> None:
    """`seq` gained `num_accepted` of its `num_drafts` drafts (and one more token); `proposals`:
    what the step proposed for its next step, if the target's step proposes (Medusa)."""

  @property
  def cache_resets(self) -> int:
    """Times a failed step consumed the proposer's own KV cache (then rebuilt empty)."""
    return 0

  def warmup(self, shapes: list[int]) -> None:
    """Compile whatever the proposer runs on device, for every token bucket in `shapes`."""

  def empty_drafts(self, num_seqs: int) -> jax.Array | None:
    """Stand-in device drafts of the right shapes, to compile the verify step with."""
    return None

  @property
  def weight_bytes(self) -> int:
    return 0
