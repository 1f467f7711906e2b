"""HF tensor names and layouts -> the jinfer params tree. Every format loads through here.

A loader only has to answer "give me the HF-named tensor as numpy" (GGUF loaders rename and
un-permute first); this module knows which tensors a config needs, checks their shapes and
rearranges them into the model's `[in..., out...]` kernels, per-layer tensors written straight
into their slot of the stacked `[L, ...]` arrays.

MoE experts come in either layout transformers writes and reads: one tensor per expert
(`experts.N.{gate,up,down}_proj`, Mixtral's `block_sparse_moe.experts.N.{w1,w3,w2}`) or
transformers 5's fused `experts.gate_up_proj [E, 2I, H]` (gate first) and
`experts.down_proj [E, H, I]`; a layer's experts are read in whichever its file has.
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from jinfer.config import ModelConfig
from jinfer.weights.channel_tensor import ChannelTensor
from jinfer.weights.groupwise_tensor import GroupwiseTensor

# Weights a checkpoint keeps quantized: stacked and placed as they are, never through float.
_QUANTIZED = (GroupwiseTensor, ChannelTensor)


class WeightError(ValueError):
  """A checkpoint file is missing a tensor, has a wrong shape, or is unreadable."""


def _expect(arr, shape: tuple[int, ...], name: str, source: str):
  if tuple(arr.shape) != shape:
    raise WeightError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, expected {shape}")
  return arr


Fetch = Callable[[int], dict[tuple[str, ...], np.ndarray]]  # layer -> {params path: tensor}


def hf_to_params(config: ModelConfig, get: Callable[[str], np.ndarray], *, dtype=jnp.float32,
                 source: str) -> dict:
  """Build params from HF-named tensors. `get(name)` raises KeyError for a missing tensor."""
  c = config
  e, f, hq, hkv, d = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
  # Host staging in the target precision where numpy has it (bfloat16 converts on device).
  host = np.float32 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)

  def t(name: str, shape: tuple[int, ...]) -> np.ndarray | GroupwiseTensor:
    try:
      arr = get(name)
    except KeyError:
      raise WeightError(f"{source}: missing tensor {name!r}") from None
    if isinstance(arr, GroupwiseTensor):  # HF [..., N, K] held as [..., K, N]
      return _expect(arr, shape[:-2] + shape[:-3:-1], name, source)
    if isinstance(arr, ChannelTensor):  # held as HF stores it
      return _expect(arr, shape, name, source)
    return _expect(np.asarray(arr), shape, name, source)

  def plain(tensors: list) -> list[Fetch]:
    """(params path, HF name after "model.layers.N.", HF shape, to our layout) -> fetches."""
    return [lambda i, path=path, hf=hf, shape=shape, to=to: {
        path: _to_layout(t(f"model.layers.{i}.{hf}", shape), to)}
        for path, hf, shape, to in tensors]

  proj = lambda heads: lambda w: w.T.reshape(e, heads, d)  # HF [heads*D, E] -> [E, heads, D]
  layer_tensors = [(("input_norm", "scale"), "input_layernorm.weight", (e,), None)]
  if c.sandwich_norms:  # Gemma: post_attention_layernorm normalizes attention's output
    layer_tensors += [
        (("attn_out_norm", "scale"), "post_attention_layernorm.weight", (e,), None),
        (("post_attn_norm", "scale"), "pre_feedforward_layernorm.weight", (e,), None),
        (("ffn_out_norm", "scale"), "post_feedforward_layernorm.weight", (e,), None)]
  else:
    layer_tensors.append((("post_attn_norm", "scale"), "post_attention_layernorm.weight", (e,),
                          None))
  layer_tensors += [
      (("attn", "q_proj", "kernel"), "self_attn.q_proj.weight", (hq * d, e), proj(hq)),
      (("attn", "k_proj", "kernel"), "self_attn.k_proj.weight", (hkv * d, e), proj(hkv)),
      (("attn", "v_proj", "kernel"), "self_attn.v_proj.weight", (hkv * d, e), proj(hkv)),
      (("attn", "o_proj", "kernel"), "self_attn.o_proj.weight", (e, hq * d),
       lambda w: w.T.reshape(hq, d, e)),
  ]
  if c.attention_bias:
    for name, heads in (("q_proj", hq), ("k_proj", hkv), ("v_proj", hkv)):
      layer_tensors.append((("attn", name, "bias"), f"self_attn.{name}.bias", (heads * d,),
                            lambda w, heads=heads: w.reshape(heads, d)))
  if c.qk_norm:
    for name in ("q_norm", "k_norm"):
      layer_tensors.append((("attn", name, "scale"), f"self_attn.{name}.weight", (d,), None))

  def stack(fetches: list[Fetch], layer_ids: list[int], prefix: tuple[str, ...] = ()) -> dict:
    """The fetched tensors of `layer_ids`, each path stacked `[len(layer_ids), ...]`, layer j
    of the stack written straight into its slot; one fetch at a time is staged on the host."""
    tree: dict = {}
    for fetch in fetches:
      arrays: dict[tuple[str, ...], np.ndarray | list[GroupwiseTensor | ChannelTensor]] = {}
      for j, i in enumerate(layer_ids):
        for path, w in fetch(i).items():
          a = arrays.get(path)
          if isinstance(w, _QUANTIZED) and not isinstance(a, np.ndarray):
            arrays.setdefault(path, []).append(w)
            continue
          # A float layer among group-wise ones (a GGUF file may store a few layers as F16):
          # the stack is float, the group-wise layers dequantized into it exactly.
          if isinstance(a, list):
            arrays[path] = np.empty((len(layer_ids),) + w.shape, host)
            for k, g in enumerate(a):
              arrays[path][k] = g.dequantize().reshape(w.shape)
          elif a is None:
            arrays[path] = np.empty((len(layer_ids),) + w.shape, host)
          a = arrays[path]
          a[j] = w.dequantize().reshape(a.shape[1:]) if isinstance(w, _QUANTIZED) else w
      for path, a in arrays.items():
        node = tree
        for key in (prefix + path)[:-1]:
          node = node.setdefault(key, {})
        node[(prefix + path)[-1]] = (type(a[0]).stack(a).to_device() if isinstance(a, list)
                                     else jnp.asarray(a, dtype=dtype))
    return tree

  attn = plain(layer_tensors)
  mlp = plain(_mlp_tensors("mlp", e, f))
  every = list(range(c.num_layers))
  moe_ids = list(c.moe_layer_ids)
  dense_ids = [i for i in every if i not in moe_ids]
  moe = _moe_fetches(c, get, t, plain, source) if moe_ids else []
  if moe_ids and dense_ids:  # each kind stacked over its own layers (see jinfer/models/llama.py)
    params = {"layers": stack(attn, every), "mlp_layers": stack(mlp, dense_ids),
              "moe_layers": stack(moe, moe_ids)}
  elif moe_ids:
    params = {"layers": {**stack(attn, every), **stack(moe, every, ("moe",))}}
  else:
    params = {"layers": {**stack(attn, every), **stack(mlp, every, ("mlp",))}}
  params["embedding"] = _placed(t("model.embed_tokens.weight", (c.vocab_size, e)), None, dtype)
  params["norm"] = {"scale": jnp.asarray(t("model.norm.weight", (e,)), dtype=dtype)}
  if not c.tie_word_embeddings:
    params["lm_head"] = {"kernel": _placed(t("lm_head.weight", (c.vocab_size, e)), np.transpose,
                                           dtype)}
  return params


def _to_layout(w: np.ndarray | GroupwiseTensor | ChannelTensor, to: Callable | None):
  """An HF tensor in our layout. A group-wise weight already is: it is held [K, N], which is
  our kernel `[in..., out...]` flattened, and stays so (the model reads it flattened). A
  per-channel one moves its values as `to` moves a float kernel."""
  if isinstance(w, GroupwiseTensor):
    return w
  if isinstance(w, ChannelTensor):
    return w.laid_out(to)
  return (to or np.asarray)(w)


def _placed(w: np.ndarray | GroupwiseTensor | ChannelTensor, to: Callable | None, dtype):
  """One unstacked tensor, on the device in our layout (group-wise ones stay quantized; an
  embedding's is [K=E, N=V], the tied head's view)."""
  if isinstance(w, GroupwiseTensor):
    return w.to_device()
  if isinstance(w, ChannelTensor):
    if to is None:
      raise WeightError("an embedding quantized per channel is not read (only linear layers)")
    return w.laid_out(to).to_device()
  return jnp.asarray(_to_layout(w, to), dtype=dtype)


def _mlp_tensors(prefix: str, e: int, f: int) -> list:
  """A dense MLP's (params path, HF name, HF shape, to our layout)."""
  return [(("gate_proj", "kernel"), f"{prefix}.gate_proj.weight", (f, e), np.transpose),
          (("up_proj", "kernel"), f"{prefix}.up_proj.weight", (f, e), np.transpose),
          (("down_proj", "kernel"), f"{prefix}.down_proj.weight", (e, f), np.transpose)]


