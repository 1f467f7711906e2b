"""quantization="mxfp4" / "nvfp4": the rounding against a literal reading of the formats, a
perplexity bound on a tiny model, the model over codebook weights against the float model over
them dequantized, the saved round trip, batch invariance in the engine, and bad options."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jinfer.engine.weight_quantization import check_config, quantize_weights
from jinfer.errors import ParameterError
from jinfer.models import CausalLM, linear_kernels
from jinfer.quant import microfloat
from jinfer.quant.groupwise import GroupwiseArray, dequantize_like
from jinfer.quant.model import quantize_model
from jinfer.quant.qarray import QArray
from pallas_kernels.groupwise_matmul.packing import unpack_int4
from jinfer.weights.quantized_checkpoint import load_quantized, save_quantized
from tests.engine_fixtures import make_engine, random_prompts, run_tokens
from tests.paged_batch import PagedBatch
from tests.test_quant_algorithms import MHA, _forward, _logits, _params, _tokens
from tests.test_quantized_engine import GREEDY, _float_like

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])  # the format's magnitudes


def _nearest_e2m1(v: np.ndarray) -> np.ndarray:
  """Each value of v rounded to the nearest signed e2m1 value, saturating (ties: either)."""
  mags = E2M1[np.abs(np.abs(v)[..., None] - E2M1).argmin(-1)]
  return np.sign(v) * mags


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_rounding_is_the_format(fmt):
  """Block scales are what the format can store (a power of two; e4m3 times one tensor scale),
  every value is a scale times an e2m1 value, the nearest one for that scale."""
  rng = np.random.default_rng(0)
  g = microfloat.FORMATS[fmt]
  w = rng.standard_normal((2, 4 * g, 12)).astype(np.float32)
  w[0, :g, 0] = 0  # an all-zero block
  w[1, g:2 * g, 1] *= 40  # a block far above the rest
  a = microfloat.quantize(jnp.asarray(w), fmt)
  assert a.offset is None and a.table.shape == (2, 16) and a.scale.shape == (2, 4, 12)
  scale = 2 * np.asarray(a.scale, np.float64)  # held halved for the doubled table
  if fmt == "mxfp4":
    nz = scale[scale > 0]
    np.testing.assert_array_equal(nz, 2.0 ** np.round(np.log2(nz)))
  else:
    tensor = np.abs(w).max(axis=(1, 2)) / (6 * 448)  # [layers]
    block = scale / tensor[:, None, None]
    np.testing.assert_allclose(block, block.astype(ml_dtypes.float8_e4m3fn).astype(np.float64),
                               rtol=1e-6)
  assert scale[0, 0, 0] == 0 or np.all(np.asarray(a.dequantize())[0, :g, 0] == 0)
  codes = np.asarray(unpack_int4(a.q, g)).reshape(2, 4, g, 12)
  vals = microfloat.E2M1_DOUBLED[codes] / 2  # e2m1 values
  s = scale[:, :, None, :]
  with np.errstate(invalid="ignore", divide="ignore"):
    want = _nearest_e2m1(np.where(s > 0, w.reshape(2, 4, g, 12) / s, 0))
  assert np.all(np.abs(vals * s - want * s) <= 1e-6 * np.abs(s) + 1e-30)
  held = microfloat.E2M1_DOUBLED[codes] * np.asarray(a.scale)[:, :, None, :]  # float32
  np.testing.assert_array_equal(np.asarray(a.dequantize()).reshape(2, 4, g, 12), held)


@pytest.fixture(scope="module")
def mha():
  return _params(MHA), CausalLM(MHA)


@pytest.mark.slow
def test_perplexity_bound_on_a_tiny_model(mha):
  """A random 2-layer model (sensitive: int4 RTN in groups of 32, about as many bits, moves its
  perplexity by ~13%): each fp4 format moves it by less than 30%, and by no more than 1.5x what
  that int4 does (a random model's perplexity may go either way)."""
  params, model = mha
  kernels = linear_kernels(MHA)
  ids = _tokens(160, seed=3)

  def ppl(p):  # one compiled forward for every float params tree of these shapes
    batch = PagedBatch(model, p, 1, 16, len(ids))
    batch._fwd = _forward(MHA)
    logits = batch.step([ids], all_rows=True)[:-1]
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return math.exp(float((lse - logits[np.arange(len(ids) - 1), ids[1:]]).mean()))

  base = ppl(params)
  up = lambda q: ppl(dequantize_like(q, params)) / base - 1
  int4 = up(quantize_model(params, kernels, group_size=32, verbose=False))
  for fmt in microfloat.FORMATS:
    fp4 = up(quantize_model(params, kernels, fmt=fmt, verbose=False))
    assert 0 < abs(fp4) < 0.3 and abs(fp4) <= 1.5 * abs(int4), (fmt, fp4, int4)


@pytest.mark.slow
def test_the_model_runs_its_own_weights_exactly(tmp_path, fmt="nvfp4"):
  """An MoE model in nvfp4 gives the logits of the float model over its weights dequantized:
  attention's projections through the codebook matmul, the experts through the grouped matmul
  widened to int8 codes (it has no codebook form); the int8 head is left out, its own error
  is int8's. Saved and loaded back, the weights are the same arrays."""
  config = dataclasses.replace(MHA, architecture="qwen3_moe", num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32, moe_layers=())
  params = _params(config)
  options = check_config(fmt, None)
  q = quantize_weights(config, params, fmt, options, int8_transposed=False)
  kernel, experts = q["layers"]["attn"]["q_proj"]["kernel"], q["layers"]["moe"]["gate_up"]["kernel"]
  assert isinstance(kernel, GroupwiseArray) and kernel.table is not None
  assert experts.table is not None and experts.table.shape == (2, 4, 16)
  assert isinstance(q["embedding"], QArray)  # the tied head: int8
  fp4 = {**q, "embedding": params["embedding"]}
  np.testing.assert_allclose(_logits(config, fp4), _logits(config, _float_like(fp4, params)),
                             rtol=1e-5, atol=1e-5)
  save_quantized(str(tmp_path), q, source="tiny", quantization=fmt, quantization_config=options)
  _, back = load_quantized(str(tmp_path))
  is_q = lambda x: isinstance(x, (GroupwiseArray, QArray))
  assert jax.tree.structure(back, is_leaf=is_q) == jax.tree.structure(q, is_leaf=is_q)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(q)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_mxfp4_engine_is_batch_invariant(tiny_model):
  """A request's greedy tokens and logprobs are the same whichever request shares its batch,
  codebook weights in the engine (two step shapes to compile: two 4-token prompts fill one
  8-token prefill, then 2-row decode steps)."""
  a, b, c = random_prompts(3, seed=1, lo=4, hi=5)
  engine = make_engine(tiny_model, warmup=False, quantization="mxfp4", scan_layers=True,
                       max_num_seqs=2, max_num_batched_tokens=8)
  first = run_tokens(engine, [a, b], GREEDY)
  assert run_tokens(engine, [b, c], GREEDY)[0] == first[1]


def test_bad_options():
  with pytest.raises(ParameterError, match="method must be one of rtn, awq for nvfp4"):
    check_config("nvfp4", {"method": "gptq"})
  with pytest.raises(ParameterError, match="'group_size' is not an option"):
    check_config("mxfp4", {"group_size": 64})
  odd = dataclasses.replace(MHA, hidden_size=40, head_dim=10, vocab_size=32)
  with pytest.raises(ValueError, match="layers/attn/k_proj: nvfp4 blocks of 16 do not divide "
                                       "its K=40"):
    quantize_model(_params(odd), linear_kernels(odd), fmt="nvfp4", verbose=False)
