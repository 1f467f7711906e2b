"""Medusa: the target's own step proposes its next step's candidates.

Every step that ends with a new token for a sequence also runs the Medusa heads on the final
hidden state that chose it (the plain step's logits row, or the verify step's stop node) and
returns each head's top candidates with the tokens. The next step fills the sequence's verify
rows with the candidate tree built from them (`fill`, on the host, like n-gram lookup) and
verifies it with `jinfer.sampling.accept.accept`; the accepted path's K/V moves to the slots of
its depths in the same jit (`jinfer.engine.runner.keep_path`). So Medusa costs no pass of its
own: the heads' few rows and a wider verify step.
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.sampling.accept import Typical
from jinfer.config import ModelConfig
from jinfer.engine.request import Sequence
from jinfer.engine.scheduler import ScheduledBatch
from jinfer.models import lm_head
from jinfer.models.kernel_options import KernelOptions
from jinfer.quant.qarray import QArray, param_bytes
from jinfer.engine.speculative import medusa_heads
from jinfer.engine.speculative.config import SpeculativeConfig
from jinfer.engine.speculative.proposer import Proposer, SpecState, Target
from jinfer.sampling.tree import Tree

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class MedusaStep:
  """What the target's jitted step does for Medusa (static: the tree and the acceptance rule)."""
  tree: Tree
  typical: Typical | None
  config: ModelConfig
  kernels: KernelOptions

  def propose(self, heads: dict, params: dict, h: jax.Array) -> jax.Array:
    """Final hidden states h [N, E] -> candidates [N, H, topk] for the tokens after them."""
    return medusa_heads.top_candidates(
        heads, h, self.tree.topk, lambda x: lm_head(params, self.config, self.kernels, x))


@dataclasses.dataclass
class MedusaState(SpecState):
  # The heads' candidates [H, topk] for the token after the first `candidates_at` tokens
  # (stale once the sequence has more or fewer).
  candidates: np.ndarray | None = None
  candidates_at: int = -1


class MedusaProposer(Proposer):
  """Host side: turns the candidates a sequence's last step proposed into its tree's tokens."""

  def __init__(self, tree: Tree, heads: dict, step: MedusaStep):
    super().__init__(tree.num_nodes)
    self.tree, self.heads = tree, heads
    self.in_step, self.in_step_weights = step, heads

  @classmethod
  def create(cls, spec: SpeculativeConfig, target: Target) -> "MedusaProposer":
    # The heads meet the target's step as it runs: its (quantized) params, its kernels.
    dtype, target_params, kernels = target.dtype, target.run_params, target.kernels
    target = target.run_config
    heads, meta = medusa_heads.load_heads(spec.model, target, dtype)
    n = spec.num_speculative_tokens
    if medusa_heads.num_heads(heads) < n:
      raise ValueError(f"speculative_config: num_speculative_tokens is {n}; {spec.model} has "
                       f"{medusa_heads.num_heads(heads)} heads")
    heads = {k: v if k == "vocab" else v[:n] for k, v in heads.items()}
    if "vocab" in heads and "lm_head" not in heads:
      if not target.tie_word_embeddings:
        raise ValueError(f"{spec.model}: heads restricted to a vocabulary share a tied "
                         f"embedding; this model has a separate LM head")
      embed = target_params["embedding"]
      if isinstance(embed, QArray):  # a quantized target's rows, dequantized once
        rows = embed.values[heads["vocab"]].astype(dtype) * embed.scale[heads["vocab"]][:, None]
      else:
        rows = embed[heads["vocab"]]
      heads = {**heads, "rows": jnp.asarray(rows, dtype)}
    # From host copies: uncommitted, like the cache they meet in the step (an input committed to
    # a device commits the step's outputs, and a cache whose commitment changes recompiles).
    heads = {k: jnp.asarray(np.asarray(v)) for k, v in heads.items()}
    tree = spec.tree()
    typical = (Typical(spec.posterior_threshold, spec.posterior_alpha)
               if spec.acceptance_method == "typical_acceptance_sampler" else None)
    log.info("Medusa: %d heads from %s, a tree of %d nodes, depth %d", n, spec.model,
             tree.num_nodes, tree.max_depth)
    return cls(tree, heads, MedusaStep(tree, typical, target, kernels))

  @property
  def max_depth(self) -> int:
    return self.tree.max_depth

  def new_state(self) -> MedusaState:
    return MedusaState()

  def lookahead(self, seq: Sequence, depth: int) -> int:
    st = seq.spec_state
    if st.candidates is None or st.candidates_at != seq.num_tokens:
      return 0  # nothing proposed for this position (yet)
    return self.tree.nodes_within(depth)

  def depth(self, num_drafts: int) -> int:
    return self.tree.depth_of(num_drafts)

  def fill(self, batch: ScheduledBatch) -> None:
    t = self.tree
    for i, (seq, m) in enumerate(zip(batch.seqs, batch.num_drafts)):
      if m:  # the first m nodes; node n is head (depth - 1)'s choice-th candidate
        cands = seq.spec_state.candidates
        batch.draft_tokens[i] = cands[t.depth[1:m + 1] - 1, t.choice[1:m + 1]].tolist()

  def on_verified(self, seq: Sequence, num_drafts: int, num_accepted: int,
                  proposals: np.ndarray | None = None) -> None:
    st = seq.spec_state
    st.candidates, st.candidates_at = proposals, seq.num_tokens + num_accepted + 1

  @property
  def weight_bytes(self) -> int:
    return param_bytes({k: v for k, v in self.heads.items() if k != "vocab"})
