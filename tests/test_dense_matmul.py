"""The dense matmul op: the CPU-shaped backend computes the oracle's product (one row split in
halves, several rows, two contracting axes, odd K, the transposed tied head), and bad calls
get a precise error."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from pallas_kernels.dense_matmul import BACKENDS, dense_matmul


def _normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
  # numpy draws: jax.random compiles its generator for every shape.
  return jax.numpy.asarray(np.random.default_rng(seed).standard_normal(shape), np.float32)


@pytest.mark.parametrize("x_shape, w_shape, n_in", [
    ((1, 64), (64, 48), 1),  # one row: split in halves
    ((7, 64), (64, 48), 1),
    ((1, 63), (63, 48), 1),  # odd K: one dot
    ((1, 4, 16), (4, 16, 32), 2),  # o_proj: heads x head_dim in
    ((3, 32), (32, 4, 8), 1),  # q_proj: heads x head_dim out
])
def test_backends_agree(x_shape, w_shape, n_in):
  x, w = _normal(0, x_shape), _normal(1, w_shape)
  want = np.tensordot(np.asarray(x, np.float64), np.asarray(w, np.float64), axes=n_in)
  for backend in BACKENDS:
    got = dense_matmul(x, w, n_in=n_in, backend=backend)
    assert got.shape == want.shape and got.dtype == x.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=backend)


@pytest.mark.parametrize("rows", [1, 5])
def test_transposed_weights(rows):
  x, embed = _normal(2, (rows, 32)), _normal(3, (100, 32))  # [V, E]
  for backend in BACKENDS:
    np.testing.assert_allclose(dense_matmul(x, embed, transpose_w=True, backend=backend),
                               np.asarray(x) @ np.asarray(embed).T, rtol=1e-5, atol=1e-4)


def test_bad_calls():
  x, w = np.zeros((2, 8), np.float32), np.zeros((8, 4), np.float32)
  with pytest.raises(ValueError, match="unknown dense matmul backend 'tpu'"):
    dense_matmul(x, w, backend="tpu")
  with pytest.raises(ValueError, match="shapes do not match"):
    dense_matmul(x, np.zeros((6, 4), np.float32))
