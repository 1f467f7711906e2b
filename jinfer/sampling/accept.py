"""Device-side verification of speculative tokens: which drafts the target accepts, and the token
that follows them, in the same jit as the target's forward pass.

A speculating sequence's verify rows are its last committed token and its drafts (a chain
`[last, d1..dm]`, m <= K, or the first m nodes of a candidate tree after the root); a row holds
the target's logits for the token after it. One rule serves every proposer: at each row the
target picks its own token exactly as `sample` would at that position (the request's
processing, with the row's drafts before it counted as output and its structured-output mask
the one after them; then the argmax, or a draw with the request's key for the token's
position), and the walk moves to the child holding that token, stopping at a row with none and
emitting the target's pick there.

So every emitted token is the token decoding without speculation emits: a seeded request draws
the same tokens whatever its drafts, whatever the batch and however many drafts the scheduler
left it (its token budget, `disable_by_batch_size` and paused speculation change only how many
tokens a step yields). For proposals that are deterministic given the history (n-gram lookup,
Medusa's candidates) this is SpecInfer's multi-candidate rule and accepts a draft as often as
rejection sampling does, p(d); a draft model samples its proposals with the same random number
the target draws with (`jinfer/engine/speculative/draft_model.py`), which couples its guess to
the target's draw.

Rows are addressed through `chain` (each sequence's i-th verify row); a chain is the tree whose
nodes each have the previous one as parent (`Tree.chain`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jinfer.sampling.sample import (SampleOutput, SamplingTensors, any_penalty, ban, choose,
                                    constrain, penalize, reported, top_logprobs)
from jinfer.sampling.tree import Tree


@struct.dataclass
class VerifyTensors:
  """How a verify step's logits rows map to its sequences' chains. R = logits rows."""
  draft_tokens: jax.Array  # [S, K] int32: d_1..d_K (past num_drafts: unused)
  num_drafts: jax.Array  # [S] int32: m, 0 for sequences that do not speculate this step
  row_seq: jax.Array  # [R] int32: the sequence of each logits row
  row_depth: jax.Array  # [R] int32: its index i in that sequence's chain
  chain: jax.Array  # [S, K+1] int32: the logits row of each chain index (past m: any row)
  ban_rows: jax.Array  # [S] int32: banned tokens (min_tokens) apply at chain indices < this
  # [R, W] int32: each logits row's structured-output mask, the one after its own draft prefix
  # (all ones: no constraint). A verify step's masks are per row, not per sequence: its
  # sampling tensors carry none. None only where a test builds the tensors.
  allowed: jax.Array | None = None


@struct.dataclass
class VerifyOutput:
  sample: SampleOutput  # every field [S, K+1, ...]: d_1..d_a, then the target's token
  num_accepted: jax.Array  # [S] int32: a; the sequence gains a + 1 tokens
  stop_row: jax.Array  # [S] int32: the logits row that chose the target's token
  path: jax.Array  # [S, D+1] int32: the accepted nodes by depth (a chain's: 0, 1, ..)


def row_tensors(st: SamplingTensors, vt: VerifyTensors, with_history: bool,
                tree: Tree | None = None) -> SamplingTensors:
  """Per logits row, its sequence's sampling tensors as of the row's position: after the drafts
  before it (its chain's earlier drafts, or its ancestors in a `tree`)."""
  r, node = vt.row_seq, vt.row_depth
  k = vt.draft_tokens.shape[1]
  j = jnp.arange(k)[None, :]
  if tree is None:
    depth, before = node, jnp.broadcast_to(j, (r.shape[0], k))  # [R], [R, K]
  else:  # the drafts before a node are its ancestors', d_(path[depth]) at depth 1..
    depth = jnp.asarray(tree.depth)[node]
    path = jnp.asarray(tree.path)[node][:, 1:] - 1  # [R, D]
    before = jnp.pad(path, ((0, 0), (0, k - path.shape[1])))
  # Without penalties the history is never read: a one-column stand-in spares the gather.
  base = st if with_history else st.replace(history=st.history[:, :1])
  rows = jax.tree.map(lambda a: a[r], base)
  rows = rows.replace(
      gen_idx=rows.gen_idx + depth,
      banned=jnp.where((depth < vt.ban_rows[r])[:, None], rows.banned, -1))
  if not with_history:
    return rows
  # The drafts before a row count as output tokens for its penalties: they follow the sequence's
  # tokens in its history.
  pos = jnp.sum(st.history >= 0, axis=1)[r][:, None] + j  # [R, K]
  val = jnp.where(j < depth[:, None],
                  jnp.take_along_axis(vt.draft_tokens[r], jnp.maximum(before, 0), axis=1), -1)
  hist = rows.history.at[jnp.arange(r.shape[0])[:, None], pos].set(val, mode="drop")
  return rows.replace(history=hist)


def _gather(logits: jax.Array, x: jax.Array, rst: SamplingTensors, rows: jax.Array,
            tokens: jax.Array, logprobs_mode: str) -> SampleOutput:
  """The output of each sequence's tokens [S, K+1], the j-th chosen at logits row rows[s, j]
  (x: the rows' processed logits)."""
  values, offset = reported(logits, x, rst, logprobs_mode)  # [R, V], [R]
  top_lp, top_ids = top_logprobs(values, offset, rst.num_logprobs)  # [R, N], [R, N]
  token_lp = values[rows, tokens] - offset[rows]  # [S, K+1]
  return SampleOutput(tokens=tokens.astype(jnp.int32), logprobs=token_lp, top_ids=top_ids[rows],
                      top_logprobs=top_lp[rows])


@struct.dataclass
class Typical:
  """Medusa's typical acceptance (opt-in, NOT lossless): a sampled row accepts a child whose
  probability under the target (at the row's temperature) exceeds
  min(threshold, alpha * exp(-entropy)), even where exact sampling would not have drawn it."""
  threshold: float = struct.field(pytree_node=False, default=0.09)
  alpha: float = struct.field(pytree_node=False, default=0.3)


def accept(logits: jax.Array, st: SamplingTensors, vt: VerifyTensors, tree: Tree,
           typical: Typical | None = None, logprobs_mode: str = "raw_logprobs") -> VerifyOutput:
  """logits [R, V] float32 straight from the model at the verify rows; st per sequence [S].
  Each sequence's rows are the first m + 1 nodes of `tree` (root first; a chain's are its
  drafts in order), `draft_tokens[s, n - 1]` the token of node n, `chain[s, n]` node n's
  logits row. The output is distributed as p because each token is the sampler's own draw
  (see the module docstring); `typical` trades that away for longer acceptance."""
  s, k = vt.draft_tokens.shape
  rows_of = vt.chain  # [S, K+1]
  rst = row_tensors(st, vt, with_history=False, tree=tree)
  x = jax.lax.cond(any_penalty(st),
                   lambda l: penalize(l, row_tensors(st, vt, with_history=True, tree=tree)),
                   lambda l: l, logits)
  # Each row under the mask of its own prefix: a draft the constraint forbids is never the pick
  # at its parent, so it and every node below it are never accepted.
  x = constrain(ban(x, rst.banned), vt.allowed)  # [R, V]
  pick = choose(x, rst)  # [R]: the target's token at each node
  parent_row = rows_of[:, jnp.asarray(tree.parent[1:])]  # [S, K]
  live = jnp.arange(1, k + 1)[None, :] <= vt.num_drafts[:, None]  # [S, K]
  ok = vt.draft_tokens == pick[parent_row]
  if typical is not None:
    temp = jnp.maximum(rst.temperature, 1e-6)[:, None]
    p = jax.nn.softmax(x / temp, axis=-1)  # [R, V]
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(p), 0.0), axis=-1)
    bar = jnp.minimum(typical.threshold, typical.alpha * jnp.exp(-entropy))  # [R]
    p_child = p[parent_row, vt.draft_tokens]  # [S, K]
    sampled = (rst.temperature > 0)[parent_row]
    ok = jnp.where(sampled, p_child > bar[parent_row], ok)
  ok = jnp.pad(ok & live, ((0, 0), (1, 0)), constant_values=True)  # [S, K+1], the root's too
  visible = jnp.asarray(tree.visible)  # [K+1, K+1]
  whole = jnp.all(ok[:, None, :] | ~visible[None], axis=-1)  # [S, K+1]: node and ancestors ok
  depth = jnp.asarray(tree.depth)
  best = jnp.argmax(jnp.where(whole, depth[None, :], -1), axis=1)  # [S] the deepest such node
  a = depth[best]  # [S]
  path = jnp.asarray(tree.path)[best]  # [S, D+1]
  stop = jnp.take_along_axis(rows_of, best[:, None], axis=1)[:, 0]  # [S]
  j = jnp.arange(k + 1)[None, :]
  path_k = jnp.pad(path, ((0, 0), (0, k - tree.max_depth)), mode="edge")  # [S, K+1]
  drafts = jnp.take_along_axis(vt.draft_tokens, jnp.maximum(path_k[:, 1:] - 1, 0), axis=1)
  drafts = jnp.pad(drafts, ((0, 0), (0, 1)))  # [S, K+1]: the path's tokens by depth
  tokens = jnp.where(j < a[:, None], drafts, jnp.where(j == a[:, None], pick[stop][:, None], 0))
  rows = jnp.take_along_axis(rows_of, path_k, axis=1)  # [S, K+1]: the row choosing token j
  return VerifyOutput(_gather(logits, x, rst, rows, tokens, logprobs_mode), a, stop, path)
