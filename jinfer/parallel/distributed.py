"""Several processes (one per host) driving one mesh, with `jax.distributed`.

Process 0 leads: it schedules, and before each step broadcasts the step's input to the others,
which run the same jitted step on their devices (`ModelRunner.follow`). Every process loads the
same weights; each puts only its own devices' shards. The step's outputs come back replicated,
so the leader reads the sampled tokens without gathering.

A peer that dies is noticed by the coordination service's heartbeat: within
`heartbeat_timeout_s` the survivors stop with an error naming the lost task instead of waiting
in a collective forever.
"""
from __future__ import annotations

import dataclasses
import json
import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
  coordinator_address: str | None = None  # "host:port" of process 0; None: one process
  num_processes: int = 1
  process_id: int = 0
  initialization_timeout_s: int = 120  # waiting for every process to join
  heartbeat_timeout_s: int = 30  # a silent peer is declared dead after this

  def __post_init__(self):
    if self.num_processes < 1:
      raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
    if not 0 <= self.process_id < self.num_processes:
      raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")
    if self.num_processes > 1 and not self.coordinator_address:
      raise ValueError("several processes need coordinator_address (host:port of process 0)")

  @property
  def is_leader(self) -> bool:
    return self.process_id == 0


def initialize(config: DistributedConfig) -> None:
  """Join the processes into one JAX runtime (once; before anything touches a device)."""
  if config.num_processes == 1 or jax.distributed.is_initialized():
    return
  # The CPU backend's cross-process collectives (accelerators bring their own).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  log.info("joining %d processes at %s as process %d ...", config.num_processes,
           config.coordinator_address, config.process_id)
  jax.distributed.initialize(config.coordinator_address, config.num_processes,
                             config.process_id,
                             initialization_timeout=config.initialization_timeout_s,
                             heartbeat_timeout_seconds=config.heartbeat_timeout_s)


def broadcast(tree, is_source: bool):
  """`tree` (numpy leaves) from process 0 to all; the others pass a same-shaped template."""
  return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree, is_source))


def broadcast_json(value=None, is_source: bool = False, max_bytes: int = 4096):
  """A small JSON value from process 0 to all (every process calls it; the others pass None)."""
  buf = np.zeros(max_bytes + 4, np.uint8)
  if is_source:
    data = json.dumps(value).encode()
    if len(data) > max_bytes:
      raise ValueError(f"{len(data)} bytes to broadcast; at most {max_bytes}")
    buf[:4] = np.frombuffer(np.uint32(len(data)).tobytes(), np.uint8)
    buf[4:4 + len(data)] = np.frombuffer(data, np.uint8)
  buf = broadcast(buf, is_source)
  n = int(np.frombuffer(buf[:4].tobytes(), np.uint32)[0])
  return json.loads(buf[4:4 + n].tobytes())
