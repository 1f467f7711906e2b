"""The server against a hostile client: a real uvicorn server without an API key, on a tiny
random model, driven by the official `openai` client, plain HTTP and raw sockets.

What a web page in a browser could do (simple cross-origin POSTs, DNS rebinding), slow and
oversized requests, and the requests that used to fail their batch, answer 500 or name the
wrong field. Every refusal comes before anything is queued and leaves the engine idle.
"""
from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import openai
import pytest

from tests.engine_fixtures import SMALL_POOL, make_engine
from tests.live_server import http, live_server, post_json, raw_request, wait_idle

MODEL = "tiny"
APP = "http://app.example"  # an origin allowed to call the server (CORS)
MATE = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_model):
  # test_fuzz_engine's options: its compiled steps are in the compilation cache.
  engine = make_engine(tiny_model, **SMALL_POOL)
  with live_server(engine, MODEL, max_waiting=4, max_request_bytes=1 << 20, header_timeout=2.0,
                   body_timeout=1.0, max_connections=250, allowed_hosts=("api.example",),
                   allowed_origins=(APP,)) as srv:
    yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
  return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def mate_alone(client) -> str:
  return client.completions.create(**MATE).choices[0].text


def completion(server, body: dict | bytes, **headers: str) -> tuple[int, dict, bytes]:
  data = body if isinstance(body, bytes) else json.dumps(body).encode()
  return http(f"{server.url}/v1/completions", data, headers=headers)


def assert_untouched(server, steps_before: int):
  """Nothing was queued: the engine never stepped and holds no request."""
  assert server.engine.num_steps == steps_before
  wait_idle(server.engine)


# -- 1: a value its device array cannot hold --------------------------------------------------
def test_top_k_beyond_int32_is_refused_and_its_batch_mates_are_untouched(client, mate_alone):
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    mates = [pool.submit(client.completions.create, **MATE) for _ in range(2)]
    with pytest.raises(openai.BadRequestError, match="top_k") as e:
      client.completions.create(model=MODEL, prompt="x", extra_body={"top_k": 2**31})
    assert e.value.body["param"] == "top_k"
    assert [m.result(timeout=60).choices[0].text for m in mates] == [mate_alone] * 2


