"""BlockManager and Scheduler alone (no model): long random runs of adds, steps, finishes and
aborts, with every invariant checked after every operation."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from jinfer.engine.block_manager import BlockManager
from jinfer.engine.request import RequestMetrics, Sequence, Status
from jinfer.engine.scheduler import Scheduler, SchedulerConfig
from jinfer.models.kv_groups import KVGroups
from jinfer.sampling.params import SamplingParams


def _check(sched: Scheduler, blocks: BlockManager, batch, cfg: SchedulerConfig):
  blocks.check_consistency()
  holders = collections.Counter(p for s in sched.running for group in s.pages for p in group
                                if p >= 0)
  for page, n in holders.items():  # a page is referenced once per sequence holding it
    assert blocks.ref[page] == n, f"page {page}: ref {blocks.ref[page]}, held by {n}"
  for p in range(1, blocks.num_pages):
    if p not in holders:
      assert blocks.ref[p] == 0, f"page {p} referenced by nobody running"
  assert all(not s.pages for s in sched.waiting)
  assert len(sched.running) <= cfg.max_num_seqs
  assert batch.num_tokens <= cfg.max_num_batched_tokens
  assert sum(n > 1 for n in batch.num_new_tokens) <= cfg.max_prefill_seqs
  assert len({id(s) for s in batch.seqs}) == len(batch.seqs)
  for s, n in zip(batch.seqs, batch.num_new_tokens):
    assert s.status is Status.RUNNING and 1 <= n <= s.num_tokens - s.num_computed_tokens
    end = blocks.pages_needed(s.num_computed_tokens + n)
    for g, pages in enumerate(s.pages):
      # Every page the step's rows see or write, and no page a window group has left behind.
      first = blocks.first_visible(g, s.num_computed_tokens)
      assert len(pages) == end and min(pages[first:end]) > 0
      assert all(p == -1 for p in pages[:first])


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_every_invariant(seed):
  rng = np.random.default_rng(seed)
  page_size = int(rng.choice([2, 4, 8]))
  max_len = 64
  cfg = SchedulerConfig(max_num_seqs=int(rng.integers(1, 9)),
                        max_num_batched_tokens=int(rng.choice([8, 16, 32, 64])),
                        max_prefill_seqs=int(rng.integers(1, 4)))
  max_pages_per_seq = max_len // page_size
  # One full-attention group, a mix of full and sliding-window groups, or windows only.
  window = int(rng.integers(1, 3 * page_size))
  windows = [(None,), (None, window, window), (window,)][seed % 3]
  longest = KVGroups(((0,),) * len(windows), windows).page_need(
      max_len, page_size, cfg.max_num_batched_tokens)  # one sequence always fits
  num_pages = 1 + longest + int(rng.integers(0, 3 * max_pages_per_seq))
  blocks = BlockManager(num_pages, page_size, enable_prefix_caching=bool(rng.random() < 0.8),
                        windows=windows)
  sched = Scheduler(cfg, blocks, max_pages_per_seq)
  shared = rng.integers(0, 50, 40).tolist()  # common prefixes make prefix-cache hits
  live: list[Sequence] = []
  done = 0
  for op in range(600):
    r = rng.random()
    if r < 0.15 and len(live) < 24:
      n = int(rng.integers(1, 40))
      prompt = (shared[:int(rng.integers(0, 40))] + rng.integers(0, 50, n).tolist())[:max_len - 8]
      seq = Sequence(seq_id=str(op), group_id=str(op), index=0, prompt_token_ids=prompt or [1],
                     params=SamplingParams(max_tokens=int(rng.integers(1, 8))), seed=0,
                     metrics=RequestMetrics(arrival_time=0.0))
      sched.add(seq)
      live.append(seq)
    elif r < 0.22 and live:  # abort anything, wherever it is
      seq = live.pop(int(rng.integers(len(live))))
      sched.finish(seq)
    batch = sched.schedule()
    _check(sched, blocks, batch, cfg)
    for seq, n in zip(batch.seqs, batch.num_new_tokens):  # what the engine does after a step
      seq.num_computed_tokens += n
      blocks.cache_full_pages(seq.pages, seq.token_ids, seq.num_computed_tokens)
      if seq.num_computed_tokens == seq.num_tokens:
        seq.output_token_ids.append(int(rng.integers(0, 50)))
        if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= max_len:
          sched.finish(seq)
          live.remove(seq)
          done += 1
    blocks.check_consistency()
  # Drain: everything left finishes (no deadlock), and every page comes back.
  for _ in range(5000):
    if not sched.has_unfinished():
      break
    batch = sched.schedule()
    _check(sched, blocks, batch, cfg)
    assert batch.seqs, "work is waiting but nothing was scheduled"
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
      seq.num_computed_tokens += n
      blocks.cache_full_pages(seq.pages, seq.token_ids, seq.num_computed_tokens)
      if seq.num_computed_tokens == seq.num_tokens:
        seq.output_token_ids.append(1)
        if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= max_len:
          sched.finish(seq)
  assert not sched.has_unfinished()
  assert blocks.num_free_pages == blocks.num_usable_pages and not any(blocks.ref)
  assert done > 0
