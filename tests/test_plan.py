"""`jinfer plan` and the abstract engine behind it, where no TPU or GPU compiler is needed: sizes
against a real engine's, and bad input (the tier builds for the targets: test_compile_*.py)."""
from __future__ import annotations

import json
import sys

import jax
import pytest

from jinfer.engine.compile_only import AbstractEngine, short_error
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.errors import ParameterError
from jinfer.plan import plan
from jinfer import targets


@pytest.mark.parametrize("options", [{}, {"quantization": "int8", "kv_cache_dtype": "int8"},
                                     {"tensor_parallel_size": 2}])
def test_abstract_sizes_are_the_engines(tiny_model, options):
  """Weights and pool as the abstract engine counts them, per device, are what a real engine
  with the same options allocates; and its smallest step builds on the CPU."""
  config, params, tokenizer = tiny_model
  ec = EngineConfig.of(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16, **options)
  real = LLMEngine.from_parts(config, params, tokenizer, config=ec, warmup=False)
  abstract = AbstractEngine(config, ec, jax.devices(), "cpu")
  per_device = real.runner.bytes_per_device()
  weights, kv = next(iter(per_device.values()))
  assert (abstract.weight_bytes, abstract.kv_cache_bytes) == (weights, kv)
  assert abstract.build((1, False, False)).built


def test_unknown_target_lists_the_known():
  with pytest.raises(ParameterError, match="known targets: v5e-1, v5e-4"):
    plan("llama-3.1-8b", "v7x-8")


def test_tensor_parallel_size_that_does_not_divide_names_the_valid(tiny_model):
  config = tiny_model[0]
  with pytest.raises(ValueError, match="valid sizes"):
    AbstractEngine(config, EngineConfig.of(tensor_parallel_size=3), jax.devices(), "cpu")


def test_more_devices_than_the_target_has():
  with pytest.raises(ParameterError, match=r"the target has 8 \(valid tensor_parallel_size "
                                           r"here: 1, 2, 4, 8\)"):
    AbstractEngine(_config("llama-3.1-70b"), EngineConfig.of(tensor_parallel_size=16),
                   jax.devices(), "cpu")


def test_unsupported_architecture_names_the_field(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon", "hidden_size": 8}))
  with pytest.raises(ValueError, match="model_type='falcon'"):
    plan(str(tmp_path), "v6e-1")


def test_missing_compiler_names_the_extra(monkeypatch):
  targets._topology.cache_clear()
  monkeypatch.setitem(sys.modules, "libtpu", None)  # import fails as if not installed
  try:
    with pytest.raises(targets.CompilerMissing, match=r"pip install 'jinfer\[compile-tpu\]'"):
      targets.target("v6e-1").devices()
  finally:
    targets._topology.cache_clear()


def test_compiler_errors_come_out_as_one_line():
  e = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem. Used 128.00M "
                   "of 127.94M vmem.\n\nThe following allocations:\n" + "  %a = f32[8192]\n" * 200)
  line = short_error(e)
  assert "\n" not in line and len(line) <= 300
  assert "Ran out of memory in memory space vmem" in line


def _config(name):
  from jinfer.loader import load_model
  return load_model(name, config_only=True)[0]


def test_advice_for_weights_that_do_not_fit():
  """Llama-3.1-70B in bf16 (131 GiB of weights) with the compiler's refusal: on one v6e the
  weights alone exceed it, so quantize; on a v6e-8 at TP 1, TP 8 is the first that leaves room
  (2 and 4 do not)."""
  from jinfer.engine.compile_only import StepBuild
  from jinfer.plan import Plan
  refused = [StepBuild(1, False, False, seconds=1.0, error="JaxRuntimeError: RESOURCE_EXHAUSTED: "
                       "Ran out of memory on HBM, ...")]
  engine = AbstractEngine(_config("llama-3.1-70b"), EngineConfig(), jax.devices(), "tpu")
  for name, want in (("v6e-1", "--quantization int8"), ("v6e-8", "--tensor-parallel-size 8")):
    p = Plan("llama-3.1-70b", targets.target(name), engine, refused, 0.9, 1024)
    assert not p.fits
    advice = p.advice()
    assert advice[0].startswith("the weights alone (131.") and "exceed 90% of 32.00 GiB" in advice[0]
    assert any(a.startswith(want) for a in advice), advice


def test_a_gguf_file_keeps_its_blocks_by_default_on_a_gpu_only():
  """The default the compile-only tier chose (`default_quantization`): GGUF blocks kept on a
  GPU, dequantized on a TPU and the CPU; a named quantization, or a model that is no GGUF
  file, is left as it is."""
  from jinfer.engine.weight_quantization import default_quantization
  q = lambda config, model, platform: default_quantization(config, model, platform).model.quantization
  plain, int8 = EngineConfig.of(), EngineConfig.of(quantization="int8")
  assert q(plain, "smollm2-135m-instruct", "gpu") == "gguf"
  assert q(plain, "/models/x.gguf", "gpu") == "gguf"
  for platform in ("cpu", "tpu"):
    assert q(plain, "smollm2-135m-instruct", platform) is None
  assert q(int8, "smollm2-135m-instruct", "gpu") == "int8"
  assert q(plain, "tiny-random-moe", "gpu") is None
  assert q(plain, "/models/hf-dir", "gpu") is None


def test_a_head_dim_the_gpu_kernel_cannot_take_is_refused_by_name(tiny_model):
  """A GPU config whose attention kernel cannot take the model's heads fails when the config
  resolves, naming the option and the way out, not when a step compiles."""
  import dataclasses
  config = dataclasses.replace(tiny_model[0], head_dim=80)
  with pytest.raises(ParameterError, match="head_dim >= 16.*80"):
    EngineConfig.of().resolve(config, platform="gpu")
  assert EngineConfig.of(attention_backend="xla").resolve(
      config, platform="gpu").attention_backend == "xla"
