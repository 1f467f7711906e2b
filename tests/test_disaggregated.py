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

# A pool of 15 pages (14 usable) holds one sequence of max_model_len (8 pages in the full group,
# 6 in the window group): sequences that grow together on one engine outgrow it, and the newest
# is preempted. Every engine has it: one cache shape, one set of compiled steps.
BASE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, page_size=16,
            num_pages=15)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)


# A random Llama small enough that a step costs little on 8 host devices (a vocabulary of 512:
# sampling and top logprobs over a large one dominated every step).
# The second layer's sliding window is shorter than the longer prompts: the hand-over moves a
# full group's pages and a window group's (the hybrid KV cache, jinfer/models/kv_groups.py).
CFG = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16,
                  max_position_embeddings=4096, rope_theta=10000.0, sliding_windows=(None, 16))


@pytest.fixture(scope="module")
def model():
  """(config, params, no tokenizer) with clear greedy winners."""
  from jinfer.models import param_shapes
  rng = np.random.default_rng(0)
  p = jax.tree_util.tree_map_with_path(
      lambda path, s: (np.ones(s.shape) if path[-1].key == "scale"  # norms
                       else rng.standard_normal(s.shape) * 0.2).astype(np.float32),
      param_shapes(CFG))
  p["embedding"] *= 20
  return CFG, jax.tree.map(jax.numpy.asarray, p), None


def _prompts(vocab: int) -> list[list[int]]:
  rng = np.random.default_rng(3)
  # The last repeats itself, so n-gram drafts get accepted.
  return [rng.integers(0, vocab, n).tolist() for n in (5, 37, 60, 40, 9)] + [[7, 8, 9] * 10]


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


def _disaggregated(model, options=None, **kv_transfer) -> DisaggregatedEngine:
  cfg, params, tok = model
  config = EngineConfig.of(**BASE, **(options or {}), tensor_parallel_size=2,
                           kv_transfer_config=kv_transfer)
  return DisaggregatedEngine.from_parts(cfg, params, tok, config=config, warmup=False)


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (see conftest.py)")
def test_disaggregated_matches_colocated(model):
  """Against the colocated engine (TP 2): prefill on 2 devices and decode on 6 (three decode
  engines of TP 2) gives its greedy tokens and logprobs and seeded samples; prefill on 2 and
  decode on 2, whose 15-page pool preempts (recomputed on the prefill side), its greedy tokens
  and logprobs. Then, on the second: aborts wherever a request is (queued, prefilling, pages in
  flight, decoding) and a transfer that fails (consuming the decode cache): that request alone
  errors, the sequences the lost cache held are recomputed, and no page leaks on either side.
  The first split verifies n-gram drafts on its decode engines."""
  cfg, params, tok = model
  prompts = _prompts(cfg.vocab_size)
  colocated = LLMEngine.from_parts(cfg, params, tok, warmup=False,
                                   config=EngineConfig.of(**BASE, tensor_parallel_size=2))
  want = _run(colocated, prompts, [GREEDY, SEEDED])

  # With n-gram drafts verified on the decode engines: speculation does not change a token.
  wide = _disaggregated(model, dict(speculative_config={
      "method": "ngram", "num_speculative_tokens": 3}), prefill_devices=2)
  assert (len(wide.prefill), len(wide.decode)) == (1, 3)
  assert wide.prefill[0].proposer is None and wide.decode[0].proposer is not None
  _assert_same(_run(wide, prompts, [GREEDY, SEEDED]), want)
  assert wide.stats().spec.num_accepted_tokens > 0
  _no_leaks(wide)
  assert wide.num_transfers >= 2 * len(prompts)
  del wide

  # Three sequences admitted together on one decode engine's 14 pages, each growing to 3 pages
  # in each group: the newest is preempted, and recomputed on the prefill side.
  narrow = _disaggregated(model, prefill_devices=2, decode_devices=2)
  assert (len(narrow.prefill), len(narrow.decode)) == (1, 1)
  grow = [p[:17] for p in prompts[1:4]]
  _assert_same(_run(narrow, grow, [GREEDY]), _run(colocated, grow, [GREEDY]))
  assert narrow.decode[0].scheduler.num_preemptions > 0
  assert narrow.num_transfers > len(grow)  # the preempted came back
  _no_leaks(narrow)

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
  dst = narrow.decode[0]
  copiers = [narrow.copiers[(p, dst)] for p in narrow.prefill]
  real = copiers[0].scatter._fn
  calls = []

  def failing_scatter(cache, pages, ids):
    if calls:
      return real(cache, pages, ids)
    calls.append(1)
    jax.tree.map(lambda a: a.delete(), cache)  # what a call that consumed its donation leaves
    raise RuntimeError("injected transfer failure")

  for c in copiers:
    c.scatter._fn = failing_scatter
  got = _run(narrow, prompts, [GREEDY])
  for c in copiers:
    c.scatter._fn = real
  failed = [o for o in got if o.error is not None]
  assert len(failed) == 1 and "injected transfer failure" in failed[0].error
  assert failed[0].outputs[0].finish_reason == "error"
  _assert_same([o for o in got if o.error is None],
               [w for w, o in zip(want[::2], got) if o.error is None])
  assert dst.runner.cache_resets == 1
  _no_leaks(narrow)
  del narrow


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (see conftest.py)")
def test_llm_the_server_loop_and_bench_take_the_option(tiny_model_dir, tmp_path):
  """`LLM(path, kv_transfer_config=...)` loads the model once for both groups; the server's
  engine loop drives the same engine unchanged, with the same answers; `jinfer bench` runs
  it."""
  import asyncio
  import json

  from jinfer import LLM
  from jinfer.engine.async_engine import AsyncLLMEngine, collect
  options = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, warmup=False)
  prompts = ["t5 t9 t3 t7", "t11 t4"]
  sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
  llm = LLM(tiny_model_dir, kv_transfer_config={"prefill_devices": 1, "decode_devices": 1},
            **options)
  assert isinstance(llm.engine, DisaggregatedEngine)
  # (That its tokens are the colocated engine's is test_disaggregated_matches_colocated's.)
  outs = llm.generate(prompts, sp)
  assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
  want = [o.outputs[0].text for o in outs]

  async def serve():
    aeng = AsyncLLMEngine(llm.engine)
    aeng.start()
    try:
      return await asyncio.gather(*(collect(aeng.generate(llm.engine.tokenize(p), sp, f"r{i}"))
                                    for i, p in enumerate(prompts)))
    finally:
      await aeng.shutdown()

  assert [o.outputs[0].text for o in asyncio.run(serve())] == want
  _no_leaks(llm.engine)

  # `jinfer bench` runs it too (the same sizes: its steps are the ones compiled above), and
  # reports the TTFT split and the bytes each request's hand-over copied.
  out = tmp_path / "bench.json"
  cli.main(["bench", "--model", tiny_model_dir, "--num-prompts", "3", "--input-len-min", "20",
            "--input-len-max", "56", "--output-len", "8", "--max-num-seqs", "2",
            "--max-num-batched-tokens", "16", "--out", str(out), "--kv-transfer-config",
            '{"prefill_devices": 1, "decode_devices": 1}'])
  r = json.loads(out.read_text())
  assert r["completed"] == 3 and r["config"]["kv_transfer_config"]["prefill_devices"] == 1
  t = r["kv_transfer"]
  assert t["requests"] == 3 and t["bytes_per_request"]["p50"] > 0
  assert 0 <= t["queue_s"]["p50"] and 0 < t["prefill_s"]["p50"] and 0 < t["handover_s"]["p50"]


