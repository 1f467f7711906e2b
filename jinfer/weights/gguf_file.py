"""GGUF files (llama.cpp's format) -> ModelConfig and the jinfer params tree.

The config comes from the `<arch>.*` and `tokenizer.ggml.*` metadata. Tensors are renamed to HF
names, dequantized one at a time with `gguf.quants` (the file itself is memory-mapped), and
llama.cpp's rotary permutation of Q/K is undone exactly as transformers undoes it, so
`hf_to_params` sees the same tensors `AutoModelForCausalLM.from_pretrained(gguf_file=...)` would.

Mixture-of-experts files: Mixtral (llama.cpp writes it as `llama` with `expert_count`),
`qwen2moe` and `qwen3moe`. Experts are stacked `blk.N.ffn_{gate,up,down}_exps` tensors, served
as transformers 5's fused `experts.gate_up_proj` / `experts.down_proj`; the router is
`ffn_gate_inp`, Qwen2-MoE's shared expert `ffn_{gate,up,down}_shexp` and its gate
`ffn_gate_inp_shexp`. A layer is an MoE layer when it has a router: GGUF metadata has no
`decoder_sparse_step`, so mixed dense/MoE files are read from their tensors.

Gemma-3 (`gemma3`): llama.cpp stores every RMSNorm weight as 1 + weight (its norm does not add
the one), names the norms around the MLP `ffn_norm` (pre) and `post_ffw_norm`, and stores no
local/global layer pattern nor the local layers' rope base: both are transformers' defaults.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from jinfer.config import (GEMMA3_LOCAL_ROPE_THETA, GEMMA3_SLIDING_WINDOW_PATTERN, ModelConfig,
                           gemma3_layer_types)
from jinfer.weights.gguf_reader import GGUFFile, GGUFTensor
from jinfer.weights.hf_layout import WeightError, hf_to_params

_Q = GGMLQuantizationType
SUPPORTED_TYPES = (_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1,
                   _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K, _Q.IQ4_NL, _Q.IQ4_XS, _Q.MXFP4,
                   _Q.NVFP4)

# GGUF `general.architecture` -> jinfer architecture. llama.cpp also writes Mistral as "llama",
# and Mixtral as "llama" with experts.
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                  "qwen3moe": "qwen3_moe", "gemma3": "gemma3"}

_GLOBAL_NAMES = {  # GGUF tensor -> HF tensor
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {  # blk.N.<GGUF> -> model.layers.N.<HF>, without the .weight/.bias suffix
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GEMMA3_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if not k.startswith("ffn_") or k in (
        "ffn_gate", "ffn_up", "ffn_down")},
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# transformers' fused expert tensors -> the stacked GGUF tensors they are made of, in order.
_EXPERTS = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "down_proj": ("ffn_down_exps",)}
_HF_EXPERTS_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_LAYER_NAMES_BY_ARCH = {"gemma3": _GEMMA3_LAYER_NAMES}
_HF_LAYER_NAMES_BY_ARCH = {a: {v: k for k, v in t.items()} for a, t in (
    (None, _LAYER_NAMES), *_LAYER_NAMES_BY_ARCH.items())}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.([\w.]+)\.(weight|bias)")
# Values per row handed to gguf.quants.dequantize at most; rows shorter than this are joined.
_ROW_VALUES = 4096


def open_gguf(path: str) -> GGUFFile:
  """Memory-map a GGUF file and parse its header, turning every parse failure into a
  WeightError naming the file.

  Readers are cached per file version: a model's tokenizer and weights usually come from the
  same file, and decoding a large vocabulary is the bulk of the parse.
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such GGUF file")
  st = os.stat(path)
  return _open_cached(os.path.realpath(path), st.st_size, st.st_mtime_ns, path)


@functools.lru_cache(maxsize=4)
def _open_cached(realpath: str, size: int, mtime_ns: int, path: str) -> GGUFFile:
  del size, mtime_ns  # cache key only: a rewritten file is parsed again
  try:
    return GGUFFile(realpath)
  except ValueError as e:
    raise WeightError(f"{path}: truncated or corrupt GGUF file: {e}") from None


def gguf_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
  """A metadata value as Python (str, int, float, bool, or a new list of them), or `default`."""
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def gguf_array_len(reader: GGUFFile, key: str) -> int | None:
  """Length of an array metadata value without building the list (1 for a scalar, as gguf-py
  counts it)."""
  field = reader.fields.get(key)
  if field is None:
    return None
  return len(field.value) if field.types[0] == GGUFValueType.ARRAY else 1


