"""Per-output-channel int8 quantization of every linear layer's kernel, at load time.

Embeddings and norms stay in float: the embedding is a gather (and, when tied, the lm head
reads it too), norms are tiny. A quantized linear holds `{"kernel": int8, "scale": float32}`,
which is what `Linear` declares when the model runs with a quantization.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quantize_per_channel

# Kernels whose leading two axes contract with the input ([Hq, D, E] for o_proj); others one.
_TWO_INPUT_AXES = ("o_proj",)


def quantize_params(params: dict) -> dict:
  def walk(tree: dict, name: str) -> dict:
    if "kernel" in tree:
      w = tree["kernel"]
      n_in = 2 if name in _TWO_INPUT_AXES else 1
      k = int(np.prod(w.shape[:n_in]))
      q, scale = quantize_per_channel(jnp.asarray(w, jnp.float32).reshape(k, -1))
      return dict(tree, kernel=q.reshape(w.shape), scale=scale.reshape(w.shape[n_in:]))
    return {key: walk(v, key) if isinstance(v, dict) else v for key, v in tree.items()}

  return walk(params, "")


def param_bytes(params: dict) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
