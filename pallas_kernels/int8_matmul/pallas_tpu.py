"""int8-weight matmul as a Mosaic TPU kernel.

Grid (M/bm, N/bn, K/bk), K innermost, with an f32 (W8A16) or int32 (W8A8) accumulator tile in VMEM
scratch; the scales are applied once, on the last K step. W8A16 widens each int8 weight tile to the
activation dtype in VMEM (int8 values are exact in bf16), so HBM traffic is the int8 weights. W8A8
quantizes activations per token before the call (one cheap fused XLA pass over x, since the row
absmax needs all of K) and multiplies int8 x int8 into int32 on the MXU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.int8_matmul.padding import pad_to, round_up
from pallas_kernels.int8_matmul.quantize import quantize_per_token


def _kernel(x_ref, w_ref, ws_ref, *refs, w8a8: bool):
  # x [bm, bk], w [bk, bn] int8, ws [1, bn] f32, (xs [bm, 1] f32 for W8A8), out [bm, bn],
  # acc [bm, bn] scratch
  xs_ref = refs[0] if w8a8 else None
  o_ref, acc_ref = refs[-2:]
  kk = pl.program_id(2)

  @pl.when(kk == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  x = x_ref[...]
  w = w_ref[...] if w8a8 else w_ref[...].astype(x.dtype)
  acc_ref[...] += jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                      preferred_element_type=acc_ref.dtype)

  @pl.when(kk == pl.num_programs(2) - 1)
  def _():
    y = acc_ref[...].astype(jnp.float32) * ws_ref[...]
    if w8a8:
      y = y * xs_ref[...]
    o_ref[...] = y.astype(o_ref.dtype)


def int8_matmul_tpu(
    x: jax.Array,  # [M, K] float
    w_int8: jax.Array,  # [K, N] int8
    w_scale: jax.Array,  # [N]
    *,
    mode: str,
    block_m: int = 128,
    block_n: int = 256,
    block_k: int = 512,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # [M, N] x.dtype
  """Blocks: bm = min(block_m, M rounded up to 32) (32 rows tile int8 and bf16 alike), bn and bk
  capped by N and K rounded up to 128. Operands are zero-padded up to whole tiles inside;
  weights whose K and N are multiples of the tiles are never copied."""
  m, k = x.shape
  n = w_int8.shape[1]
  w8a8 = mode == "w8a8"
  bm = min(block_m, round_up(m, 32))
  bn = min(block_n, round_up(n, 128))
  bk = min(block_k, round_up(k, 128))
  mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)

  if w8a8:
    xq, xs = quantize_per_token(x)
    operands = [pad_to(xq, (mp, kp)), pad_to(w_int8, (kp, np_)),
                pad_to(w_scale.astype(jnp.float32)[None, :], (1, np_)), pad_to(xs[:, None], (mp, 1))]
  else:
    operands = [pad_to(x, (mp, kp)), pad_to(w_int8, (kp, np_)),
                pad_to(w_scale.astype(jnp.float32)[None, :], (1, np_))]
  in_specs = [
      pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
      pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
      pl.BlockSpec((1, bn), lambda i, j, kk: (0, j)),
  ]
  if w8a8:
    in_specs.append(pl.BlockSpec((bm, 1), lambda i, j, kk: (i, 0)))
  out = pl.pallas_call(
      functools.partial(_kernel, w8a8=w8a8),
      grid=(mp // bm, np_ // bn, kp // bk),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
      out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
      scratch_shapes=[pltpu.VMEM((bm, bn), jnp.int32 if w8a8 else jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name=f"int8_matmul_{mode}",
  )(*operands)
  return out[:m, :n]
