"""Calibrated quantizations kept on disk, so a model calibrates once per machine, not per load.

SmoothQuant W8A8, AWQ and GPTQ run the float model over the calibration text and fit the
weights: 15-50 s for SmolLM2 on 2 cores, hours for a large model. Their result is a pure function
of the float weights, the model's shapes, the quantization options, the calibration tokens and
the quantizers' code, so it is stored under a hash of all of them (`key`) in
`$JINFER_QUANTIZATION_CACHE_DIR`, else `<jinfer cache dir>/quantized`, in the format of
`jinfer/weights/quantized_checkpoint.py`. The next load with the same key reads it back instead
of calibrating; any change to one of the inputs (another checkpoint, an option, a quantizer's
source) is another key. Round-to-nearest quantizations take less time than hashing the weights
and are not cached. Mixed precision's sensitivities, which do not depend on its budget, are
kept beside them (`cached_array`), so another budget measures nothing again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from typing import Callable

import jax
import numpy as np

from jinfer.config import ModelConfig
from jinfer.weights.builtin import cache_dir
from jinfer.weights.quantized_checkpoint import (
    is_quantized_checkpoint, load_quantized, save_quantized)

log = logging.getLogger("jinfer")

# The code whose output is cached: a change to any of these files is a new key.
_SOURCES = ("quant", "models")


def directory() -> str:
  return (os.environ.get("JINFER_QUANTIZATION_CACHE_DIR")
          or os.path.join(cache_dir(), "quantized"))


def key(config: ModelConfig, params: dict, quantization: str, options: dict,
        calibration_tokens: list[int], store_transposed: bool) -> str:
  """A hash of everything a calibrated quantization depends on. Hashing SmolLM2's float32
  weights takes ~0.5 s."""
  h = hashlib.sha256()
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for package in _SOURCES:
    folder = os.path.join(here, package)
    for name in sorted(os.listdir(folder)):
      if name.endswith((".py", ".txt")):
        with open(os.path.join(folder, name), "rb") as fh:
          h.update(name.encode() + fh.read())
  h.update(json.dumps([repr(config), quantization, options, store_transposed],
                      sort_keys=True, default=str).encode())
  h.update(np.asarray(calibration_tokens, np.int64).tobytes())
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    a = np.asarray(leaf)
    h.update(f"{jax.tree_util.keystr(path)} {a.dtype} {a.shape}".encode())
    h.update(np.ascontiguousarray(a).data)
  return h.hexdigest()[:40]


def cached(k: str, quantization: str, options: dict, compute: Callable[[], dict]) -> dict:
  """The params stored under key `k`, else `compute()`'s, stored there for the next load. A
  cache that cannot be written (a read-only home) costs the next load a calibration, nothing
  else."""
  path = os.path.join(directory(), k)
  if is_quantized_checkpoint(path):
    t0 = time.monotonic()
    try:
      params = load_quantized(path)[1]
    except Exception as e:  # a damaged entry is computed again and replaced
      log.warning("quantization cache entry %s unreadable (%s); calibrating again", path, e)
    else:
      log.info("calibrated %s weights loaded from the quantization cache in %.1f s",
               quantization, time.monotonic() - t0)
      return params
  params = compute()
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    shutil.rmtree(path, ignore_errors=True)
    save_quantized(tmp, params, source="quantization cache", quantization=quantization,
                   quantization_config=options)
    os.replace(tmp, path)
  except OSError as e:
    log.warning("could not keep the calibrated weights in %s: %s", path, e)
    shutil.rmtree(tmp, ignore_errors=True)
  return params


def cached_array(k: str, compute: Callable[[], np.ndarray]) -> np.ndarray:
  """The array stored under key `k` (`<key>.npy`), else `compute()`'s, stored for the next run."""
  path = os.path.join(directory(), f"{k}.npy")
  if os.path.isfile(path):
    try:
      out = np.load(path)
    except (OSError, ValueError) as e:
      log.warning("quantization cache entry %s unreadable (%s); measuring again", path, e)
    else:
      log.info("sensitivities loaded from the quantization cache")
      return out
  out = compute()
  try:
    os.makedirs(directory(), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}.npy"
    np.save(tmp, out)
    os.replace(tmp, path)
  except OSError as e:
    log.warning("could not keep the sensitivities in %s: %s", path, e)
  return out
