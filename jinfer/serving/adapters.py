"""The LoRA adapters a server serves by name (vLLM's `--lora-modules`, the request's `model`
field, `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`).

Adapters named at startup are checked and loaded before the server answers. At run time, with
`allow_runtime_lora_updating`, clients may load more, but only from directories under the
allowed roots (by default those holding the startup adapters, and the shipped adapters'
folder): a path is resolved (symlinks, `..`) before it is compared, so a client cannot make the
server read any other file. Unloading removes the name at once; requests already running on the
adapter finish on it (its device slot is freed after them).
"""
from __future__ import annotations

import itertools
import json
import os
import threading

from jinfer.engine.async_engine import AsyncLLMEngine
from jinfer.engine.lora_slots import LoRARequest
from jinfer.serving.errors import APIError
from jinfer.weights.builtin import CHECKPOINTS_DIR, resolve_adapter


def parse_lora_modules(specs) -> tuple[tuple[str, str], ...]:
  """`name=path` strings (or vLLM's JSON objects `{"name": ..., "path": ...}`) -> pairs."""
  out = []
  for spec in specs:
    if spec.lstrip().startswith("{"):
      try:
        d = json.loads(spec)
        out.append((str(d["name"]), str(d["path"])))
      except (ValueError, KeyError, TypeError):
        raise ValueError(f"--lora-modules {spec!r}: a JSON module needs \"name\" and \"path\"")
      continue
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
      raise ValueError(f"--lora-modules {spec!r}: expected NAME=PATH")
    out.append((name, path))
  return tuple(out)


class ServedAdapters:
  def __init__(self, engine: AsyncLLMEngine, base_name: str, modules=(), *,
               allowed_roots=(), allow_runtime_updating: bool = False):
    self.engine, self.base_name = engine, base_name
    self.allow_runtime_updating = allow_runtime_updating
    self._lock = threading.Lock()
    self._by_name: dict[str, LoRARequest] = {}
    self._ids = itertools.count(1)
    if (modules or allow_runtime_updating) and not engine.engine.config.lora.enable_lora:
      raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    paths = []
    for name, path in modules:
      try:
        paths.append(self._add(name, os.path.realpath(resolve_adapter(path))).lora_path)
      except (APIError, ValueError) as e:
        raise ValueError(f"--lora-modules {name}={path}: {e}") from None
    roots = allowed_roots or [os.path.dirname(p) for p in paths] + [CHECKPOINTS_DIR]
    self.allowed_roots = tuple(dict.fromkeys(os.path.realpath(r) for r in roots))

  def _add(self, name: str, path: str) -> LoRARequest:
    """Check and load the adapter (on the caller's thread); raises APIError or ValueError."""
    if name == self.base_name:
      raise APIError(400, f"{name!r} is the base model's name", param="lora_name")
    with self._lock:
      if name in self._by_name:
        raise APIError(400, f"the adapter {name!r} is already loaded", param="lora_name")
      request = LoRARequest(name, next(self._ids), path)
    self.engine.engine.add_lora(request)  # reads and checks the files: ParameterError
    with self._lock:
      if name in self._by_name:  # loaded twice at once: the first one wins
        self.engine.engine.remove_lora(request.lora_int_id)
        raise APIError(400, f"the adapter {name!r} is already loaded", param="lora_name")
      self._by_name[name] = request
    return request

  def lookup(self, model: str) -> LoRARequest | None:
    """The request's `model` field -> its adapter (None: the base model); 404 if neither."""
    if model == self.base_name:
      return None
    with self._lock:
      request = self._by_name.get(model)
    if request is None:
      raise APIError(404, f"The model `{model}` does not exist.", param="model",
                     code="model_not_found")
    return request

  def served(self) -> list[LoRARequest]:
    with self._lock:
      return list(self._by_name.values())

  def check_runtime(self):
    if not self.allow_runtime_updating:
      raise APIError(404, "loading and unloading LoRA adapters at run time is off: start the "
                          "server with --allow-runtime-lora-updating")

  def load(self, name: str, path: str) -> LoRARequest:
    """A client's load: the path must resolve under an allowed root."""
    self.check_runtime()
    real = os.path.realpath(resolve_adapter(path))
    if not any(os.path.commonpath([real, root]) == root for root in self.allowed_roots):
      raise APIError(403, f"lora_path {path!r} is outside the directories this server loads "
                          f"adapters from (--lora-allowed-roots)", param="lora_path")
    try:
      return self._add(name, real)
    except ValueError as e:  # the adapter's own check: the field at fault is in the message
      raise APIError(400, str(e), param="lora_path") from None

  def unload(self, name: str) -> None:
    self.check_runtime()
    with self._lock:
      request = self._by_name.pop(name, None)
    if request is None:
      raise APIError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name")
    self.engine.engine.remove_lora(request.lora_int_id)
