"""The fixed-shape pytree one jitted step consumes, and how the host builds it.

Shapes come from a finite bucket set: `T` a power of two up to `max_num_batched_tokens`,
`S = min(T, max_num_seqs)`, `P = max_pages_per_seq`; the attention metadata's block table
[G, S, P] and slot mapping [G, T] have one row per KV group (`jinfer/models/kv_groups.py`).
The attention's loops run as far as the step's real sequences need (a decode-only step skips
the prefill ones), so one compiled shape per `T` serves decode and mixed steps alike. Padding
rows write to the sink page and are never read.

With speculative decoding (k drafts), a step where some sequence verifies drafts is a verify
step, a second variant per `T`: each such sequence's rows are `[last, d1..dm]` (m <= k, verify
rows of the attention contract, `verify_width = k + 1`), and logits come out at
`R = min(T, S * (k + 1))` rows, every sequence's chain of m + 1 rows (see
`jinfer/sampling/accept.py`).
With a candidate tree (Medusa) the m drafts are the tree's first m nodes: their rows sit at
positions by depth and see their ancestors (the tree mask), see `jinfer/sampling/tree.py`.
A verify step's structured-output masks are per logits row ([R, W], in the verify tensors): a
constrained sequence's row i is masked for the tokens allowed after its own draft prefix.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np
from flax import struct

from jinfer.sampling.accept import VerifyTensors
from jinfer.sampling.grammar import mask_words
from jinfer.engine.request import Sequence
from jinfer.engine.scheduler import ScheduledBatch
from jinfer.models.lora import LoraRows, lora_rows
from jinfer.sampling.sample import SamplingTensors
from jinfer.sampling.tree import Tree
from pallas_kernels import AttentionMetadata

MAX_BANNED = 16  # EOS and stop token ids suppressed while min_tokens is not reached


@struct.dataclass
class VerifyInput:
  tensors: VerifyTensors
  draft_rows: jax.Array  # [S, K] int32: the flat row of each draft token (T: none)
  logits_rows: jax.Array  # [R] int32: the flat rows projected to logits


@struct.dataclass
class StepInput:
  token_ids: jax.Array  # [T] int32
  positions: jax.Array  # [T] int32
  md: AttentionMetadata
  logits_indices: jax.Array  # [S] int32
  sampling: SamplingTensors
  target_ids: jax.Array  # [T] int32: the token each row predicts (for prompt logprobs)
  verify: VerifyInput | None = None  # a verify step (speculative decoding)
  lora: LoraRows | None = None  # each row's adapter slot, in an engine that serves adapters
  # Static: project every row to logits and return prompt logprobs.
  prompt_logprobs: bool = struct.field(pytree_node=False, default=False)


class RowError(Exception):
  """The row of sequence `index` (in the batch) could not be built: `error` says why."""

  def __init__(self, index: int, error: Exception):
    super().__init__(f"sequence {index} of the batch: {error!r}")
    self.index, self.error = index, error


@dataclasses.dataclass(frozen=True)
class Buckets:
  max_num_seqs: int
  max_num_batched_tokens: int
  max_prefill_seqs: int
  max_pages_per_seq: int
  max_model_len: int
  num_speculative_tokens: int = 0  # k; > 0 adds the verify variant of every bucket
  smallest_bucket: int = 1
  tree: Tree | None = None  # verify steps check this tree's first k nodes, not a chain of k
  # The model's logits per row: sizes the structured-output masks [S, ceil(V / 32)], a verify
  # step's [R, ceil(V / 32)] (0: the step carries none, for callers that build sampling tensors
  # without an engine).
  vocab_size: int = 0
  # KV groups (jinfer/models/kv_groups.py): the step carries a block table [G, S, P] and a slot
  # mapping [G, T], one per group.
  num_kv_groups: int = 1
  max_loras: int = 0  # adapter slots (jinfer/models/lora.py); 0: the step carries no adapters

  @property
  def token_buckets(self) -> list[int]:
    """Powers of two from `smallest_bucket`, and with speculation the single stream's verify
    step exactly (1 + k rows): on a CPU a step's cost grows with its rows (SmolLM2: 5 rows cost
    0.8x of 8), and that step is the one speculation at batch 1 runs."""
    out, t = [], self.smallest_bucket
    while t < self.max_num_batched_tokens:
      out.append(t)
      t *= 2
    verify = 1 + self.num_speculative_tokens
    if (self.num_speculative_tokens and verify < self.max_num_batched_tokens
        and verify % self.smallest_bucket == 0):
      out = sorted(set(out) | {verify})
    return out + [self.max_num_batched_tokens]

  def num_seqs(self, t: int) -> int:
    return min(t, self.max_num_seqs)

  def verify_rows(self, t: int) -> int:
    """R: logits rows of a verify step of T tokens."""
    return min(t, self.num_seqs(t) * (self.num_speculative_tokens + 1))

  def shapes(self, with_prompt_logprobs: bool) -> list[tuple[int, bool, bool]]:
    """Every (T, prompt_logprobs, verify) the engine can run: what warmup compiles. A step
    carrying prompt logprobs never verifies drafts."""
    variants = [(False, False)] + [(True, False)] * with_prompt_logprobs
    variants += [(False, True)] * (self.num_speculative_tokens > 0)
    return [(t, pl, v) for t in self.token_buckets for pl, v in variants]

  def pick(self, num_tokens: int) -> int:
    return next(t for t in self.token_buckets if t >= num_tokens)


def empty_step_input(b: Buckets, t: int, prompt_logprobs: bool = False,
                     verify: bool = False) -> dict:
  s = b.num_seqs(t)
  z = lambda *shape: np.zeros(shape, np.int32)
  masks = b.verify_rows(t) if verify else s  # a verify step masks each logits row
  if verify:
    k, r = b.num_speculative_tokens, b.verify_rows(t)
    extra = dict(draft_tokens=z(s, k), num_drafts=z(s), row_seq=z(r), row_depth=z(r),
                 chain=z(s, k + 1), ban_rows=z(s), draft_rows=np.full((s, k), t, np.int32),
                 logits_rows=z(r))
    if b.tree is not None:  # padding rows see the first; a sequence's rows are set as built
      extra["tree_mask"] = np.arange(k + 1)[None, :] == np.zeros((t, 1), np.int32)
  else:
    extra = {}
  return extra | dict(
      token_ids=z(t), positions=z(t), slot_mapping=z(b.num_kv_groups, t),
      block_table=z(b.num_kv_groups, s, b.max_pages_per_seq),
      kv_lens=z(s), cu_q_lens=z(s + 1), num_seqs=z(1), logits_indices=z(s),
      temperature=np.zeros(s, np.float32), top_k=np.full(s, 1 << 30, np.int32),
      top_p=np.ones(s, np.float32), min_p=np.zeros(s, np.float32),
      repetition_penalty=np.ones(s, np.float32), presence_penalty=np.zeros(s, np.float32),
      frequency_penalty=np.zeros(s, np.float32), seeds=np.zeros(s, np.uint32), gen_idx=z(s),
      history=np.full((s, b.max_model_len), -1, np.int32), prompt_lens=z(s),
      banned=np.full((s, MAX_BANNED), -1, np.int32), num_logprobs=z(s), target_ids=z(t),
      prompt_logprobs=prompt_logprobs,
      allowed=np.full((masks, mask_words(b.vocab_size)), -1, np.int32) if b.vocab_size else None,
      lora_slot=np.full(t, -1, np.int32) if b.max_loras else None)


def to_step_input(a: dict, b: Buckets) -> StepInput:
  t = a["token_ids"].shape[0]
  md = AttentionMetadata(
      slot_mapping=a["slot_mapping"], block_table=a["block_table"], kv_lens=a["kv_lens"],
      cu_q_lens=a["cu_q_lens"], num_seqs=a["num_seqs"], max_q_len=t,
      max_prefill_seqs=b.max_prefill_seqs)
  pick = lambda cls: cls(**{f.name: a[f.name] for f in dataclasses.fields(cls)})
  verify = None
  if "draft_rows" in a:
    md = md.replace(verify_width=b.num_speculative_tokens + 1, tree_mask=a.get("tree_mask"))
    verify = VerifyInput(tensors=pick(VerifyTensors), draft_rows=a["draft_rows"],
                         logits_rows=a["logits_rows"])
  sampling = pick(SamplingTensors)
  if verify is not None:  # its masks are per logits row, in the verify tensors
    sampling = sampling.replace(allowed=None)
  lora = None if a["lora_slot"] is None else LoraRows(**lora_rows(a["lora_slot"], b.max_loras))
  return StepInput(token_ids=a["token_ids"], positions=a["positions"], md=md,
                   logits_indices=a["logits_indices"], sampling=sampling,
                   target_ids=a["target_ids"], verify=verify, lora=lora,
                   prompt_logprobs=a["prompt_logprobs"])


def build_step_input(batch: ScheduledBatch, b: Buckets, page_size: int,
                     eos_ids: tuple[int, ...],
                     pick: Callable[[int], int] | None = None,
                     fill_masks: Callable[[np.ndarray, list], None] | None = None) -> StepInput:
  """`pick(num_tokens)`: the bucket to run in (default `b.pick`: the smallest that holds it).
  `fill_masks(allowed, [(matcher, row, drafts)])`: writes the token masks of the sequences under
  a structured-output constraint that sample this step, into allowed [S, W] by sequence, or in a
  verify step [R, W] by logits row, each after that row's draft prefix (`draft_prefixes`)."""
  n_tok = batch.num_tokens
  # A draft model's own pass over the batch leaves out the drafts and adds the tokens it lags
  # behind; its rows must fit the same bucket.
  n_draft = sum(n - m + s.draft_lag for s, n, m in zip(batch.seqs, batch.num_new_tokens,
                                                       batch.num_drafts))
  t = (pick or b.pick)(max(n_tok, n_draft, len(batch.seqs)))
  want_prompt_lp = any(
      s.params.prompt_logprobs is not None and s.num_computed_tokens < len(s.prompt_token_ids)
      for s in batch.seqs)
  verify = any(batch.num_drafts)
  assert not (verify and want_prompt_lp), "a step carrying prompt logprobs verifies no drafts"
  a = empty_step_input(b, t, want_prompt_lp, verify)
  a["num_seqs"][0] = len(batch.seqs)
  any_penalty = any(_has_penalty(s) for s in batch.seqs)
  constrained = []  # (matcher, row, drafts before it) of the rows this step masks
  off = r = 0
  for i, (seq, n, m) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.num_drafts)):
    try:
      start = seq.num_computed_tokens
      pos = np.arange(start, start + n)
      a["token_ids"][off:off + n - m] = seq.token_ids[start:start + n - m]
      if want_prompt_lp:
        nxt = seq.token_ids[start + 1:start + n + 1]
        a["target_ids"][off:off + len(nxt)] = nxt
      a["positions"][off:off + n] = pos
      if verify and b.tree is not None and n <= b.num_speculative_tokens + 1:
        # The mask governs every sequence of at most verify_width rows, a short prefill chunk
        # (a prefix hit's tail) too: causal, unless its rows are a tree, whose rows sit at
        # positions by depth and see their ancestors.
        a["tree_mask"][off:off + n, :n] = np.tri(n, dtype=bool)
        if m:
          a["positions"][off + n - m - 1:off + n] = start + n - m - 1 + b.tree.depth[:m + 1]
          a["tree_mask"][off + n - m - 1:off + n, :m + 1] = b.tree.visible[:m + 1, :m + 1]
      for g, pages in enumerate(seq.pages):
        # Only a group's present pages are converted: a window group's long run of pages
        # given back (-1) is a prefix, filled in one slice.
        lo = _pages_given_back(pages)
        row = a["block_table"][g, i]
        row[:lo] = -1
        row[lo:len(pages)] = pages[lo:]
        a["slot_mapping"][g, off:off + n] = row[pos // page_size] * page_size + pos % page_size
      a["kv_lens"][i] = start + n
      if seq.lora_slot is not None:
        a["lora_slot"][off:off + n] = seq.lora_slot
      off += n
      a["cu_q_lens"][i + 1] = off
      a["logits_indices"][i] = off - 1
      p = seq.params
      if verify:  # the chain: the last token's row, then one per draft
        a["token_ids"][off - m:off] = batch.draft_tokens[i] or 0  # a device proposer fills them
        a["draft_tokens"][i, :len(batch.draft_tokens[i])] = batch.draft_tokens[i]
        a["draft_rows"][i, :m] = np.arange(off - m, off)
        a["num_drafts"][i] = m
        a["logits_rows"][r:r + m + 1] = np.arange(off - m - 1, off)
        a["row_seq"][r:r + m + 1] = i
        a["row_depth"][r:r + m + 1] = np.arange(m + 1)
        a["chain"][i] = r + np.minimum(np.arange(b.num_speculative_tokens + 1), m)
        a["ban_rows"][i] = max(0, p.min_tokens - len(seq.output_token_ids))
        r += m + 1
      a["temperature"][i] = p.temperature
      if p.top_k > 0:
        a["top_k"][i] = p.top_k
      a["top_p"][i], a["min_p"][i] = p.top_p, p.min_p
      a["repetition_penalty"][i] = p.repetition_penalty
      a["presence_penalty"][i] = p.presence_penalty
      a["frequency_penalty"][i] = p.frequency_penalty
      a["seeds"][i] = seq.seed
      a["gen_idx"][i] = len(seq.output_token_ids)
      a["prompt_lens"][i] = len(seq.prompt_token_ids)
      a["num_logprobs"][i] = p.logprobs or 0
      if any_penalty and _has_penalty(seq):
        a["history"][i, :seq.num_tokens] = seq.token_ids
      if len(seq.output_token_ids) < p.min_tokens:
        banned = (() if p.ignore_eos else eos_ids) + p.stop_token_ids
        a["banned"][i, :len(banned)] = banned
      if seq.matcher is not None and start + n - m >= seq.num_tokens:  # it samples this step
        if not verify:
          constrained.append((seq.matcher, i, []))
        else:
          drafts = batch.draft_tokens[i]
          if len(drafts) < m:  # a device proposer's: the host cannot mask their rows
            raise ValueError("a constrained sequence's drafts must be known on the host")
          constrained += [(seq.matcher, r - m - 1 + j, prefix)
                          for j, prefix in enumerate(draft_prefixes(drafts, m, b.tree))]
    except Exception as e:  # what the checks upstream missed fails this sequence alone
      raise RowError(i, e) from e
  a["cu_q_lens"][len(batch.seqs) + 1:] = off
  if constrained:
    fill_masks(a["allowed"], constrained)
  return to_step_input(a, b)


def draft_prefixes(drafts: list[int], m: int, tree: Tree | None) -> list[list[int]]:
  """The drafts a sequence's verify rows 0..m follow: a chain's row j the first j, a tree's
  node j the tokens of its path from the root (itself included)."""
  if tree is None:
    return [list(drafts[:j]) for j in range(m + 1)]
  return [[drafts[node - 1] for node in tree.path[j, 1:tree.depth[j] + 1]] for j in range(m + 1)]


def _pages_given_back(pages: list[int]) -> int:
  """How many leading entries of a group's pages are -1 (a window group's pages given back are
  a prefix): found from the end, so the cost is the pages still held."""
  if not pages or pages[0] >= 0:
    return 0
  i = len(pages)
  while pages[i - 1] >= 0:
    i -= 1
  return i


def _has_penalty(seq: Sequence) -> bool:
  p = seq.params
  return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
