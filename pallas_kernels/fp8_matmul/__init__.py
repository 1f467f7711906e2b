"""float8 (e4m3) weight matmul: one entry point, implementations chosen by `backend`.

W8A16 ("w8a16"): float8 weights with one float32 scale per output channel, activations stay
float. W8A8 ("w8a8", vLLM's FP8-dynamic): activations also quantized to float8 per token
(dynamic, symmetric), float32 accumulation, then both scales applied.
"""
from __future__ import annotations

import jax

from pallas_kernels.fp8_matmul.quantize import (FP8, FP8_MAX, quantize_per_channel_fp8,
                                                quantize_per_token_fp8)
from pallas_kernels.fp8_matmul.reference import fp8_matmul_reference
from pallas_kernels.fp8_matmul.xla import fp8_matmul_xla

_IMPLS = {"reference": fp8_matmul_reference, "xla": fp8_matmul_xla}
BACKENDS = tuple(_IMPLS)
MODES = ("w8a16", "w8a8")

__all__ = ["BACKENDS", "FP8", "FP8_MAX", "MODES", "fp8_matmul", "quantize_per_channel_fp8",
           "quantize_per_token_fp8"]


def fp8_matmul(
    x: jax.Array,  # [M, K] float
    w_fp8: jax.Array,  # [K, N] float8_e4m3fn ([N, K] with transpose_w)
    w_scale: jax.Array,  # [N]
    *,
    mode: str = "w8a8",
    backend: str = "xla",
    transpose_w: bool = False,
) -> jax.Array:  # [M, N] x.dtype
  """x @ (w_fp8 * w_scale), in `mode` ("w8a16" or "w8a8"). `transpose_w`: the weights come as
  [N, K] (a tied embedding as the LM head; HF checkpoints' own layout)."""
  if mode not in MODES:
    raise ValueError(f"unknown fp8 matmul mode {mode!r}; choose one of {MODES}")
  if backend not in _IMPLS:
    raise ValueError(f"unknown fp8 matmul backend {backend!r}; choose one of {BACKENDS}")
  if w_fp8.dtype != FP8:
    raise ValueError(f"w_fp8 must be float8_e4m3fn, got {w_fp8.dtype}")
  k_axis = 1 if transpose_w else 0
  if x.ndim != 2 or w_fp8.shape[k_axis] != x.shape[1] or w_scale.shape != (
      w_fp8.shape[1 - k_axis],):
    raise ValueError(f"shapes do not match: x {x.shape}, w {w_fp8.shape}, scale {w_scale.shape}")
  return _IMPLS[backend](x, w_fp8, w_scale, mode=mode, transpose_w=transpose_w)
