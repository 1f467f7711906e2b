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

Group-wise quantized kernels (`GroupwiseArray`: int4, AWQ/GPTQ checkpoints, GGUF blocks) are
flattened to one contracting axis K and one output axis N, the kernel's first logical axis of
each outermost. Splitting K or N into TP contiguous chunks therefore splits the logical axis a
float kernel splits when that axis is the first of its group (q_proj's `q_heads` in N, o_proj's
`q_heads` and down's `mlp` in K) and N or K divides evenly; K also needs whole groups per shard
(each group's scale, offset and 4-bit packing stay together). Otherwise that flattened axis stays
whole (replicated; logged): a fused MoE `gate_up` N `[2, mlp]` under plain tensor parallelism,
whose chunks would hold gate and up rather than both halves of a slice of `mlp`, and a K whose
number of groups TP does not divide. An act-order `perm` follows K; its rows may point into other shards,
where XLA gathers the step's activations (never the weights) before the matmul.
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jinfer.config import ModelConfig
from jinfer.quant.groupwise import GroupwiseArray
from jinfer.quant.qarray import QArray
from pallas_kernels import QuantizedKVCache

log = logging.getLogger(__name__)

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
  biases, quantized or not) TP / num_kv_heads times. Query head h still meets a copy of its own
  KV head: copies sit next to each other, so shard i holds a copy of KV head i * Hkv // TP."""
  hkv = config.num_kv_heads
  if hkv >= tp:
    return config, params
  r = tp // hkv

  def repeat(w):
    if isinstance(w, GroupwiseArray):  # N = [Hkv, D] flattened: repeat whole heads' columns
      def cols(a):  # [lead..., rows, Hkv * D]
        a = a.reshape(*a.shape[:-1], hkv, a.shape[-1] // hkv)
        a = jnp.repeat(a, r, axis=-2)
        return a.reshape(*a.shape[:-2], -1)
      return dataclasses.replace(w, q=cols(w.q), scale=cols(w.scale),
                                 offset=None if w.offset is None else cols(w.offset))
    if isinstance(w, QArray):  # values [lead, E, Hkv, D] or, transposed, [lead, Hkv, D, E]
      return dataclasses.replace(
          w, values=jnp.repeat(w.values, r, axis=-3 if w.transposed else -2),
          scale=jnp.repeat(w.scale, r, axis=-2))  # [lead, Hkv, D]
    # kernel [L, E, Hkv, D] and bias [L, Hkv, D]: the KV head axis is third from the end or the
    # middle one; repeating it along -2 covers both.
    return jnp.repeat(w, r, axis=-2)

  attn = dict(params["layers"]["attn"])
  for name in ("k_proj", "v_proj"):
    attn[name] = {key: repeat(w) for key, w in attn[name].items()}
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


def shard_params(params: dict, axes: dict, mesh: Mesh, expert_parallel: bool = False,
                 linear: dict | None = None, place=jax.device_put) -> dict:
  """`linear`: the model's `linear_kernels(config)`, needed where params hold `GroupwiseArray`s
  (which axes of theirs contract). `place(array, sharding)` puts each array (the default), or
  describes it (`abstract`: params of shapes only, for compiling without weights)."""
  shardings = param_shardings(axes, mesh, expert_parallel)
  decls = {} if linear is None else dict(jax.tree_util.tree_flatten_with_path(
      linear, is_leaf=lambda x: isinstance(x, tuple))[0])
  axes_of = dict(jax.tree_util.tree_flatten_with_path(
      axes, is_leaf=lambda x: isinstance(x, tuple))[0]).get
  whole: list[str] = []

  # Quantized kernels (QArray leaves) take their kernel's sharding for the values and the same
  # spec without the contracting axes for the scales (which come last in a transposed kernel,
  # the quantized tied embedding). Group-wise ones split their flattened K and N as the module
  # docstring says.
  def put(path, w, sharding):
    if isinstance(w, QArray):
      spec = tuple(sharding.spec) + (None,) * (w.values.ndim - len(sharding.spec))
      lead = w.values.ndim - w.n_in - w.n_out
      if w.transposed:
        scale_spec = P(*spec[:lead + w.n_out])
      else:
        scale_spec = P(*(spec[:lead] + spec[lead + w.n_in:]))
      return dataclasses.replace(
          w, values=place(w.values, sharding),
          scale=place(w.scale, NamedSharding(mesh, scale_spec)))
    if isinstance(w, GroupwiseArray):
      decl = decls.get(path)
      if decl is None and axes_of(path) == ("vocab", "embed"):
        decl = (1, 1, True)  # an untied embedding kept group-wise: the head's view [K=E, N=V]
      if decl is None:
        raise ValueError(f"{_name(path)}: a group-wise kernel needs its declaration (pass "
                         f"linear=linear_kernels(config))")
      lead_spec, k_spec, n_spec, why = _groupwise_spec(
          w, tuple(sharding.spec), decl, mesh.shape["tensor"])
      if why:
        whole.append(f"{_name(path)} ({why})")
      put_as = lambda a, *spec: place(a, NamedSharding(mesh, P(*lead_spec, *spec)))
      return dataclasses.replace(
          w, q=put_as(w.q, k_spec, n_spec), scale=put_as(w.scale, k_spec, n_spec),
          offset=None if w.offset is None else put_as(w.offset, k_spec, n_spec),
          perm=None if w.perm is None else put_as(w.perm, k_spec),
          table=None if w.table is None else put_as(w.table, None))
    return place(w, sharding)

  out = jax.tree_util.tree_map_with_path(
      put, params, shardings, is_leaf=lambda x: isinstance(x, (QArray, GroupwiseArray)))
  if whole:
    log.info("group-wise kernels kept whole along an axis the float kernel splits: %s",
             "; ".join(whole))
  return out


def abstract(a, sharding) -> jax.ShapeDtypeStruct:
  """`shard_params`' `place` for params of shapes only: `a`'s shape and dtype with `sharding`."""
  return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)


def _name(path) -> str:
  return "/".join(str(k.key) for k in path)


def group_split(w: GroupwiseArray, axes: tuple[str, ...], n_in: int, tp: int):
  """(K's mesh axis, N's) of one layer's group-wise kernel `[K, N]` with logical `axes`, as
  `shard_params` split it."""
  _, k_spec, n_spec, _ = _groupwise_spec(w, tuple(partition_spec(axes)),
                                         (n_in, len(axes) - n_in, False), tp)
  return k_spec, n_spec


def _groupwise_spec(w: GroupwiseArray, spec: tuple, decl: tuple, tp: int):
  """(lead spec, K's, N's, why an axis the float kernel splits stays whole or "") of a flattened
  kernel, from its float kernel's partition spec `spec` and declaration `decl` (`n_in, n_out,
  transposed, ...`). The flattened K or N splits as its group's first logical axis does."""
  n_in, n_out, transposed = decl[:3]
  lead = w.q.ndim - 2
  spec = spec + (None,) * (lead + n_in + n_out - len(spec))
  lead_spec, rest = spec[:lead], spec[lead:]
  outs, ins = (rest[:n_out], rest[n_out:]) if transposed else (rest[n_in:], rest[:n_in])
  k, n = w.shape[-2:]
  reasons = []

  def flat(group, what, size, unit):
    if not any(group):
      return None
    if group[0] is None:
      reasons.append(f"{what}: the split axis is not its first")
    elif (size // unit) % tp:
      reasons.append(f"{what}: {size // unit} {'groups' if unit > 1 else 'columns'} over "
                     f"{tp} shards")
    else:
      return group[0]
    return None

  k_spec = flat(ins, "K", k, w.group_size)
  n_spec = flat(outs, "N", n, 1)
  return lead_spec, k_spec, n_spec, ", ".join(reasons)


def lora_slot_specs(axes: dict, linear: dict, targets: dict) -> dict:
  """The adapter slots' layout (jinfer/models/lora.py): `a [L, M, K, r]` splits K and
  `b [L, M, r, N]` N over `tensor` where the base kernel splits its first input or output
  axis, so each shard's share of the low-rank product meets its share of the activations."""
  out: dict = {}
  for path in targets:
    names, kind = axes, linear
    for part in path + ("kernel",):
      names, kind = names[part], kind[part]
    n_in = kind[0]
    split = lambda name: RULES.get(name)
    node = out
    for part in path:
      node = node.setdefault(part, {})
    node["a"] = P(None, None, split(names[1]), None)
    node["b"] = P(None, None, None, split(names[1 + n_in]))
  return out


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
