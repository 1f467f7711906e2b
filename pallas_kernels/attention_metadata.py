"""Where a step's query rows sit in the paged KV cache: the one contract every attention
implementation reads.

A step's queries are packed flat (`[T, ...]`); sequence s owns rows `cu_q_lens[s]:cu_q_lens[s+1]`
and they are the last `q_len` positions of its `kv_len` tokens (their own K/V already written to
the cache). Rows past `cu_q_lens[num_seqs]` are padding: they write to the sink page, read
nothing and come out zero.

Row classes, by a sequence's query count `q_len`:
  * decode: `q_len == 1`;
  * verify: `1 < q_len <= verify_width` — speculative decoding's `[last, d1..dk]` rows on top of
    a cached context, or a tree of candidate nodes; handled like decodes, batched over sequences,
    never throttled as prefills;
  * prefill chunk: `q_len > verify_width`, causal.
The classes only choose how an implementation schedules its work; the result is the same.

Tree mask: for the rows of decode and verify sequences, bit `j` of a row says whether it sees
its sequence's `j`-th new row (absent: causal, row i sees new rows 0..i). A row must see itself
and only earlier rows (parents before children). A tree row's position is the cached context
length plus its depth (how many new rows it sees, minus one); sliding windows count from there,
and must be at least `verify_width` wide when a tree mask is given (so a row's ancestors are never
outside its window, whichever way their positions are counted).

Block table entries that are negative mark pages absent from this cache: their keys are
skipped. Attention over a subset of a sequence's pages (one context-parallel rank's, or one
split of a long context) is then the same call, and with the softmax state (the log-sum-exp of
each row's scores) partial results over disjoint pages merge exactly (`merge_attention`).
"""
from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class AttentionMetadata:
  slot_mapping: jax.Array  # [T] int32: layer-less slot (page * page_size + offset) of each new K/V
  block_table: jax.Array  # [S, P] int32: pages of each sequence; negative = absent here
  kv_lens: jax.Array  # [S] int32: tokens in the cache per sequence, this step's included
  cu_q_lens: jax.Array  # [S+1] int32: sequence s owns query rows cu_q_lens[s]:cu_q_lens[s+1]
  num_seqs: jax.Array  # [1] int32: live sequences; rows past them are padding
  tree_mask: jax.Array | None = None  # [T, verify_width] bool: see the module docstring
  # [S, P'] int32 each, or None: the present pages of each sequence (a subset of block_table's,
  # e.g. one context-parallel rank's) first and in position order, and each one's index among
  # the sequence's pages (its first key's position // page_size); -1 pads. The jnp backend's
  # context loops walk these instead of every block table entry, so their work follows the
  # pages present. None: block_table's entries, in order. Results are the same either way.
  context_pages: jax.Array | None = None
  context_page_pos: jax.Array | None = None
  # Static bound on any sequence's query count this step (1 for decode-only steps).
  max_q_len: int | None = struct.field(pytree_node=False, default=None)
  # Static bound on how many sequences are prefill chunks (q_len > verify_width) this step.
  max_prefill_seqs: int | None = struct.field(pytree_node=False, default=None)
  # Static: sequences with q_len <= verify_width are decode/verify rows (see above).
  verify_width: int = struct.field(pytree_node=False, default=1)

  def __post_init__(self):
    if self.verify_width < 1:
      raise ValueError(f"verify_width must be >= 1, got {self.verify_width}")
    # jax may rebuild the dataclass around placeholder leaves: check real arrays only.
    shape = getattr(self.tree_mask, "shape", None)
    if shape is not None and shape[-1] != self.verify_width:
      raise ValueError(f"tree_mask has {shape[-1]} columns; verify_width is {self.verify_width}")
