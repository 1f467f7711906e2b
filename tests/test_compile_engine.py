"""Compile-only tier, engine steps on one device: the steps `jinfer serve` would run, built by the real
compilers of the claimed targets through `jinfer.plan`, with the engine's own pool and sharding.

Full depth where depth changes what is checked (whether weights, pool and step fit HBM); two to
six layers and a small vocabulary where it does not (what builds, its temporaries, which
collectives a sharded step runs: a scanned layer compiles once whatever the depth, and the
sampler's full-vocabulary sort is what makes a TPU build slow).
"""
from __future__ import annotations

import json
import math

import jax
import pytest

from jinfer.models import param_shapes
from tests.compile_targets import built, devices, plan_for as _plan, shallow as _shallow

pytestmark = [pytest.mark.slow, pytest.mark.compile_only]


def test_llama_8b_bf16_fits_v6e_1():
  """Full depth and vocabulary: the largest step with the default pool fits one v6e's 32 GiB,
  its temporaries a small fraction of it (a relayout of the cache once made the 64-token step
  need 47 GB). Decode builds on v5e-1 and v6e-8 below."""
  p = _plan("llama-3.1-8b", "v6e-1", [512])
  built(p)
  assert p.fits, p.report()
  assert p.max_temp_bytes < 1 << 30, p.report()


def test_llama_8b_int8_v5e_1_default_pool_does_not_fit_and_the_advice_does():
  """v5e has 16 GiB: int8 weights (8 GiB) and the default pool (8 GiB) do not fit; the plan
  says by how much and names a num_pages that fits, and with it the step builds and fits."""
  p = _plan("llama-3.1-8b", "v5e-1", [1], quantization="int8")
  assert not p.fits
  pages = p.max_num_pages
  assert 0 < pages < p.engine.kv_spec.num_pages
  assert any(a.startswith(f"--num-pages {pages} ") for a in p.advice()), p.advice()
  ok = _plan("llama-3.1-8b", "v5e-1", [1], quantization="int8", num_pages=pages)
  built(ok)
  assert ok.fits, ok.report()


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_kv_decode_reads_the_cache_in_place_v6e(tmp_path, kv):
  """Llama-3.1-8B's heads, two layers, an int8 / fp8 cache at the TPU's page size for it (128):
  the decode step relayouts nothing and its temporaries are a few tiles. At page 16 the
  compiler laid the scales out pages-minor and every layer's attention copied all of them back
  (132 MB of temporaries; `page_size_for` now refuses such pages on a TPU)."""
  p = _plan(_shallow(tmp_path, "llama-3.1-8b", 2), "v6e-1", [1], kv_cache_dtype=kv,
            num_pages=2048)
  built(p)
  assert p.engine.config.cache.page_size == 128
  decode = p.steps[0]
  assert decode.copy_bytes == 0 and decode.temp_bytes < 8 << 20, p.report()


@pytest.mark.parametrize("target", ["v6e-1", "h100"])
def test_lora_slots_build_beside_the_base_step(tmp_path, target):
  """Llama-3.1-8B's shapes, two layers, 4 adapter slots of rank 16 on every projection: the
  8-row decode step builds with the adapters grouped by slot through the target's grouped
  matmul; the slots are their exact bytes (bf16) and add little to the step's temporaries (v6e:
  2.5 -> 3.9 MB)."""
  model = _shallow(tmp_path, "llama-3.1-8b", 2)
  base = _plan(model, target, [64], num_pages=256)
  lora = _plan(model, target, [64], num_pages=256, enable_lora=True, max_loras=4,
               max_lora_rank=16)
  built(base), built(lora)
  c = lora.engine.model_config
  e, q, kv, f = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, \
      c.intermediate_size
  per_rank = (e + q) + 2 * (e + kv) + (q + e) + 2 * (e + f) + (f + e)  # a's K + b's N, 7 linears
  assert lora.engine.lora_bytes == c.num_layers * 4 * 16 * per_rank * 2
  assert lora.max_temp_bytes <= base.max_temp_bytes + (4 << 20), (base.report(), lora.report())


def test_llama_8b_bf16_h100():
  """Full depth on one H100 (XLA:GPU and the Triton attention): the default pool fits its
  80 GB, decode and the largest prefill step build, and decode reads every weight in place (the
  scanned stack copied each layer's weights out before its matmuls: 200 MB per layer)."""
  p = _plan("llama-3.1-8b", "h100", [1, 512])
  built(p)
  assert p.fits, p.report()
  assert p.steps[0].copy_bytes == 0, p.report()


def test_smollm2_gguf_blocks_kept_by_default_on_h100():
  """The built-in GGUF on an H100 keeps its blocks (`default_quantization`): its weights are
  under half its bf16 bytes and the decode step reads them in place, relayouting nothing."""
  p = _plan("smollm2-135m-instruct", "h100", [1])
  built(p)
  assert p.engine.config.model.quantization == "gguf"
  bf16 = 2 * sum(math.prod(a.shape) for a in jax.tree.leaves(param_shapes(p.engine.model_config)))
  assert p.engine.weight_bytes < 0.5 * bf16, p.report()
  assert p.steps[0].copy_bytes == 0, p.report()


def test_plan_cli_json(capsys):
  """`jinfer plan ... --json` prints the plan: every figure with its source, estimates labelled
  as estimates, a shipped config and one bucket (on the GPU, whose compiler is the quicker)."""
  from jinfer.cli import main
  devices("h100")
  main(["plan", "--model", "qwen3-8b", "--target", "h100", "--buckets", "1", "--json"])
  out = json.loads(capsys.readouterr().out)
  assert out["steps"][0]["built"] and out["memory_per_device"]["fits"]
  assert {d["kind"] for d in out["decode"]} == {"estimate"}
  assert [d["batch"] for d in out["decode"]] == [1, 8, 64]
  assert out["memory_per_device"]["weights"] > 15e9  # Qwen3-8B in bf16: 16.4 GB


def test_fp8_decode_reads_fp8_weights_in_place_on_h100(tmp_path):
  """quantization="fp8" on an H100: the decode step of Llama-3.1-8B's layers (two of them)
  builds with every linear on the float8 dot, reading the float8 weights where they are; the
  weights are about half their bf16 bytes (the untied embedding stays bf16)."""
  p = _plan(_shallow(tmp_path, "llama-3.1-8b", 2), "h100", [1], quantization="fp8")
  built(p)
  step = p.steps[0]
  assert step.copy_bytes == 0, p.report()
  bf16 = 2 * sum(math.prod(a.shape) for a in jax.tree.leaves(param_shapes(p.engine.model_config)))
  assert p.engine.weight_bytes < 0.55 * bf16, p.report()
