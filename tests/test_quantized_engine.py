"""Quantized weights in the engine: int4 on the fly, AWQ and GPTQ checkpoints, GGUF blocks kept.

Each mode runs what its weights say, exactly: the engine's tokens equal those of a float engine
over the same weights dequantized by hand. The algorithms' quality is tested in
test_quant_algorithms.py, the readers' exactness in test_quantized_checkpoints.py, the kernels
in test_groupwise_matmul.py; here they meet in the engine, and on the real SmolLM2."""
from __future__ import annotations

import json
import math
import os
import shutil

import jax
import numpy as np
import pytest
from pydoc_data.topics import topics
from safetensors.numpy import load_file, save_file

from jinfer import LLM, SamplingParams
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.engine import quantization_cache, weight_quantization
from jinfer.engine.weight_quantization import check_config, quantize_weights
from jinfer.errors import ParameterError
from jinfer.loader import load_model
from jinfer.quant.groupwise import GroupwiseArray
from jinfer.quant.qarray import QArray
from tests.engine_fixtures import (SMALL_POOL, CompileCounter, assert_batch_matches, make_engine,
                                   prefix_sharing_prompts, random_prompts, run_tokens)
from tests.test_quantized_checkpoints import awq_pack, gptq_pack_columns, gptq_pack_rows

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
INT4 = dict(quantization="int4", quantization_config={"method": "rtn", "group_size": 32})


def _is_quantized(x) -> bool:
  return isinstance(x, (QArray, GroupwiseArray))


def _dequantized(params: dict) -> dict:
  """Every quantized leaf back to the float32 weight it stands for, in the float layout."""
  def one(x):
    if isinstance(x, GroupwiseArray):
      return x.dequantize()
    if isinstance(x, QArray):  # [lead..., in..., out...] or, transposed, outputs first
      lead = x.scale.ndim - x.n_out
      shape = x.scale.shape + (1,) * (x.values.ndim - x.scale.ndim) if x.transposed else (
          x.scale.shape[:lead] + (1,) * x.n_in + x.scale.shape[lead:])
      return x.values.astype(np.float32) * x.scale.reshape(shape)
    return x
  return jax.tree.map(one, params, is_leaf=_is_quantized)


def _float_like(quantized: dict, float_params: dict) -> dict:
  """`quantized` dequantized into the shapes of `float_params` (group-wise kernels are held
  flattened [K, N])."""
  return jax.tree.map(lambda w, ref: np.asarray(w).reshape(ref.shape),
                      _dequantized(quantized), float_params)


def test_int4_runs_its_own_weights_exactly(tiny_model):
  """The int4 engine's tokens and logprobs are a float engine's over the int4 weights
  dequantized: the group-wise matmul computes what the format says."""
  config, params, tok = tiny_model
  q = quantize_weights(config, params, "int4", check_config("int4", INT4["quantization_config"]),
                       int8_transposed=False)
  assert isinstance(q["layers"]["attn"]["q_proj"]["kernel"], GroupwiseArray)
  assert isinstance(q["embedding"], QArray)  # the tied head: int8
  prompts = random_prompts(4, seed=1, lo=17, hi=32)
  # Scanned, one sequence at a time, prompts in one bucket: two steps to compile per engine.
  options = dict(scan_layers=True, max_num_seqs=1, max_num_batched_tokens=64)
  got = make_engine(tiny_model, warmup=False, **INT4, **options)
  want = LLMEngine.from_parts(config, _float_like(q, params), tok, warmup=False,
                              config=EngineConfig.of(**options))
  outs = [run_tokens(e, prompts, GREEDY) for e in (got, want)]
  assert outs[0] == outs[1]
  assert got.stats().weight_bytes < 0.3 * want.stats().weight_bytes


@pytest.mark.slow
def test_int4_is_batch_invariant_and_compiles_nothing_after_warmup(tiny_model):
  engine = make_engine(tiny_model, **INT4, **{**SMALL_POOL, "num_pages": 18})
  prompts = prefix_sharing_prompts()
  sp = SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True)
  alone = [run_tokens(engine, [p], sp)[0] for p in prompts]
  counter = CompileCounter()
  assert_batch_matches(engine, prompts, sp, alone)
  assert counter.count == 0, f"{counter.count} compiles after warmup"


# -- AWQ / GPTQ checkpoints ---------------------------------------------------------------------
G = 32


