"""FP8 (e4m3): the float8 matmul against its oracle, the quantizer against ml_dtypes' rounding,
`quantization="fp8"` in the engine (W8A8-FP8 and W8A16-FP8), saved and loaded back."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jinfer import LLM
from jinfer.engine import weight_quantization
from jinfer.engine.engine_config import EngineConfig
from jinfer.engine.weight_quantization import check_config, quantize_weights
from jinfer.errors import ParameterError
from jinfer.loader import load_model
from jinfer.quant.qarray import QArray, quantize, relayout
from pallas_kernels.fp8_matmul import FP8, fp8_matmul, quantize_per_channel_fp8


def _weights(k=96, n=80, seed=0):
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((k, n)).astype(np.float32) * rng.uniform(0.01, 1, n).astype(np.float32)
  w[:, 3] = 0.0  # an all-zero channel
  return w


def test_per_channel_rounding_is_ml_dtypes_float8():
  """Each channel scaled onto [-448, 448] and rounded to nearest (even) float8 e4m3, as
  ml_dtypes (numpy's float8) rounds; zero channels stay zero."""
  w = _weights()
  q, scale = quantize_per_channel_fp8(jnp.asarray(w))
  amax = np.abs(w).max(0)
  want_scale = np.where(amax == 0, 1, amax / 448).astype(np.float32)
  # XLA divides by the constant as a multiplication by its reciprocal: within an ulp.
  np.testing.assert_allclose(np.asarray(scale), want_scale, rtol=2.5e-7)
  want = (w / np.asarray(scale)).astype(ml_dtypes.float8_e4m3fn)
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want.view(np.uint8))
  assert not np.any(np.isnan(np.asarray(q).astype(np.float32)))


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_fp8_matmul_xla_matches_reference(mode, transpose_w):
  """XLA's float8 dot against the float32 oracle (every e4m3 product is exact in float32):
  only the accumulation order differs."""
  w = _weights()
  q, scale = quantize_per_channel_fp8(jnp.asarray(w))
  wq = q.T if transpose_w else q
  x = jnp.asarray(np.random.default_rng(1).standard_normal((5, w.shape[0])), jnp.float32)
  run = lambda backend, x: fp8_matmul(x, wq, scale, mode=mode, backend=backend,
                                      transpose_w=transpose_w)
  ref, got = run("reference", x), run("xla", x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
  dequantized = np.asarray(q, np.float32) * np.asarray(scale)
  if mode == "w8a16":  # the weights the format stands for, float activations
    np.testing.assert_allclose(np.asarray(ref), np.asarray(x) @ dequantized, rtol=1e-5,
                               atol=1e-5)


def test_fp8_matmul_checks_its_operands():
  w = jnp.zeros((8, 4), FP8)
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    fp8_matmul(jnp.zeros((2, 8)), w.astype(jnp.int8), jnp.ones(4))
  with pytest.raises(ValueError, match="shapes do not match"):
    fp8_matmul(jnp.zeros((2, 6)), w, jnp.ones(4))


def test_fp8_quantizes_every_linear_kernel(tiny_model_dir):
  """Every decoder-layer kernel becomes float8 values with a scale per output channel, each
  value within e4m3's half step (1/16 relative) of its weight; the LM head int8."""
  config, params, _ = load_model(tiny_model_dir, load_tokenizer=False)
  q = quantize_weights(config, params, "fp8", check_config("fp8", None), int8_transposed=True)
  is_q = lambda x: isinstance(x, QArray)
  leaves = [x for x in jax.tree.leaves(q, is_leaf=is_q) if is_q(x)]
  assert [x.values.dtype for x in leaves].count(FP8) == 7  # q, k, v, o, gate, up, down
  assert q["lm_head"]["kernel"].values.dtype == jnp.int8
  w = np.asarray(params["layers"]["mlp"]["down_proj"]["kernel"])  # [L, F, E]
  got = q["layers"]["mlp"]["down_proj"]["kernel"]  # stored transposed: [L, E, F]
  deq = np.asarray(got.values, np.float32) * np.asarray(got.scale)[..., None]
  err = np.abs(deq.swapaxes(1, 2) - w)
  # Normal values round to 3 mantissa bits; subnormals (below 2^-6) to steps of 2^-9.
  assert np.all(err <= np.maximum(np.abs(w) / 16, np.asarray(got.scale)[:, None, :] * 2**-10))


@pytest.mark.parametrize("options, says", [
    ({"activations": "int8"}, "activations must be one of fp8, float"),
    ({"alpha": 0.5}, "'alpha' is not an option of quantization='fp8'"),
])
def test_bad_fp8_options_fail_before_loading(tiny_model_dir, options, says):
  with pytest.raises(ParameterError, match=says) as e:
    LLM(tiny_model_dir, warmup=False, quantization="fp8", quantization_config=options)
  assert e.value.param == "quantization_config"


def test_fp8_saves_and_loads_back_with_its_activations(tiny_model_dir, tmp_path):
  """W8A16-FP8 (float activations) saved and loaded: the float8 values as they were, and the
  engine config it loads with runs them the same way (no quantizing again)."""
  config, params, _ = load_model(tiny_model_dir, load_tokenizer=False)
  options = check_config("fp8", {"activations": "float"})
  q = quantize_weights(config, params, "fp8", options, int8_transposed=True)
  path = str(tmp_path / "saved")
  weight_quantization.save(path, q, source=tiny_model_dir, quantization="fp8",
                           quantization_config=options)
  _, back, _, engine_config = weight_quantization.load(EngineConfig(), path, jnp.float32,
                                                       load_tokenizer=False)
  assert engine_config.model.quantization == "fp8"
  assert engine_config.model.quantization_config == {"activations": "float"}
  kernels = engine_config.resolve(config, jnp.float32).kernel_options()
  assert kernels.matmul_mode == "w8a16"
  is_q = lambda x: isinstance(x, QArray)
  for a, b in zip(jax.tree.leaves(q, is_leaf=is_q), jax.tree.leaves(back, is_leaf=is_q)):
    assert type(a) is type(b)
    if is_q(a):
      assert a.values.dtype == b.values.dtype and a.transposed == b.transposed
      np.testing.assert_array_equal(np.asarray(a.values, np.float32),
                                    np.asarray(b.values, np.float32))
      np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
  with pytest.raises(ParameterError, match="quantized as 'fp8'"):
    weight_quantization.load(EngineConfig.of(quantization="int8"), path, jnp.float32,
                             load_tokenizer=False)


@pytest.mark.parametrize("n_in, shape", [(1, (2, 24, 3, 8)), (2, (2, 3, 8, 24))])
def test_relayout_moves_values_exactly(n_in, shape):
  """A kernel stored inputs first, laid out outputs first (and back), is the kernel the
  quantizer stores that way: the CPU's layout for a checkpoint read inputs first."""
  w = jnp.asarray(np.random.default_rng(2).standard_normal(shape), jnp.float32)
  n_out = len(shape) - 1 - n_in
  ins_first = quantize(w, n_in, n_out, store_transposed=False, fmt="fp8")
  outs_first = quantize(w, n_in, n_out, store_transposed=True, fmt="fp8")
  moved = relayout(ins_first, True)
  assert moved.transposed and moved.values.shape == outs_first.values.shape
  np.testing.assert_array_equal(np.asarray(moved.values, np.float32),
                                np.asarray(outs_first.values, np.float32))
  back = relayout(moved, False)
  np.testing.assert_array_equal(np.asarray(back.values, np.float32),
                                np.asarray(ins_first.values, np.float32))
