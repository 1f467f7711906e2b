"""Model configuration: one frozen dataclass, read from HF config.json or GGUF metadata."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe",
                           "qwen3_moe", "gemma3")
# HF model types read as one of them: Gemma-3's text stack, alone or nested in a multimodal config.
_HF_MODEL_TYPES = {"gemma3_text": "gemma3"}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Gemma3TextConfig's defaults (transformers 5): a multimodal checkpoint's `text_config` often
# lists only the fields that differ from them.
_GEMMA3_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
    rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096, tie_word_embeddings=True,
    bos_token_id=2, eos_token_id=1, hidden_activation="gelu_pytorch_tanh")
GEMMA3_LOCAL_ROPE_THETA = 10_000.0  # transformers' default for the sliding-window layers
GEMMA3_GLOBAL_ROPE_THETA = 1_000_000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every 6th layer global when a config lists no layer types


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  architecture: str  # one of SUPPORTED_ARCHITECTURES
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  # None, or a dict with "rope_type" in ("linear", "llama3") and that type's parameters.
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # Qwen2: biases on q/k/v projections
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
  # Per-layer sliding window (None = full attention), length num_layers.
  sliding_windows: tuple[int | None, ...] = ()
  # Gemma-3's local layers rotate with their own rope (`local_rope_theta`, `local_rope_scaling`);
  # per layer, length num_layers (all False: every layer uses rope_theta / rope_scaling).
  local_rope: tuple[bool, ...] = ()
  local_rope_theta: float = 10000.0
  local_rope_scaling: tuple[tuple[str, Any], ...] | None = None
  # Gemma: RMSNorm scales by (1 + weight) in float32; the norms after attention and after the
  # MLP ("sandwich" norms); the embedding times sqrt(hidden_size); attention's sm_scale from
  # query_pre_attn_scalar (None: head_dim ** -0.5); tanh soft caps on attention scores and on
  # the final logits (None: none).
  gemma_norm: bool = False
  sandwich_norms: bool = False
  scale_embedding: bool = False
  query_pre_attn_scalar: float | None = None
  attn_logit_softcapping: float | None = None
  final_logit_softcapping: float | None = None
  hidden_act: str = "silu"  # the gated MLP's activation, one of ACTIVATIONS
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  # Mixture-of-experts (0 experts: a dense model). Routing is softmax then top-k, the top-k
  # weights renormalized when `norm_topk_prob` (Mixtral always).
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0  # each routed expert's FFN width
  shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0: none
  norm_topk_prob: bool = False
  # Per layer: an MoE layer (True) or a dense MLP of `intermediate_size`; length num_layers.
  moe_layers: tuple[bool, ...] = ()

  def __post_init__(self):
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise ValueError(f"unsupported architecture {self.architecture!r}; jinfer supports "
                       f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if not self.sliding_windows:
      object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
    if len(self.sliding_windows) != self.num_layers:
      raise ValueError("sliding_windows must have one entry per layer")
    if not self.local_rope:
      object.__setattr__(self, "local_rope", (False,) * self.num_layers)
    if len(self.local_rope) != self.num_layers:
      raise ValueError("local_rope must have one entry per layer")
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; jinfer supports "
                       f"{', '.join(ACTIVATIONS)}")
    if not self.moe_layers:
      object.__setattr__(self, "moe_layers", (self.num_experts > 0,) * self.num_layers)
    if len(self.moe_layers) != self.num_layers:
      raise ValueError("moe_layers must have one entry per layer")
    if any(self.moe_layers) and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
      raise ValueError(f"MoE layers need 0 < num_experts_per_tok <= num_experts and a positive "
                       f"moe_intermediate_size; got {self.num_experts_per_tok} of "
                       f"{self.num_experts} experts, moe_intermediate_size "
                       f"{self.moe_intermediate_size}")

  @property
  def moe_layer_ids(self) -> tuple[int, ...]:
    return tuple(i for i, moe in enumerate(self.moe_layers) if moe)

  @property
  def rope_scaling_dict(self) -> dict[str, Any] | None:
    return dict(self.rope_scaling) if self.rope_scaling else None

  @property
  def embed_scale(self) -> float | None:
    return self.hidden_size ** 0.5 if self.scale_embedding else None

  @property
  def sm_scale(self) -> float:
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  def inv_freq(self, local: bool = False) -> np.ndarray:  # [head_dim // 2] float64
    """Rotary inverse frequencies, with HF's scaling rules applied (`local`: the local layers')."""
    theta, scaling = ((self.local_rope_theta, self.local_rope_scaling) if local
                      else (self.rope_theta, self.rope_scaling))
    inv = 1.0 / (theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
    sc = dict(scaling) if scaling else None
    if sc is None:
      return inv
    kind = sc["rope_type"]
    if kind == "linear":
      return inv / sc["factor"]
    if kind == "llama3":
      factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
      old_len = sc["original_max_position_embeddings"]
      low_wavelen, high_wavelen = old_len / lo, old_len / hi
      wavelen = 2 * math.pi / inv
      scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
      smooth = (old_len / wavelen - lo) / (hi - lo)
      smoothed = (1 - smooth) * scaled / factor + smooth * scaled
      medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
      return np.where(medium, smoothed, scaled)
    raise AssertionError(kind)  # rejected in from_hf_dict

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
    if d.get("model_type") == "gemma3" and "text_config" in d:  # multimodal: its text stack
      d = {"model_type": "gemma3_text", **(d["text_config"] or {})}
    arch = _HF_MODEL_TYPES.get(d.get("model_type"), d.get("model_type"))
    if arch == "gemma3":
      return _gemma3_from_hf(cls, {**_GEMMA3_DEFAULTS, **d}, source)
    if arch not in SUPPORTED_ARCHITECTURES:
      raise ValueError(f"{source}: unsupported architecture model_type={arch!r}; jinfer supports "
                       f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
      num_layers = d["num_hidden_layers"]
      num_heads = d["num_attention_heads"]
      hidden = d["hidden_size"]
      # transformers 5 writes rope_parameters; older files have rope_theta / rope_scaling.
      rope = dict(d.get("rope_parameters") or {})
      theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
      if not rope and d.get("rope_scaling"):
        rope = dict(d["rope_scaling"])
        if "type" in rope and "rope_type" not in rope:
          rope["rope_type"] = rope.pop("type")
      scaling = _rope_scaling(rope, source)

      windows: list[int | None] = [None] * num_layers
      window = d.get("sliding_window")
      if arch in ("mistral", "mixtral") and window:
        windows = [window] * num_layers
      elif arch in ("qwen2", "qwen3", "qwen2_moe") and d.get("use_sliding_window") and window:
        max_window = d.get("max_window_layers", num_layers)
        if arch == "qwen2_moe":  # transformers' defaults when the file lists no layer types
          sliding = lambda i: (i + 1) % 2 == 1 and i < max_window
        else:
          sliding = lambda i: i >= max_window
        types = d.get("layer_types") or [
            "sliding_attention" if sliding(i) else "full_attention" for i in range(num_layers)]
        windows = [window if t == "sliding_attention" else None for t in types]
      elif arch == "qwen3_moe" and d.get("use_sliding_window") and window:
        windows = [window] * num_layers

      eos = d.get("eos_token_id")
      eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
      moe = _hf_moe_fields(arch, d, num_layers, source)
      return cls(
          architecture=arch,
          vocab_size=d["vocab_size"],
          hidden_size=hidden,
          intermediate_size=d["intermediate_size"],
          num_layers=num_layers,
          num_heads=num_heads,
          num_kv_heads=d.get("num_key_value_heads") or num_heads,
          head_dim=d.get("head_dim") or hidden // num_heads,
          rms_norm_eps=d.get("rms_norm_eps", 1e-6),
          rope_theta=float(theta),
          rope_scaling=scaling,
          max_position_embeddings=d.get("max_position_embeddings", 2048),
          tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
          attention_bias=(arch == "qwen2" or (arch == "qwen2_moe" and d.get("qkv_bias", True))
                          or bool(d.get("attention_bias", False))),
          qk_norm=arch in ("qwen3", "qwen3_moe"),
          sliding_windows=tuple(windows),
          bos_token_id=d.get("bos_token_id"),
          eos_token_ids=eos_ids,
          **moe,
      )
    except KeyError as e:
      raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None

  @classmethod
  def from_hf_dir(cls, path: str) -> "ModelConfig":
    f = os.path.join(path, "config.json")
    if not os.path.exists(f):
      raise FileNotFoundError(f"{path}: no config.json (expected an HF model directory)")
    try:
      with open(f) as fh:
        d = json.load(fh)
    except json.JSONDecodeError as e:
      raise ValueError(f"{f}: not valid JSON ({e})") from None
    return cls.from_hf_dict(d, source=f)


def _rope_scaling(rope: dict[str, Any], source: str) -> tuple[tuple[str, Any], ...] | None:
  """ModelConfig's rope_scaling from an HF rope dict (rope_theta removed)."""
  kind = rope.get("rope_type", "default")
  if kind not in ("default", "linear", "llama3"):
    raise ValueError(f"{source}: unsupported rope_type {kind!r} (supported: default, linear, llama3)")
  return tuple(sorted(rope.items())) if kind != "default" else None


