"""Grouped matmul as a Pallas GPU kernel, lowered through Triton.

Triton for the reasons `int8_matmul/pallas_gpu.py` gives (it runs under `interpret=True` on the
CPU, and picks MMA shapes for decode-sized row tiles itself). Grid (work item, column tile). A
work item is up to `bm` rows of one group, starting at the group's first row (the attention's
`schedule.seq_q_blocks`, groups for sequences), computed in jnp before the call: a group of 3
rows is one item whatever its offset, so each expert's weights are read once per `bm` of its
rows, and empty groups get no item. The rows past `sum(group_sizes)` form one more group whose
items store zeros, so every output row is written exactly once. There are at most
`cdiv(M, bm) + G` items; the grid has that static bound and the unused tail returns at once.

Each program loads its `[bm, K]` rows at a dynamic offset (the window slides back inside the
array for the last rows, so M needs no padding when M >= bm), walks K in `bk` steps with an f32
accumulator in registers (int32 for W8A8), and stores only its own group's rows (masked store).
Weights are read in place from the stacked `[G, K, N]` array, the group picked by a scalar
index, so nothing is sliced out or copied per expert:

  float       the weight tile in the activations' dtype
  per-channel int8 widened to the activations' dtype in registers (W8A16), or int8 x int8 into
              int32 after per-token activation quantization (W8A8); the group's channel scales
              (and the rows' token scales) once after the K loop
  group-wise  int4 packed per quant group, or int8, with a scale and an offset per expert, quant
              group and channel, dequantized in registers as the dense group-wise kernel does
              (`groupwise_matmul/pallas_gpu.py`): the low and high nibble halves of each packed
              tile dotted with the matching activation columns, taken from a free
              `[M, K/g, 2, g/2]` view of the activations

HBM traffic is each visited expert's weights in their stored form (packed int4, int8 or float)
once per item, its scales, and each item's rows once per column tile; no dequantized copy of any
expert exists. The grid's first axis is the work item, the fastest-varying in launch order, so
the items of one expert run side by side on one column tile and at prefill may find its weight
tile in L2 (not yet measured on a device).

Triton rules (the H100 build checks them): every tile is a power of two >= 16 (bm, bn, bk; the
quant group size a power of two, bk >= 32 for int4 so each half-tile dot is 16 deep). Shared
memory per program is num_stages x (bm x bk + bk x bn) x 2 bytes for bf16 activations and
weights and must stay within the H100's 227 KiB (232448 bytes): the defaults (bm <= 64,
bn = bk = 128, 3 stages) take 144 KiB and block_m=128 192 KiB; bm=64 with bn=256 (240 KiB) or
bk=256 (288 KiB) is refused at 3 stages, bm=128 with bn=256 builds at 2. Packed int4 weight
tiles take a quarter of the bf16 bytes (the H100 builds bm=256, or bn=256, at 3 stages).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.groupwise_matmul.tiles import k_tile
from pallas_kernels.int8_matmul.padding import pad_to, round_up
from pallas_kernels.int8_matmul.quantize import quantize_per_token
from pallas_kernels.ragged_paged_attention.schedule import seq_q_blocks


def row_block(m: int, num_groups: int, block_m: int) -> int:
  """Rows per work item: the mean group size as a power of two, between 16 (the smallest MMA)
  and block_m, so decode batches of a few rows per expert waste little of each tile."""
  mean = max(1, -(-m // num_groups))
  return min(block_m, max(16, pl.next_power_of_2(mean)))


def work_items(group_sizes: jax.Array, m: int, bm: int):
  """(group of each item [V], its first row [V], group row offsets [G+2]) for m rows in items
  of at most bm rows; group G holds the rows past the last real group, and items past the real
  ones have group -1."""
  g = group_sizes.shape[0]
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)  # [G]
  offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), ends, jnp.full(1, m, jnp.int32)])
  item_group, item_row = seq_q_blocks(offsets, bm, pl.cdiv(m, bm) + g)
  return item_group, item_row, offsets


def _kernel(item_group_ref, item_row_ref, offsets_ref, x_ref, w_ref, *refs, num_groups: int,
            rows: int, block_n: int, block_k: int, num_k: int, per_channel: bool, w8a8: bool,
            bits: int, quant_group_size: int | None):
  # x [Mp, Kp] (group-wise int4: [Mp, Kp/g, 2, g/2]), w [G, Kp, Np] (int4: [G, Kp/2, Np] int8);
  # then per-channel: ws [G, Np] f32 (and xs [Mp] f32 for W8A8); group-wise: s, o [G, Kp/g, Np]
  # f32; then out [Mp, Np]
  groupwise = quant_group_size is not None
  out_ref = refs[-1]
  i, j = pl.program_id(0), pl.program_id(1)
  e = item_group_ref[i]
  first = item_row_ref[i]
  bm, bn, bk = rows, block_n, block_k
  # The window slides back so it never leaves the array; rows before `first` are not stored.
  start = jnp.minimum(first, x_ref.shape[0] - bm)
  row = start + jnp.arange(bm, dtype=jnp.int32)  # [bm]
  at_rows, at_cols = pl.ds(start, bm), pl.ds(j * bn, bn)

  def store(y):  # [bm, bn]: only this item's rows of its group
    end = offsets_ref[e + 1]
    mine = (row >= first) & (row < end)
    plgpu.store(out_ref.at[at_rows, at_cols], y.astype(out_ref.dtype),
                mask=jnp.broadcast_to(mine[:, None], (bm, bn)))

  @pl.when((e >= 0) & (e < num_groups))
  def _():
    # f32 activations get an f32 product (Triton's default is TF32).
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def dot(x, w, acc_dtype=jnp.float32):
      return lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=acc_dtype)

    if groupwise:
      s_ref, o_ref = refs[0], refs[1]
      g = quant_group_size
      gpb = bk // g

      def body(kk, acc):
        groups = pl.ds(kk * gpb, gpb)
        s = s_ref[e, groups, at_cols][:, None, :]  # [gpb, 1, bn]
        o = o_ref[e, groups, at_cols][:, None, :]

        def dequantize(v, n_rows):  # [gpb * n_rows, bn] int32 -> same shape, x dtype
          w = v.reshape(gpb, n_rows, bn).astype(jnp.float32) * s + o
          return w.reshape(gpb * n_rows, bn).astype(x_ref.dtype)

        if bits == 4:
          p = w_ref[e, pl.ds(kk * (bk // 2), bk // 2), at_cols].astype(jnp.int32)  # [bk/2, bn]
          x_lo = x_ref[at_rows, groups, 0, :].reshape(bm, bk // 2)
          x_hi = x_ref[at_rows, groups, 1, :].reshape(bm, bk // 2)
          return (acc + dot(x_lo, dequantize(p & 15, g // 2))
                  + dot(x_hi, dequantize((p >> 4) & 15, g // 2)))
        w = dequantize(w_ref[e, pl.ds(kk * bk, bk), at_cols].astype(jnp.int32), g)
        return acc + dot(x_ref[at_rows, pl.ds(kk * bk, bk)], w)
      acc_dtype = jnp.float32
    else:
      acc_dtype = jnp.int32 if w8a8 else jnp.float32

      def body(kk, acc):
        x = x_ref[at_rows, pl.ds(kk * bk, bk)]  # [bm, bk]
        w = w_ref[e, pl.ds(kk * bk, bk), at_cols]  # [bk, bn]
        return acc + dot(x, w if w8a8 else w.astype(x.dtype), acc_dtype)

    y = lax.fori_loop(0, num_k, body, jnp.zeros((bm, bn), acc_dtype)).astype(jnp.float32)
    if per_channel:
      y = y * refs[0][e, at_cols][None, :]
    if w8a8:
      y = y * refs[1][at_rows][:, None]
    store(y)

  @pl.when(e == num_groups)  # the rows past the last group
  def _():
    store(jnp.zeros((bm, bn), jnp.float32))


def _check_tile(name: str, value: int, least: int = 16) -> None:
  if not isinstance(value, int) or value < least or value & (value - 1):
    raise ValueError(f"{name} must be a power of two >= {least} (a Triton tile), got {value!r}")


def grouped_matmul_gpu(
    lhs: jax.Array,  # [M, K] float
    rhs: jax.Array,  # [G, K, N] float or int8 ([G, K/2, N] uint8: group-wise int4)
    group_sizes: jax.Array,  # [G] int32
    scale: jax.Array | None,  # [G, N] float32 for int8 rhs; [G, K/qg, N] group-wise
    *,
    mode: str,
    offset: jax.Array | None = None,  # [G, K/qg, N] float32, group-wise
    bits: int = 8,
    quant_group_size: int | None = None,
    block_m: int = 64,
    block_n: int = 128,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:  # [M, N] lhs.dtype
  """Blocks are powers of two >= 16 (Triton tiles). Rows per item: `row_block` (16 for decode
  batches, up to block_m). bn = block_n; bk = block_k, or for group-wise weights the
  power-of-two multiple of the quant group size up to block_k that pads K least (at least 32
  for int4). K and N are zero-padded up to whole tiles inside (weights whose K and N are
  multiples of the tiles are never copied); M is padded only when it is under one row tile."""
  m, k = lhs.shape
  g, n = rhs.shape[0], rhs.shape[2]
  groupwise = quant_group_size is not None
  per_channel = scale is not None and not groupwise
  w8a8 = per_channel and mode == "w8a8"
  for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
    _check_tile(name, value)
  bm = row_block(m, g, block_m)
  if groupwise:
    qg = quant_group_size
    if qg & (qg - 1):
      raise ValueError(f"the pallas_gpu backend needs a power-of-two quant_group_size, got {qg}")
    least = max(qg, 32 if bits == 4 else 16)
    bk = k_tile(k, block_k, [least << i for i in range(max(block_k, least).bit_length())
                             if least << i <= max(block_k, least)])
  else:
    bk = block_k
  mp, np_, kp = max(m, bm), round_up(n, block_n), round_up(k, bk)
  item_group, item_row, offsets = work_items(group_sizes, m, bm)

  x = lhs
  if w8a8:
    x, xs = quantize_per_token(lhs)
  x = pad_to(x, (mp, kp))
  if groupwise and bits == 4:
    x = x.reshape(mp, kp // qg, 2, qg // 2)
    w = pad_to(lax.bitcast_convert_type(rhs, jnp.int8), (g, kp // 2, np_))
  else:
    w = pad_to(rhs, (g, kp, np_))
  operands = [item_group, item_row, offsets, x, w]
  if groupwise:
    operands += [pad_to(a.astype(jnp.float32), (g, kp // qg, np_)) for a in (scale, offset)]
    name = f"grouped_matmul_int{bits}_g{qg}"
  else:
    name = f"grouped_matmul_{mode if per_channel else 'float'}"
  if per_channel:
    operands.append(pad_to(scale.astype(jnp.float32), (g, np_)))
  if w8a8:
    operands.append(pad_to(xs, (mp,)))
  out = pl.pallas_call(
      functools.partial(_kernel, num_groups=g, rows=bm, block_n=block_n, block_k=bk,
                        num_k=kp // bk, per_channel=per_channel, w8a8=w8a8, bits=bits,
                        quant_group_size=quant_group_size),
      grid=(item_group.shape[0], np_ // block_n),
      out_shape=jax.ShapeDtypeStruct((mp, np_), lhs.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=name,
  )(*operands)
  return out[:m, :n]
