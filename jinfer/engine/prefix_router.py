"""Which of several engines a request goes to: the one that has seen its prefix (prefix-cache
affinity: its pages are, or soon will be, cached there) unless that engine carries
`balance_slack` more sequences than the least-loaded one; else the least-loaded one.

The prefixes an engine has seen are the page-hash chains of the prompts routed to it, kept in a
bounded LRU, as SGLang's cache-aware router does; the engines' own caches are never queried, so
a burst of requests sharing a prefix lands together before any of it is cached. Used by the
data-parallel front end for its ranks and by disaggregated serving for each group's engines.
"""
from __future__ import annotations

import collections
from collections.abc import Callable


class PrefixRouter:
  MAX_ROUTES = 1 << 16  # prefix hashes remembered

  def __init__(self, chain_hashes: Callable, page_size: int, balance_slack: int):
    # The engines' own page hashing (`BlockManager.chain_hashes`), so a route's keys are theirs.
    self._chain_hashes, self.page_size, self.balance_slack = chain_hashes, page_size, balance_slack
    self._routes: collections.OrderedDict[int, int] = collections.OrderedDict()  # hash -> engine

  @classmethod
  def over(cls, engine, max_num_seqs: int) -> "PrefixRouter":
    """Over engines like `engine` (an LLMEngine): one may carry a quarter of `max_num_seqs`
    more sequences than the least-loaded and still get a request for a prefix it has seen."""
    return cls(engine.blocks.chain_hashes, engine.config.cache.page_size,
               max(1, max_num_seqs // 4))

  def route(self, token_ids: list[int], cache_salt, loads: list[int]) -> int:
    """The engine (an index into `loads`, each engine's sequences) these tokens go to; their
    prefix is remembered there."""
    hashes = self._chain_hashes(token_ids, cache_salt, (len(token_ids) - 1) // self.page_size)
    least = min(range(len(loads)), key=loads.__getitem__)
    chosen = least
    for h in reversed(hashes):  # the longest prefix seen wins
      seen = self._routes.get(h)
      if seen is not None:
        if loads[seen] - loads[least] <= self.balance_slack:
          chosen = seen
        break
    for h in hashes:
      self._routes[h] = chosen
      self._routes.move_to_end(h)
    while len(self._routes) > self.MAX_ROUTES:
      self._routes.popitem(last=False)
    return chosen
