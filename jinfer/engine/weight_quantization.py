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
  "mxfp4"  4-bit micro-floats (W4A16): e2m1 values, a power-of-two scale per block of 32
  "nvfp4"  4-bit micro-floats: e2m1 values, an e4m3 scale per block of 16 and one float32 scale
           per tensor. Both `quantization_config={"method": "rtn" | "awq"}`, the projections
           as "int4" picks them (`jinfer/quant/microfloat.py`), kept in the group-wise
           codebook form; the embedding int8
  "gguf"   a GGUF file's blocks as stored: the loader keeps them, nothing to do here. The
           default for a GGUF file on a GPU (`default_quantization`)
  "fp8"    the decoder layers' projections float8 (e4m3) per output channel, activations
           float8 per token, dynamic (vLLM's FP8-dynamic); `quantization_config={"activations":
           "float"}` keeps activations float (W8A16-FP8). The embedding and LM head int8 per
           channel, as under int4: in fp8 they cost SmolLM2 another 3.6% of perplexity (+6.7%
           against +3.8%, docs/quantization.md). No calibration. Dense models only (no float8
           grouped matmul for MoE experts yet)
  "mixed"  each linear across the layers (`"granularity": "linear"`, the default) or each
           decoder layer's linears (`"layer"`) int4 (by `method`), int8 or float, picked by
           their measured sensitivity to meet `{"bits": 5.5}` (average bits per weight, scales
           counted) or `{"max_ppl_increase": 0.02}` (on the calibration text); see
           jinfer/quant/mixed.py

Calibration (AWQ, GPTQ, SmoothQuant, mixed precision's sensitivities) runs the float model over the English text shipped with
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
from jinfer.quant.microfloat import FORMATS
from jinfer.quant.mixed import GRANULARITIES, bits_range, mixed_quantize
from jinfer.quant.model import METHODS, quantize_model, smooth_model
from jinfer.quant.qarray import QArray, quantize, relayout
from jinfer.weights.builtin import RANDOM_MODELS, is_builtin
from jinfer.weights.hf_quantized import is_quantized_dir
from jinfer.weights.hf_quantized_dir import checkpoint_quantization
from jinfer.weights.quantized_checkpoint import is_quantized_checkpoint, read_meta, save_quantized

# quantization -> the quantization_config keys it reads, with their defaults
CONFIG_KEYS = {"int8": {}, "w8a8": {"smoothquant": True, "alpha": 0.7, "gptq": True},
               "int4": {"method": "rtn", "group_size": 128, "sym": False}, "gguf": {},
               **{fmt: {"method": "rtn"} for fmt in FORMATS},
               "fp8": {"activations": "fp8"},
               "mixed": {"bits": None, "max_ppl_increase": None, "method": "awq",
                         "group_size": 128, "sym": False, "granularity": "linear"}}
FP4_METHODS = ("rtn", "awq")
FP8_ACTIVATIONS = ("fp8", "float")  # quantization_config["activations"] of "fp8"
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
  if quantization == "fp8" and out["activations"] not in FP8_ACTIVATIONS:
    raise ParameterError("quantization_config", f"quantization_config: activations must be one "
                         f"of {', '.join(FP8_ACTIVATIONS)}, got {out['activations']!r}")
  if quantization in ("int4", "mixed"):
    if out["method"] not in METHODS:
      raise ParameterError("quantization_config", f"quantization_config: method must be one of "
                           f"{', '.join(METHODS)}, got {out['method']!r}")
    g = out["group_size"]
    if isinstance(g, bool) or not isinstance(g, int) or g < 2 or g & (g - 1):
      raise ParameterError("quantization_config", f"quantization_config: group_size must be a "
                           f"power of two >= 2, got {g!r}")
  if quantization in FORMATS and out["method"] not in FP4_METHODS:
    raise ParameterError("quantization_config", f"quantization_config: method must be one of "
                         f"{', '.join(FP4_METHODS)} for {quantization}, got {out['method']!r}")
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
  engine config returned says so, with the options it was saved with, and asking for another
  quantization is an error."""
  config = default_quantization(config, model, jax.default_backend())
  m = config.model
  check_config(m.quantization, m.quantization_config)
  if m.quantization == "gguf" and not is_gguf(model):
    raise ParameterError("quantization", f"quantization='gguf' keeps a GGUF file's blocks "
                                         f"quantized; {model!r} is not a .gguf file")
  own, own_config = None, None
  if os.path.isdir(model):
    if is_quantized_checkpoint(model):
      meta = read_meta(model)
      own, own_config = meta["quantization"], meta.get("quantization_config") or None
    elif is_quantized_dir(model):
      own, own_config = checkpoint_quantization(model)
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


def calibrated(quantization: str | None, options: dict) -> bool:
  """Whether `quantization` (`options`: `check_config`'s) calibrates on text: SmoothQuant,
  AWQ, GPTQ and mixed precision do; round-to-nearest does not."""
  return ((quantization == "w8a8" and options["smoothquant"])
          or ((quantization == "int4" or quantization in FORMATS) and options["method"] != "rtn")
          or quantization == "mixed")  # its sensitivity pass runs the model over the text


def quantize_weights(config: ModelConfig, params: dict, quantization: str | None,
                     options: dict, *, int8_transposed: bool, tokenizer=None) -> dict:
  """`params` as `quantization` runs them (`options`: `check_config`'s). Params a checkpoint
  brought quantized keep their values; per-channel ones are laid out as this engine's matmul
  reads them (`int8_transposed`), exactly."""
  done = lambda x: isinstance(x, (QArray, GroupwiseArray))
  if quantization in (None, "gguf"):
    return params
  kernels = linear_kernels(config, int8_transposed)
  if any(map(done, jax.tree.leaves(params, is_leaf=done))):
    if quantization == "mixed":  # runs of layers as saved; each int8 kernel says its layout
      return params
    return jax.tree.map(lambda w, k: relayout(w, k[3]) if isinstance(w, QArray) else w, params,
                        kernels, is_leaf=done)
  if quantization == "fp8" and config.moe_layer_ids:
    raise ParameterError("quantization", "quantization='fp8' runs dense models; MoE experts "
                         "have no float8 grouped matmul yet (use int8, w8a8 or int4)")
  declared = linear_kernels(config)
  fmt = "fp8" if quantization == "fp8" else "int8"
  if quantization == "mixed":
    _check_mixed_model(config, params, declared, options)
  calibrates = calibrated(quantization, options)
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
    if quantization in FORMATS:
      params = quantize_model(params, declared, method=options["method"], fmt=quantization,
                              **(calibrate() if calibrates else {}))
    # What is still float among the linear kernels goes int8 (for int4: the embedding / head),
    # or for fp8 the decoder layers' (stacked) kernels fp8 and the embedding / head int8.
    to_int8 = lambda params, kernels: jax.tree.map(
        lambda w, k: w if k is None or done(w) else quantize(
            w, *k, fmt=fmt if w.ndim > k[0] + k[1] else "int8"), params, kernels, is_leaf=done)
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
