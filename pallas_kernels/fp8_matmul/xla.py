"""float8 matmul as XLA's float8 dot: what runs on every platform.

W8A8 (FP8-dynamic) is one `dot_general` of float8 operands accumulating in float32, the
scales applied after it. W8A16-FP8 widens the weights to the activation dtype inside the dot
(e4m3 values are exact in bfloat16). What each compiler makes of it (docs/quantization.md):
  * H100 (XLA:GPU): a Triton GEMM fusion that reads the float8 weights from HBM (half of
    bf16's bytes) and widens them to float16 in registers for `mma.sync`: no float copy of
    the weights, but not the fp8 tensor cores yet.
  * TPU v5e/v6e (no float8 matrix unit): XLA widens the operands in the dot's fusion; the estimate puts it level with the int8 XLA form (tests/test_compile_kernels.py).
  * CPU (XLA:CPU): the weights are converted to float32 every step, slower than float32
    weights; the CPU's quantized path is int8's integer GEMM.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_matmul.quantize import quantize_per_token_fp8


def fp8_matmul_xla(
    x: jax.Array,  # [M, K] float
    w_fp8: jax.Array,  # [K, N] float8_e4m3fn ([N, K] with transpose_w)
    w_scale: jax.Array,  # [N] float
    *,
    mode: str,
    transpose_w: bool = False,
) -> jax.Array:  # [M, N] x.dtype
  dims = (((1,), (1 if transpose_w else 0,)), ((), ()))
  if mode == "w8a8":
    xq, xs = quantize_per_token_fp8(x)
    y = jax.lax.dot_general(xq, w_fp8, dims, preferred_element_type=jnp.float32) * xs[:, None]
  else:
    y = jax.lax.dot_general(x, w_fp8.astype(x.dtype), dims, preferred_element_type=jnp.float32)
  return (y * w_scale.astype(jnp.float32)[None, :]).astype(x.dtype)
