"""Fuzzing the engine on a tiny random model.

(a) Whatever SamplingParams a request brings, it is refused with a ValueError before anything is
    queued, or it runs to a normal finish; either way the requests in its batch produce exactly
    what they produce alone.
(b) Adds, aborts and steps in any order keep every KV page accounted for, and leave all of them
    free once the requests are gone.
"""
from __future__ import annotations

import collections

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)

from jinfer.sampling.params import SamplingParams
from tests.engine_fixtures import SMALL_POOL, make_engine
from tests.fuzz import INT_EDGES, fuzz_settings, one_edge, sampling_fields

pytestmark = pytest.mark.fuzz

MATES = [[11, 22, 33, 44, 55, 66], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
MATE_PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model):
  # Long prompts are chunked, and the pool of 32 pages of 4 tokens can run out, so sequences are
  # preempted and recomputed.
  return make_engine(tiny_model, **SMALL_POOL)


@pytest.fixture(scope="module")
def mates_alone(engine) -> list[list[int]]:
  outs = []
  for p in MATES:
    rid = engine.add_request(None, p, MATE_PARAMS)
    outs.append(engine.run_to_completion([rid])[rid].outputs[0].token_ids)
  return outs


def _all_free(engine):
  b = engine.blocks
  b.check_consistency()
  assert not engine.has_unfinished_requests()
  assert b.num_free_pages == b.num_usable_pages and not any(b.ref)


@st.composite
def _request(draw, vocab: int) -> tuple[str | list[int], dict]:
  """A prompt (valid three times in four) and SamplingParams fields (see `one_edge`)."""
  valid = st.one_of(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24),
                    st.text(min_size=1, max_size=40))
  edge = st.one_of(st.just([]), st.lists(st.sampled_from(INT_EDGES + (vocab,)), min_size=1,
                                         max_size=3),
                   st.lists(st.integers(0, 99), min_size=64, max_size=70))  # too long
  prompt = draw(st.one_of(valid, valid, valid, edge))
  return prompt, draw(one_edge(*sampling_fields(st.integers(0, vocab - 1))))


@fuzz_settings(30)
@given(data=st.data())
def test_any_sampling_params_fail_alone_or_run(engine, mates_alone, data):
  prompt, kwargs = data.draw(_request(engine.model_config.vocab_size))
  try:
    params = SamplingParams(**kwargs)
  except ValueError as e:
    assert str(e)
    event("refused by SamplingParams")
    return
  mates = [engine.add_request(None, p, MATE_PARAMS) for p in MATES]
  rid = None
  try:
    rid = engine.add_request(None, prompt, params)
  except ValueError as e:
    assert str(e) and set(engine.groups) == set(mates)  # refused before anything was queued
    event("refused by the engine")
  final = engine.run_to_completion()
  assert [final[m].outputs[0].token_ids for m in mates] == mates_alone
  if rid is not None:
    out = final[rid]
    assert out.error is None and len(out.outputs) == params.n
    assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
    event("ran")
  _all_free(engine)


class _AddAbortStep(RuleBasedStateMachine):
  """Random adds (shared prefixes, n > 1, salts), aborts (of live and finished requests) and
  steps on one engine. What is drawn never depends on the engine's answers, which its earlier
  history (the prefix cache) can change."""
  engine = None  # set by the test

  def __init__(self):
    super().__init__()
    self.added: list[str] = []
    self.live: set[str] = set()

  @rule(prefix=st.sampled_from([[], [5] * 9, [6, 7] * 6]),
        tail=st.lists(st.integers(3, 40000), min_size=1, max_size=30),
        n=st.integers(1, 3), max_tokens=st.integers(1, 12),
        temperature=st.sampled_from([0.0, 0.8]), salt=st.sampled_from([None, "s"]))
  def add(self, prefix, tail, n, max_tokens, temperature, salt):
    rid = f"f{len(self.added)}"
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=1,
                            ignore_eos=True)
    self.engine.add_request(rid, prefix + tail, params, cache_salt=salt)
    self.added.append(rid)
    self.live.add(rid)

  @precondition(lambda self: self.added)
  @rule(data=st.data())
  def abort(self, data):
    rid = data.draw(st.sampled_from(self.added))
    assert self.engine.abort(rid) == (rid in self.live)
    self.live.discard(rid)

  @rule(steps=st.integers(1, 4))
  def step(self, steps):
    for _ in range(steps):
      for out in self.engine.step():
        if out.finished:
          self.live.remove(out.request_id)

  @invariant()
  def pages_accounted_for(self):
    sched, blocks = self.engine.scheduler, self.engine.blocks
    blocks.check_consistency()
    held = collections.Counter(p for s in [*sched.running, *sched.waiting]
                               for group in s.pages for p in group if p >= 0)
    assert all(blocks.ref[p] == held[p] for p in range(1, blocks.num_pages))
    assert set(self.engine.groups) == self.live

  def teardown(self):
    for rid in self.live:
      self.engine.abort(rid)
    _all_free(self.engine)


def test_any_interleaving_of_add_abort_step_leaks_no_pages(engine):
  _AddAbortStep.engine = engine
  run_state_machine_as_test(_AddAbortStep, settings=fuzz_settings(10, stateful_step_count=20))
