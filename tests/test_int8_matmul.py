"""int8 matmul: both Pallas kernels (interpret mode on the CPU) against the jnp reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.int8_matmul import int8_matmul, quantize_per_channel, quantize_per_token

KERNELS = [("pallas_tpu", "tpu"), ("pallas_gpu", "gpu")]
# (M, K, N, block sizes): M never a multiple of the M tile; K and N both on and off the tiles.
SHAPES = [
    (1, 256, 128, dict(block_m=32, block_n=128, block_k=128)),  # decode-sized M
    (37, 384, 256, dict(block_m=32, block_n=128, block_k=128)),  # 2 M tiles, 3 K steps
    (50, 200, 72, dict(block_m=32, block_n=128, block_k=128)),  # K, N off the tiles: padded
    (130, 512, 384, {}),  # default blocks
]


# Jitted, the test's own quantization and reference products compile once per shape instead of
# once per op and shape (most of this file's compiles were those).
_quantize_per_channel = jax.jit(quantize_per_channel)
_reference = jax.jit(int8_matmul, static_argnames=("mode", "transpose_w"))


def _operands(m, k, n, dtype, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  w_int8, w_scale = _quantize_per_channel(jnp.asarray(rng.standard_normal((k, n)) * 0.05))
  return x, w_int8, w_scale


def test_quantize_per_channel_roundtrip():
  w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 48)), jnp.float32)
  w = w.at[:, 3].set(0.0)  # an all-zero channel must not divide by zero
  wq, scale = quantize_per_channel(w)
  assert wq.dtype == jnp.int8 and scale.shape == (48,)
  assert int(jnp.max(jnp.abs(wq.astype(jnp.int32)))) == 127
  # Rounding to the nearest step: error at most half a step per element.
  assert bool(jnp.all(jnp.abs(wq * scale[None, :] - w) <= scale[None, :] / 2 + 1e-7))
  assert bool(jnp.all(wq[:, 3] == 0))


def test_quantize_per_token():
  x = jnp.asarray([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]], jnp.float32)
  xq, xs = quantize_per_token(x)
  np.testing.assert_array_equal(np.asarray(xq), [[64, -127, 32], [0, 0, 0]])
  np.testing.assert_allclose(np.asarray(xs), [1.0 / 127, 1.0])


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_reference_close_to_float_matmul(mode):
  x, wq, ws = _operands(16, 256, 64, jnp.float32)
  want = np.asarray(x) @ (np.asarray(wq, np.float32) * np.asarray(ws)[None, :])
  got = np.asarray(int8_matmul(x, wq, ws, mode=mode))
  # W8A16 is exact up to f32 rounding; W8A8 adds per-token activation rounding (~0.4% relative).
  tol = 1e-4 if mode == "w8a16" else 3e-2
  np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("m,k,n,blocks", [
    pytest.param(*s, id=f"{s[0]}x{s[1]}x{s[2]}",
                 # 50x200x72 has two M tiles and K steps too (and padding): fast tier without it.
                 marks=pytest.mark.slow if s[0] == 37 else ()) for s in SHAPES])
@pytest.mark.parametrize("mode,dtype", [("w8a16", "float32"), ("w8a16", "bfloat16"),
                                        ("w8a8", "float32"), ("w8a8", "bfloat16")])
@pytest.mark.parametrize("backend", [b for b, _ in KERNELS])
def test_kernel_matches_reference(backend, mode, dtype, m, k, n, blocks):
  x, wq, ws = _operands(m, k, n, jnp.dtype(dtype))
  fn = jax.jit(lambda x, wq, ws: int8_matmul(x, wq, ws, mode=mode, backend=backend,
                                             interpret=True, **blocks))
  got = fn(x, wq, ws)
  want = _reference(x, wq, ws, mode=mode)
  assert got.shape == (m, n) and got.dtype == x.dtype
  tol = 1e-2 if dtype == "bfloat16" else 1e-5  # bf16: output rounding only
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_pallas_tpu_detect_races(mode):
  """The strict TPU interpreter, two simulated cores splitting the parallel grid axes."""
  x, wq, ws = _operands(37, 256, 200, jnp.float32)
  params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
  pltpu.reset_tpu_interpret_mode_state()
  try:
    got = int8_matmul(x, wq, ws, mode=mode, backend="pallas_tpu", interpret=params, block_m=32,
                      block_n=128, block_k=128)
    assert not tpu_interpret.races.races_found
  finally:
    pltpu.reset_tpu_interpret_mode_state()
  np.testing.assert_allclose(np.asarray(got), np.asarray(int8_matmul(x, wq, ws, mode=mode)),
                             atol=1e-5, rtol=1e-5)


def _exact_int_operands():
  """Integer-valued operands whose products sum past 2**24 in every column.

  Every row of x is +-127 throughout, so its per-token scale is exactly 1 and it quantizes to
  itself; w_scale is 1. Column sums of w are 2**18 + c * 2**11, so every true result is
  127 * 2**11 * (2**7 + c): representable in f32, while the running sums in between are not, and
  an f32 accumulator would round them.
  """
  rng = np.random.default_rng(0)
  m, k, n = 24, 4096, 256
  e = rng.integers(-60, 61, (k // 2, n))
  w = 64 + np.concatenate([e, -e], axis=0)  # [K, N], columns sum to 64 * K = 2**18
  c = rng.integers(-1, 2, n)
  w[: k // 2] += c[None, :]  # + c * 2**11
  x = 127 * np.where(rng.random(m) < 0.5, 1, -1)[:, None] * np.ones((1, k), np.int64)
  want = x @ w  # int64, exact
  assert np.abs(want).max() > 2 ** 24
  return (jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.int8), jnp.ones((n,), jnp.float32),
          want)


@pytest.mark.parametrize("backend", ["reference", "xla"] + [b for b, _ in KERNELS])
def test_w8a8_exact_int32_accumulation(backend):
  x, wq, ws, want = _exact_int_operands()
  kw = {} if backend in ("reference", "xla") else dict(interpret=True, block_k=512)
  got = jax.jit(lambda x, wq, ws: int8_matmul(x, wq, ws, mode="w8a8", backend=backend, **kw))(
      x, wq, ws)
  np.testing.assert_array_equal(np.asarray(got, np.float64), want.astype(np.float64))


@pytest.mark.parametrize("backend,platform", [("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")])
@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_lowers_for_device(backend, platform, mode):
  """Lowering to Mosaic / Triton IR runs on the CPU and catches unsupported ops and block shapes."""
  fn = jax.jit(lambda x, wq, ws: int8_matmul(x, wq, ws, mode=mode, backend=backend))
  fn.trace(jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16),
           jax.ShapeDtypeStruct((4096, 1536), jnp.int8),
           jax.ShapeDtypeStruct((1536,), jnp.float32)).lower(lowering_platforms=(platform,))


@pytest.mark.parametrize("backend,platform", KERNELS)
@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_compiled_on_device(backend, platform, mode):
  if jax.default_backend() != platform:
    pytest.skip(f"needs a real {platform.upper()}: on {jax.default_backend()} the kernel only "
                "runs interpreted (tested above)")
  x, wq, ws = _operands(40, 1024, 768, jnp.bfloat16)
  got = jax.jit(lambda *a: int8_matmul(*a, mode=mode, backend=backend))(x, wq, ws)
  want = int8_matmul(x, wq, ws, mode=mode)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=2e-2, rtol=2e-2)


def test_bad_mode_raises():
  x, wq, ws = _operands(4, 128, 128, jnp.float32)
  with pytest.raises(ValueError, match="unknown int8 matmul mode"):
    int8_matmul(x, wq, ws, mode="w4a16")


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_xla_backend_matches_reference(mode, m, transpose_w):
  """The CPU path (activations as int8 digits, one integer GEMM): W8A8 is the reference's own
  arithmetic (up to the order of the two float scalings); W8A16's 16-bit activations stay within max|x| / 64,516 per element of the float
  ones, even beside an outlier channel 50x the rest."""
  x, w_int8, w_scale = _operands(m, 512, 1024, jnp.float32, seed=3)
  x = x.at[:, 7].multiply(50.0)
  w = w_int8.T if transpose_w else w_int8
  want = _reference(x, w, w_scale, mode=mode, transpose_w=transpose_w)
  got = jax.jit(lambda x, w, s: int8_matmul(x, w, s, mode=mode, backend="xla",
                                            transpose_w=transpose_w))(x, w, w_scale)
  if mode == "w8a8":
    np.testing.assert_allclose(got, want, rtol=1e-6)
  else:
    # Per output: sum_k |err_k| |w_kn| <= max|x| / 64516 * sum_k |w_kn|.
    bound = (jnp.abs(x).max(1)[:, None] / 64516) * (jnp.abs(w_int8.astype(jnp.float32)).sum(0)
                                                    * w_scale)[None, :]
    assert bool(jnp.all(jnp.abs(got - want) <= bound * 1.01 + 1e-5))
    assert float(jnp.abs(got - want).max()) > 0  # the digits are not float activations


def test_xla_backend_rows_are_independent_of_their_batch():
  """Per-token digits and exact integer accumulation: a row's result is bitwise the same
  whatever rows share its GEMM (what the engine's batch invariance needs)."""
  x, w_int8, w_scale = _operands(9, 256, 384, jnp.float32, seed=4)
  for mode in ("w8a16", "w8a8"):
    f = jax.jit(lambda x: int8_matmul(x, w_int8, w_scale, mode=mode, backend="xla"))
    together = np.asarray(f(x))
    alone = np.concatenate([np.asarray(f(x[i:i + 1])) for i in range(9)])
    np.testing.assert_array_equal(together, alone)
