"""Medusa heads (Cai et al., 2024): small decoding heads on the target's final hidden state; head
i guesses the token i + 2 positions ahead (the target's own head guesses the next one).

Head i is `num_layers` residual blocks x <- x + SiLU(x W + b) (W zero-initialized, so a new
head starts as the identity) followed by a vocabulary projection:
  * shared: the target's own LM head, frozen (what we train: a private 28M-parameter projection
    per head would nearly double SmolLM2 and cost a full head read each per step), optionally
    restricted to the `vocab` rows most frequent in the training text (FR-Spec: a fraction of the
    read, and the verify step keeps the output exact whatever the heads guess);
  * private: a projection per head, `lm_head` [H, V, E], as published Medusa heads have.

Params, one tree for all heads (E = hidden size, L = residual blocks per head):
  w [H, L, E, E] (x @ w: input axis first), b [H, L, E], and optionally lm_head [H, V, E] and
  vocab [Vh] int32.

On disk, our format is a directory with `medusa.json` and `params/`, an orbax checkpoint of only
what was trained; the published format (`medusa_lm_head.safetensors`, keys
`{head}.{layer}.linear.weight` [E, E] (out, in) and `.bias`, `{head}.{num_layers}.weight` [V, E],
with `medusa_num_heads` / `medusa_num_layers` in `config.json`) loads too.
"""
from __future__ import annotations

import json
import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.config import ModelConfig
from jinfer.weights.orbax_checkpoint import restore_params, save_params

META = "medusa.json"
FORMAT = "jinfer-medusa-v1"
PUBLISHED_FILE = "medusa_lm_head.safetensors"


def init_heads(num_heads: int, hidden_size: int, num_layers: int = 1,
               dtype=jnp.float32) -> dict:
  """New shared-projection heads: every residual block zero, so each head is the identity."""
  return {"w": jnp.zeros((num_heads, num_layers, hidden_size, hidden_size), dtype),
          "b": jnp.zeros((num_heads, num_layers, hidden_size), dtype)}


def num_heads(params: dict) -> int:
  return params["w"].shape[0]


def head_states(params: dict, h: jax.Array) -> jax.Array:
  """h [N, E] -> each head's state before its projection [N, H, E]."""
  x = jnp.broadcast_to(h[:, None, :], (h.shape[0], num_heads(params), h.shape[1]))
  for layer in range(params["w"].shape[1]):
    w, b = params["w"][:, layer].astype(h.dtype), params["b"][:, layer].astype(h.dtype)
    x = x + jax.nn.silu(jnp.einsum("nhe,hef->nhf", x, w) + b)
  return x


