"""The engine's `quantization` option applied to loaded params: which quantizer runs, on which
weights, calibrated on what.

  None     float weights (or a checkpoint's own quantization: AWQ/GPTQ directories load int4)
  "int8"   int8 per output channel, float activations (W8A16)
  "w8a8"   int8 weights and per-token int8 activations, by default SmoothQuant: the weights
           smoothed (`quantization_config={"alpha": 0.7}`), then rounded onto the int8 grid by
           GPTQ fitted to the per-token-rounded inputs (`"gptq": true`). On SmolLM2 it more
           than halves plain W8A8's perplexity increase (docs/quantization.md);
           `{"smoothquant": false}` is plain W8A8, which needs no calibration
  "int4"   4-bit group-wise (W4A16), `quantization_config={"method": "rtn" | "awq" | "gptq",
           "group_size": 128, "sym": false}`: the decoder layers' projections take 4 bits, a
           tied embedding (the LM head too) int8 per channel, as llama.cpp's 4-bit files keep
           their embedding at 6-8 bits
  "gguf"   a GGUF file's blocks as stored: the loader keeps them, nothing to do here. The
           default for a GGUF file on a GPU (`default_quantization`)
  "mixed"  each linear across the layers (`"granularity": "linear"`, the default) or
           each decoder layer's linears (`"layer"`) int4 (by `method`), int8 or float, picked by their measured
           sensitivity to meet `{"bits": 5.5}` (average bits per weight, scales counted) or
           `{"max_ppl_increase": 0.02}` (on the calibration text); see jinfer/quant/mixed.py

Calibration (AWQ, GPTQ, SmoothQuant) runs the float model over the English text shipped with
`jinfer.quant` and prints its progress and time, once per machine: its result is kept in the
quantization cache (`quantization_cache.py`) and the next load reads it back.
"""
from __future__ import annotations

import os

import jax

from jinfer.config import ModelConfig
from jinfer.engine import quantization_cache
from jinfer.engine.engine_config import EngineConfig
from jinfer.errors import ParameterError
from jinfer.loader import load_model
from jinfer.models import CausalLM, linear_kernels
from jinfer.quant.calibration import calibrate as calibrate_stats, calibration_tokens
from jinfer.quant.groupwise import GroupwiseArray
from jinfer.quant.mixed import GRANULARITIES, bits_range, mixed_quantize
from jinfer.quant.model import METHODS, quantize_model, smooth_model
from jinfer.quant.qarray import QArray, quantize
from jinfer.weights.builtin import RANDOM_MODELS, is_builtin
from jinfer.weights.hf_quantized import is_quantized_dir
from jinfer.weights.quantized_checkpoint import is_quantized_checkpoint, read_meta, save_quantized

# quantization -> the quantization_config keys it reads, with their defaults
CONFIG_KEYS = {"int8": {}, "w8a8": {"smoothquant": True, "alpha": 0.7, "gptq": True},
               "int4": {"method": "rtn", "group_size": 128, "sym": False}, "gguf": {},
               "mixed": {"bits": None, "max_ppl_increase": None, "method": "awq",
                         "group_size": 128, "sym": False, "granularity": "linear"}}
# The budgets of "mixed", exactly one of which is given.
BUDGETS = ("bits", "max_ppl_increase")


def check_config(quantization: str | None, config: dict | None) -> dict:
  """`quantization_config` with its defaults filled in, or a ParameterError naming the key."""
  if quantization is None:
    if config:
      raise ParameterError("quantization_config", "quantization_config needs a quantization")
    return {}
  known = CONFIG_KEYS[quantization]
  for key in config or {}:
    if key not in known:
      raise ParameterError("quantization_config",
                           f"quantization_config: {key!r} is not an option of quantization="
                           f"{quantization!r} (options: {', '.join(known) or 'none'})")
  out = {**known, **(config or {})}
  if quantization in ("int4", "mixed"):
    if out["method"] not in METHODS:
      raise ParameterError("quantization_config", f"quantization_config: method must be one of "
                           f"{', '.join(METHODS)}, got {out['method']!r}")
    g = out["group_size"]
    if isinstance(g, bool) or not isinstance(g, int) or g < 2 or g & (g - 1):
      raise ParameterError("quantization_config", f"quantization_config: group_size must be a "
                           f"power of two >= 2, got {g!r}")
  if quantization == "mixed":
    _check_mixed(out)
  return out


