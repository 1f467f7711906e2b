"""Group-wise quantized matmul: x @ w for w stored as `packing.py` defines it (int4 packed two
per byte per group, or int8, with a float32 scale and offset per group of K rows and output
channel; or the codebook form, 4-bit codes indexing a table of 16 values, times a scale per
group). One entry point, implementations chosen by `backend`:

  reference   dequantize the whole weight to f32, one f32 dot: the oracle
  xla         the CPU path (see xla.py for what was measured)
  pallas_tpu  Mosaic TPU kernel: packed tiles unpacked and dequantized in VMEM
  pallas_gpu  Triton kernel: the same in registers

All accumulate in float32 and return the activation dtype.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.groupwise_matmul.packing import (BITS, CODES, dequantize,
                                                    dequantize_codebook, pack_int4, unpack_int4)
from pallas_kernels.groupwise_matmul.pallas_gpu import groupwise_matmul_gpu
from pallas_kernels.groupwise_matmul.pallas_tpu import groupwise_matmul_tpu
from pallas_kernels.groupwise_matmul.reference import groupwise_matmul_reference
from pallas_kernels.groupwise_matmul.xla import groupwise_matmul_xla

_IMPLS = {
    "reference": groupwise_matmul_reference,
    "xla": groupwise_matmul_xla,
    "pallas_tpu": groupwise_matmul_tpu,
    "pallas_gpu": groupwise_matmul_gpu,
}
BACKENDS = tuple(_IMPLS)

__all__ = ["BACKENDS", "BITS", "CODES", "default_backend", "dequantize", "dequantize_codebook",
           "groupwise_matmul", "pack_int4", "unpack_int4"]


def default_backend() -> str:
  """The implementation for the platform jax runs on: the Pallas kernel there, else XLA's."""
  return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "xla")


def _check(x, q, scale, offset, bits: int, group_size: int, table) -> None:
  if bits not in BITS:
    raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
  if table is not None:
    if bits != 4 or offset is not None:
      given = "" if offset is None else " and an offset"
      raise ValueError(f"the codebook form (a table) takes 4-bit codes and no offset; got "
                       f"bits={bits}{given}")
    if table.shape != (CODES,) or not jnp.issubdtype(table.dtype, jnp.floating):
      raise ValueError(f"table must be a float [{CODES}] array, got {table.dtype} {table.shape}")
  elif offset is None:
    raise ValueError("offset is needed unless a codebook table is given")
  if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a float [M, K] array, got {x.dtype} {x.shape}")
  k = x.shape[1]
  if not isinstance(group_size, int) or group_size <= 0 or group_size % 2:
    raise ValueError(f"group_size must be a positive even int, got {group_size!r}")
  if k % group_size:
    raise ValueError(f"group_size {group_size} does not divide K={k}")
  want_dtype, k_rows = (jnp.uint8, k // 2) if bits == 4 else (jnp.int8, k)
  if q.ndim != 2 or q.shape[0] != k_rows or q.dtype != want_dtype:
    raise ValueError(f"{bits}-bit q must be [{k_rows}, N] {jnp.dtype(want_dtype).name} for "
                     f"K={k}, got {q.dtype} {q.shape}")
  want = (k // group_size, q.shape[1])
  for name, a in (("scale", scale), ("offset", offset)):
    if a is not None and a.shape != want:
      raise ValueError(f"{name} must be [K/group_size, N] = {list(want)}, got {list(a.shape)}")


def groupwise_matmul(
    x: jax.Array,  # [M, K] float
    q: jax.Array,  # [K/2, N] uint8 (bits 4, packed per group) or [K, N] int8 (bits 8)
    scale: jax.Array,  # [K/g, N] float32
    offset: jax.Array | None,  # [K/g, N] float32; None with a table
    *,
    bits: int,
    group_size: int,
    table: jax.Array | None = None,  # [16] float32: the codebook form
    backend: str | None = None,
    interpret: Any = False,
    **block_sizes: int,
) -> jax.Array:  # [M, N] x.dtype
  """x @ w with w[k, n] = q[k, n] * scale[k // g, n] + offset[k // g, n], or with a `table`
table[q[k, n]] * scale[k // g, n], accumulated in f32.

  `backend` None: the platform's default when traced (`default_backend`). `interpret` runs a
  Pallas backend in interpret mode (True, or `pltpu.InterpretParams` for pallas_tpu) so it works
  on the CPU; the XLA backends ignore it (as attention's and grouped_matmul's do, so one kernel
  option serves every op). `block_sizes` (block_m, block_n, block_k, and num_warps /
  num_stages for pallas_gpu) go to the Pallas kernel. M, K and N need not be multiples of the
  blocks.
  """
  backend = backend or default_backend()
  if backend not in _IMPLS:
    raise ValueError(f"unknown groupwise matmul backend {backend!r}; choose one of {BACKENDS}")
  _check(x, q, scale, offset, bits, group_size, table)
  kw = dict(bits=bits, group_size=group_size, table=table)
  if backend in ("reference", "xla"):
    if block_sizes:
      raise ValueError(f"the {backend} backend takes no block sizes, got {sorted(block_sizes)}")
    return _IMPLS[backend](x, q, scale, offset, **kw)
  return _IMPLS[backend](x, q, scale, offset, interpret=interpret, **kw, **block_sizes)
