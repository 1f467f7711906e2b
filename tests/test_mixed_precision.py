"""Mixed precision (`quantization="mixed"`): the allocator against brute force, a stack of runs
of different precisions against the same weights dequantized, in the engine without recompiles
and batch-invariant, budgets met by the saved leaves, the save/load round trip, bad options.
Its quality on SmolLM2 is measured by `jinfer.bench.quantization` (docs/quantization.md)."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer import LLM, SamplingParams
from jinfer.engine.engine_config import EngineConfig
from jinfer.errors import ParameterError
from jinfer.loader import load_model
from jinfer.models import CausalLM, layer_runs, linear_kernels, param_shapes
from jinfer.quant import allocation, mixed
from jinfer.quant.allocation import FLOAT, INT4, INT8
from jinfer.quant.groupwise import GroupwiseArray
from jinfer.quant.qarray import QArray, quantize
from jinfer.weights.quantized_checkpoint import load_quantized
from tests.engine_fixtures import (SMALL_POOL, CompileCounter, assert_batch_matches, make_engine,
                                   prefix_sharing_prompts, run_tokens, tiny_hf_dir)

_is_q = lambda x: isinstance(x, (QArray, GroupwiseArray))


# -- the allocator --------------------------------------------------------------------------
def test_the_allocation_fits_is_optimal_and_never_worse_with_more_bytes():
  rng = np.random.default_rng(0)
  units = 6
  nbytes = np.stack([np.full(units, 3200), np.full(units, 820), np.full(units, 500)], 1)
  nbytes = (nbytes * rng.uniform(0.5, 2.0, (units, 1))).astype(np.int64)  # [U, 3]
  loss = np.sort(rng.exponential(1.0, (units, 3)), 1)  # [U, 3] float <= int8 <= int4
  loss[:, FLOAT] = 0
  everything = [np.array(c) for c in itertools.product((FLOAT, INT8, INT4), repeat=units)]
  last = np.inf
  for budget in np.linspace(nbytes[:, INT4].sum(), nbytes[:, FLOAT].sum(), 25):
    choice = allocation.within_bytes(loss, nbytes, budget)
    assert allocation.cost(choice, nbytes) <= budget
    got = allocation.predicted(loss, choice)
    # Optimal up to the quantization of bytes: no assignment that fits a budget smaller by
    # one quantum per unit does better.
    slack = units * (nbytes[:, FLOAT] - nbytes[:, INT4]).sum() / allocation.STEPS
    best = min((allocation.predicted(loss, c) for c in everything
                if allocation.cost(c, nbytes) <= budget - slack), default=np.inf)
    assert got <= best + 1e-12
    assert got <= last + 1e-12  # more bytes, no worse
    last = got
  with pytest.raises(ValueError, match="does not hold every unit at int4"):
    allocation.within_bytes(loss, nbytes, nbytes[:, INT4].sum() - 1)


# -- a stack of runs ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed_model(tiny_model):
  """(config, mixed params, the same weights dequantized as a float stack, tokenizer): the
  tiny model's two layers with every precision in them, kernel by kernel: two runs."""
  config, params, tok = tiny_model
  declared = linear_kernels(config)
  c = mixed.candidates(params, declared, linear_kernels(config, True), method="rtn",
                       group_size=32, sym=False, stats=None, verbose=False)
  choice = np.array([[FLOAT, INT8, INT4, INT4, INT8, FLOAT, INT4][:len(c.paths)],
                     [INT8] * len(c.paths)], np.int32)  # [L, P]
  out = mixed.build(c, choice)
  out = {**out, "embedding": quantize(params["embedding"], *declared["embedding"])}
  dequantized = dict(params, embedding=out["embedding"].dequantize())
  for j, (f, d8, d4) in enumerate(c.forms()):
    w = np.stack([np.asarray((f, d8, d4)[choice[i, j]][i]) for i in range(len(choice))])
    dequantized = mixed.folding.replace(dequantized, ("layers",) + c.paths[j] + ("kernel",),
                                        jnp.asarray(w))
  return config, out, dequantized, tok


def test_a_stack_of_runs_computes_its_own_weights(mixed_model):
  config, params, dequantized, _ = mixed_model
  assert layer_runs(params) == (1, 1)
  types = {type(x).__name__ for x in jax.tree.leaves(params["layers"], is_leaf=_is_q)}
  assert {"QArray", "GroupwiseArray", "ArrayImpl"} <= types
  ids = jnp.asarray([5, 9, 33, 2, 7, 11], jnp.int32)
  got = _forward(config, params, ids, layer_runs(params))
  want = _forward(config, dequantized, ids, ())
  # W8A16 on the CPU multiplies by two int8 digits of the activations: 1e-5 relative.
  np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-3)


