"""How params and the KV cache lay out over a `(context, tensor)` mesh.

Params carry logical axis names (`jinfer.models.logical_axes`); `RULES` maps them to mesh axes:

| logical axis | mesh axis | what splits |
| --- | --- | --- |
| `q_heads`, `kv_heads` | tensor | attention heads (q/k/v/o projections, their biases) |
| `mlp` | tensor | MLP columns (gate/up) and rows (down) |
| `vocab` | tensor | embedding rows and LM head columns |
| `expert` | tensor with expert parallelism, else none | MoE experts |
| `layers`, `embed`, `head_dim`, `norm` | none | replicated |

A mesh axis is used once per array: the first logical axis that maps to it wins (so with expert
parallelism an expert's MLP columns stay whole). The KV cache shards its pages over `context`
and its KV heads over `tensor` (a quantized cache's scales likewise). Where `num_kv_heads < TP`
each KV head is duplicated `TP / num_kv_heads` times (as vLLM does) so every tensor shard holds
the one its query heads use.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jinfer.config import ModelConfig
from jinfer.quant.qarray import QArray
from pallas_kernels import QuantizedKVCache

RULES = {"q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
KV_CACHE_SPEC = P(None, "context", None, "tensor", None, None)
# A quantized cache's scales: its values' layout less head_dim (pallas_kernels/kv_cache_layout.py).
KV_SCALES_SPEC = P(None, "context", None, "tensor", None)


def valid_tensor_parallel_sizes(config: ModelConfig, limit: int = 64) -> list[int]:
  """TP sizes this model's shapes allow: dividing query heads, MLP width and vocabulary, with
  KV heads a multiple or a divisor of TP."""
  c = config
  return [tp for tp in range(1, limit + 1)
          if c.num_heads % tp == 0 and c.intermediate_size % tp == 0 and c.vocab_size % tp == 0
          and c.moe_intermediate_size % tp == 0
          and (c.num_kv_heads % tp == 0 or tp % c.num_kv_heads == 0)]


def check_tensor_parallel(config: ModelConfig, tp: int, expert_parallel: bool = False):
  if expert_parallel and config.num_experts % tp:
    raise ValueError(f"enable_expert_parallel over tensor_parallel_size={tp} needs the number "
                     f"of experts ({config.num_experts}) to be a multiple of {tp}")
  if tp not in valid_tensor_parallel_sizes(config, max(tp, 64)):
    raise ValueError(
        f"tensor_parallel_size={tp} does not fit this model ({config.num_heads} query heads, "
        f"{config.num_kv_heads} KV heads, MLP width {config.intermediate_size}, vocabulary "
        f"{config.vocab_size}); valid sizes: "
        f"{', '.join(map(str, valid_tensor_parallel_sizes(config)))}")


def duplicate_kv_heads(config: ModelConfig, params: dict, tp: int) -> tuple[ModelConfig, dict]:
  """With fewer KV heads than TP shards, repeat each KV head (its k/v projection columns and
  biases) TP / num_kv_heads times. Query head h still meets a copy of its own KV head: copies
  sit next to each other, so shard i holds a copy of KV head i * Hkv // TP."""
  hkv = config.num_kv_heads
  if hkv >= tp:
    return config, params
  r = tp // hkv
  attn = dict(params["layers"]["attn"])
  for name in ("k_proj", "v_proj"):
    # kernel [L, E, Hkv, D] and bias [L, Hkv, D]: the KV head axis is third from the end or the
    # middle one; repeating it along -2 covers both.
    attn[name] = {key: jnp.repeat(w, r, axis=-2) for key, w in attn[name].items()}
  params = dict(params, layers=dict(params["layers"], attn=attn))
  return dataclasses.replace(config, num_kv_heads=tp), params


def partition_spec(names: tuple[str, ...], expert_parallel: bool = False) -> P:
  rules = dict(RULES, expert="tensor") if expert_parallel else RULES
  used, spec = set(), []
  for name in names:
    axis = rules.get(name)
    spec.append(axis if axis not in used else None)
    used.add(axis)
  return P(*spec)


def param_shardings(axes: dict, mesh: Mesh, expert_parallel: bool = False) -> dict:
  """`axes`: the params tree of logical names (`logical_axes(config)`)."""
  return jax.tree.map(lambda names: NamedSharding(mesh, partition_spec(names, expert_parallel)),
                      axes, is_leaf=lambda x: isinstance(x, tuple))


def shard_params(params: dict, axes: dict, mesh: Mesh, expert_parallel: bool = False) -> dict:
  shardings = param_shardings(axes, mesh, expert_parallel)
  # Quantized kernels (QArray leaves) take their kernel's sharding for the values and the same
  # spec without the contracting axes for the scales (which come last in a transposed kernel,
  # the quantized tied embedding).
  def put(w, sharding):
    if isinstance(w, QArray):
      spec = tuple(sharding.spec) + (None,) * (w.values.ndim - len(sharding.spec))
      lead = w.values.ndim - w.n_in - w.n_out
      if w.transposed:
        scale_spec = P(*spec[:lead + w.n_out])
      else:
        scale_spec = P(*(spec[:lead] + spec[lead + w.n_in:]))
      return dataclasses.replace(
          w, values=jax.device_put(w.values, sharding),
          scale=jax.device_put(w.scale, NamedSharding(mesh, scale_spec)))
    return jax.device_put(w, sharding)
  return jax.tree.map(put, params, shardings, is_leaf=lambda x: isinstance(x, QArray))


def kv_cache_specs(quantized: bool = False) -> P | QuantizedKVCache:
  """The partition spec of the KV cache: one, or the values' and the scales' of a quantized one."""
  return QuantizedKVCache(KV_CACHE_SPEC, KV_SCALES_SPEC) if quantized else KV_CACHE_SPEC


def kv_cache_sharding(mesh: Mesh, quantized: bool = False) -> NamedSharding | QuantizedKVCache:
  if quantized:
    return QuantizedKVCache(NamedSharding(mesh, KV_CACHE_SPEC),
                            NamedSharding(mesh, KV_SCALES_SPEC))
  return NamedSharding(mesh, KV_CACHE_SPEC)


def bytes_per_device(tree) -> dict:
  """Bytes each device holds of the arrays in `tree` (addressable shards only)."""
  out: dict = {}
  for x in jax.tree.leaves(tree):
    for shard in x.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out
