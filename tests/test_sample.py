"""The device sampler on fixed logits: greedy, filtering, frequencies, banned tokens, logprobs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.sampling.sample import SamplingTensors, _argmax, sample

V = 40
N = 4000  # draws, one row each: the same logits under different seeds


def tensors(n: int, *, temperature=1.0, top_k=1 << 30, top_p=1.0, min_p=0.0, banned=None,
            num_logprobs=0) -> SamplingTensors:
  f = lambda x, dt: jnp.full((n,), x, dt)
  ban = np.full((n, 4), -1, np.int32)
  if banned is not None:
    ban[:, :len(banned)] = banned
  return SamplingTensors(
      temperature=f(temperature, jnp.float32), top_k=f(top_k, jnp.int32),
      top_p=f(top_p, jnp.float32), min_p=f(min_p, jnp.float32),
      repetition_penalty=f(1.0, jnp.float32), presence_penalty=f(0.0, jnp.float32),
      frequency_penalty=f(0.0, jnp.float32), seeds=jnp.arange(n, dtype=jnp.uint32),
      gen_idx=f(3, jnp.int32), history=jnp.full((n, 1), -1, jnp.int32),
      prompt_lens=f(0, jnp.int32), banned=jnp.asarray(ban), num_logprobs=f(num_logprobs, jnp.int32))


@pytest.fixture(scope="module")
def logits() -> np.ndarray:
  return np.random.default_rng(0).normal(0, 1.5, V).astype(np.float32)


def draw(logits, **kw) -> np.ndarray:
  out = jax.jit(sample)(jnp.broadcast_to(jnp.asarray(logits), (N, V)), tensors(N, **kw))
  return np.asarray(out.tokens)


def probs(logits, temperature=1.0):
  p = np.exp((logits - logits.max()) / temperature)
  return p / p.sum()


def check_frequencies(tokens, allowed_probs):
  """Empirical frequencies match the renormalized allowed distribution (3.5 sigma per token)."""
  want = allowed_probs / allowed_probs.sum()
  got = np.bincount(tokens, minlength=V) / len(tokens)
  sigma = np.sqrt(want * (1 - want) / len(tokens))
  assert (np.abs(got - want) <= 3.5 * sigma + 1e-9).all()


@pytest.mark.parametrize("shape", [(64, 49152), (3, 1000), (5, 130)])
def test_argmax_matches_numpy(shape):
  x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
  x[0, 5] = x[0, 77] = x.max() + 1  # a tie: the first one wins, as in np.argmax
  x[1, -1] = x.max() + 2  # the maximum in the last, partial block
  np.testing.assert_array_equal(np.asarray(_argmax(jnp.asarray(x))), x.argmax(-1))


def test_greedy_and_banned(logits):
  order = np.argsort(-logits)
  assert (draw(logits, temperature=0.0) == order[0]).all()
  assert (draw(logits, temperature=0.0, banned=order[:2]) == order[2]).all()
  assert not np.isin(draw(logits, banned=order[:3]), order[:3]).any()


def test_plain_sampling_follows_the_softmax(logits):
  check_frequencies(draw(logits, temperature=0.7), probs(logits, 0.7))


def test_top_k(logits):
  keep = np.zeros(V, bool)
  keep[np.argsort(-logits)[:5]] = True
  tokens = draw(logits, top_k=5)
  assert keep[tokens].all()
  check_frequencies(tokens, probs(logits) * keep)


def test_top_p(logits):
  p = probs(logits)
  order = np.argsort(-p)
  before = np.cumsum(p[order]) - p[order]  # mass strictly above each token
  keep = np.zeros(V, bool)
  keep[order[before < 0.6]] = True  # the smallest set whose mass reaches 0.6
  tokens = draw(logits, top_p=0.6)
  assert keep[tokens].all() and keep.sum() < V
  check_frequencies(tokens, p * keep)


def test_min_p(logits):
  p = probs(logits)
  keep = p >= 0.2 * p.max()
  tokens = draw(logits, min_p=0.2)
  assert keep[tokens].all() and keep.sum() < V
  check_frequencies(tokens, p * keep)


def test_logprobs_are_the_models(logits):
  out = jax.jit(sample)(jnp.asarray(np.stack([logits, logits[::-1]])),
                        tensors(2, temperature=0.0, num_logprobs=3))
  for row, lg in enumerate([logits, logits[::-1]]):
    want = lg - np.log(np.exp(lg.astype(np.float64)).sum())
    tok = int(out.tokens[row])
    np.testing.assert_allclose(float(out.logprobs[row]), want[tok], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.top_ids[row, :3]), np.argsort(-want)[:3])
    np.testing.assert_allclose(np.asarray(out.top_logprobs[row, :3]), np.sort(want)[::-1][:3],
                               rtol=1e-5, atol=1e-5)
