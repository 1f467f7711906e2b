"""A tree of candidate continuations, verified in one step (Medusa, SpecInfer).

A tree is given as its paths, like Medusa's `medusa_choices`: `(1, 0)` is "the second-best
guess of the first head, then the best guess of the second head after it". Node 0 is the root,
the sequence's last committed token; the other nodes are numbered in breadth-first order (by
depth, then path), so every parent precedes its children and any prefix of the nodes is a tree
too (what a step cut short by its token budget verifies). A node at depth d is a guess of head
d - 1, its token that head's `choice`-th candidate.

In the step a sequence's rows are its nodes in that order: row i writes its K/V to the i-th slot
after the context, sits at position context + depth, and sees its ancestors and itself (the
attention contract's tree mask). After acceptance the accepted path's K/V moves to the slots of
its depths (`path`), so the sequence's cache reads as if the path had been decoded one token at
a time.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Sequence

import numpy as np

MAX_NODES = 64  # verify rows per sequence and step, root excluded


@dataclasses.dataclass(frozen=True, eq=False)
class Tree:
  choices: tuple[tuple[int, ...], ...]  # the nodes' paths, breadth-first (root excluded)
  parent: np.ndarray  # [N+1] int32: each node's parent (the root's: itself)
  depth: np.ndarray  # [N+1] int32
  choice: np.ndarray  # [N+1] int32: which candidate of its head (the root: 0)
  visible: np.ndarray  # [N+1, N+1] bool: row i sees node j (j is i or an ancestor of i)
  path: np.ndarray  # [N+1, D+1] int32: node i's ancestors at depths 0..depth(i), then i repeated

  @property
  def num_nodes(self) -> int:  # N, the root excluded
    return len(self.choices)

  @property
  def max_depth(self) -> int:  # D
    return self.path.shape[1] - 1

  @property
  def topk(self) -> int:  # candidates each head must offer
    return 1 + max(max(c) for c in self.choices)

  def nodes_within(self, depth: int) -> int:
    """How many nodes lie at depth <= `depth` (a prefix, breadth-first)."""
    return int(np.sum(self.depth[1:] <= depth))

  def depth_of(self, num_nodes: int) -> int:
    """The depth of a tree cut to its first `num_nodes` nodes."""
    return int(self.depth[num_nodes])

  @classmethod
  @functools.cache
  def chain(cls, length: int) -> "Tree":
    """A chain of `length` drafts: node i's parent is node i - 1."""
    return cls.of(chain_choices(length), length)

  @classmethod
  def of(cls, choices: Sequence[Sequence[int]], num_heads: int) -> "Tree":
    """Check and order `choices`; each path's prefixes must be in the tree too."""
    paths = []
    for c in choices:
      if (not isinstance(c, (list, tuple)) or not c
          or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in c)):
        raise ValueError(f"medusa_choices: each path must be a non-empty list of candidate "
                         f"indices (integers >= 0), got {c!r}")
      paths.append(tuple(c))
    if not paths:
      raise ValueError("medusa_choices: the tree needs at least one path")
    if len(set(paths)) != len(paths):
      raise ValueError("medusa_choices: a path is listed twice")
    if len(paths) > MAX_NODES:
      raise ValueError(f"medusa_choices: {len(paths)} nodes; at most {MAX_NODES} are supported")
    known = set(paths)
    for p in paths:
      if len(p) > num_heads:
        raise ValueError(f"medusa_choices: path {list(p)} is {len(p)} deep; there are "
                         f"{num_heads} heads")
      if len(p) > 1 and p[:-1] not in known:
        raise ValueError(f"medusa_choices: path {list(p)} lacks its parent {list(p[:-1])}")
    paths.sort(key=lambda p: (len(p), p))
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    n, d = len(paths), max(map(len, paths))
    parent = np.zeros(n + 1, np.int32)
    depth = np.zeros(n + 1, np.int32)
    choice = np.zeros(n + 1, np.int32)
    visible = np.eye(n + 1, dtype=bool)
    path = np.zeros((n + 1, d + 1), np.int32)
    for p, i in index.items():
      if p:
        parent[i], depth[i], choice[i] = index[p[:-1]], len(p), p[-1]
      chain = [index[p[:j]] for j in range(len(p) + 1)]
      visible[i, chain] = True
      path[i] = chain + [i] * (d - len(p))
    return cls(tuple(paths), parent, depth, choice, visible, path)


def chain_choices(num_heads: int) -> list[tuple[int, ...]]:
  """Each head's best guess after the previous one's: a chain of `num_heads`."""
  return [(0,) * i for i in range(1, num_heads + 1)]


def best_choices(rank_hits: Sequence[Sequence[float]], num_nodes: int) -> list[tuple[int, ...]]:
  """The `num_nodes` paths most likely to be accepted in full, taking each head's guesses as
  independent: a path's chance is the product over its depths of `rank_hits[depth][choice]`
  (how often that head's `choice`-th candidate is the right token), as the Medusa paper builds
  its trees. Grown best-first from the root, so every path's parent is chosen before it."""
  hits = [list(h) for h in rank_hits]
  heap = [(-hits[0][0], (0,), 1.0)]  # (-the path's chance, the path, its parent's chance)
  out = []
  while heap and len(out) < num_nodes:
    neg, p, up = heapq.heappop(heap)
    out.append(p)
    d, c = len(p) - 1, p[-1]
    if c + 1 < len(hits[d]):  # its next sibling
      heapq.heappush(heap, (-up * hits[d][c + 1], p[:-1] + (c + 1,), up))
    if d + 1 < len(hits):  # its first child
      heapq.heappush(heap, (neg * hits[d + 1][0], p + (0,), -neg))
  return out


def expected_length(choices: Sequence[Sequence[int]],
                    rank_hits: Sequence[Sequence[float]]) -> float:
  """Tokens a step is expected to yield with this tree, the target's own token included: one
  plus each path's chance of being accepted in full (the product of its hit rates), taking the
  heads' guesses as independent, as `best_choices` does."""
  return 1.0 + sum(float(np.prod([rank_hits[d][c] for d, c in enumerate(p)])) for p in choices)


def default_choices(num_heads: int, rank_hits: Sequence[Sequence[float]] | None = None,
                    num_nodes: int = 10) -> list[tuple[int, ...]]:
  """The tree used when none is given: the best `num_nodes` paths for the heads' measured
  accuracy (a checkpoint's `rank_hits`), or for a typical decay of it (each head right about
  half as often as the one before, each next candidate a third as often as the one above)."""
  if rank_hits is None:
    rank_hits = [[0.6 * 0.5 ** h * 0.35 ** i for i in range(8)] for h in range(num_heads)]
  return best_choices(list(rank_hits)[:num_heads], num_nodes)
