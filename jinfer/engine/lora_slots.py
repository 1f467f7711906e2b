"""LoRA adapters in an engine: which are known, which sit in host memory, which hold a device slot.

`LoRARequest(name, int_id, path)` (vLLM's) names a PEFT adapter directory. The engine keeps
`max_loras` device slots (`jinfer/models/lora.py`) and a host cache of `max_cpu_loras` loaded
adapters, both least recently used first out. A sequence takes its adapter's slot when the
scheduler admits it (loading the adapter there if it is not resident, into a free slot or the
least recently used idle one) and lets go when it finishes or is preempted; a sequence whose
adapter finds every slot in use by running sequences waits, and the others go ahead. Writing a
slot is a donated update of fixed shape: adapters come and go without a compile.

`update` replaces a registered adapter's weights in place (a trainer's new LoRA): checked
whole before anything changes, written to its slot if it holds one, and kept in host memory for
good (its files no longer describe it); its version goes up, which the engine's prefix-cache
salt carries, so K/V computed under the old weights is never reused under the new.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable

import numpy as np

from jinfer.config import ModelConfig
from jinfer.errors import ParameterError
from jinfer.weights.peft_adapter import LoraAdapter, load_peft_adapter, replace_tensors


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
  enable_lora: bool = False  # serve LoRA adapters (`lora_request=` per prompt)
  max_loras: int = 1  # adapters on device at once: the distinct adapters one step can mix
  max_lora_rank: int = 16  # the largest adapter rank (r) accepted; slots are this wide
  max_cpu_loras: int | None = None  # adapters kept loaded in host memory (default max_loras)

  def __post_init__(self):
    for name in ("max_loras", "max_lora_rank"):
      if getattr(self, name) < 1:
        raise ParameterError(name, f"{name} must be >= 1, got {getattr(self, name)}")
    if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
      raise ParameterError("max_cpu_loras", f"max_cpu_loras ({self.max_cpu_loras}) must be at "
                           f"least max_loras ({self.max_loras})")

  @property
  def host_capacity(self) -> int:
    return self.max_cpu_loras or self.max_loras


@dataclasses.dataclass(frozen=True)
class LoRARequest:
  """An adapter for a request: `lora_name` (what the server's `model` field says),
  `lora_int_id` (>= 1, unique per adapter), `lora_path` (a PEFT directory)."""
  lora_name: str
  lora_int_id: int
  lora_path: str = ""

  def __post_init__(self):
    if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
      raise ParameterError("lora_request", f"lora_int_id must be an integer >= 1, got "
                           f"{self.lora_int_id!r}")
    if not self.lora_path:
      raise ParameterError("lora_request", f"adapter {self.lora_name!r} has no lora_path")


class AdapterSlots:
  """Host bookkeeping of the adapters and the device slots. `write(slot, adapter)` puts an
  adapter's weights (or None: zeros) in device slot `slot`."""

  def __init__(self, config: LoRAConfig, model_config: ModelConfig,
               write: Callable[[int, LoraAdapter], None]):
    self.config, self.model_config, self._write = config, model_config, write
    self.known: dict[int, LoRARequest] = {}  # by lora_int_id
    self._host: collections.OrderedDict[int, LoraAdapter] = collections.OrderedDict()
    self.owner: list[int | None] = [None] * config.max_loras  # slot -> lora_int_id
    self.refs = [0] * config.max_loras  # running sequences per slot
    self._idle: collections.OrderedDict[int, None] = collections.OrderedDict(
        (s, None) for s in range(config.max_loras))  # slots nobody uses, least recent first
    self.loads = 0  # slot writes so far
    self.versions: dict[int, int] = {}  # by lora_int_id: updates so far (0: as its files say)
    self._pinned: set[int] = set()  # updated adapters: no file holds their weights any more
    self._lock = threading.Lock()  # the server registers adapters while steps run

  def register(self, request: LoRARequest) -> LoraAdapter:
    """Check and load `request`'s adapter into the host cache (raises ParameterError, before
    anything is queued); the same id must keep its name and path."""
    with self._lock:
      old = self.known.get(request.lora_int_id)
      if old is not None and (old.lora_name, old.lora_path) != (request.lora_name,
                                                                  request.lora_path):
        raise ParameterError("lora_request", f"lora_int_id {request.lora_int_id} is adapter "
                             f"{old.lora_name!r} ({old.lora_path}), not {request.lora_name!r} "
                             f"({request.lora_path})")
      adapter = self._host.get(request.lora_int_id)
      if adapter is None:
        adapter = load_peft_adapter(request.lora_path, self.model_config,
                                    max_rank=self.config.max_lora_rank)
      self.known[request.lora_int_id] = request
      self._keep(request.lora_int_id, adapter)
      return adapter

  def unregister(self, lora_int_id: int) -> None:
    """Forget an adapter: its host copy now, its slot once no sequence uses it."""
    with self._lock:
      self.known.pop(lora_int_id, None)
      self._host.pop(lora_int_id, None)
      self._pinned.discard(lora_int_id)
      self.versions.pop(lora_int_id, None)
      for slot, owner in enumerate(self.owner):
        if owner == lora_int_id and not self.refs[slot]:
          self.owner[slot] = None
          self._idle.move_to_end(slot, last=False)  # the first to be taken

  def _keep(self, lora_int_id: int, adapter: LoraAdapter) -> None:
    self._host[lora_int_id] = adapter
    self._host.move_to_end(lora_int_id)
    while len(self._host) > self.config.host_capacity:
      # The least recent adapter that its path can give back if asked for again.
      victim = next((i for i in self._host if i not in self._pinned), None)
      if victim is None:
        break
      del self._host[victim]

  def find(self, name_or_id: str | int) -> LoRARequest:
    """A registered adapter by `lora_name` or `lora_int_id`; ParameterError if none."""
    request = (self.known.get(name_or_id) if isinstance(name_or_id, int) else
               next((r for r in self.known.values() if r.lora_name == name_or_id), None))
    if request is None:
      raise ParameterError("lora", f"no adapter {name_or_id!r} is registered (known: "
                           f"{sorted(r.lora_name for r in self.known.values())}); add_lora "
                           f"first")
    return request

  def update(self, name_or_id: str | int, tensors: dict) -> LoRARequest:
    """Replace a registered adapter's weights (`peft_adapter.replace_tensors`' forms): checked
    in full first, so a bad tensor raises (AdapterError naming it) and leaves the old weights
    in place; then its host copy, its device slot if it holds one, and its version."""
    with self._lock:
      request = self.find(name_or_id)
      i = request.lora_int_id
      current = self._host.get(i) or load_peft_adapter(request.lora_path, self.model_config,
                                                       max_rank=self.config.max_lora_rank)
      adapter = replace_tensors(current, self.model_config, tensors)
      self._pinned.add(i)
      self._keep(i, adapter)
      slot = self.resident(i)
      if slot is not None:
        self._write(slot, adapter)
        self.loads += 1
      self.versions[i] = self.versions.get(i, 0) + 1
      return request

  def resident(self, lora_int_id: int) -> int | None:
    return next((s for s, o in enumerate(self.owner) if o == lora_int_id), None)

  def acquire(self, request: LoRARequest) -> int | None:
    """The device slot holding this adapter, loading it into one if needed (from the host
    cache, or its files: it may have been unregistered while its request waited); None when
    every slot is held by running sequences (the caller waits)."""
    lora_int_id = request.lora_int_id
    with self._lock:
      slot = self.resident(lora_int_id)
      if slot is None:
        if not self._idle:
          return None
        slot = next(iter(self._idle))
        adapter = self._host.get(lora_int_id) or load_peft_adapter(
            request.lora_path, self.model_config, max_rank=self.config.max_lora_rank)
        self._keep(lora_int_id, adapter)
        self._write(slot, adapter)
        self.owner[slot] = lora_int_id
        self.loads += 1
      self.refs[slot] += 1
      self._idle.pop(slot, None)
      return slot

  def release(self, slot: int) -> None:
    with self._lock:
      self.refs[slot] -= 1
      assert self.refs[slot] >= 0, f"slot {slot} released more often than acquired"
      if not self.refs[slot]:
        self._idle[slot] = None  # most recently used: the last to be taken
        if self.owner[slot] not in self.known:  # unregistered meanwhile
          self.owner[slot] = None
          self._idle.move_to_end(slot, last=False)

  @property
  def slots_in_use(self) -> int:
    return sum(r > 0 for r in self.refs)

  def host_ids(self) -> list[int]:
    return list(self._host)


def pad_adapter(adapter: LoraAdapter | None, targets: dict, max_rank: int, *, head_dim: int,
                kv_repeat: int = 1, dtype=np.float32) -> dict:
  """An adapter's weights as a device slot holds them: for every target of the model
  (`{path: (L, K, N)}`) `a [L, K, max_rank]`, `b [L, max_rank, N]`, zeros where the adapter has
  no such module or a smaller rank. `kv_repeat`: KV heads duplicated for tensor parallelism
  (k/v projections' columns repeated as `duplicate_kv_heads` repeats their kernels)."""
  out: dict = {}
  for path, (layers, k, n) in targets.items():
    a = np.zeros((layers, k, max_rank), dtype)
    b = np.zeros((layers, max_rank, n), dtype)
    have = None if adapter is None else adapter.weights.get(path)
    if have is not None:
      wa, wb = have
      r = wa.shape[-1]
      if kv_repeat > 1 and path[-1] in ("k_proj", "v_proj"):
        wb = np.repeat(wb.reshape(layers, r, -1, head_dim), kv_repeat, axis=2).reshape(
            layers, r, n)
      a[..., :r], b[:, :r] = wa, wb
    node = out
    for part in path:
      node = node.setdefault(part, {})
    node["a"], node["b"] = a, b
  return out
