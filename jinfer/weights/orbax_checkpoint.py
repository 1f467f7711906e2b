"""Save and restore jinfer params (and artifacts jinfer makes) as orbax checkpoints."""
from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp


def save_params(path: str, params: dict) -> None:
  ck = ocp.StandardCheckpointer()
  ck.save(os.path.abspath(path), params)
  ck.wait_until_finished()


def restore_params(path: str, like: dict) -> dict:
  """Restore onto the shapes and dtypes of `like`, as host (numpy) arrays.

  Orbax hands back arrays committed to a device; the rest of the engine's arrays are not, and
  jit keys its compiles on that: a committed draft or head would give every step it feeds (and,
  through the donated KV cache, every later step) a second compile after warmup."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path}: no orbax checkpoint there")
  ck = ocp.StandardCheckpointer()
  restored = ck.restore(os.path.abspath(path), jax.tree.map(ocp.utils.to_shape_dtype_struct, like))
  return jax.tree.map(np.asarray, restored)
