"""A draft model proposer: a small model with the target's tokenizer guesses k tokens per
sequence, in one jitted loop per step, ahead of the target's verify step.

Its KV cache is its own, with the target's page geometry and kv_cache_dtype, indexed by the same
block tables: a page holds the same positions in both caches, so prefix hits, preemption and
rollback need no bookkeeping of their own. Each step the draft runs
  1. one pass over the step's flat batch without the drafts: prefill chunks alongside the
     target's, and for a decoding sequence the tokens its cache lacks (`Sequence.draft_lag`,
     then the last token), giving d_1 from the last row;
  2. k - 1 passes of one row per sequence, each feeding the previous draft to get the next.
Rows a sequence does not need (it verifies fewer than k drafts) write to the sink page.
A step where nobody speculates runs pass 1 alone, without the head, to keep the cache whole.

Draft tokens are drawn from the draft's distribution under the request's own processing, with
the random number the target's sampler uses for the same position (see `_sample_draft`).
"""
from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jinfer.sampling.accept import VerifyTensors, row_tensors
from jinfer.config import ModelConfig
from jinfer.engine.engine_config import KV_STORAGE_DTYPES, ResolvedConfig
from jinfer.engine.request import Sequence
from jinfer.engine.scheduler import ScheduledBatch
from jinfer.engine.step_input import Buckets, StepInput, empty_step_input, to_step_input
from jinfer.models import CausalLM, unstack_layers
from jinfer.quant.qarray import param_bytes
from jinfer.sampling.sample import SamplingTensors, _argmax, any_penalty, ban, choose, penalize
from jinfer.engine.speculative.config import SpeculativeConfig
from jinfer.engine.speculative.draft_checkpoint import is_draft_checkpoint, load_draft
from jinfer.engine.speculative.proposer import Proposer, Target
from jinfer.loader import load_model
from pallas_kernels import AttentionMetadata, KVCacheSpec
from pallas_kernels.kv_cache_layout import SINK_PAGE

log = logging.getLogger(__name__)
_PROBE = "Speculative decoding checks the draft's guesses: 3.14, naïve café, def f(x): return x"


@struct.dataclass
class DraftInput:
  """The draft's passes over one step. Pass 1 is a flat batch of `T` rows like the target's;
  passes 2..k have one row per sequence, fed the previous pass's draft."""
  token_ids: jax.Array  # [T] int32
  positions: jax.Array  # [T] int32
  md: AttentionMetadata  # pass 1; the block table is the target's
  logits_indices: jax.Array  # [S] int32: each sequence's last row in pass 1
  slots: jax.Array  # [S, K-1] int32: where pass 2..k writes each sequence's K/V (sink: unused)
  kv_lens: jax.Array  # [S, K-1] int32: the sequence's tokens in the cache in pass 2..k


def _sample_draft(logits: jax.Array, st: SamplingTensors, vt: VerifyTensors, vocab: jax.Array,
                  vocab_size: int) -> jax.Array:
  """The draft's token [S] for chain index `vt.row_depth` of every sequence: the request's
  processing over the draft's logits [S, Vd] (-inf outside its vocabulary), then its argmax or a
  draw with the very random number the target draws that token with. The target accepts a draft
  only where its own draw is the same token (`jinfer/sampling/accept.py`); sharing the number
  makes the two draws agree wherever the draft's distribution is close to the target's."""
  s = logits.shape[0]
  rst = row_tensors(st, vt, with_history=False)

  def processed(logits):  # the request's processing needs the whole vocabulary
    x = jnp.full((s, vocab_size), -jnp.inf, logits.dtype).at[:, vocab].set(logits)
    x = jax.lax.cond(any_penalty(st),
                     lambda l: penalize(l, row_tensors(st, vt, with_history=True)),
                     lambda l: l, x)
    return choose(ban(x, rst.banned), rst)

  # All greedy with nothing to process (the common case): the argmax over the draft's own
  # vocabulary, without scattering every row to the full one ([S, V] writes each pass).
  plain = jnp.all(st.temperature <= 0) & ~any_penalty(st) & jnp.all(rst.banned < 0)
  return jax.lax.cond(plain, lambda l: vocab[_argmax(l)], processed, logits)


def _unmasked(st: SamplingTensors) -> SamplingTensors:
  """The draft never applies structured-output masks (a constrained sequence does not draft
  with it); without them its passes take the same inputs beside plain and verify steps."""
  return st.replace(allowed=None)


