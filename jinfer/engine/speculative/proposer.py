"""The proposer interface: who guesses the draft tokens a verify step checks.

The scheduler gives each decoding sequence up to k verify rows (`ScheduledBatch.num_drafts`,
see `Engine._lookahead`); a proposer then fills them:
  * on the host, before the step input is built (`fill`): n-gram lookup writes its tokens into
    the batch, and gives back rows it has no guess for; Medusa writes its tree's candidates;
  * on the device, between building the step input and running the target (`propose`): a draft
    model runs its own jitted loop and hands the target its tokens [S, K] as a device array, so
    the host never waits for them;
  * inside the target's own step (`in_step`): Medusa's heads read the target's final hidden
    states and propose the next step's candidates, and the step verifies a tree.
After the step the engine reports each sequence's outcome (`on_verified`).

A proposer is made by `create(spec, target)` and registered by its method's name in
`jinfer.engine.speculative.registry`; the engine knows nothing else about it.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Protocol

import jax
import numpy as np

from jinfer.config import ModelConfig
from jinfer.engine.engine_config import ResolvedConfig
from jinfer.engine.request import Sequence
from jinfer.engine.scheduler import ScheduledBatch
from jinfer.engine.speculative.config import SpeculativeConfig
from jinfer.engine.step_input import Buckets, StepInput
from jinfer.models.kernel_options import KernelOptions
from jinfer.sampling.accept import Typical
from jinfer.sampling.tree import Tree
from jinfer.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
  """The target model a proposer is built for: as loaded (`config`, `params`), and as its step
  runs (`run_config` with KV heads duplicated for tensor parallelism, `run_params` quantized,
  the `kernels` it calls)."""
  config: ModelConfig
  params: dict
  run_config: ModelConfig
  run_params: dict
  kernels: KernelOptions
  tokenizer: Tokenizer | None
  engine_config: ResolvedConfig
  buckets: Buckets
  dtype: Any


@dataclasses.dataclass
class SpecState:
  """A sequence's speculation state; a proposer with state of its own subclasses it."""
  # The pause (`pause.py`): the moving average of drafts accepted per verify step, and the
  # length below which the sequence does not speculate.
  accepted_avg: float | None = None
  paused_until: int = 0


class InStep(Protocol):
  """What runs inside the target's jitted step (static: hashed into the compiled step)."""
  tree: Tree  # the verify rows' tree
  typical: Typical | None  # a non-lossless acceptance rule, or None for the exact one

  def propose(self, weights: dict, params: dict, h: jax.Array) -> jax.Array:
    """The target's final hidden states h [N, E] -> proposals [N, ...] for the next step."""


class Proposer(abc.ABC):
  """Proposes up to `k` tokens per speculating sequence and step."""
  # Set by proposers whose proposals come from the target's step, with the arrays it reads.
  in_step: InStep | None = None
  in_step_weights: dict | None = None
  # Whether the drafts are on the host when the step input is built (`fill`): only then can a
  # sequence under a structured-output constraint speculate, each verify row masked for its own
  # draft prefix. A device proposer's drafts would have to be waited for.
  host_drafts: bool = True

  def __init__(self, k: int):
    self.k = k

  @classmethod
  @abc.abstractmethod
  def create(cls, spec: SpeculativeConfig, target: Target) -> "Proposer":
    """The proposer `spec` asks for, built for `target` (loads its checkpoints)."""

  def new_state(self) -> SpecState:
    """A new sequence's state (`Sequence.spec_state`)."""
    return SpecState()

  @property
  def max_depth(self) -> int:
    """The most drafts one step can accept (a tree's depth)."""
    return self.k

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

  def compile(self, t: int, verify: bool) -> None:
    """Compile what the proposer runs on device beside a step of token bucket `t`, a verify step
    or (`verify=False`) a plain one, ahead of time (without running it: this may run on another
    thread while steps run)."""

  def empty_drafts(self, num_seqs: int) -> jax.Array | None:
    """Stand-in device drafts of the right shapes, to compile the verify step with."""
    return None

  @property
  def weight_bytes(self) -> int:
    return 0
