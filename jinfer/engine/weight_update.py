"""New weights for a running engine (`LLMEngine.update_weights` and `load_weights`): checked
against the model's params before anything is written, and cast to the dtypes the engine's
compiled steps were built for, so that they run the new weights unchanged.

Two spellings: jinfer's own params tree (what a JAX trainer of this model holds: the stacked
layout of `jinfer.models`), or tensors by their HF names (what any trainer can name), which go
through the one HF name mapping every loader uses (`jinfer.weights.hf_layout`).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.config import ModelConfig
from jinfer.errors import ParameterError
from jinfer.weights.hf_layout import WeightError, hf_to_params

SOURCE = "load_weights"  # how load_weights' errors name where the tensors came from


def _floating(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def checked(params: Any, expected: dict) -> dict:
  """`params` (jinfer's params tree) in `expected`'s structure, each leaf cast to the dtype of
  its `expected` ShapeDtypeStruct (an array of that dtype already is kept as it is, not
  copied). A ParameterError names the first leaf that is missing, not the model's, of another
  shape, or not floating point; none is cast before every one is checked."""
  if not isinstance(params, Mapping):
    raise ParameterError("params", f"params: expected jinfer's params tree (a dict), got "
                                   f"{type(params).__name__}")
  want, treedef = jax.tree_util.tree_flatten_with_path(expected)
  got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  name = lambda path: "params" + jax.tree_util.keystr(path)
  wanted = {path for path, _ in want}
  for path in got:
    if path not in wanted:
      raise ParameterError("params", f"{name(path)} is not a parameter of this model")
  for path, spec in want:
    if path not in got:
      raise ParameterError("params", f"{name(path)} is missing (shape {spec.shape})")
    leaf = got[path]
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
      raise ParameterError("params", f"{name(path)}: expected an array, got "
                                     f"{type(leaf).__name__}")
    if tuple(shape) != spec.shape:
      raise ParameterError("params", f"{name(path)} has shape {tuple(shape)}, expected "
                                     f"{spec.shape}")
    if not _floating(dtype):
      raise ParameterError("params", f"{name(path)} has dtype {dtype}, expected a floating-point "
                                     f"one (it is cast to the engine's {spec.dtype})")
  cast = lambda leaf, spec: (leaf if leaf.dtype == spec.dtype and not getattr(
      leaf, "weak_type", False) else leaf.astype(spec.dtype))
  return jax.tree_util.tree_unflatten(treedef, [cast(got[path], spec) for path, spec in want])


def from_hf(config: ModelConfig, named_arrays: Mapping[str, Any] | Iterable[tuple[str, Any]],
            dtype) -> dict:
  """jinfer's params tree from every tensor of the model by its HF name (transformers' names
  and layouts, `[out, in]` kernels; numpy or JAX arrays). A WeightError names a tensor that is
  missing, misshapen, not floating point, or that maps to no parameter of the model. A tied
  model's `lm_head.weight` may come along if it equals `model.embed_tokens.weight` (a PyTorch
  `state_dict` holds both)."""
  tensors = dict(named_arrays)
  used: set[str] = set()

  def get(name: str) -> np.ndarray:
    arr = np.asarray(tensors[name])  # a KeyError is hf_to_params' "missing tensor"
    if not _floating(arr.dtype):
      raise WeightError(f"{SOURCE}: tensor {name!r} has dtype {arr.dtype}, expected a "
                        f"floating-point one")
    used.add(name)
    return arr

  params = hf_to_params(config, get, dtype=dtype, source=SOURCE)
  left = sorted(set(tensors) - used)
  if config.tie_word_embeddings and "lm_head.weight" in left:
    if not np.array_equal(np.asarray(tensors["lm_head.weight"]),
                          np.asarray(tensors["model.embed_tokens.weight"])):
      raise WeightError(f"{SOURCE}: 'lm_head.weight' differs from 'model.embed_tokens.weight', "
                        f"but this model ties them (tie_word_embeddings)")
    left.remove("lm_head.weight")
  if left:
    raise WeightError(f"{SOURCE}: {len(left)} tensor(s) map to no parameter of this model: "
                      f"{', '.join(map(repr, left[:5]))}{' ...' if len(left) > 5 else ''}")
  return params
