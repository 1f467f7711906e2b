"""Group-wise quantized matmul for XLA:CPU.

Two forms, picked by shape:

* dequantize, then one float32 dot (every M for 8-bit, M >= 2 for 4-bit): the packed weight
  becomes an f32 [K, N] in one fused pass (both nibbles unpacked by one broadcast shift), and
  XLA's f32 GEMM multiplies it. Exact up to f32 summation order.
* one row of 4-bit weights: the integer path of `int8_matmul/xla.py`. The row becomes two int8
  digits in base 254 (16-bit activations, error below max|x| / 64,516 per element, measured
  2-4e-5 of max|y|); each group's two halves (low and high nibbles, unpacked to int8 without
  interleaving) multiply the matching digit columns in one batched integer dot, exact in int32;
  the groups' scales and offsets are applied by one f32 dot, [1, 2G] x [2G, N]: the sum over
  groups written as a matrix product, which XLA:CPU runs far faster than a reduction.

Measured on a 2-core x86 box (AMD EPYC, 32 MB L3) at SmolLM2-135M's shapes, float32
activations, ms per matmul, "hot / scan": hot is one weight called repeatedly (its f32 form,
3.5 MB at most, stays in cache); scan is 28 stacked layers' weights in a `lax.scan`, per layer,
as the runner's scanned stack runs them (there the dense weight is sliced out, a copy, per
layer). Other jobs shared the two cores: each figure is the least of 3 rounds of a 15-call
median, and repeat runs moved by up to ~30%.

  K x N, int4 g=32   M  dense f32    stacked dq    broadcast dq  int digits    chosen
  576 x 1536         1  0.062/0.165  0.145/1.085   0.103/0.100   0.115/0.103   0.148/0.075
                     2  0.065/0.196  0.159/1.045   0.185/0.137                 0.150/0.249
                     8  0.091/0.222  0.157/0.956   0.152/0.143                 0.157/0.158
                    64  0.564/0.724  0.642/1.447   0.666/0.658                 0.612/0.652
  1536 x 576         1  0.084/0.203  0.167/1.836   0.194/0.242   0.190/0.098   0.184/0.114
                     2  0.069/0.225  0.159/0.895   0.187/0.119                 0.138/0.128
                     8  0.132/0.242  0.200/0.950   0.197/0.218                 0.199/0.184
                    64  0.583/0.756  0.691/1.452   0.640/0.652                 0.698/0.652
  576 x 576          1  0.030/0.142  0.071/0.676   0.083/0.061   0.041/0.025   0.044/0.023
                     2  0.052/0.179  0.096/0.729   0.096/0.053                 0.059/0.051
                     8  0.068/0.103  0.135/0.428   0.119/0.093                 0.116/0.064
                    64  0.258/0.277  0.329/0.552   0.300/0.428                 0.325/0.502

(dense f32: x @ w of the dequantized weight; stacked dq: `packing.dequantize`, which stacks the
two nibble arrays, then the dot; broadcast dq: `dequantize_f32` below, then the dot; int digits:
the one-row integer path; chosen: this module. "chosen" and the form it picks are the same code,
so their difference is the noise.) Groups of 64 (576 x 1536, 576 x 576) and 128 (1536 x 576)
measured alike; at one row the integer path took 0.019-0.082 ms per layer in the scan against
0.080-0.119 for the broadcast dequantize. 8-bit weights (no unpacking): the broadcast dequantize
ran 0.035-0.154 ms per layer in the scan at M <= 2 against dense's 0.072-0.193, and the integer
path lost even at one row there (0.22 against 0.05 ms at 576 x 1536 in the scan).

Why these two: in the scan, the form that matters for a model, the dequantize-then-dot path runs
at or below the dense f32 matmul from one row up to 64 (once 1.5x above: 576 x 576 at M=64)
while reading 1/5 (g=32) to 1/7 (g=128) of its bytes. Stacking the nibbles instead costs 4-14x
there at M <= 8 and 1.3-2.4x at M=64 (what is slow is the stack fused with the layer's slice
inside the loop: called alone it costs little more), hence the broadcast shift. At one row of
int4, the single-stream decode step, the integer path beat or tied it in the scan in every shape
and group size measured (1.4-4x faster, one tie); in three earlier runs it won or tied every
case too. From two rows up it loses: at M=2 it took 1.15-1.5x the dequantize's time in the scan
except at 576 x 576 (0.047 against 0.083 ms), 2.2-2.7x at M=8, and 2-25x at M=64, where the
per-group batched integer dots (depth g/2) starve XLA:CPU's integer GEMM. Its 16-bit activations
are the precision `int8_matmul`'s CPU path already uses for W8A16; the float path's own results
differ with M anyway (XLA:CPU's f32 GEMV and GEMM sum in different orders), so switching forms
at M=1 gives up no bitwise batch invariance that existed.

The codebook form (a table of 16 values, see packing.py) always dequantizes, then one f32 dot:
its values are not integers on a grid, so the one-row integer path does not apply. The codes
are looked up by `packing.lookup`'s select tree inside the same broadcast pass.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.groupwise_matmul.packing import lookup
from pallas_kernels.int8_matmul.quantize import QMAX, quantize_per_token

_BASE = 2 * QMAX  # a digit's residual is at most half its step: the next digit's full range


def dequantize_f32(q: jax.Array, scale: jax.Array, offset: jax.Array | None, *, bits: int,
                   group_size: int, table: jax.Array | None = None) -> jax.Array:  # [K, N] f32
  """`packing.dequantize` (or `dequantize_codebook`, given a [16] table) written as one
  broadcast: the two nibbles of each packed byte come from a shift by [0, 4] along a new half
  axis, never a stack of two arrays (inside a scan over layers, a stack fused with the layer's
  slice ran 4-14x slower: see above)."""
  g = group_size
  rows, n = q.shape  # [K/2, N] or [K, N]
  if bits == 4:
    p = q.reshape(2 * rows // g, 1, g // 2, n)  # [K/g, 1, g/2, N]
    shift = jnp.array([0, 4], jnp.uint8).reshape(1, 2, 1, 1)
    v = (p >> shift) & 15  # [K/g, 2, g/2, N]: a group's rows 0..g/2-1, then g/2..g-1
  else:
    v = q.reshape(rows // g, 1, g, n)
  if table is not None:
    w = lookup(v, lambda i: table[i]) * scale[:, None, None, :]
  else:
    w = v.astype(jnp.float32) * scale[:, None, None, :] + offset[:, None, None, :]
  return w.reshape(-1, n)


def _int4_row(x: jax.Array, q: jax.Array, scale: jax.Array, offset: jax.Array,
              group_size: int) -> jax.Array:  # [1, N] float32
  g = group_size
  k, n = x.shape[1], q.shape[1]
  groups = k // g
  d1, xs = quantize_per_token(x)  # [1, K] int8, [1]: x ~= xs * (d1 + d2 / BASE)
  r = (x.astype(jnp.float32) / xs[:, None] - d1.astype(jnp.float32)) * _BASE
  d2 = jnp.clip(jnp.round(r), -QMAX, QMAX).astype(jnp.int8)
  # [2 digits, K] -> [half, G, digit, g/2]: a group's first g/2 columns meet its low nibbles.
  digits = jnp.concatenate([d1, d2]).reshape(2, groups, 2, g // 2).transpose(2, 1, 0, 3)
  p = q.reshape(groups, g // 2, n)

  def dot(a, b):  # [G, 2, g/2] x [G, g/2, N] -> [G, 2, N] int32, exact
    return jnp.einsum("gdk,gkn->gdn", a, b, preferred_element_type=jnp.int32)

  acc = dot(digits[0], (p & 15).astype(jnp.int8)) + dot(digits[1], (p >> 4).astype(jnp.int8))
  xq = acc[:, 0].astype(jnp.float32) + acc[:, 1].astype(jnp.float32) / _BASE  # [G, N]
  x_sums = x.astype(jnp.float32).reshape(groups, g).sum(-1)  # [G]
  # y = xs * sum_g scale_g * xq_g + sum_g x_sums_g * offset_g, as one [1, 2G] x [2G, N] dot.
  lhs = jnp.concatenate([jnp.broadcast_to(xs, (groups,)), x_sums])[None]
  return jnp.dot(lhs, jnp.concatenate([xq * scale, offset]))


def groupwise_matmul_xla(
    x: jax.Array,  # [M, K] float
    q: jax.Array,  # [K/2, N] uint8 (bits 4) or [K, N] int8 (bits 8)
    scale: jax.Array,  # [K/g, N] float32
    offset: jax.Array | None,  # [K/g, N] float32; None with a table
    *,
    bits: int,
    group_size: int,
    table: jax.Array | None = None,  # [16] float32: the codebook form
) -> jax.Array:  # [M, N] x.dtype
  scale = scale.astype(jnp.float32)
  if table is None and bits == 4 and x.shape[0] == 1:
    return _int4_row(x, q, scale, offset.astype(jnp.float32), group_size).astype(x.dtype)
  w = dequantize_f32(q, scale, None if offset is None else offset.astype(jnp.float32), bits=bits,
                     group_size=group_size, table=table)  # [K, N]
  return jnp.dot(x.astype(jnp.float32), w).astype(x.dtype)
