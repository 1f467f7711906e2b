"""What a forward needs to know about where tokens sit in the paged KV cache."""
from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class AttentionMetadata:
  slot_mapping: jax.Array  # [T] int32: page * page_size + offset where each new K/V goes
  block_table: jax.Array  # [S, P] int32: pages of each sequence (P may be a bucketed prefix)
  kv_lens: jax.Array  # [S] int32: tokens in the cache per sequence, this step's included
  cu_q_lens: jax.Array  # [S+1] int32: sequence s owns query rows cu_q_lens[s]:cu_q_lens[s+1]
  num_seqs: jax.Array  # [1] int32: live sequences; rows past them are padding
  # Static bound on any sequence's query count this step (1 for decode-only steps).
  max_q_len: int | None = struct.field(pytree_node=False, default=None)
  # Static bound on how many sequences have more than one query this step.
  max_prefill_seqs: int | None = struct.field(pytree_node=False, default=None)
