"""The OpenAI-compatible server end to end: a real uvicorn server on a loopback port, driven by the
official `openai` client (and raw HTTP where a client would refuse to send the request).

One server (SmolLM2, warmed up) serves the whole module; the last test shuts it down. What a
hostile client can do without a model to speak of is in test_server_guard.py.
"""
from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
import urllib.request

import openai
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from tests.engine_fixtures import SMOLLM2
from tests.fuzz import INT_EDGES, edges, fuzz_settings, one_edge, sampling_fields
from tests.live_server import http, live_server, post_json, wait_idle

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
KEY = "test-key"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
VOCAB = 49152
MATE = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def server(smollm2_gguf):
  engine = LLMEngine(smollm2_gguf, config=EngineConfig.of(**SMOLLM2))
  with live_server(engine, MODEL, api_key=KEY, shutdown_timeout=3.0) as srv:
    yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
  return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path: str, body: bytes, key: str | None = KEY) -> tuple[int, dict]:
  return post_json(server.url + path, body, key)


# -- what works ---------------------------------------------------------------------------------
def test_models_and_health(server, client):
  models = client.models.list().data
  assert [m.id for m in models] == [MODEL] and models[0].object == "model"
  with urllib.request.urlopen(server.url + "/health", timeout=10) as resp:
    assert resp.status == 200


def test_completion_and_its_stream_agree(server, client):
  full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
  assert full.object == "text_completion" and full.model == MODEL and full.id.startswith("cmpl-")
  (choice,) = full.choices
  assert choice.index == 0 and choice.finish_reason == "length" and choice.text
  n_prompt = len(server.engine.tokenize(PROMPT))
  assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (n_prompt, 8)
  assert full.usage.total_tokens == n_prompt + 8

  chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
  assert all(c.usage is None for c in chunks[:-1])


def test_chat_and_its_stream_agree(client):
  full = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10,
                                        temperature=0)
  assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
  (choice,) = full.choices
  assert choice.message.role == "assistant" and "Paris" in choice.message.content
  assert choice.finish_reason in ("stop", "length")
  assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

  chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                               temperature=0, stream=True))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
  assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_stop_strings(client):
  text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                   temperature=0).choices[0].text
  stop = text.strip()[1:3]  # two characters from inside the greedy continuation
  kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
  choice = client.completions.create(**kw).choices[0]
  assert choice.finish_reason == "stop" and choice.text == text[:text.index(stop)]
  streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
  assert streamed == choice.text


def test_n_and_seeded_sampling(client):
  kw = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, n=3)
  a = client.chat.completions.create(**kw, seed=7)
  b = client.chat.completions.create(**kw, seed=7)
  c = client.chat.completions.create(**kw, seed=8)
  assert [ch.index for ch in a.choices] == [0, 1, 2]
  texts = lambda r: [ch.message.content for ch in r.choices]
  assert texts(a) == texts(b) and texts(a) != texts(c)
  assert 3 <= a.usage.completion_tokens <= 24

  batch = client.completions.create(model=MODEL, prompt=[PROMPT, "1, 2, 3,"], n=2, max_tokens=4,
                                    temperature=0)
  assert sorted(ch.index for ch in batch.choices) == [0, 1, 2, 3]
  assert batch.choices[0].text == batch.choices[1].text  # greedy: the samples agree
  assert batch.usage.completion_tokens == 16


def test_logprobs(client):
  comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                   logprobs=3)
  lp = comp.choices[0].logprobs
  assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
  assert "".join(lp.tokens) == comp.choices[0].text
  assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(5)]
  for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
    assert logprob <= 0 and 3 <= len(top) <= 4 and top[token] == logprob
    assert logprob == max(top.values())  # greedy picks the most likely token

  chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                        logprobs=True, top_logprobs=2)
  content = chat.choices[0].logprobs.content
  assert len(content) == chat.usage.completion_tokens
  assert "".join(t.token for t in content) == chat.choices[0].message.content
  for t in content:
    assert t.bytes == list(t.token.encode("utf-8")) and len(t.top_logprobs) == 2
    assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
    assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob

  chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5,
                                               temperature=0, logprobs=True, top_logprobs=2,
                                               stream=True))
  streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content]
  assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


