"""int8-weight matmul as a Pallas GPU kernel, lowered through Triton.

Triton rather than Mosaic GPU for the same reasons as the attention kernel (see
`ragged_paged_attention/pallas_gpu.py`): it runs under `interpret=True` on the CPU, and Triton
picks MMA shapes for the small M of decode steps itself. Grid (M/bm, N/bn); each program walks K
in `block_k` steps, widening int8 weights to the activation dtype in registers (W8A16) or
multiplying int8 x int8 into int32 (W8A8, activations quantized per token before the call).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.int8_matmul.padding import pad_to, round_up
from pallas_kernels.int8_matmul.quantize import quantize_per_token


def _kernel(x_ref, w_ref, ws_ref, *refs, block_k: int, w8a8: bool):
  # x [bm, Kp], w [Kp, bn] int8, ws [bn] f32, (xs [bm] f32 for W8A8), out [bm, bn]
  xs_ref = refs[0] if w8a8 else None
  o_ref = refs[-1]
  bm, bn = o_ref.shape
  acc_dtype = jnp.int32 if w8a8 else jnp.float32

  def body(kk, acc):
    x = x_ref[:, pl.ds(kk * block_k, block_k)]  # [bm, bk]
    w = w_ref[pl.ds(kk * block_k, block_k), :]  # [bk, bn]
    if not w8a8:
      w = w.astype(x.dtype)
    return acc + jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                     preferred_element_type=acc_dtype)

  acc = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, body, jnp.zeros((bm, bn), acc_dtype))
  y = acc.astype(jnp.float32) * ws_ref[...][None, :]
  if w8a8:
    y = y * xs_ref[...][:, None]
  o_ref[...] = y.astype(o_ref.dtype)


def int8_matmul_gpu(
    x: jax.Array,  # [M, K] float
    w_int8: jax.Array,  # [K, N] int8
    w_scale: jax.Array,  # [N]
    *,
    mode: str,
    block_m: int = 64,
    block_n: int = 128,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:  # [M, N] x.dtype
  """Block sizes must be powers of two >= 16 (Triton tiles); bm shrinks to M rounded up to a
  power of two for decode-sized M. Operands are zero-padded up to whole tiles inside; weights
  whose K and N are multiples of the tiles are never copied."""
  m, k = x.shape
  n = w_int8.shape[1]
  w8a8 = mode == "w8a8"
  bm = min(block_m, max(16, pl.next_power_of_2(m)))
  mp, np_, kp = round_up(m, bm), round_up(n, block_n), round_up(k, block_k)

  if w8a8:
    xq, xs = quantize_per_token(x)
    operands = [pad_to(xq, (mp, kp)), pad_to(w_int8, (kp, np_)),
                pad_to(w_scale.astype(jnp.float32), (np_,)), pad_to(xs, (mp,))]
  else:
    operands = [pad_to(x, (mp, kp)), pad_to(w_int8, (kp, np_)),
                pad_to(w_scale.astype(jnp.float32), (np_,))]
  in_specs = [
      pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
      pl.BlockSpec((kp, block_n), lambda i, j: (0, j)),
      pl.BlockSpec((block_n,), lambda i, j: (j,)),
  ]
  if w8a8:
    in_specs.append(pl.BlockSpec((bm,), lambda i, j: (i,)))
  out = pl.pallas_call(
      functools.partial(_kernel, block_k=block_k, w8a8=w8a8),
      grid=(mp // bm, np_ // block_n),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((bm, block_n), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=f"int8_matmul_{mode}",
  )(*operands)
  return out[:m, :n]
