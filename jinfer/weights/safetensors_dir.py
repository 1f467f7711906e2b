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


class TensorFiles:
  """The tensors of an HF safetensors directory by name: their headers (shape and safetensors
  dtype, no data read) and their values on the host, each file opened once."""

  def __init__(self, path: str):
    self.files = _tensor_files(path)  # tensor name -> the file holding it
    self._handles: dict[str, object] = {}

  def _handle(self, name: str):
    file = self.files[name]
    if file not in self._handles:
      self._handles[file] = _open(file)
    return self._handles[file]

  def header(self, name: str) -> tuple[tuple[int, ...], str]:
    sl = self._handle(name).get_slice(name)
    return tuple(sl.get_shape()), sl.get_dtype()

  def read(self, name: str) -> np.ndarray:
    try:
      if self.header(name)[1] == "F8_E4M3":  # safetensors' numpy and flax readers lack float8
        return _raw_float8(self.files[name], name)
      with jax.default_device(jax.local_devices(backend="cpu")[0]):  # on the host until placed
        return np.asarray(self._handle(name).get_tensor(name))
    except Exception as e:
      raise WeightError(f"{self.files[name]}: cannot read tensor {name!r} ({e})") from None


def _raw_float8(file: str, name: str) -> np.ndarray:
  """A float8_e4m3fn tensor's bytes as laid out in the file: an 8-byte header length, the JSON
  header, then the data (safetensors' format)."""
  with open(file, "rb") as fh:
    size = int.from_bytes(fh.read(8), "little")
    entry = json.loads(fh.read(size))[name]
    start, end = entry["data_offsets"]
    fh.seek(8 + size + start)
    return np.frombuffer(fh.read(end - start), jnp.float8_e4m3fn).reshape(entry["shape"])


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
