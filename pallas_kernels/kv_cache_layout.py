"""The paged KV cache layout: defined here once, used by the model, the engine and every kernel.

One array for all layers, shape `[num_layers, num_pages, 2, num_kv_heads, page_size, head_dim]`:
axis 2 is K (0) / V (1). It is carried through the layer stack and donated to the step, so every
layer writes its new K/V in place and the kernels read pages straight out of it at
`[layer, page]` — no layer's slice is ever copied out. A page of one layer and one KV head is a
contiguous `[page_size, head_dim]` tile, so a kernel DMAs it with a plain (unstrided) copy and
the interpreter's no-strided-load limit never bites. Page 0 is the sink: padding tokens write
there and no block table entry ever reads it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SINK_PAGE = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
  num_layers: int
  num_pages: int
  page_size: int
  num_kv_heads: int
  head_dim: int
  dtype: jnp.dtype = jnp.float32

  @property
  def shape(self) -> tuple[int, ...]:
    return (self.num_layers, self.num_pages, 2, self.num_kv_heads, self.page_size, self.head_dim)

  @property
  def bytes_per_token(self) -> int:
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

  @property
  def nbytes(self) -> int:
    return self.num_pages * self.page_size * self.bytes_per_token

  def allocate(self) -> jax.Array:
    return jnp.zeros(self.shape, self.dtype)


def write_kv(cache: jax.Array, layer: jax.Array | int, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> jax.Array:
  """Scatter one layer's new K/V rows into their slots, in place when the cache is donated.

  cache: [L, num_pages, 2, Hkv, page_size, D]; layer: scalar (traced under a layer scan);
  k, v: [T, Hkv, D]; slot_mapping: [T] int32 with slot = page * page_size + offset (padding rows
  point into the sink page).
  """
  page_size = cache.shape[4]
  pages = slot_mapping // page_size  # [T]
  offs = slot_mapping % page_size  # [T]
  kv = jnp.stack([k, v], axis=1).astype(cache.dtype)  # [T, 2, Hkv, D]
  # The advanced indices (layer, pages, offs) broadcast to [T] and are separated by slices, so
  # the indexed result is laid out [T, 2, Hkv, D], matching kv.
  return cache.at[layer, pages, :, :, offs, :].set(kv, mode="drop", unique_indices=False)


def copy_slots(cache: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
  """Copy every layer's K/V from slots `src` to slots `dst` [N] (all read before any is
  written; a negative `dst` copies nothing). In place when the cache is donated."""
  page_size = cache.shape[4]
  kv = cache[:, src // page_size, :, :, src % page_size, :]  # [N, L, 2, Hkv, D]
  pages = jnp.where(dst >= 0, dst // page_size, cache.shape[1])  # out of range: dropped
  return cache.at[:, pages, :, :, dst % page_size, :].set(kv, mode="drop")
