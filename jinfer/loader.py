"""Resolve a model name or path to (config, params, tokenizer)."""
from __future__ import annotations

import json
import os

import jax.numpy as jnp

from jinfer.config import ModelConfig
from jinfer.tokenizer import Tokenizer
from jinfer.weights.builtin import (CONFIG_ONLY_MODELS, builtin_path, config_only_path,
                                    is_builtin, known_names)
from jinfer.weights.gguf_file import gguf_config, load_gguf, open_gguf
from jinfer.weights.gguf_quantized import read_gguf_groupwise
from jinfer.weights.hf_layout import hf_to_params
from jinfer.weights.hf_quantized import is_quantized_dir
from jinfer.weights.hf_quantized_dir import read_quantized_dir
from jinfer.weights.quantized_checkpoint import is_quantized_checkpoint, load_quantized
from jinfer.weights.safetensors_dir import load_safetensors_dir

DEFAULT_MODEL = "smollm2-135m-instruct"


def load_model(model: str, dtype=jnp.float32, *, load_tokenizer: bool = True,
               keep_gguf_quantized: bool = False, config_only: bool = False
               ) -> tuple[ModelConfig, dict | None, Tokenizer | None]:
  """`model`: a built-in name, an HF directory (config.json + safetensors), or a .gguf file.
  Without `load_tokenizer` the tokenizer is None (token-id prompts only).

  Quantized checkpoints: an AWQ or GPTQ directory always loads its linear layers as 4-bit
  `GroupwiseArray`s (never through float), a compressed-tensors or transformers FP8 one as
  its scheme stores them (int8 / float8 `QArray`s, 4-bit `GroupwiseArray`s); a GGUF file's
  blocks stay quantized (re-encoded exactly, see `jinfer/weights/gguf_quantized.py`) with
  `keep_gguf_quantized`, else they are
  dequantized to `dtype`. A directory jinfer saved a quantized model into
  (`jinfer/weights/quantized_checkpoint.py`) loads its params as saved, the config and tokenizer
  from the model they came from. `config_only`: no params (None); it also takes the names of
  the shipped configs of public models (`CONFIG_ONLY_MODELS`: shapes only, no weights or
  tokenizer anywhere)."""
  name = model
  if model in CONFIG_ONLY_MODELS:
    if not config_only:
      raise ValueError(f"{model!r} is a shipped config without weights (for `jinfer plan`); "
                       f"pass its HF directory or GGUF file to run it")
    with open(config_only_path(model)) as f:
      return ModelConfig.from_hf_dict(json.load(f), source=f"{model} (shipped config)"), None, None
  if is_builtin(model):
    model = builtin_path(model)
  config, params, tokenizer = _load(model, dtype, load_tokenizer, keep_gguf_quantized, config_only)
  if tokenizer is not None and tokenizer.name is None:
    tokenizer.name = name
  return config, params, tokenizer


def _load(model: str, dtype, load_tokenizer: bool, keep_gguf_quantized: bool,
          config_only: bool) -> tuple[ModelConfig, dict | None, Tokenizer | None]:
  if os.path.isfile(model) and model.endswith(".gguf"):
    if config_only:
      config, params = gguf_config(open_gguf(model), model), None
    elif keep_gguf_quantized:
      config, weights = read_gguf_groupwise(model, dequantize_unsupported=True)
      params = hf_to_params(config, weights.get, dtype=dtype, source=model)
    else:
      config, params = load_gguf(model, dtype)
    return config, params, Tokenizer.from_gguf(model) if load_tokenizer else None
  if os.path.isdir(model) and is_quantized_checkpoint(model):  # saved by jinfer
    meta, params = load_quantized(model)
    config, _, tokenizer = load_model(meta["source"], dtype, load_tokenizer=load_tokenizer,
                                      config_only=True)
    return config, params, tokenizer
  if os.path.isdir(model):
    config = ModelConfig.from_hf_dir(model)
    if config_only:
      params = None
    elif is_quantized_dir(model):
      params = hf_to_params(config, read_quantized_dir(model).get, dtype=dtype, source=model)
    else:
      params = load_safetensors_dir(model, config, dtype)
    return config, params, Tokenizer.from_dir(model) if load_tokenizer else None
  raise ValueError(f"model {model!r} not found: not a built-in name ({', '.join(known_names())}), "
                   f"an HF model directory, or a .gguf file")
