"""Grouped matmul: rows sorted by group, each group multiplied by its own weights. The MoE
expert computation: one call per projection for every expert's tokens, none dropped.

One entry point, implementations chosen by `backend`:

  ragged_dot  `jax.lax.ragged_dot`: the oracle
  xla         batched blocks or a loop over the non-empty groups; what runs on the CPU (see
              xla.py for why)
  pallas_tpu  Mosaic TPU kernel
  pallas_gpu  Triton GPU kernel over work items of 16-64 rows of one group (see pallas_gpu.py)

int8 weights come with one float scale per group and output channel: W8A16 (activations stay
float) or W8A8 (activations quantized per token, int32 accumulation), as in `int8_matmul`.

Group-wise quantized weights (`quant_group_size` given; the format of
`groupwise_matmul/packing.py`, per expert): int4 packed [G, K/2, N] uint8 (`bits=4`) or int8
[G, K, N] (`bits=8`), with a scale and an offset per expert, group of `quant_group_size` rows
and output channel, [G, K/quant_group_size, N]. Activations stay float. Every backend takes
them: ragged_dot dequantizes every expert (the oracle), xla one visited expert at a time, and
the Pallas kernels read the packed tiles themselves (unpacked and dequantized in VMEM on TPU,
in registers on GPU, f32 accumulation; the TPU kernel's `block_k` must be a multiple of
`quant_group_size`, the GPU kernel's quant group size a power of two).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.pallas_gpu import grouped_matmul_gpu
from pallas_kernels.grouped_matmul.pallas_tpu import grouped_matmul_tpu
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference
from pallas_kernels.grouped_matmul.xla import grouped_matmul_xla
from pallas_kernels.groupwise_matmul.packing import BITS

_IMPLS = {
    "ragged_dot": grouped_matmul_reference,
    "xla": grouped_matmul_xla,
    "pallas_tpu": grouped_matmul_tpu,
    "pallas_gpu": grouped_matmul_gpu,
}
BACKENDS = tuple(_IMPLS)
MODES = ("w8a16", "w8a8")

__all__ = ["BACKENDS", "MODES", "default_backend", "grouped_matmul"]


def default_backend() -> str:
  return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "xla")


def grouped_matmul(
    lhs: jax.Array,  # [M, K] float
    rhs: jax.Array,  # [G, K, N] float, or int8 with `scale`
    group_sizes: jax.Array,  # [G] int32
    scale: jax.Array | None = None,  # [G, N]: per group and output channel, for int8 rhs
    offset: jax.Array | None = None,  # [G, K/qg, N], with scale [G, K/qg, N]: group-wise
    *,
    bits: int = 8,
    quant_group_size: int | None = None,
    mode: str = "w8a16",
    backend: str = "ragged_dot",
    interpret: Any = False,
    **block_sizes: int,
) -> jax.Array:  # [M, N] lhs.dtype
  """Row r of group g (rows `sum(group_sizes[:g])` up to `sum(group_sizes[:g+1])`) times
  `rhs[g]`; rows past `sum(group_sizes)` come out zero. Empty groups cost nothing.

  `quant_group_size` (qg) makes rhs group-wise quantized (see above): `bits` 4 (packed) or 8,
  `scale` and `offset` per expert, row group and output channel.

  `mode` applies to per-channel int8 rhs only. `interpret` runs the Pallas backends in
  interpret mode (True, or `pltpu.InterpretParams` for pallas_tpu) so they work on the CPU; the
  XLA backends run anywhere and ignore it. `block_sizes` go to the implementation (block_m for
  xla; block_m, block_n, block_k for pallas_tpu; those and num_warps, num_stages for
  pallas_gpu).
  """
  if backend not in _IMPLS:
    raise ValueError(f"unknown grouped matmul backend {backend!r}; choose one of {BACKENDS}")
  if mode not in MODES:
    raise ValueError(f"unknown grouped matmul mode {mode!r}; choose one of {MODES}")
  if quant_group_size is not None:
    _check_groupwise(lhs, rhs, group_sizes, scale, offset, bits, quant_group_size, mode)
    block_k = block_sizes.get("block_k")
    if backend == "pallas_tpu" and block_k is not None and (
        not isinstance(block_k, int) or block_k <= 0 or block_k % quant_group_size):
      raise ValueError(f"block_k must be a positive multiple of quant_group_size="
                       f"{quant_group_size} (a K tile holds whole quant groups), got {block_k!r}")
  else:
    if offset is not None:
      raise ValueError("an offset comes with group-wise weights: pass quant_group_size")
    if (lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]
        or group_sizes.shape != rhs.shape[:1]):
      raise ValueError(f"shapes do not match: lhs {lhs.shape}, rhs {rhs.shape}, "
                       f"group_sizes {group_sizes.shape}")
    if (rhs.dtype == jnp.int8) != (scale is not None):
      raise ValueError("int8 weights need a scale, and float weights take none")
    if scale is not None and scale.shape != (rhs.shape[0], rhs.shape[2]):
      raise ValueError(f"scale has shape {scale.shape}, expected {(rhs.shape[0], rhs.shape[2])}")
  kw = dict(mode=mode, **block_sizes)
  if quant_group_size is not None:
    kw.update(offset=offset, bits=bits, quant_group_size=quant_group_size)
  if backend.startswith("pallas"):
    kw["interpret"] = interpret
  return _IMPLS[backend](lhs, rhs, group_sizes.astype(jnp.int32), scale, **kw)


def _check_groupwise(lhs, rhs, group_sizes, scale, offset, bits: int, qg: int,
                     mode: str) -> None:
  if mode != "w8a16":
    raise ValueError(f"group-wise weights keep activations float; mode {mode!r} does not apply")
  if bits not in BITS:
    raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be [M, K], got {lhs.shape}")
  k = lhs.shape[1]
  if not isinstance(qg, int) or qg <= 0 or qg % 2 or k % qg:
    raise ValueError(f"quant_group_size must be a positive even int dividing K={k}, got {qg!r}")
  want_dtype, k_rows = (jnp.uint8, k // 2) if bits == 4 else (jnp.int8, k)
  if rhs.ndim != 3 or rhs.shape[1] != k_rows or rhs.dtype != want_dtype:
    raise ValueError(f"{bits}-bit rhs must be [G, {k_rows}, N] {jnp.dtype(want_dtype).name} for "
                     f"K={k}, got {rhs.dtype} {rhs.shape}")
  if group_sizes.shape != rhs.shape[:1]:
    raise ValueError(f"group_sizes has shape {group_sizes.shape}, expected {rhs.shape[:1]}")
  want = (rhs.shape[0], k // qg, rhs.shape[2])
  for name, a in (("scale", scale), ("offset", offset)):
    if a is None or a.shape != want:
      raise ValueError(f"group-wise {name} must be [G, K/quant_group_size, N] = {list(want)}, "
                       f"got {None if a is None else list(a.shape)}")