def _check_mixed(options: dict) -> None:
  given = [k for k in BUDGETS if options[k] is not None]
  if len(given) != 1:
    raise ParameterError("quantization_config", f"quantization_config: quantization='mixed' "
                         f"takes exactly one of {' or '.join(BUDGETS)}, got "
                         f"{' and '.join(given) or 'neither'}")
  number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
  bits, ppl = options["bits"], options["max_ppl_increase"]
  if bits is not None and not (number(bits) and 4 < bits <= 32):
    raise ParameterError("quantization_config", f"quantization_config: bits must be a number "
                         f"in (4, 32] (average bits per weight), got {bits!r}")
  if ppl is not None and not (number(ppl) and ppl > 0):
    raise ParameterError("quantization_config", f"quantization_config: max_ppl_increase must "
                         f"be a positive number (0.02: +2% perplexity), got {ppl!r}")
  if options["granularity"] not in GRANULARITIES:
    raise ParameterError("quantization_config", f"quantization_config: granularity must be one "
                         f"of {', '.join(GRANULARITIES)}, got {options['granularity']!r}")


def is_gguf(model: str) -> bool:
  """A .gguf file, or a built-in name that stands for one."""
  return model.endswith(".gguf") or (is_builtin(model) and model not in RANDOM_MODELS)


def default_quantization(config: EngineConfig, model: str, platform: str) -> EngineConfig:
  """`config`, where it names no quantization and `model` is a GGUF file, set to keep the
  file's blocks on a GPU, as vLLM runs GGUF files. The basis is the compile-only tier's (see
  docs/quantization.md): on an H100 SmolLM2's kept Q4_1 blocks are 0.43x the bytes of its bf16
  weights (115 against 269 MB) and its decode step relayouts nothing, so a step reads less. On
  a v6e the step relayouts the packed stacks around the group-wise kernel (81 MB more copied
  than in bf16, read and written, about what the smaller weights save), so the blocks are
  dequantized there, as on the CPU (whose f32 path measured about 5x faster than its
  group-wise kernels)."""
  if config.model.quantization is None and platform == "gpu" and is_gguf(model):
    return config.replace(quantization="gguf")
  return config


def load(config: EngineConfig, model: str, dtype, *, load_tokenizer: bool = True):
  """`load_model` for `config`'s quantization, its options checked before anything loads:
  (config, params, tokenizer, engine config). "gguf" keeps a GGUF file's blocks quantized. A
  checkpoint quantized already (AWQ, GPTQ, or saved by `save`) runs as it was quantized: the
  engine config returned says so, and asking for another quantization is an error."""
  config = default_quantization(config, model, jax.default_backend())
  m = config.model
  check_config(m.quantization, m.quantization_config)
  if m.quantization == "gguf" and not is_gguf(model):
    raise ParameterError("quantization", f"quantization='gguf' keeps a GGUF file's blocks "
                                         f"quantized; {model!r} is not a .gguf file")
  own, own_config = None, None
  if os.path.isdir(model):
    if is_quantized_checkpoint(model):  # saved by `save`: with the options it was made with
      meta = read_meta(model)
      own, own_config = meta["quantization"], meta.get("quantization_config")
    elif is_quantized_dir(model):
      own = "int4"
  if own is not None:
    if m.quantization not in (None, own):
      raise ParameterError("quantization", f"{model} holds weights quantized as {own!r}; it "
                                           f"cannot run as quantization={m.quantization!r}")
    config = config.replace(quantization=own, quantization_config=own_config)
  model_config, params, tokenizer = load_model(model, dtype, load_tokenizer=load_tokenizer,
                                               keep_gguf_quantized=m.quantization == "gguf")
  return model_config, params, tokenizer, config


def save(path: str, params: dict, *, source: str, quantization: str | None,
         quantization_config: dict | None) -> None:
  """Save an engine's quantized params (`jinfer/weights/quantized_checkpoint.py`): `LLM(path)`
  loads them back without quantizing or calibrating again."""
  if quantization in (None, "gguf"):
    raise ParameterError("quantization", f"nothing to save: quantization={quantization!r} (a "
                                         f"float model or GGUF file is its own checkpoint)")
  if not is_builtin(source):
    source = os.path.abspath(source)
  save_quantized(path, params, source=source, quantization=quantization,
                 quantization_config=check_config(quantization, quantization_config))


