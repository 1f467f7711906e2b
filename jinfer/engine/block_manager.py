"""Host-side page pool: free list, ref counts, and a prefix cache over full pages.

A full page is keyed by a hash chain `hash((parent_hash, page_tokens, salt))` and the stored
tokens are compared on every hit, so a hash collision can never serve another prompt's KV.
Requests that share a prefix share its pages (ref counted, never copied). A page whose last
reference goes away stays cached and evictable, least recently used first.

The KV groups (`jinfer/models/kv_groups.py`) draw from this one pool. A sequence holds one list
of pages per group, indexed by position (page i holds tokens [i * page_size, (i+1) *
page_size)); a sliding-window group gives back the pages that left its window and keeps -1 in
their place. Each group caches its own pages, under its own keys: a group's page holds only its
layers' K/V. A prefix hit of h pages must give every full group pages 0..h-1 and every window
group the pages a query at position h * page_size still sees; the longest such h is served.
"""
from __future__ import annotations

import collections
import functools

from pallas_kernels.kv_cache_layout import SINK_PAGE


class BlockManager:

  def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
               num_ranks: int = 1, windows: tuple[int | None, ...] = (None,)):
    """`num_ranks`: devices the pool is split over in equal runs of pages (context
    parallelism); the free list deals pages from each in turn, so a sequence's pages, and its
    attention work, spread evenly over them. `windows`: each KV group's sliding window (None:
    full attention)."""
    if num_pages < 2:
      raise ValueError("the KV cache needs at least 2 pages (page 0 is the padding sink)")
    self.num_pages, self.page_size = num_pages, page_size
    self.enable_prefix_caching = enable_prefix_caching
    self.windows = windows
    self.ref = [0] * num_pages
    per_rank = num_pages // num_ranks
    self.free: collections.deque[int] = collections.deque(sorted(
        (p for p in range(num_pages) if p != SINK_PAGE), key=lambda p: (p % per_rank, p)))
    # page -> ((group, hash), tokens, salt) once full and cached
    self.page_key: dict[int, tuple] = {}
    self.by_hash: dict[tuple[int, int], int] = {}  # (group, hash) -> page
    self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU order
    self.prefix_queries = 0  # prompt tokens looked up
    self.prefix_hits = 0  # of those, tokens served from cache

  # -- capacity -----------------------------------------------------------------------------
  @property
  def num_usable_pages(self) -> int:
    return self.num_pages - 1

  @property
  def num_free_pages(self) -> int:
    return len(self.free) + len(self.evictable)

  def pages_needed(self, num_tokens: int) -> int:
    return -(-num_tokens // self.page_size)

  def first_visible(self, group: int, position: int) -> int:
    """The first page of `group` a query at `position` (or later) can see."""
    w = self.windows[group]
    return 0 if w is None else max(0, position - w + 1) // self.page_size

  # -- prefix cache -------------------------------------------------------------------------
  def chain_hashes(self, tokens: list[int], salt, num_pages: int,
                   known: list[int] | None = None) -> list[int]:
    """The hash chain of the first `num_pages` full pages of `tokens`. `known`: the chain of a
    prefix of them (a sequence's, whose tokens only grow), extended in place."""
    hashes = [] if known is None else known
    for i in range(len(hashes), num_pages):
      parent = hashes[-1] if hashes else None
      hashes.append(hash((parent, tuple(tokens[i * self.page_size:(i + 1) * self.page_size]),
                          salt)))
    return hashes[:num_pages]

  def match_prefix(self, tokens: list[int], salt=None,
                   known: list[int] | None = None) -> list[list[int]]:
    """Each group's cached pages holding the longest prefix of `tokens` every group can serve
    (see the module docstring), a reference taken on each; -1 where a window group needs none.

    The last token is never served from cache: its logits are needed, so it is always computed.
    """
    pages: list[list[int]] = [[] for _ in self.windows]
    if not self.enable_prefix_caching:
      return pages
    self.prefix_queries += len(tokens)
    hashes = self.chain_hashes(tokens, salt, (len(tokens) - 1) // self.page_size, known)

    @functools.cache
    def cached(g: int, i: int) -> int | None:  # group g's page holding page i's tokens
      page = self.by_hash.get((g, hashes[i]))
      chunk = tuple(tokens[i * self.page_size:(i + 1) * self.page_size])
      return None if page is None or self.page_key[page][1:] != (chunk, salt) else page

    # The longest prefix of pages every full group holds; then, while some window group lacks a
    # page its window at h needs, no hit reaches past that page. Pages are looked at from the
    # hit's end down, so a window group looks at about its window's pages.
    h = len(hashes)
    for g, w in enumerate(self.windows):
      if w is None:
        h = next((i for i in range(h) if cached(g, i) is None), h)
    settled = False
    while not settled:
      settled = True
      for g, w in enumerate(self.windows):
        i = h - 1
        while w is not None and i >= self.first_visible(g, h * self.page_size):
          if cached(g, i) is None:
            h, settled = i, False
          i -= 1
    for g in range(len(self.windows)):
      lo = self.first_visible(g, h * self.page_size)
      pages[g] = [-1] * lo + [cached(g, i) for i in range(lo, h)]
      for page in pages[g][lo:]:
        self._take(page)
    self.prefix_hits += h * self.page_size
    return pages

  def cache_full_pages(self, pages: list[list[int]], tokens: list[int], num_computed: int,
                       salt=None, known: list[int] | None = None, start: int = 0) -> int:
    """Register each group's pages whose every token is now in the cache, from page `start`
    (those before were offered already); returns how many pages are full."""
    full = num_computed // self.page_size
    if not self.enable_prefix_caching:
      return full
    hashes = self.chain_hashes(tokens, salt, full, known)
    for i in range(start, full):
      h = hashes[i]
      for g, group_pages in enumerate(pages):
        page = group_pages[i]
        # Skipped: a page a window group gave back, one cached already, or the same content
        # computed twice concurrently (the first is kept).
        if page < 0 or page in self.page_key or (g, h) in self.by_hash:
          continue
        self.page_key[page] = ((g, h), tuple(tokens[i * self.page_size:(i + 1) * self.page_size]),
                               salt)
        self.by_hash[g, h] = page
    return full

  def forget_cached(self):
    """Drop every prefix-cache entry: the KV they pointed to is gone (the cache was rebuilt)."""
    self.free.extend(self.evictable)
    self.evictable.clear()
    self.page_key.clear()
    self.by_hash.clear()

  # -- allocation ---------------------------------------------------------------------------
  def _take(self, page: int):
    if self.ref[page] == 0:
      self.evictable.pop(page, None)
    self.ref[page] += 1

  def allocate(self, n: int) -> list[int] | None:
    """n fresh pages, evicting cached ones LRU if needed; None (and nothing taken) if short."""
    if n > self.num_free_pages:
      return None
    out = []
    for _ in range(n):
      if self.free:
        page = self.free.popleft()
      else:
        page, _ = self.evictable.popitem(last=False)
        del self.by_hash[self.page_key.pop(page)[0]]
      self.ref[page] = 1
      out.append(page)
    return out

  def release(self, pages: list[int]):
    """Drop a reference on each page (-1 entries: none held)."""
    # Reversed: a sequence's tail pages are the least likely to be shared, so they go first.
    for page in reversed(pages):
      if page < 0:
        continue
      self.ref[page] -= 1
      assert self.ref[page] >= 0, f"page {page} released twice"
      if self.ref[page] == 0:
        if page in self.page_key:
          self.evictable[page] = None
        else:
          self.free.append(page)

  def check_consistency(self) -> None:
    """Invariants for tests: every page is exactly one of free, evictable, or referenced."""
    for page in range(self.num_pages):
      if page == SINK_PAGE:
        continue
      states = [page in self.free, page in self.evictable, self.ref[page] > 0]
      assert sum(states) == 1, f"page {page}: free/evictable/referenced = {states}"
    assert set(self.by_hash.values()) == set(self.page_key)
    assert len(set(self.free)) == len(self.free)
