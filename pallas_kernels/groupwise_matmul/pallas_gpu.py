"""Group-wise quantized matmul as a Pallas GPU kernel, lowered through Triton.

Triton for the reasons `int8_matmul/pallas_gpu.py` gives (it runs under `interpret=True` on the
CPU, and picks MMA shapes for decode-sized M itself). Grid (M/bm, N/bn); each program walks K in
`bk` steps of whole groups, keeping an f32 accumulator in registers. Triton tensors cannot be
sliced or concatenated along rows, so the two halves of each group stay apart: the packed tile
[bk/2, bn] unpacks with a mask and a shift into the low halves of its groups and the high
halves, each dequantized through a [bk/g, g/2, bn] view that broadcasts a group's scale and
offset row over its rows, and each multiplied by the matching activation columns. Those come
from a [M, K/g, 2, g/2] view of the activations (a free reshape outside): a strided load of
index 0 (or 1) on the half axis gives the columns of the low (high) halves, in the same group
order as the unpacked rows.

The codebook form (packing.py) reads the [16] table instead of the offsets, as 16 scalar loads
per program, and each unpacked half becomes table values by `packing.lookup`'s select tree,
times its group's scale.

Triton wants power-of-two tensor shapes: the group size and the tiles are powers of two.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.groupwise_matmul.packing import CODES, lookup
from pallas_kernels.groupwise_matmul.tiles import k_tile
from pallas_kernels.int8_matmul.padding import pad_to, round_up


def _kernel(x_ref, q_ref, s_ref, o_ref, out_ref, *, bits: int, group_size: int, block_k: int,
            codebook: bool):
  # x [bm, Kp/g, 2, g/2] (bits 4) or [bm, Kp/g, g] (bits 8), q [Kp/2, bn] int8 (packed) or
  # [Kp, bn] int8, s/o [Kp/g, bn] f32 (codebook: o is the [16] f32 table), out [bm, bn]
  g, bk = group_size, block_k
  table = [o_ref[i] for i in range(CODES)] if codebook else None
  gpb = bk // g
  bm, bn = out_ref.shape
  # f32 activations get an f32 product (Triton's default is TF32).
  precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

  def dot(x, w):
    return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)

  def body(kk, acc):
    groups = pl.ds(kk * gpb, gpb)
    s = s_ref[groups, :][:, None, :]  # [gpb, 1, bn]

    def dequantize(v, rows):  # [gpb * rows, bn] int32 -> [gpb * rows, bn] x dtype
      v = v.reshape(gpb, rows, bn)
      if codebook:
        w = lookup(v, table.__getitem__) * s
      else:
        w = v.astype(jnp.float32) * s + o_ref[groups, :][:, None, :]
      return w.reshape(gpb * rows, bn).astype(x_ref.dtype)

    if bits == 4:
      p = q_ref[pl.ds(kk * (bk // 2), bk // 2), :].astype(jnp.int32)  # [bk/2, bn]
      x_lo = x_ref[:, groups, 0, :].reshape(bm, bk // 2)
      x_hi = x_ref[:, groups, 1, :].reshape(bm, bk // 2)
      return (acc + dot(x_lo, dequantize(p & 15, g // 2))
              + dot(x_hi, dequantize((p >> 4) & 15, g // 2)))
    w = dequantize(q_ref[pl.ds(kk * bk, bk), :].astype(jnp.int32), g)
    return acc + dot(x_ref[:, groups, :].reshape(bm, bk), w)

  acc = jax.lax.fori_loop(0, q_ref.shape[0] * (2 if bits == 4 else 1) // bk, body,
                          jnp.zeros((bm, bn), jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


def groupwise_matmul_gpu(
    x: jax.Array,  # [M, K] float
    q: jax.Array,  # [K/2, N] uint8 (bits 4) or [K, N] int8 (bits 8)
    scale: jax.Array,  # [K/g, N]
    offset: jax.Array | None,  # [K/g, N]; None with a table
    *,
    bits: int,
    group_size: int,
    table: jax.Array | None = None,  # [16] f32: the codebook form
    block_m: int = 64,
    block_n: int = 128,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:  # [M, N] x.dtype
  """Blocks are powers of two >= 16 (Triton tiles); bm shrinks to M rounded up to a power of
  two for decode-sized M. bk is the power-of-two multiple of the group size up to block_k that
  pads K least, at least 32 so that each half-tile dot is 16 deep. Operands are zero-padded up to
  whole tiles inside; weights whose K and N are multiples of the tiles are never copied."""
  m, k = x.shape
  n = scale.shape[1]
  g = group_size
  if g & (g - 1):
    raise ValueError(f"the pallas_gpu backend needs a power-of-two group size, got {g}")
  bm = min(block_m, max(16, pl.next_power_of_2(m)))
  first = max(g, 32)
  bk = k_tile(k, block_k, [first << i for i in range(max(block_k, first).bit_length())
                           if first << i <= max(block_k, first)])
  mp, np_, kp = round_up(m, bm), round_up(n, block_n), round_up(k, bk)

  x = pad_to(x, (mp, kp))
  if bits == 4:
    x = x.reshape(mp, kp // g, 2, g // 2)
    x_block = (bm, kp // g, 2, g // 2)
    q = pad_to(jax.lax.bitcast_convert_type(q, jnp.int8), (kp // 2, np_))
  else:
    x = x.reshape(mp, kp // g, g)
    x_block = (bm, kp // g, g)
    q = pad_to(q, (kp, np_))
  zeros = (0,) * (len(x_block) - 1)
  group_spec = pl.BlockSpec((kp // g, block_n), lambda i, j: (0, j))
  codebook = table is not None
  if codebook:
    last, last_spec = table.astype(jnp.float32), pl.BlockSpec((CODES,), lambda i, j: (0,))
  else:
    last, last_spec = pad_to(offset.astype(jnp.float32), (kp // g, np_)), group_spec
  out = pl.pallas_call(
      functools.partial(_kernel, bits=bits, group_size=g, block_k=bk, codebook=codebook),
      grid=(mp // bm, np_ // block_n),
      in_specs=[
          pl.BlockSpec(x_block, lambda i, j: (i, *zeros)),
          pl.BlockSpec((q.shape[0], block_n), lambda i, j: (0, j)),
          group_spec,
          last_spec,
      ],
      out_specs=pl.BlockSpec((bm, block_n), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=f"groupwise_matmul_{'codebook' if codebook else f'int{bits}'}_g{g}",
  )(x, q, pad_to(scale.astype(jnp.float32), (kp // g, np_)), last)
  return out[:m, :n]
