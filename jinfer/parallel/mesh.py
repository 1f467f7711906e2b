"""Parallel sizes (vLLM's vocabulary) and the device mesh one engine runs on.

One engine's mesh has two named axes: `context` (CP: a sequence's KV pages and a step's query rows
spread over it) and `tensor` (TP: heads, MLP columns and the vocabulary split over it; with expert
parallelism, the experts). Data parallelism is not a mesh axis: each DP rank is its own engine
with its own page pool and scheduler on its own devices (`jinfer/engine/data_parallel.py`).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jinfer.errors import ParameterError

AXES = ("context", "tensor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
  tensor_parallel_size: int = 1  # split heads, MLP and vocabulary over this many devices
  # Spread each sequence's KV pages and each step's query rows over this many devices (ring
  # attention; a power of two).
  context_parallel_size: int = 1
  data_parallel_size: int = 1  # engines, each with its own page pool, behind one front end
  # MoE: whole experts per tensor-parallel device instead of each expert split over them.
  enable_expert_parallel: bool = False
  # How a step's query rows are laid over the context ranks: "zigzag" (2*CP chunks, rank r holds
  # chunks r and 2*CP-1-r: equal causal work when one long prompt dominates) or "plain".
  context_layout: str = "zigzag"

  def __post_init__(self):
    for name in ("tensor_parallel_size", "context_parallel_size", "data_parallel_size"):
      if getattr(self, name) < 1:
        raise ParameterError(name, f"{name} must be >= 1, got {getattr(self, name)}")
    cp = self.context_parallel_size
    if cp & (cp - 1):
      raise ParameterError("context_parallel_size",
                           f"context_parallel_size must be a power of two, got {cp}")
    if self.context_layout not in ("zigzag", "plain"):
      raise ParameterError("context_layout", f"context_layout must be 'zigzag' or 'plain', got "
                                             f"{self.context_layout!r}")

  @property
  def devices_per_engine(self) -> int:
    return self.tensor_parallel_size * self.context_parallel_size

  @property
  def world_size(self) -> int:
    return self.devices_per_engine * self.data_parallel_size

  @property
  def is_parallel(self) -> bool:
    return self.devices_per_engine > 1


def make_mesh(config: ParallelConfig, devices: list | None = None) -> Mesh:
  """A `(context, tensor)` mesh over `devices` (default: the first CP*TP of `jax.devices()`)."""
  n = config.devices_per_engine
  devices = jax.devices() if devices is None else list(devices)
  if len(devices) < n:
    raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} x "
                     f"context_parallel_size={config.context_parallel_size} needs {n} devices; "
                     f"{len(devices)} are available")
  grid = np.asarray(devices[:n]).reshape(config.context_parallel_size,
                                          config.tensor_parallel_size)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 2)


def data_parallel_devices(config: ParallelConfig) -> list[list]:
  """The devices of each DP rank's engine, in order."""
  devices = jax.devices()
  if len(devices) < config.world_size:
    raise ValueError(f"{config.data_parallel_size} data-parallel ranks of "
                     f"{config.devices_per_engine} devices need {config.world_size} devices; "
                     f"{len(devices)} are available")
  n = config.devices_per_engine
  return [devices[i * n:(i + 1) * n] for i in range(config.data_parallel_size)]
