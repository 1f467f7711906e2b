"""The group-wise matmul's codebook form (4-bit codes indexing a table of 16 values, a scale per
group): the oracle against a literal numpy reading, every backend (the CPU path, both Pallas
kernels in interpret mode, the TPU one once with race detection) against the oracle on ragged
shapes, and bad input."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.groupwise_matmul import dequantize_codebook, groupwise_matmul, pack_int4

# e2m1 doubled (MXFP4/NVFP4 as ggml stores them) and IQ4_NL's non-uniform table
E2M1 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
               np.float32)


def _operands(m, k, n, g, table, dtype=jnp.float32, seed=0):
  """(x, packed q, scale, table) and the float64 weight: table[q] * scale, by numpy indexing."""
  rng = np.random.default_rng(seed)
  codes = rng.integers(0, 16, (k, n))
  scale = rng.uniform(0.5, 1.5, (k // g, n)).astype(np.float32) * 0.01
  w64 = table.astype(np.float64)[codes] * np.repeat(scale, g, 0)
  q = pack_int4(jnp.asarray(codes), g)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  return (x, q, jnp.asarray(scale), jnp.asarray(table)), w64


def _run(backend, args, g, **kw):
  x, q, s, t = args
  return jax.jit(lambda x, q, s, t: groupwise_matmul(x, q, s, None, bits=4, group_size=g,
                                                     table=t, backend=backend, **kw))(x, q, s, t)


def test_oracle_is_the_table_lookup():
  (x, q, s, t), w64 = _operands(5, 128, 24, 32, IQ4, seed=1)
  np.testing.assert_array_equal(np.asarray(dequantize_codebook(q, s, t, group_size=32)),
                                w64.astype(np.float32))
  want = np.asarray(x, np.float64) @ w64
  got = np.asarray(_run("reference", (x, q, s, t), 32))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# (backend, M, K, N, g, table, dtype): ragged M and N, K in one and in several tiles, both
# tables; the bf16 GPU case in the slow tier (the TPU kernel's bf16 tiles are int4's)
CASES = [
    ("xla", 1, 96, 40, 32, E2M1, "float32"),
    ("xla", 7, 256, 130, 16, IQ4, "float32"),
    ("xla", 3, 128, 64, 32, E2M1, "bfloat16"),
    ("pallas_tpu", 3, 256, 200, 32, IQ4, "float32"),
    ("pallas_gpu", 5, 256, 72, 32, E2M1, "float32"),
    pytest.param("pallas_gpu", 17, 128, 40, 16, IQ4, "bfloat16", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("backend,m,k,n,g,table,dtype", CASES)
def test_backends_match_oracle(backend, m, k, n, g, table, dtype):
  args, w64 = _operands(m, k, n, g, table, jnp.dtype(dtype))
  kw = {} if backend == "xla" else dict(interpret=True, block_k=128)
  got = np.asarray(_run(backend, args, g, **kw), np.float64)
  want = np.asarray(_run("reference", args, g), np.float64)
  assert got.shape == (m, n)
  # per output, a fraction of max|x_row| * sum_k |w_kn|, as test_groupwise_matmul bounds it
  bound = np.abs(np.asarray(args[0], np.float64)).max(1, keepdims=True) * np.abs(w64).sum(0)
  tol = 2 ** -8 if dtype == "bfloat16" else 1e-6
  assert (np.abs(got - want) <= tol * bound + 1e-6).all()


@pytest.mark.slow
def test_tpu_kernel_has_no_races():
  """Several K steps and N blocks under the race detector (it also fails on reads out of
  bounds or before a DMA's wait, which interpret=True clamps)."""
  args, _ = _operands(8, 256, 256, 32, E2M1, seed=2)
  try:
    got = _run("pallas_tpu", args, 32, interpret=pltpu.InterpretParams(detect_races=True),
               block_k=128, block_n=128)
  finally:
    pltpu.reset_tpu_interpret_mode_state()
  np.testing.assert_allclose(np.asarray(got), np.asarray(_run("reference", args, 32)),
                             rtol=1e-5, atol=1e-5)


def test_bad_input():
  (x, q, s, t), _ = _operands(2, 64, 8, 32, E2M1)
  with pytest.raises(ValueError, match="no offset"):
    groupwise_matmul(x, q, s, s, bits=4, group_size=32, table=t, backend="xla")
  with pytest.raises(ValueError, match=r"table must be a float \[16\]"):
    groupwise_matmul(x, q, s, None, bits=4, group_size=32, table=t[:8], backend="xla")
  with pytest.raises(ValueError, match="offset is needed"):
    groupwise_matmul(x, q, s, None, bits=4, group_size=32, backend="xla")
