"""Speculative decoding in the engine, on tiny random models: greedy output identical to no
speculation (alone and in batches with chunked prefill, preemption and prefix hits), stop
conditions and logprobs as without it, seeded sampling independent of the batch (and of the
proposer: see test_spec_lossless), no page leaks under aborts, no compiles after warmup, and
precise errors for a bad speculative_config."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest


from jinfer.sampling.accept import VerifyTensors
from jinfer.engine.engine_config import EngineConfig
from jinfer.errors import ParameterError
from jinfer.engine.request import RequestMetrics, Sequence
from jinfer.sampling.params import SamplingParams, StructuredOutputsParams
from jinfer.engine.speculative import pause
from jinfer.engine.speculative.proposer import SpecState
from jinfer.engine.speculative.draft_model import _sample_draft
from jinfer.engine.speculative.ngram import lookup
from tests.engine_fixtures import (CompileCounter, assert_batch_matches, make_engine,
                                   prefix_sharing_prompts, random_prompts, run_tokens,
                                   tiny_loaded)
from tests.test_accept import tensors

K = 3
# Chunked prefill (budget 16), preemption (20 pages of 8 for up to 8 sequences of up to 128).
# Two token buckets keep the compiles few: the engines of this module are shared.
SMALL = dict(max_model_len=128, page_size=8, num_pages=20, max_num_seqs=8,
             max_num_batched_tokens=16, max_prefill_seqs=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
METHODS = ("ngram", "self", "other")


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, smollm2_gguf) -> dict[str, str]:
  """Draft model directories: the target itself (accepts everything), and a 1-layer model of
  another seed (rejects nearly everything)."""
  out = {}
  for name, seed, layers in (("self", 0, 2), ("other", 1, 1)):
    out[name] = str(tmp_path_factory.mktemp(f"draft_{name}"))
    tiny_loaded(out[name], smollm2_gguf, seed=seed, num_layers=layers)
  return out


def spec_config(method: str, drafts: dict[str, str]) -> dict:
  if method == "ngram":
    return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}
  return {"method": "draft_model", "num_speculative_tokens": K, "model": drafts[method]}


def _no_leaks(engine):
  assert not engine.scheduler.running and not engine.scheduler.waiting
  b = engine.blocks
  b.check_consistency()
  assert b.num_free_pages == b.num_usable_pages and not any(b.ref[1:])


_prompts, _run = random_prompts, run_tokens


@pytest.fixture(scope="module")
def baseline(tiny_model):
  return make_engine(tiny_model, warmup=False, **SMALL)


@pytest.fixture(scope="module")
def engines(tiny_model, drafts) -> dict:
  """One speculating engine per proposer, compiled lazily."""
  return {m: make_engine(tiny_model, warmup=False, **SMALL,
                         speculative_config=spec_config(m, drafts)) for m in METHODS}


# Slow-tier: the tests below keep the verify step in the quick loop.
@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_is_the_same_as_without_speculation(engines, baseline, method):
  prompts = prefix_sharing_prompts()
  want = _run(baseline, prompts, GREEDY)
  eng = engines[method]
  assert [_run(eng, [p], GREEDY)[0] for p in prompts[:2]] == want[:2]
  spec = assert_batch_matches(eng, prompts, GREEDY, want).spec
  assert spec.num_draft_tokens > 0
  if method != "other":  # these agree with the target's greedy choices
    assert spec.acceptance_rate > 0.9 and spec.mean_tokens_per_verify > 2
  _no_leaks(eng)


@pytest.fixture(scope="module")
def spec_engine(engines):
  return engines["other"]


def test_stops_and_logprobs_as_without_speculation(spec_engine, baseline):
  prompt = _prompts(1, seed=3)[0]
  free = _run(baseline, [prompt], GREEDY)[0]
  cases = [dict(max_tokens=7), dict(stop_token_ids=[free[4]]), dict(min_tokens=6),
           dict(logprobs=3), dict(max_tokens=9, repetition_penalty=1.5, presence_penalty=0.5)]
  for case in cases:
    params = SamplingParams(**{**dict(temperature=0.0, max_tokens=20, ignore_eos=True), **case})
    rid_a = baseline.add_request(None, prompt, params)
    a = baseline.run_to_completion([rid_a])[rid_a].outputs[0]
    rid_b = spec_engine.add_request(None, prompt, params)
    b = spec_engine.run_to_completion([rid_b])[rid_b].outputs[0]
    assert (b.token_ids, b.finish_reason, b.stop_reason, b.text) == (
        a.token_ids, a.finish_reason, a.stop_reason, a.text), case
    if a.logprobs is not None:
      for la, lb in zip(a.logprobs, b.logprobs):
        assert la.keys() == lb.keys()
        np.testing.assert_allclose(list(lb.values()), list(la.values()), atol=1e-4)
  full = _run(baseline, [prompt], GREEDY)[0]
  text = spec_engine.tokenizer.decode(full)
  stop = text[len(text) // 2:len(text) // 2 + 3]
  rid = spec_engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=20,
                                                            ignore_eos=True, stop=[stop]))
  cut = spec_engine.run_to_completion([rid])[rid].outputs[0]
  assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]


@pytest.mark.slow
def test_a_constrained_sequence_does_not_draft_with_a_draft_model(spec_engine, baseline):
  """The draft model's tokens reach the target as a device array: the host cannot mask each
  verify row for its own draft prefix without waiting for them, so a constrained sequence
  decodes one token a step, with the output it has without speculation."""
  params = SamplingParams(temperature=0.0, max_tokens=20,
                          structured_outputs=StructuredOutputsParams(regex="[a-z ]{4,40}"))
  prompts = _prompts(2, seed=6)
  before = spec_engine.stats().spec
  assert _run(spec_engine, prompts, params) == _run(baseline, prompts, params)
  assert spec_engine.stats().spec.since(before).num_draft_tokens == 0


@pytest.mark.slow
def test_seeded_sampling_independent_of_the_batch(spec_engine):
  params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
  prompt = _prompts(1, seed=4)[0]
  alone = _run(spec_engine, [prompt], params)[0]
  others = [SamplingParams(temperature=t, seed=i, max_tokens=12, top_k=50)
            for i, t in enumerate([0.0, 0.7, 1.3] * 2)]
  rids = [spec_engine.add_request(None, p, sp) for p, sp in zip(_prompts(6, seed=5), others)]
  rid = spec_engine.add_request(None, prompt, params)
  final = spec_engine.run_to_completion(rids + [rid])
  assert final[rid].outputs[0].token_ids == alone
  assert spec_engine.stats().spec.num_draft_tokens > 0


def test_failing_drafts_pause_a_sequence():
  """The moving average of accepted drafts: ~6 failed verify steps pause a sequence at k = 3
  and min_accepted_per_step = 0.5, for PAUSE_TOKENS tokens; a good try lifts it again."""
  seq = Sequence(seq_id="s", group_id="s", index=0, prompt_token_ids=[1] * 10,
                 params=GREEDY, seed=0, metrics=RequestMetrics(arrival_time=0.0),
                 spec_state=SpecState())
  failed = 0
  while not pause.paused(seq):
    pause.after_verify(seq, K, 0, 0.5)
    failed += 1
    seq.output_token_ids.append(1)  # a failed step still yields the target's token
  assert failed == 6 and seq.spec_state.paused_until == seq.num_tokens + pause.PAUSE_TOKENS
  seq.output_token_ids += [1] * pause.PAUSE_TOKENS
  assert not pause.paused(seq)
  pause.after_verify(seq, K, K, 0.5)  # all three accepted: 0.3 * 3 lifts the average over 0.5
  assert seq.spec_state.accepted_avg >= 0.5 and seq.spec_state.paused_until <= seq.num_tokens


@pytest.mark.slow
def test_paused_speculation_tries_again_and_keeps_the_output(tiny_model, drafts, baseline,
                                                             spec_engine):
  """The engine asks a paused sequence for no drafts until it has PAUSE_TOKENS more tokens. A
  threshold above k pauses after every verify step: one try per 4 + 16 tokens, same tokens."""
  prompt = _prompts(1, seed=5)[0]
  params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
  want = _run(baseline, [prompt], params)
  pausing = make_engine(tiny_model, warmup=False, **SMALL, speculative_config={
      **spec_config("other", drafts), "min_accepted_per_step": K + 0.5})
  verified = {}
  for name, eng in (("always", spec_engine), ("pausing", pausing)):
    before = eng.stats().spec
    assert _run(eng, [prompt], params) == want
    verified[name] = eng.stats().spec.since(before).num_verified
  assert verified["always"] >= 11  # the tiny draft agrees here: 4 tokens a step
  assert verified["pausing"] == 3, verified  # at tokens 1, 21 and 41 of 48
  _no_leaks(pausing)


@pytest.mark.slow
def test_random_aborts_during_speculation_leak_no_pages(spec_engine):
  rng = np.random.default_rng(6)
  live = []
  for i, p in enumerate(_prompts(16, seed=7)):
    params = SamplingParams(temperature=float(rng.choice([0.0, 1.0])), max_tokens=30, seed=i)
    live.append(spec_engine.add_request(f"abort-{i}", p, params))
    for _ in range(int(rng.integers(0, 3))):
      for o in spec_engine.step():
        if o.finished:
          live.remove(o.request_id)
    if live and rng.random() < 0.4:
      assert spec_engine.abort(live.pop(int(rng.integers(len(live)))))
  spec_engine.run_to_completion()
  _no_leaks(spec_engine)


# Slow (~20 s of warmup): quick, test_engine's and test_kv_cache_quantization's no-compile tests
# hold for the plain step, and test_stops_and_logprobs_as_without_speculation runs verify steps.
@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "other"])
def test_no_compiles_after_warmup(engines, method):
  eng = engines[method]
  eng.warmup("now")  # what was not compiled yet: every bucket's plain and verify variants
  counter = CompileCounter()
  params = [SamplingParams(temperature=t, top_p=tp, top_k=k, max_tokens=m, seed=i, logprobs=lp,
                           presence_penalty=pp, min_tokens=2, n=2 if i == 3 else 1)
            for i, (t, tp, k, m, lp, pp) in enumerate(zip(
                [0, 0.7, 1.0] * 3, [1, 0.9] * 5, [-1, 5, 20] * 3, [2, 7, 30] * 3,
                [None, 3] * 5, [0, 0.5, 0] * 3))]
  # A constrained sequence too: n-gram verifies its drafts under per-row masks.
  params.append(SamplingParams(temperature=0.0, max_tokens=20,
                               structured_outputs=StructuredOutputsParams(regex="[a-z ]{4,40}")))
  rids = [eng.add_request(None, p, sp)
          for p, sp in zip(_prompts(10, seed=8, lo=1, hi=40), params)]
  eng.abort(rids[4])
  eng.run_to_completion()
  assert counter.count == 0, f"{counter.count} compiles after warmup"
  assert eng.stats().spec.num_draft_tokens > 0


def test_ngram_lookup():
  t = lambda *x: np.asarray(x)
  assert lookup(t(1, 2, 3, 4, 5, 9, 1, 2, 3), 1, 3, 4).tolist() == [4, 5, 9, 1]
  assert lookup(t(1, 2, 3, 1, 2), 2, 3, 5).tolist() == [3, 1, 2, 3, 1]  # runs into the guess
  assert lookup(t(1, 2, 9, 2, 8, 2), 1, 3, 2).tolist() == [8, 2]  # the latest occurrence
  assert lookup(t(5, 1, 2, 8, 1, 2), 3, 3, 2).size == 0  # the longest match is too short
  assert lookup(t(1, 2, 3), 1, 3, 2).size == 0


@pytest.mark.parametrize("config, says", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "needs model, a Medusa heads checkpoint"),
    ({"method": "ngram", "num_speculative_tokens": 2, "medusa_choices": [[0]]},
     "medusa_choices is for method 'medusa'"),
    ({"num_speculative_tokens": 2}, "needs 'method'"),
    ({"method": "ngram"}, "method 'ngram' needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be .* \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
      "prompt_lookup_max": 3}, "prompt_lookup_min .5. exceeds prompt_lookup_max .3."),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model is for method"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "no/such/dir"},
     "model 'no/such/dir' not found: no such file or directory .*not a known name"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "smollm2-135m-instruct",
      "prompt_lookup_max": 2}, "prompt_lookup_max is for method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, "unknown key 'k'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "min_accepted_per_step": -1},
     "min_accepted_per_step must be a number >= 0"),
    ("{not json", "not valid JSON"), ("[1, 2]", "must be a dict"),
])
def test_a_bad_speculative_config_is_refused_before_the_engine_loads(tiny_model, config, says):
  """Refused when made, or by `resolve()` where it takes a file lookup."""
  with pytest.raises(ParameterError, match=says) as e:
    EngineConfig.of(speculative_config=config).resolve(tiny_model[0])
  assert e.value.param == "speculative_config"


def test_a_draft_with_another_vocabulary_is_refused(tiny_model, tmp_path):
  import transformers
  transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
      num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
  with pytest.raises(ValueError, match="does not share the target's tokenizer"):
    make_engine(tiny_model, warmup=False, **SMALL, speculative_config={
        "method": "draft_model", "num_speculative_tokens": 2, "model": str(tmp_path)})


def test_draft_sampling_over_a_restricted_vocabulary():
  """All-greedy rows take the argmax over the draft's own vocabulary (no scatter to the full
  one); a row with a banned token goes the full way: both give the target's ids."""
  s, v = 3, 1000
  rng = np.random.default_rng(0)
  vocab = rng.permutation(v)[:300].astype(np.int32)  # target ids, in no particular order
  logits = rng.standard_normal((s, len(vocab))).astype(np.float32)
  st = tensors(s, np.zeros(s), temperature=0.0)  # greedy, nothing banned
  i32 = lambda x: jnp.full(s, x, jnp.int32)
  vt = VerifyTensors(draft_tokens=jnp.zeros((s, 2), jnp.int32), num_drafts=i32(2),
                     row_seq=jnp.arange(s, dtype=jnp.int32), row_depth=i32(0),
                     chain=jnp.zeros((s, 3), jnp.int32), ban_rows=i32(1))
  best = vocab[np.argmax(logits, axis=1)]
  token = _sample_draft(jnp.asarray(logits), st, vt, jnp.asarray(vocab), v)
  np.testing.assert_array_equal(token, best)
  banned = np.full((s, 2), -1, np.int32)
  banned[1, 0] = best[1]
  token = _sample_draft(jnp.asarray(logits), st.replace(banned=jnp.asarray(banned)), vt,
                        jnp.asarray(vocab), v)
  second = vocab[np.argsort(logits[1])[-2]]
  np.testing.assert_array_equal(token, [best[0], second, best[2]])


def test_metrics_export_the_speculation_statistics(spec_engine):
  """/metrics' speculative gauges are the engine's statistics (the prompt test_stops_and_logprobs
  ran: its steps are compiled by now)."""
  from prometheus_client.parser import text_string_to_metric_families

  from jinfer.serving.metrics import ServerMetrics
  _run(spec_engine, _prompts(1, seed=3), GREEDY)
  sp = spec_engine.stats().spec
  assert sp.num_draft_tokens > 0
  got = {s.name: s.value for f in text_string_to_metric_families(
      ServerMetrics(spec_engine, "m").render()) for s in f.samples}
  assert got["jinfer_spec_decode_num_draft_tokens_total"] == sp.num_draft_tokens
  assert got["jinfer_spec_decode_alpha"] == pytest.approx(sp.alpha)
  assert got["jinfer_spec_decode_expected_tokens_per_full_step"] == pytest.approx(
      sp.expected_tokens_per_full_step)
  assert got["jinfer_spec_decode_tokens_per_full_step"] == pytest.approx(sp.tokens_per_full_step)