# -- 5: browsers on this machine ----------------------------------------------------------------
def test_simple_cross_origin_posts_are_refused(server):
  steps = server.engine.num_steps
  body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
  # What a form or a no-cors fetch can send: a text/plain body, with or without its Origin.
  status, _, data = completion(server, body, **{"Content-Type": "text/plain",
                                                "Origin": "http://evil.example"})
  assert status == 403 and json.loads(data)["error"]["code"] == "origin_not_allowed"
  status, _, data = completion(server, body, **{"Content-Type": "text/plain"})
  assert status == 415 and json.loads(data)["error"]["code"] == "unsupported_media_type"
  status, _, _ = completion(server, body, **{"Content-Type": "application/json",
                                             "Origin": "http://evil.example"})
  assert status == 403
  # A preflight from a foreign origin is refused; the allowed origin gets its CORS answer.
  status, _, _ = http(f"{server.url}/v1/completions", method="OPTIONS", headers={
      "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
  assert status == 403
  assert_untouched(server, steps)
  status, headers, _ = http(f"{server.url}/v1/completions", method="OPTIONS", headers={
      "Origin": APP, "Access-Control-Request-Method": "POST",
      "Access-Control-Request-Headers": "content-type"})
  assert status == 200 and headers["access-control-allow-origin"] == APP
  for origin in (APP, server.url):  # the allowed one, and the server's own (its docs page)
    status, headers, _ = completion(server, body, **{"Content-Type": "application/json",
                                                     "Origin": origin})
    assert status == 200
  assert headers.get("access-control-allow-origin") is None  # same-origin needs no CORS


@pytest.mark.parametrize("host, allowed", [
    ("evil.example", False), ("evil.example:80", False), ("127.0.0.1.evil.example", False),
    ("", False), ("evil.example@127.0.0.1", False), ("127.0.0.1/evil", False),
    ("127.0.0.1", True), ("localhost:8000", True), ("[::1]:8000", True),
    ("api.example", True), ("API.example.", True)])
def test_without_a_key_only_the_servers_own_names_are_answered(server, host, allowed):
  """A page whose DNS name was rebound to 127.0.0.1 sends its own name as Host."""
  status, _, data = http(f"{server.url}/v1/models", headers={"Host": host})
  assert status == (200 if allowed else 400)
  if not allowed:
    assert json.loads(data)["error"]["code"] == "host_not_allowed"


def test_docs_are_open_without_a_key(server):
  assert http(f"{server.url}/docs")[0] == 200
  status, _, data = http(f"{server.url}/openapi.json")
  assert status == 200 and "/v1/completions" in json.loads(data)["paths"]


# -- 2 and 6: large and slow requests -----------------------------------------------------------
def _head(length: int | None = None, chunked: bool = False) -> bytes:
  head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
  if chunked:
    head += b"Transfer-Encoding: chunked\r\n"
  elif length is not None:
    head += b"Content-Length: %d\r\n" % length
  return head + b"\r\n"


def test_oversized_bodies_get_413_and_a_closed_connection(server):
  steps = server.engine.num_steps
  limit = 1 << 20
  # Declared too large: refused before a byte of the body is read.
  reply = raw_request(server.port, _head(limit + 1))
  assert reply.startswith(b"HTTP/1.1 413") and b"request_too_large" in reply
  # Chunked, so the size shows only while reading: refused once past the limit.
  chunk = b"%x\r\n%s\r\n" % (64 << 10, b" " * (64 << 10))
  with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
    sock.sendall(_head(chunked=True))
    reply = b""
    try:
      for _ in range(limit // (64 << 10) + 2):
        sock.sendall(chunk)
      reply = sock.recv(65536)
    except (BrokenPipeError, ConnectionResetError):
      pass  # closed while we were still sending: the reply may be lost, not the refusal
    assert not reply or reply.startswith(b"HTTP/1.1 413")
  assert_untouched(server, steps)


def test_a_body_that_does_not_arrive_gets_408(server):
  steps = server.engine.num_steps
  t0 = time.monotonic()
  reply = raw_request(server.port, _head(100), b'{"model": ')  # then nothing
  assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
  assert 0.9 < time.monotonic() - t0 < 10
  assert_untouched(server, steps)


def test_half_sent_headers_cannot_hold_connections(server):
  """Connections stalled inside their headers are closed after the header timeout (2 s); until
  then other clients are served, up to max_connections (250), past which they get 503."""
  head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"
  socks = []
  try:
    for _ in range(200):
      socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
      socks[-1].sendall(head)
    t0 = time.monotonic()
    assert http(f"{server.url}/health", timeout=10)[0] == 200
    assert time.monotonic() - t0 < 0.5
    for _ in range(60):
      socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
      socks[-1].sendall(head)
    assert http(f"{server.url}/health", timeout=10)[0] == 503
    for s in socks:  # each is closed by the server, with no reply
      assert s.recv(1024) == b""
    assert time.monotonic() - t0 < 15
  finally:
    for s in socks:
      s.close()
  deadline = time.monotonic() + 10
  while len(server.uvicorn.server_state.connections) > 0:
    assert time.monotonic() < deadline, "the server still holds the connections"
    time.sleep(0.05)
  assert http(f"{server.url}/health", timeout=10)[0] == 200


# -- 3: chat_template_kwargs ----------------------------------------------------------------------
def test_chat_template_kwargs(client):
  chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
              temperature=0)
  for key in ("add_generation_prompt", "tokenize", "messages"):
    with pytest.raises(openai.BadRequestError, match=key) as e:
      client.chat.completions.create(**chat, extra_body={"chat_template_kwargs": {key: False}})
    assert e.value.body["param"] == "chat_template_kwargs"
  # SmolLM2's template reads no other variable: what it cannot use is not passed.
  plain = client.chat.completions.create(**chat).choices[0].message.content
  given = client.chat.completions.create(**chat, extra_body={"chat_template_kwargs": {
      "enable_thinking": True, "raise_exception": "x", "bos_token": [1]}})
  assert given.choices[0].message.content == plain


# -- 4: requests that can never fit the queue -----------------------------------------------------
def test_more_sequences_than_the_queue_holds_get_400_not_429(server, client):
  steps = server.engine.num_steps
  with pytest.raises(openai.BadRequestError, match="smaller requests") as e:
    client.completions.create(model=MODEL, prompt=["a", "b", "c"], n=2, max_tokens=2)
  assert e.value.body["param"] == "prompt"
  with pytest.raises(openai.BadRequestError, match="queue bound") as e:
    client.completions.create(model=MODEL, prompt="a", n=5, max_tokens=2)
  assert e.value.body["param"] == "n"
  assert_untouched(server, steps)


# -- 7: what the messages name --------------------------------------------------------------------
@pytest.mark.parametrize("prompt, says", [
    ([1, True], "token ids are integers; item 1 is true"),
    ([1.5], "token ids are integers; item 0 is 1.5"),
    ([[1, 2], [3, 2.5]], "token ids are integers; item [1][1] is 2.5"),
    (["a", 3], "a list of prompts holds strings; item 1 is 3"),
    ({"text": "a"}, "must be a string, a list of strings"),
])
def test_bad_prompts_are_named(server, prompt, says):
  status, err = post_json(f"{server.url}/v1/completions",
                          json.dumps({"model": MODEL, "prompt": prompt}).encode())
  assert status == 400 and err["error"]["param"] == "prompt"
  assert says in err["error"]["message"] and "str" not in err["error"]["message"].split(":")[0]


def test_image_parts_and_output_limits_are_named(client):
  with pytest.raises(openai.BadRequestError, match='part 1 has type "image_url"') as e:
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
  assert e.value.body["param"] == "messages"
  with pytest.raises(openai.BadRequestError, match="max_model_len") as e:
    client.completions.create(model=MODEL, prompt="hi", max_tokens=100)
  assert (e.value.body["param"], e.value.body["code"]) == ("max_tokens",
                                                           "context_length_exceeded")
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                   max_completion_tokens=100)
  assert e.value.body["param"] == "max_completion_tokens"
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model=MODEL, prompt="word " * 100, max_tokens=2)
  assert (e.value.body["param"], e.value.body["code"]) == ("prompt", "context_length_exceeded")


def test_unknown_request_fields_are_ignored_and_logged(server, caplog):
  """As vLLM: a field the server does not know does not fail the request; its name is logged."""
  body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "frobnicate": 3, "zeta": {"a": 1}}
  with caplog.at_level("WARNING", logger="jinfer.serving.app"):
    status, data = post_json(f"{server.url}/v1/completions", json.dumps(body).encode())
  assert status == 200 and data["usage"]["completion_tokens"] == 1, data
  assert "ignored request fields: frobnicate, zeta" in caplog.text