@pytest.mark.slow
def test_constraints_and_prompt_logprobs_cross_the_hand_over(tiny_model):
  """A structured-output request (its matcher goes with it to the decode engine) and one with
  prompt logprobs (computed on the prefill side) end as on one colocated engine."""
  from jinfer.sampling.params import StructuredOutputsParams
  options = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                 enable_prompt_logprobs=True)
  params = [SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=(
                StructuredOutputsParams(regex=r"(yes|no), [0-9]{3}, [a-z]{4}"))),
            SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)]
  colocated = LLMEngine.from_parts(*tiny_model, warmup=False, config=EngineConfig.of(**options))
  split = DisaggregatedEngine.from_parts(*tiny_model, warmup=False, config=EngineConfig.of(
      **options, kv_transfer_config={"prefill_devices": 1, "decode_devices": 1}))
  want, got = (_run(e, ["Is it?"], params) for e in (colocated, split))
  assert split.num_transfers == 2
  for g, w in zip(got, want):
    assert (g.outputs[0].token_ids, g.outputs[0].text, g.outputs[0].finish_reason) == (
        w.outputs[0].token_ids, w.outputs[0].text, w.outputs[0].finish_reason)
  assert want[0].outputs[0].finish_reason == "stop"  # the constraint ended it
  assert got[1].prompt_logprobs[0] is None and len(got[1].prompt_logprobs) > 1
  for g, w in zip(got[1].prompt_logprobs[1:], want[1].prompt_logprobs[1:]):
    assert g.keys() == w.keys()
    np.testing.assert_allclose([g[t] for t in w], list(w.values()), atol=1e-4)
  _no_leaks(split)


