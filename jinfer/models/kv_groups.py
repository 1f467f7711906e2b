"""How a model's layers share the paged KV cache: groups of layers, one span of keys each.

A layer with a sliding window of `w` tokens reads only the last `w` keys; a full-attention layer
reads the whole context. Keeping every layer's pages for the whole context wastes, for
Gemma-3's five local layers out of six, almost all of their memory. So the layers are grouped by
span, and each group has its own pages and its own block table: a sliding-window group gives a
page back as soon as it has left the window (its block table marks it absent, -1), a full group
keeps every page.

All groups draw their pages from one pool. The cache array's leading axis holds `num_slots`
layer slots, and group g's i-th layer lives at slot i of the pages group g owns; a page id (the
array's axis 1) belongs to one group at a time, and a page costs the same bytes whichever group
owns it. That needs every group to have `num_slots` layers: the span with the fewest layers sets
it, and a span whose layer count is not a multiple of it leaves slots of its last group unused.
(vLLM's hybrid KV cache manager makes the same choice.)

Gemma-3-270M (18 layers: 3 global, 15 with a 512-token window) makes one full group and five
sliding-window groups of 3 slots each. At 32k tokens a sequence holds 2048 pages of 16 tokens in
the full group and at most ~65 in each window group (the window and one step's chunk):
2373 x 3 layer-pages, 0.19x the 2048 x 18 that full attention in every layer would hold.

A window as long as the longest sequence frees nothing, so such layers page as full ones, and a
model with one span (Llama; Mistral, whose every layer has the window) is one group whose slots
are its layers.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jinfer.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class KVGroups:
  layers: tuple[tuple[int, ...], ...]  # per group: its layers, in slot order
  windows: tuple[int | None, ...]  # per group: its layers' sliding window (None: full)

  @classmethod
  def of(cls, config: ModelConfig, max_model_len: int | None = None,
         hybrid: bool = True) -> "KVGroups":
    """The groups of `config`'s layers for sequences of at most `max_model_len` tokens;
    `hybrid=False`: one group of every layer, each keeping the whole context."""
    def span(window):  # the keys a layer's pages must hold
      if not hybrid or window is None or (max_model_len is not None and window >= max_model_len):
        return None
      return window

    by_span: dict[int | None, list[int]] = {}
    for layer, window in enumerate(config.sliding_windows):
      by_span.setdefault(span(window), []).append(layer)
    k = min(len(layers) for layers in by_span.values())
    layers, windows = [], []
    for w in sorted(by_span, key=lambda w: -1 if w is None else w):  # full groups first
      for i in range(0, len(by_span[w]), k):
        layers.append(tuple(by_span[w][i:i + k]))
        windows.append(w)
    return cls(tuple(layers), tuple(windows))

  @property
  def num_groups(self) -> int:
    return len(self.layers)

  @property
  def num_slots(self) -> int:
    return max(len(g) for g in self.layers)

  @property
  def num_layers(self) -> int:
    return sum(len(g) for g in self.layers)

  def layer_slots(self) -> tuple[np.ndarray, np.ndarray]:
    """(group [L], slot [L]) int32: where each layer's K/V lives."""
    group, slot = np.zeros(self.num_layers, np.int32), np.zeros(self.num_layers, np.int32)
    for g, layers in enumerate(self.layers):
      group[list(layers)], slot[list(layers)] = g, np.arange(len(layers))
    return group, slot

  def page_need(self, num_tokens: int, page_size: int, chunk: int) -> int:
    """Pages one sequence of `num_tokens` holds at most, over every group, when a step adds
    up to `chunk` tokens: a window group holds the pages of its window before the step's first
    row and those of the step's rows."""
    full = -(-num_tokens // page_size)
    return sum(full if w is None else min(full, -(-(w - 1 + chunk) // page_size) + 1)
               for w in self.windows)
