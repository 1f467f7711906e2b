"""HF tensor names and layouts -> the jinfer params tree. Every format loads through here.

A loader only has to answer "give me the HF-named tensor as numpy" (GGUF loaders rename and
un-permute first); this module knows which tensors a config needs, checks their shapes and
rearranges them into the model's `[in..., out...]` kernels, per-layer tensors written straight
into their slot of the stacked `[L, ...]` arrays.
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from jinfer.config import ModelConfig


class WeightError(ValueError):
  """A checkpoint file is missing a tensor, has a wrong shape, or is unreadable."""


def _expect(arr: np.ndarray, shape: tuple[int, ...], name: str, source: str) -> np.ndarray:
  if tuple(arr.shape) != shape:
    raise WeightError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, expected {shape}")
  return arr


def hf_to_params(config: ModelConfig, get: Callable[[str], np.ndarray], *, dtype=jnp.float32,
                 source: str) -> dict:
  """Build params from HF-named tensors. `get(name)` raises KeyError for a missing tensor."""
  c = config
  e, f, hq, hkv, d = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
  # Host staging in the target precision where numpy has it (bfloat16 converts on device).
  host = np.float32 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)

  def t(name: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
      arr = get(name)
    except KeyError:
      raise WeightError(f"{source}: missing tensor {name!r}") from None
    return _expect(np.asarray(arr), shape, name, source)

  # Per-layer tensors: (params path, HF name after "model.layers.N.", HF shape, to our layout).
  proj = lambda heads: lambda w: w.T.reshape(e, heads, d)  # HF [heads*D, E] -> [E, heads, D]
  layer_tensors = [
      (("input_norm", "scale"), "input_layernorm.weight", (e,), None),
      (("post_attn_norm", "scale"), "post_attention_layernorm.weight", (e,), None),
      (("attn", "q_proj", "kernel"), "self_attn.q_proj.weight", (hq * d, e), proj(hq)),
      (("attn", "k_proj", "kernel"), "self_attn.k_proj.weight", (hkv * d, e), proj(hkv)),
      (("attn", "v_proj", "kernel"), "self_attn.v_proj.weight", (hkv * d, e), proj(hkv)),
      (("attn", "o_proj", "kernel"), "self_attn.o_proj.weight", (e, hq * d),
       lambda w: w.T.reshape(hq, d, e)),
      (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", (f, e), np.transpose),
      (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", (f, e), np.transpose),
      (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", (e, f), np.transpose),
  ]
  if c.attention_bias:
    for name, heads in (("q_proj", hq), ("k_proj", hkv), ("v_proj", hkv)):
      layer_tensors.append((("attn", name, "bias"), f"self_attn.{name}.bias", (heads * d,),
                            lambda w, heads=heads: w.reshape(heads, d)))
  if c.qk_norm:
    for name in ("q_norm", "k_norm"):
      layer_tensors.append((("attn", name, "scale"), f"self_attn.{name}.weight", (d,), None))

  layers: dict = {}
  for path, hf_name, shape, to_ours in layer_tensors:
    stacked = None
    for i in range(c.num_layers):
      w = t(f"model.layers.{i}.{hf_name}", shape)
      w = to_ours(w) if to_ours is not None else w
      if stacked is None:
        stacked = np.empty((c.num_layers,) + w.shape, host)
      stacked[i] = w
    node = layers
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = jnp.asarray(stacked, dtype=dtype)

  params: dict = {"embedding": jnp.asarray(t("model.embed_tokens.weight", (c.vocab_size, e)),
                                           dtype=dtype),
                  "layers": layers,
                  "norm": {"scale": jnp.asarray(t("model.norm.weight", (e,)), dtype=dtype)}}
  if not c.tie_word_embeddings:
    params["lm_head"] = {"kernel": jnp.asarray(t("lm_head.weight", (c.vocab_size, e)).T,
                                               dtype=dtype)}
  return params
