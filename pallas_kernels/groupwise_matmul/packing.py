"""The group-wise quantized weight format every int4 path shares (kernels, quantizers, loaders).

A weight `w [K, N]` (K contracts with the input) is cut along K into groups of `group_size`
rows; each group and output channel has a float32 `scale` and `offset`:

    w[k, n] = q[k, n] * scale[k // g, n] + offset[k // g, n]

with `q` unsigned 4-bit (0..15) when `bits == 4`, signed 8-bit when `bits == 8`. The affine
form covers every published scheme exactly: symmetric int4 (offset = -8 * scale), AWQ/GPTQ
integer zero points (offset = -zero * scale), GGUF's Q4_0 / Q4_1 (d * q + m) and the K-quants
(sub-block scale d * sc, offset -dmin * m).

4-bit values are packed two per byte *within each group*: byte row j of a group holds row j in
its low nibble and row j + g/2 in its high nibble. A kernel block that covers whole groups then
unpacks with a mask and a shift into two contiguous halves of the group, no interleaving:

    packed [K/2, N] uint8  ->  low = p & 15 (rows 0..g/2-1 of each group), high = p >> 4

The codebook form: 4-bit codes that index a table of 16 float32 values instead of an affine grid,
with one scale per group and output channel and no offset,

    w[k, n] = table[q[k, n]] * scale[k // g, n]

packed the same way. It carries the formats whose values are not evenly spaced: GGUF's IQ4_NL
and IQ4_XS (a fixed non-uniform table), MXFP4 and NVFP4 (e2m1 micro-floats). The kernels look
a code up by its four bits, a tree of 15 selects (`lookup`), which Mosaic and Triton lower
where a gather would not; the oracle (`dequantize_codebook`) gathers.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BITS = (4, 8)
CODES = 16  # entries of a codebook table


def pack_int4(q: jax.Array, group_size: int) -> jax.Array:
  """q [..., K, N] integers in [0, 16) -> [..., K/2, N] uint8, packed per group (see above)."""
  *lead, k, n = q.shape
  if k % group_size or group_size % 2:
    raise ValueError(f"K={k} must be a multiple of an even group size, got {group_size}")
  g = q.astype(jnp.uint8).reshape(*lead, k // group_size, 2, group_size // 2, n)
  return (g[..., 0, :, :] | (g[..., 1, :, :] << 4)).reshape(*lead, k // 2, n)


def unpack_int4(p: jax.Array, group_size: int) -> jax.Array:
  """[..., K/2, N] uint8 -> q [..., K, N] uint8 in [0, 16)."""
  *lead, k2, n = p.shape
  g = p.reshape(*lead, 2 * k2 // group_size, group_size // 2, n)
  return jnp.stack([g & 15, g >> 4], axis=-3).reshape(*lead, 2 * k2, n)


def dequantize(q: jax.Array, scale: jax.Array, offset: jax.Array, *, bits: int,
               group_size: int) -> jax.Array:
  """The float32 weight [..., K, N] that (q, scale [..., K/g, N], offset [..., K/g, N]) stand
  for; `q` packed when bits == 4."""
  if bits not in BITS:
    raise ValueError(f"bits must be one of {BITS}, got {bits}")
  v = unpack_int4(q, group_size) if bits == 4 else q
  *lead, k, n = v.shape
  v = v.astype(jnp.float32).reshape(*lead, k // group_size, group_size, n)
  w = v * scale[..., :, None, :] + offset[..., :, None, :]
  return w.reshape(*lead, k, n)


def lookup(v: jax.Array, entry) -> jax.Array:
  """table[v] for codes v (any int shape, values in [0, 16)) as float32, from `entry(i)`, the
  table's i-th value (a scalar, or anything broadcasting against v): the code's bits pick
  between halves of the table, lowest bit first, 8 + 4 + 2 + 1 selects."""
  level = [entry(i) for i in range(CODES)]
  bit = 0
  while len(level) > 1:
    b = ((v >> bit) & 1) == 1
    level = [jnp.where(b, hi, lo) for lo, hi in zip(level[0::2], level[1::2])]
    bit += 1
  return jnp.broadcast_to(level[0], v.shape).astype(jnp.float32)


def dequantize_codebook(q: jax.Array, scale: jax.Array, table: jax.Array, *,
                        group_size: int) -> jax.Array:
  """The float32 weight [..., K, N] that packed codes q [..., K/2, N], scale [..., K/g, N] and
  table [..., 16] stand for: table[q] * scale."""
  v = unpack_int4(q, group_size).astype(jnp.int32)
  *lead, k, n = v.shape
  vals = jnp.take_along_axis(table.astype(jnp.float32)[..., None, :], v.reshape(*lead, 1, k * n),
                             axis=-1)  # [..., 1, K*N]: a plain gather, the obvious reading
  vals = vals.reshape(*lead, k // group_size, group_size, n)
  return (vals * scale[..., :, None, :]).reshape(*lead, k, n)
