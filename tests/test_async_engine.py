"""AsyncLLMEngine on the real SmolLM2: streaming, validation at the call, the bounded queue,
aborts that free pages, failures confined to their requests, and shutdown."""
from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from jinfer.engine.async_engine import (AsyncLLMEngine, EngineDeadError, QueueFullError,
                                        RequestAbortedError, RequestFailedError, collect)
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.sampling.params import SamplingParams
from tests.engine_fixtures import SMOLLM2

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def engine(smollm2_gguf) -> LLMEngine:
  return LLMEngine(smollm2_gguf, config=EngineConfig.of(**SMOLLM2))


def run(engine: LLMEngine, body, **options):
  """Run `body(async_engine)` on a fresh event loop with a started AsyncLLMEngine."""

  async def main():
    aeng = AsyncLLMEngine(engine, **options)
    aeng.start()
    try:
      return await body(aeng)
    finally:
      await aeng.shutdown(drain=False)

  result = asyncio.run(main())
  assert not engine.has_unfinished_requests()
  assert engine.blocks.num_free_pages == engine.blocks.num_usable_pages  # nothing leaked
  return result


def test_stream_deltas_add_up_and_match_the_offline_engine(engine):
  offline_id = engine.add_request(None, "The capital of France is", GREEDY)
  offline = engine.run_to_completion()[offline_id].outputs[0]

  async def body(aeng):
    async def one():
      text, tokens, outs = "", [], []
      async for out in aeng.generate("The capital of France is", GREEDY):
        text += out.outputs[0].delta_text
        tokens += out.outputs[0].delta_token_ids
        outs.append(out)
      return text, tokens, outs
    return await asyncio.gather(one(), one(), one())

  for text, tokens, outs in run(engine, body):
    final = outs[-1]
    assert final.finished and sum(o.finished for o in outs) == 1
    assert (text, tokens) == (final.outputs[0].text, final.outputs[0].token_ids)
    assert (text, tokens) == (offline.text, offline.token_ids)
    assert final.metrics.ttft is not None and final.metrics.e2e >= final.metrics.ttft


def test_invalid_requests_raise_at_the_call_and_queue_nothing(engine):
  async def body(aeng):
    with pytest.raises(ValueError, match="max_model_len"):
      aeng.generate("word " * 600, GREEDY)
    with pytest.raises(ValueError, match="empty"):
      aeng.generate([], GREEDY)
    with pytest.raises(ValueError, match="exceeds"):
      aeng.generate("hi", SamplingParams(max_tokens=1000))
    stream = aeng.generate("hi", GREEDY, "dup")
    with pytest.raises(ValueError, match="already in use"):
      aeng.generate("hi", GREEDY, "dup")
    await collect(stream)
    return aeng.stats()

  stats = run(engine, body)
  assert stats.num_waiting == 0 and stats.num_running == 0


def test_bounded_queue(engine):
  gate = threading.Event()
  step = engine.step

  def held_step():  # the engine thread waits here, so submissions pile up deterministically
    gate.wait()
    return step()

  async def body(aeng):
    engine.step = held_step
    streams = [aeng.generate("hi", GREEDY), aeng.generate("hi", SamplingParams(n=2, max_tokens=2))]
    with pytest.raises(QueueFullError):
      aeng.generate("hi", GREEDY)
    with pytest.raises(ValueError, match="queue bound"):
      aeng.generate("hi", SamplingParams(n=4))
    gate.set()
    finals = [await collect(s) for s in streams]
    return finals, await collect(aeng.generate("hi", GREEDY))  # room again

  try:
    finals, later = run(engine, body, max_waiting=3)
  finally:
    del engine.step
  assert [len(f.outputs) for f in finals] == [1, 2] and later.finished


def test_closing_or_cancelling_the_consumer_aborts_and_frees_pages(engine):
  long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

  async def idle(aeng):
    for _ in range(200):  # the abort reaches the engine thread
      if not engine.has_unfinished_requests():
        return
      await asyncio.sleep(0.05)
    raise AssertionError("the request was not aborted")

  async def body(aeng):
    before = engine.generation_tokens
    async with contextlib.aclosing(aeng.generate("Once upon a time", long)) as stream:
      async for out in stream:
        if len(out.outputs[0].token_ids) >= 3:
          break
    await idle(aeng)

    started = asyncio.Event()

    async def consume():
      async for _ in aeng.generate("Tell me a story", long):
        started.set()
    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
      await task
    await idle(aeng)
    assert engine.generation_tokens - before < 100  # neither ran to its end
    return aeng.stats()

  stats = run(engine, body)
  assert stats.kv_pages_used == 0.0 and stats.num_running == stats.num_waiting == 0


def test_abort_reaches_the_consumer(engine):
  async def body(aeng):
    stream = aeng.generate("Once upon a time", SamplingParams(max_tokens=100, ignore_eos=True),
                           "victim")
    await anext(stream)
    await aeng.abort("victim")
    assert aeng.stats().kv_pages_used == 0.0
    with pytest.raises(RequestAbortedError):
      async for _ in stream:
        pass

  run(engine, body)


def test_a_failing_request_fails_alone(engine):
  append = engine._append_token

  def failing_append(seq, out, row, now):
    if seq.group_id == "bad" and seq.output_token_ids:
      raise RuntimeError("injected")
    return append(seq, out, row, now)

  async def body(aeng):
    engine._append_token = failing_append
    good = aeng.generate("The capital of France is", GREEDY)
    bad = aeng.generate("The capital of France is", GREEDY, "bad")
    with pytest.raises(RequestFailedError, match="injected"):
      await collect(bad)
    return await collect(good)

  try:
    good = run(engine, body)
  finally:
    del engine._append_token
  assert good.finished and len(good.outputs[0].token_ids) == 8


def test_a_failing_step_fails_its_batch_and_the_loop_goes_on(engine):
  runner_run = engine.runner.run
  calls = []

  def failing_run(inp, drafts=None):
    calls.append(1)
    if len(calls) == 2:
      raise RuntimeError("injected step failure")
    return runner_run(inp, drafts)

  async def body(aeng):
    engine.runner.run = failing_run
    with pytest.raises(RequestFailedError, match="injected step failure"):
      await collect(aeng.generate("The capital of France is", GREEDY))
    return await collect(aeng.generate("The capital of France is", GREEDY))

  try:
    after = run(engine, body)
  finally:
    del engine.runner.run
  assert after.finished and len(after.outputs[0].token_ids) == 8


def test_shutdown_drains_or_aborts(engine):
  async def body():
    aeng = AsyncLLMEngine(engine)
    aeng.start()
    drained = asyncio.ensure_future(collect(aeng.generate("Hello", GREEDY)))
    await asyncio.sleep(0)
    await aeng.shutdown(drain=True)
    assert (await drained).finished
    with pytest.raises(EngineDeadError):
      aeng.generate("Hello", GREEDY)

    aeng = AsyncLLMEngine(engine)
    aeng.start()
    stream = aeng.generate("Hello", SamplingParams(max_tokens=100, ignore_eos=True))
    await anext(stream)
    await aeng.shutdown(drain=False)
    with pytest.raises(RequestAbortedError):
      await collect(stream)

  asyncio.run(body())
  assert not engine.has_unfinished_requests()
  assert engine.blocks.num_free_pages == engine.blocks.num_usable_pages
