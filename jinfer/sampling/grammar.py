"""Constraints on a request's output as token masks: llguidance compiles a constraint
(`StructuredOutputsParams`: a JSON schema, a regex, a choice, a Lark grammar, any JSON object)
against the model's tokenizer, and a matcher per sequence gives the tokens allowed next as bit
words, ceil(V / 32) int32 per row (bit b of word w: token 32 w + b), which the step applies to
the logits (`jinfer/sampling/sample.py`).

Compiling is bounded: llguidance's parser limits cap the lexer's work and the grammar's size (an
enum of 100k strings is refused in a fraction of a second), a JSON schema reaches it as text,
whose parser refuses nesting deeper than 128 (handed over as a Python object, a schema nested
10,000 deep crashed its converter), and every limit hit is a `ParameterError` with the
compiler's reason. Compiled constraints are cached by their text; each sequence gets a copy of
the cached matcher, so n samples and repeated requests compile once.
"""
from __future__ import annotations

import collections
import json
import threading

import llguidance
import llguidance.numpy
import numpy as np

from jinfer.errors import ParameterError
from jinfer.sampling.params import StructuredOutputsParams
from jinfer.tokenizer import Tokenizer

PARAM = "structured_outputs"
CACHE_SIZE = 256  # compiled constraints kept (LRU)
# llguidance's defaults, spelled out: they bound a compile to well under a second on a CPU and a
# mask to a few milliseconds (its fuel units run at ~50k/ms and ~14k/ms).
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=250_000, max_grammar_size=500_000, verbose_errors=False)

# JSON is laid out as `json.dumps` does ("a": 1, "b": [1, 2]) with no free whitespace: a model
# that may put whitespace anywhere can emit it forever (a weak or random model does) and spend
# its max_tokens before closing the object. A schema's "x-guidance" options override this.
JSON_LAYOUT = dict(whitespace_flexible=False, item_separator=", ", key_separator=": ")


def mask_words(vocab_size: int) -> int:
  """W: int32 words of a row's token mask."""
  return (vocab_size + 31) // 32


def grammar_text(c: StructuredOutputsParams) -> str:
  """The constraint as an llguidance grammar (not yet compiled: that checks it)."""
  m = llguidance.LLMatcher
  if c.json is not None:
    if isinstance(c.json, str):
      text = c.json
    else:
      try:
        text = json.dumps(c.json)
      except (TypeError, ValueError, RecursionError) as e:
        raise ParameterError(PARAM, f"the JSON schema is not JSON: {e}") from None
    try:
      return m.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
    except ValueError as e:
      raise ParameterError(PARAM, f"invalid JSON schema: {e}") from None
  if c.json_object:
    return m.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
  if c.regex is not None:
    return m.grammar_from_regex(c.regex)
  if c.choice is not None:
    # An alternation of literal strings; JSON string syntax is Lark's for literals.
    return m.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in c.choice))
  return m.grammar_from_lark(c.grammar)


class GrammarCompiler:
  """Compiles constraints for one tokenizer and a model vocabulary of `vocab_size` logits (it
  may exceed the tokenizer's: the extra ids are never allowed). Thread-safe: a server may
  compile off its event loop while the engine steps."""

  def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
    self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids)
    self._ll_tokenizer: llguidance.LLTokenizer | None = None
    self._cache: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
    self._lock = threading.Lock()
    self.limits = llguidance.LLParserLimits(**LIMITS)
    self._executor: llguidance.LLExecutor | None = None

  @property
  def ll_tokenizer(self) -> llguidance.LLTokenizer:
    """Built on first use: it reads the whole vocabulary (~0.2 s for 49k tokens)."""
    with self._lock:
      if self._ll_tokenizer is None:
        self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.to_json(),
                                                    n_vocab=self.vocab_size,
                                                    eos_token=self._eos or None)
      return self._ll_tokenizer

  def matcher(self, c: StructuredOutputsParams) -> llguidance.LLMatcher:
    """A fresh matcher for `c`, at the start of the output; `ParameterError` with the
    compiler's reason if `c` does not compile."""
    key = grammar_text(c)
    with self._lock:
      proto = self._cache.get(key)
      if proto is not None:
        self._cache.move_to_end(key)
        return proto.deep_copy()
    tok = self.ll_tokenizer
    # Outside the lock: a long compile must not hold up cached ones (it releases the GIL).
    proto = llguidance.LLMatcher(tok, key, log_level=0, limits=self.limits)
    if proto.is_error():
      raise ParameterError(PARAM, f"the constraint does not compile: {proto.get_error()}")
    with self._lock:
      self._cache[key] = proto
      if len(self._cache) > CACHE_SIZE:
        self._cache.popitem(last=False)
    return proto.deep_copy()

  def fill(self, masks: np.ndarray,
           rows: list[tuple[llguidance.LLMatcher, int, list[int]]]) -> None:
    """For each (matcher, row, drafts), write into row `row` of masks [N, W] int32 the tokens
    the matcher allows after `drafts` (a verify row's draft prefix; none for a sequence's next
    token). The matcher consumes the drafts for the mask and rolls them back: it only ever
    advances by the tokens a sequence keeps. A row whose drafts the constraint refuses is left
    as it was (all ones): no draft at or below a refused one can be accepted, since the mask at
    the refused draft's parent forbids it.

    The rows without drafts: one on this thread, several on llguidance's thread pool (it
    releases the GIL); the others one by one (a mask takes some 25 us for a JSON schema over a
    49k vocabulary)."""
    plain = [(m, r) for m, r, drafts in rows if not drafts]
    if len(plain) == 1:
      llguidance.numpy.fill_next_token_bitmask(plain[0][0], masks, plain[0][1])
    elif plain:
      if self._executor is None:
        self._executor = llguidance.LLExecutor()
      llguidance.numpy.fill_next_token_bitmask_par(self._executor, plain, masks)
    for m, r, drafts in rows:
      if drafts:
        n = m.try_consume_tokens(drafts)  # a refused token stops it, and leaves no error
        if n == len(drafts):
          llguidance.numpy.fill_next_token_bitmask(m, masks, r)
        if n and not m.rollback(n):
          raise RuntimeError(f"structured outputs: rolling back {n} drafts failed: "
                             f"{m.get_error()}")
