"""Grouped matmul: rows sorted by group, each group multiplied by its own weights. The MoE
expert computation: one call per projection for every expert's tokens, none dropped.

One entry point, implementations chosen by `backend`:

  ragged_dot  `jax.lax.ragged_dot`: the oracle, and the GPU path
  xla         batched blocks or a loop over the non-empty groups; what runs on the CPU (see
              xla.py for why)
  pallas_tpu  Mosaic TPU kernel

int8 weights come with one float scale per group and output channel: W8A16 (activations stay
float) or W8A8 (activations quantized per token, int32 accumulation), as in `int8_matmul`.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.pallas_tpu import grouped_matmul_tpu
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference
from pallas_kernels.grouped_matmul.xla import grouped_matmul_xla

_IMPLS = {
    "ragged_dot": grouped_matmul_reference,
    "xla": grouped_matmul_xla,
    "pallas_tpu": grouped_matmul_tpu,
}
BACKENDS = tuple(_IMPLS)
MODES = ("w8a16", "w8a8")

__all__ = ["BACKENDS", "MODES", "default_backend", "grouped_matmul"]


def default_backend() -> str:
  return {"tpu": "pallas_tpu", "gpu": "ragged_dot"}.get(jax.default_backend(), "xla")


def grouped_matmul(
    lhs: jax.Array,  # [M, K] float
    rhs: jax.Array,  # [G, K, N] float, or int8 with `scale`
    group_sizes: jax.Array,  # [G] int32
    scale: jax.Array | None = None,  # [G, N]: per group and output channel, for int8 rhs
    *,
    mode: str = "w8a16",
    backend: str = "ragged_dot",
    interpret: Any = False,
    **block_sizes: int,
) -> jax.Array:  # [M, N] lhs.dtype
  """Row r of group g (rows `sum(group_sizes[:g])` up to `sum(group_sizes[:g+1])`) times
  `rhs[g]`; rows past `sum(group_sizes)` come out zero. Empty groups cost nothing.

  `mode` applies to int8 rhs only. `interpret` runs the Pallas backend in interpret mode (True,
  or `pltpu.InterpretParams`) so it works on the CPU; the XLA backends run anywhere and ignore
  it. `block_sizes` go to the implementation (block_m for xla; block_m, block_n, block_k for
  pallas_tpu).
  """
  if backend not in _IMPLS:
    raise ValueError(f"unknown grouped matmul backend {backend!r}; choose one of {BACKENDS}")
  if mode not in MODES:
    raise ValueError(f"unknown grouped matmul mode {mode!r}; choose one of {MODES}")
  if (lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]
      or group_sizes.shape != rhs.shape[:1]):
    raise ValueError(f"shapes do not match: lhs {lhs.shape}, rhs {rhs.shape}, "
                     f"group_sizes {group_sizes.shape}")
  if (rhs.dtype == jnp.int8) != (scale is not None):
    raise ValueError("int8 weights need a scale, and float weights take none")
  if scale is not None and scale.shape != (rhs.shape[0], rhs.shape[2]):
    raise ValueError(f"scale has shape {scale.shape}, expected {(rhs.shape[0], rhs.shape[2])}")
  kw = dict(mode=mode, **block_sizes)
  if backend == "pallas_tpu":
    kw["interpret"] = interpret
  return _IMPLS[backend](lhs, rhs, group_sizes.astype(jnp.int32), scale, **kw)
