"""Decoder-only Llama family in flax.linen: Llama 2/3/3.1, Mistral, Qwen2, Qwen3, Gemma-3's
text stack, and the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE.

The differences are config switches: q/k/v biases (Qwen2), q/k RMSNorm (Qwen3, Gemma-3),
per-layer sliding windows (Mistral, Qwen2, Gemma-3), rope scaling (Llama 3.1), tied embeddings,
GQA/MQA by head counts, MoE feed-forward layers (`jinfer/models/moe.py`), and Gemma's own: a
(1 + weight) RMSNorm, norms after attention and after the MLP, a scaled embedding, GeGLU,
`query_pre_attn_scalar`, soft caps, and a second rope for the local layers. Per-layer
differences (a layer's window, its rope, whether its feed-forward is dense or MoE) are scanned
values, never Python branches.

The layer stack has one params layout: every per-layer param stacked on a leading `layers` axis
(`params["layers"]`). It runs two ways over it:
  * scanned (`scan_layers=True`): `nn.scan` over the stacked params, the KV cache in the carry.
    One layer body to compile, so a step compiles in seconds.
  * unrolled (`scan_layers=False`): a Python loop over `unstack_layers(params)`. On XLA:CPU a
    scanned layer copies its weights out of the stack before each matmul (a dynamic slice feeds
    no dot in place), which doubles a decode step's memory traffic; unrolled, each matmul reads
    its weights where they are, at the price of compiling every layer. On the CPU the unrolled
    layers' arrays are views of the stacked ones, so an engine runs both from one copy of the
    weights (small decode steps unrolled, prefill and large batches scanned).
Either way one KV cache array holds every layer and is updated in place.

Feed-forward kinds. When every layer's feed-forward is the same kind, it is part of the layer:
`layers/mlp` (dense) or `layers/moe`. When dense and MoE layers mix (Qwen-MoE's
`decoder_sparse_step`, `mlp_only_layers`), `layers` holds what every layer has (attention and
norms) and each kind is stacked over its own layers beside it: `mlp_layers` `[dense layers,
...]` and `moe_layers` `[MoE layers, ...]`. A layer picks its own with a `lax.cond` on its
scanned kind and its scanned index into that kind's stack. Params stay honest (no dense layer
carries experts, no MoE layer a dense MLP) and each kind compiles once, where splitting the
stack into runs of one kind would compile every run (every layer, for alternating kinds).

MoE layers report their expert load, tokens routed to each expert `[MoE layers, experts]`
(live rows only), in the `expert_load` collection (`apply(..., mutable=["expert_load"])`).

Every param is created with its logical axis names (`logical_axes(config)`), and linear
kernels with what contracts (`linear_kernels(config)`), so sharding rules and the quantizer work
from declarations, never from parameter names.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from jinfer.config import ModelConfig
from jinfer.models.kernel_options import KernelOptions
from jinfer.models.kv_groups import KVGroups
from jinfer.models.lora import LoraRows, lora_delta
from jinfer.models.moe import MoE
from jinfer.models.params import LinearKernel, default_init as _init, kernel as _kernel, param as _param
from jinfer.quant.groupwise import GroupwiseArray
from jinfer.quant.qarray import QArray
from jinfer.parallel.attention import paged_attention
from jinfer.parallel.linear import int8_specs, tensor_parallel_matmul
from jinfer.parallel.sharding import group_split
from pallas_kernels import AttentionMetadata, dense_matmul, groupwise_matmul, int8_matmul
from pallas_kernels.fp8_matmul import FP8, fp8_matmul

NO_WINDOW = 1 << 30  # a per-layer window that never excludes a key
# A quantized tied LM head keeps float activations even under W8A8: rounding the final hidden
# state per token cost W8A8 another point of perplexity on the pydoc text (+5.4% vs +4.4%).
HEAD_MODE = "w8a16"
# Quantizations whose float-shaped kernels become `QArray`s: int4, fp8 and the 4-bit micro-floats
# keep the LM head int8.
INT8_KERNELS = ("int8", "w8a8", "int4", "fp8", "mxfp4", "nvfp4")


class Linear(nn.Module):
  """y = x @ kernel over the leading `n_in` kernel axes. The one place weights multiply.

  Quantized, the kernel is a `QArray` (int8 or float8 values, a float scale per output channel)
  and the product goes through the int8 or the float8 matmul, or a `GroupwiseArray` (int4 or
  int8 values with a scale and offset per group of inputs, or 4-bit codes into a table with a
  scale per group, flattened to [K, N]) through the group-wise one.
  """
  shape: tuple[int, ...]
  axes: tuple[str, ...]
  kernels: KernelOptions
  n_in: int = 1  # how many leading kernel axes contract with x's trailing axes
  use_bias: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, lora: LoraRows | None = None) -> jax.Array:
    """`lora`: the rows' adapter slots, when the `lora` collection has this layer's slots
    (jinfer/models/lora.py); the adapters stay float over a quantized kernel."""
    out_shape = self.shape[self.n_in:]
    n_out = len(out_shape)
    stored = (self.get_variable("params", "kernel") if self.has_variable("params", "kernel")
              else None)
    # A kernel a checkpoint left float (an lm_head outside its quantized layers) stays float;
    # mixed precision stores int8 kernels beside float ones: a stored `QArray` says which.
    if isinstance(stored, QArray) or (self.kernels.quantization in INT8_KERNELS
                                      and not isinstance(stored, jax.Array)):
      flip = stored.transposed if isinstance(stored, QArray) else self.kernels.int8_transposed
      init = lambda _, shape, dtype: QArray(
          values=jnp.zeros(out_shape + shape[:self.n_in] if flip else shape, jnp.int8),
          scale=jnp.ones(out_shape, jnp.float32), n_in=self.n_in, n_out=n_out, transposed=flip)
    else:
      init = _init
    w = _kernel(self, "kernel", lambda *a: LinearKernel(init(*a), self.axes, n_in=self.n_in,
                                                        n_out=n_out, reads_transposed=True),
                self.shape, self.dtype)
    k, n = int(np.prod(self.shape[:self.n_in])), int(np.prod(out_shape))
    lead = x.shape[:x.ndim - self.n_in]
    mesh = self.kernels.mesh
    if isinstance(w, GroupwiseArray):
      if mesh is not None and w.perm is None:
        y = _sharded_groupwise(x, w, self.axes, self.n_in, out_shape, self.kernels)
      else:
        y = _groupwise(x.reshape(-1, k), w, self.kernels).reshape(lead + out_shape)
    elif isinstance(w, QArray):
      mm = functools.partial(_per_channel, mode=self.kernels.matmul_mode, kernels=self.kernels,
                             transposed=w.transposed)
      if mesh is not None:  # the kernel per shard (jinfer/parallel/linear.py)
        ins, outs, w_spec, s_spec = int8_specs(self.axes, self.n_in, w.transposed)
        y = tensor_parallel_matmul(mm, x, w.values, (w.scale,), in_spec=ins, out_spec=outs,
                                   weight_spec=w_spec, scale_specs=(s_spec,),
                                   out_shape=out_shape, mesh=mesh)
      else:
        y = mm(x.reshape(-1, k), w.values, w.scale).reshape(lead + out_shape)
    else:
      y = dense_matmul(x, w, n_in=self.n_in, backend=self.kernels.dense)
    if lora is not None and self.has_variable("lora", "a"):
      kn = self.kernels
      y = y + lora_delta(x.reshape(-1, k), self.get_variable("lora", "a"),
                         self.get_variable("lora", "b"), lora, backend=kn.grouped_matmul,
                         interpret=kn.interpret, masked=mesh is not None
                         ).reshape(lead + out_shape).astype(y.dtype)
    if self.use_bias:
      y = y + _param(self, "bias", out_shape, self.axes[self.n_in:], self.dtype,
                     nn.initializers.zeros).astype(y.dtype)
    return y


class RMSNorm(nn.Module):
  dim: int
  eps: float
  dtype: Any = jnp.float32
  gemma: bool = False  # scale by (1 + weight), in float32 before the cast (Gemma's RMSNorm)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = _param(self, "scale", (self.dim,), ("norm",), self.dtype,
                   nn.initializers.zeros if self.gemma else nn.initializers.ones)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    if self.gemma:
      return (xf * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
    return scale.astype(x.dtype) * xf.astype(x.dtype)  # HF casts before scaling


def _norm(config: ModelConfig, dtype, name: str, dim: int | None = None) -> RMSNorm:
  return RMSNorm(dim or config.hidden_size, config.rms_norm_eps, dtype, gemma=config.gemma_norm,
                 name=name)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
  return x if cap is None else cap * jnp.tanh(x / cap)


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """HF's rotate-half rotary embedding. x: [T, H, D]; cos, sin: [T, D]."""
  half = x.shape[-1] // 2
  rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos[:, None, :] + rot * sin[:, None, :]).astype(x.dtype)


