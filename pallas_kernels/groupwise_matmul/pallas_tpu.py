"""Group-wise quantized matmul as a Mosaic TPU kernel.

Grid (M/bm, N/bn, K/bk), K innermost, with an f32 accumulator tile in VMEM scratch. A K tile
holds whole groups, so each step reads its groups' scales and offsets as one [bk/g, bn] block
(the [K/g, N] arrays are viewed as [K/bk, bk/g, N] outside, which makes that block the full
extent of its last two axes: no 8-row tiling constraint on bk/g). The packed weight tile is
widened to int32 once, and each group is unpacked with a mask and a shift into its two halves
(rows j and j + g/2 of the group), dequantized in f32 with its scale and offset row, and stored
in the activation dtype into a [bk, bn] VMEM tile in natural row order. Those slices and stores
are static and start on whole (8, 128) f32 / (16, 128) bf16 tiles for groups of 32 and up. One
MXU dot of the activation tile with it then adds into the accumulator: HBM traffic is the packed
weights, the MXU sees a full-depth contraction.

Packed bytes come in as int8 (a free bitcast outside): Mosaic's unsigned-integer support is
thin, and sign extension followed by `& 15` and `(>> 4) & 15` gives the same nibbles.

The codebook form (packing.py) takes the [16] table in SMEM instead of the offsets: each
unpacked half becomes table values by `packing.lookup`'s select tree over scalar SMEM reads,
times its group's scale; the tiles and the dot are the same.

The K tile, the operand layout and the tile dequantization are helpers the grouped matmul's TPU
kernel (MoE experts) shares.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.groupwise_matmul.packing import lookup
from pallas_kernels.groupwise_matmul.tiles import k_tile
from pallas_kernels.int8_matmul.padding import pad_to, round_up


def k_block(k: int, group_size: int, block_k: int) -> int:
  """The K tile, whole groups: all of K when K <= block_k (no padding); else the multiple of
  lcm(g, 128) up to block_k that pads K least (128: the activation tile's lanes)."""
  if k <= block_k:
    return k
  unit = math.lcm(group_size, 128)
  return k_tile(k, block_k, [unit * i for i in range(1, max(block_k, unit) // unit + 1)])


def tile_operands(q: jax.Array, scale: jax.Array, offset: jax.Array | None, *, bits: int,
                  group_size: int, bk: int, kp: int, np_: int) -> list[jax.Array]:
  """[q, scale, offset] (any leading axes; [q, scale] without an offset) as the kernels read
  them: q as int8 (packed bytes bitcast) zero-padded to [..., kp(/2), np_]; scale and offset
  f32, zero-padded (so padded weights are zero) and viewed as [..., kp/bk, bk/g, np_], one K
  tile's groups per block."""
  lead = scale.shape[:-2]
  nk, gpb = kp // bk, bk // group_size
  if bits == 4:
    q = jax.lax.bitcast_convert_type(q, jnp.int8)
  group = lambda a: pad_to(a.astype(jnp.float32), (*lead, kp // group_size, np_)).reshape(
      *lead, nk, gpb, np_)
  groups = [group(scale)] + ([] if offset is None else [group(offset)])
  return [pad_to(q, (*lead, kp // 2 if bits == 4 else kp, np_)), *groups]


def dequantize_tile(q: jax.Array, s: jax.Array, o: jax.Array | None, w_ref, *, bits: int,
                    group_size: int, table_ref=None) -> None:
  """Unpack and dequantize one weight tile into `w_ref` [bk, bn] (its dtype), natural row
  order: q [bk/2, bn] int8 (packed 4-bit) or [bk, bn] int8, s and o [bk/g, bn] f32; with
  `table_ref` ([16] f32 in SMEM) the codebook form, table[q] * s, and no o."""
  g = group_size
  q = q.astype(jnp.int32)
  for gi in range(s.shape[0]):
    if bits == 4:
      p = q[gi * g // 2:(gi + 1) * g // 2]  # [g/2, bn]
      halves = (p & 15, (p >> 4) & 15)  # rows 0..g/2-1 and g/2..g-1 of group gi
    else:
      halves = (q[gi * g:(gi + 1) * g],)
    rows = g // len(halves)
    for h, v in enumerate(halves):
      if table_ref is not None:
        w = lookup(v, lambda i: table_ref[i]) * s[gi:gi + 1]  # [rows, bn]
      else:
        w = v.astype(jnp.float32) * s[gi:gi + 1] + o[gi:gi + 1]
      w_ref[pl.ds(gi * g + h * rows, rows), :] = w.astype(w_ref.dtype)


def dot_f32(x: jax.Array, w: jax.Array) -> jax.Array:
  # f32 activations get an f32 product (the MXU's default rounds f32 inputs to bf16).
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def _kernel(x_ref, q_ref, s_ref, o_ref, out_ref, acc_ref, w_ref, *, bits: int, group_size: int,
            codebook: bool):
  # x [bm, bk], q [bk/2, bn] int8 (packed 4-bit) or [bk, bn] int8, s/o [bk/g, bn] f32 (codebook:
  # o_ref is the [16] f32 table in SMEM), out [bm, bn]; scratch acc [bm, bn] f32, w [bk, bn]
  kk = pl.program_id(2)

  @pl.when(kk == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  dequantize_tile(q_ref[...], s_ref[...], None if codebook else o_ref[...], w_ref, bits=bits,
                  group_size=group_size, table_ref=o_ref if codebook else None)
  acc_ref[...] += dot_f32(x_ref[...], w_ref[...])

  @pl.when(kk == pl.num_programs(2) - 1)
  def _():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def groupwise_matmul_tpu(
    x: jax.Array,  # [M, K] float
    q: jax.Array,  # [K/2, N] uint8 (bits 4) or [K, N] int8 (bits 8)
    scale: jax.Array,  # [K/g, N]
    offset: jax.Array | None,  # [K/g, N]; None with a table
    *,
    bits: int,
    group_size: int,
    table: jax.Array | None = None,  # [16] f32: the codebook form
    block_m: int = 128,
    block_n: int = 256,
    block_k: int = 512,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # [M, N] x.dtype
  """Blocks: bm = min(block_m, M rounded up to 16) (a bf16 tile's rows), bn = min(block_n, N
  rounded up to 128). K in one tile when K <= block_k (no padding); else bk is the multiple of
  lcm(g, 128) up to block_k that pads K least (128: the activation tile's lanes). Operands are
  zero-padded up to whole tiles inside (zero weights with zero scale and offset add nothing);
  weights whose K and N are multiples of the tiles are never copied."""
  m, k = x.shape
  n = scale.shape[1]
  g = group_size
  bm = min(block_m, round_up(m, 16))
  bn = min(block_n, round_up(n, 128))
  bk = k_block(k, g, block_k)
  mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)
  nk, gpb = kp // bk, bk // g
  q_rows = bk // 2 if bits == 4 else bk
  codebook = table is not None
  operands = [pad_to(x, (mp, kp)),
              *tile_operands(q, scale, offset, bits=bits, group_size=g, bk=bk, kp=kp, np_=np_)]
  group_spec = pl.BlockSpec((None, gpb, bn), lambda i, j, kk: (kk, 0, j))
  if codebook:
    operands.append(table.astype(jnp.float32))
  out = pl.pallas_call(
      functools.partial(_kernel, bits=bits, group_size=g, codebook=codebook),
      grid=(mp // bm, np_ // bn, nk),
      in_specs=[
          pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
          pl.BlockSpec((q_rows, bn), lambda i, j, kk: (kk, j)),
          group_spec,
          pl.BlockSpec(memory_space=pltpu.SMEM) if codebook else group_spec,
      ],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
      out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
      scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32), pltpu.VMEM((bk, bn), x.dtype)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name=f"groupwise_matmul_{'codebook' if codebook else f'int{bits}'}_g{g}",
  )(*operands)
  return out[:m, :n]
