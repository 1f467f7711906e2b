"""`speculative_config`: what proposes draft tokens and how many, as vLLM spells it."""
from __future__ import annotations

import dataclasses
import functools
import numbers
import os
from typing import Any

from jinfer.engine.json_option import parse_option
from jinfer.engine.speculative.medusa_heads import (META, PUBLISHED_FILE, heads_meta,
                                                   is_medusa_checkpoint)
from jinfer.errors import ParameterError
from jinfer.sampling.tree import Tree, default_choices
from jinfer.weights.builtin import is_builtin, resolve_speculative_model


def default_tree_nodes(platform: str) -> int:
  """Nodes of the default tree. On the CPU a step's cost grows with its rows (SmolLM2: 1, 5 and
  8 rows take 17.5, 26 and 32 ms), so the tree is small: 4 nodes, whose 5 rows are a bucket of
  their own (1 + k), measured ahead of 7 nodes (8 rows) and of the 4-head chain. On accelerators
  a single stream's step is memory-bound and rows come cheap: 31 nodes, 32 rows."""
  return 4 if platform == "cpu" else 31

METHODS = ("ngram", "draft_model", "medusa")
MAX_SPECULATIVE_TOKENS = 16
ACCEPTANCE_METHODS = ("rejection_sampler", "typical_acceptance_sampler")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
  method: str  # "ngram" (prompt lookup, no model), "draft_model" or "medusa"
  # k: drafts verified per sequence and step; for medusa, the heads used (the tree's depth),
  # by default the checkpoint's heads (as vLLM takes it from a speculator's config) or the
  # depth of `medusa_choices`
  num_speculative_tokens: int | None = None
  # draft_model: a draft checkpoint, HF directory, .gguf or built-in; medusa: a heads checkpoint
  # (ours, or a directory or file of published `medusa_lm_head.safetensors`)
  model: str | None = None
  # ngram: the longest and shortest suffix of the sequence looked up in its earlier tokens.
  prompt_lookup_max: int | None = None
  prompt_lookup_min: int | None = None
  # Speculate only in steps whose running batch has at most this many sequences (None: always).
  # Verifying k+1 rows per sequence pays where a step's cost hardly grows with its rows (one
  # sequence, a memory-bound accelerator); on a compute-bound one a large batch loses.
  disable_by_batch_size: int | None = None
  # Speculate for a sequence only while the moving average of the drafts it gets accepted per
  # verify step stays at or above this (None: always). Below it, the sequence decodes plainly
  # for a while and then tries again (`pause.py`): where its text defeats the proposer, it pays
  # little more than the proposer's upkeep instead of a verify step's cost.
  min_accepted_per_step: float | None = None
  # medusa: the candidate tree, as paths of per-head candidate indices (Medusa's
  # `medusa_choices`); None: the best tree of `default_tree_nodes()` nodes for the heads'
  # measured accuracy (see `jinfer/sampling/tree.py`).
  medusa_choices: list | None = None
  # medusa: "rejection_sampler" keeps the target's distribution exactly; Medusa's
  # "typical_acceptance_sampler" accepts any candidate more likely than
  # min(posterior_threshold, posterior_alpha * exp(-entropy)): longer acceptance, NOT lossless.
  acceptance_method: str = "rejection_sampler"
  posterior_threshold: float = 0.09
  posterior_alpha: float = 0.3

  def __post_init__(self):
    """Checks what needs no file and no platform; `resolve()` does the rest."""
    if self.method not in METHODS:
      raise _error(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
    if self.num_speculative_tokens is not None:
      _int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
    elif self.method != "medusa":
      raise _error(f"method {self.method!r} needs num_speculative_tokens")
    if self.method == "ngram":
      if self.model is not None:
        raise _error("model is for method 'draft_model' or 'medusa', not 'ngram'")
      lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
      # As in vLLM: one bound given sets both.
      lo, hi = (lo if lo is not None else hi), (hi if hi is not None else lo)
      lo, hi = (2, 4) if lo is None else (lo, hi)
      _int("prompt_lookup_min", lo, 1)
      _int("prompt_lookup_max", hi, 1)
      if lo > hi:
        raise _error(f"prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
      object.__setattr__(self, "prompt_lookup_min", lo)
      object.__setattr__(self, "prompt_lookup_max", hi)
    else:
      if not isinstance(self.model, str) or not self.model:
        raise _error(f"method {self.method!r} needs model, "
                     + ("the draft's path or built-in name" if self.method == "draft_model"
                        else "a Medusa heads checkpoint"))
      for name in ("prompt_lookup_min", "prompt_lookup_max"):
        if getattr(self, name) is not None:
          raise _error(f"{name} is for method 'ngram'")
    if self.method == "medusa":
      if self.acceptance_method not in ACCEPTANCE_METHODS:
        raise _error(f"acceptance_method must be one of {', '.join(ACCEPTANCE_METHODS)}, got "
                     f"{self.acceptance_method!r}")
      for name in ("posterior_threshold", "posterior_alpha"):
        v = getattr(self, name)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v <= 1:
          raise _error(f"{name} must be in (0, 1], got {v!r}")
      choices = self.medusa_choices
      if choices is not None:
        if not isinstance(choices, (list, tuple)):
          raise _error(f"medusa_choices must be a list of paths, got {type(choices).__name__}")
        tree = _tree(choices, self.num_speculative_tokens or MAX_SPECULATIVE_TOKENS)
        object.__setattr__(self, "medusa_choices", [list(c) for c in tree.choices])
        if self.num_speculative_tokens is None:
          object.__setattr__(self, "num_speculative_tokens", tree.max_depth)
    elif self.medusa_choices is not None:
      raise _error("medusa_choices is for method 'medusa'")
    if self.disable_by_batch_size is not None:
      _int("disable_by_batch_size", self.disable_by_batch_size, 1)
    v = self.min_accepted_per_step
    if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or v < 0):
      raise _error(f"min_accepted_per_step must be a number >= 0, got {v!r}")

  def resolve(self, platform: str) -> "SpeculativeConfig":
    """This config checked against the files it names, with what the platform decides filled
    in (Medusa's default tree): what the engine runs. The one place speculation reads files.
    A shipped checkpoint's name becomes its installed path; a model that is neither a known name
    nor a path that exists is "not found"."""
    self = resolve_speculative_model(self)
    if self.method == "draft_model" and not (
        is_builtin(self.model) or os.path.isdir(self.model)
        or (os.path.isfile(self.model) and self.model.endswith(".gguf"))):
      raise _error(f"model {self.model!r} is not a built-in name, a directory (a draft "
                   f"checkpoint or HF model) or a .gguf file")
    if self.method != "medusa":
      return self
    if not is_medusa_checkpoint(self.model):
      raise _error(f"method 'medusa' needs model, a Medusa heads checkpoint (a directory with "
                   f"{META} or {PUBLISHED_FILE}); got {self.model!r}")
    if self.medusa_choices is not None:
      return self
    meta = heads_meta(self.model)
    if self.num_speculative_tokens is None:
      self = dataclasses.replace(
          self, num_speculative_tokens=min(meta["num_heads"], MAX_SPECULATIVE_TOKENS))
    if meta["num_heads"] < self.num_speculative_tokens:
      raise _error(f"num_speculative_tokens is {self.num_speculative_tokens}; {self.model} has "
                   f"{meta['num_heads']} heads")
    choices = default_choices(self.num_speculative_tokens, meta.get("rank_hits"),
                              default_tree_nodes(platform))
    return dataclasses.replace(self, medusa_choices=[list(c) for c in choices])

  @classmethod
  def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str") -> "SpeculativeConfig":
    """From a config, a dict, or JSON text (the CLI's --speculative-config)."""
    return parse_option(cls, value, "speculative_config", "method")

  def to_dict(self) -> dict[str, Any]:
    d = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
    if self.method != "medusa":
      for name in ("acceptance_method", "posterior_threshold", "posterior_alpha"):
        d.pop(name)
    return d

  @property
  def verifies_tree(self) -> bool:
    return self.method == "medusa"

  @property
  def num_draft_rows(self) -> int:
    """Verify rows a sequence may add to a step: k, or the tree's nodes."""
    return self.tree().num_nodes if self.verifies_tree else self.num_speculative_tokens

  def tree(self) -> Tree | None:
    """Medusa's candidate tree (once resolved); None for the other methods."""
    if not self.verifies_tree:
      return None
    if self.medusa_choices is None:
      raise RuntimeError("the Medusa tree is chosen by resolve(): call it first")
    return _tree(self.medusa_choices, self.num_speculative_tokens)


def _tree(choices, depth: int) -> Tree:
  return _tree_of(tuple(tuple(c) for c in choices), depth)


@functools.lru_cache(maxsize=64)
def _tree_of(choices: tuple, depth: int) -> Tree:
  try:
    return Tree.of([list(c) for c in choices], depth)
  except ValueError as e:
    raise _error(f"medusa_choices: {e}") from None


def _error(message: str) -> ParameterError:
  return ParameterError("speculative_config", f"speculative_config: {message}")


def _int(name: str, v, lo: int, hi: int | None = None) -> None:
  if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo or (hi and v > hi):
    bound = f"in [{lo}, {hi}]" if hi else f">= {lo}"
    raise _error(f"{name} must be an integer {bound}, got {v!r}")
