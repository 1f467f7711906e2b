"""Per-input-channel scales folded into the op that produces a linear layer's input, so that a
smoothed or AWQ-scaled model runs exactly the float graph with different numbers in it:

    norm(x) W  =  (norm(x) / s) (diag(s) W)    the norm's `scale` param divided by s
    y W        =  (y / s) (diag(s) W)          y a linear's output: its kernel's output columns
                                               (and bias) divided by s

This is the one place that knows which op feeds which linear inside a decoder layer (as
AutoAWQ's per-architecture `get_layers_for_scaling` does), as param paths relative to the layer
stack (`params["layers"]`), every param stacked on the leading `layers` axis:

* `input_norm` -> q/k/v projections;
* `attn/v_proj` -> `attn/o_proj`, only when v's outputs are o's inputs one to one (as many KV
  heads as query heads). Under GQA one value channel feeds several query heads' slots of o's
  input, which one scale per channel cannot serve (AutoAWQ skips it too);
* `post_attn_norm` -> gate/up projections of a dense MLP (an MoE layer's norm also feeds its
  router, so MoE feed-forwards are left alone);
* `mlp/up_proj` -> `mlp/down_proj`: down's input is silu(gate) * up, linear in up's outputs.

A group whose params are absent from the stack (no dense MLP in it, another architecture's
names) is skipped.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ScaleGroup:
  source: Path  # what produces the linears' input: a norm (has `scale`) or a linear (`kernel`)
  linears: tuple[Path, ...]  # the linears that read it, all with one scale per input channel


DECODER_GROUPS = (
    ScaleGroup(("input_norm",), (("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"))),
    ScaleGroup(("attn", "v_proj"), (("attn", "o_proj"),)),
    ScaleGroup(("post_attn_norm",), (("mlp", "gate_proj"), ("mlp", "up_proj"))),
    ScaleGroup(("mlp", "up_proj"), (("mlp", "down_proj"),)),
)
# Linears whose outputs become attention scores: their errors pass through the softmax's
# exponential, so AWQ does not clip them.
SCORE_LINEARS = (("attn", "q_proj"), ("attn", "k_proj"))


def get(tree: dict, path: Path):
  for p in path:
    tree = tree[p]
  return tree


def has(tree: dict, path: Path) -> bool:
  for p in path:
    if not isinstance(tree, dict) or p not in tree:
      return False
    tree = tree[p]
  return True


def replace(tree: dict, path: Path, value) -> dict:
  """A copy of nested dicts `tree` with the leaf at `path` replaced (the rest shared)."""
  if not path:
    return value
  return {**tree, path[0]: replace(tree[path[0]], path[1:], value)}


def flat_kernel(w: jax.Array, kernel: tuple) -> jax.Array:
  """A kernel [lead..., in..., out...] as [lead..., K, N]; `kernel` its `(n_in, n_out, ...)`
  from `linear_kernels`."""
  n_in, n_out = kernel[:2]
  lead = w.shape[:w.ndim - n_in - n_out]
  k = int(np.prod(w.shape[len(lead):len(lead) + n_in]))
  return w.reshape(*lead, k, -1)


def _out_size(stack: dict, kernels: dict, path: Path) -> int:
  return flat_kernel(get(stack, path + ("kernel",)), get(kernels, path + ("kernel",))).shape[-1]


def _in_size(stack: dict, kernels: dict, path: Path) -> int:
  return flat_kernel(get(stack, path + ("kernel",)), get(kernels, path + ("kernel",))).shape[-2]


def layer_groups(stack: dict, kernels: dict) -> list[ScaleGroup]:
  """The groups of `DECODER_GROUPS` this layer stack has, whose source's outputs are the
  linears' inputs channel for channel."""
  out = []
  for g in DECODER_GROUPS:
    if not all(has(stack, p) for p in (g.source,) + g.linears):
      continue
    if "kernel" in get(stack, g.source):  # a linear source: its outputs must be the inputs
      width = _out_size(stack, kernels, g.source)
      if any(_in_size(stack, kernels, p) != width for p in g.linears):
        continue
    out.append(g)
  return out


def group_kernel(stack: dict, kernels: dict, group: ScaleGroup) -> jax.Array:
  """The group's kernels side by side along N: [layers, K, sum of N]."""
  return jnp.concatenate([flat_kernel(get(stack, p + ("kernel",)), get(kernels, p + ("kernel",)))
                          for p in group.linears], axis=-1)


def fold(stack: dict, kernels: dict, group: ScaleGroup, s: jax.Array,
         norm_offset: float = 0.0) -> dict:
  """The layer stack with scales s [layers, K] folded in: the group's kernels' rows times s, the
  source's outputs divided by s. The float model computes the same function.

  norm_offset: what a norm adds to its `scale` param before scaling (Gemma's RMSNorm
  multiplies by 1 + scale: 1)."""
  src = get(stack, group.source)
  if "kernel" in src:
    w = get(stack, group.source + ("kernel",))
    flat = flat_kernel(w, get(kernels, group.source + ("kernel",)))  # [L, K', N]
    new = {**src, "kernel": (flat / s[:, None, :]).reshape(w.shape).astype(w.dtype)}
    if "bias" in src:
      b = src["bias"]
      new["bias"] = (b.reshape(s.shape) / s).reshape(b.shape).astype(b.dtype)
    stack = replace(stack, group.source, new)
  else:
    scale = src["scale"]  # [L, K]
    stack = replace(stack, group.source + ("scale",),
                    ((scale + norm_offset) / s - norm_offset).astype(scale.dtype))
  for p in group.linears:
    w = get(stack, p + ("kernel",))
    flat = flat_kernel(w, get(kernels, p + ("kernel",)))  # [L, K, N]
    stack = replace(stack, p + ("kernel",),
                    (flat * s[:, :, None]).reshape(w.shape).astype(w.dtype))
  return stack
