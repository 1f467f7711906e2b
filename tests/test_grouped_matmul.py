"""Grouped matmul: the oracle against a plain loop, the CPU loop and the TPU and GPU kernels
(interpret mode) against the oracle, over empty groups, one group holding every row, ragged
sizes, rows past the last group, and int8 weights with per-group, per-channel scales."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.grouped_matmul import default_backend, grouped_matmul
from pallas_kernels.int8_matmul import quantize_per_channel

K, N = 200, 72  # neither a multiple of the TPU tiles: padded inside
# Rows per group (G = 5): empty groups first, last and between; one group holding every row;
# sizes that straddle 32-row tiles; rows past the last group (M > sum).
GROUP_SIZES = [[0, 3, 0, 40, 1], [0, 0, 45, 0, 0], [7, 33, 9, 0, 2], [0, 0, 0, 0, 0]]
M = 51
TPU_BLOCKS = dict(block_m=32, block_n=128, block_k=128)
# Rows per item 16 (M=51 over 5 groups), 2 column tiles (N padded to 128), 4 K steps (K to 256).
GPU_BLOCKS = dict(block_n=64, block_k=64)


def _operands(dtype, quantized: bool, seed: int = 0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((M, K)), dtype)
  w = jnp.asarray(rng.standard_normal((5, K, N)) * 0.1, jnp.float32)
  if quantized:
    wq, scale = jax.vmap(quantize_per_channel)(w)  # [G, K, N] int8, [G, N]
    return x, wq, scale
  return x, w.astype(dtype), None


def test_oracle_is_a_loop_over_groups():
  x, w, _ = _operands(jnp.float32, False)
  for sizes in GROUP_SIZES:
    got = np.asarray(grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32)))
    want = np.zeros((M, N), np.float32)
    start = 0
    for g, size in enumerate(sizes):
      want[start:start + size] = np.asarray(x[start:start + size]) @ np.asarray(w[g])
      start += size
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not got[start:].any()  # rows past the last group are zero


def _check(backend: str, dtype, mode: str | None, **kw):
  x, w, scale = _operands(jnp.dtype(dtype), mode is not None)
  fn = jax.jit(lambda x, w, gs, s: grouped_matmul(x, w, gs, s, mode=mode or "w8a16",
                                                  backend=backend, **kw))
  for sizes in GROUP_SIZES:
    gs = jnp.asarray(sizes, jnp.int32)
    got = fn(x, w, gs, scale)
    want = grouped_matmul(x, w, gs, scale, mode=mode or "w8a16")
    assert got.shape == (M, N) and got.dtype == x.dtype
    tol = 2e-2 if dtype == "bfloat16" else 1e-5  # bf16: output rounding only
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol, err_msg=f"group sizes {sizes}")
    assert not np.asarray(got[sum(sizes):], np.float32).any()


_slow = pytest.mark.slow
CASES = [pytest.param(d, m, id=f"{d}-{m or 'float'}", marks=[_slow] if slow else [])
         for d, m, slow in [("float32", None, False), ("float32", "w8a8", False),
                            ("float32", "w8a16", True), ("bfloat16", None, True),
                            ("bfloat16", "w8a8", True)]]


@pytest.mark.parametrize("dtype,mode", CASES)
def test_xla_matches_oracle(dtype, mode):
  _check("xla", dtype, mode)  # float: batched blocks; int8: the loop
  _check("xla", dtype, mode, block_m=8)  # the loop, many tiles per group


@pytest.mark.parametrize("dtype,mode", CASES)
def test_pallas_tpu_matches_oracle(dtype, mode):
  _check("pallas_tpu", dtype, mode, interpret=True, **TPU_BLOCKS)


@pytest.mark.parametrize("mode", [pytest.param(None, marks=_slow), "w8a8"])
def test_pallas_tpu_detect_races(mode):
  """The strict TPU interpreter, two simulated cores splitting the column tiles."""
  x, w, scale = _operands(jnp.float32, mode is not None)
  gs = jnp.asarray([0, 20, 0, 25, 3], jnp.int32)
  params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
  pltpu.reset_tpu_interpret_mode_state()
  try:
    got = grouped_matmul(x, w, gs, scale, mode=mode or "w8a16", backend="pallas_tpu",
                         interpret=params, **TPU_BLOCKS)
    assert not tpu_interpret.races.races_found
  finally:
    pltpu.reset_tpu_interpret_mode_state()
  want = grouped_matmul(x, w, gs, scale, mode=mode or "w8a16")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [None, "w8a16", "w8a8"])
def test_pallas_tpu_lowers_for_device(mode):
  """Lowering to Mosaic runs on the CPU and catches unsupported ops and block shapes."""
  quantized = mode is not None
  fn = jax.jit(lambda x, w, gs, s: grouped_matmul(x, w, gs, s, mode=mode or "w8a16",
                                                  backend="pallas_tpu"))
  fn.trace(jax.ShapeDtypeStruct((256, 2048), jnp.bfloat16),
           jax.ShapeDtypeStruct((8, 2048, 1536), jnp.int8 if quantized else jnp.bfloat16),
           jax.ShapeDtypeStruct((8,), jnp.int32),
           jax.ShapeDtypeStruct((8, 1536), jnp.float32) if quantized else None,
           ).lower(lowering_platforms=("tpu",))


@pytest.mark.parametrize("dtype,mode", CASES)
def test_pallas_gpu_matches_oracle(dtype, mode):
  _check("pallas_gpu", dtype, mode, interpret=True, **GPU_BLOCKS)


# m=6: under one row tile (padded inside), 16 rows per item; m=300: 64 rows per item
@pytest.mark.parametrize("m", [6, pytest.param(300, marks=_slow)])
def test_pallas_gpu_random_group_sizes(m):
  """Random splits of up to m rows over 8 groups, many of them empty, rows left past the last."""
  rng = np.random.default_rng(m)
  x = jnp.asarray(rng.standard_normal((m, K)), jnp.float32)
  w, scale = jax.vmap(quantize_per_channel)(jnp.asarray(rng.standard_normal((8, K, N)) * 0.1))
  fn = jax.jit(lambda x, w, gs, s: grouped_matmul(x, w, gs, s, backend="pallas_gpu",
                                                  interpret=True))
  for _ in range(3):
    sizes = rng.multinomial(rng.integers(m // 2, m + 1), rng.dirichlet(np.full(8, 0.3)))
    gs = jnp.asarray(sizes, jnp.int32)
    got, want = fn(x, w, gs, scale), grouped_matmul(x, w, gs, scale)
    assert got.shape == (m, N)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5,
                               err_msg=f"group sizes {sizes}")
    assert not np.asarray(got[sizes.sum():]).any()


@pytest.mark.parametrize("mode", [None, "w8a16", "w8a8"])
def test_pallas_gpu_lowers_for_device(mode):
  """Lowering to Triton IR runs on the CPU and catches unsupported ops and block shapes."""
  quantized = mode is not None
  fn = jax.jit(lambda x, w, gs, s: grouped_matmul(x, w, gs, s, mode=mode or "w8a16",
                                                  backend="pallas_gpu"))
  fn.trace(jax.ShapeDtypeStruct((16, 2048), jnp.bfloat16),
           jax.ShapeDtypeStruct((8, 2048, 1536), jnp.int8 if quantized else jnp.bfloat16),
           jax.ShapeDtypeStruct((8,), jnp.int32),
           jax.ShapeDtypeStruct((8, 1536), jnp.float32) if quantized else None,
           ).lower(lowering_platforms=("cuda",))


def test_default_backend():
  want = {"cpu": "xla", "tpu": "pallas_tpu", "gpu": "pallas_gpu"}[jax.default_backend()]
  assert default_backend() == want


def test_compiled_on_tpu():
  if jax.default_backend() != "tpu":
    pytest.skip(f"needs a real TPU: on {jax.default_backend()} the kernel only runs interpreted "
                "(tested above)")
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((300, 1024)), jnp.bfloat16)
  w, scale = jax.vmap(quantize_per_channel)(jnp.asarray(rng.standard_normal((8, 1024, 768))))
  gs = jnp.asarray([0, 100, 3, 0, 120, 7, 50, 0], jnp.int32)
  for s, wt in ((None, w.astype(jnp.bfloat16)), (scale, w)):
    got = jax.jit(lambda *a: grouped_matmul(*a, backend="pallas_tpu"))(x, wt, gs, s)
    want = grouped_matmul(x, wt, gs, s)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=5e-2, rtol=2e-2)


def test_compiled_on_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip(f"needs a real GPU: on {jax.default_backend()} the kernel only runs interpreted "
                "(tested above)")
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((300, 1024)), jnp.bfloat16)
  w, scale = jax.vmap(quantize_per_channel)(jnp.asarray(rng.standard_normal((8, 1024, 768))))
  for gs in ([0, 100, 3, 0, 120, 7, 50, 0], [0, 2, 0, 0, 1, 0, 5, 0]):  # prefill, decode rows
    gs = jnp.asarray(gs, jnp.int32)
    for s, wt, mode in ((None, w.astype(jnp.bfloat16), "w8a16"), (scale, w, "w8a16"),
                        (scale, w, "w8a8")):
      got = jax.jit(lambda *a: grouped_matmul(*a, mode=mode, backend="pallas_gpu"))(
          x, wt, gs, s)
      want = grouped_matmul(x, wt, gs, s, mode=mode)
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                 atol=5e-2, rtol=2e-2)


def test_bad_arguments_raise():
  x, w, scale = _operands(jnp.float32, True)
  gs = jnp.zeros((5,), jnp.int32)
  with pytest.raises(ValueError, match="need a scale"):
    grouped_matmul(x, w, gs)
  with pytest.raises(ValueError, match="shapes do not match"):
    grouped_matmul(x, w, gs[:4], scale)
  with pytest.raises(ValueError, match="unknown grouped matmul backend"):
    grouped_matmul(x, w, gs, scale, backend="cuda")
  with pytest.raises(ValueError, match="expected"):
    grouped_matmul(x, w, gs, scale[:, :4])
  for blocks in (dict(block_m=48), dict(block_n=8), dict(block_k=0)):  # Triton tiles
    name = next(iter(blocks))
    with pytest.raises(ValueError, match=f"{name} must be a power of two >= 16"):
      grouped_matmul(x, w, gs, scale, backend="pallas_gpu", interpret=True, **blocks)


@pytest.mark.slow
def test_device_bench_script_smoke(tmp_path):
  """The device benchmark's grouped matmul part runs end to end (tiny shapes, the TPU kernel
  interpreted) and every backend, float, int8 and group-wise int4, agrees with ragged_dot."""
  from jinfer.bench.kernels import main
  out = tmp_path / "bench.json"
  report = main(["--smoke", "--skip", "attention", "--skip", "int8_matmul", "--skip",
                 "int4_matmul", "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(report))
  gmm = [r for r in report["results"] if r["op"] == "grouped_matmul"]
  assert {(r["backend"], r["mode"]) for r in gmm} == {
      (b, m) for b in ("ragged_dot", "pallas_tpu") for m in ("float32", "w8a16", "w8a8", "int4")}
  for r in gmm:
    assert r["ms"] > 0 and r["max_abs_err_vs_reference"] < 1e-4
    assert sum(r["group_sizes"]) == r["m"]