def quantize_weights(config: ModelConfig, params: dict, quantization: str | None,
                     options: dict, *, int8_transposed: bool, tokenizer=None) -> dict:
  """`params` as `quantization` runs them (`options`: `check_config`'s). Params a checkpoint
  brought quantized are left as they are."""
  done = lambda x: isinstance(x, (QArray, GroupwiseArray))
  if quantization in (None, "gguf") or any(map(done, jax.tree.leaves(params, is_leaf=done))):
    return params
  kernels, declared = linear_kernels(config, int8_transposed), linear_kernels(config)
  if quantization == "mixed":
    _check_mixed_model(config, params, declared, options)
  # Mixed precision always runs the model over the calibration text: its sensitivity pass.
  calibrates = ((quantization == "w8a8" and options["smoothquant"])
                or (quantization == "int4" and options["method"] != "rtn")
                or quantization == "mixed")
  tokens = calibration_tokens(_calibration(tokenizer)) if calibrates else None
  # Gemma's norms scale by 1 + their param: scales fold into that.
  calibrate = lambda: dict(model=CausalLM(config), calibration=tokens,
                           norm_offset=1.0 if config.gemma_norm else 0.0)

  def run(params):
    if quantization == "w8a8" and options["smoothquant"]:
      params = smooth_model(params, declared, alpha=options["alpha"], gptq=options["gptq"],
                            store_kernels=kernels, **calibrate())
    if quantization == "int4":
      params = quantize_model(params, declared, method=options["method"],
                              group_size=options["group_size"], sym=options["sym"],
                              **(calibrate() if calibrates else {}))
    # What is still float among the linear kernels goes int8 (for int4: the embedding / head).
    to_int8 = lambda params, kernels: jax.tree.map(
        lambda w, k: w if k is None or done(w) else quantize(w, *k), params, kernels, is_leaf=done)
    if quantization == "mixed":  # its layers as allocated, the rest (the embedding) int8
      rest = lambda tree: {k: v for k, v in tree.items() if k != "layers"}
      return {**to_int8(rest(params), rest(kernels)), "layers": _mixed(params)["layers"]}
    return to_int8(params, kernels)

  def _mixed(params):
    model, k = CausalLM(config), quantization_cache.key(
        config, params, "mixed-sensitivity", {n: options[n] for n in options if n not in BUDGETS},
        tokens, int8_transposed)
    return mixed_quantize(
        params, declared, kernels, model=model, calibration=tokens,
        **{n: options[n] for n in ("method", "group_size", "sym", "granularity", *BUDGETS)},
        sensitivity_cache=lambda compute: quantization_cache.cached_array(k, compute),
        calibrate=lambda **kw: calibrate_stats(model, params, declared, tokens, **kw),
        norm_offset=1.0 if config.gemma_norm else 0.0)

  if not calibrates:
    return run(params)
  key = quantization_cache.key(config, params, quantization, options, tokens, int8_transposed)
  return quantization_cache.cached(key, quantization, options, lambda: run(params))


def _check_mixed_model(config: ModelConfig, params: dict, declared: dict, options: dict) -> None:
  """What `check_config` cannot see without the model: its feed-forward kind and the bits its
  shapes allow."""
  if any(config.moe_layers):
    raise ParameterError("quantization", "quantization='mixed' allocates dense decoder layers; "
                         "this model has MoE layers (use int4 or int8)")
  bits = options["bits"]
  if bits is not None:
    lo, hi = bits_range(params, declared, options["group_size"])
    if not lo <= bits <= hi:
      raise ParameterError("quantization_config", f"quantization_config: bits {bits} is outside "
                           f"what this model's layers can take: {lo:.3f} (all int4 in groups of "
                           f"up to {options['group_size']}, float32 scale and offset per group) "
                           f"to {hi:.3f} (all float)")


def _calibration(tokenizer):
  if tokenizer is None:
    raise ParameterError("quantization_config", "calibrating (AWQ, GPTQ, SmoothQuant) needs the "
                         "model's tokenizer to encode its text")
  return tokenizer