def _propose(model: CausalLM, k: int, vocab_size: int, propose: bool, params, head, vocab,
             kv_cache, inp: DraftInput, st: SamplingTensors, ban_rows) -> tuple:
  apply = functools.partial(model.apply, {"params": params}, return_hidden=True)
  _, hidden, kv_cache = apply(inp.token_ids, inp.positions, kv_cache, inp.md,
                              inp.logits_indices)
  if not propose:  # the hidden states go unused: XLA drops the head and the sampling
    return None, kv_cache
  s = inp.logits_indices.shape[0]
  drafts = jnp.zeros((s, k), jnp.int32)
  vt = lambda drafts, i: VerifyTensors(
      draft_tokens=drafts, num_drafts=jnp.full(s, k, jnp.int32),
      row_seq=jnp.arange(s, dtype=jnp.int32), row_depth=jnp.full(s, i, jnp.int32),
      chain=jnp.zeros((s, k + 1), jnp.int32), ban_rows=ban_rows)
  drafts = drafts.at[:, 0].set(_sample_draft(hidden @ head.T, st, vt(drafts, 0), vocab,
                                             vocab_size))
  one_row = jnp.minimum(jnp.arange(s + 1, dtype=jnp.int32), inp.md.num_seqs[0])

  def step(i, carry):  # pass i + 1 feeds d_i, proposes d_{i+1}
    drafts, kv_cache = carry
    kv_lens = inp.kv_lens[:, i - 1]
    md = AttentionMetadata(slot_mapping=inp.slots[:, i - 1], block_table=inp.md.block_table,
                           kv_lens=kv_lens, cu_q_lens=one_row, num_seqs=inp.md.num_seqs,
                           max_q_len=1, max_prefill_seqs=0)
    _, hidden, kv_cache = apply(drafts[:, i - 1], kv_lens - 1, kv_cache, md,
                                jnp.arange(s, dtype=jnp.int32))
    token = _sample_draft(hidden @ head.T, st, vt(drafts, i), vocab, vocab_size)
    return drafts.at[:, i].set(token), kv_cache

  return jax.lax.fori_loop(1, k, step, (drafts, kv_cache))


