"""Device-side verification of speculative tokens: which drafts the target accepts, and the token
that follows them, in the same jit as the target's forward pass.

A speculating sequence's verify rows are its last committed token and its drafts,
`[last, d1..dm]` (m <= K); row i holds the target's logits for the token after d_i (d_0 = last),
so it judges d_{i+1}, and row m yields a bonus token. Every row is processed as the request's
own sampler would process it at that position (penalties counting d_1..d_i as output, min_tokens
bans while they apply, temperature, top-k, top-p, min-p), giving the target's distribution p.

  * Greedy rows accept the longest prefix of drafts equal to the target's argmax, then emit the
    argmax at the first mismatch (or after the last draft).
  * Sampled rows run Leviathan et al. / Chen et al. rejection sampling: accept d_{i+1} with
    probability min(1, p(d)/q(d)), q being the proposer's distribution under the same processing
    (one-hot for n-gram lookups); at the first rejection draw from normalize(max(0, p - q)); when
    all m are accepted draw a bonus token from p. The output is distributed exactly as p.

A sequence without drafts (m = 0) is a plain sample: its token is drawn exactly as `sample`
draws it. Every random number derives from the request's seed and the token's position
(`row_keys`), in separate streams for the acceptance test and the proposer, so a seeded request
draws the same tokens whatever else shares its batch.

Rows are addressed through `chain` (each sequence's i-th verify row), so a tree of candidates
(Medusa, EAGLE) is a different walk over the same per-row quantities.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jinfer.sample import (SampleOutput, SamplingTensors, _argmax, any_penalty, ban, choose, draw,
                           filter_sorted, penalize, row_keys, top_logprobs)
from jinfer.spec.tree import Tree

ACCEPT_STREAM = 1  # the acceptance test's uniform number, beside the sampler's own draw
DRAFT_STREAM = 2  # the proposer's sample of a draft token


@struct.dataclass
class VerifyTensors:
  """How a verify step's logits rows map to its sequences' chains. R = logits rows."""
  draft_tokens: jax.Array  # [S, K] int32: d_1..d_K (past num_drafts: unused)
  num_drafts: jax.Array  # [S] int32: m, 0 for sequences that do not speculate this step
  row_seq: jax.Array  # [R] int32: the sequence of each logits row
  row_depth: jax.Array  # [R] int32: its index i in that sequence's chain
  chain: jax.Array  # [S, K+1] int32: the logits row of each chain index (past m: any row)
  ban_rows: jax.Array  # [S] int32: banned tokens (min_tokens) apply at chain indices < this


@struct.dataclass
class DraftProbs:
  """A draft model's distributions for its proposals: q of d_i is `probs[s, i-1]`."""
  probs: jax.Array  # [S, K, Vd] float32
  vocab: jax.Array  # [Vd] int32: the draft's vocabulary, as target token ids


@struct.dataclass
class Drafts:
  """A device proposer's guesses, handed to the verify step without leaving the device."""
  tokens: jax.Array  # [S, K] int32
  probs: DraftProbs


@struct.dataclass
class VerifyOutput:
  sample: SampleOutput  # every field [S, K+1, ...]: d_1..d_a, then the target's token
  num_accepted: jax.Array  # [S] int32: a; the sequence gains a + 1 tokens
  stop_row: jax.Array  # [S] int32: the logits row that chose the target's token
  path: jax.Array | None = None  # [S, D+1] int32, a tree's: the accepted nodes by depth


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


def _residual(p: jax.Array, q: jax.Array) -> jax.Array:
  """What to draw from after rejecting a draft: max(0, p - q), unnormalized."""
  return jnp.maximum(p - q, 0.0)


