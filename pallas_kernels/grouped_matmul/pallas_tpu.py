"""Grouped matmul as a Mosaic TPU kernel.

Written here rather than taken from `jax.experimental.pallas.ops.tpu.megablox.gmm`: megablox
takes float weights only (no int8 with per-group scales), needs M to be a multiple of its row
tile, and leaves rows past the last group uninitialized, where our contract (and ragged_dot's)
makes them zero. The schedule is megablox's: rows are sorted by group; the grid walks
(column tile, visit, K tile), a visit being one (group, row tile) pair, so a row tile that two
groups share is visited once per group and each visit stores only its own group's rows.
The visit table is computed on device and scalar-prefetched. The rows past the last group form
one more group whose visits store zeros, so every output row is written exactly once and no
uninitialized memory escapes.

The number of visits is data-dependent, at most `M / bm + G`; the grid has that static bound
and visits past the real count repeat the last one's block indices (so nothing is fetched) and
skip their work. int8 weights are widened to the activation dtype in VMEM (W8A16), or
multiplied int8 x int8 into int32 after per-token activation quantization (W8A8); the group's
scales are applied once per visit, on its last K step.

Group-wise quantized experts (int4 packed per quant group, or int8, with a scale and an offset
per quant group and output channel) are read as the dense group-wise kernel reads its weight
(`groupwise_matmul/pallas_tpu.py`, whose helpers this uses): a K tile holds whole quant groups,
the expert's packed tile and that tile's scale and offset rows come in per step, are unpacked
and dequantized into a VMEM tile of the activations' dtype, and one dot adds into the f32
accumulator. HBM traffic is the packed weights; each visit of an expert dequantizes its tiles
again (as the dense kernel does per row tile).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.groupwise_matmul.pallas_tpu import (dequantize_tile, dot_f32, k_block,
                                                         tile_operands)
from pallas_kernels.int8_matmul.padding import pad_to, round_up
from pallas_kernels.int8_matmul.quantize import quantize_per_token


def visit_table(group_sizes: jax.Array, m_pad: int, bm: int):
  """(group id [V], row tile [V], group row offsets [G+2], number of real visits [1]) for
  `m_pad` rows in tiles of `bm`, group G holding the rows past the last real group."""
  g = group_sizes.shape[0]
  sizes = jnp.concatenate([group_sizes, (m_pad - jnp.sum(group_sizes))[None]]).astype(jnp.int32)
  offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes)])  # [G+2]
  first = offsets[:-1] // bm  # each group's first row tile
  tiles = jnp.where(sizes > 0, (offsets[1:] + bm - 1) // bm - first, 0)  # [G+1]
  v_max = m_pad // bm + g  # every group adds at most one shared tile
  group_ids = jnp.repeat(jnp.arange(g + 1, dtype=jnp.int32), tiles, total_repeat_length=v_max)
  visit_start = jnp.cumsum(tiles) - tiles  # [G+1]: first visit of each group
  tile_ids = first[group_ids] + jnp.arange(v_max, dtype=jnp.int32) - visit_start[group_ids]
  return group_ids, tile_ids.astype(jnp.int32), offsets, jnp.sum(tiles, keepdims=True)


def _kernel(group_ids, tile_ids, offsets, num_visits, x_ref, w_ref, *refs, num_groups: int,
            per_channel: bool, w8a8: bool, bits: int, quant_group_size: int | None):
  # x [bm, bk], w [bk, bn] (group-wise: [bk/2, bn] or [bk, bn] int8), then per-channel int8:
  # ws [1, bn] f32, (xs [bm, 1] f32 for W8A8); or group-wise: scale and offset [bk/qg, bn]
  # f32. Then out [bm, bn], acc [bm, bn] scratch, (group-wise: the dequantized w [bk, bn]).
  groupwise = quant_group_size is not None
  if groupwise:
    gs_ref, go_ref, o_ref, acc_ref, wt_ref = refs
  else:
    ws_ref = refs[0] if per_channel else None
    xs_ref = refs[1] if w8a8 else None
    o_ref, acc_ref = refs[-2:]
  v, kk = pl.program_id(1), pl.program_id(2)
  g = group_ids[v]
  real = v < num_visits[0]

  @pl.when(kk == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(real & (g < num_groups))
  def _():
    x = x_ref[...]
    if groupwise:
      dequantize_tile(w_ref[...], gs_ref[...], go_ref[...], wt_ref, bits=bits,
                      group_size=quant_group_size)
      acc_ref[...] += dot_f32(x, wt_ref[...])
    else:
      w = w_ref[...].astype(x.dtype) if per_channel and not w8a8 else w_ref[...]
      acc_ref[...] += jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                          preferred_element_type=acc_ref.dtype)

  @pl.when(real & (kk == pl.num_programs(2) - 1))
  def _():
    y = acc_ref[...].astype(jnp.float32)
    if per_channel:
      y = y * ws_ref[...]
    if w8a8:
      y = y * xs_ref[...]
    bm = o_ref.shape[0]
    rows = tile_ids[v] * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    mine = (rows >= offsets[g]) & (rows < offsets[g + 1])  # [bm, 1]
    y = jnp.where(g < num_groups, y, 0.0)  # the group past the last stores zeros
    o_ref[...] = jnp.where(mine, y.astype(o_ref.dtype), o_ref[...])


def grouped_matmul_tpu(
    lhs: jax.Array,  # [M, K] float
    rhs: jax.Array,  # [G, K, N] float or int8 ([G, K/2, N] uint8: group-wise int4)
    group_sizes: jax.Array,  # [G] int32
    scale: jax.Array | None,  # [G, N] float32 for int8 rhs; [G, K/qg, N] group-wise
    *,
    mode: str,
    offset: jax.Array | None = None,  # [G, K/qg, N] float32, group-wise
    bits: int = 8,
    quant_group_size: int | None = None,
    block_m: int = 128,
    block_n: int = 256,
    block_k: int = 512,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # [M, N] lhs.dtype
  """Blocks: bm = min(block_m, M rounded up to 32) (32 rows tile int8 and bf16 alike), bn
  capped by N rounded up to 128; bk = min(block_k, K rounded up to 128), or for group-wise
  weights the dense group-wise kernel's K tile (`k_block`: whole quant groups, block_k a
  multiple of the group size). Operands are zero-padded up to whole tiles inside; weights
  whose K and N are multiples of the tiles are never copied."""
  m, k = lhs.shape
  g, n = rhs.shape[0], rhs.shape[2]
  groupwise = quant_group_size is not None
  per_channel = scale is not None and not groupwise
  w8a8 = per_channel and mode == "w8a8"
  bm = min(block_m, round_up(m, 32))
  bn = min(block_n, round_up(n, 128))
  bk = k_block(k, quant_group_size, block_k) if groupwise else min(block_k, round_up(k, 128))
  mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)
  table = visit_table(group_sizes, mp, bm)
  v_max = table[0].shape[0]

  def visit(v, num_visits):  # visits past the real ones repeat the last one's blocks
    return jnp.minimum(v, num_visits[0] - 1)

  def x_map(j, v, kk, group_ids, tile_ids, offsets, num_visits):
    return tile_ids[visit(v, num_visits)], kk

  def w_map(j, v, kk, group_ids, tile_ids, offsets, num_visits):
    return jnp.minimum(group_ids[visit(v, num_visits)], g - 1), kk, j

  def ws_map(j, v, kk, group_ids, tile_ids, offsets, num_visits):
    return jnp.minimum(group_ids[visit(v, num_visits)], g - 1), 0, j

  def quant_group_map(j, v, kk, group_ids, tile_ids, offsets, num_visits):
    return jnp.minimum(group_ids[visit(v, num_visits)], g - 1), kk, 0, j

  def row_map(j, v, kk, group_ids, tile_ids, offsets, num_visits):
    return tile_ids[visit(v, num_visits)], 0

  def out_map(j, v, kk, group_ids, tile_ids, offsets, num_visits):
    return tile_ids[visit(v, num_visits)], j

  x = lhs
  if w8a8:
    x, xs = quantize_per_token(lhs)
  operands = [pad_to(x, (mp, kp))]
  in_specs = [pl.BlockSpec((bm, bk), x_map)]
  scratch = [pltpu.VMEM((bm, bn), jnp.int32 if w8a8 else jnp.float32)]
  if groupwise:
    # Packed tiles come in as int8 and are unpacked and dequantized into a VMEM tile of the
    # activations' dtype per visit, as in the dense group-wise kernel.
    operands += tile_operands(rhs, scale, offset, bits=bits, group_size=quant_group_size,
                              bk=bk, kp=kp, np_=np_)
    q_rows = bk // 2 if bits == 4 else bk
    group_spec = pl.BlockSpec((None, None, bk // quant_group_size, bn), quant_group_map)
    in_specs += [pl.BlockSpec((None, q_rows, bn), w_map), group_spec, group_spec]
    scratch.append(pltpu.VMEM((bk, bn), lhs.dtype))
    name = f"grouped_matmul_int{bits}_g{quant_group_size}"
  else:
    operands.append(pad_to(rhs, (g, kp, np_)))
    in_specs.append(pl.BlockSpec((None, bk, bn), w_map))
    name = f"grouped_matmul_{mode if per_channel else 'float'}"
  if per_channel:
    operands.append(pad_to(scale.astype(jnp.float32)[:, None, :], (g, 1, np_)))
    in_specs.append(pl.BlockSpec((None, 1, bn), ws_map))
  if w8a8:
    operands.append(pad_to(xs[:, None], (mp, 1)))
    in_specs.append(pl.BlockSpec((bm, 1), row_map))
  out = pl.pallas_call(
      functools.partial(_kernel, num_groups=g, per_channel=per_channel, w8a8=w8a8, bits=bits,
                        quant_group_size=quant_group_size),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          grid=(np_ // bn, v_max, kp // bk),
          in_specs=in_specs,
          out_specs=pl.BlockSpec((bm, bn), out_map),
          scratch_shapes=scratch,
      ),
      out_shape=jax.ShapeDtypeStruct((mp, np_), lhs.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      interpret=interpret,
      name=name,
  )(*table, *operands)
  return out[:m, :n]
