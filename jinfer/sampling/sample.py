"""Device-side sampling for a batch of rows, each with its own parameters and seed.

All per-row options are arrays, so one compiled function serves any mix of greedy and sampled
requests. A row's random key is `fold_in(key(seed), number of tokens it has generated)`, so its
tokens do not depend on which other requests share the batch. The expensive parts (penalties,
the sort for top-k/top-p/min-p, top-N logprobs) sit behind `lax.cond` and cost nothing when no
row asks for them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jinfer.sampling.params import MAX_LOGPROBS

# What `logprobs` reports (vLLM's `logprobs_mode`): the model's own distribution ("raw_"), or
# the one the token was drawn from ("processed_": penalties, banned tokens and the
# structured-output mask, then temperature and the top-k/top-p/min-p filter, -inf for the
# tokens filtered out; a greedy row's is its processed logits at temperature 1), as log
# probabilities or as logits.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@struct.dataclass
class SamplingTensors:
  temperature: jax.Array  # [S] float32, 0 = greedy
  top_k: jax.Array  # [S] int32, >= vocab when disabled
  top_p: jax.Array  # [S] float32
  min_p: jax.Array  # [S] float32
  repetition_penalty: jax.Array  # [S] float32
  presence_penalty: jax.Array  # [S] float32
  frequency_penalty: jax.Array  # [S] float32
  seeds: jax.Array  # [S] uint32
  gen_idx: jax.Array  # [S] int32: tokens generated so far (the key's counter)
  history: jax.Array  # [S, H] int32: prompt then output tokens, -1 padded (penalties only)
  prompt_lens: jax.Array  # [S] int32
  banned: jax.Array  # [S, B] int32: tokens forbidden this step (EOS under min_tokens), -1 padded
  num_logprobs: jax.Array  # [S] int32
  # [S, W] int32, W = ceil(V / 32): bit b of word w allows token 32 w + b (all ones: no
  # constraint; see jinfer/sampling/grammar.py). None only where a test builds the tensors.
  allowed: jax.Array | None = None


@struct.dataclass
class SampleOutput:
  tokens: jax.Array  # [S] int32
  logprobs: jax.Array  # [S] float32, of the sampled token
  top_ids: jax.Array  # [S, MAX_LOGPROBS] int32
  top_logprobs: jax.Array  # [S, MAX_LOGPROBS] float32


def any_penalty(st: SamplingTensors) -> jax.Array:  # [] bool
  return jnp.any((st.repetition_penalty != 1.0) | (st.presence_penalty != 0.0)
                 | (st.frequency_penalty != 0.0))


def penalize(logits: jax.Array, st: SamplingTensors) -> jax.Array:
  s, v = logits.shape
  h = st.history.shape[1]
  rows = jnp.broadcast_to(jnp.arange(s)[:, None], (s, h))
  valid = st.history >= 0
  ids = jnp.where(valid, st.history, v)  # out of range -> dropped
  is_out = (jnp.arange(h)[None, :] >= st.prompt_lens[:, None]) & valid
  out_counts = jnp.zeros((s, v), jnp.float32).at[rows, ids].add(is_out, mode="drop")
  seen = jnp.zeros((s, v), jnp.bool_).at[rows, ids].max(valid, mode="drop")
  rp = st.repetition_penalty[:, None]
  logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
  logits = logits - st.frequency_penalty[:, None] * out_counts
  return logits - st.presence_penalty[:, None] * (out_counts > 0)


def row_keys(st: SamplingTensors) -> jax.Array:  # [S] keys
  """Each row's key for the token at position `gen_idx`: `fold_in(key(seed), gen_idx)`. The
  only random number a token ever takes: speculation draws its tokens with it too."""
  return jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(st.seeds,
                                                                             st.gen_idx)


def filter_sorted(x: jax.Array, st: SamplingTensors) -> tuple[jax.Array, jax.Array]:
  """Temperature, top-k, top-p and min-p over processed logits x [S, V]: (order [S, V], the
  vocabulary by descending probability; weights [S, V], the probability of each kept token in
  that order, 0 where filtered out). Kept tokens are a prefix of the order."""
  s, v = x.shape
  scaled = x / jnp.maximum(st.temperature, 1e-6)[:, None]
  order = jnp.argsort(-scaled, axis=-1)  # [S, V] descending
  srt = jnp.take_along_axis(scaled, order, axis=-1)
  rank = jnp.arange(v)[None, :]
  keep = rank < st.top_k[:, None]
  probs = jax.nn.softmax(jnp.where(keep, srt, -jnp.inf), axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
  # top_p = 1 keeps everything: the running sum can reach 1.0 in float32 before the tail does.
  keep &= (before < st.top_p[:, None]) | (st.top_p[:, None] >= 1.0)
  keep &= probs >= st.min_p[:, None] * probs[:, :1]
  keep = keep.at[:, 0].set(True)  # the most likely token always survives
  return order, jnp.where(keep, probs, 0.0)


def draw(order: jax.Array, weights: jax.Array, last: jax.Array, keys: jax.Array) -> jax.Array:
  """Inverse-CDF sampling, one uniform number per row: a token with probability proportional to
  `weights` [S, V] (in `order`'s positions), never past position `last` [S]. (A Gumbel draw over
  the whole vocabulary costs a [S, V] random tensor, and inside the sampler's cond that made
  even the greedy-only path ~7 ms slower on XLA:CPU.)"""
  cdf = jnp.cumsum(weights, axis=-1)  # [S, V]
  u = jax.vmap(jax.random.uniform)(keys) * cdf[:, -1]  # [S]
  pick = jnp.minimum(jnp.sum(cdf <= u[:, None], axis=-1), last)  # [S]
  return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _sample_filtered(x: jax.Array, st: SamplingTensors) -> jax.Array:  # [S] int32
  order, weights = filter_sorted(x, st)
  return draw(order, weights, jnp.sum(weights > 0, axis=-1) - 1, row_keys(st))


def _argmax(x: jax.Array, block: int = 128) -> jax.Array:  # [S, V] -> [S] int32
  """The first maximum of each row, like jnp.argmax. XLA:CPU lowers argmax over a long row to
  a slow variadic (value, index) reduce (7 ms for [64, 49152]); a max per block of `block`
  columns, an argmax over those maxima and one inside the winning block take ~1 ms."""
  s, v = x.shape
  xb = jnp.pad(x, ((0, 0), (0, -v % block)), constant_values=-jnp.inf).reshape(s, -1, block)
  best = jnp.argmax(xb.max(axis=-1), axis=-1)  # [S] the first block holding the maximum
  inner = jnp.argmax(jnp.take_along_axis(xb, best[:, None, None], axis=1)[:, 0], axis=-1)
  return (best * block + inner).astype(jnp.int32)


def ban(x: jax.Array, banned: jax.Array) -> jax.Array:
  """x [S, V] with each row's `banned` [S, B] tokens (-1 padded) set to -inf."""
  s, v = x.shape
  rows = jnp.broadcast_to(jnp.arange(s)[:, None], banned.shape)
  return x.at[rows, jnp.where(banned >= 0, banned, v)].set(-jnp.inf, mode="drop")