def gemma3_layer_types(num_layers: int,
                       pattern: int = GEMMA3_SLIDING_WINDOW_PATTERN) -> list[str]:
  """transformers' default Gemma-3 layers: every `pattern`-th one global, the others local."""
  return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _gemma3_from_hf(cls, d: dict[str, Any], source: str) -> ModelConfig:
  """Gemma3TextConfig (transformers 5, older files too) -> ModelConfig."""
  n = d["num_hidden_layers"]
  types = d.get("layer_types") or gemma3_layer_types(
      n, d.get("sliding_window_pattern") or GEMMA3_SLIDING_WINDOW_PATTERN)
  if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
    raise ValueError(f"{source}: layer_types must list 'sliding_attention' or 'full_attention' "
                     f"for each of the {n} layers")
  # transformers 5 writes rope_parameters per layer type; older files rope_theta,
  # rope_local_base_freq and rope_scaling (the global layers').
  per_type = d.get("rope_parameters") or {}
  if per_type and not ({"full_attention", "sliding_attention"} & set(per_type)):
    per_type = {"full_attention": per_type}  # one dict for the global layers
  glob = dict(per_type.get("full_attention") or {})
  if not glob and d.get("rope_scaling"):
    glob = dict(d["rope_scaling"])
    if "type" in glob and "rope_type" not in glob:
      glob["rope_type"] = glob.pop("type")
  local = dict(per_type.get("sliding_attention") or {})
  theta = float(glob.pop("rope_theta", d.get("rope_theta", GEMMA3_GLOBAL_ROPE_THETA)))
  local_theta = float(local.pop("rope_theta",
                                d.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA)))
  window = d.get("sliding_window")
  if d.get("use_bidirectional_attention"):
    raise ValueError(f"{source}: bidirectional attention (EmbeddingGemma) is not supported")
  act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
  if act not in ACTIVATIONS:
    raise ValueError(f"{source}: unsupported hidden_activation {act!r}")
  eos = d.get("eos_token_id")
  return cls(
      architecture="gemma3",
      vocab_size=d["vocab_size"],
      hidden_size=d["hidden_size"],
      intermediate_size=d["intermediate_size"],
      num_layers=n,
      num_heads=d["num_attention_heads"],
      num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
      head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
      rms_norm_eps=d["rms_norm_eps"],
      rope_theta=theta,
      rope_scaling=_rope_scaling(glob, source),
      local_rope=tuple(t == "sliding_attention" for t in types),
      local_rope_theta=local_theta,
      local_rope_scaling=_rope_scaling(local, source),
      max_position_embeddings=d["max_position_embeddings"],
      tie_word_embeddings=bool(d["tie_word_embeddings"]),
      attention_bias=bool(d.get("attention_bias", False)),
      qk_norm=True,
      sliding_windows=tuple(window if t == "sliding_attention" and window else None
                            for t in types),
      bos_token_id=d.get("bos_token_id"),
      eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
      gemma_norm=True,
      sandwich_norms=True,
      scale_embedding=True,
      query_pre_attn_scalar=d["query_pre_attn_scalar"],
      attn_logit_softcapping=d.get("attn_logit_softcapping"),
      final_logit_softcapping=d.get("final_logit_softcapping"),
      hidden_act=act,
  )