def _codes(w: np.ndarray, sym: bool):
  """w [K, N] -> 4-bit codes [K, N], zero points and float16 scales [K/G, N] (RTN)."""
  k, n = w.shape
  grp = w.reshape(k // G, G, n)
  if sym:
    s = (np.abs(grp).max(1) / 7.5).astype(np.float16)
    z = np.full_like(s, 8, dtype=np.int64)
  else:
    lo, hi = grp.min(1), grp.max(1)
    s = ((hi - lo) / 15).astype(np.float16)
    z = np.clip(np.round(-lo / s.astype(np.float32)), 0, 15).astype(np.int64)
  sf = np.maximum(s.astype(np.float32), 1e-8)
  q = np.clip(np.round(grp / sf[:, None]) + z[:, None], 0, 15).astype(np.int64).reshape(k, n)
  return q, z, s


def _quantized_dir(src: str, dst: str, method: str, sym: bool) -> str:
  """A copy of HF directory `src` with every decoder linear stored as AWQ (GEMM) or GPTQ (v1,
  zeros minus one) from round-to-nearest codes; config.json says so."""
  shutil.copytree(src, dst)
  tensors = load_file(os.path.join(src, "model.safetensors"))
  out = {}
  for name, w in tensors.items():
    if ".layers." not in name or not name.endswith("proj.weight"):
      out[name] = w
      continue
    q, z, s = _codes(w.T.astype(np.float32), sym)  # HF [N, K] -> [K, N]
    p = name.removesuffix(".weight")
    if method == "awq":
      out |= {p + ".qweight": awq_pack(q), p + ".qzeros": awq_pack(z), p + ".scales": s}
    else:
      out |= {p + ".qweight": gptq_pack_rows(q), p + ".qzeros": gptq_pack_columns(z - 1),
              p + ".scales": s, p + ".g_idx": (np.arange(q.shape[0]) // G).astype(np.int32)}
  os.remove(os.path.join(dst, "model.safetensors"))
  save_file(out, os.path.join(dst, "model.safetensors"))
  with open(os.path.join(dst, "config.json")) as fh:
    config = json.load(fh)
  config["quantization_config"] = (
      {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm"}
      if method == "awq" else {"quant_method": "gptq", "bits": 4, "group_size": G, "sym": sym,
                               "desc_act": False})
  with open(os.path.join(dst, "config.json"), "w") as fh:
    json.dump(config, fh)
  return dst


# Slow: ~10 s of engines. Quick: test_quantized_checkpoints reads these formats into the same
# `GroupwiseArray`s, and test_int4_runs_its_own_weights_exactly runs them in the engine.
@pytest.mark.slow
@pytest.mark.parametrize("method, sym", [("awq", False), ("gptq", True), ("gptq", False)])
def test_awq_and_gptq_checkpoints_run_int4(tiny_model_dir, tmp_path, method, sym):
  """Loaded as int4 (never through float), they run what a float model with the hand-dequantized
  weights runs."""
  path = _quantized_dir(tiny_model_dir, str(tmp_path / method), method, sym)
  config, params, tok = load_model(path)
  assert isinstance(params["layers"]["mlp"]["down_proj"]["kernel"], GroupwiseArray)
  _, float_params, _ = load_model(tiny_model_dir)
  engines = [LLMEngine.from_parts(config, p, tok, warmup=False, config=EngineConfig.of(
      max_model_len=64, max_num_seqs=4)) for p in (params, _float_like(params, float_params))]
  prompts = [[0, 5, 9, 33, 2, 7], [0, 100, 4], [0] + list(range(10, 40))]
  got, want = [run_tokens(e, prompts, GREEDY) for e in engines]
  assert got == want


@pytest.mark.parametrize("quantization, qc", [
    # All slow: compiles of two engines each; the quick tier runs int4 in the test above.
    pytest.param("int4", {"method": "rtn", "group_size": 32}, marks=pytest.mark.slow),
    pytest.param("w8a8", {}, marks=pytest.mark.slow),  # SmoothQuant: calibrates first
    pytest.param("int4", {"method": "awq", "group_size": 32}, marks=pytest.mark.slow)])
def test_a_quantized_model_saves_and_loads_back_without_quantizing(
    tiny_model_dir, tmp_path, monkeypatch, quantization, qc):
  monkeypatch.setenv("JINFER_QUANTIZATION_CACHE_DIR", str(tmp_path / "cache"))
  # Scanned, few buckets: the steps compile in seconds; what is tested is the saving.
  options = dict(warmup=False, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                 scan_layers=True)
  llm = LLM(tiny_model_dir, quantization=quantization, quantization_config=qc, **options)
  prompts = [[0, 5, 9, 33, 2, 7], [0] + list(range(10, 40))]
  sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
  want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
  path = str(tmp_path / "saved")
  llm.save_quantized(path)

  def quantizing(*a, **k):
    raise AssertionError("a saved quantized model was quantized again")
  for name in ("quantize_model", "smooth_model", "quantize"):
    monkeypatch.setattr(weight_quantization, name, quantizing)
  if qc.get("method", "awq") != "rtn":  # calibrated: the same options load from the cache
    again = LLM(tiny_model_dir, quantization=quantization, quantization_config=qc, **options)
    assert [o.outputs[0].token_ids for o in again.generate(prompts, sp, use_tqdm=False)] == want
  back = LLM(path, **options)
  assert back.engine.config.model.quantization == quantization  # w8a8 runs as w8a8
  got = [o.outputs[0].token_ids for o in back.generate(prompts, sp, use_tqdm=False)]
  assert got == want
  assert back.engine.stats().weight_bytes == llm.engine.stats().weight_bytes
  with pytest.raises(ParameterError, match=f"quantized as '{quantization}'") as e:
    LLM(path, quantization="int8" if quantization != "int8" else "w8a8", **options)
  assert e.value.param == "quantization"


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("options, param, says", [
    (dict(quantization="int4", quantization_config={"bits": 3}), "quantization_config",
     "'bits' is not an option of quantization='int4'"),
    (dict(quantization="int4", quantization_config={"method": "hqq"}), "quantization_config",
     "method must be one of rtn, awq, gptq"),
    (dict(quantization="int4", quantization_config={"group_size": 48}), "quantization_config",
     "group_size must be a power of two"),
    (dict(quantization_config={"method": "awq"}), "quantization_config",
     "needs a quantization"),
    (dict(quantization="int3"), "quantization", "unknown quantization 'int3'"),
    (dict(quantization="gguf"), "quantization", "is not a .gguf file"),
])
def test_bad_quantization_options_fail_before_loading(tiny_model_dir, options, param, says):
  with pytest.raises(ParameterError, match=says) as e:
    LLM(tiny_model_dir, warmup=False, **options)
  assert e.value.param == param


# -- the real model -----------------------------------------------------------------------------
def _perplexity(llm: LLM, ids: list[int]) -> float:
  out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
  return math.exp(-float(np.mean([lp[t] for t, lp in zip(ids[1:], out.prompt_logprobs[1:])])))


@pytest.mark.slow
def test_smollm2_quantized_modes_answer_and_fit():
  """Every weight mode answers the question; weights within the targets' fractions of float32;
  GGUF kept runs its blocks as the dequantized model does (perplexity on 512 tokens of a fixed
  English text within 0.2%; the quality report measures 1k tokens of three)."""
  question = [{"role": "user", "content": "What is the capital of France?"}]
  # Scanned steps only, compiled as they come (an unrolled SmolLM2 step compiles every layer).
  # int8 is checked the same way in test_kernels_in_engine.py.
  options = dict(max_model_len=600, max_num_seqs=2, max_num_batched_tokens=256, warmup=False,
                 enable_prompt_logprobs=True, scan_layers=True)
  limits = {None: 1.0, "int4": 0.18, "gguf": 0.22}
  ppl, size = {}, {}
  for mode, limit in limits.items():
    llm = LLM(quantization=mode, **options)
    size[mode] = llm.engine.stats().weight_bytes
    answer = llm.chat([question], SamplingParams(temperature=0.0, max_tokens=16),
                      use_tqdm=False)[0].outputs[0].text
    assert "Paris" in answer, (mode, answer)
    assert size[mode] <= limit * size[None], (mode, size[mode] / size[None])
    if mode in (None, "gguf"):
      ppl[mode] = _perplexity(llm, llm.tokenizer.encode(topics["assignment"])[:512])
    del llm
  print({m: round(s / size[None], 3) for m, s in size.items()}, ppl)
  assert abs(ppl["gguf"] / ppl[None] - 1) <= 0.002



def test_the_quantization_cache_key_follows_every_input(tiny_model):
  """A calibrated quantization is read back only for the same weights, options, calibration
  tokens and layout (the slow save/load test above reads one back through the engine)."""
  config, params, _ = tiny_model
  options, tokens = check_config("w8a8", None), [5, 9, 33]
  key = lambda **kw: quantization_cache.key(**{**dict(
      config=config, params=params, quantization="w8a8", options=options,
      calibration_tokens=tokens, store_transposed=False), **kw})
  assert key() == key()
  changed = [key(options={**options, "alpha": 0.5}), key(calibration_tokens=tokens[:2]),
             key(store_transposed=True), key(quantization="int4"),
             key(params=jax.tree.map(lambda a: a.at[(0,) * a.ndim].add(1e-3), params))]
  assert len({key(), *changed}) == 1 + len(changed)