@pytest.mark.slow
def test_a_request_crosses_processes_and_decodes_on(tiny_model):
  """What a hand-over to another process carries: a request just prefilled, under a
  structured-output constraint, goes through the peer link's pickling (the tokenizer by name)
  and is rebuilt (its matcher from the grammar and the token so far). Taken in without its
  pages, it is recomputed and ends as it would have without leaving: tokens, streamed text."""
  from jinfer.engine.disaggregated import arriving, leaving
  from jinfer.parallel.peer_link import dumps, loads
  from jinfer.sampling.params import StructuredOutputsParams
  engine = LLMEngine.from_parts(*tiny_model, warmup=False, config=EngineConfig.of(
      max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16))
  sp = SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=StructuredOutputsParams(
      regex=r"(yes|no), [0-9]{3}, [a-z]{4}"))
  want = _run(engine, ["Is it?"], [sp])[0].outputs[0]
  engine.hand_off_prefilled = True  # parked after its first token, as a prefill engine parks it
  rid = engine.add_request(None, "Is it?", sp)
  streamed = "".join(o.outputs[0].delta_text for o in engine.step())
  (seq,) = engine.handoffs
  group = engine.groups.pop(rid)
  for pages in seq.pages:
    engine.blocks.release(pages)
  seq.pages, engine.handoffs[:], engine.hand_off_prefilled = [], [], False
  leaving(group)
  local = {"tokenizer": engine.tokenizer}
  group = loads(dumps(group, local), local)
  arriving(group, engine)
  (seq,) = group.seqs
  assert seq.matcher is not None and seq.output_token_ids == want.token_ids[:1]
  engine.adopt(group)
  final = None
  while engine.has_unfinished_requests():
    for o in engine.step():
      streamed += o.outputs[0].delta_text
      final = o
  assert final.outputs[0].token_ids == want.token_ids and final.outputs[0].text == want.text
  assert streamed == want.text and final.outputs[0].finish_reason == "stop"
  engine.blocks.check_consistency()
  assert engine.blocks.num_free_pages == engine.blocks.num_usable_pages


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (see conftest.py)")
def test_each_side_routes_by_prefix_then_load(model):
  """Two prefill and two decode engines: a prompt goes where its prefix went (the pages are
  cached there), others to the least-loaded engine, on either side."""
  d = _disaggregated(model, prefill_devices=2, decode_devices=2, prefill_tensor_parallel_size=1,
                     decode_tensor_parallel_size=1)
  assert (len(d.prefill), len(d.decode)) == (2, 2)
  shared = list(range(100, 180))  # 5 full pages of 16
  first = d.add_request(None, shared + [1, 2], GREEDY)
  again = d.add_request(None, shared + [3], GREEDY)
  assert d._where[again] is d._where[first]
  other = d.add_request(None, [7] * 40, GREEDY)  # the least-loaded
  assert d._where[other] is not d._where[first]
  to = d._route("decode", d.decode, shared + [5] * 20, None)
  assert d._route("decode", d.decode, shared + [6], None) is to
  for rid in list(d._where):
    assert d.abort(rid)
  _no_leaks(d)


def test_pages_copy_between_meshes_and_head_layouts():
  """The copy reads the pages asked for and writes them where asked, whatever mesh each side
  has: 2 KV heads over TP 2 into a cache of TP 4 that holds each head twice, values and scales
  of a quantized cache alike (every leaf's page axis)."""
  from types import SimpleNamespace

  from jax.sharding import NamedSharding

  from jinfer.engine.kv_transfer import PageCopier
  from jinfer.parallel.mesh import ParallelConfig, make_mesh
  from jinfer.parallel.sharding import kv_cache_sharding
  from pallas_kernels.kv_cache_layout import QuantizedKVCache
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (see conftest.py)")
  devices = jax.devices()
  rng = np.random.default_rng(0)

  def side(tp, heads, devs, values):  # a runner as the copy sees one: its heads and its cache
    mesh = make_mesh(ParallelConfig(tensor_parallel_size=tp), devs)
    sh = kv_cache_sharding(mesh, quantized=True)
    cache = QuantizedKVCache(values, values[..., 0] * 0.5)  # [L, pages, 2, H, ps, D], [.., ps]
    return SimpleNamespace(config=SimpleNamespace(num_kv_heads=heads), mesh=mesh,
                           kv_cache=jax.device_put(cache, sh))

  src = side(2, 2, devices[:2], rng.standard_normal((2, 6, 2, 2, 4, 8)).astype(np.float32))
  dst = side(4, 4, devices[4:], np.zeros((2, 9, 2, 4, 4, 8), np.float32))
  copier = PageCopier(src, dst)
  staged = copier.send(src.kv_cache, [3, 1, 4])  # 3 pages, padded to 4 with the sink page
  out = copier.receive(dst.kv_cache, staged, [7, 2, 5])
  assert isinstance(out.values.sharding, NamedSharding) and out.values.sharding.mesh.size == 4
  for got, want in ((out.values, src.kv_cache.values), (out.scales, src.kv_cache.scales)):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(got[:, [7, 2, 5]], np.repeat(want[:, [3, 1, 4]], 2, axis=3))
    assert not got[:, [1, 3, 4, 6, 8]].any()  # no other page written (the sink is scratch)
  assert copier.bytes_per_page == 2 * 2 * 4 * 4 * (8 + 1) * 4

  # To an engine of another process, over JAX's transfer API (here between two endpoints of
  # this process): into TP 4 through one device, into a TP 2 mesh laid out alike shard by shard.
  from jinfer.engine.kv_transfer import PageReceiver, PageSender, TransferEndpoint
  a, b = TransferEndpoint(devices[0], "127.0.0.1"), TransferEndpoint(devices[4], "127.0.0.1")
  wide = side(4, 4, devices[4:], np.zeros((2, 9, 2, 4, 4, 8), np.float32))
  twin = side(2, 2, devices[6:], np.zeros((2, 9, 2, 2, 4, 8), np.float32))
  for far, heads, devs, repeat in ((wide, 4, 4, 2), (twin, 2, 2, 1)):
    sender = PageSender(src, heads, devs, a)
    assert sender.sharded == (far is twin)
    uuid, n = sender.send(src.kv_cache, [3, 1, 4])
    receiver = PageReceiver(far, b)
    staged = receiver.pull(far.kv_cache, a.address, uuid, n, sender.sharded)
    out = receiver.receive(far.kv_cache, staged, [7, 2, 5])
    np.testing.assert_array_equal(np.asarray(out.values)[:, [7, 2, 5]],
                                  np.repeat(np.asarray(src.kv_cache.values)[:, [3, 1, 4]],
                                            repeat, axis=3))
    assert out.values.sharding == far.kv_cache.values.sharding