def gguf_to_hf_name(name: str, arch: str | None = None) -> str | None:
  """HF name of a GGUF tensor of a file of GGUF architecture `arch`; None for tensors jinfer
  does not load (e.g. rope_freqs)."""
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  names = _LAYER_NAMES_BY_ARCH.get(arch, _LAYER_NAMES)
  m = _GGUF_LAYER_RE.fullmatch(name)
  if m and m[2] in names:
    return f"model.layers.{m[1]}.{names[m[2]]}.{m[3]}"
  return None


def hf_to_gguf_name(name: str, arch: str | None = None) -> str:
  for g, h in _GLOBAL_NAMES.items():
    if h == name:
      return g
  names = _HF_LAYER_NAMES_BY_ARCH[arch if arch in _LAYER_NAMES_BY_ARCH else None]
  m = _HF_LAYER_RE.fullmatch(name)
  assert m and m[2] in names, name  # hf_layout only asks for names in the tables
  return f"blk.{m[1]}.{names[m[2]]}.{m[3]}"


def stored_norm_offset(arch: str | None, hf_name: str) -> float:
  """What llama.cpp added to an HF tensor when it wrote it (Gemma's norms: 1)."""
  return 1.0 if arch == "gemma3" and hf_name.endswith("norm.weight") else 0.0


def _llama3_rope_scaling(freq_factors: np.ndarray, theta: float, head_dim: int, *,
                         source: str) -> tuple[tuple[str, Any], ...]:
  """Recover Llama 3.1-style rope scaling from llama.cpp's `rope_freqs` tensor.

  llama.cpp stores the per-frequency divisors instead of the parameters. Every Llama 3.x release
  uses low/high frequency factors 1 and 4 around an 8192-token original context, so the scaling
  factor is the largest divisor; the fit is then checked divisor by divisor.
  """
  scaling = (("factor", float(freq_factors.max())), ("high_freq_factor", 4.0),
             ("low_freq_factor", 1.0), ("original_max_position_embeddings", 8192),
             ("rope_type", "llama3"))
  probe = ModelConfig(architecture="llama", vocab_size=1, hidden_size=head_dim,
                      intermediate_size=1, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=head_dim, rope_theta=theta, rope_scaling=scaling)
  plain = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [D/2]
  if freq_factors.shape != plain.shape or not np.allclose(plain / probe.inv_freq(), freq_factors,
                                                          rtol=1e-4):
    raise WeightError(f"{source}: tensor 'rope_freqs.weight' holds rope frequency factors that "
                      f"match no Llama 3 rope scaling; jinfer cannot reproduce them")
  return scaling


