"""Ragged paged attention: one entry point, implementations chosen by `backend`."""
from __future__ import annotations

from typing import Any

import jax

from pallas_kernels.ragged_paged_attention.pallas_gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention.pallas_tpu import ragged_paged_attention_tpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

_IMPLS = {
    "reference": ragged_paged_attention_reference,
    "pallas_tpu": ragged_paged_attention_tpu,
    "pallas_gpu": ragged_paged_attention_gpu,
}
BACKENDS = tuple(_IMPLS)


def default_backend() -> str:
  """The implementation for the platform jax runs on: the Pallas kernel there, else the reference."""
  return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "reference")


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array,  # [num_pages, 2, Hkv, page_size, D]
    kv_lens: jax.Array,  # [S]
    page_indices: jax.Array,  # [S, P]
    cu_q_lens: jax.Array,  # [S+1]
    num_seqs: jax.Array,  # [1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    max_q_len: int | None = None,
    max_prefill_seqs: int | None = None,
    backend: str = "reference",
    interpret: Any = False,
    **block_sizes: int,
) -> jax.Array:  # [T, Hq, D]
  """Causal attention of a flat ragged batch of queries over a paged KV cache.

  Static hints the engine passes so work follows the batch: `max_q_len` bounds any sequence's
  query count (1 for decode-only steps), `max_prefill_seqs` how many sequences have more than one
  query. Kernels may use them to size their work.
  `interpret` runs a Pallas backend in interpret mode (True, or `pltpu.InterpretParams` for the
  TPU kernel) so it works on the CPU; `block_sizes` go to the implementation (see its docstring).
  """
  if backend not in _IMPLS:
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
  kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
            v_scale=v_scale, max_q_len=max_q_len)
  if backend != "reference":
    kw.update(interpret=interpret, **block_sizes)
  elif interpret:
    raise ValueError("the reference backend has no interpret mode")
  else:
    kw.update(max_prefill_seqs=max_prefill_seqs, **block_sizes)
  return _IMPLS[backend](q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, **kw)
