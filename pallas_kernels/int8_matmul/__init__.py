"""int8-weight matmul: one entry point, implementations chosen by `backend`.

W8A16: int8 weights with one scale per output channel, activations stay float.
W8A8: activations also quantized to int8 per token (dynamic, symmetric), int32 accumulation,
then both scales applied.
"""
from __future__ import annotations

from typing import Any

import jax

from pallas_kernels.int8_matmul.pallas_gpu import int8_matmul_gpu
from pallas_kernels.int8_matmul.pallas_tpu import int8_matmul_tpu
from pallas_kernels.int8_matmul.quantize import quantize_per_channel, quantize_per_token
from pallas_kernels.int8_matmul.reference import int8_matmul_reference
from pallas_kernels.int8_matmul.xla import int8_matmul_xla

_IMPLS = {
    "reference": int8_matmul_reference,
    "xla": int8_matmul_xla,
    "pallas_tpu": int8_matmul_tpu,
    "pallas_gpu": int8_matmul_gpu,
}
BACKENDS = tuple(_IMPLS)
MODES = ("w8a16", "w8a8")

__all__ = ["BACKENDS", "MODES", "int8_matmul", "quantize_per_channel", "quantize_per_token"]


def int8_matmul(
    x: jax.Array,  # [M, K] float
    w_int8: jax.Array,  # [K, N] int8 ([N, K] with transpose_w)
    w_scale: jax.Array,  # [N]
    *,
    mode: str = "w8a16",
    backend: str = "reference",
    interpret: Any = False,
    transpose_w: bool = False,
    **block_sizes: int,
) -> jax.Array:  # [M, N] x.dtype
  """x @ (w_int8 * w_scale), in `mode` ("w8a16" or "w8a8").

  `transpose_w`: the weights come as [N, K] (a tied embedding used as the LM head), read in
  place by the reference; the Pallas kernels take them transposed.

  `interpret` runs a Pallas backend in interpret mode (CPU); `block_sizes` (block_m, block_n,
  block_k, ...) go to the Pallas kernel. M, K and N need not be multiples of the blocks.
  """
  if mode not in MODES:
    raise ValueError(f"unknown int8 matmul mode {mode!r}; choose one of {MODES}")
  if backend not in _IMPLS:
    raise ValueError(f"unknown int8 matmul backend {backend!r}; choose one of {BACKENDS}")
  k_axis = 1 if transpose_w else 0
  if x.ndim != 2 or w_int8.shape[k_axis] != x.shape[1] or w_scale.shape != (
      w_int8.shape[1 - k_axis],):
    raise ValueError(f"shapes do not match: x {x.shape}, w {w_int8.shape}, scale {w_scale.shape}")
  if backend in ("reference", "xla"):
    if block_sizes or interpret:
      raise ValueError(f"the {backend} backend takes no block sizes and no interpret mode")
    return _IMPLS[backend](x, w_int8, w_scale, mode=mode, transpose_w=transpose_w)
  if transpose_w:
    w_int8 = w_int8.T
  return _IMPLS[backend](x, w_int8, w_scale, mode=mode, interpret=interpret, **block_sizes)