def _dequantized(t: GGUFTensor, source: str) -> np.ndarray:  # [rows..., cols] float32
  if t.tensor_type not in SUPPORTED_TYPES:
    supported = ", ".join(q.name for q in SUPPORTED_TYPES)
    raise WeightError(f"{source}: tensor {t.name!r} has type {t.tensor_type.name}, which jinfer "
                      f"cannot dequantize (supported: {supported})")
  if t.data.ndim != 2:
    return dequantize(t.data, t.tensor_type)
  # gguf.quants dequantizes 16 rows per round of numpy calls, so short rows spend most of the
  # time in Python between rounds. Blocks never straddle rows: k rows dequantize as one.
  cols, rows = t.shape
  most = max(1, _ROW_VALUES // max(cols, 1))
  k = next(d for d in range(most, 0, -1) if rows % d == 0)
  return dequantize(t.data.reshape(rows // k, k * t.data.shape[1]),
                    t.tensor_type).reshape(rows, cols)


def _unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's Q/K row permutation (transformers' `_reverse_permute_weights`).

  llama.cpp interleaves each head's two rotary halves so its rope rotates adjacent pairs; HF's
  rotate-half rope wants the halves contiguous again.
  """
  half = w.shape[0] // heads // 2
  return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader: GGUFFile, source: str) -> ModelConfig:
  """ModelConfig from a GGUF file's metadata (and, for tied embeddings, its tensor list)."""
  arch = gguf_value(reader, "general.architecture")
  if arch not in _ARCHITECTURES:
    raise WeightError(f"{source}: unsupported GGUF architecture {arch!r}; jinfer loads "
                      f"{', '.join(_ARCHITECTURES)}")

  def need(key: str) -> Any:
    value = gguf_value(reader, f"{arch}.{key}")
    if value is None:
      raise WeightError(f"{source}: missing metadata {arch}.{key}")
    return value

  hidden, heads = need("embedding_length"), need("attention.head_count")
  rope_dim = gguf_value(reader, f"{arch}.rope.dimension_count")
  # transformers reads Llama's head dim from the rope dimension; newer files also state it.
  head_dim = gguf_value(reader, f"{arch}.attention.key_length") or rope_dim or hidden // heads
  if rope_dim is not None and rope_dim != head_dim:
    raise WeightError(f"{source}: partial rotary embeddings ({arch}.rope.dimension_count="
                      f"{rope_dim}, head dim {head_dim}) are not supported")
  theta = float(gguf_value(reader, f"{arch}.rope.freq_base", 10000.0))

  scaling = None
  kind = gguf_value(reader, f"{arch}.rope.scaling.type", "none")
  if kind == "linear":
    scaling = (("factor", float(need("rope.scaling.factor"))), ("rope_type", "linear"))
  elif kind != "none":
    raise WeightError(f"{source}: unsupported rope scaling {arch}.rope.scaling.type={kind!r} "
                      f"(supported: none, linear, and Llama 3's rope_freqs)")
  tensors = {t.name: t for t in reader.tensors}
  if "rope_freqs.weight" in tensors:
    scaling = _llama3_rope_scaling(_dequantized(tensors["rope_freqs.weight"], source), theta,
                                   head_dim, source=source)

  vocab = (gguf_array_len(reader, "tokenizer.ggml.tokens")
           or gguf_value(reader, f"{arch}.vocab_size"))
  if vocab is None:
    raise WeightError(f"{source}: no tokenizer.ggml.tokens or {arch}.vocab_size to size the vocab")
  eos = [gguf_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
  moe = _moe_config(reader, arch, need, tensors, source)
  extra = (_gemma3_config(reader, arch, need, hidden, heads, head_dim, source)
           if arch == "gemma3" else {})
  return ModelConfig(
      architecture="mixtral" if arch == "llama" and moe else _ARCHITECTURES[arch],
      vocab_size=vocab,
      hidden_size=hidden,
      intermediate_size=need("feed_forward_length"),
      num_layers=need("block_count"),
      num_heads=heads,
      num_kv_heads=gguf_value(reader, f"{arch}.attention.head_count_kv") or heads,
      head_dim=head_dim,
      rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
      rope_theta=theta,
      rope_scaling=scaling,
      max_position_embeddings=gguf_value(reader, f"{arch}.context_length", 2048),
      # llama.cpp writes no output projection when it is the embedding matrix.
      tie_word_embeddings="output.weight" not in tensors,
      attention_bias=arch in ("qwen2", "qwen2moe"),
      qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
      bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id"),
      eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
      **moe,
      **extra,
  )


def _gemma3_config(reader: GGUFFile, arch: str, need, hidden: int, heads: int, head_dim: int,
                   source: str) -> dict[str, Any]:
  """Gemma-3's ModelConfig fields. The file has the global layers' rope and the window; the
  layer pattern and the local rope base are transformers' defaults unless a newer file states a
  `sliding_window_pattern` (a period, or one flag per layer, true for a local layer)."""
  layers = need("block_count")
  pattern = gguf_value(reader, f"{arch}.attention.sliding_window_pattern")
  if isinstance(pattern, list):
    local = tuple(bool(p) for p in pattern)
    if len(local) != layers:
      raise WeightError(f"{source}: {arch}.attention.sliding_window_pattern lists {len(local)} "
                        f"layers, the file has {layers}")
  else:
    local = tuple(t == "sliding_attention" for t in gemma3_layer_types(
        layers, pattern or GEMMA3_SLIDING_WINDOW_PATTERN))
  window = need("attention.sliding_window")
  return dict(
      local_rope=local,
      local_rope_theta=GEMMA3_LOCAL_ROPE_THETA,
      sliding_windows=tuple(window if w else None for w in local),
      gemma_norm=True, sandwich_norms=True, scale_embedding=True,
      # llama.cpp's rule: Gemma-3 27B (62 layers) scales queries by hidden / heads, the others
      # by the head dim (transformers' configs say the same through query_pre_attn_scalar).
      query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
      attn_logit_softcapping=gguf_value(reader, f"{arch}.attn_logit_softcapping"),
      final_logit_softcapping=gguf_value(reader, f"{arch}.final_logit_softcapping"),
      hidden_act="gelu_pytorch_tanh")


def _moe_config(reader: GGUFFile, arch: str, need, tensors: dict, source: str) -> dict[str, Any]:
  """ModelConfig's MoE fields from `<arch>.expert_*` metadata; which layers are MoE layers from
  the tensors (a router `ffn_gate_inp` per MoE layer)."""
  experts = gguf_value(reader, f"{arch}.expert_count")
  if not experts:
    if arch in ("qwen2moe", "qwen3moe"):
      raise WeightError(f"{source}: {arch} file without {arch}.expert_count")
    return {}
  if (gating := gguf_value(reader, f"{arch}.expert_gating_func")) not in (None, 1):
    raise WeightError(f"{source}: unsupported {arch}.expert_gating_func={gating} (jinfer routes "
                      f"with softmax, 1)")
  if (scale := gguf_value(reader, f"{arch}.expert_weights_scale")) not in (None, 1.0):
    raise WeightError(f"{source}: unsupported {arch}.expert_weights_scale={scale} (only 1)")
  if (shared := gguf_value(reader, f"{arch}.expert_shared_count")) not in (None, 0, 1):
    raise WeightError(f"{source}: {arch}.expert_shared_count={shared}: jinfer supports one "
                      f"shared expert")
  if any(re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", n) for n in tensors):
    raise WeightError(f"{source}: experts stored one tensor each (blk.N.ffn_gate.E.weight, an "
                      f"old llama.cpp layout) are not supported; convert the model again to get "
                      f"stacked blk.N.ffn_gate_exps tensors")
  layers = need("block_count")
  moe_layers = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(layers))
  if not any(moe_layers):
    raise WeightError(f"{source}: {arch}.expert_count={experts} but no layer has a router "
                      f"(blk.N.ffn_gate_inp.weight)")
  # llama.cpp renormalizes the top-k weights of Mixtral and Qwen3-MoE, not of Qwen2-MoE.
  norm = gguf_value(reader, f"{arch}.expert_weights_norm", arch != "qwen2moe")
  return dict(
      num_experts=experts,
      num_experts_per_tok=need("expert_used_count"),
      # Mixtral's experts are its feed-forward: llama.cpp writes their width as the FFN's.
      moe_intermediate_size=gguf_value(reader, f"{arch}.expert_feed_forward_length")
      or need("feed_forward_length"),
      shared_expert_intermediate_size=(
          need("expert_shared_feed_forward_length") if any(
              n.endswith("ffn_gate_shexp.weight") for n in tensors) else 0),
      norm_topk_prob=bool(norm),
      moe_layers=moe_layers)


def load_gguf(path: str, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
  """Read a GGUF file into (config, params), dequantizing one tensor at a time.

  Dequantizing on a thread pool (tensors ahead of hf_to_params, large ones in row blocks)
  measured slower: gguf.quants works through many small numpy operations per tensor with
  Python in between, which leaves threads little to overlap.
  """
  reader = open_gguf(path)
  config = gguf_config(reader, path)
  arch = gguf_value(reader, "general.architecture")
  by_hf_name = {hf: t for t in reader.tensors if (hf := gguf_to_hf_name(t.name, arch))}
  by_name = {t.name: t for t in reader.tensors}
  # llama.cpp permutes Q/K rows only for its llama architecture (Mixtral's too); Qwen already
  # uses HF's rope.
  permute = arch == "llama"

  def get(name: str) -> np.ndarray:
    if m := _HF_EXPERTS_RE.fullmatch(name):  # [X, rows, cols] each, rows joined
      parts = [f"blk.{m[1]}.{part}.weight" for part in _EXPERTS[m[2]]]
      for part in parts:
        if part not in by_name:
          raise WeightError(f"{path}: missing tensor {part!r} (part of HF {name!r})")
      return np.concatenate([_dequantized(by_name[p], path) for p in parts], axis=1)
    t = by_hf_name.get(name)
    if t is None:
      raise WeightError(f"{path}: missing tensor {hf_to_gguf_name(name, arch)!r} (HF {name!r})")
    is_q, is_k = ".q_proj." in name, ".k_proj." in name
    if permute and (is_q or is_k):
      heads = config.num_heads if is_q else config.num_kv_heads
      rows = t.shape[-1] if t.shape else 1  # GGUF lists dimensions innermost first
      if rows != heads * config.head_dim:
        raise WeightError(f"{path}: tensor {t.name!r} has {rows} rows, expected "
                          f"{heads} heads x {config.head_dim}")
      if t.data.ndim > 1:  # a 1-D tensor is left to fail hf_to_params' shape check
        # Rows dequantize independently: moving the stored rows ([rows, row bytes] for block
        # types) copies a fraction of the bytes that moving the float32 rows would.
        t = t._replace(data=_unpermute_rope(t.data, heads))
    w = _dequantized(t, path)
    if offset := stored_norm_offset(arch, name):
      w = w - np.float32(offset)
    # llama.cpp stores the shared expert's gate as a vector; transformers' is a [1, E] linear.
    return w[None] if name.endswith("shared_expert_gate.weight") else w

  return config, hf_to_params(config, get, dtype=dtype, source=path)