@struct.dataclass
class LayerInputs:
  """What differs from one layer to the next besides its params (scanned over)."""
  index: jax.Array  # [] int32: the layer's slot in the KV cache
  window: jax.Array | None  # [] int32 sliding window (NO_WINDOW: none); None: no layer has one
  # [] int32: the layer's KV group (see kv_groups.py), whose pages the metadata's block_table
  # [G, S, P] and slot_mapping [G, T] list per group; None: one table for every layer.
  group: jax.Array | None = None
  # [] int32: which rope table the layer rotates with (1: the local one); None: one table.
  rope: jax.Array | None = None
  # When dense and MoE layers mix (else None): [] bool, an MoE layer; [] int32, the layer's slot
  # in its kind's stack (`moe_layers` or `mlp_layers`).
  moe: jax.Array | None = None
  ffn_index: jax.Array | None = None


class Attention(nn.Module):
  config: ModelConfig
  kernels: KernelOptions
  dtype: Any

  @nn.compact
  def __call__(self, x, cos, sin, kv_cache, md: AttentionMetadata, layer: LayerInputs,
               lora: LoraRows | None = None):
    c, kn = self.config, self.kernels
    e, hq, hkv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    q = Linear((e, hq, d), ("embed", "q_heads", "head_dim"), kn, use_bias=c.attention_bias,
               dtype=self.dtype, name="q_proj")(x, lora)  # [T, Hq, D]
    k = Linear((e, hkv, d), ("embed", "kv_heads", "head_dim"), kn, use_bias=c.attention_bias,
               dtype=self.dtype, name="k_proj")(x, lora)  # [T, Hkv, D]
    v = Linear((e, hkv, d), ("embed", "kv_heads", "head_dim"), kn, use_bias=c.attention_bias,
               dtype=self.dtype, name="v_proj")(x, lora)  # [T, Hkv, D]
    if c.qk_norm:
      q = _norm(c, self.dtype, "q_norm", d)(q)
      k = _norm(c, self.dtype, "k_norm", d)(k)
    if layer.rope is not None:  # [R, T, D] tables: this layer's
      cos, sin = cos[layer.rope], sin[layer.rope]
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    if layer.group is not None:
      md = md.replace(slot_mapping=md.slot_mapping[layer.group],
                      block_table=md.block_table[layer.group])
    o, kv_cache = paged_attention(q, k, v, kv_cache, md, layer=layer.index,
                                  sliding_window=layer.window, sm_scale=c.sm_scale,
                                  soft_cap=c.attn_logit_softcapping,
                                  backend=kn.attention, interpret=kn.interpret, mesh=kn.mesh,
                                  context_layout=kn.context_layout)
    out = Linear((hq, d, e), ("q_heads", "head_dim", "embed"), kn, n_in=2, dtype=self.dtype,
                 name="o_proj")(o, lora)  # [T, E]
    return out, kv_cache


