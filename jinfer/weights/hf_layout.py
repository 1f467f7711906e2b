"""HF tensor names and layouts -> the jinfer params tree. Every format loads through here.

A loader only has to answer "give me the HF-named tensor as numpy" (GGUF loaders rename and
un-permute first); this module knows which tensors a config needs, checks their shapes and
rearranges them into the model's `[in..., out...]` kernels.
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

  def t(name: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
      arr = get(name)
    except KeyError:
      raise WeightError(f"{source}: missing tensor {name!r}") from None
    return _expect(np.asarray(arr), shape, name, source)

  def out(x: np.ndarray):
    return jnp.asarray(x, dtype=dtype)

  def proj(prefix: str, heads: int) -> dict:  # HF [heads*D, E] -> [E, heads, D]
    p = {"kernel": out(t(f"{prefix}.weight", (heads * d, e)).T.reshape(e, heads, d))}
    if c.attention_bias:
      p["bias"] = out(t(f"{prefix}.bias", (heads * d,)).reshape(heads, d))
    return p

  params: dict = {"embedding": out(t("model.embed_tokens.weight", (c.vocab_size, e)))}
  for i in range(c.num_layers):
    pre = f"model.layers.{i}"
    attn = {
        "q_proj": proj(f"{pre}.self_attn.q_proj", hq),
        "k_proj": proj(f"{pre}.self_attn.k_proj", hkv),
        "v_proj": proj(f"{pre}.self_attn.v_proj", hkv),
        "o_proj": {"kernel": out(t(f"{pre}.self_attn.o_proj.weight", (e, hq * d)).T
                                 .reshape(hq, d, e))},
    }
    if c.qk_norm:
      attn["q_norm"] = {"scale": out(t(f"{pre}.self_attn.q_norm.weight", (d,)))}
      attn["k_norm"] = {"scale": out(t(f"{pre}.self_attn.k_norm.weight", (d,)))}
    params[f"layers_{i}"] = {
        "input_norm": {"scale": out(t(f"{pre}.input_layernorm.weight", (e,)))},
        "post_attn_norm": {"scale": out(t(f"{pre}.post_attention_layernorm.weight", (e,)))},
        "attn": attn,
        "mlp": {
            "gate_proj": {"kernel": out(t(f"{pre}.mlp.gate_proj.weight", (f, e)).T)},
            "up_proj": {"kernel": out(t(f"{pre}.mlp.up_proj.weight", (f, e)).T)},
            "down_proj": {"kernel": out(t(f"{pre}.mlp.down_proj.weight", (e, f)).T)},
        },
    }
  params["norm"] = {"scale": out(t("model.norm.weight", (e,)))}
  if not c.tie_word_embeddings:
    params["lm_head"] = {"kernel": out(t("lm_head.weight", (c.vocab_size, e)).T)}
  return params