def head_logits(params: dict, h: jax.Array,
                shared_head: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
  """h [N, E] -> logits [N, H, V'] over the heads' vocabulary (`vocab` if given, else all V).
  `shared_head(x [M, E]) -> [M, V]`: the target's full LM head, for shared heads without
  `vocab`."""
  x = head_states(params, h)
  if "lm_head" in params:
    return jnp.einsum("nhe,hve->nhv", x, params["lm_head"].astype(x.dtype))
  if "rows" in params:  # the shared head's `vocab` rows, gathered once (see `with_rows`)
    return jnp.einsum("nhe,ve->nhv", x, params["rows"].astype(x.dtype))
  n, hh, e = x.shape
  return shared_head(x.reshape(n * hh, e)).reshape(n, hh, -1)


def with_rows(params: dict, embedding: jax.Array) -> dict:
  """Shared heads restricted to `vocab`: the params with the target's LM head rows [Vh, E]
  (its tied embedding, float) they project onto."""
  if "vocab" not in params or "lm_head" in params:
    return params
  return {**params, "rows": jnp.asarray(embedding)[jnp.asarray(params["vocab"])]}


def top_candidates(params: dict, h: jax.Array, topk: int,
                   shared_head: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
  """h [N, E] -> each head's `topk` most likely tokens [N, H, topk] int32, as target token ids,
  best first."""
  _, ids = jax.lax.top_k(head_logits(params, h, shared_head).astype(jnp.float32), topk)
  if "vocab" in params:
    ids = params["vocab"][ids]
  return ids.astype(jnp.int32)


# -- on disk ----------------------------------------------------------------------------------
def is_medusa_checkpoint(path: str) -> bool:
  return os.path.isfile(os.path.join(path, META)) or _published_file(path) is not None


def heads_meta(path: str) -> dict:
  """What a checkpoint says of its heads without loading them: at least `num_heads`, and
  `rank_hits` (each head's hit rate per candidate rank) where it was measured."""
  if os.path.isfile(os.path.join(path, META)):
    with open(os.path.join(path, META)) as fh:
      meta = json.load(fh)
    return {**meta, "num_heads": meta["shapes"]["w"][0],
            "rank_hits": meta.get("eval", {}).get("rank_hits")}
  from safetensors import safe_open
  file = _published_file(path)
  cfg_file = os.path.join(os.path.dirname(file), "config.json")
  if os.path.isfile(cfg_file):
    with open(cfg_file) as fh:
      heads = json.load(fh).get("medusa_num_heads")
    if heads:
      return {"num_heads": int(heads)}
  with safe_open(file, framework="numpy") as st:
    return {"num_heads": 1 + max(int(k.split(".")[0]) for k in st.keys())}


def save_heads(path: str, params: dict, meta: dict, dtype=jnp.bfloat16) -> None:
  """Our format; float leaves stored as `dtype`. `meta` says what the heads fit (hidden_size,
  vocab_size) and how they were made."""
  os.makedirs(path, exist_ok=True)
  tree = jax.tree.map(lambda a: jnp.asarray(a, dtype) if jnp.issubdtype(a.dtype, jnp.floating)
                      else jnp.asarray(a), params)
  save_params(os.path.join(path, "params"), tree)
  shapes = {k: list(v.shape) for k, v in params.items()}
  with open(os.path.join(path, META), "w") as fh:
    json.dump({"format": FORMAT, "shapes": shapes, "dtype": jnp.dtype(dtype).name, **meta}, fh,
              indent=2)


def load_heads(path: str, target: ModelConfig, dtype=jnp.float32) -> tuple[dict, dict]:
  """(params, meta) from our format or the published one, checked against the target."""
  if os.path.isfile(os.path.join(path, META)):
    with open(os.path.join(path, META)) as fh:
      meta = json.load(fh)
    if meta.get("format") != FORMAT:
      raise ValueError(f"{path}: not a {FORMAT} checkpoint (format {meta.get('format')!r})")
    stored = jnp.dtype(meta.get("dtype", "bfloat16"))
    like = {k: jax.ShapeDtypeStruct(tuple(s), jnp.int32 if k == "vocab" else stored)
            for k, s in meta["shapes"].items()}
    params = restore_params(os.path.join(path, "params"), like)
  else:
    params, meta = _load_published(path)
  params = {k: np.asarray(v) if k == "vocab" else jnp.asarray(v, dtype) for k, v in params.items()}
  e = params["w"].shape[-1]
  if e != target.hidden_size:
    raise ValueError(f"{path}: the heads take hidden size {e}; the model's is "
                     f"{target.hidden_size}")
  if "lm_head" in params and params["lm_head"].shape[1] != target.vocab_size:
    raise ValueError(f"{path}: the heads project to {params['lm_head'].shape[1]} tokens; the "
                     f"model's vocabulary has {target.vocab_size}")
  if "vocab" in params and not np.all((params["vocab"] >= 0)
                                      & (params["vocab"] < target.vocab_size)):
    raise ValueError(f"{path}: the heads' vocabulary holds ids outside the model's "
                     f"[0, {target.vocab_size})")
  return params, meta


def _published_file(path: str) -> str | None:
  if os.path.isfile(path) and path.endswith(".safetensors"):
    return path
  f = os.path.join(path, PUBLISHED_FILE)
  return f if os.path.isfile(f) else None


def _load_published(path: str) -> tuple[dict, dict]:
  from safetensors.numpy import load_file
  file = _published_file(path)
  if file is None:
    raise ValueError(f"{path}: neither a {FORMAT} checkpoint ({META}) nor published Medusa heads "
                     f"({PUBLISHED_FILE})")
  tensors = {k: np.asarray(v, np.float32) for k, v in load_file(file).items()}
  config = {}
  cfg_file = os.path.join(os.path.dirname(file), "config.json")
  if os.path.isfile(cfg_file):
    with open(cfg_file) as fh:
      config = json.load(fh)
  keys = [re.fullmatch(r"(\d+)\.(\d+)\.(linear\.)?(weight|bias)", k) for k in tensors]
  if not all(keys):
    bad = next(k for k, m in zip(tensors, keys) if m is None)
    raise ValueError(f"{file}: unexpected tensor {bad!r} for Medusa heads "
                     f"('{{head}}.{{layer}}.linear.weight/bias', '{{head}}.{{layers}}.weight')")
  heads = config.get("medusa_num_heads", 1 + max(int(m[1]) for m in keys))
  layers = config.get("medusa_num_layers", max(int(m[2]) for m in keys))
  get = lambda name: _need(tensors, name, file)
  w = np.stack([np.stack([get(f"{h}.{l}.linear.weight").T for l in range(layers)])
                for h in range(heads)])  # [H, L, E_in, E_out]
  b = np.stack([np.stack([get(f"{h}.{l}.linear.bias") for l in range(layers)])
                for h in range(heads)])
  lm = np.stack([get(f"{h}.{layers}.weight") for h in range(heads)])  # [H, V, E]
  return {"w": w, "b": b, "lm_head": lm}, {"format": "medusa", "source": file}


def _need(tensors: dict, name: str, file: str) -> np.ndarray:
  if name not in tensors:
    raise ValueError(f"{file}: missing tensor {name!r}")
  return tensors[name]
