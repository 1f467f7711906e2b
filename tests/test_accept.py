"""The acceptance rule on fixed distributions: greedy prefix matching; sampled speculation emits
the very tokens plain sampling emits, whatever the drafts and however many, and so keeps the
target's exact law (chi-squared), which a rule that reuses a key fails."""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jinfer.sampling import accept as accept_mod
from jinfer.sampling.accept import VerifyTensors, accept
from jinfer.sampling.sample import SamplingTensors, sample
from jinfer.sampling.tree import Tree

V, K = 4, 2  # live vocabulary and drafts per step: the first K+1 tokens have V**(K+1) outcomes
PAD = 24  # the model's vocabulary: tokens V.. never come out (top-N logprobs need >= 20)


def tensors(s: int, gen_idx, *, temperature=1.0, top_k=1 << 30, top_p=1.0,
            num_logprobs=0) -> SamplingTensors:
  f = lambda x, dt: jnp.full((s,), x, dt)
  return SamplingTensors(
      temperature=f(temperature, jnp.float32), top_k=f(top_k, jnp.int32),
      top_p=f(top_p, jnp.float32), min_p=f(0.0, jnp.float32),
      repetition_penalty=f(1.0, jnp.float32), presence_penalty=f(0.0, jnp.float32),
      frequency_penalty=f(0.0, jnp.float32), seeds=jnp.arange(s, dtype=jnp.uint32),
      gen_idx=jnp.asarray(gen_idx, jnp.int32), history=jnp.full((s, 1), -1, jnp.int32),
      prompt_lens=f(0, jnp.int32), banned=jnp.full((s, 2), -1, jnp.int32),
      num_logprobs=f(num_logprobs, jnp.int32))


def chain_tensors(drafts: np.ndarray, num_drafts: np.ndarray) -> VerifyTensors:
  """Every sequence owns K+1 consecutive logits rows."""
  s, k = drafts.shape
  return VerifyTensors(
      draft_tokens=jnp.asarray(drafts, jnp.int32), num_drafts=jnp.asarray(num_drafts, jnp.int32),
      row_seq=jnp.repeat(jnp.arange(s, dtype=jnp.int32), k + 1),
      row_depth=jnp.tile(jnp.arange(k + 1, dtype=jnp.int32), s),
      chain=jnp.arange(s * (k + 1), dtype=jnp.int32).reshape(s, k + 1),
      ban_rows=jnp.zeros(s, jnp.int32))


def markov(seed: int, sharpness: float) -> np.ndarray:  # [V, V]: row x is p(next | x)
  z = np.random.default_rng(seed).normal(0, sharpness, (V, V))
  p = np.exp(z)
  return p / p.sum(1, keepdims=True)


