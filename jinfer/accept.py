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

from jinfer.sample import (SampleOutput, SamplingTensors, _argmax, any_penalty, ban, draw,
                           filter_sorted, penalize, row_keys, top_logprobs)

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


def row_tensors(st: SamplingTensors, vt: VerifyTensors, with_history: bool) -> SamplingTensors:
  """Per logits row, its sequence's sampling tensors as of the row's position."""
  r, depth = vt.row_seq, vt.row_depth
  # Without penalties the history is never read: a one-column stand-in spares the gather.
  base = st if with_history else st.replace(history=st.history[:, :1])
  rows = jax.tree.map(lambda a: a[r], base)
  rows = rows.replace(
      gen_idx=rows.gen_idx + depth,
      banned=jnp.where((depth < vt.ban_rows[r])[:, None], rows.banned, -1))
  if not with_history:
    return rows
  # The drafts before a row count as output tokens for its penalties: d_1..d_depth follow the
  # sequence's tokens in its history.
  k = vt.draft_tokens.shape[1]
  j = jnp.arange(k)[None, :]
  pos = jnp.sum(st.history >= 0, axis=1)[r][:, None] + j  # [R, K]
  val = jnp.where(j < depth[:, None], vt.draft_tokens[r], -1)
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
  lse, top_lp, top_ids = top_logprobs(logits, rst.num_logprobs)  # [R], [R, N], [R, N]
  token_lp = logits[chain, tokens] - lse[chain]  # [S, K+1]
  return VerifyOutput(SampleOutput(tokens=tokens.astype(jnp.int32), logprobs=token_lp,
                                   top_ids=top_ids[chain], top_logprobs=top_lp[chain]), a)
