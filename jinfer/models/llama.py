"""Decoder-only Llama family in flax.linen: Llama 2/3/3.1, Mistral, Qwen2, Qwen3.

The differences are config switches: q/k/v biases (Qwen2), q/k RMSNorm (Qwen3), per-layer
sliding windows (Mistral), rope scaling (Llama 3.1), tied embeddings, GQA/MQA by head counts.
Every param is created with its logical axis names; `logical_axes(config)` reads them back so
sharding rules can map them to a mesh.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jinfer.config import ModelConfig
from jinfer.models.attention_metadata import AttentionMetadata
from jinfer.models.kernel_options import KernelOptions
from pallas_kernels import int8_matmul, ragged_paged_attention, write_kv

_init = nn.initializers.normal(0.02)


def _param(mod: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...], dtype,
           init=_init) -> jax.Array:
  return mod.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class Linear(nn.Module):
  """y = x @ kernel over the leading `n_in` kernel axes. The one place weights multiply.

  Quantized, the kernel is int8 with a float scale per output channel and the product goes
  through the int8 matmul kernel.
  """
  shape: tuple[int, ...]
  axes: tuple[str, ...]
  kernels: KernelOptions
  n_in: int = 1  # how many leading kernel axes contract with x's trailing axes
  use_bias: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    out_shape = self.shape[self.n_in:]
    if self.kernels.quantization:
      w = _param(self, "kernel", self.shape, self.axes, jnp.int8, nn.initializers.zeros)
      scale = _param(self, "scale", out_shape, self.axes[self.n_in:], jnp.float32,
                     nn.initializers.ones)
      k, n = int(np.prod(self.shape[:self.n_in])), int(np.prod(out_shape))
      lead = x.shape[:x.ndim - self.n_in]
      interpret = self.kernels.interpret and self.kernels.matmul != "reference"
      y = int8_matmul(x.reshape(-1, k), w.reshape(k, n), scale.reshape(n),
                      mode=self.kernels.matmul_mode, backend=self.kernels.matmul,
                      interpret=interpret).reshape(lead + out_shape)
    else:
      w = _param(self, "kernel", self.shape, self.axes, self.dtype)
      y = jnp.tensordot(x, w.astype(x.dtype), axes=self.n_in)
    if self.use_bias:
      y = y + _param(self, "bias", out_shape, self.axes[self.n_in:], self.dtype,
                     nn.initializers.zeros).astype(y.dtype)
    return y


class RMSNorm(nn.Module):
  dim: int
  eps: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = _param(self, "scale", (self.dim,), ("norm",), self.dtype, nn.initializers.ones)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return scale.astype(x.dtype) * xf.astype(x.dtype)  # HF casts before scaling


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """HF's rotate-half rotary embedding. x: [T, H, D]; cos, sin: [T, D]."""
  half = x.shape[-1] // 2
  rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos[:, None, :] + rot * sin[:, None, :]).astype(x.dtype)


class Attention(nn.Module):
  config: ModelConfig
  layer_idx: int
  kernels: KernelOptions
  dtype: Any

  @nn.compact
  def __call__(self, x, cos, sin, kv_cache, md: AttentionMetadata):
    c, kn = self.config, self.kernels
    e, hq, hkv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    q = Linear((e, hq, d), ("embed", "q_heads", "head_dim"), kn, use_bias=c.attention_bias,
               dtype=self.dtype, name="q_proj")(x)  # [T, Hq, D]
    k = Linear((e, hkv, d), ("embed", "kv_heads", "head_dim"), kn, use_bias=c.attention_bias,
               dtype=self.dtype, name="k_proj")(x)  # [T, Hkv, D]
    v = Linear((e, hkv, d), ("embed", "kv_heads", "head_dim"), kn, use_bias=c.attention_bias,
               dtype=self.dtype, name="v_proj")(x)  # [T, Hkv, D]
    if c.qk_norm:
      q = RMSNorm(d, c.rms_norm_eps, self.dtype, name="q_norm")(q)
      k = RMSNorm(d, c.rms_norm_eps, self.dtype, name="k_norm")(k)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    kv_cache = write_kv(kv_cache, k, v, md.slot_mapping)
    o = ragged_paged_attention(
        q, kv_cache, md.kv_lens, md.block_table, md.cu_q_lens, md.num_seqs,
        sm_scale=d ** -0.5, sliding_window=c.sliding_windows[self.layer_idx],
        max_q_len=md.max_q_len, max_prefill_seqs=md.max_prefill_seqs, backend=kn.attention,
        **({"interpret": True} if kn.interpret and kn.attention != "reference" else {}))
    out = Linear((hq, d, e), ("q_heads", "head_dim", "embed"), kn, n_in=2, dtype=self.dtype,
                 name="o_proj")(o)  # [T, E]
    return out, kv_cache


