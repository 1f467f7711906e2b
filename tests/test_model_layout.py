"""The v2 model layer on a tiny random model: the scanned and the unrolled stack agree, a step
never copies the KV cache, hidden states come out beside the logits, quantized weights are a
leaf type whose scales never mix layers, and a one-row product is that row of a larger one."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.config import ModelConfig
from jinfer.engine.step_input import empty_step_input, to_step_input
from jinfer.models import CausalLM, linear_kernels, param_shapes, unstack_layers
from jinfer.models.kernel_options import KernelOptions
from jinfer.models.llama import Linear, lm_head
from jinfer.quant.qarray import QArray, quantize, quantize_params
from tests.engine_fixtures import make_engine
from tests.paged_batch import PagedBatch

CONFIG = ModelConfig(architecture="mistral", vocab_size=128, hidden_size=32,
                     intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                     sliding_windows=(None, 6, None), tie_word_embeddings=True)


def _params(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape) * 0.3, s.dtype),
                      param_shapes(CONFIG))


@pytest.mark.slow
def test_scanned_and_unrolled_stacks_agree():
  params = _params()
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 128, n).tolist() for n in (9, 17)]
  outs = []
  for scan in (True, False):
    model = CausalLM(CONFIG, scan_layers=scan)
    batch = PagedBatch(model, params if scan else unstack_layers(params, 3), 2, 4, 40)
    logits = [batch.step(prompts)]
    for tok in (5, 7, 11):  # decodes past layer 1's 6-token window
      logits.append(batch.step([[tok], [tok]]))
    outs.append(np.stack(logits))
  np.testing.assert_allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scan_layers", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_step_does_not_copy_the_kv_cache(scan_layers):
  """The compiled step's temporary memory does not grow with the cache: the cache is updated
  in place and every layer reads its pages where they are."""
  temps = []
  for num_pages in (64, 2048):
    eng = make_engine((CONFIG, _params(), None), warmup=False, max_model_len=64, page_size=4,
                      num_pages=num_pages, max_num_seqs=4, max_num_batched_tokens=32,
                      scan_layers=scan_layers, compilation_cache=False)
    r = eng.runner
    v = r.variant(32)
    inp = to_step_input(empty_step_input(eng.buckets, 32), eng.buckets)
    mem = v.step.lower(v.params, r.kv_cache, inp, None, None, None).compile().memory_analysis()
    temps.append(mem.temp_size_in_bytes)
    cache_bytes = r.kv_cache_bytes
  assert cache_bytes > 2 * max(temps), "the test needs a cache larger than the temporaries"
  assert temps[0] == temps[1], f"temporaries grew with the cache: {temps}"


def test_unrolled_layers_are_views_of_the_stacked_weights():
  """On the CPU the unrolled stack's per-layer arrays alias the stacked ones: an engine runs
  both stacks from one copy of the weights."""
  params = quantize_params(_params(), linear_kernels(CONFIG))
  flat = unstack_layers(params, 3)
  stacked = jax.tree.leaves(params["layers"])  # int8 values, scales, norms
  assert any(leaf.dtype == jnp.int8 for leaf in stacked)
  for i in range(3):
    for leaf, view in zip(stacked, jax.tree.leaves(flat[f"layers_{i}"]), strict=True):
      assert view.unsafe_buffer_pointer() == leaf.unsafe_buffer_pointer() + i * leaf.nbytes // 3
      np.testing.assert_array_equal(view, leaf[i])


def test_hidden_states_come_out_beside_the_logits():
  params = _params()
  batch = PagedBatch(CausalLM(CONFIG), params, 2, 4, 40)
  rng = np.random.default_rng(2)
  logits, hidden = batch.step([rng.integers(0, 128, 7).tolist(), [3, 4]], return_hidden=True)
  assert hidden.shape == (2, CONFIG.hidden_size)
  np.testing.assert_allclose(logits, hidden @ np.asarray(params["embedding"]).T, atol=1e-5,
                             rtol=1e-5)


@pytest.mark.slow
def test_quantized_weights_are_a_leaf_type_with_per_layer_channels():
  params = _params()
  kernels = linear_kernels(CONFIG)
  # [L, Hq, D, E]: 2 contract
  assert kernels["layers"]["attn"]["o_proj"]["kernel"] == (2, 1, False, False)
  assert kernels["layers"]["mlp"]["up_proj"]["kernel"] == (1, 1, False, False)
  # Tied: the embedding [V, E] is the LM head's kernel, contracted over its last axis.
  assert kernels["embedding"] == (1, 1, True, True)
  assert kernels["layers"]["input_norm"]["scale"] is None
  q = quantize_params(params, kernels)
  o = q["layers"]["attn"]["o_proj"]["kernel"]
  assert isinstance(o, QArray) and o.values.dtype == jnp.int8
  assert o.scale.shape == (3, CONFIG.hidden_size)  # one scale per layer and output channel
  emb = q["embedding"]
  assert isinstance(emb, QArray) and emb.scale.shape == (CONFIG.vocab_size,)  # one per row
  err = jnp.abs(emb.values.astype(jnp.float32) * emb.scale[:, None] - params["embedding"])
  assert float(err.max()) <= float(emb.scale.max()) / 2 + 1e-6
  w = params["layers"]["attn"]["o_proj"]["kernel"]  # [L, Hq, D, E]
  for layer in range(3):  # each layer quantized alone gives the same values and scales
    alone = quantize(w[layer], 2, 1)
    np.testing.assert_array_equal(o.values[layer], alone.values)
    np.testing.assert_array_equal(o.scale[layer], alone.scale)
  deq = o.values.astype(jnp.float32) * o.scale[:, None, None, :]
  assert float(jnp.abs(deq - w).max()) <= float(o.scale.max()) / 2 + 1e-6
  # The quantized model runs on them, scanned and unrolled alike, close to the float model.
  prompt = [list(range(3, 20))]
  want = PagedBatch(CausalLM(CONFIG), params, 1, 4, 20).step(prompt)
  kn = KernelOptions(quantization="int8")
  got = [PagedBatch(CausalLM(CONFIG, kn, scan_layers=scan),
                    q if scan else unstack_layers(q, 3), 1, 4, 20).step(prompt)
         for scan in (True, False)]
  # 1e-4: the CPU's int8 path rounds activations to 16-bit digits, and the layouts' float ops
  # differ in the last bit, which can move a digit by one step.
  np.testing.assert_allclose(got[0], got[1], atol=1e-4, rtol=1e-4)
  assert np.abs(got[0] - want).max() < 0.05 * np.abs(want).max()


@pytest.mark.slow  # quick: test_int8_matmul runs both layouts against the reference
def test_quantized_kernels_stored_outputs_first_give_the_same_logits():
  """`linear_kernels(..., transposed=True)` (the CPU's layout) stores the same int8 values
  `[L, out..., in...]`; the model reads either layout to the same logits."""
  params = _params()
  kernels = linear_kernels(CONFIG, transposed=True)
  assert kernels["layers"]["attn"]["o_proj"]["kernel"] == (2, 1, False, True)
  plain, flipped = quantize_params(params, linear_kernels(CONFIG)), quantize_params(params, kernels)
  a, b = plain["layers"]["attn"]["o_proj"]["kernel"], flipped["layers"]["attn"]["o_proj"]["kernel"]
  assert b.transposed and b.values.shape == (3, CONFIG.hidden_size, 4, 8)  # [L, E, Hq, D]
  np.testing.assert_array_equal(b.values, jnp.moveaxis(a.values, 3, 1))
  np.testing.assert_array_equal(b.scale, a.scale)
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 128, n).tolist() for n in (9, 1)]
  logits = [PagedBatch(CausalLM(CONFIG, KernelOptions(quantization="int8", int8_transposed=f)),
                       p, 2, 4, 40).step(prompts) for f, p in ((False, plain), (True, flipped))]
  assert np.isfinite(logits[0]).all()
  np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, n_in", [((32, 48), 1), ((4, 8, 32), 2)])
def test_a_one_row_product_is_that_row_of_a_larger_one(shape, n_in):
  """A one-row step multiplies its own way on the CPU (two half-length dots, and the tied head
  as embedding @ x); the row must come out as it does among others."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3,) + shape[:n_in]), jnp.float32)
  lin = Linear(shape, tuple(f"axis{i}" for i in range(len(shape))), KernelOptions(), n_in=n_in)
  variables = lin.init(jax.random.key(0), x)
  np.testing.assert_allclose(lin.apply(variables, x[:1]), lin.apply(variables, x)[:1],
                             rtol=1e-5, atol=1e-5)
  params, h = _params(), x.reshape(3, -1)[:, :CONFIG.hidden_size]
  head = lambda rows: lm_head(params, CONFIG, KernelOptions(), rows)  # [rows, vocab]
  np.testing.assert_allclose(head(h[:1]), head(h)[:1], rtol=1e-5, atol=1e-5)