def accept(logits: jax.Array, st: SamplingTensors, vt: VerifyTensors,
           draft: DraftProbs | None) -> VerifyOutput:
  """logits [R, V] float32 straight from the model at the verify rows; st per sequence [S];
  draft None when the proposer's q is one-hot on its tokens (n-gram lookup)."""
  num_rows, v = logits.shape
  s, k = vt.draft_tokens.shape
  rst = row_tensors(st, vt, with_history=False)
  x = jax.lax.cond(any_penalty(st),
                   lambda l: penalize(l, row_tensors(st, vt, with_history=True)),
                   lambda l: l, logits)
  x = ban(x, rst.banned)  # [R, V]
  greedy = _argmax(x)  # [R]
  r, depth = vt.row_seq, vt.row_depth
  judged = depth < vt.num_drafts[r]  # [R]: the row has a draft to judge
  d_next = jnp.where(judged, vt.draft_tokens[r, jnp.minimum(depth, k - 1)], -1)  # [R]

  def sampled(x):
    order, w = filter_sorted(x, rst)  # [R, V] each
    p = w / jnp.sum(w, axis=-1, keepdims=True)
    hit = order == d_next[:, None]  # [R, V]: where d_{i+1} sits in the row's order
    if draft is None:
      q = hit.astype(p.dtype)
    else:
      q_rows = draft.probs[r, jnp.minimum(depth, k - 1)]  # [R, Vd]
      q_vocab = jnp.zeros_like(p).at[:, draft.vocab].set(q_rows)
      q = jnp.take_along_axis(q_vocab, order, axis=-1)
    p_d = jnp.sum(jnp.where(hit, p, 0.0), axis=-1)  # [R]
    q_d = jnp.sum(jnp.where(hit, q, 0.0), axis=-1)
    u = jax.vmap(jax.random.uniform)(row_keys(rst, ACCEPT_STREAM))  # [R]
    ok = u * q_d < p_d  # probability min(1, p/q)
    resid = _residual(p, q)
    last_resid = v - 1 - jnp.argmax(resid[:, ::-1] > 0, axis=-1)
    keys = row_keys(rst)
    bonus = draw(order, w, jnp.sum(w > 0, axis=-1) - 1, keys)
    return ok, bonus, draw(order, resid, last_resid, keys)

  ok, bonus, resid = jax.lax.cond(jnp.any(st.temperature > 0), sampled,
                                  lambda x: (jnp.zeros(num_rows, bool), greedy, greedy), x)
  is_greedy = rst.temperature <= 0
  ok = jnp.where(is_greedy, greedy == d_next, ok) & judged
  bonus, resid = jnp.where(is_greedy, greedy, bonus), jnp.where(is_greedy, greedy, resid)

  chain = vt.chain  # [S, K+1]
  a = jnp.sum(jnp.cumprod(ok[chain[:, :k]], axis=1), axis=1).astype(jnp.int32)  # [S]
  stop = jnp.take_along_axis(chain, a[:, None], axis=1)[:, 0]  # [S]
  final = jnp.where(a < vt.num_drafts, resid[stop], bonus[stop])  # [S]
  j = jnp.arange(k + 1)[None, :]
  drafts = jnp.pad(vt.draft_tokens, ((0, 0), (0, 1)))  # [S, K+1]
  tokens = jnp.where(j < a[:, None], drafts, jnp.where(j == a[:, None], final[:, None], 0))
  return VerifyOutput(_gather(logits, rst, chain, tokens), a, stop)


def _gather(logits: jax.Array, rst: SamplingTensors, rows: jax.Array,
            tokens: jax.Array) -> SampleOutput:
  """The output of each sequence's tokens [S, K+1], the j-th chosen at logits row rows[s, j]."""
  lse, top_lp, top_ids = top_logprobs(logits, rst.num_logprobs)  # [R], [R, N], [R, N]
  token_lp = logits[rows, tokens] - lse[rows]  # [S, K+1]
  return SampleOutput(tokens=tokens.astype(jnp.int32), logprobs=token_lp, top_ids=top_ids[rows],
                      top_logprobs=top_lp[rows])


@struct.dataclass
class Typical:
  """Medusa's typical acceptance (opt-in, NOT lossless): a sampled row accepts a child whose
  probability under the target (at the row's temperature) exceeds
  min(threshold, alpha * exp(-entropy)), even where exact sampling would not have drawn it."""
  threshold: float = struct.field(pytree_node=False, default=0.09)
  alpha: float = struct.field(pytree_node=False, default=0.3)


def accept_tree(logits: jax.Array, st: SamplingTensors, vt: VerifyTensors, tree: Tree,
                typical: Typical | None = None) -> VerifyOutput:
  """Verify each sequence's candidate tree: its rows are the tree's first m + 1 nodes (root
  first), `draft_tokens[s, n - 1]` the token of node n, `chain[s, n]` node n's logits row.

  At every node the target picks its own token exactly as `sample` would at that position
  (argmax, or a draw with the request's key for the token's position, after the request's
  processing with the node's ancestors as output so far); the walk moves to the child holding
  that token, and stops at a node with none, emitting the target's pick there. This is
  SpecInfer's multi-candidate rule for candidates whose proposal is deterministic (q one-hot on
  each child in turn: child c is accepted with probability p(c) of what the earlier children
  left, and the residual after all of them is p without them), so the output is distributed as
  p; and since the draw is the sampler's own, a seeded request emits the same tokens as without
  speculation."""
  s, k = vt.draft_tokens.shape
  rows_of = vt.chain  # [S, K+1]
  rst = row_tensors(st, vt, with_history=False, tree=tree)
  x = jax.lax.cond(any_penalty(st),
                   lambda l: penalize(l, row_tensors(st, vt, with_history=True, tree=tree)),
                   lambda l: l, logits)
  x = ban(x, rst.banned)  # [R, V]
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
  return VerifyOutput(_gather(logits, rst, rows, tokens), a, stop, path)
