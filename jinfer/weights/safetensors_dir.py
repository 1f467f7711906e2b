"""HF safetensors directories: a single model.safetensors or a sharded index."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jinfer.config import ModelConfig
from jinfer.weights.hf_layout import WeightError, hf_to_params


def _tensor_files(path: str) -> dict[str, str]:
  """Map tensor name -> file holding it."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    try:
      with open(index) as fh:
        weight_map = json.load(fh)["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise WeightError(f"{index}: malformed safetensors index ({e})") from None
    return {name: os.path.join(path, f) for name, f in weight_map.items()}
  files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise WeightError(f"{path}: no .safetensors files")
  names: dict[str, str] = {}
  for f in files:
    full = os.path.join(path, f)
    with _open(full) as st:
      names.update({k: full for k in st.keys()})
  return names


def _open(file: str):
  try:
    # The "flax" framework reads bfloat16, which plain numpy cannot represent.
    return safe_open(file, framework="flax")
  except FileNotFoundError:
    raise WeightError(f"{file}: file listed in the index does not exist") from None
  except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
    raise WeightError(f"{file}: unreadable safetensors file ({e})") from None


def _text_stack_names(name: str) -> tuple[str, ...]:
  """Where a multimodal checkpoint (Gemma-3) keeps the text model's `model.X`: transformers 5
  saves `model.language_model.X`, older files `language_model.model.X`."""
  rest = name.removeprefix("model.")
  return (f"model.language_model.{rest}", f"language_model.model.{rest}")


def load_safetensors_dir(path: str, config: ModelConfig, dtype=jnp.float32) -> dict:
  files = _tensor_files(path)
  handles: dict[str, object] = {}

  def get(name: str) -> np.ndarray:
    if name not in files and name.startswith("model."):  # a multimodal checkpoint's text stack
      name = next((n for n in _text_stack_names(name) if n in files), name)
    file = files[name]  # KeyError -> "missing tensor"
    if file not in handles:
      handles[file] = _open(file)
    try:
      with jax.default_device(jax.local_devices(backend="cpu")[0]):  # on the host until placed
        return np.asarray(handles[file].get_tensor(name))
    except Exception as e:
      raise WeightError(f"{file}: cannot read tensor {name!r} ({e})") from None

  return hf_to_params(config, get, dtype=dtype, source=path)