def filtered(p: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
  """What the sampler keeps of each row, renormalized (no ties in these rows)."""
  out = np.zeros_like(p)
  for x, row in enumerate(p):
    order = np.argsort(-row)[:top_k]
    mass = np.cumsum(row[order]) - row[order]
    keep = order[mass < top_p]
    out[x, keep] = row[keep] / row[keep].sum()
  return out


_accept = jax.jit(functools.partial(accept, tree=Tree.chain(K)))


def speculate(target: np.ndarray, draft: np.ndarray, n: int, run=_accept, max_drafts: int = K,
              **params) -> np.ndarray:
  """Generate K+1 tokens for n sequences from token 0, each step drafting a random number
  (0..max_drafts) of tokens from `draft`'s Markov chain and verifying them against `target`'s.
  [n, K+1]"""
  rng = np.random.default_rng(1)
  out = np.zeros((n, K + 1), np.int64)
  done = np.zeros(n, np.int64)
  while (done < K + 1).any():
    last = np.where(done > 0, out[np.arange(n), np.maximum(done - 1, 0)], 0)
    m = rng.integers(0, max_drafts + 1, n)
    chain = np.zeros((n, K + 1), np.int64)
    chain[:, 0] = last
    for i in range(1, K + 1):  # d_i ~ q(. | d_{i-1})
      cdf = np.cumsum(draft[chain[:, i - 1]], axis=1)
      chain[:, i] = np.minimum((rng.random(n)[:, None] > cdf).sum(1), V - 1)
    logits = np.full((n * (K + 1), PAD), -1e9, np.float32)
    logits[:, :V] = np.log(target[chain]).reshape(n * (K + 1), V)
    res = run(jnp.asarray(logits, jnp.float32), tensors(n, done, **params),
              chain_tensors(chain[:, 1:], m))
    toks, a = np.asarray(res.sample.tokens), np.asarray(res.num_accepted)
    assert (a <= m).all()
    for s in np.nonzero(done < K + 1)[0]:
      new = toks[s, :a[s] + 1][:K + 1 - done[s]]
      out[s, done[s]:done[s] + len(new)] = new
      done[s] += len(new)
  return out


def joint_pvalue(samples: np.ndarray, p: np.ndarray) -> float:
  """Chi-squared goodness of fit of the samples' joint law against the Markov chain p from 0."""
  cells = list(itertools.product(range(V), repeat=K + 1))
  law = np.array([np.prod([p[x, y] for x, y in zip((0,) + c[:-1], c)]) for c in cells])
  expected = law * len(samples)
  counts = np.bincount(np.ravel_multi_index(samples.T, [V] * (K + 1)), minlength=len(cells))
  keep = expected > 0
  assert counts[~keep].sum() == 0, "a token the target never emits came out"
  return stats.chisquare(counts[keep], expected[keep]).pvalue


N = 20000
CASES = {"temperature 1": dict(), "top-k 3": dict(top_k=3), "top-p 0.8": dict(top_p=0.8)}


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_speculation_emits_the_samplers_tokens(case):
  target, draft = markov(0, 1.2), markov(7, 1.2)  # a draft that often disagrees
  params = CASES[case]
  got = speculate(target, draft, N, **params)
  # Token for token what sampling without drafts gives the same seeds ...
  np.testing.assert_array_equal(got, speculate(target, draft, N, max_drafts=0, **params))
  # ... and so distributed as the target's chain.
  p = filtered(target, params.get("top_k", V), params.get("top_p", 1.0))
  assert joint_pvalue(got, p) > 1e-3


def test_a_wrong_rule_fails_the_same_test(monkeypatch):
  # Every row drawing with its step's first key (not its own position's) ties the tokens of a
  # step together, where a draft was accepted.
  real = accept_mod.row_tensors
  monkeypatch.setattr(accept_mod, "row_tensors", lambda st, vt, *a, **kw: real(
      st, vt, *a, **kw).replace(gen_idx=st.gen_idx[vt.row_seq]))
  target = markov(0, 1.2)
  wrong = jax.jit(functools.partial(accept_mod.accept, tree=Tree.chain(K)))  # traced patched
  assert joint_pvalue(speculate(target, target, N, run=wrong), target) < 1e-6


def test_greedy_takes_the_longest_matching_prefix():
  logits = np.full((3 * (K + 1), PAD), -5.0, np.float32)
  argmax = np.array([[1, 2, 3], [1, 0, 3], [2, 2, 2]])
  logits[np.arange(3 * (K + 1)), argmax.reshape(-1)] = 5.0
  drafts = np.array([[1, 2], [1, 2], [1, 2]])
  out = _accept(jnp.asarray(logits), tensors(3, [0, 0, 0], temperature=0.0),
                chain_tensors(drafts, np.array([2, 2, 1])))
  a = np.asarray(out.num_accepted)
  np.testing.assert_array_equal(a, [2, 1, 0])
  toks = np.asarray(out.sample.tokens)
  assert toks[0].tolist() == [1, 2, 3] and toks[1, :2].tolist() == [1, 0] and toks[2, 0] == 2


def test_without_drafts_it_is_the_sampler():
  rng = np.random.default_rng(3)
  s = 64
  logits = rng.normal(0, 2.0, (s, 50)).astype(np.float32)
  st = tensors(s, rng.integers(0, 100, s), temperature=0.9, top_p=0.9, num_logprobs=3)
  plain = jax.jit(sample)(jnp.asarray(logits), st)
  vt = VerifyTensors(draft_tokens=jnp.zeros((s, K), jnp.int32), num_drafts=jnp.zeros(s, jnp.int32),
                     row_seq=jnp.arange(s, dtype=jnp.int32), row_depth=jnp.zeros(s, jnp.int32),
                     chain=jnp.tile(jnp.arange(s, dtype=jnp.int32)[:, None], (1, K + 1)),
                     ban_rows=jnp.zeros(s, jnp.int32))
  out = _accept(jnp.asarray(logits), st, vt)
  np.testing.assert_array_equal(np.asarray(out.sample.tokens[:, 0]), np.asarray(plain.tokens))
  np.testing.assert_allclose(np.asarray(out.sample.logprobs[:, 0]), np.asarray(plain.logprobs))
  np.testing.assert_array_equal(np.asarray(out.sample.top_ids[:, 0]), np.asarray(plain.top_ids))
  assert not np.asarray(out.num_accepted).any()
