"""Save and restore jinfer params (and artifacts jinfer makes) as orbax checkpoints."""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


def save_params(path: str, params: dict) -> None:
  ck = ocp.StandardCheckpointer()
  ck.save(os.path.abspath(path), params)
  ck.wait_until_finished()


def restore_params(path: str, like: dict) -> dict:
  """Restore onto the shapes, dtypes (and shardings, if any) of `like`."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path}: no orbax checkpoint there")
  ck = ocp.StandardCheckpointer()
  return ck.restore(os.path.abspath(path), jax.tree.map(ocp.utils.to_shape_dtype_struct, like))
