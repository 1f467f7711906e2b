"""Ragged paged attention: one entry point, one contract (`AttentionMetadata`), implementations
chosen by `backend`:

  reference   the dense oracle, obviously right (tests only)
  xla         the tuned pure-jnp path; what runs on the CPU
  pallas_tpu  Mosaic TPU kernel
  pallas_gpu  Pallas GPU kernel (Triton lowering)
"""
from __future__ import annotations

from typing import Any

import jax

from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.kv_cache_layout import KVCache, QuantizedKVCache, rotate_keys
from pallas_kernels.ragged_paged_attention.pallas_gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention.pallas_tpu import ragged_paged_attention_tpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.softmax_state import merge_attention
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

_IMPLS = {
    "reference": ragged_paged_attention_reference,
    "xla": ragged_paged_attention_xla,
    "pallas_tpu": ragged_paged_attention_tpu,
    "pallas_gpu": ragged_paged_attention_gpu,
}
BACKENDS = tuple(_IMPLS)
_PALLAS = ("pallas_tpu", "pallas_gpu")

__all__ = ["BACKENDS", "default_backend", "merge_attention", "ragged_paged_attention"]


def default_backend() -> str:
  """The implementation for the platform jax runs on: the Pallas kernel there, else XLA's."""
  return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "xla")


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: KVCache,  # [L, num_pages, 2, Hkv, page_size, D], see kv_cache_layout.py
    md: AttentionMetadata,
    *,
    layer: jax.Array | int = 0,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    return_softmax_state: bool = False,
    backend: str = "xla",
    interpret: Any = False,
    **block_sizes: int,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [T, Hq, D] (, lse [T, Hq] float32)
  """Attention of a flat ragged batch of queries over layer `layer` of a paged KV cache, by the
  rules of `AttentionMetadata` (row classes, tree mask, absent pages).

  `kv_cache` is an array of K/V as they are, or a `QuantizedKVCache` (int8 / fp8 values with a
  scale per token and KV head) that every backend dequantizes as it reads; its keys are stored
  rotated (`kv_cache_layout.rotate_keys`), so the queries are rotated here, for every backend.
  `layer` and `sliding_window` may be traced (a layer scan passes them per layer); a window
  wider than any sequence means none. With `return_softmax_state` the row log-sum-exp comes
  too, so results over disjoint pages merge with `merge_attention`.
  `interpret` runs a Pallas backend in interpret mode (True, or `pltpu.InterpretParams` for the
  TPU kernel) so it works on the CPU; the jnp backends run anywhere and ignore it.
  `block_sizes` go to the implementation (see its docstring).
  """
  if backend not in _IMPLS:
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
  kw = dict(layer=layer, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            k_scale=k_scale, v_scale=v_scale, return_softmax_state=return_softmax_state)
  if backend in _PALLAS:
    kw["interpret"] = interpret
  if isinstance(kv_cache, QuantizedKVCache):
    q = rotate_keys(q).astype(q.dtype)  # [T, Hq, D]
  return _IMPLS[backend](q, kv_cache, md, **kw, **block_sizes)
