"""Structured outputs: constraints (JSON schema, regex, choice, Lark grammar, any JSON object)
as token masks in the step, on the tiny random model, which emits garbage left to itself: every
finished sample must still satisfy its constraint. Its sharpened logits make temperature 1 close
to greedy, so each property is also sampled at temperature 3, where the samples differ."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from jinfer import SamplingParams, StructuredOutputsParams
from jinfer.errors import ParameterError
from jinfer.sampling.grammar import GrammarCompiler
from jinfer.tokenizer import Tokenizer
from tests.engine_fixtures import SMALL_POOL, CompileCounter, make_engine, random_prompts

SO = StructuredOutputsParams

# Every field bounded (lengths, ranges, items), so that most samples close within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5, "multipleOf": 0.25},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3},
        "ok": {"type": "boolean"},
        "inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                         "maximum": 99}},
                  "required": ["x"], "additionalProperties": False},
    },
    "required": ["name", "age", "score", "tags", "ok", "inner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_model):
  # SMALL_POOL's steps are shared with the other engine modules (the compilation cache), and its
  # pool of 32 pages of 4 tokens preempts.
  return make_engine(tiny_model, warmup="now", **SMALL_POOL)


def _sample(engine, constraint: SO, n: int, max_tokens: int, seed: int = 0, temperature=1.0,
            **kw) -> list:
  prompts = random_prompts(n, seed=seed, lo=3, hi=8)
  params = [SamplingParams(temperature=temperature, seed=seed * 100 + i, max_tokens=max_tokens,
                           structured_outputs=constraint, **kw) for i in range(n)]
  rids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
  final = engine.run_to_completion(rids)
  return [c for r in rids for c in final[r].outputs]


# Slow at 1.0: the tiny model's sharp logits make it nearly greedy (the seeds agree); 3.0 samples.
@pytest.mark.parametrize("temperature", [pytest.param(1.0, marks=pytest.mark.slow), 3.0])
def test_json_schema_samples_validate(engine, temperature):
  outs = _sample(engine, SO(json=SCHEMA), 5, 56, seed=1, temperature=temperature)
  finished = [o for o in outs if o.finish_reason == "stop"]
  for o in finished:
    jsonschema.validate(json.loads(o.text), SCHEMA)
  assert all(o.finish_reason == "length" for o in outs if o not in finished)
  assert len(finished) >= len(outs) // 2, [o.text for o in outs]


def test_regex_choice_and_json_object(engine):
  pattern = r"[a-z]{2,5}@[a-z]{3}\.(com|org)"
  outs = _sample(engine, SO(regex=pattern), 4, 20, seed=2, temperature=3.0)
  for o in outs:
    assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), o.text
  # A seeded constrained request reproduces, alone as in its batch.
  assert _sample(engine, SO(regex=pattern), 1, 20, seed=2, temperature=3.0)[0].text == outs[0].text
  choices = ["yes", "no", "maybe not"]
  outs = _sample(engine, SO(choice=choices), 6, 8, seed=3, temperature=3.0)
  assert all(o.text in choices and o.finish_reason == "stop" for o in outs)
  assert len({o.text for o in outs}) > 1
  for o in _sample(engine, SO(json_object=True), 3, 40, seed=4):
    if o.finish_reason == "stop":
      assert isinstance(json.loads(o.text), dict)
  grammar = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]/'
  for o in _sample(engine, SO(grammar=grammar), 3, 16, seed=5, temperature=3.0):
    if o.finish_reason == "stop":
      assert re.fullmatch(r"\([0-9](\+[0-9])*\)", o.text), o.text


def test_unconstrained_rows_unchanged_and_no_compiles(engine):
  greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
  prompts = random_prompts(2, seed=6, lo=3, hi=20)
  alone = [engine.run_to_completion([engine.add_request(None, p, greedy)]) for p in prompts]
  alone = [next(iter(f.values())).outputs[0].token_ids for f in alone]
  counter = CompileCounter()
  free = [engine.add_request(None, p, greedy) for p in prompts]
  constrained = [engine.add_request(None, p, SamplingParams(
      temperature=1.0, seed=i, max_tokens=12, structured_outputs=SO(regex="[0-9]{5,30}")))
      for i, p in enumerate(random_prompts(3, seed=7, lo=3, hi=20))]
  final = engine.run_to_completion(free + constrained)
  assert [final[r].outputs[0].token_ids for r in free] == alone
  assert all(re.fullmatch("[0-9]*", final[r].outputs[0].text) for r in constrained)
  assert counter.count == 0


def test_bad_constraints_raise_before_queueing(engine):
  bad = [SO(regex="a(b"), SO(json={"type": "foo"}), SO(json="{not json"),
         SO(grammar="start: undefined_rule")]
  for c in bad:
    with pytest.raises(ParameterError) as e:
      engine.add_request(None, [5, 6, 7], SamplingParams(structured_outputs=c))
    assert e.value.param == "structured_outputs"
  for kw in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"json": 3}):
    with pytest.raises(ParameterError):
      SO(**kw)
  with pytest.raises(ParameterError) as e:
    engine.add_request(None, [5], SamplingParams(min_tokens=2, structured_outputs=SO(regex="a+")))
  assert e.value.param == "min_tokens"
  # vLLM's extra body field, as it comes from JSON.
  assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs == SO(
      choice=("a",))
  assert not engine.has_unfinished_requests()


def test_hostile_constraints_are_refused_within_a_bound(engine):
  deep: dict = {"type": "string"}
  for _ in range(10_000):
    deep = {"type": "object", "properties": {"a": deep}}
  hostile = [SO(json=deep), SO(json=json.dumps({"enum": [f"s{i}" for i in range(100_000)]}))]
  for c in hostile:
    t0 = time.monotonic()
    with pytest.raises(ParameterError):
      engine.add_request(None, [5, 6, 7], SamplingParams(structured_outputs=c))
    assert time.monotonic() - t0 < 10
  assert not engine.has_unfinished_requests()
  # Catastrophic backtracking is no threat to an automaton: this one compiles and matches.
  for o in _sample(engine, SO(regex="(a+)+b"), 2, 12, seed=8, temperature=3.0):
    assert o.finish_reason == "length" or re.fullmatch("(a+)+b", o.text)


def test_n_samples_and_preemption_under_a_grammar(engine):
  """n > 1: each sample its own matcher; a batch that runs out of pages preempts and
  recomputes, and a constrained greedy request's output is the same as alone."""
  greedy = SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=SO(json=SCHEMA))
  prompt = random_prompts(1, seed=9, lo=20, hi=21)[0]
  alone = engine.run_to_completion([engine.add_request(None, prompt, greedy)])
  alone = next(iter(alone.values())).outputs[0].token_ids
  before = engine.stats().num_preemptions
  crowd = [engine.add_request(None, p, SamplingParams(temperature=3.0, n=2, seed=i, max_tokens=32,
                                                      structured_outputs=SO(json=SCHEMA)))
           for i, p in enumerate(random_prompts(3, seed=10, lo=18, hi=22))]
  rid = engine.add_request(None, prompt, greedy)
  final = engine.run_to_completion(crowd + [rid])
  assert engine.stats().num_preemptions > before, "the pool was meant to force preemption"
  assert final[rid].outputs[0].token_ids == alone
  samples = [c for r in crowd for c in final[r].outputs]
  assert len(samples) == 6 and len({tuple(c.token_ids) for c in samples}) > 1
  for c in samples:
    if c.finish_reason == "stop":
      jsonschema.validate(json.loads(c.text), SCHEMA)