def _mask(x: jax.Array, allowed: jax.Array) -> jax.Array:
  """x [S, V] with the tokens whose bit is clear in allowed [S, W] set to -inf."""
  s, v = x.shape
  bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
  return jnp.where(bits.reshape(s, -1)[:, :v] != 0, x, -jnp.inf)


def constrain(x: jax.Array, allowed: jax.Array | None) -> jax.Array:
  """x [S, V] under each row's token mask (structured outputs); free unless some row has one."""
  if allowed is None:
    return x
  return jax.lax.cond(jnp.any(allowed != -1), _mask, lambda l, _: l, x, allowed)


def process(logits: jax.Array, st: SamplingTensors) -> jax.Array:  # [S, V]
  """The request's own changes to the model's logits: penalties, then banned tokens, then the
  structured-output mask (as vLLM: before temperature and the top-k/top-p/min-p filters)."""
  x = jax.lax.cond(any_penalty(st), penalize, lambda l, _: l, logits, st)
  return constrain(ban(x, st.banned), st.allowed)


def filtered(x: jax.Array, st: SamplingTensors) -> jax.Array:  # [S, V]
  """The logits each row's token is drawn from, over processed logits x [S, V]: a sampled row's
  x / temperature with -inf where top-k/top-p/min-p leave a token out (exactly the tokens
  `draw` cannot pick), a greedy row's x. The sort only runs when some row samples."""
  def scaled_and_kept(x, st):
    order, weights = filter_sorted(x, st)
    rows = jnp.arange(x.shape[0])[:, None]
    kept = jnp.zeros(x.shape, jnp.bool_).at[rows, order].set(weights > 0)
    y = jnp.where(kept, x / jnp.maximum(st.temperature, 1e-6)[:, None], -jnp.inf)
    return jnp.where((st.temperature > 0)[:, None], y, x)
  return jax.lax.cond(jnp.any(st.temperature > 0), scaled_and_kept, lambda l, _: l, x, st)