# -- what fails, and leaves nothing behind ------------------------------------------------------
@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b'["a list"]', 400, None),
    (b'{"model": "%s", "prompt": "hi", "max_tokens": "5"}' % MODEL.encode(), 400, "max_tokens"),
    (b'{"model": "%s", "prompt": "hi", "temperature": true}' % MODEL.encode(), 400, "temperature"),
    (b'{"model": "%s", "prompt": "hi", "top_p": 1.5}' % MODEL.encode(), 400, "top_p"),
    (b'{"model": "%s", "prompt": "hi", "n": 0}' % MODEL.encode(), 400, "n"),
    (b'{"model": "%s", "prompt": "hi", "logprobs": 21}' % MODEL.encode(), 400, "logprobs"),
    (b'{"model": "%s", "prompt": "hi", "max_tokens": 600}' % MODEL.encode(), 400, "max_tokens"),
    (b'{"model": "%s", "prompt": ""}' % MODEL.encode(), 400, "prompt"),
    (b'{"model": "%s", "prompt": [99999999]}' % MODEL.encode(), 400, "prompt"),
    (b'{"model": "%s", "prompt": "hi", "top_k": 2147483648}' % MODEL.encode(), 400, "top_k"),
    (b'{"model": "%s", "prompt": "hi", "temperature": 1e39}' % MODEL.encode(), 400,
     "temperature"),
    (b'{"model": "%s", "prompt": "hi", "echo": true}' % MODEL.encode(), 400, "echo"),
    (b'{"prompt": "hi"}', 400, "model"),
    (b'{"model": "gpt-4", "prompt": "hi"}', 404, "model"),
])
def test_bad_completion_requests(server, body, status, param):
  code, err = post(server, "/v1/completions", body)
  assert code == status, err
  assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
  assert err["error"]["param"] == param
  assert not server.engine.has_unfinished_requests()


def test_bad_chat_requests_through_the_client(server, client):
  with pytest.raises(openai.BadRequestError, match="max_model_len") as e:
    client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "word " * 600}])
  assert e.value.body["code"] == "context_length_exceeded"
  with pytest.raises(openai.BadRequestError, match="top_logprobs"):
    client.chat.completions.create(model=MODEL, messages=CHAT, top_logprobs=3)
  with pytest.raises(openai.BadRequestError, match="role"):
    client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
  with pytest.raises(openai.BadRequestError, match="messages"):
    client.chat.completions.create(model=MODEL, messages=[])
  with pytest.raises(openai.NotFoundError) as e:
    client.chat.completions.create(model="gpt-4", messages=CHAT)
  assert e.value.body["code"] == "model_not_found"
  code, err = post(server, "/v1/nowhere", b"{}")
  assert code == 404 and err["error"]["message"]
  assert not server.engine.has_unfinished_requests()


def test_api_key(server):
  bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong-key", max_retries=0)
  with pytest.raises(openai.AuthenticationError) as e:
    bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
  assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
  code, err = post(server, "/v1/completions", b"{}", key=None)  # no key at all
  assert code == 401 and err["error"]["code"] == "invalid_api_key"
  body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1}).encode()
  for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive
    code, _ = post_json(server.url + "/v1/completions", body, Authorization=f"{scheme} {KEY}")
    assert code == 200
  with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:  # no key needed
    assert resp.status == 200
  for path in ("/docs", "/redoc", "/openapi.json"):  # behind the key, like the API
    assert http(server.url + path)[0] == 401
    assert http(server.url + path, headers={"Authorization": f"Bearer {KEY}"})[0] == 200