class MLP(nn.Module):
  config: ModelConfig
  kernels: KernelOptions
  dtype: Any
  features: int | None = None  # the hidden width; default `intermediate_size`

  @nn.compact
  def __call__(self, x, lora: LoraRows | None = None):
    e, f, kn = self.config.hidden_size, self.features or self.config.intermediate_size, self.kernels
    gate = Linear((e, f), ("embed", "mlp"), kn, dtype=self.dtype, name="gate_proj")(x, lora)
    up = Linear((e, f), ("embed", "mlp"), kn, dtype=self.dtype, name="up_proj")(x, lora)
    act = nn.silu if self.config.hidden_act == "silu" else functools.partial(
        nn.gelu, approximate=True)  # gelu_pytorch_tanh
    return Linear((f, e), ("mlp", "embed"), kn, dtype=self.dtype,
                  name="down_proj")(act(gate) * up, lora)


def _moe(config: ModelConfig, kernels: KernelOptions, dtype, **kw) -> MoE:
  # parent=None: made here, the shared expert becomes the MoE block's child, not the caller's.
  shared = (MLP(config, kernels, dtype, features=config.shared_expert_intermediate_size,
                parent=None) if config.shared_expert_intermediate_size else None)
  return MoE(config, kernels, dtype, shared_expert=shared, **kw)


