"""Host-side page pool: free list, ref counts, and a prefix cache over full pages.

A full page is keyed by a hash chain `hash((parent_hash, page_tokens, salt))` and the stored
tokens are compared on every hit, so a hash collision can never serve another prompt's KV.
Requests that share a prefix share its pages (ref counted, never copied). A page whose last
reference goes away stays cached and evictable, least recently used first.
"""
from __future__ import annotations

import collections

from pallas_kernels.kv_cache_layout import SINK_PAGE


class BlockManager:

  def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
               num_ranks: int = 1):
    """`num_ranks`: devices the pool is split over in equal runs of pages (context
    parallelism); the free list deals pages from each in turn, so a sequence's pages, and its
    attention work, spread evenly over them."""
    if num_pages < 2:
      raise ValueError("the KV cache needs at least 2 pages (page 0 is the padding sink)")
    self.num_pages, self.page_size = num_pages, page_size
    self.enable_prefix_caching = enable_prefix_caching
    self.ref = [0] * num_pages
    per_rank = num_pages // num_ranks
    self.free: collections.deque[int] = collections.deque(sorted(
        (p for p in range(num_pages) if p != SINK_PAGE), key=lambda p: (p % per_rank, p)))
    self.page_key: dict[int, tuple] = {}  # page -> (hash, tokens, salt) once full and cached
    self.by_hash: dict[int, int] = {}  # hash -> page
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

  # -- prefix cache -------------------------------------------------------------------------
  def chain_hashes(self, tokens: list[int], salt, num_pages: int) -> list[int]:
    hashes, parent = [], None
    for i in range(num_pages):
      parent = hash((parent, tuple(tokens[i * self.page_size:(i + 1) * self.page_size]), salt))
      hashes.append(parent)
    return hashes

  def match_prefix(self, tokens: list[int], salt=None) -> list[int]:
    """Cached pages holding a prefix of `tokens`, taking a reference on each.

    The last token is never served from cache: its logits are needed, so it is always computed.
    """
    if not self.enable_prefix_caching:
      return []
    full = (len(tokens) - 1) // self.page_size
    self.prefix_queries += len(tokens)
    pages = []
    for i, h in enumerate(self.chain_hashes(tokens, salt, full)):
      page = self.by_hash.get(h)
      chunk = tuple(tokens[i * self.page_size:(i + 1) * self.page_size])
      if page is None or self.page_key[page][1:] != (chunk, salt):
        break
      self._take(page)
      pages.append(page)
    self.prefix_hits += len(pages) * self.page_size
    return pages

  def cache_full_pages(self, pages: list[int], tokens: list[int], num_computed: int, salt=None):
    """Register the pages whose every token is now in the cache."""
    if not self.enable_prefix_caching:
      return
    full = num_computed // self.page_size
    for i, h in enumerate(self.chain_hashes(tokens, salt, full)):
      page = pages[i]
      if page in self.page_key:
        continue
      if h in self.by_hash:  # the same content computed twice concurrently: keep the first
        continue
      self.page_key[page] = (h, tuple(tokens[i * self.page_size:(i + 1) * self.page_size]), salt)
      self.by_hash[h] = page

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
        h = self.page_key.pop(page)[0]
        del self.by_hash[h]
      self.ref[page] = 1
      out.append(page)
    return out

  def release(self, pages: list[int]):
    # Reversed: a sequence's tail pages are the least likely to be shared, so they go first.
    for page in reversed(pages):
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
