"""Structured outputs: constraints (JSON schema, regex, choice, Lark grammar, any JSON object)
as token masks in the step, on the tiny random model, which emits garbage left to itself: every
finished sample must still satisfy its constraint. Its sharpened logits make temperature 1 close
to greedy, so each property is also sampled at temperature 3, where the samples differ. Under
speculation each verify row is masked for its own draft prefix."""
from __future__ import annotations

import json
import re
import time

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jinfer import SamplingParams, StructuredOutputsParams
from jinfer.engine.step_input import draft_prefixes
from jinfer.errors import ParameterError
from jinfer.sampling.accept import VerifyTensors, accept
from jinfer.sampling.grammar import GrammarCompiler, mask_words
from jinfer.sampling.tree import Tree
from jinfer.tokenizer import Tokenizer
from tests.engine_fixtures import SMALL_POOL, CompileCounter, make_engine, random_prompts
from tests.test_accept import tensors

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
  masks = []
  for tok in (gguf_tok, dir_tok):
    c = GrammarCompiler(tok, gguf_tok.vocab_size, gguf_tok.eos_token_ids)
    m = c.matcher(SO(json=SCHEMA))
    assert m.consume_tokens(tok.encode('{"name": "ab', add_special_tokens=False))
    masks.append(np.zeros((1, (gguf_tok.vocab_size + 31) // 32), np.int32))
    c.fill(masks[-1], [(m, 0, [])])
  assert (masks[0] == masks[1]).all() and masks[0].any()


def _verify(c, matcher, logits, drafts, tree, masked=True):
  """`accept` over one sequence's verify rows [m + 1, v] (greedy), each row masked for its own
  draft prefix (or, `masked=False`, left all ones): (tokens emitted, drafts accepted). The
  logits cover the vocabulary's first v tokens only, and the masks their first v bits: the
  rest never matters here, and a full row would make the test a few seconds slower."""
  m, k = len(drafts), tree.num_nodes
  allowed = np.full((m + 1, mask_words(c.vocab_size)), -1, np.int32)
  if masked:
    c.fill(allowed, [(matcher, j, p) for j, p in enumerate(draft_prefixes(drafts, m, tree))])
  allowed = allowed[:, :mask_words(logits.shape[1])]
  vt = VerifyTensors(
      draft_tokens=jnp.asarray([drafts], jnp.int32), num_drafts=jnp.asarray([m], jnp.int32),
      row_seq=jnp.zeros(m + 1, jnp.int32), row_depth=jnp.arange(m + 1, dtype=jnp.int32),
      chain=jnp.minimum(jnp.arange(k + 1, dtype=jnp.int32), m)[None],
      ban_rows=jnp.zeros(1, jnp.int32), allowed=jnp.asarray(allowed))
  out = accept(jnp.asarray(logits), tensors(1, [0], temperature=0.0), vt, tree)
  a = int(out.num_accepted[0])
  return [int(t) for t in out.sample.tokens[0, :a + 1]], a


def test_a_draft_the_constraint_forbids_is_never_accepted(tiny_model):
  """Each verify row is masked for its own draft prefix: a target whose logits favour every
  draft accepts them up to the first the constraint refuses and then emits a token the
  constraint allows, in a chain and in a tree (where a refused node's children are refused with
  it and an allowed sibling is taken). Masked by the sequence's mask alone it would not."""
  config, _, tok = tiny_model
  c = GrammarCompiler(tok, config.vocab_size, tok.eos_token_ids)
  matcher = c.matcher(SO(regex="a[bc]+"))
  a, b, cc, x = (tok.encode(t, add_special_tokens=False)[0] for t in "abcx")

  def logits(*favourites):  # row i ranks favourites[i] first, then the others in order
    out = np.zeros((len(favourites), 128), np.float32)  # a, b, c and x are among the first 128
    for i, row in enumerate(favourites):
      out[i, list(row)] = 10.0 - np.arange(len(row))
    return out

  # A chain a, b, a, c: the second a is refused after "ab"; row 2 then picks c, its next best.
  chain, drafts = Tree.chain(3), [a, b, a]
  rows = logits([a], [b], [a, cc], [cc])
  assert _verify(c, matcher, rows, drafts, chain) == ([a, b, cc], 2)
  assert _verify(c, matcher, rows, drafts, chain, masked=False) == ([a, b, a, cc], 3)
  # A tree: node 1 = x (refused at the start), node 2 = a, node 3 = b under x.
  tree, drafts = Tree.of([(0,), (1,), (0, 0)], 2), [x, a, b]
  rows = logits([x, a], [b], [b], [b])
  assert _verify(c, matcher, rows, drafts, tree) == ([a, b], 1)
  assert _verify(c, matcher, rows, drafts, tree, masked=False) == ([x, b, b], 2)
  # Filling the masks left the matcher where it was, and the rows under x as they were.
  masks = np.zeros((2, mask_words(config.vocab_size)), np.int32)
  c.fill(masks, [(matcher, 0, [x]), (matcher, 1, [x, b])])
  assert (masks == 0).all() and matcher.validate_tokens([a, b, cc]) == 3


@pytest.mark.slow
def test_ngram_speculates_under_a_constraint(tiny_model):
  """n-gram drafts under a constraint, each verify row masked for its own draft prefix: greedy
  output and seeded samples are the ones without speculation (beside unconstrained sequences,
  whose output does not change either), the constraint holds, and its sequences do speculate:
  drafts are verified and accepted."""
  options = dict(max_model_len=128, page_size=8, num_pages=40, max_num_seqs=8,
                 max_num_batched_tokens=16, max_prefill_seqs=2)
  plain = make_engine(tiny_model, warmup=False, **options)
  spec = make_engine(tiny_model, warmup=False, **options, speculative_config={
      "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
  constraints = [SO(json=SCHEMA), SO(regex="[a-z ]{4,40}"), SO(regex="[0-9]{5,30}")]
  prompts = random_prompts(5, seed=11, lo=5, hi=30)

  def run(engine, temperature, free=False):
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=40, structured_outputs=c)
              for i, c in enumerate(constraints + [None, None] * free)]
    rids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    final = engine.run_to_completion(rids)
    return [final[r].outputs[0] for r in rids]

  for temperature in (0.0, 3.0):  # 1.0 is near-greedy on the tiny model: 3.0 samples
    before = spec.stats().spec
    outs = run(spec, temperature)
    stats = spec.stats().spec.since(before)
    assert [o.token_ids for o in outs] == [o.token_ids for o in run(plain, temperature)]
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, temperature
    json_out, *regex_outs = outs
    if json_out.finish_reason == "stop":
      jsonschema.validate(json.loads(json_out.text), SCHEMA)
    for o, c in zip(regex_outs, constraints[1:]):
      assert o.finish_reason == "length" or re.fullmatch(c.regex, o.text), o.text
  mixed = run(spec, 0.0, free=True)
  assert [o.token_ids for o in mixed] == [o.token_ids for o in run(plain, 0.0, free=True)]


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