def test_full_queue_gets_429(server, client):
  aeng, engine = server.async_engine, server.engine
  gate = threading.Event()
  step = engine.step

  def held_step():  # hold the engine so the first request stays waiting
    gate.wait()
    return step()

  max_waiting = aeng.max_waiting
  engine.step, aeng.max_waiting = held_step, 1
  try:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      first = pool.submit(client.completions.create, model=MODEL, prompt=PROMPT, max_tokens=2)
      while aeng.stats().num_waiting == 0:
        time.sleep(0.02)
      with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
      assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
      gate.set()
      assert first.result(timeout=60).choices[0].finish_reason == "length"
  finally:
    gate.set()
    del engine.step
    aeng.max_waiting = max_waiting
  wait_idle(engine)


def test_a_failing_request_gets_500_and_the_others_finish(server, client):
  engine = server.engine
  marker = [1234, 4321, 1234]
  append = engine._append_token

  def failing_append(seq, out, row, now):
    if seq.prompt_token_ids[:3] == marker and seq.output_token_ids:
      raise RuntimeError("injected failure")
    return append(seq, out, row, now)

  engine._append_token = failing_append
  try:
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
      good = [pool.submit(client.completions.create, model=MODEL, prompt=PROMPT, max_tokens=6,
                          temperature=0) for _ in range(2)]
      bad = pool.submit(client.completions.create, model=MODEL, prompt=marker + [5, 6],
                        max_tokens=6)
      with pytest.raises(openai.InternalServerError, match="injected failure"):
        bad.result(timeout=60)
      assert all(g.result(timeout=60).usage.completion_tokens == 6 for g in good)
    stream = client.completions.create(model=MODEL, prompt=marker, max_tokens=6, stream=True)
    with pytest.raises(openai.APIError, match="injected failure"):
      list(stream)
  finally:
    del engine._append_token
  wait_idle(engine)


def test_disconnects_abort_and_free_pages(server, client):
  engine = server.engine
  wait_idle(engine)
  before, aborts = engine.generation_tokens, server.metrics.finished["abort"]
  long = dict(model=MODEL, prompt=PROMPT, max_tokens=400, extra_body={"ignore_eos": True})

  stream = client.completions.create(**long, stream=True)
  for i, _ in enumerate(stream):
    if i == 2:
      break
  assert engine.has_unfinished_requests()
  stream.close()
  wait_idle(engine)

  # A non-streaming request whose client hangs up while it runs.
  body = json.dumps({**{k: v for k, v in long.items() if k != "extra_body"},
                     "ignore_eos": True}).encode()
  with socket.create_connection(("127.0.0.1", server.port)) as sock:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 30
    while not engine.has_unfinished_requests():
      assert time.monotonic() < deadline
      time.sleep(0.02)
    time.sleep(0.3)
  wait_idle(engine)
  assert engine.generation_tokens - before < 400  # neither request ran to its end
  assert server.async_engine.stats().kv_pages_used == 0.0
  assert server.metrics.finished["abort"] == aborts + 2


