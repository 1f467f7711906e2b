"""Grouped matmul over group-wise quantized experts (int4 packed, int8; a scale and an offset per
expert, row group and output channel): the ragged_dot oracle against a float64 loop over the
experts, and the CPU loop against the oracle, over empty experts, one expert holding every row,
ragged sizes and rows past the last expert."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.groupwise_matmul import pack_int4

K, N, QG = 192, 72, 32  # 6 row groups of 32 per expert
# Rows per expert (G = 5): empty experts first, last and between; one expert holding every row;
# ragged sizes; rows past the last expert (M > sum).
GROUP_SIZES = [[0, 3, 0, 40, 1], [0, 0, 45, 0, 0], [7, 33, 9, 0, 2]]
M = 51

_pack = jax.jit(jax.vmap(pack_int4, in_axes=(0, None)), static_argnums=1)


def _operands(bits: int, dtype, seed: int = 0):
  """(x, q, scale, offset) and the float64 weights [G, K, N] they stand for."""
  rng = np.random.default_rng(seed)
  qv = rng.integers(0, 16, (5, K, N)) if bits == 4 else rng.integers(-128, 128, (5, K, N))
  scale = rng.uniform(0.5, 1.5, (5, K // QG, N)).astype(np.float32) * 0.01
  offset = (-(8.0 if bits == 4 else 0.0) * scale
            + rng.uniform(-0.01, 0.01, scale.shape)).astype(np.float32)
  w64 = qv * np.repeat(scale, QG, 1).astype(np.float64) + np.repeat(offset, QG, 1)
  q = _pack(jnp.asarray(qv), QG) if bits == 4 else jnp.asarray(qv, jnp.int8)
  x = jnp.asarray(rng.standard_normal((M, K)), dtype)
  return (x, q, jnp.asarray(scale), jnp.asarray(offset)), w64


def _run(backend, x, q, gs, s, o, bits, **kw):
  return jax.jit(lambda x, q, gs, s, o: grouped_matmul(
      x, q, gs, s, o, bits=bits, quant_group_size=QG, backend=backend, **kw))(x, q, gs, s, o)


@pytest.mark.parametrize("bits", [4, 8])
def test_oracle_is_a_float64_loop_over_experts(bits):
  (x, q, s, o), w64 = _operands(bits, jnp.float32)
  x64 = np.asarray(x, np.float64)
  for sizes in GROUP_SIZES:
    got = np.asarray(_run("ragged_dot", x, q, jnp.asarray(sizes, jnp.int32), s, o, bits))
    want = np.zeros((M, N))
    start = 0
    for e, size in enumerate(sizes):
      want[start:start + size] = x64[start:start + size] @ w64[e]
      start += size
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert not got[start:].any()  # rows past the last expert are zero


@pytest.mark.parametrize("bits,dtype", [(4, "float32"), (8, "float32"),
                                        pytest.param(4, "bfloat16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("block_m", [None, 8])  # 8: many row tiles per expert
def test_xla_matches_oracle(bits, dtype, block_m):
  (x, q, s, o), _ = _operands(bits, jnp.dtype(dtype))
  kw = {} if block_m is None else dict(block_m=block_m)
  for sizes in GROUP_SIZES:
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(_run("xla", x, q, gs, s, o, bits, **kw), np.float32)
    want = np.asarray(_run("ragged_dot", x, q, gs, s, o, bits), np.float32)
    # bf16: the loop rounds dequantized weights and outputs to bf16.
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max(),
                               err_msg=f"group sizes {sizes}")


@pytest.mark.slow
def test_the_tpu_kernel_runs_groupwise_experts_widened():
  """The Mosaic kernel takes float experts: group-wise ones are dequantized before it (the
  interpreter runs it here)."""
  (x, q, s, o), _ = _operands(4, jnp.float32)
  gs = jnp.asarray(GROUP_SIZES[2], jnp.int32)
  got = _run("pallas_tpu", x, q, gs, s, o, 4, interpret=True, block_m=16, block_n=128,
             block_k=128)
  want = _run("ragged_dot", x, q, gs, s, o, 4)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                             atol=1e-5 * np.abs(np.asarray(want)).max())


def test_bad_arguments_raise():
  (x, q, s, o), _ = _operands(4, jnp.float32)
  gs = jnp.zeros((5,), jnp.int32)
  kw = dict(bits=4, quant_group_size=QG)
  with pytest.raises(ValueError, match="keep activations float"):
    grouped_matmul(x, q, gs, s, o, mode="w8a8", **kw)
  with pytest.raises(ValueError, match=r"4-bit rhs must be \[G, 96, N\] uint8"):
    grouped_matmul(x, q.astype(jnp.int8), gs, s, o, **kw)
  with pytest.raises(ValueError, match="dividing K=192"):
    grouped_matmul(x, q, gs, s, o, bits=4, quant_group_size=40)
  with pytest.raises(ValueError, match=r"offset must be \[G, K/quant_group_size, N\]"):
    grouped_matmul(x, q, gs, s, None, **kw)
  with pytest.raises(ValueError, match="pass quant_group_size"):
    grouped_matmul(x, q, gs, s, o)
