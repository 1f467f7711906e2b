"""Prefill and decode on separate device groups (`kv_transfer_config`): the same tokens and
logprobs as one colocated engine, whatever the split, with preemption on the decode side,
speculation there, aborts while pages are in flight and a failed transfer; no page leaks."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from jinfer import cli
from jinfer.config import ModelConfig
from jinfer.engine.disaggregated import DisaggregatedEngine
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.engine.kv_transfer import KVTransferConfig
from jinfer.errors import ParameterError
from jinfer.sampling.params import SamplingParams

# A pool of 9 pages (8 usable) holds one sequence of max_model_len: two long ones on one decode
# engine outgrow it, and the newer is preempted.
BASE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, page_size=16)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)


def _prompts(vocab: int) -> list[list[int]]:
  rng = np.random.default_rng(3)
  # The last repeats itself, so n-gram drafts get accepted.
  return [rng.integers(0, vocab, n).tolist() for n in (5, 37, 100, 40, 9)] + [[7, 8, 9] * 10]


def _run(engine, prompts, params) -> list:
  rids = [engine.add_request(None, p, sp) for p in prompts for sp in params]
  final = {}
  while engine.has_unfinished_requests():
    final.update((o.request_id, o) for o in engine.step() if o.finished)
  return [final[r] for r in rids]


def _assert_same(got, want):
  for g, w in zip(got, want):
    assert g.error is None and g.outputs[0].token_ids == w.outputs[0].token_ids
    for gl, wl in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or []):
      assert gl.keys() == wl.keys()
      np.testing.assert_allclose([gl[t] for t in wl], list(wl.values()), atol=1e-4)


def _engines(d: DisaggregatedEngine) -> list[LLMEngine]:
  return d.prefill + d.decode


def _no_leaks(d: DisaggregatedEngine):
  assert not d.has_unfinished_requests() and not d._transfers
  for e in _engines(d):
    e.blocks.check_consistency()
    assert e.blocks.num_free_pages == e.blocks.num_usable_pages and not e.groups


def _disaggregated(tiny_model, options=None, **kv_transfer) -> DisaggregatedEngine:
  cfg, params, tok = tiny_model
  config = EngineConfig.of(**BASE, **(options or {}), tensor_parallel_size=2,
                           kv_transfer_config=kv_transfer)
  return DisaggregatedEngine.from_parts(cfg, params, tok, config=config, warmup=False)


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (see conftest.py)")
def test_disaggregated_matches_colocated(tiny_model):
  """Greedy tokens and logprobs and seeded samples of two splits equal the colocated engine's
  (TP 2): prefill on 2 devices and decode on 6 (three decode engines of TP 2); prefill on 4 (two
  engines of TP 2) and decode on 4 (one engine of TP 4, which holds each KV head twice: the
  copy maps heads), whose 9-page pool preempts and recomputes on the prefill side. Then, on the
  second: aborts wherever a request is (queued, prefilling, pages in flight, decoding) and a
  transfer that fails (consuming the decode cache): that request alone errors, the sequences
  the lost cache held are recomputed, and no page leaks on either side."""
  cfg, params, tok = tiny_model
  prompts = _prompts(cfg.vocab_size)
  colocated = LLMEngine.from_parts(cfg, params, tok, warmup=False,
                                   config=EngineConfig.of(**BASE, tensor_parallel_size=2))
  want = _run(colocated, prompts, [GREEDY, SEEDED])

  wide = _disaggregated(tiny_model, prefill_devices=2)
  assert (len(wide.prefill), len(wide.decode)) == (1, 3)
  _assert_same(_run(wide, prompts, [GREEDY, SEEDED]), want)
  _no_leaks(wide)
  assert wide.num_transfers >= 2 * len(prompts)

  narrow = _disaggregated(tiny_model, dict(num_pages=9), prefill_devices=4,
                          decode_tensor_parallel_size=4)
  assert (len(narrow.prefill), len(narrow.decode)) == (2, 1)
  _assert_same(_run(narrow, prompts, [GREEDY, SEEDED]), want)
  _no_leaks(narrow)
  assert narrow.decode[0].scheduler.num_preemptions > 0
  assert narrow.num_transfers > 2 * len(prompts)  # the preempted came back a second time

  # Aborts: one queued, and the others once each is prefilling, in flight or decoding.
  long = [p for p in prompts if len(p) >= 37]
  rids = [narrow.add_request(None, p, GREEDY) for p in long * 2]
  assert narrow.abort(rids[0])
  seen = set()
  while narrow.has_unfinished_requests():
    narrow.step()
    for rid in rids[1:]:
      where = narrow._where.get(rid)
      kind = ("transfer" if where.__class__.__name__ == "_Transfer" else
              "decode" if where in narrow.decode else "prefill" if where is not None else None)
      if kind is not None and kind not in seen and (kind != "prefill" or where.scheduler.running):
        seen.add(kind)
        assert narrow.abort(rid)
  assert seen >= {"prefill", "decode"}  # and "transfer" when a transfer waited for room
  _no_leaks(narrow)

  # A transfer whose write consumes the decode cache and fails.
  copier = narrow.copiers[(narrow.prefill[0], narrow.decode[0])]
  real = copier._scatter
  calls = []

  def failing_scatter(cache, pages, ids):
    if calls:
      return real(cache, pages, ids)
    calls.append(1)
    jax.tree.map(lambda a: a.delete(), cache)  # what a call that consumed its donation leaves
    raise RuntimeError("injected transfer failure")

  copier._scatter = failing_scatter
  got = _run(narrow, prompts, [GREEDY])
  copier._scatter = real
  failed = [o for o in got if o.error is not None]
  assert len(failed) == 1 and "injected transfer failure" in failed[0].error
  assert failed[0].outputs[0].finish_reason == "error"
  _assert_same([o for o in got if o.error is None],
               [w for w, o in zip(want[::2], got) if o.error is None])
  assert narrow.decode[0].runner.cache_resets == 1
  _no_leaks(narrow)


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (see conftest.py)")
def test_speculative_decoding_on_the_decode_side(tiny_model):
  """n-gram drafts verified on the decode engine: the greedy tokens of plain decoding."""
  cfg, params, tok = tiny_model
  prompts = _prompts(cfg.vocab_size)
  config = EngineConfig.of(**BASE, tensor_parallel_size=2,
                           kv_transfer_config={"prefill_devices": 2, "decode_devices": 2},
                           speculative_config={"method": "ngram", "num_speculative_tokens": 3})
  d = DisaggregatedEngine.from_parts(cfg, params, tok, config=config, warmup=False)
  assert d.prefill[0].proposer is None and d.decode[0].proposer is not None
  colocated = LLMEngine.from_parts(cfg, params, tok, warmup=False,
                                   config=EngineConfig.of(**BASE, tensor_parallel_size=2))
  got, want = _run(d, prompts, [GREEDY]), _run(colocated, prompts, [GREEDY])
  assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
  assert d.stats().spec.num_accepted_tokens > 0
  _no_leaks(d)


# -- bad input, on the host alone -------------------------------------------------------------
CFG = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16,
                  max_position_embeddings=4096, rope_theta=10000.0)


@pytest.mark.parametrize("options,says", [
    (dict(prefill_devices=1), r"prefill_devices=1 cannot hold engines of tensor_parallel_size=2"),
    (dict(prefill_devices=2, decode_devices=3), r"decode_devices=3 cannot hold engines of "
                                                r"tensor_parallel_size=2"),
    (dict(prefill_devices=2, decode_tensor_parallel_size=4, decode_devices=2),
     r"decode_devices=2 cannot hold engines of decode_tensor_parallel_size=4"),
    (dict(prefill_devices=4, decode_devices=6), r"needs 10 devices; 8 are available"),
    (dict(prefill_devices=8), r"needs 9 devices; 8 are available"),
    (dict(prefill_devices=2, prefill_num_pages=8), r"prefill_num_pages=8 cannot hold one "
                                                   r"sequence of max_model_len=128"),
    (dict(prefill_devices=2, kv_connector="nixl"), r"kv_connector must be one of in_process"),
    (dict(prefill_devices=0), r"prefill_devices must be an integer >= 1"),
    (dict(decode_devices=2), r"needs 'prefill_devices'"),
    (dict(prefill_devices=2, decode_device=2), r"unknown key 'decode_device'"),
])
def test_a_split_that_does_not_fit_fails_at_start(options, says):
  with pytest.raises(ParameterError, match=says) as e:
    config = EngineConfig.of(**BASE, tensor_parallel_size=2, kv_transfer_config=options)
    DisaggregatedEngine.from_parts(CFG, None, None, config=config, warmup=False)
  assert e.value.param == "kv_transfer_config"


def test_pools_and_options_that_do_not_fit():
  split = {"prefill_devices": 2}
  for options, param in [(dict(num_pages=8), "num_pages"),
                         (dict(data_parallel_size=2), "data_parallel_size"),
                         (dict(context_parallel_size=2), "context_parallel_size"),
                         (dict(speculative_config={"method": "draft_model", "model": "x",
                                                   "num_speculative_tokens": 2}),
                          "speculative_config")]:
    with pytest.raises(ParameterError) as e:
      config = EngineConfig.of(**{**BASE, **options}, kv_transfer_config=split)
      DisaggregatedEngine.from_parts(CFG, None, None, config=config, warmup=False)
    assert e.value.param == param


def test_the_flag_spells_the_config():
  args = cli.parser().parse_args(["serve", "--kv-transfer-config",
                                  '{"prefill_devices": 2, "decode_tensor_parallel_size": 4}'])
  assert cli._engine_config(args).kv_transfer == KVTransferConfig(
      prefill_devices=2, decode_tensor_parallel_size=4)
  args = cli.parser().parse_args(["bench", "--kv-transfer-config", '{"prefill_devices": 1}'])
  assert cli._engine_config(args, max_model_len=64).kv_transfer.prefill_devices == 1
