"""Grouped matmul over group-wise quantized experts (int4 packed, int8; a scale and an offset per
expert, row group and output channel): the ragged_dot oracle against a float64 loop over the
experts, the CPU loop and the TPU and GPU kernels (interpret mode) against the oracle, over empty
experts, one expert holding every row, ragged sizes and rows past the last expert; the kernels'
K tiles holding one quant group or several, and their lowering to Mosaic and Triton."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.groupwise_matmul import pack_int4

K, N, QG = 192, 72, 32  # 6 row groups of 32 per expert
# Rows per expert (G = 5): empty experts first, last and between; one expert holding every row;
# ragged sizes; rows past the last expert (M > sum).
GROUP_SIZES = [[0, 3, 0, 40, 1], [0, 0, 45, 0, 0], [7, 33, 9, 0, 2]]
M = 51

_pack = jax.jit(jax.vmap(pack_int4, in_axes=(0, None)), static_argnums=1)


def _operands(bits: int, dtype, seed: int = 0, k: int = K, qg: int = QG, n: int = N):
  """(x, q, scale, offset) and the float64 weights [G, K, N] they stand for."""
  rng = np.random.default_rng(seed)
  qv = rng.integers(0, 16, (5, k, n)) if bits == 4 else rng.integers(-128, 128, (5, k, n))
  scale = rng.uniform(0.5, 1.5, (5, k // qg, n)).astype(np.float32) * 0.01
  offset = (-(8.0 if bits == 4 else 0.0) * scale
            + rng.uniform(-0.01, 0.01, scale.shape)).astype(np.float32)
  w64 = qv * np.repeat(scale, qg, 1).astype(np.float64) + np.repeat(offset, qg, 1)
  q = _pack(jnp.asarray(qv), qg) if bits == 4 else jnp.asarray(qv, jnp.int8)
  x = jnp.asarray(rng.standard_normal((M, k)), dtype)
  return (x, q, jnp.asarray(scale), jnp.asarray(offset)), w64


@functools.cache
def _jitted(backend: str, bits: int, qg: int, kw: tuple):
  return jax.jit(lambda x, q, gs, s, o: grouped_matmul(
      x, q, gs, s, o, bits=bits, quant_group_size=qg, backend=backend, **dict(kw)))


def _run(backend, x, q, gs, s, o, bits, qg: int = QG, **kw):
  """Compiled once per backend, format and options: group sizes are traced."""
  return _jitted(backend, bits, qg, tuple(sorted(kw.items())))(x, q, gs, s, o)


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


def _check_kernel(backend, bits, dtype, k, qg, group_sizes, interpret=True, n=N, **blocks):
  (x, q, s, o), _ = _operands(bits, jnp.dtype(dtype), k=k, qg=qg, n=n)
  for sizes in group_sizes:
    gs = jnp.asarray(sizes, jnp.int32)
    got = _run(backend, x, q, gs, s, o, bits, qg, interpret=interpret, **blocks)
    want = np.asarray(_run("ragged_dot", x, q, gs, s, o, bits, qg), np.float32)
    assert got.shape == (M, n) and got.dtype == x.dtype
    got = np.asarray(got, np.float32)
    # bf16: the kernel rounds dequantized weights and outputs to bf16.
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max(),
                               err_msg=f"group sizes {sizes}")
    assert not got[sum(sizes):].any()  # rows past the last expert are zero


def test_pallas_tpu_reads_groupwise_experts():
  """The quick case: int4 bf16, 4 quant groups per K tile and K padded (192 -> 2 tiles of 128),
  row tiles that experts share, empty experts first and between, rows past the last; under the
  strict interpreter (out-of-bounds reads raise, scratch starts NaN-filled)."""
  pltpu.reset_tpu_interpret_mode_state()
  try:
    _check_kernel("pallas_tpu", 4, "bfloat16", K, QG, GROUP_SIZES[:1],
                  interpret=pltpu.InterpretParams(), block_m=16, block_n=128, block_k=128)
  finally:
    pltpu.reset_tpu_interpret_mode_state()


# (bits, dtype, K, quant group, N, blocks): block_k spanning several quant groups (with K padded,
# and with K in one tile) and exactly one (two K tiles of one group each).
TPU_CASES = [
    (4, "float32", K, QG, N, dict(block_m=16, block_n=128, block_k=128)),
    (8, "float32", K, QG, 200, dict(block_m=32, block_n=128, block_k=128)),  # 2 column tiles
    (8, "bfloat16", K, QG, N, dict(block_m=32, block_n=128)),  # K=192: one tile of 6 groups
    (4, "float32", 256, 128, N, dict(block_m=16, block_n=128, block_k=128)),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, id="-".join(map(str, c[:5])))
                                  for c in TPU_CASES])
def test_pallas_tpu_matches_oracle(case):
  """The case with two column tiles runs under race detection (two simulated cores splitting
  them; on one ragged batch, as it is slow), the others under the plain interpreter."""
  bits, dtype, k, qg, n, blocks = case
  interpret, group_sizes = True, GROUP_SIZES + [[0, 0, 0, 0, 0]]
  if n > 128:
    interpret = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    group_sizes = GROUP_SIZES[2:]
  pltpu.reset_tpu_interpret_mode_state()
  try:
    _check_kernel("pallas_tpu", bits, dtype, k, qg, group_sizes, interpret=interpret, n=n,
                  **blocks)
    assert interpret is True or not tpu_interpret.races.races_found
  finally:
    pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.parametrize("bits,qg,k", [(4, 128, 4096), (4, 32, 4096), (8, 128, 4096),
                                       (4, 32, 96)])  # the last: K in one tile, unpadded
def test_pallas_tpu_lowers_for_device(bits, qg, k):
  """Lowering to Mosaic runs on the CPU and catches unsupported ops and block shapes
  (Mixtral-like experts: 8 of them, N = 1536 columns of a sharded projection)."""
  g, n = 8, 1536
  fn = jax.jit(lambda *a: grouped_matmul(*a, bits=bits, quant_group_size=qg,
                                         backend="pallas_tpu"))
  fn.trace(jax.ShapeDtypeStruct((256, k), jnp.bfloat16),
           jax.ShapeDtypeStruct((g, k // 2, n), jnp.uint8) if bits == 4
           else jax.ShapeDtypeStruct((g, k, n), jnp.int8),
           jax.ShapeDtypeStruct((g,), jnp.int32),
           jax.ShapeDtypeStruct((g, k // qg, n), jnp.float32),
           jax.ShapeDtypeStruct((g, k // qg, n), jnp.float32)).lower(lowering_platforms=("tpu",))


# (bits, dtype, K, quant group, N, blocks) and the K tile `k_tile` picks: 2 quant groups per
# tile (64 of K=192), 2 column tiles (N=72 padded to 128); K padded (208 = 13 groups of 16, in
# tiles of 32, the least for int4); one group per tile (128, and 64 for int8) with 2 column
# tiles of 128 (N=200 padded to 256). 51 rows over 5 experts: items of 16 rows.
GPU_CASES = [
    pytest.param(4, "float32", K, QG, N, dict(block_n=64), id="int4-f32-g32"),
    pytest.param(8, "float32", K, QG, N, dict(block_n=64), id="int8-f32-g32"),
    pytest.param(4, "bfloat16", 208, 16, N, {}, id="int4-bf16-g16-kpad",
                 marks=pytest.mark.slow),
    pytest.param(4, "float32", 256, 128, 200, {}, id="int4-f32-g128", marks=pytest.mark.slow),
    pytest.param(8, "bfloat16", K, 64, 200, dict(block_k=64), id="int8-bf16-g64",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("bits,dtype,k,qg,n,blocks", GPU_CASES)
def test_pallas_gpu_matches_oracle(bits, dtype, k, qg, n, blocks):
  _check_kernel("pallas_gpu", bits, dtype, k, qg, GROUP_SIZES + [[0, 0, 0, 0, 0]], n=n,
                **blocks)


@pytest.mark.parametrize("bits", [4, 8])
def test_pallas_gpu_lowers_for_device(bits):
  """Lowering to Triton IR runs on the CPU and catches unsupported ops and block shapes."""
  g, k, n, qg = 8, 4096, 1536, 128
  fn = jax.jit(lambda *a: grouped_matmul(*a, bits=bits, quant_group_size=qg,
                                         backend="pallas_gpu"))
  fn.trace(jax.ShapeDtypeStruct((16, k), jnp.bfloat16),
           jax.ShapeDtypeStruct((g, k // 2, n), jnp.uint8) if bits == 4
           else jax.ShapeDtypeStruct((g, k, n), jnp.int8),
           jax.ShapeDtypeStruct((g,), jnp.int32),
           jax.ShapeDtypeStruct((g, k // qg, n), jnp.float32),
           jax.ShapeDtypeStruct((g, k // qg, n), jnp.float32)).lower(lowering_platforms=("cuda",))


def test_compiled_on_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip(f"needs a real GPU: on {jax.default_backend()} the kernel only runs interpreted "
                "(tested above)")
  rng = np.random.default_rng(0)
  g, k, n, qg = 8, 1024, 768, 128
  x = jnp.asarray(rng.standard_normal((300, k)), jnp.bfloat16)
  scale = jnp.asarray(rng.uniform(0.5, 1.5, (g, k // qg, n)) * 0.01, jnp.float32)
  offset = -8 * scale
  for bits in (4, 8):
    qv = rng.integers(0, 16, (g, k, n)) if bits == 4 else rng.integers(-128, 128, (g, k, n))
    q = _pack(jnp.asarray(qv), qg) if bits == 4 else jnp.asarray(qv, jnp.int8)
    for gs in ([0, 100, 3, 0, 120, 7, 50, 0], [0, 2, 0, 0, 1, 0, 5, 0]):  # prefill, decode
      gs = jnp.asarray(gs, jnp.int32)
      got = _run("pallas_gpu", x, q, gs, scale, offset, bits, qg)
      want = _run("ragged_dot", x, q, gs, scale, offset, bits, qg)
      got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
      np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())


def test_compiled_on_tpu():
  if jax.default_backend() != "tpu":
    pytest.skip(f"needs a real TPU: on {jax.default_backend()} the kernel only runs interpreted "
                "(tested above)")
  rng = np.random.default_rng(0)
  g, k, n, qg = 8, 1024, 768, 128
  x = jnp.asarray(rng.standard_normal((300, k)), jnp.bfloat16)
  gs = jnp.asarray([0, 100, 3, 0, 120, 7, 50, 0], jnp.int32)
  scale = jnp.asarray(rng.uniform(0.5, 1.5, (g, k // qg, n)) * 0.01, jnp.float32)
  offset = -8 * scale
  for bits in (4, 8):
    qv = rng.integers(0, 16, (g, k, n)) if bits == 4 else rng.integers(-128, 128, (g, k, n))
    q = _pack(jnp.asarray(qv), qg) if bits == 4 else jnp.asarray(qv, jnp.int8)
    got = _run("pallas_tpu", x, q, gs, scale, offset, bits, qg)
    want = _run("ragged_dot", x, q, gs, scale, offset, bits, qg)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())


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
  for block_k in (48, 16):  # K tiles hold whole quant groups of 32
    with pytest.raises(ValueError, match="block_k must be a positive multiple of "
                                         "quant_group_size=32"):
      grouped_matmul(x, q, gs, s, o, backend="pallas_tpu", interpret=True, block_k=block_k,
                     **kw)
  (x, q, s, o), _ = _operands(4, jnp.float32, qg=48)  # K=192: 4 groups of 48
  with pytest.raises(ValueError, match="power-of-two quant_group_size, got 48"):
    grouped_matmul(x, q, gs, s, o, bits=4, quant_group_size=48, backend="pallas_gpu",
                   interpret=True)
