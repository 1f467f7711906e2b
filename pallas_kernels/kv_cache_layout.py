"""The paged KV cache layout: defined here once, used by the model, the engine and every kernel.

One array for all layers, shape `[num_layers, num_pages, 2, num_kv_heads, page_size, head_dim]`:
axis 2 is K (0) / V (1). It is carried through the layer stack and donated to the step, so every
layer writes its new K/V in place and the kernels read pages straight out of it at
`[layer, page]` — no layer's slice is ever copied out. A page of one layer and one KV head is a
contiguous `[page_size, head_dim]` tile, so a kernel DMAs it with a plain (unstrided) copy and
the interpreter's no-strided-load limit never bites. Page 0 is the sink: padding tokens write
there and no block table entry ever reads it. The leading axis is really a layer *slot*: an
engine may put several layers in one slot when they use disjoint pages (each layer's `layer`
index and block table say which), and a kernel never needs to know.

Quantized caches (vLLM's `kv_cache_dtype` "int8" and "fp8") are a `QuantizedKVCache`, one pytree
of two arrays carried and donated together:
  values  [L, num_pages, 2, Hkv, page_size, D]  int8 or float8_e4m3fn, the layout above;
  scales  [L, num_pages, 2, Hkv, page_size]     float32, the same layout less head_dim.
Each token's K (and V) of each KV head is scaled by its own absmax over head_dim (symmetric:
int8 in [-127, 127], fp8 in [-448, 448]), so `K = values * scales[..., None]`. K is stored
rotated: `K @ R` with R an orthonormal Hadamard matrix over head_dim (`key_rotation`), and the
attention entry point rotates the queries the same way ((q R).(k R) = q.k), so no kernel knows.
The rotation spreads the few outlier channels that RoPE'd keys carry over the whole head before
the absmax is taken: on SmolLM2-135M (fixed 512-token text) int8 keys cost +0.40% perplexity
unrotated, -0.01% rotated; values cost ~0 either way and are stored as they are. Why this way:
  * a token's scale depends on that token alone: writing a row never rescales rows written before,
    a page is final once written (prefix caching shares it as is), and results do not depend on
    what else is in the batch;
  * the scales of a page sit beside its values at the same `[layer, page]` index, so a kernel
    fetches a page with two plain DMAs (values, then its `[2, Hkv, page_size]` scales), and a
    row gather in the GPU kernel indexes both arrays with the same row number;
  * a separate array keeps the value tiles' lanes exactly head_dim wide: scales packed into the
    values' last axis would need in-kernel bitcasts and break the lane alignment.
Cost per token and head: D value bytes + 4 scale bytes for K and V each (head_dim 64: 68 bytes
against 128 in bfloat16 and 256 in float32).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

SINK_PAGE = 0
SCALE_DTYPE = jnp.float32
# The largest magnitude each quantized dtype stores: a row's absmax maps onto it.
QUANTIZED_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


@struct.dataclass
class QuantizedKVCache:
  """A quantized KV cache (see the module docstring): K/V = values * scales[..., None]."""
  values: jax.Array  # [L, num_pages, 2, Hkv, page_size, D] int8 or float8_e4m3fn
  scales: jax.Array  # [L, num_pages, 2, Hkv, page_size] float32

  @property
  def nbytes(self) -> int:
    return self.values.nbytes + self.scales.nbytes

  def is_deleted(self) -> bool:
    return self.values.is_deleted() or self.scales.is_deleted()


KVCache = jax.Array | QuantizedKVCache


def is_quantized_dtype(dtype) -> bool:
  return jnp.dtype(dtype) in QUANTIZED_MAX


def split_cache(cache: KVCache) -> tuple[jax.Array, jax.Array | None]:
  """(values, scales), scales None for a cache that stores K/V as they are."""
  if isinstance(cache, QuantizedKVCache):
    return cache.values, cache.scales
  return cache, None


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """x [..., D] -> (values [..., D] of `dtype`, scales [...] float32), one scale per row."""
  qmax = QUANTIZED_MAX[jnp.dtype(dtype)]
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=-1) / qmax  # [...]; 0 for an all-zero row
  y = jnp.clip(x / jnp.where(scale > 0, scale, 1.0)[..., None], -qmax, qmax)
  if jnp.issubdtype(dtype, jnp.integer):
    y = jnp.round(y)
  # Clipped first: a quotient a rounding step past the largest float8 would convert to NaN.
  return y.astype(dtype), scale.astype(SCALE_DTYPE)


@functools.cache
def key_rotation(head_dim: int) -> np.ndarray:  # [D, D] float32, orthonormal and symmetric
  """Sylvester's Hadamard matrix / sqrt(size), block-diagonal over the powers of two that sum to
  head_dim when it is not one (64 + 16 for 80): orthonormal whatever the head size."""
  blocks, d = [], head_dim
  while d:
    n = 1 << (d.bit_length() - 1)
    h = np.ones((1, 1))
    while h.shape[0] < n:
      h = np.block([[h, h], [h, -h]])
    blocks.append(h / np.sqrt(n))
    d -= n
  out = np.zeros((head_dim, head_dim), np.float32)
  i = 0
  for b in blocks:
    out[i:i + len(b), i:i + len(b)] = b
    i += len(b)
  return out


def rotate_keys(x: jax.Array) -> jax.Array:
  """x [..., D] @ key_rotation(D), in float32 (the rotation is its own inverse)."""
  r = key_rotation(x.shape[-1])
  return jnp.matmul(x.astype(jnp.float32), r, precision=jax.lax.Precision.HIGHEST)


def quantize_pages(pages: jax.Array, dtype) -> QuantizedKVCache:
  """A float cache [..., 2, Hkv, page_size, D] in the quantized layout: K rotated, then K and V
  quantized per row. What write_kv stores, for caches built whole (tests, conversions)."""
  k = rotate_keys(pages[..., 0, :, :, :])
  kv = jnp.stack([k, pages[..., 1, :, :, :].astype(jnp.float32)], axis=-4)
  return QuantizedKVCache(*quantize(kv, dtype))


def dequantize(values: jax.Array, scales: jax.Array | None, dtype=jnp.float32) -> jax.Array:
  """values [..., D], scales [...] (None: unquantized) -> [..., D] of `dtype`."""
  x = values.astype(jnp.float32 if scales is not None else dtype)
  return x if scales is None else (x * scales[..., None]).astype(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
  num_layers: int
  num_pages: int
  page_size: int
  num_kv_heads: int
  head_dim: int
  # What the cache stores: the model's float dtype, or int8 / float8_e4m3fn with scales.
  dtype: jnp.dtype = jnp.float32

  @property
  def quantized(self) -> bool:
    return is_quantized_dtype(self.dtype)

  @property
  def shape(self) -> tuple[int, ...]:
    return (self.num_layers, self.num_pages, 2, self.num_kv_heads, self.page_size, self.head_dim)

  @property
  def bytes_per_token(self) -> int:
    """K and V of one token over every layer and KV head, scales included."""
    row = self.head_dim * jnp.dtype(self.dtype).itemsize
    if self.quantized:
      row += jnp.dtype(SCALE_DTYPE).itemsize
    return 2 * self.num_layers * self.num_kv_heads * row

  @property
  def nbytes(self) -> int:
    return self.num_pages * self.page_size * self.bytes_per_token

  def allocate(self) -> KVCache:
    if not self.quantized:
      return jnp.zeros(self.shape, self.dtype)
    return QuantizedKVCache(values=jnp.zeros(self.shape, self.dtype),
                            scales=jnp.zeros(self.shape[:-1], SCALE_DTYPE))


def write_kv(cache: KVCache, layer: jax.Array | int, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> KVCache:
  """Scatter one layer's new K/V rows into their slots (K rotated and both quantized first if
  the cache is), in place when the cache is donated.

  cache: see the module docstring; layer: scalar (traced under a layer scan);
  k, v: [T, Hkv, D]; slot_mapping: [T] int32 with slot = page * page_size + offset (padding rows
  point into the sink page).
  """
  values, scales = split_cache(cache)
  page_size, hkv = values.shape[4], values.shape[3]
  pages = (slot_mapping // page_size)[:, None, None]  # [T, 1, 1]
  offs = (slot_mapping % page_size)[:, None, None]
  kv = jnp.stack([k, v], axis=1)  # [T, 2, Hkv, D]
  # Every axis but head_dim indexed (the indices broadcast to [T, 2, Hkv]): each update is one
  # row of D values, the cache's innermost axis. A scatter whose windows also spanned K/V and
  # the heads (strided rows of [page_size, D] tiles) made XLA:TPU pick another layout for the
  # cache inside the layer loop and copy the whole cache to it and back around every layer's
  # write (found by the compile-only tier: a 64-token Llama-3.1-8B step asked for 47 GB).
  at = (layer, pages, jnp.arange(2)[None, :, None], jnp.arange(hkv)[None, None, :], offs)
  if scales is None:
    return values.at[at].set(kv.astype(values.dtype), mode="drop", unique_indices=False)
  kv, kv_scales = quantize(jnp.stack([rotate_keys(k), v.astype(jnp.float32)], axis=1),
                           values.dtype)
  return QuantizedKVCache(
      values=values.at[at].set(kv, mode="drop", unique_indices=False),
      scales=scales.at[at].set(kv_scales, mode="drop", unique_indices=False))


def copy_slots(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
  """Copy every layer's K/V (and scales) from slots `src` to slots `dst` [N] (all read before
  any is written; a negative `dst` copies nothing). In place when the cache is donated."""

  def copy(x):  # values [L, P, 2, Hkv, ps, D] or scales [L, P, 2, Hkv, ps]
    page_size = x.shape[4]
    rows = x[:, src // page_size, :, :, src % page_size]  # [N, L, 2, Hkv(, D)]
    pages = jnp.where(dst >= 0, dst // page_size, x.shape[1])  # out of range: dropped
    return x.at[:, pages, :, :, dst % page_size].set(rows, mode="drop")

  return jax.tree.map(copy, cache)
