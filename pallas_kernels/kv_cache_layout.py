"""The paged KV cache layout: defined here once, used by the model, the engine and every kernel.

One array per layer, shape `[num_pages, 2, num_kv_heads, page_size, head_dim]`:
axis 1 is K (0) / V (1). A page of one KV head is a contiguous `[page_size, head_dim]` tile, so a
kernel DMAs it with a plain (unstrided) copy and the interpreter's no-strided-load limit never
bites. Page 0 is the sink: padding tokens write there and no block table entry ever reads it.
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
  def layer_shape(self) -> tuple[int, ...]:
    return (self.num_pages, 2, self.num_kv_heads, self.page_size, self.head_dim)

  @property
  def bytes_per_token(self) -> int:
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

  def allocate(self) -> list[jax.Array]:
    return [jnp.zeros(self.layer_shape, self.dtype) for _ in range(self.num_layers)]


def write_kv(cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
  """Scatter new K/V rows into their slots.

  cache: [num_pages, 2, Hkv, page_size, D]; k, v: [T, Hkv, D]; slot_mapping: [T] int32 with
  slot = page * page_size + offset (padding rows point into the sink page).
  """
  page_size = cache.shape[3]
  pages = slot_mapping // page_size  # [T]
  offs = slot_mapping % page_size  # [T]
  kv = jnp.stack([k, v], axis=1).astype(cache.dtype)  # [T, 2, Hkv, D]
  # Advanced indices (pages, offs) are separated by slices, so the indexed result is laid out
  # [T, 2, Hkv, D], matching kv.
  return cache.at[pages, :, :, offs, :].set(kv, mode="drop", unique_indices=False)
