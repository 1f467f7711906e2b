"""Engine invariants on a tiny random model: batch invariance, prefix cache, leaks, compiles."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from jinfer.sampling.params import SamplingParams
from tests.engine_fixtures import SMALL_POOL, CompileCounter, make_engine, random_prompts, run_tokens
from tests.paged_batch import PagedBatch

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_model):
  return tiny_model


# The module engine: SMALL_POOL's 8-token budget chunks every prompt past 8 tokens and its 32 pages
# of 4 tokens force preemption; test_fuzz_engine and test_server_guard build theirs with the same
# options, so its steps are compiled once for the three. Prompts fit its max_model_len of 64.
@pytest.fixture(scope="module")
def engine(loaded):
  return make_engine(loaded, **SMALL_POOL)


# The slow tests' fresh engines, for prompts up to 200 tokens: built with these same options, they
# share their compiled steps through the compilation cache.
OPTIONS = dict(max_model_len=256, page_size=8, num_pages=90, max_num_seqs=16,
               max_num_batched_tokens=64, max_prefill_seqs=2)

_prompts = functools.partial(random_prompts, hi=40)
_run = run_tokens


def test_greedy_output_same_alone_and_in_a_batch(engine):
  prompts = _prompts(20)
  shared = _prompts(1, seed=9, lo=24, hi=25)[0]  # six full pages
  prompts += [shared + p[:7] for p in prompts[:4]]  # prefix hits among these
  alone = [_run(engine, [p], GREEDY)[0] for p in prompts]
  before = engine.stats()
  together = _run(engine, prompts, GREEDY)
  after = engine.stats()
  assert after.num_preemptions > before.num_preemptions, "the pool was meant to force preemption"
  for i, (a, b) in enumerate(zip(alone, together)):
    assert a == b, f"request {i} differs in a batch"


@pytest.mark.slow
def test_prefix_cache_skips_shared_prompt_and_keeps_output(loaded):
  eng = make_engine(loaded, warmup=False, **OPTIONS)
  system = _prompts(1, seed=3, lo=96, hi=97)[0]
  prompts = [system + q for q in _prompts(4, seed=4, lo=5, hi=9)]
  first = _run(eng, prompts[:1], GREEDY)
  computed_before = eng.stats().prompt_tokens
  rest = _run(eng, prompts[1:], GREEDY)
  computed = eng.stats().prompt_tokens - computed_before
  # The 96-token system prompt is 12 full pages: only the question tails are computed.
  assert computed <= sum(len(p) - 96 for p in prompts[1:]) + 3 * 8
  assert eng.stats().prefix_hit_rate > 0.5
  cold = make_engine(loaded, warmup=False, **OPTIONS, enable_prefix_caching=False)
  assert _run(cold, prompts, GREEDY) == first + rest


@pytest.mark.slow
def test_random_aborts_leak_no_pages(engine):
  rng = np.random.default_rng(5)
  prompts = _prompts(24, seed=6)
  live = []
  for i, p in enumerate(prompts):
    live.append(engine.add_request(f"leak-{i}", p, SamplingParams(temperature=0.8, max_tokens=24)))
    for _ in range(int(rng.integers(0, 3))):
      for o in engine.step():
        if o.finished:
          live.remove(o.request_id)
    if live and rng.random() < 0.4:
      victim = live.pop(int(rng.integers(len(live))))
      assert engine.abort(victim)
  engine.run_to_completion()
  assert not engine.scheduler.running and not engine.scheduler.waiting
  b = engine.blocks
  assert b.num_free_pages == b.num_usable_pages
  assert all(r == 0 for r in b.ref[1:])
  b.check_consistency()


def test_seeded_sampling_independent_of_batch(engine):
  params = SamplingParams(temperature=8.0, top_p=0.95, top_k=500, seed=1234, max_tokens=16)
  prompt = _prompts(1, seed=7)[0]
  alone = _run(engine, [prompt], params)[0]
  others = [SamplingParams(temperature=0.7, seed=i, max_tokens=10) for i in range(8)]
  rids = [engine.add_request(None, p, sp) for p, sp in zip(_prompts(8, seed=8), others)]
  rid = engine.add_request(None, prompt, params)
  final = engine.run_to_completion(rids + [rid])
  assert final[rid].outputs[0].token_ids == alone
  # And a different seed gives a different sample.
  other = _run(engine, [prompt], dataclasses.replace(params, seed=99))[0]
  assert other != alone


@pytest.mark.slow
def test_no_compiles_after_warmup(loaded):
  # A fresh engine (its own jitted steps), warmed up partly from the compilation cache where the
  # other slow tests' engines with these options left their steps.
  eng = make_engine(loaded, **OPTIONS)
  counter = CompileCounter()
  prompts = _prompts(12, seed=10, lo=1, hi=200)
  params = [SamplingParams(temperature=t, top_p=tp, top_k=k, min_p=mp, max_tokens=m, seed=i,
                           logprobs=lp, presence_penalty=pp, repetition_penalty=rp, min_tokens=2,
                           stop=["ab"] if i % 3 else (), n=2 if i % 5 == 0 else 1)
            for i, (t, tp, k, mp, m, lp, pp, rp) in enumerate(zip(
                [0, 0.7, 1.0] * 4, [1, 0.9] * 6, [-1, 5, 20] * 4, [0, 0.1] * 6,
                [2, 7, 30, 55] * 3, [None, 3] * 6, [0, 0.5, 0, -0.3] * 3, [1, 1.2, 1] * 4))]
  rids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
  eng.abort(rids[4])
  eng.run_to_completion()
  assert counter.count == 0, f"{counter.count} compiles after warmup"


@pytest.mark.slow
def test_n_samples_share_prompt_pages(loaded):
  eng = make_engine(loaded, warmup=False, **OPTIONS)
  prompt = _prompts(1, seed=11, lo=64, hi=65)[0]
  rid = eng.add_request(None, prompt, SamplingParams(n=3, temperature=8.0, seed=5, max_tokens=8))
  out = eng.run_to_completion([rid])[rid]
  assert [c.index for c in out.outputs] == [0, 1, 2]
  assert all(len(c.token_ids) == 8 for c in out.outputs)
  assert len({tuple(c.token_ids) for c in out.outputs}) > 1
  # The siblings found the first sample's 7 full prompt pages in the cache.
  assert eng.stats().prompt_tokens == 64 + 2 * 8


def test_stop_conditions(engine):
  prompt = _prompts(1, seed=12)[0]
  free = _run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
  stop_tok = free[5]
  rid = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=20,
                                                       stop_token_ids=[stop_tok]))
  out = engine.run_to_completion([rid])[rid].outputs[0]
  first = free.index(stop_tok)
  assert out.token_ids == free[:first + 1]
  assert out.finish_reason == "stop" and out.stop_reason == stop_tok

  rid = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=20,
                                                       ignore_eos=True))
  full = engine.run_to_completion([rid])[rid].outputs[0]
  assert full.finish_reason == "length" and len(full.token_ids) == 20
  stop = full.text[10:13]
  rid = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=20,
                                                       ignore_eos=True, stop=[stop]))
  cut = engine.run_to_completion([rid])[rid].outputs[0]
  assert cut.finish_reason == "stop" and cut.stop_reason == stop
  assert cut.text == full.text[:full.text.index(stop)]


def test_logprobs_and_penalties(engine):
  prompt = _prompts(1, seed=13)[0]
  rid = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=5,
                                                       ignore_eos=True))
  out = engine.run_to_completion([rid])[rid].outputs[0]
  assert len(out.logprobs) == 6
  for tok, entry in zip(out.token_ids, out.logprobs):
    assert len(entry) == 5 and tok in entry  # greedy: the sampled token is the top one
    assert entry[tok] == pytest.approx(max(entry.values()))
    assert all(v <= 0.0 for v in entry.values())
  rid = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                       ignore_eos=True, repetition_penalty=50.0))
  rep = engine.run_to_completion([rid])[rid].outputs[0].token_ids
  assert len(set(rep)) == len(rep), "a huge repetition penalty must forbid repeats"
  assert not set(rep) & set(prompt)


@pytest.mark.parametrize("bad, match", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[1] * 300), "max_model_len"),
    (dict(prompt=[10**6]), "outside the vocabulary"),
    (dict(params=SamplingParams(max_tokens=250)), "exceeds max_model_len"),
])
def test_bad_requests_rejected_before_queueing(engine, bad, match):
  before = len(engine.scheduler.waiting)
  with pytest.raises(ValueError, match=match):
    engine.add_request(None, bad.get("prompt", [5, 6, 7] * 3), bad.get("params"))
  assert len(engine.scheduler.waiting) == before and not engine.has_unfinished_requests()


def test_duplicate_request_id_rejected(engine):
  engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
  with pytest.raises(ValueError, match="already in use"):
    engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
  engine.run_to_completion()


@pytest.mark.parametrize("kwargs, says", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"), (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"), (dict(logprobs=21), "logprobs"), (dict(min_tokens=5, max_tokens=2),
                                                        "min_tokens"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition"),
    # What fits Python but not the int32/float32 array it goes into.
    (dict(top_k=2**31), r"top_k must be an integer in \[-1, 2147483647\], got 2147483648"),
    (dict(max_tokens=2**31), "max_tokens"), (dict(stop_token_ids=[2**31]), "stop_token_ids"),
    (dict(temperature=1e39), r"temperature .* \(inf as a float32\)"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=1e-50), "0.0 as a float32"),
    (dict(repetition_penalty=1e-50), "repetition_penalty"), (dict(seed=2**63), "seed"),
    # Wrong types, and too much for the host to match after every token.
    (dict(n=True), "n"), (dict(temperature="1"), "temperature"), (dict(stop=5), "stop"),
    (dict(stop=[""]), "stop"), (dict(stop=["x"] * 65), "at most 64"),
    (dict(ignore_eos="yes"), "ignore_eos"), (dict(stop_token_ids=[1.0]), "stop_token_ids")])
def test_invalid_sampling_params(kwargs, says):
  with pytest.raises(ValueError, match=says):
    SamplingParams(**kwargs)


def test_sampling_params_at_their_limits():
  p = SamplingParams(top_k=2**31 - 1, temperature=3.4e38, seed=-2**63, stop="x")
  assert (p.top_k, p.temperature, p.seed, p.stop) == (2**31 - 1, 3.4e38, -2**63, ("x",))
  assert SamplingParams(top_k=0).top_k == -1 and type(SamplingParams(n=np.int64(2)).n) is int


@pytest.mark.slow
def test_prompt_logprobs_match_the_model(loaded):
  eng = make_engine(loaded, max_model_len=256, page_size=8, max_num_seqs=4,
                    max_num_batched_tokens=16, enable_prompt_logprobs=True)
  counter = CompileCounter()
  prompt = _prompts(1, seed=14, lo=40, hi=41)[0]  # 40 tokens: three chunks of at most 16
  rid = eng.add_request(None, prompt, SamplingParams(max_tokens=2, prompt_logprobs=3))
  other = eng.add_request(None, prompt[:20], SamplingParams(max_tokens=3))  # rides along
  final = eng.run_to_completion([rid, other])
  assert counter.count == 0, "the prompt-logprobs variant is warmed up too"
  plp = final[rid].prompt_logprobs
  assert final[other].prompt_logprobs is None
  assert len(plp) == len(prompt) and plp[0] is None
  # Reference: the model's own logits over the whole prompt in one pass.
  model = eng.runner.model.clone(kv_groups=None)  # for one table, as PagedBatch builds
  logits = PagedBatch(model, eng.runner.params, 1, 8, 64).step([prompt], all_rows=True)
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  for p in range(1, len(prompt)):
    assert len(plp[p]) in (3, 4) and prompt[p] in plp[p]
    assert plp[p][prompt[p]] == pytest.approx(logits[p - 1, prompt[p]] - lse[p - 1], abs=1e-4)
  with pytest.raises(ValueError, match="enable_prompt_logprobs"):
    make_engine(loaded, max_model_len=64, max_num_batched_tokens=16, warmup=False).add_request(
        None, prompt[:5], SamplingParams(prompt_logprobs=1))


@pytest.mark.slow
def test_static_batching_waits_for_the_whole_batch(loaded):
  # 3 sequences of max_model_len (8 pages each) fit in 25 usable pages: batches of 3.
  eng = make_engine(loaded, warmup=False, max_model_len=64, page_size=8, num_pages=26,
                    max_num_seqs=8, max_num_batched_tokens=32, continuous_batching=False)
  params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (2, 9, 4, 3)]
  rids = [eng.add_request(None, p, sp) for p, sp in zip(_prompts(4, seed=15, lo=5, hi=20), params)]
  batches = []
  while eng.has_unfinished_requests():
    eng.step()
    batches.append(sorted(s.seq_id for s in eng.scheduler.running))
  assert max(len(b) for b in batches) == 3
  # The 4th request starts only after the longest of the first batch (9 tokens) is done.
  first_with_4th = next(i for i, b in enumerate(batches) if rids[3] in b)
  assert all(rids[1] not in b for b in batches[first_with_4th:])


@pytest.mark.slow
def test_a_failed_step_fails_its_requests_and_the_engine_recovers(loaded):
  """A step that raises after XLA consumed the donated cache: the requests it ran fail, the
  cache is rebuilt, what was cached is forgotten, and the rest run as if nothing happened."""
  eng = make_engine(loaded, warmup=False, max_model_len=256, page_size=8, max_num_seqs=2,
                    max_num_batched_tokens=256)
  prompts = _prompts(3, seed=11)
  want = _run(eng, prompts, GREEDY)  # also leaves their pages in the prefix cache
  real = eng.runner.variant(256)  # the step below prefills two prompts: the scanned variant

  def failing_step(params, cache, inp, drafts, heads, lora):
    cache.delete()  # what a call that consumed its donated input leaves behind
    raise RuntimeError("injected device failure")

  rids = [eng.add_request(None, p, GREEDY) for p in prompts]  # max_num_seqs=2: the last waits
  eng.runner._main = dataclasses.replace(real, step=failing_step)
  outs = eng.step()
  eng.runner._main = real
  assert sorted(o.request_id for o in outs) == sorted(rids[:2])
  for o in outs:
    assert o.finished and "injected device failure" in o.error
    assert o.outputs[0].finish_reason == "error"
  assert eng.runner.cache_resets == 1 and not eng.runner.kv_cache.is_deleted()
  assert not eng.blocks.by_hash  # nothing cached survives the rebuilt cache
  final = eng.run_to_completion()
  assert list(final) == [rids[2]] and final[rids[2]].outputs[0].token_ids == want[2]
  eng.blocks.check_consistency()
  assert eng.blocks.num_free_pages == eng.blocks.num_usable_pages
  assert _run(eng, prompts, GREEDY) == want  # recomputed from scratch, same tokens


def test_token_ids_without_a_tokenizer(engine, tiny_model_path):
  """skip_tokenizer_init: a model directory without tokenizer.json serves token-id prompts."""
  from jinfer.engine.engine import LLMEngine
  from jinfer.engine.engine_config import EngineConfig
  # The tiny model's own directory: config.json and weights, no tokenizer files. The module
  # engine's options, so its steps come from the compilation cache.
  eng = LLMEngine(tiny_model_path, skip_tokenizer_init=True, warmup=False,
                  config=EngineConfig.of(**SMALL_POOL))
  assert eng.tokenizer is None
  prompt = _prompts(1, seed=16)[0][:20]
  out = _run(eng, [prompt], GREEDY)[0]
  assert out == _run(engine, [prompt], GREEDY)[0]
  with pytest.raises(ValueError, match="no tokenizer"):
    eng.add_request(None, "text needs a tokenizer", GREEDY)
  with pytest.raises(ValueError, match="stop strings"):
    eng.add_request(None, prompt, SamplingParams(stop=["x"]))


def test_a_row_that_cannot_be_built_fails_alone(engine):
  """A value that slipped past validation and cannot go into its int32 row fails its own request
  before the step; the sequences scheduled with it run as if it had never come."""
  prompts = _prompts(3, seed=16)
  want = _run(engine, prompts, GREEDY)
  bad = SamplingParams(temperature=0.7, top_k=5, max_tokens=8)
  object.__setattr__(bad, "top_k", 2**31)  # what SamplingParams now refuses when made
  rids = [engine.add_request(None, p, GREEDY) for p in prompts]
  bad_id = engine.add_request(None, prompts[0], bad)
  final = engine.run_to_completion()
  assert [final[r].outputs[0].token_ids for r in rids] == want
  assert "OverflowError" in final[bad_id].error
  assert final[bad_id].outputs[0].finish_reason == "error"
  engine.blocks.check_consistency()
  assert engine.blocks.num_free_pages == engine.blocks.num_usable_pages
