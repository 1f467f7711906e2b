"""compressed-tensors and transformers FP8 checkpoints: made here by the `compressed-tensors`
package from a tiny random Llama, read kept quantized, checked against the package's own
decompression bit for bit, run against transformers loading the same directory, and refused
with an error naming the tensor and the config field when they cannot be read."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.quantization import (QuantizationConfig, QuantizationScheme,
                                             apply_quantization_config, preset_name_to_scheme)
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from jinfer import LLM, SamplingParams
from jinfer.quant.qarray import QArray
from jinfer.weights.channel_tensor import ChannelTensor
from jinfer.weights.groupwise_tensor import GroupwiseTensor
from jinfer.weights.hf_layout import WeightError
from jinfer.weights.hf_quantized_dir import checkpoint_quantization, read_quantized_dir

# name -> (compressed-tensors preset, format, weight changes, what jinfer runs it as)
SCHEMES = {
    "w8a8-int8": ("W8A8", "int-quantized", {}, ("w8a8", {"smoothquant": False})),
    "fp8-dynamic": ("FP8_DYNAMIC", "float-quantized", {}, ("fp8", {"activations": "fp8"})),
    "fp8-static": ("FP8", "float-quantized", {}, ("fp8", {"activations": "fp8"})),
    "w4a16-sym": ("W4A16", "pack-quantized", {"group_size": 32}, ("int4", None)),
    "w4a16-asym": ("W4A16_ASYM", "pack-quantized", {"group_size": 32}, ("int4", None)),
    # llm-compressor's GPTQ with activation order: columns visited by activation size, stored
    # in the plain layout (no g_idx); the config says so.
    "w4a16-actorder": ("W4A16", "pack-quantized", {"group_size": 16, "actorder": "weight"},
                       ("int4", None)),
}


def compress(src: str, dst: str, preset: str, fmt: str, changes: dict) -> str:
  """HF directory `src` with its decoder linears compressed by compressed-tensors into `dst`:
  the scheme applied, weight scales (and zero points) computed by the package from each
  weight's min and max (bfloat16 scales, as a bf16 model stores them), then compressed."""
  model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
  scheme = preset_name_to_scheme(preset, ["Linear"])
  scheme.weights = scheme.weights.model_copy(update=changes)
  apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                      ignore=["lm_head"]))
  for module in model.modules():
    if getattr(module, "quantization_scheme", None) is None:
      continue
    w, args = module.weight.data, module.quantization_scheme.weights
    if args.strategy == "channel":
      lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "tensor":
      lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    else:
      grouped = w.reshape(w.shape[0], -1, args.group_size)
      lo, hi = grouped.amin(-1), grouped.amax(-1)
    scale, zero = calculate_qparams(lo, hi, args)
    module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(torch.bfloat16)
    if hasattr(module, "weight_zero_point"):
      module.weight_zero_point.data = zero.reshape(module.weight_zero_point.shape).to(
          module.weight_zero_point.dtype)
    if hasattr(module, "input_scale"):  # a static activation scale: any calibrated value
      module.input_scale.data.fill_(0.05)
  compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
  compressor.compress_model(model)
  shutil.copytree(src, dst)
  save_file({k: v.contiguous() for k, v in model.state_dict().items()},
            os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
  compressor.update_config(dst)
  return dst


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
  root = tmp_path_factory.mktemp("compressed")
  return {name: compress(tiny_model_dir, str(root / name), preset, fmt, changes)
          for name, (preset, fmt, changes, _) in SCHEMES.items()}


def _decompressed(path: str) -> dict[str, torch.Tensor]:
  """Each quantized linear's weight [N, K] as compressed-tensors itself decompresses it."""
  q = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
  (group,) = q["config_groups"].values()
  scheme, compressor = QuantizationScheme(**group), BaseCompressor.get_value_from_registry(
      q["format"])
  state = load_file(os.path.join(path, "model.safetensors"))
  modules = {k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_scale")}
  return {m: compressor.decompress({k[len(m) + 1:]: v for k, v in state.items()
                                    if k.startswith(m + ".")}, scheme)["weight"]
          for m in modules}


@pytest.mark.parametrize("name", SCHEMES)
def test_compressed_tensors_read_kept_and_bit_exact(checkpoints, name):
  """Every quantized linear is read as stored (int8 / float8 values, 4-bit codes) and stands
  for exactly the weight the package decompresses."""
  path = checkpoints[name]
  assert checkpoint_quantization(path) == SCHEMES[name][3]
  weights = read_quantized_dir(path)
  ref = _decompressed(path)
  assert set(weights.linears) == set(ref)
  for module, t in weights.linears.items():
    want = ref[module]
    if isinstance(t, ChannelTensor):
      assert t.values.dtype == (np.int8 if name.startswith("w8a8") else np.dtype("float8_e4m3fn"))
      got = torch.from_numpy(t.dequantize())  # [N, K]
    else:
      assert isinstance(t, GroupwiseTensor) and t.bits == 4
      got = torch.from_numpy(t.dequantize().T.copy())
    # The package multiplies in the scales' dtype: the exact float32 product, rounded once.
    assert torch.equal(got.to(want.dtype), want), module
  assert "lm_head.weight" in weights.floats  # ignored by the scheme: float, as stored


def test_pack_quantized_group_index_sorts_rows_into_groups(checkpoints, tmp_path):
  """An older checkpoint's activation order (`weight_g_idx`, input k in group g_idx[k]): rows
  sorted into whole groups, the activations permuted to match, exactly the weight a hand
  dequantization through g_idx gives (the package no longer reads g_idx)."""
  from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
  path = shutil.copytree(checkpoints["w4a16-actorder"], tmp_path / "g_idx")
  file = os.path.join(path, "model.safetensors")
  state = load_file(file)
  want = {}
  for name in [k for k in state if k.endswith(".weight_packed")]:
    module = name.removesuffix(".weight_packed")
    n, k = state[module + ".weight_shape"].tolist()
    g_idx = torch.arange(k, dtype=torch.int32) % (k // 16)  # interleaved groups
    state[module + ".weight_g_idx"] = g_idx
    q = unpack_from_int32(state[name], 4, torch.Size([n, k])).float()
    want[module] = q * state[module + ".weight_scale"].float()[:, g_idx.long()]  # [N, K]
  save_file(state, file, metadata={"format": "pt"})
  weights = read_quantized_dir(str(path))
  for module, t in weights.linears.items():
    assert t.perm is not None
    assert torch.equal(torch.from_numpy(t.dequantize().T.copy()), want[module]), module


def test_transformers_fp8_checkpoint_reads_exactly(tiny_model_dir, tmp_path):
  """transformers' own FP8 layout (per-tensor `weight_scale_inv`), against its dequantization."""
  from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
  dst = shutil.copytree(tiny_model_dir, tmp_path / "fp8")
  state = load_file(os.path.join(dst, "model.safetensors"))
  out = {}
  for name, w in state.items():
    if ".layers." in name and name.endswith("proj.weight"):
      scale = w.abs().max() / 448
      out[name] = (w / scale).to(torch.float8_e4m3fn)
      out[name + "_scale_inv"] = scale.reshape(())
    else:
      out[name] = w
  save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
  _edit_config(dst, {"quant_method": "fp8", "activation_scheme": "dynamic",
                     "weight_block_size": None})
  assert checkpoint_quantization(str(dst)) == ("fp8", {"activations": "fp8"})
  weights = read_quantized_dir(str(dst))
  for module, t in weights.linears.items():
    want = _dequantize_fp8_weight(out[module + ".weight"], out[module + ".weight_scale_inv"],
                                  None, torch.float32)
    assert torch.equal(torch.from_numpy(t.dequantize()), want), module


def _edit_config(path, quantization_config: dict | None = None, **changes) -> None:
  file = os.path.join(path, "config.json")
  config = json.load(open(file))
  if quantization_config is not None:
    config["quantization_config"] = quantization_config
  for dotted, value in changes.items():  # "a.b.c" -> config["quantization_config"][a][b][c]
    node = config["quantization_config"]
    *keys, last = dotted.split(".")
    for key in keys:
      node = node[key]
    node[last] = value
  json.dump(config, open(file, "w"))


def _drop_tensor(path, name: str) -> None:
  file = os.path.join(path, "model.safetensors")
  state = load_file(file)
  del state[name]
  save_file(state, file, metadata={"format": "pt"})


@pytest.mark.parametrize("base, edit, says", [
    ("w4a16-sym", dict(**{"format": "nvfp4-pack-quantized",
                          "config_groups.group_0.format": "nvfp4-pack-quantized"}),
     r"quantization_config.format='nvfp4-pack-quantized' is not supported"),
    ("w8a8-int8", {"config_groups.group_0.weights.strategy": "block"},
     r"quantization_config.config_groups.group_0.weights.strategy='block'"),
    ("w4a16-sym", {"config_groups.group_0.weights.group_size": 24},
     r"quantization_config.config_groups.group_0.weights.group_size=24 does not divide the 64 "
     r"inputs of 'model.layers.0.mlp.down_proj.weight_packed'"),
    ("fp8-dynamic", "drop:model.layers.0.mlp.up_proj.weight_scale",
     r"missing tensor 'model.layers.0.mlp.up_proj.weight_scale' \(quantization_config."
     r"config_groups.group_0.weights"),
    ("fp8-static", "drop:model.layers.0.self_attn.o_proj.input_scale",
     r"missing tensor 'model.layers.0.self_attn.o_proj.input_scale' .*static activations"),
    ("w4a16-asym", "drop:model.layers.0.mlp.down_proj.weight_zero_point",
     r"missing tensor 'model.layers.0.mlp.down_proj.weight_zero_point'"),
])
def test_unreadable_checkpoints_name_the_tensor_and_field(checkpoints, tmp_path, monkeypatch,
                                                          base, edit, says):
  """Refused from the config and the headers, before any weight reaches a device."""
  path = shutil.copytree(checkpoints[base], tmp_path / base)
  if isinstance(edit, str):
    _drop_tensor(path, edit.removeprefix("drop:"))
  else:
    _edit_config(path, **edit)
  for cls in (ChannelTensor, GroupwiseTensor):
    monkeypatch.setattr(cls, "to_device", lambda self: pytest.fail("placed on a device"))
  with pytest.raises(WeightError, match=says):
    LLM(str(path), warmup=False)


def test_block_wise_fp8_names_the_field(tiny_model_dir, tmp_path):
  dst = shutil.copytree(tiny_model_dir, tmp_path / "fp8-block")
  _edit_config(dst, {"quant_method": "fp8", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128]})
  with pytest.raises(WeightError, match=r"quantization_config.weight_block_size=\[128, 128\]"):
    LLM(str(dst), warmup=False)


# Slow: an engine and a transformers model (~15 s on a 2-core CPU). FP8, the new matmul; int8
# W8A8 and W4A16 run the int8 and group-wise kernels the other engine tests run
# (test_quantized_engine.py), from the `QArray`s and `GroupwiseArray`s read bit for bit above.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp8-dynamic"])
def test_compressed_tensors_generate_as_transformers_does(checkpoints, name):
  """jinfer runs the checkpoint as its scheme says (FP8 weights and float8 activations per
  token) and greedy decoding gives transformers' tokens for the same directory (transformers
  decompresses it and quantizes activations the same way)."""
  path = checkpoints[name]
  llm = LLM(path, warmup=False, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
            scan_layers=True)
  assert llm.engine.config.model.quantization == SCHEMES[name][3][0]
  q_proj = llm.engine.runner.stacked_params["layers"]["attn"]["q_proj"]["kernel"]
  assert isinstance(q_proj, QArray) and q_proj.values.dtype == (
      np.int8 if name == "w8a8-int8" else np.dtype("float8_e4m3fn"))
  prompts = [[0, 5, 9, 33, 2, 7], [0, 100, 4, 17]]
  sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
  got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
  hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  for p, tokens in zip(prompts, got):
    want = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
    assert tokens == want.tolist()
