"""An HF directory that holds a quantized checkpoint: which reader reads it, and what jinfer
runs it as. AWQ and GPTQ (`hf_quantized`) run as int4; compressed-tensors and transformers'
FP8 (`compressed_tensors`) as their scheme says."""
from __future__ import annotations

import json
import os

from jinfer.weights import compressed_tensors
from jinfer.weights.groupwise_tensor import GroupwiseWeights
from jinfer.weights.hf_layout import WeightError
from jinfer.weights.hf_quantized import read_hf_groupwise

_CF = "quantization_config"
_CHANNEL_METHODS = ("compressed-tensors", "fp8")  # read by `compressed_tensors`


def _channel_scheme(path: str) -> compressed_tensors.Scheme | None:
  """The scheme of a compressed-tensors or FP8 directory; None for any other (AWQ, GPTQ, and
  unknown methods, which `hf_quantized.quant_scheme` names)."""
  source = os.path.join(path, "config.json")
  try:
    with open(source) as fh:
      q = json.load(fh).get(_CF)
  except (OSError, json.JSONDecodeError) as e:
    raise WeightError(f"{source}: cannot read ({e})") from None
  if not isinstance(q, dict) or q.get("quant_method") not in _CHANNEL_METHODS:
    return None
  return compressed_tensors.scheme(q, source)


def checkpoint_quantization(path: str) -> tuple[str, dict | None]:
  """(quantization, quantization_config) that quantized HF directory `path` runs as."""
  s = _channel_scheme(path)
  return ("int4", None) if s is None else s.quantization


def read_quantized_dir(path: str) -> GroupwiseWeights:
  """The tensors of quantized HF directory `path`, linears kept quantized."""
  s = _channel_scheme(path)
  return read_hf_groupwise(path) if s is None else compressed_tensors.read(path, s)
