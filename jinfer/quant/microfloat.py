"""The 4-bit micro-float formats, MXFP4 and NVFP4, as the group-wise codebook form: a float
model's weights rounded onto them (RTN), and their e2m1 table.

Both store e2m1 values (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6) in
blocks along K with a shared scale per block and output channel:

  MXFP4 (OCP Microscaling v1.0)  blocks of 32, an e8m0 scale (a power of two)
  NVFP4 (NVIDIA)                 blocks of 16, an e4m3 scale, times one float32 scale per tensor

The table holds e2m1 doubled, the integers 0..12 (as ggml stores them), and the block's scale
is kept halved in float32: every product stays exact, and the codes widen exactly to int8 codes
(`GroupwiseArray.affine`) where a kernel has no codebook form. NVFP4's tensor scale is folded
into the block scales (float32 products, rounded once); MXFP4's scales are exact.

Scales (RTN): MXFP4's is 2^(floor(log2 amax) - 2) as the OCP spec and gguf-py pick it (amax
lands in [4, 8) and values above 6 saturate), or twice that (no saturation, a coarser grid),
whichever reconstructs the block with less squared error. NVFP4's tensor scale is
amax / (6 * 448), so the largest block scale is e4m3's largest value, and each block's scale
is its amax / 6 rounded to e4m3 (NVIDIA's recipe). Values round to the nearest e2m1 value.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.quant.groupwise import GroupwiseArray
from pallas_kernels.groupwise_matmul.packing import pack_int4

# code -> e2m1 value doubled; codes 8..15 are the negatives of 0..7 (8 is -0)
E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
FORMATS = {"mxfp4": 32, "nvfp4": 16}  # format -> block size along K
_MIDPOINTS = (0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0)  # between consecutive doubled magnitudes
_E4M3_MAX = 448.0


def block_size(fmt: str) -> int:
  if fmt not in FORMATS:
    raise ValueError(f"unknown micro-float format {fmt!r}; choose one of {', '.join(FORMATS)}")
  return FORMATS[fmt]


def _codes(v: jax.Array) -> jax.Array:
  """v (in doubled e2m1 units) -> the code of its nearest table value (saturating at +-12)."""
  mag = sum((jnp.abs(v) > m).astype(jnp.int32) for m in _MIDPOINTS)  # 0..7
  return jnp.where(v < 0, mag + 8, mag)


def _error(w: jax.Array, half: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(codes, squared error per block [..., G, 1, N]) of w [..., G, g, N] at scales `half`."""
  q = _codes(w / half)
  wq = jnp.asarray(E2M1_DOUBLED)[q] * half
  return q, jnp.sum((wq - w) ** 2, axis=-2, keepdims=True)


def _round(w: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
  """w [..., K, N] -> (codes [..., K, N] int32, halved block scales [..., K/g, N] float32)."""
  g = block_size(fmt)
  *lead, k, n = w.shape
  if k % g:
    raise ValueError(f"{fmt} blocks of {g} do not divide K={k}")
  wg = w.astype(jnp.float32).reshape(*lead, k // g, g, n)
  amax = jnp.abs(wg).max(-2, keepdims=True)  # [..., G, 1, N]
  if fmt == "mxfp4":
    e = jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1.0))) - 2
    half = jnp.exp2(e - 1)  # the scale 2^e, halved for the doubled table
    q, err = _error(wg, half)
    q2, err2 = _error(wg, 2 * half)
    coarser = err2 < err
    q, half = jnp.where(coarser, q2, q), jnp.where(coarser, 2 * half, half)
  else:
    t_amax = jnp.abs(wg).max(axis=(-3, -2, -1), keepdims=True)  # per tensor (per leading index)
    tensor = jnp.where(t_amax > 0, t_amax / (6 * _E4M3_MAX), 1.0)
    block = (amax / 6 / tensor).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    # An all-zero block (or one below e4m3's range) has scale 0: any code reproduces it.
    half = jnp.where(block > 0, block, 1.0) * tensor / 2
    q = _codes(wg / half)
    half = jnp.where(block > 0, half, 0.0)
  return q.reshape(*lead, k, n), half[..., 0, :]


@functools.partial(jax.jit, static_argnames=("fmt",))
def quantize(w: jax.Array, fmt: str) -> GroupwiseArray:
  """w [lead..., K, N] (K contracts) -> its `fmt` codes in the codebook form, blocks along K for
  every output channel and leading index."""
  q, half = _round(w, fmt)
  lead = w.shape[:-2]
  return GroupwiseArray(q=pack_int4(q.astype(jnp.uint8), block_size(fmt)), scale=half,
                        offset=None, bits=4, group_size=block_size(fmt),
                        table=jnp.broadcast_to(jnp.asarray(E2M1_DOUBLED), (*lead, 16)))


@functools.partial(jax.jit, static_argnames=("fmt",))
def fake_quantize(w: jax.Array, fmt: str) -> jax.Array:
  """w [..., K, N] rounded onto `fmt` and back to float32 (AWQ's searches compare candidates
  this way)."""
  q, half = _round(w, fmt)
  g = block_size(fmt)
  *lead, k, n = w.shape
  vals = jnp.asarray(E2M1_DOUBLED)[q].reshape(*lead, k // g, g, n)
  return (vals * half[..., :, None, :]).reshape(*lead, k, n)