def reported(logits: jax.Array, x: jax.Array, st: SamplingTensors,
             mode: str) -> tuple[jax.Array, jax.Array]:
  """(values [S, V], offset [S]): `logprobs` reports values - offset for a row's tokens, as
  `mode` (LOGPROBS_MODES) says, from the model's logits and the processed ones x."""
  values = filtered(x, st) if mode.startswith("processed_") else logits
  offset = (jax.nn.logsumexp(values, axis=-1) if mode.endswith("_logprobs")
            else jnp.zeros(values.shape[:1], values.dtype))
  return values, offset


def top_logprobs(values: jax.Array, offset: jax.Array,
                 num_logprobs: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(the top-N values - offset [S, N], their ids [S, N]) of `reported`'s output, only computed
  when some row asks for top-N (`num_logprobs` [S])."""
  s = values.shape[0]
  top_lp, top_ids = jax.lax.cond(
      jnp.any(num_logprobs > 0),
      lambda l: tuple(jax.lax.top_k(l - offset[:, None], MAX_LOGPROBS)),
      lambda l: (jnp.zeros((s, MAX_LOGPROBS), l.dtype), jnp.zeros((s, MAX_LOGPROBS), jnp.int32)),
      values)
  return top_lp, top_ids.astype(jnp.int32)


def choose(x: jax.Array, st: SamplingTensors) -> jax.Array:  # [S] int32
  """Each row's token from its processed logits x [S, V]: the argmax for greedy rows, a draw
  with the row's own key for the others."""
  greedy = _argmax(x)
  sampled = jax.lax.cond(jnp.any(st.temperature > 0), _sample_filtered, lambda l, _: greedy, x, st)
  return jnp.where(st.temperature > 0, sampled, greedy)


def sample(logits: jax.Array, st: SamplingTensors,
           logprobs_mode: str = "raw_logprobs") -> SampleOutput:
  """logits: [S, V] float32 straight from the model; `logprobs_mode` (static) what the
  logprobs report. The tokens do not depend on it."""
  x = process(logits, st)
  tokens = choose(x, st)
  values, offset = reported(logits, x, st, logprobs_mode)
  top_lp, top_ids = top_logprobs(values, offset, st.num_logprobs)
  token_lp = jnp.take_along_axis(values, tokens[:, None], axis=-1)[:, 0] - offset
  return SampleOutput(tokens=tokens, logprobs=token_lp, top_ids=top_ids, top_logprobs=top_lp)
