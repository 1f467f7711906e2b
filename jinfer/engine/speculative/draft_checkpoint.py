"""A distilled draft on disk: only what was trained, the rest borrowed from its target.

A directory holding `draft.json` (what it is and what it fits) and `params/`, an orbax
checkpoint of the draft's own weights: its decoder layers (stacked, as `CausalLM` reads them), its
final norm, and its vocabulary (the target token ids it may propose, most frequent first). The
embedding, which is also the LM head, is the target's, shared at load time; the draft's head is
the embedding's rows of its vocabulary (FR-Spec: a smaller head costs less, and rejection
sampling stays exact whatever q is).
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.config import ModelConfig
from jinfer.models import param_shapes
from jinfer.weights.orbax_checkpoint import restore_params, save_params

META = "draft.json"
FORMAT = "jinfer-draft-v1"


def is_draft_checkpoint(path: str) -> bool:
  return os.path.isfile(os.path.join(path, META))


def draft_config(target: ModelConfig, num_layers: int) -> ModelConfig:
  """The target's architecture with `num_layers` layers (their sliding windows, ropes and MoE
  kinds, if any, from the first layers)."""
  return dataclasses.replace(target, num_layers=num_layers,
                             sliding_windows=target.sliding_windows[:num_layers],
                             local_rope=target.local_rope[:num_layers],
                             moe_layers=target.moe_layers[:num_layers])


def save_draft(path: str, own: dict, meta: dict, dtype=jnp.bfloat16) -> None:
  """`own`: {"layers": ..., "norm": ..., "vocab": [Vd] int32}; float leaves stored as `dtype`."""
  os.makedirs(path, exist_ok=True)
  tree = jax.tree.map(lambda a: jnp.asarray(a, dtype) if jnp.issubdtype(a.dtype, jnp.floating)
                      else jnp.asarray(a), own)
  save_params(os.path.join(path, "params"), tree)
  with open(os.path.join(path, META), "w") as fh:
    json.dump({"format": FORMAT, **meta}, fh, indent=2)


def load_draft(path: str, target: ModelConfig, target_params: dict,
               dtype) -> tuple[ModelConfig, dict, np.ndarray]:
  """(config, params with the target's embedding, vocabulary [Vd] int32)."""
  with open(os.path.join(path, META)) as fh:
    meta = json.load(fh)
  if meta.get("format") != FORMAT:
    raise ValueError(f"{path}: not a {FORMAT} draft checkpoint (format {meta.get('format')!r})")
  for key in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
    if meta[key] != getattr(target, key):
      raise ValueError(f"{path}: the draft was made for a target with {key}={meta[key]}; this "
                       f"target has {getattr(target, key)}")
  if not target.tie_word_embeddings:
    raise ValueError(f"{path}: a distilled draft shares its target's tied embedding; this target "
                     f"has a separate LM head")
  config = draft_config(target, meta["num_layers"])
  shapes = param_shapes(config, jnp.bfloat16)
  like = {"layers": shapes["layers"], "norm": shapes["norm"],
          "vocab": jax.ShapeDtypeStruct((meta["draft_vocab_size"],), jnp.int32)}
  own = restore_params(os.path.join(path, "params"), like)
  params = {"embedding": target_params["embedding"],
            "layers": jax.tree.map(lambda a: jnp.asarray(a, dtype), own["layers"]),
            "norm": jax.tree.map(lambda a: jnp.asarray(a, dtype), own["norm"])}
  return config, params, np.asarray(own["vocab"])