def _hf_moe_fields(arch: str, d: dict[str, Any], num_layers: int, source: str) -> dict[str, Any]:
  """ModelConfig's MoE fields from an HF config, with transformers' defaults for absent keys."""
  if arch not in ("mixtral", "qwen2_moe", "qwen3_moe"):
    return {}
  if d.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{source}: unsupported hidden_act {d['hidden_act']!r} (jinfer's experts "
                     f"use silu)")
  if arch == "mixtral":
    return dict(num_experts=d.get("num_local_experts", 8),
                num_experts_per_tok=d.get("num_experts_per_tok", 2),
                moe_intermediate_size=d["intermediate_size"], norm_topk_prob=True)
  # Qwen2-MoE and Qwen3-MoE files say num_experts or num_local_experts.
  experts = d.get("num_experts", d.get("num_local_experts",
                                       60 if arch == "qwen2_moe" else 128))
  step, dense = d.get("decoder_sparse_step", 1), set(d.get("mlp_only_layers") or ())
  if step < 1:
    raise ValueError(f"{source}: decoder_sparse_step must be >= 1, got {step}")
  fields = dict(
      num_experts=experts,
      num_experts_per_tok=d.get("num_experts_per_tok", 4 if arch == "qwen2_moe" else 8),
      moe_intermediate_size=d.get("moe_intermediate_size", 1408 if arch == "qwen2_moe" else 768),
      norm_topk_prob=bool(d.get("norm_topk_prob", False)),
      # transformers' rule (Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer)
      moe_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                       for i in range(num_layers)))
  if arch == "qwen2_moe":
    fields["shared_expert_intermediate_size"] = d.get("shared_expert_intermediate_size", 5632)
  return fields
