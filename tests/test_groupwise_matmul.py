"""Group-wise quantized matmul: the packing against a literal numpy reading of the format, the
oracle against float64, and every backend (the CPU path, both Pallas kernels in interpret mode)
against the oracle on ragged shapes; lowering to Mosaic TPU and Triton; bad inputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.groupwise_matmul import (BACKENDS, default_backend, dequantize,
                                             groupwise_matmul, pack_int4, unpack_int4)
from tests.fuzz import fuzz_settings

KERNELS = [("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")]
# Jitted: one compile per shape, not one per op and shape.
_pack_int4 = jax.jit(pack_int4, static_argnums=1)
_unpack_int4 = jax.jit(unpack_int4, static_argnums=1)
_dequantize = jax.jit(dequantize, static_argnames=("bits", "group_size"))


def _np_pack(qv: np.ndarray, g: int) -> np.ndarray:
  """[K, N] values in [0, 16) -> [K/2, N] uint8, as the format says: byte row j of a group holds
  row j in its low nibble and row j + g/2 in its high one."""
  k, n = qv.shape
  grp = qv.reshape(k // g, g, n).astype(np.uint8)
  return (grp[:, :g // 2] | (grp[:, g // 2:] << 4)).reshape(k // 2, n)


def _operands(m, k, n, g, bits, dtype, seed=0):
  """(x, q, scale, offset) and the float64 weight they stand for. Affine groups: an int4
  group's values centre near zero (offset ~ -8 scale) with a per-group shift."""
  rng = np.random.default_rng(seed)
  qv = rng.integers(0, 16, (k, n)) if bits == 4 else rng.integers(-128, 128, (k, n))
  scale = rng.uniform(0.5, 1.5, (k // g, n)).astype(np.float32) * (0.02 if bits == 4 else 0.001)
  offset = (-(8.0 if bits == 4 else 0.0) * scale
            + rng.uniform(-0.01, 0.01, (k // g, n))).astype(np.float32)
  w64 = qv * np.repeat(scale, g, 0).astype(np.float64) + np.repeat(offset, g, 0)
  q = _np_pack(qv, g) if bits == 4 else qv.astype(np.int8)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  return (x, jnp.asarray(q), jnp.asarray(scale), jnp.asarray(offset)), w64


# The oracle, jitted: compiled once per shape for every backend it checks.
_oracle = jax.jit(lambda *a, bits, group_size: groupwise_matmul(
    *a, bits=bits, group_size=group_size, backend="reference"),
                  static_argnames=("bits", "group_size"))


def _tolerance(backend: str, m: int, bits: int, dtype) -> float:
  """Per output, as a fraction of max|x_row| * sum_k |w_kn| (what an error per weight or per
  activation element scales with: outputs themselves can cancel to near zero)."""
  if jnp.dtype(dtype) == jnp.bfloat16:
    # The kernels round each dequantized weight to bf16 (2**-9 relative) and all round the output
    # (2**-9 of |y|, itself at most the scale).
    return 2 ** -8
  if backend == "xla" and bits == 4 and m == 1:
    return 1 / 64516 + 1e-6  # 16-bit activations (see xla.py)
  return 1e-6  # f32: summation order


def _check(backend, m, k, n, g, bits, dtype, seed=0, **kw):
  args, w64 = _operands(m, k, n, g, bits, jnp.dtype(dtype), seed)
  got = jax.jit(lambda *a: groupwise_matmul(*a, bits=bits, group_size=g, backend=backend,
                                            **kw))(*args)
  want = _oracle(*args, bits=bits, group_size=g)
  assert got.shape == (m, n) and got.dtype == args[0].dtype
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = np.abs(np.asarray(args[0], np.float64)).max(1, keepdims=True) * np.abs(w64).sum(0)
  bound = _tolerance(backend, m, bits, dtype) * scale + 1e-6
  err = np.abs(got - want)
  assert (err <= bound).all(), f"max error / bound {(err / bound).max():.3g}"


# -- the format ----------------------------------------------------------------------------------

@pytest.mark.fuzz
@fuzz_settings(8)
@given(groups=st.integers(1, 4), half=st.sampled_from([1, 2, 16, 64]), n=st.integers(1, 9),
       seed=st.integers(0, 2**16))
def test_pack_int4_is_the_spec_and_round_trips(groups, half, n, seed):
  g = 2 * half
  qv = np.random.default_rng(seed).integers(0, 16, (groups * g, n))
  packed = _pack_int4(jnp.asarray(qv), g)
  assert packed.dtype == jnp.uint8 and packed.shape == (groups * half, n)
  np.testing.assert_array_equal(np.asarray(packed), _np_pack(qv, g))
  np.testing.assert_array_equal(np.asarray(_unpack_int4(packed, g)), qv)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_is_the_spec(bits):
  """With a leading (expert) axis, as stacked weights have."""
  per = [_operands(1, 64, 24, 16, bits, jnp.float32, seed=s) for s in range(3)]
  q, scale, offset = (jnp.stack([p[0][i] for p in per]) for i in (1, 2, 3))
  got = _dequantize(q, scale, offset, bits=bits, group_size=16)
  np.testing.assert_allclose(np.asarray(got), np.stack([p[1] for p in per]), rtol=1e-6,
                             atol=1e-7)


@pytest.mark.parametrize("bits,g", [(4, 32), (8, 128)])
def test_oracle_is_float64_matmul(bits, g):
  (x, q, s, o), w64 = _operands(9, 256, 40, g, bits, jnp.float32)
  want = np.asarray(x, np.float64) @ w64
  got = np.asarray(_oracle(x, q, s, o, bits=bits, group_size=g))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# -- backends against the oracle -----------------------------------------------------------------

@pytest.mark.fuzz
@fuzz_settings(6)
@given(m=st.sampled_from([1, 2, 3, 8, 13, 64, 70]), groups=st.integers(1, 6),
       g=st.sampled_from([32, 64, 128]), n=st.integers(1, 200), bits=st.sampled_from([4, 8]),
       dtype=st.sampled_from(["float32", "bfloat16"]))
def test_xla_matches_oracle(m, groups, g, n, bits, dtype):
  _check("xla", m, groups * g, n, g, bits, dtype)


def test_xla_one_row_int4_error_bound():
  """The one-row int4 path's 16-bit activations stay within max|x| / 64,516 per element of the
  float ones, even beside an outlier channel 50x the rest (it sets the row's digit scale)."""
  (x, q, s, o), w64 = _operands(1, 1536, 576, 32, 4, jnp.float32, seed=3)
  x = x.at[:, 7].multiply(50.0)
  got = np.asarray(jax.jit(lambda *a: groupwise_matmul(*a, bits=4, group_size=32,
                                                       backend="xla"))(x, q, s, o), np.float64)
  want = np.asarray(x, np.float64) @ w64
  bound = float(jnp.abs(x).max()) / 64516 * np.abs(w64).sum(0)
  err = np.abs(got - want)
  assert (err <= bound * 1.01 + 1e-5).all() and err.max() > 0  # not float activations


# (M, K, N, g, bits, dtype, blocks): M never a multiple of the M tile; N off the tiles.
FAST = [
    # 3 M tiles, 3 N tiles; K in 5 steps of 2 groups, padded by one (TPU: K tiles are whole
    # lanes), or in 9 steps of 1 (GPU).
    (37, 576, 300, 64, 4, "bfloat16", dict(block_m=16, block_n=128, block_k=256)),
    # Decode-sized M, K in one tile, 3 groups.
    (1, 96, 200, 32, 8, "float32", {}),
]
SLOW = [
    (5, 384, 136, 128, 4, "float32", dict(block_k=256)),
    (40, 512, 256, 32, 4, "float32", dict(block_m=16, block_n=128, block_k=128)),
    (3, 1152, 128, 64, 8, "bfloat16", {}),
    (70, 256, 72, 32, 8, "float32", dict(block_m=32)),
    (2, 768, 576, 128, 4, "bfloat16", {}),
]


@pytest.mark.parametrize("case", [pytest.param(c, id="-".join(map(str, c[:6]))) for c in FAST]
                         + [pytest.param(c, id="-".join(map(str, c[:6])),
                                         marks=pytest.mark.slow) for c in SLOW])
@pytest.mark.parametrize("backend", [b for b, _ in KERNELS])
def test_kernel_matches_oracle(backend, case):
  *shape, blocks = case
  interpret = True
  if backend == "pallas_tpu" and case is FAST[0]:
    # The strict TPU interpreter on the case with every kind of tile: it fails on races,
    # out-of-bounds reads and uninitialized (NaN-filled) scratch, where True clamps silently;
    # two simulated cores split the parallel grid axes.
    interpret = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
  pltpu.reset_tpu_interpret_mode_state()
  try:
    _check(backend, *shape, interpret=interpret, **blocks)
    assert interpret is True or not tpu_interpret.races.races_found
  finally:
    pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.slow
@pytest.mark.fuzz
@fuzz_settings(12)
@given(backend=st.sampled_from(BACKENDS), m=st.integers(1, 48), groups=st.integers(1, 12),
       g=st.sampled_from([32, 64, 128]), n=st.integers(1, 300), bits=st.sampled_from([4, 8]),
       dtype=st.sampled_from(["float32", "bfloat16"]), block_k=st.sampled_from([128, 256, 512]),
       seed=st.integers(0, 2**16))
def test_every_backend_matches_oracle_fuzzed(backend, m, groups, g, n, bits, dtype, block_k,
                                             seed):
  kw = {} if backend in ("reference", "xla") else dict(interpret=True, block_k=block_k)
  _check(backend, m, groups * g, n, g, bits, dtype, seed=seed, **kw)


@pytest.mark.parametrize("backend,platform", KERNELS)
@pytest.mark.parametrize("bits,g,k", [(4, 32, 4096), (4, 128, 1536), (8, 128, 4096),
                                      (4, 32, 96)])  # the last: K in one tile, unpadded
def test_lowers_for_device(backend, platform, bits, g, k):
  """Lowering to Mosaic / Triton IR runs on the CPU and catches unsupported ops and block shapes."""
  n = 1536
  fn = jax.jit(lambda *a: groupwise_matmul(*a, bits=bits, group_size=g, backend=backend))
  fn.trace(jax.ShapeDtypeStruct((8, k), jnp.bfloat16),
           jax.ShapeDtypeStruct((k // 2, n), jnp.uint8) if bits == 4
           else jax.ShapeDtypeStruct((k, n), jnp.int8),
           jax.ShapeDtypeStruct((k // g, n), jnp.float32),
           jax.ShapeDtypeStruct((k // g, n), jnp.float32)).lower(lowering_platforms=(platform,))


@pytest.mark.parametrize("backend,platform", KERNELS)
@pytest.mark.parametrize("bits", [4, 8])
def test_compiled_on_device(backend, platform, bits):
  if jax.default_backend() != platform.replace("cuda", "gpu"):
    pytest.skip(f"needs a real {platform.upper()}: on {jax.default_backend()} the kernel only "
                "runs interpreted (tested above)")
  _check(backend, 40, 4096, 1536, 128, bits, "bfloat16")


def test_default_backend_is_picked_when_traced():
  """And an interpret flag meant for the Pallas kernels passes through the XLA path unused."""
  want = {"cpu": "xla", "tpu": "pallas_tpu", "gpu": "pallas_gpu"}[jax.default_backend()]
  assert default_backend() == want
  args, _ = _operands(3, 64, 16, 32, 4, jnp.float32)
  got = jax.jit(lambda *a: groupwise_matmul(*a, bits=4, group_size=32,
                                            interpret=want == "xla"))(*args)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(
      lambda *a: groupwise_matmul(*a, bits=4, group_size=32, backend=want))(*args)))


# -- bad inputs ----------------------------------------------------------------------------------

def _bad_cases():
  (x, q4, s, o), _ = _operands(2, 64, 16, 32, 4, jnp.float32)
  (_, q8, _, _), _ = _operands(2, 64, 16, 32, 8, jnp.float32)
  ok = dict(bits=4, group_size=32)
  return [
      ("bits", (x, q4, s, o), dict(ok, bits=3), "bits must be one of"),
      ("backend", (x, q4, s, o), dict(ok, backend="cuda"), "unknown groupwise matmul backend"),
      ("odd group", (x, q4, s, o), dict(ok, group_size=7), "positive even int"),
      ("group does not divide K", (x, q4, s, o), dict(ok, group_size=48), "does not divide K=64"),
      ("int x", (x.astype(jnp.int32), q4, s, o), ok, "float"),
      ("1-d x", (x[0], q4, s, o), ok, r"\[M, K\]"),
      ("int8 q for 4 bits", (x, q8, s, o), ok, r"4-bit q must be \[32, N\] uint8"),
      ("packed q for 8 bits", (x, q4, s, o), dict(ok, bits=8), r"8-bit q must be \[64, N\] int8"),
      ("scale rows", (x, q4, s[:1], o), ok, r"scale must be \[K/group_size, N\] = \[2, 16\]"),
      ("offset columns", (x, q4, s, o[:, :8]), ok, r"offset must be \[K/group_size, N\]"),
      ("blocks for xla", (x, q4, s, o), dict(ok, backend="xla", block_k=128), "no block sizes"),
  ]


@pytest.mark.parametrize("args,kw,match", [pytest.param(*c[1:], id=c[0]) for c in _bad_cases()])
def test_bad_input_raises(args, kw, match):
  with pytest.raises(ValueError, match=match):
    groupwise_matmul(*args, **kw)


def test_gpu_needs_power_of_two_groups():
  (x, q, s, o), _ = _operands(2, 96, 16, 48, 4, jnp.float32)
  with pytest.raises(ValueError, match="power-of-two group size"):
    groupwise_matmul(x, q, s, o, bits=4, group_size=48, backend="pallas_gpu", interpret=True)