def _forward(config, params, ids, runs):
  """Logits [T, V] of one prefill sequence through the scanned model."""
  from jinfer.quant.calibration import prefill_batch as batch
  from pallas_kernels import KVCacheSpec
  ids_, pos, md, pages, _ = batch(list(np.asarray(ids)), 16)
  spec = KVCacheSpec(num_layers=config.num_layers, num_pages=pages, page_size=16,
                     num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
  model = CausalLM(config, layer_runs=runs)
  return np.asarray(model.apply({"params": params}, ids_, pos, spec.allocate(), md,
                                jnp.arange(len(ids), dtype=jnp.int32))[0])


@pytest.mark.slow  # an engine's warmup: ~half a minute of compiles on a 2-core CPU
def test_a_mixed_engine_is_batch_invariant_and_compiles_nothing_after_warmup(mixed_model):
  config, params, _, tok = mixed_model
  # Scanned only: the runs are what is tested, and the unrolled variant would compile every layer.
  engine = make_engine((config, params, tok), **{**SMALL_POOL, "num_pages": 18},
                       scan_layers=True)
  prompts = prefix_sharing_prompts()
  sp = SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True)
  alone = [run_tokens(engine, [p], sp)[0] for p in prompts]
  counter = CompileCounter()
  assert_batch_matches(engine, prompts, sp, alone)
  assert counter.count == 0, f"{counter.count} compiles after warmup"


# -- budgets, saving, bad options -----------------------------------------------------------
def _saved_bits(path: str, config) -> float:
  """Average bits per weight of the decoder layers' linear kernels, from the saved leaves."""
  _, params = load_quantized(path)
  stored = sum(x.nbytes for kp, x in jax.tree_util.tree_flatten_with_path(
      params["layers"], is_leaf=_is_q)[0] if "'kernel'" in jax.tree_util.keystr(kp))
  weights = sum(int(np.prod(x.shape)) for kp, x in jax.tree_util.tree_flatten_with_path(
      param_shapes(config)["layers"])[0] if "'kernel'" in jax.tree_util.keystr(kp))
  return 8 * stored / weights


@pytest.mark.slow  # a sensitivity pass and five engines of a 4-layer model
def test_mixed_meets_its_budget_and_saves_and_loads_back(tmp_path, monkeypatch):
  monkeypatch.setenv("JINFER_QUANTIZATION_CACHE_DIR", str(tmp_path / "cache"))
  model = tiny_hf_dir(str(tmp_path / "tiny"), num_layers=4)
  config, params, _ = load_model(model)
  declared = linear_kernels(config)
  lo, hi = mixed.bits_range(params, declared, 128)
  # The largest step one layer's upgrade takes, in average bits: how far under a budget the
  # allocation may stop.
  shapes = mixed.kernel_shapes(params, declared)
  cells = mixed.cell_bytes(shapes, 128).sum(1)  # [3] one layer's bytes per precision
  step = 8 * (cells[FLOAT] - cells[INT8]) / sum(int(np.prod(s)) for s, _, _ in shapes)
  prompts = [[0, 5, 9, 33, 2, 7], [0] + list(range(10, 30))]
  sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
  options = dict(warmup=False, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                 scan_layers=True)
  for bits in (lo, 7.0, 20.0):
    qc = {"bits": bits, "method": "rtn", "granularity": "layer"}  # "layer": runs to save
    llm = LLM(model, quantization="mixed", quantization_config=qc, **options)
    path = str(tmp_path / f"saved-{bits}")
    llm.save_quantized(path)
    got = _saved_bits(path, config)
    assert bits - step - 1e-6 <= got <= bits + 1e-6, (bits, got)
    if bits == 7.0:  # int4 and int8 layers: runs; back from disk as they were
      runs = layer_runs(llm.engine.runner.stacked_params)
      assert len(runs) > 1, runs
      want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
      back = LLM(path, **options)
      assert back.engine.config.model.quantization == "mixed"
      assert layer_runs(back.engine.runner.stacked_params) == runs
      assert [o.outputs[0].token_ids for o in back.generate(prompts, sp, use_tqdm=False)] == want
  assert lo < 7.0 < 20.0 < hi


@pytest.mark.parametrize("qc, says", [
    ({"bits": 3}, "bits must be a number in \\(4, 32\\]"),
    ({"bits": 40}, "bits must be a number in \\(4, 32\\]"),
    ({"bits": "5"}, "bits must be a number"),
    ({"bits": 5, "max_ppl_increase": 0.02}, "exactly one of bits or max_ppl_increase, got bits "
                                            "and max_ppl_increase"),
    ({}, "exactly one of bits or max_ppl_increase, got neither"),
    ({"max_ppl_increase": -0.1}, "max_ppl_increase must be a positive number"),
    ({"bits": 5, "bitz": 4}, "'bitz' is not an option of quantization='mixed'"),
    ({"bits": 5, "granularity": "block"}, "granularity must be one of layer, linear"),
    ({"bits": 5, "method": "hqq"}, "method must be one of rtn, awq, gptq"),
    # Within (4, 32] but below what this model's groups allow: found once the shapes are known,
    # before anything is quantized.
    ({"bits": 4.25}, "bits 4.25 is outside what this model's layers can take: 5.778"),
])
def test_bad_mixed_options_name_the_key(tiny_model_dir, qc, says):
  with pytest.raises(ParameterError, match=says) as e:
    LLM(tiny_model_dir, warmup=False, quantization="mixed", quantization_config=qc)
  assert e.value.param == "quantization_config"


def test_mixed_refuses_a_mesh_and_adapters():
  for extra in (dict(tensor_parallel_size=2), dict(enable_lora=True)):
    with pytest.raises(ParameterError, match="runs on one device without LoRA") as e:
      EngineConfig.of(quantization="mixed", quantization_config={"bits": 6}, **extra)
    assert e.value.param == "quantization"
