"""Property-based fuzzing: settings and the value strategies the fuzz tests share.

Each fuzz test runs a small, fixed (derandomized) set of examples, so the suite stays fast and
repeatable. `JINFER_FUZZ_EXAMPLES=N` runs N random examples per test instead, e.g.
`JINFER_FUZZ_EXAMPLES=2000 python -m pytest -m fuzz`.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

_LONG = os.environ.get("JINFER_FUZZ_EXAMPLES")


def fuzz_settings(examples: int, **kwargs) -> settings:
  """`examples` derandomized examples, or JINFER_FUZZ_EXAMPLES random ones."""
  return settings(max_examples=int(_LONG) if _LONG else examples, derandomize=not _LONG,
                  deadline=None, database=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.function_scoped_fixture], **kwargs)


# Where fixed-width arrays and parsers break: the edges of int32, uint32, int64 and float32.
INT_EDGES = (-2**64, -2**63 - 1, -2**63, -2**31 - 1, -2**31, -2, -1, 0, 1, 2, 2**31 - 1, 2**31,
             2**32, 2**63 - 1, 2**63, 2**64, 10**30)
FLOAT_EDGES = (0.0, -0.0, 1e-50, 1.2e-38, 1e-7, 0.5, 1.0, 2.0, 2.0000001, 3.4e38, 3.5e38, 1e300,
               float("inf"), float("-inf"), float("nan"))


def junk() -> st.SearchStrategy:
  """Values of the wrong type for any field."""
  return st.one_of(st.none(), st.booleans(), st.text(max_size=4),
                   st.lists(st.integers(-2, 5), max_size=2),
                   st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))


def edges() -> st.SearchStrategy:
  """Boundary and wrong values for any field."""
  return st.one_of(st.sampled_from(INT_EDGES + FLOAT_EDGES), junk())


def sampling_fields(token_ids: st.SearchStrategy) -> tuple[dict, dict]:
  """(valid, edge) strategies per SamplingParams field. Valid counts stay small, so that a
  request that runs finishes soon; edges are the limits of its array type and wrong types."""
  valid = {
      "n": st.integers(1, 3),
      "temperature": st.one_of(st.just(0.0), st.floats(0.0, 3.0)),
      "top_p": st.floats(0.01, 1.0),
      "top_k": st.integers(-1, 60),
      "min_p": st.floats(0.0, 1.0),
      "repetition_penalty": st.floats(0.5, 3.0),
      "presence_penalty": st.floats(-2.0, 2.0),
      "frequency_penalty": st.floats(-2.0, 2.0),
      "seed": st.integers(-2**63, 2**63 - 1),
      "max_tokens": st.integers(1, 8),
      "min_tokens": st.integers(0, 3),
      "stop": st.one_of(st.text(min_size=1, max_size=3),
                        st.lists(st.text(min_size=1, max_size=3), max_size=3)),
      "stop_token_ids": st.lists(token_ids, max_size=3),
      "include_stop_str_in_output": st.booleans(),
      "ignore_eos": st.booleans(),
      "logprobs": st.integers(0, 20),
      "skip_special_tokens": st.booleans(),
  }
  edge = {name: edges() for name in valid}
  edge["stop"] = st.one_of(edges(), st.lists(st.just("x"), min_size=65, max_size=65),
                           st.lists(st.one_of(st.just(""), st.integers()), min_size=1, max_size=2))
  edge["stop_token_ids"] = st.one_of(edges(), st.lists(st.sampled_from(INT_EDGES), min_size=1,
                                                       max_size=2),
                                     st.lists(st.just(1), min_size=65, max_size=65))
  return valid, edge


@st.composite
def one_edge(draw, valid: dict, edge: dict, required: tuple[str, ...] = ()) -> dict:
  """The `required` fields and some others, all valid, and half the time one of them at an
  edge: a request is refused for that field alone, or runs."""
  fields = draw(st.fixed_dictionaries({k: valid[k] for k in required},
                                      optional={k: v for k, v in valid.items()
                                                if k not in required}))
  if draw(st.booleans()):
    name = draw(st.sampled_from(sorted(edge)))
    fields[name] = draw(edge[name])
  return fields
