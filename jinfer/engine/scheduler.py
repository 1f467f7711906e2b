"""Iteration-level scheduling: every step, finished sequences leave and waiting ones join.

Running sequences go first (decodes and unfinished prefill chunks, oldest first), then waiting
ones in arrival order while the token budget, `max_num_seqs` and the page pool allow. A prefill
longer than the remaining budget is chunked. When pages run out the newest running sequence is
preempted (its pages freed, recomputed later from its tokens so far); the oldest always fits,
because one sequence of `max_model_len` tokens fits in the pool, so progress is guaranteed.

Speculative decoding: a decoding sequence may get up to k extra rows for draft tokens
(`lookahead`, decided by the engine), verified in the same step. They take budget and pages like
any row, but never preempt anyone: short of pages, the sequence decodes one token as usual.
After the step, `rollback` hands back the pages that only rejected drafts used.

A sequence holds pages per KV group (`seq.pages[g]`, see block_manager.py); a sliding-window
group gives back the pages that left its window before the sequence grows.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

from jinfer.engine.block_manager import BlockManager
from jinfer.engine.lora_slots import AdapterSlots
from jinfer.errors import ParameterError
from jinfer.engine.request import Sequence, Status


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
  max_num_seqs: int = 64  # sequences running at once
  max_num_batched_tokens: int = 512  # token budget of one step; long prefills are chunked
  max_prefill_seqs: int = 8  # sequences with a prefill chunk in one step
  # False: static batches (a baseline for benchmarks) that wait for their longest member, each
  # sequence reserving max_model_len slots as an engine without paging must.
  continuous_batching: bool = True

  def __post_init__(self):
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_seqs"):
      if getattr(self, name) < 1:
        raise ParameterError(name, f"{name} must be >= 1, got {getattr(self, name)}")
    if self.max_num_batched_tokens & (self.max_num_batched_tokens - 1):
      raise ParameterError("max_num_batched_tokens", "max_num_batched_tokens must be a power of "
                                                     "two (it is the largest bucket)")


@dataclasses.dataclass
class ScheduledBatch:
  seqs: list[Sequence]
  num_new_tokens: list[int]  # per sequence, this step, draft rows included
  num_drafts: list[int] = None  # per sequence: rows for draft tokens (speculative decoding)
  draft_tokens: list[list[int]] = None  # per sequence: drafts proposed on the host, if any

  def __post_init__(self):
    self.num_drafts = self.num_drafts or [0] * len(self.seqs)
    self.draft_tokens = self.draft_tokens or [[] for _ in self.seqs]

  @property
  def num_tokens(self) -> int:
    return sum(self.num_new_tokens)


class Scheduler:

  def __init__(self, config: SchedulerConfig, blocks: BlockManager, max_pages_per_seq: int,
               lookahead: Callable[[Sequence], int] | None = None,
               adapters: AdapterSlots | None = None):
    self.config, self.blocks = config, blocks
    # LoRA: a sequence with an adapter holds its device slot while admitted.
    self.adapters = adapters
    self.max_pages_per_seq = max_pages_per_seq
    self.lookahead = lookahead  # draft rows a decoding sequence may verify this step
    self.waiting: collections.deque[Sequence] = collections.deque()
    self.running: list[Sequence] = []
    self.num_preemptions = 0
    # False: waiting sequences are left for someone else to take (a decode engine of
    # disaggregated serving, whose preempted sequences are recomputed on the prefill side).
    self.admit_waiting = True

  def add(self, seq: Sequence):
    self.waiting.append(seq)

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running)

  def finish(self, seq: Sequence):
    """Drop a sequence wherever it is and give back its pages."""
    if seq in self.running:
      self.running.remove(seq)
    elif seq in self.waiting:
      self.waiting.remove(seq)
    self._release(seq)
    seq.status = Status.FINISHED

  def _release(self, seq: Sequence):
    for pages in seq.pages:
      self.blocks.release(pages)
    seq.pages, seq.pages_offered = [], 0
    if seq.lora_slot is not None:
      self.adapters.release(seq.lora_slot)
      seq.lora_slot = None

  def _grow(self, seq: Sequence, num_new: int) -> bool:
    """Pages for `num_new` more tokens in every group, all or none."""
    # Window groups first give back what the step's first row (or a draft model's first
    # catch-up row, which trails it) no longer sees.
    # The pages given back are always a prefix: walk back from the window's start to it.
    first = seq.num_computed_tokens - seq.draft_lag
    for g, pages in enumerate(seq.pages):
      i = min(self.blocks.first_visible(g, first), len(pages)) - 1
      while i >= 0 and pages[i] >= 0:
        self.blocks.release([pages[i]])
        pages[i] = -1
        i -= 1
    total = self.blocks.pages_needed(seq.num_computed_tokens + num_new)
    need = [max(0, total - len(pages)) for pages in seq.pages]
    if not any(need):
      return True
    new = self.blocks.allocate(sum(need))
    if new is None:
      return False
    for pages, n in zip(seq.pages, need):
      pages.extend(new[:n])
      new = new[n:]
    return True

  def rollback(self, seq: Sequence):
    """Release the pages past the sequence's computed tokens: those only rejected drafts wrote
    to. Their slots in the kept pages are left as they are; the next step overwrites them."""
    keep = self.blocks.pages_needed(seq.num_computed_tokens)
    for pages in seq.pages:
      if len(pages) > keep:
        self.blocks.release(pages[keep:])
        del pages[keep:]

  def preempt(self, seq: Sequence):
    """Send a running sequence back to wait, to be recomputed from its tokens so far."""
    self.running.remove(seq)
    self._release(seq)
    seq.num_computed_tokens, seq.status = 0, Status.WAITING
    seq.draft_lag = 0
    self.waiting.appendleft(seq)
    self.num_preemptions += 1

  def preempt_all(self):
    """Send every running sequence back to wait for recomputation, keeping their order."""
    for seq in reversed(self.running[:]):
      self.preempt(seq)

  def _match_prefix(self, seq: Sequence):
    # Prompt logprobs need every prompt row computed, so such requests skip the cache.
    if seq.params.prompt_logprobs is not None:
      seq.pages = [[] for _ in self.blocks.windows]
      return
    seq.pages = self.blocks.match_prefix(seq.token_ids, seq.cache_salt, seq.page_hashes)
    seq.pages_offered = len(seq.pages[0])  # cached already
    seq.num_computed_tokens = seq.pages_offered * self.blocks.page_size
    seq.draft_lag = 0
    if seq.metrics.first_scheduled_time is None:
      seq.num_cached_tokens = seq.num_computed_tokens

  def _admit(self, seq: Sequence):
    seq.status = Status.RUNNING
    if seq.metrics.first_scheduled_time is None:
      seq.metrics.first_scheduled_time = time.monotonic()
    self.running.append(seq)

  def schedule(self, max_tokens: int | None = None) -> ScheduledBatch:
    """`max_tokens`: a smaller token budget for this step (the largest step compiled so far)."""
    cfg = self.config
    budget = min(cfg.max_num_batched_tokens, max_tokens or cfg.max_num_batched_tokens)
    seqs: list[Sequence] = []
    counts: list[int] = []
    drafts: list[int] = []
    prefills = 0

    # A static batch takes requests at once and runs until all have finished. Without paging a
    # sequence must reserve max_model_len slots up front, so the same pool holds fewer of them.
    if not cfg.continuous_batching and not self.running:
      size = min(cfg.max_num_seqs, self.blocks.num_usable_pages // self.max_pages_per_seq)
      while self.waiting and len(self.running) < size:
        self._admit(self.waiting.popleft())

    # 1. Running sequences, oldest first.
    i = 0
    while i < len(self.running) and budget > 0:
      seq = self.running[i]
      remaining = seq.num_tokens - seq.num_computed_tokens
      if remaining > 1 and prefills >= cfg.max_prefill_seqs:
        i += 1
        continue
      if not seq.pages:  # admitted without pages: a static batch member or after preemption
        self._match_prefix(seq)
        remaining = seq.num_tokens - seq.num_computed_tokens
      n = min(remaining, budget)
      m = 0
      if remaining == 1:
        if budget < 1 + seq.draft_lag:  # its draft model's catch-up rows would not fit
          break
        if self.lookahead is not None:
          m = max(0, min(self.lookahead(seq), budget - 1))
          if m and not self._grow(seq, 1 + m):
            m = 0
      while not self._grow(seq, n + m):
        victim = self.running[-1]
        self.preempt(victim)
        if victim is seq:
          break
      if seq.status is not Status.RUNNING:  # preempted itself: nothing newer left to evict
        break
      seqs.append(seq)
      counts.append(n + m)
      drafts.append(m)
      # A draft model also catches up on the tokens it lags behind (see Sequence.draft_lag):
      # those rows come out of the same budget.
      budget -= max(n + m, n + seq.draft_lag)
      prefills += remaining > 1
      i += 1

    # 2. Waiting sequences in arrival order.
    skipped: list[Sequence] = []
    while (cfg.continuous_batching and self.admit_waiting and self.waiting and budget > 0
           and len(self.running) < cfg.max_num_seqs):
      seq = self.waiting[0]
      lead = seq.wait_for
      if lead is not None and not lead.finished and lead.num_computed_tokens < len(lead.prompt_token_ids):
        skipped.append(self.waiting.popleft())  # a sibling: wait for the lead's prompt pages
        continue
      if seq.lora is not None and seq.lora_slot is None:
        seq.lora_slot = self.adapters.acquire(seq.lora)
        if seq.lora_slot is None:  # every slot busy with running adapters: the others go on
          skipped.append(self.waiting.popleft())
          continue
      if not seq.pages:
        self._match_prefix(seq)
      remaining = seq.num_tokens - seq.num_computed_tokens
      n = min(remaining, budget)
      if (remaining > 1 and prefills >= cfg.max_prefill_seqs) or not self._grow(seq, n):
        # FCFS: nobody overtakes a request that cannot start yet. It holds no pages meanwhile,
        # or a waiting request could pin what the running ones need.
        self._release(seq)
        seq.num_computed_tokens = 0
        break
      self._admit(self.waiting.popleft())
      seqs.append(seq)
      counts.append(n)
      drafts.append(0)
      budget -= n
      prefills += remaining > 1
    self.waiting.extendleft(reversed(skipped))
    return ScheduledBatch(seqs, counts, drafts)