def test_huge_prompts_are_refused_without_stalling_the_server(server, client):
  """5 MB prompts, sent while a stream runs, are refused from their size before any
  tokenizing: /health keeps answering at once and the stream's pace holds."""
  wait_idle(server.engine)
  huge = "Paris " * ((5 << 20) // 6)  # 5 MiB
  bodies = [json.dumps({"model": MODEL, "prompt": huge, "max_tokens": 4}).encode(),
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": huge}]}).encode()]
  token_times: list[float] = []

  def consume():
    for _ in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=300, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True}):
      token_times.append(time.monotonic())

  def refuse_all():
    for i in range(20):
      path = "/v1/chat/completions" if i % 2 else "/v1/completions"
      code, err = post(server, path, bodies[i % 2])
      assert code == 400 and err["error"]["code"] == "context_length_exceeded", err

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    stream = pool.submit(consume)
    while len(token_times) < 20:  # the stream's own pace first
      assert not stream.done(), stream.exception()
      time.sleep(0.02)
    start = time.monotonic()
    refusals = pool.submit(refuse_all)
    health = []
    while not refusals.done():
      t0 = time.monotonic()
      assert http(server.url + "/health", timeout=10)[0] == 200
      health.append(time.monotonic() - t0)
      time.sleep(0.02)
    refusals.result()
    end = time.monotonic()
    stream.result(timeout=120)
  gaps = [(b, b - a) for a, b in zip(token_times, token_times[1:])]
  before = sorted(g for t, g in gaps[1:] if t < start)  # the first gap holds the prefill
  during = sorted(g for t, g in gaps if start <= t and t - g <= end)
  median = lambda xs: xs[len(xs) // 2]
  print(f"\n20 refusals of 5 MB prompts in {end - start:.2f} s; /health max "
        f"{max(health) * 1e3:.0f} ms over {len(health)} calls; inter-token gap before: median "
        f"{median(before) * 1e3:.0f} ms, max {before[-1] * 1e3:.0f} ms; during: median "
        f"{median(during) * 1e3:.0f} ms, max {during[-1] * 1e3:.0f} ms ({len(during)} gaps)")
  # Tokenizing one such prompt held the server for 3-5 s; parsing 20 bodies of 5 MB still
  # takes CPU from the stream on a 2-core machine, so its pace may slow but never stall.
  assert max(health) < 0.5
  assert median(during) <= 3 * median(before) and during[-1] < 0.5


# -- fuzzing the request JSON ---------------------------------------------------------------------
_ANY_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=5)


def _messages(content: st.SearchStrategy) -> st.SearchStrategy:
  roles = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
  return st.lists(st.fixed_dictionaries({"role": roles, "content": content},
                                        optional={"name": st.text(max_size=4)}),
                  min_size=1, max_size=3)


_TEXT_PARTS = st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                              "text": st.text(max_size=8)}), max_size=2)
_VALID = {
    "model": st.just(MODEL), "stream": st.booleans(), "user": st.text(max_size=4),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "logit_bias": st.just({})}
_COMPLETION = {
    "prompt": st.one_of(st.text(min_size=1, max_size=30),
                        st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
                        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
                        st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
                                 min_size=1, max_size=2)),
    "echo": st.just(False), "suffix": st.just("")}
_CHAT = {
    "messages": _messages(st.one_of(st.text(max_size=20), _TEXT_PARTS)),
    "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
    "max_completion_tokens": st.integers(1, 12), "tools": st.just([]),
    "response_format": st.just({"type": "text"}),
    "chat_template_kwargs": st.dictionaries(st.text(max_size=3), _ANY_JSON, max_size=2)}
_EDGE = {
    "model": st.one_of(st.text(max_size=5), edges()),
    "prompt": st.one_of(_ANY_JSON, st.lists(st.sampled_from(INT_EDGES), min_size=1, max_size=3),
                        st.lists(st.one_of(st.integers(0, 9), st.floats(), st.booleans()),
                                 min_size=1, max_size=3)),
    "messages": st.one_of(_ANY_JSON, _messages(st.one_of(edges(), st.just(
        [{"type": "image_url", "image_url": {"url": "data:,"}}])))),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["messages", "tokenize", "add_generation_prompt"]), _ANY_JSON,
        min_size=1, max_size=2)}


@st.composite
def _request(draw) -> tuple[str, bytes]:
  """An endpoint and a body: every field valid, or one at an edge, or any JSON at all."""
  valid, edge = sampling_fields(st.integers(0, VOCAB - 1))
  valid |= _VALID
  if draw(st.booleans()):
    path, required, valid = "/v1/completions", ("model", "prompt", "max_tokens"), \
        valid | _COMPLETION
  else:
    path, required, valid = "/v1/chat/completions", ("model", "messages", "max_tokens"), \
        valid | _CHAT
  edge |= {k: _EDGE.get(k, edges()) for k in valid if k not in edge}
  body = draw(st.one_of(one_edge(valid, edge, required), one_edge(valid, edge, required),
                        one_edge(valid, edge, required), _ANY_JSON))
  return path, json.dumps(body).encode()