def test_tokenizer_from_a_directory_masks_as_the_gguf_one(tiny_model, tmp_path):
  gguf_tok = tiny_model[2]
  (tmp_path / "tokenizer.json").write_text(gguf_tok.to_json())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  dir_tok = Tokenizer.from_dir(str(tmp_path))
  import numpy as np
  masks = []
  for tok in (gguf_tok, dir_tok):
    c = GrammarCompiler(tok, gguf_tok.vocab_size, gguf_tok.eos_token_ids)
    m = c.matcher(SO(json=SCHEMA))
    assert m.consume_tokens(tok.encode('{"name": "ab', add_special_tokens=False))
    masks.append(np.zeros((1, (gguf_tok.vocab_size + 31) // 32), np.int32))
    c.fill(masks[-1], [(m, 0)])
  assert (masks[0] == masks[1]).all() and masks[0].any()


@pytest.mark.slow
def test_speculation_keeps_the_constrained_greedy_output(tiny_model):
  """A constrained sequence drafts nothing (its verify rows would each need their own prefix's
  mask): beside speculating unconstrained ones, its greedy output is the one without
  speculation, and theirs too."""
  options = dict(max_model_len=128, page_size=8, num_pages=40, max_num_seqs=8,
                 max_num_batched_tokens=16, max_prefill_seqs=2)
  plain = make_engine(tiny_model, warmup=False, **options)
  spec = make_engine(tiny_model, warmup=False, **options, speculative_config={
      "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
  params = [SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=c) for c in
            (SO(json=SCHEMA), SO(regex="[a-z ]{4,40}"), None, None)]
  prompts = random_prompts(4, seed=11, lo=5, hi=30)

  def run(engine):
    rids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    final = engine.run_to_completion(rids)
    return [final[r].outputs[0].token_ids for r in rids]

  assert run(spec) == run(plain)
  assert spec.stats().spec.num_draft_tokens > 0, "the unconstrained sequences were meant to speculate"


def test_generate_command_takes_a_constraint():
  from jinfer.cli import _params, parser
  args = parser().parse_args(["generate", "--choice", "yes", "--choice", "no", "Is it?"])
  assert _params(args).structured_outputs == SO(choice=("yes", "no"))
  args = parser().parse_args(["generate", "--json-schema", '{"type": "object"}', "Say it"])
  assert _params(args).structured_outputs == SO(json='{"type": "object"}')
  assert _params(parser().parse_args(["generate", "hi"])).structured_outputs is None


def test_llm_generate_checks_every_constraint_first(engine):
  from jinfer import LLM
  llm = object.__new__(LLM)  # the offline API over this module's engine (no second model load)
  llm.engine, llm.is_leader, llm.tokenizer = engine, True, engine.tokenizer
  good = SamplingParams(temperature=3.0, seed=1, max_tokens=8,
                        structured_outputs=SO(choice=["red", "green"]))
  bad = SamplingParams(structured_outputs=SO(regex="(unclosed"))
  with pytest.raises(ValueError, match="prompt 1"):
    llm.generate([[5, 6, 7], [8, 9]], [good, bad], use_tqdm=False)
  assert not engine.has_unfinished_requests()
  outs = llm.generate([[5, 6, 7], [8, 9]], good, use_tqdm=False)
  assert all(o.outputs[0].text in ("red", "green") for o in outs)