class MLP(nn.Module):
  config: ModelConfig
  kernels: KernelOptions
  dtype: Any

  @nn.compact
  def __call__(self, x):
    e, f, kn = self.config.hidden_size, self.config.intermediate_size, self.kernels
    gate = Linear((e, f), ("embed", "mlp"), kn, dtype=self.dtype, name="gate_proj")(x)
    up = Linear((e, f), ("embed", "mlp"), kn, dtype=self.dtype, name="up_proj")(x)
    return Linear((f, e), ("mlp", "embed"), kn, dtype=self.dtype,
                  name="down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
  config: ModelConfig
  layer_idx: int
  kernels: KernelOptions
  dtype: Any

  @nn.compact
  def __call__(self, x, cos, sin, kv_cache, md):
    c = self.config
    h, kv_cache = Attention(c, self.layer_idx, self.kernels, self.dtype, name="attn")(
        RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, name="input_norm")(x), cos, sin,
        kv_cache, md)
    x = x + h
    x = x + MLP(c, self.kernels, self.dtype, name="mlp")(
        RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, name="post_attn_norm")(x))
    return x, kv_cache


class CausalLM(nn.Module):
  config: ModelConfig
  kernels: KernelOptions = KernelOptions()
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(
      self,
      token_ids: jax.Array,  # [T] int32
      positions: jax.Array,  # [T] int32
      kv_caches: list[jax.Array],  # per layer [num_pages, 2, Hkv, page_size, D]
      md: AttentionMetadata,
      logits_indices: jax.Array | None = None,  # [S] rows to project to logits
  ) -> tuple[jax.Array, list[jax.Array]]:  # logits [S or T, V] float32, new caches
    c = self.config
    embed = _param(self, "embedding", (c.vocab_size, c.hidden_size), ("vocab", "embed"),
                   self.dtype)
    x = embed[token_ids]  # [T, E]
    inv_freq = jnp.asarray(c.inv_freq(), jnp.float32)  # [D/2]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, D]
    cos, sin = jnp.cos(emb).astype(self.dtype), jnp.sin(emb).astype(self.dtype)
    new_caches = []
    for i in range(c.num_layers):
      x, cache = DecoderLayer(c, i, self.kernels, self.dtype, name=f"layers_{i}")(
          x, cos, sin, kv_caches[i], md)
      new_caches.append(cache)
    x = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, name="norm")(x)
    if logits_indices is not None:
      x = x[logits_indices]  # [S, E]
    if c.tie_word_embeddings:
      logits = x @ embed.T.astype(x.dtype)
    else:
      logits = Linear((c.hidden_size, c.vocab_size), ("embed", "vocab"), self.kernels,
                      dtype=self.dtype, name="lm_head")(x)
    return logits.astype(jnp.float32), new_caches


def _abstract_params(config: ModelConfig, dtype, kernels: KernelOptions = KernelOptions()) -> dict:
  """Params as boxed ShapeDtypeStructs, traced from init without allocating anything."""
  t = jnp.zeros((1,), jnp.int32)
  md = AttentionMetadata(slot_mapping=t, block_table=jnp.zeros((1, 1), jnp.int32), kv_lens=t + 1,
                         cu_q_lens=jnp.array([0, 1], jnp.int32), num_seqs=t + 1)
  cache = [jnp.zeros((1, 2, config.num_kv_heads, 1, config.head_dim))] * config.num_layers
  return jax.eval_shape(CausalLM(config, kernels, dtype=dtype).init, jax.random.key(0), t, t, cache,
                        md)["params"]


def logical_axes(config: ModelConfig) -> dict:
  """The params tree with each leaf replaced by its logical axis names."""
  return jax.tree.map(lambda b: b.names, _abstract_params(config, jnp.float32),
                      is_leaf=lambda b: isinstance(b, nn.Partitioned))


def param_shapes(config: ModelConfig, dtype=jnp.float32) -> dict:
  """The params tree with each leaf a ShapeDtypeStruct: what a loader must produce."""
  return nn.unbox(_abstract_params(config, dtype))