def _check_answer(status: int, data: bytes, stream: bool):
  assert status in (200, 400, 404, 429), (status, data[:300])
  if status != 200:
    err = json.loads(data)["error"]
    assert err["message"] and set(err) == {"message", "type", "param", "code"}
    return
  if not stream:
    assert json.loads(data)["choices"]
    return
  events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
  assert events[-1] == "[DONE]"
  assert all("error" not in json.loads(e) for e in events[:-1]), events


@pytest.fixture(scope="module")
def mate_alone(client) -> str:
  return client.completions.create(**MATE).choices[0].text


@pytest.mark.fuzz
@fuzz_settings(20)
@given(case=_request())
def test_any_request_json_is_answered_and_its_batch_mates_are_untouched(server, client,
                                                                        mate_alone, case):
  """Every field valid, or one at an edge, or any JSON: an answer or an OpenAI-shaped 4xx,
  never a 5xx or an error event, and a request running beside it gets its usual output."""
  path, body = case
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    # Either may find the queue full while the other waits: the mate retries, as it is told to.
    mate = pool.submit(client.with_options(max_retries=5).completions.create, **MATE)
    status, _, data = http(server.url + path, body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    event(f"status {status}")
    stream = status == 200 and json.loads(body).get("stream") is True
    _check_answer(status, data, stream)
    assert mate.result(timeout=60).choices[0].text == mate_alone
  wait_idle(server.engine)


def test_metrics(server, client):
  for _ in range(2):  # the second one hits the first one's cached prompt pages
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
  with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
    text = resp.read().decode()
  families = {f.name: f for f in text_string_to_metric_families(text)}
  value = lambda name, suffix="": next(s.value for s in families[name].samples
                                       if s.name == name + suffix)
  for name in ("jinfer_time_to_first_token_seconds", "jinfer_time_per_output_token_seconds",
               "jinfer_e2e_request_latency_seconds"):
    assert families[name].type == "histogram"
    buckets = [s.value for s in families[name].samples if s.name.endswith("_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == value(name, "_count") > 0
    assert value(name, "_sum") > 0
  assert value("jinfer_generation_tokens", "_total") >= 4
  assert value("jinfer_prompt_tokens", "_total") > 0
  for gauge in ("jinfer_num_requests_running", "jinfer_num_requests_waiting",
                "jinfer_kv_cache_usage_perc", "jinfer_prefix_cache_hit_rate"):
    assert families[gauge].type == "gauge"
  assert 0 < value("jinfer_prefix_cache_hit_rate") <= 1  # the same prompt came many times
  # Idle: the one KV group (a model without windows) holds nothing.
  assert [(s.labels["window"], s.value) for s in
          families["jinfer_kv_cache_bytes_per_seq"].samples] == [("none", 0.0)]
  assert families["jinfer_num_preemptions"].type == "counter"
  # Requests served while the background compiler was (or had been) at work: none compiled.
  assert value("jinfer_compiles_after_startup", "_total") == 0
  assert 2 <= value("jinfer_step_buckets_compiled") <= server.engine.stats().buckets_total
  reasons = {s.labels["finished_reason"]: s.value
             for s in families["jinfer_requests_finished"].samples}
  assert reasons["length"] >= 2 and set(reasons) <= {"stop", "length", "abort", "error"}


def test_shutdown_drains_short_requests_and_aborts_long_ones(server, client):
  """Runs last: it stops the module's server (shutdown timeout 3 s)."""
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    short = pool.submit(lambda: list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True)))
    long = pool.submit(lambda: list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=400, stream=True, extra_body={"ignore_eos": True})))
    while server.async_engine.stats().num_running < 2:
      time.sleep(0.02)
    server.uvicorn.should_exit = True
    while server.async_engine.is_running:
      time.sleep(0.02)
    with pytest.raises(openai.InternalServerError) as e:  # draining: no new requests
      client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 503
    chunks = short.result(timeout=60)
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.APIError, match="shut down"):  # an error event ends the stream
      long.result(timeout=60)
  server.thread.join(timeout=60)
  assert not server.thread.is_alive()
  wait_idle(server.engine)
  with pytest.raises(openai.APIConnectionError):  # the server is gone
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