class DecoderLayer(nn.Module):
  config: ModelConfig
  kernels: KernelOptions
  dtype: Any

  @nn.compact
  def __call__(self, carry, layer: LayerInputs, cos, sin, md, live, ffn_stacks,
               lora: LoraRows | None = None):
    """-> ((x, kv_cache), this layer's expert load [experts] int32, or None in a dense model)."""
    x, kv_cache = carry  # [T, E], the whole cache
    c, kn = self.config, self.kernels
    h, kv_cache = Attention(c, kn, self.dtype, name="attn")(
        _norm(c, self.dtype, "input_norm")(x), cos, sin, kv_cache, md, layer, lora)
    if c.sandwich_norms:
      h = _norm(c, self.dtype, "attn_out_norm")(h)
    x = x + h
    # The norm before the feed-forward (HF's post_attention_layernorm, Gemma's
    # pre_feedforward_layernorm).
    y = _norm(c, self.dtype, "post_attn_norm")(x)
    load = None
    if ffn_stacks is not None:  # dense and MoE layers mix: this layer's own from its kind's stack
      own = lambda stack: jax.tree.map(lambda a: a[layer.ffn_index], stack)
      dense = {"params": own(ffn_stacks["mlp_layers"])}
      if "lora_mlp_layers" in ffn_stacks:  # the dense layers' adapter slots
        dense["lora"] = own(ffn_stacks["lora_mlp_layers"])
      y, load = jax.lax.cond(
          layer.moe,
          lambda: _moe(c, kn, self.dtype).apply({"params": own(ffn_stacks["moe_layers"])}, y, live),
          lambda: (MLP(c, kn, self.dtype).apply(dense, y, lora),
                   jnp.zeros((c.num_experts,), jnp.int32)))
    elif any(c.moe_layers):
      y, load = _moe(c, kn, self.dtype, name="moe")(y, live)
    else:
      y = MLP(c, kn, self.dtype, name="mlp")(y, lora)
    if c.sandwich_norms:
      y = _norm(c, self.dtype, "ffn_out_norm")(y)
    return (x + y, kv_cache), load


def _scan(length: int, unroll: bool):
  """DecoderLayer scanned over `length` stacked layers (`unroll`: see `CausalLM.unroll_scan`)."""
  return nn.scan(DecoderLayer, variable_axes={"params": 0, "lora": 0},
                 split_rngs={"params": True}, in_axes=(0,) + (nn.broadcast,) * 6,
                 length=length, metadata_params={nn.PARTITION_NAME: "layers"},
                 unroll=length if unroll else 1)


class LayerRuns(nn.Module):
  """The layer stack as consecutive runs, each scanned over its own stack (`run_i`): layers of
  different param types cannot share one scanned stack. A step compiles one layer body per run
  and stays one program."""
  config: ModelConfig
  kernels: KernelOptions
  dtype: Any
  runs: tuple[int, ...]
  unroll: bool

  @nn.compact
  def __call__(self, carry, layers: LayerInputs, *rest):
    start, loads = 0, []
    for i, n in enumerate(self.runs):
      own = jax.tree.map(lambda a: a[start:start + n], layers)  # each [n]
      carry, load = _scan(n, self.unroll)(self.config, self.kernels, self.dtype,
                                          name=f"run_{i}")(carry, own, *rest)
      start += n
      loads.append(load)
    return carry, None if loads[0] is None else jnp.concatenate(loads)


def layer_runs(params: dict) -> tuple[int, ...]:
  """The run lengths of a layer stack held as runs (`LayerRuns`), () for one stack."""
  stack = params.get("layers", {})
  if "run_0" not in stack:
    return ()
  return tuple(jax.tree.leaves(stack[f"run_{i}"])[0].shape[0] for i in range(len(stack)))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _decoder_layer(config: ModelConfig, kernels: KernelOptions, dtype, params, lora, *args):
  """One unrolled layer, jitted so that its trace is made once and reused by every layer (the
  layers differ only in params and their scanned `LayerInputs`, all traced). Tracing 30 layers
  one by one took most of the 1.3 s a cached one-token SmolLM2 step needed before it ran; XLA
  inlines the calls, so the compiled step is the same. `lora`: the layer's adapter slots."""
  variables = {"params": params} | ({} if lora is None else {"lora": lora})
  return DecoderLayer(config, kernels, dtype).apply(variables, *args)