class DraftModelProposer(Proposer):
  """`vocab`: the draft's vocabulary (target ids); None: the whole of it."""
  host_drafts = False  # they reach the target as a device array

  def __init__(self, k: int, config: ModelConfig, params: dict, vocab: np.ndarray | None,
               engine_config: ResolvedConfig, buckets: Buckets, dtype):
    super().__init__(k)
    self.config, self.buckets = config, buckets
    # Where the target runs its small steps unrolled (the CPU, unless `scan_layers` says
    # otherwise; see `ResolvedConfig.unrolled_max_tokens`), the draft runs every pass unrolled:
    # its passes are a few rows each, and with its few layers the compile stays cheap.
    unrolled = engine_config.unrolled_max_tokens() > 0
    self.model = CausalLM(config, engine_config.kernel_options(), dtype=dtype,
                          scan_layers=not unrolled)
    self.params = unstack_layers(params, config.num_layers) if unrolled else params
    if vocab is None:
      vocab = np.arange(config.vocab_size, dtype=np.int32)
    self.vocab = jnp.asarray(vocab, jnp.int32)
    if config.tie_word_embeddings:
      head = params["embedding"]
    else:
      head = params["lm_head"]["kernel"].T
    # [Vd, E]: the head's rows for the draft's vocabulary (all of it shares the array).
    self.head = head if len(vocab) == config.vocab_size else head[self.vocab]
    # The draft's cache stores what the target's does (kv_cache_dtype: int8 / fp8 pages are
    # quantized the same way), so it takes the same share of memory.
    self.spec = KVCacheSpec(num_layers=config.num_layers, num_pages=engine_config.num_pages,
                            page_size=engine_config.cache.page_size,
                            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                            dtype=KV_STORAGE_DTYPES.get(engine_config.cache.kv_cache_dtype,
                                                        dtype))
    self.page_size = engine_config.cache.page_size
    self.kv_cache = self.spec.allocate()
    self._cache_resets = 0
    self._propose = jax.jit(functools.partial(_propose, self.model, k, config.vocab_size),
                            static_argnums=(0,), donate_argnums=(4,))

  @classmethod
  def create(cls, spec: SpeculativeConfig, target: Target) -> "DraftModelProposer":
    """A distilled draft checkpoint (sharing the target's embedding), or any model (built-in
    name, HF directory, .gguf) with the target's tokenizer."""
    dtype, tokenizer = target.dtype, target.tokenizer
    if is_draft_checkpoint(spec.model):
      config, params, vocab = load_draft(spec.model, target.config, target.params, dtype)
    else:
      try:
        config, params, draft_tok = load_model(spec.model, dtype)
      except FileNotFoundError:  # a model directory without tokenizer files: ids must do
        config, params, draft_tok = load_model(spec.model, dtype, load_tokenizer=False)
      if config.vocab_size != target.config.vocab_size or (
          None not in (tokenizer, draft_tok) and draft_tok.encode(_PROBE) != tokenizer.encode(_PROBE)):
        raise ValueError(f"speculative_config: the draft model {spec.model!r} does not share "
                         f"the target's tokenizer (vocabulary {config.vocab_size} vs "
                         f"{target.config.vocab_size})")
      vocab = None
    log.info("draft model %s: %d layers, vocabulary %d", spec.model, config.num_layers,
             config.vocab_size if vocab is None else len(vocab))
    return cls(spec.num_speculative_tokens, config, params, vocab, target.engine_config,
               target.buckets, dtype)

  # -- the proposer interface ---------------------------------------------------------------
  def propose(self, batch: ScheduledBatch, inp: StepInput) -> jax.Array | None:
    speculating = inp.verify is not None
    d = self._input(batch, inp)
    ban_rows = (inp.verify.tensors.ban_rows if speculating
                else np.zeros(inp.logits_indices.shape, np.int32))
    try:
      drafts, self.kv_cache = self._propose(speculating, self.params, self.head, self.vocab,
                                            self.kv_cache, d, _unmasked(inp.sampling), ban_rows)
    except Exception:
      if self.kv_cache.is_deleted():  # donated to the failed call (see ModelRunner._run)
        self.kv_cache = self.spec.allocate()
        self._cache_resets += 1
      raise
    return drafts

  def on_verified(self, seq: Sequence, num_drafts: int, num_accepted: int,
                  proposals=None) -> None:
    # Passes 1..m fed the draft everything up to d_{m-1}: if d_m was accepted too, the draft
    # has yet to see it.
    seq.draft_lag = int(num_drafts > 0 and num_accepted == num_drafts)

  @property
  def cache_resets(self) -> int:
    return self._cache_resets

  def compile(self, t: int, verify: bool) -> None:
    # A plain step runs the catch-up pass, a verify step the proposal pass.
    b = self.buckets
    inp = to_step_input(empty_step_input(b, t, verify=True), b)
    d = self._input(ScheduledBatch([], []), inp)
    t0 = time.monotonic()
    self._propose.lower(verify, self.params, self.head, self.vocab, self.kv_cache, d,
                        _unmasked(inp.sampling), inp.verify.tensors.ban_rows).compile()
    log.info("draft model %d-token %s pass ready in %.1f s", t,
             "proposal" if verify else "catch-up", time.monotonic() - t0)

  def empty_drafts(self, num_seqs: int) -> jax.Array:
    return jnp.zeros((num_seqs, self.k), jnp.int32)

  @property
  def weight_bytes(self) -> int:
    own = {k: v for k, v in self.params.items() if k != "embedding"}
    return param_bytes(own) + (0 if self.head is self.params.get("embedding") else
                               param_bytes(self.head))

  # -- host side ----------------------------------------------------------------------------
  def _input(self, batch: ScheduledBatch, inp: StepInput) -> DraftInput:
    t = inp.token_ids.shape[0]
    s, k, ps = inp.logits_indices.shape[0], self.k, self.page_size
    token_ids, positions, slot_mapping = (np.zeros(t, np.int32) for _ in range(3))
    kv_lens, cu, last = np.zeros(s, np.int32), np.zeros(s + 1, np.int32), np.zeros(s, np.int32)
    slots = np.full((s, k - 1), SINK_PAGE * ps, np.int32)
    later_lens = np.ones((s, k - 1), np.int32)
    off = 0
    for i, (seq, n, m) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.num_drafts)):
      start = seq.num_computed_tokens - seq.draft_lag
      end = seq.num_computed_tokens + n - m  # the target's rows without the drafts
      pages = np.asarray(seq.pages[0], np.int32)  # see `_input`'s md
      pos = np.arange(start, end)
      rows = slice(off, off + len(pos))
      token_ids[rows] = seq.token_ids[start:end]
      positions[rows] = pos
      slot_mapping[rows] = pages[pos // ps] * ps + pos % ps
      off += len(pos)
      cu[i + 1], kv_lens[i], last[i] = off, end, off - 1
      later = np.arange(end, end + max(m - 1, 0))  # d_1..d_{m-1}'s positions: passes 2..m
      slots[i, :len(later)] = pages[later // ps] * ps + later % ps
      later_lens[i, :len(later)] = later + 1
    cu[len(batch.seqs) + 1:] = off
    # The draft's cache has a slot per layer and uses the pages of the target's first KV group
    # (its full-attention group, where the target has one; see kv_groups.py).
    md = inp.md.replace(slot_mapping=slot_mapping, block_table=inp.md.block_table[0],
                        kv_lens=kv_lens, cu_q_lens=cu, verify_width=2, tree_mask=None)
    return DraftInput(token_ids=token_ids, positions=positions, md=md, logits_indices=last,
                      slots=slots, kv_lens=later_lens)