def _moe_fetches(c: ModelConfig, get: Callable, t: Callable, plain: Callable,
                 source: str) -> list[Fetch]:
  """An MoE layer's params (router, experts, shared expert) in whichever layout its file has."""
  e, n, f = c.hidden_size, c.num_experts, c.moe_intermediate_size
  # Per-expert names (router, gate, up, down) after "model.layers.N."; the fused layout uses
  # transformers 5's in-memory names, "mlp." for every architecture.
  if c.architecture == "mixtral":
    router, gate, up, down = ("block_sparse_moe.gate.weight",
                              "block_sparse_moe.experts.{}.w1.weight",
                              "block_sparse_moe.experts.{}.w3.weight",
                              "block_sparse_moe.experts.{}.w2.weight")
  else:
    router, gate, up, down = ("mlp.gate.weight", "mlp.experts.{}.gate_proj.weight",
                              "mlp.experts.{}.up_proj.weight", "mlp.experts.{}.down_proj.weight")

  def maybe(name: str):
    try:
      w = get(name)
    except KeyError:
      return None
    return w if isinstance(w, GroupwiseTensor) else np.asarray(w)

  def kernel(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One expert's HF [N, K] weight as our [K, N] float kernel (a per-expert layout stacks
    experts here, so quantized ones are dequantized; the fused layout keeps them quantized)."""
    w = t(name, shape)
    if isinstance(w, ChannelTensor):
      raise WeightError(f"{source}: tensor {name!r}: MoE experts quantized per channel are not "
                        f"read yet (dense layers are)")
    return w.dequantize() if isinstance(w, GroupwiseTensor) else w.T

  def experts(i: int) -> dict:
    p = f"model.layers.{i}"
    gate_up = maybe(f"{p}.mlp.experts.gate_up_proj")
    if gate_up is not None:  # fused: gate_up [X, 2F, E] (gate first), down [X, E, F]
      name = f"{p}.mlp.experts.gate_up_proj"
      if isinstance(gate_up, GroupwiseTensor):  # [X, E, 2F]: our [X, E, 2, F] flattened
        return {("router",): t(f"{p}.mlp.gate.weight", (n, e)).T,
                ("gate_up", "kernel"): _expect(gate_up, (n, e, 2 * f), name, source),
                ("down", "kernel"): t(f"{p}.mlp.experts.down_proj", (n, e, f))}
      gate_up = _expect(gate_up, (n, 2 * f, e), name, source)
      return {("router",): t(f"{p}.mlp.gate.weight", (n, e)).T,
              ("gate_up", "kernel"): gate_up.reshape(n, 2, f, e).transpose(0, 3, 1, 2),
              ("down", "kernel"): t(f"{p}.mlp.experts.down_proj", (n, e, f)).transpose(0, 2, 1)}
    return {("router",): t(f"{p}.{router}", (n, e)).T,  # [E, X]
            ("gate_up", "kernel"): np.stack([  # [X, E, 2, F]
                np.stack([kernel(f"{p}.{gate.format(x)}", (f, e)),
                          kernel(f"{p}.{up.format(x)}", (f, e))], axis=1) for x in range(n)]),
            ("down", "kernel"): np.stack([kernel(f"{p}.{down.format(x)}", (e, f))  # [X, F, E]
                                          for x in range(n)])}

  fetches = [experts]
  if c.shared_expert_intermediate_size:
    fetches += plain([(("shared_expert",) + path, hf, shape, to) for path, hf, shape, to in
                      _mlp_tensors("mlp.shared_expert", e, c.shared_expert_intermediate_size)])
    fetches += plain([(("shared_expert_gate",), "mlp.shared_expert_gate.weight", (1, e),
                       lambda w: w.reshape(e))])
  return fetches