def _mixed_ffn(config: ModelConfig) -> bool:
  return len(set(config.moe_layers)) > 1


def _layer_inputs(config: ModelConfig, kv_groups: KVGroups | None) -> LayerInputs:  # each [L]
  windows, moe = config.sliding_windows, np.asarray(config.moe_layers)
  mixed = _mixed_ffn(config)
  group, slot = (None, np.arange(config.num_layers)) if kv_groups is None else (
      kv_groups.layer_slots())
  return LayerInputs(
      index=jnp.asarray(slot, jnp.int32), group=None if group is None else jnp.asarray(group),
      window=None if all(w is None for w in windows) else jnp.asarray(
          [NO_WINDOW if w is None else w for w in windows], jnp.int32),
      rope=jnp.asarray(config.local_rope, jnp.int32) if any(config.local_rope) else None,
      moe=jnp.asarray(moe) if mixed else None,
      # The i-th layer of a kind is slot i of that kind's stack.
      ffn_index=jnp.asarray(np.where(moe, np.cumsum(moe), np.cumsum(~moe)) - 1, jnp.int32)
      if mixed else None)


def _stacked(mod: nn.Module, name: str, n: int, module: nn.Module, *args) -> dict:
  """Params of `n` copies of `module` (initialized on `args`), stacked on a leading `layers`
  axis, as the param subtree `name` of `mod`."""
  def init(rng):
    # lax.map, not vmap: flax traces this again on every apply to check the shapes, and not
    # every grouped matmul backend has a batching rule.
    boxes = jax.lax.map(lambda r: module.init(r, *args)["params"], jax.random.split(rng, n))
    return jax.tree.map(lambda b: b.replace(names=("layers",) + b.names), boxes,
                        is_leaf=_is_box)
  return _kernel(mod, name, init)