# -- bad input, on the host alone -------------------------------------------------------------


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
    (dict(prefill_devices=2, kv_connector="jax_transfer"), r"'jax_transfer' runs each group in "
                                                           r"a process of its own"),
    (dict(prefill_devices=2, kv_ip=""), r"kv_ip must be a host address"),
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


# -- across processes ------------------------------------------------------------------------
PROMPTS = [[7, 30, 12, 90, 5], list(range(4, 64)), [42] * 20, list(range(60, 97))]


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (see conftest.py)")
def test_across_processes_matches_colocated(tiny_model_dir):
  """`kv_connector: "jax_transfer"` on loopback: process 0 prefills (TP 2), process 1 decodes
  (TP 2: the pages are pulled shard by shard) with a pool small enough to preempt (recomputed
  on process 0). Greedy tokens and logprobs and seeded samples are the
  colocated engine's; a request aborted once its first token is out is dropped; neither
  process holds a page or a request at the end. Then the decode process is killed mid-way:
  process 0 stops at once with an error naming it."""
  import json
  import time

  from jinfer.loader import load_model
  from tests.engine_fixtures import kill_the_follower_once_it_ran
  sizes = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, page_size=16)
  colocated = LLMEngine.from_parts(*load_model(tiny_model_dir, load_tokenizer=False),
                                   warmup=False, config=EngineConfig.of(
                                       **sizes, tensor_parallel_size=2))
  greedy = SamplingParams(max_tokens=40, temperature=0.0, logprobs=1, ignore_eos=True)
  seeded = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
  want = _run(colocated, PROMPTS, [greedy, seeded])
  abort = [3]
  spec = dict(options=dict(sizes, num_pages=9, tensor_parallel_size=2, compilation_cache=False,
                           kv_transfer_config={"kv_connector": "jax_transfer",
                                               "prefill_devices": 2, "decode_devices": 2}),
              prompts=PROMPTS, max_tokens=40, seeded=True, ignore_eos=True, abort=abort,
              then_killed=True)
  leader, lines = kill_the_follower_once_it_ran(tiny_model_dir, spec)
  # Its error at once (the process then exits once the runtime's heartbeat gives up the peer).
  t0 = time.monotonic()
  while "decode process 1 is gone" not in (line := leader.stderr.readline()):
    lines.append(line)
    assert time.monotonic() - t0 < 30 and line, "".join(lines[-40:])
  assert time.monotonic() - t0 < 10
  leader.kill()
  out, _ = leader.communicate(timeout=60)

  got = json.loads(out.splitlines()[-1])  # gloo logs on stdout too
  assert got["leaks"] == []
  assert len(got["decode"]) == 1 and got["decode"][0]["preemptions"] > 0
  assert all(d["pages_used"] == 0 and d["running"] == 0 for d in got["decode"])
  for i, w in enumerate(want):
    tokens, logprobs = got["tokens"][i], got["logprobs"][i]
    if i in abort:
      assert tokens is None
      continue
    assert tokens == w.outputs[0].token_ids, i
    if logprobs is not None:
      np.testing.assert_allclose(logprobs, [lp[t] for lp, t in zip(
          w.outputs[0].logprobs, w.outputs[0].token_ids)], atol=1e-4)