class CausalLM(nn.Module):
  config: ModelConfig
  kernels: KernelOptions = KernelOptions()
  dtype: Any = jnp.float32
  scan_layers: bool = True
  # How the layers share the KV cache: the cache has kv_groups.num_slots layer slots and the
  # metadata one block table and slot mapping per group. None: a slot per layer, one table.
  kv_groups: KVGroups | None = None
  # The scan unrolled (layers traced once, compiled each): each layer then reads its weights
  # at a static offset of the stack. On a GPU a scanned layer's dynamic slice of the stack is
  # copied out before every matmul (cuBLAS and Triton take operands in place at static offsets
  # only): the compile-only tier found 400 MB of copies in a 2-layer Llama-3.1-8B decode step on
  # an H100, tripling what decode reads; unrolled there are none.
  unroll_scan: bool = False
  # Consecutive runs of layers whose params differ in type (mixed precision: a run's layers
  # share one int4 / int8 / float assignment), each its own stack `params["layers"]["run_i"]`
  # scanned on its own (`layer_runs(params)`). Empty: one stack of every layer.
  layer_runs: tuple[int, ...] = ()

  @nn.compact
  def __call__(
      self,
      token_ids: jax.Array,  # [T] int32
      positions: jax.Array,  # [T] int32
      kv_cache: jax.Array,  # [L or slots, num_pages, 2, Hkv, page_size, D]
      md: AttentionMetadata,  # block_table [G, S, P], slot_mapping [G, T] with kv_groups
      logits_indices: jax.Array | None = None,  # [S] rows to project to logits
      return_hidden: bool = False,
      lora: LoraRows | None = None,  # the rows' adapters, with the `lora` collection's slots
  ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """(logits [S or T, V] float32, final hidden states of the same rows [S or T, E] when
    `return_hidden` (else None), the updated cache)."""
    c = self.config
    if c.tie_word_embeddings:  # the LM head's kernel too: quantized with the linear layers
      embed = _kernel(self, "embedding", lambda *a: LinearKernel(
          _embedding_init(self.kernels, *a), ("vocab", "embed"), transposed=True),
          (c.vocab_size, c.hidden_size), self.dtype)
    else:
      embed = _kernel(self, "embedding", nn.with_logical_partitioning(_init, ("vocab", "embed")),
                      (c.vocab_size, c.hidden_size), self.dtype)
    if isinstance(embed, QArray):  # rows dequantized as they are looked up
      x = (embed.values[token_ids].astype(self.dtype)
           * embed.scale[token_ids][:, None].astype(self.dtype))  # [T, E]
    elif isinstance(embed, GroupwiseArray):  # [K=E, N=V], the head's view: columns looked up
      x = embed.dequantize_columns(token_ids).T.astype(self.dtype)  # [T, E]
    else:
      x = embed[token_ids]  # [T, E]
    if c.embed_scale is not None:  # rounded to the dtype first, as transformers does
      x = x * jnp.asarray(c.embed_scale, self.dtype)
    layers = _layer_inputs(c, self.kv_groups)
    # [T, D], or [2, T, D] (global, local) when some layers rotate with the local rope
    inv_freq = jnp.asarray(np.stack([c.inv_freq(), c.inv_freq(local=True)])
                           if layers.rope is not None else c.inv_freq(), jnp.float32)
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[..., None, :]  # [..., T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [..., T, D]
    cos, sin = jnp.cos(emb).astype(self.dtype), jnp.sin(emb).astype(self.dtype)
    live = jnp.arange(token_ids.shape[0]) < md.cu_q_lens[md.num_seqs[0]]  # [T]: not padding
    ffn_stacks = None
    if _mixed_ffn(c):
      row = jnp.zeros((1, c.hidden_size), self.dtype)
      moe_ids = c.moe_layer_ids
      ffn_stacks = {
          "moe_layers": _stacked(self, "moe_layers", len(moe_ids),
                                 _moe(c, self.kernels, self.dtype), row, jnp.ones((1,), bool)),
          "mlp_layers": _stacked(self, "mlp_layers", c.num_layers - len(moe_ids),
                                 MLP(c, self.kernels, self.dtype), row)}
      if self.has_variable("lora", "mlp_layers"):
        ffn_stacks["lora_mlp_layers"] = self.get_variable("lora", "mlp_layers")
    if self.scan_layers:
      rest = (cos, sin, md, live, ffn_stacks, lora)
      if self.layer_runs:
        (x, kv_cache), loads = LayerRuns(c, self.kernels, self.dtype, self.layer_runs,
                                         self.unroll_scan, name="layers")(
            (x, kv_cache), layers, *rest)
      else:
        (x, kv_cache), loads = _scan(c.num_layers, self.unroll_scan)(
            c, self.kernels, self.dtype, name="layers")((x, kv_cache), layers, *rest)
    else:
      # The adapter slots stay stacked (they change while the engine runs, so no per-layer
      # views of them): each layer takes its slice.
      slots = self.get_variable("lora", "layers") if self.has_variable("lora", "layers") else None
      loads = []
      for i in range(c.num_layers):
        args = ((x, kv_cache), jax.tree.map(lambda a: a[i], layers), cos, sin, md, live,
                ffn_stacks, lora)
        if self.is_initializing():
          (x, kv_cache), load = DecoderLayer(c, self.kernels, self.dtype, name=f"layers_{i}")(*args)
        else:  # traced once for every layer: see `_decoder_layer`
          (x, kv_cache), load = _decoder_layer(
              c, self.kernels, self.dtype, self.variables["params"][f"layers_{i}"],
              None if slots is None else jax.tree.map(lambda a: a[i], slots), *args)
        loads.append(load)
      loads = jnp.stack(loads) if any(c.moe_layers) else None
    if loads is not None:  # [L, experts] -> the MoE layers' rows
      self.sow("expert_load", "tokens_per_expert", loads[np.asarray(c.moe_layer_ids)])
    x = _norm(c, self.dtype, "norm")(x)
    if logits_indices is not None:
      x = x[logits_indices]  # [S, E]
    if c.tie_word_embeddings:
      logits = _tied_head(x, embed, self.kernels)
    else:
      logits = Linear((c.hidden_size, c.vocab_size), ("embed", "vocab"), self.kernels,
                      dtype=self.dtype, name="lm_head")(x)
    logits = soft_cap(logits.astype(jnp.float32), c.final_logit_softcapping)
    return logits, (x if return_hidden else None), kv_cache


def _per_channel(x: jax.Array, values: jax.Array, scale: jax.Array, *, mode: str,
                 kernels: KernelOptions, transposed: bool) -> jax.Array:
  """x [M, K] @ values (K x N, or N x K `transposed`; any shape of that size) -> [M, N], by
  the matmul of the values' dtype: float8's is XLA's float8 dot on every platform (the
  `reference` backend stays the reference)."""
  k = x.shape[1]
  w = values.reshape((-1, k) if transposed else (k, -1))
  if w.dtype == FP8:
    return fp8_matmul(x, w, scale.reshape(-1), mode=mode, transpose_w=transposed,
                      backend="reference" if kernels.matmul == "reference" else "xla")
  return int8_matmul(x, w, scale.reshape(-1), mode=mode, backend=kernels.matmul,
                     interpret=kernels.interpret, transpose_w=transposed)


def _sharded_groupwise(x: jax.Array, w: GroupwiseArray, axes: tuple[str, ...], n_in: int,
                       out_shape: tuple[int, ...], kernels: KernelOptions) -> jax.Array:
  """The group-wise kernel per tensor shard: its flattened K or N splits as `shard_params` laid
  it out (`sharding.group_split`), the activations or the outputs likewise."""
  k_axis, n_axis = group_split(w, axes, n_in, kernels.mesh.shape["tensor"])
  ins = (k_axis,) + (None,) * (n_in - 1)
  outs = (n_axis,) + (None,) * (len(out_shape) - 1)
  spec = P(k_axis, n_axis)
  if w.table is None:
    mm = lambda x, q, scale, offset: groupwise_matmul(
        x, q, scale, offset, bits=w.bits, group_size=w.group_size, backend=kernels.groupwise,
        interpret=kernels.interpret)
    scales, specs = (w.scale, w.offset), (spec, spec)
  else:  # the codebook form: its table whole on every shard
    mm = lambda x, q, scale, table: groupwise_matmul(
        x, q, scale, None, bits=w.bits, group_size=w.group_size, table=table,
        backend=kernels.groupwise, interpret=kernels.interpret)
    scales, specs = (w.scale, w.table), (spec, P(None))
  return tensor_parallel_matmul(mm, x, w.q, scales, in_spec=ins, out_spec=outs,
                                weight_spec=spec, scale_specs=specs, out_shape=out_shape,
                                mesh=kernels.mesh)


def _groupwise(x: jax.Array, w: GroupwiseArray, kernels: KernelOptions) -> jax.Array:
  """x [M, K] @ w [K, N] (group-wise quantized) -> [M, N]."""
  if w.perm is not None:  # rows stored in act-order groups: x's columns follow them
    x = x[:, w.perm]
  return groupwise_matmul(x, w.q, w.scale, w.offset, bits=w.bits, group_size=w.group_size,
                          table=w.table, backend=kernels.groupwise, interpret=kernels.interpret)


def _tied_head(x: jax.Array, embed, kernels: KernelOptions) -> jax.Array:
  if isinstance(embed, GroupwiseArray):  # stored [K=E, N=V]
    return _groupwise(x, embed, kernels)
  if isinstance(embed, QArray):
    mm = functools.partial(_per_channel, mode=HEAD_MODE, kernels=kernels, transposed=True)
    if kernels.mesh is None:
      return mm(x, embed.values, embed.scale)
    ins, outs, w_spec, s_spec = int8_specs(("vocab", "embed"), 1, True)
    return tensor_parallel_matmul(mm, x, embed.values, (embed.scale,), in_spec=ins,
                                  out_spec=outs, weight_spec=w_spec, scale_specs=(s_spec,),
                                  out_shape=embed.values.shape[:1], mesh=kernels.mesh)
  return dense_matmul(x, embed, transpose_w=True, backend=kernels.dense)


def lm_head(params: dict, config: ModelConfig, kernels: KernelOptions, x: jax.Array) -> jax.Array:
  """The model's LM head outside the model: final hidden states x [N, E] -> logits [N, V]
  (Medusa's shared heads project through it)."""
  if config.tie_word_embeddings:
    logits = _tied_head(x, params["embedding"], kernels)
  else:
    logits = Linear((config.hidden_size, config.vocab_size), ("embed", "vocab"), kernels,
                    dtype=x.dtype).apply({"params": params["lm_head"]}, x)
  return soft_cap(logits, config.final_logit_softcapping)


def _embedding_init(kernels: KernelOptions, key, shape, dtype):
  if kernels.quantization in INT8_KERNELS + ("mixed",):  # mixed: int8 as under int4
    return QArray(values=jnp.zeros(shape, jnp.int8), scale=jnp.ones(shape[:1], jnp.float32),
                  n_in=1, n_out=1, transposed=True)
  return _init(key, shape, dtype)


def unstack_layers(params: dict, num_layers: int) -> dict:
  """The stacked layout as the unrolled stack reads it: `layers` -> `layers_0`, `layers_1`, ...
  (each leaf a separate array, so no layer's weights are sliced out of a stack at run time).

  On the CPU each layer's array is a view of the stacked one (no copy): the scanned and the
  unrolled stack then run from one copy of the weights. A stack held as runs (`LayerRuns`)
  unstacks run after run."""
  out = {k: v for k, v in params.items() if k != "layers"}
  runs = layer_runs(params)
  stacks = ([params["layers"][f"run_{r}"] for r in range(len(runs))] if runs
            else [params["layers"]])
  i = 0
  for stack in stacks:
    for j in range(jax.tree.leaves(stack)[0].shape[0]):
      out[f"layers_{i}"] = jax.tree.map(lambda a: _layer_view(a, j), stack)
      i += 1
  assert i == num_layers, (i, num_layers)
  return out


def _layer_view(a: jax.Array, i: int) -> jax.Array:
  # A sharded array slices as usual: a host view would land on one device and lose its layout.
  if (not isinstance(a, jax.Array) or len(a.devices()) != 1
      or next(iter(a.devices())).platform != "cpu"):
    return a[i]
  # np.asarray of a CPU array is a view of its buffer, and device_put of an aligned host array
  # aliases it on the CPU (an unaligned one is copied, which costs memory, not correctness).
  # The view is committed only where the stacked array is: a step's outputs (the KV cache) are
  # committed when any input is, and a cache whose commitment changes between steps recompiles
  # the step that saw it the other way.
  return jax.device_put(np.asarray(a)[i], next(iter(a.devices())) if a.committed else None)


def _abstract_params(config: ModelConfig, dtype=jnp.float32,
                     kernels: KernelOptions = KernelOptions()) -> dict:
  """Params as boxed ShapeDtypeStructs, traced from init without allocating anything."""
  t = jnp.zeros((1,), jnp.int32)
  md = AttentionMetadata(slot_mapping=t, block_table=jnp.zeros((1, 1), jnp.int32), kv_lens=t + 1,
                         cu_q_lens=jnp.array([0, 1], jnp.int32), num_seqs=t + 1)
  cache = jnp.zeros((config.num_layers, 1, 2, config.num_kv_heads, 1, config.head_dim))
  return jax.eval_shape(CausalLM(config, kernels, dtype=dtype).init, jax.random.key(0), t, t,
                        cache, md)["params"]


_is_box = lambda b: isinstance(b, nn.Partitioned)


def logical_axes(config: ModelConfig) -> dict:
  """The params tree with each leaf replaced by its logical axis names."""
  return jax.tree.map(lambda b: b.names, _abstract_params(config), is_leaf=_is_box)


def linear_kernels(config: ModelConfig, transposed: bool = False) -> dict:
  """The params tree with each linear kernel (a tied embedding included) replaced by its
  `(n_in, n_out, transposed, store_transposed)`, other leaves by None: what the quantizer reads.

  `transposed` stores every quantized kernel that its layer can read so outputs first, as
  `KernelOptions.int8_transposed` says (the tied embedding is stored so anyway)."""
  return jax.tree.map(lambda b: (b.n_in, b.n_out, b.transposed,
                                 b.transposed or (transposed and b.reads_transposed))
                      if isinstance(b, LinearKernel) else None,
                      _abstract_params(config), is_leaf=_is_box)


def param_shapes(config: ModelConfig, dtype=jnp.float32) -> dict:
  """The params tree with each leaf a ShapeDtypeStruct: what a loader must produce."""
  return nn.unbox(_abstract_params(config, dtype))
