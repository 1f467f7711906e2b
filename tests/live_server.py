"""A real uvicorn server on a free loopback port, run in a thread, and plain-HTTP helpers."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import types
import urllib.error
import urllib.request

from jinfer.engine.engine import LLMEngine
from jinfer.serving.options import ServerOptions
from jinfer.serving.server import build_server


@contextlib.contextmanager
def live_server(engine: LLMEngine, model_name: str, **options):
  """Serve `engine` until the block ends (or a test sets `uvicorn.should_exit`)."""
  sock = socket.create_server(("127.0.0.1", 0))
  port = sock.getsockname()[1]
  srv = build_server(engine, model_name=model_name,
                     options=ServerOptions(port=port, **options), log_level="warning")
  thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  deadline = time.monotonic() + 60
  while not srv.started:
    assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
    time.sleep(0.05)
  try:
    yield types.SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, engine=engine,
                                async_engine=srv.config.app.state.engine,
                                metrics=srv.config.app.state.metrics, uvicorn=srv, thread=thread)
  finally:
    srv.should_exit = True
    thread.join(timeout=60)


def wait_idle(engine: LLMEngine, timeout: float = 20.0):
  """Until the engine holds no request and every KV page is free again."""
  deadline = time.monotonic() + timeout
  while engine.has_unfinished_requests() or \
      engine.blocks.num_free_pages != engine.blocks.num_usable_pages:
    assert time.monotonic() < deadline, "requests or pages were not released"
    time.sleep(0.05)


def http(url: str, body: bytes | None = None, *, method: str | None = None,
         headers: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, dict, bytes]:
  """(status, response headers, body) of one request; error statuses are returned, not raised."""
  req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
  try:
    with urllib.request.urlopen(req, timeout=timeout) as resp:
      return resp.status, dict(resp.headers), resp.read()
  except urllib.error.HTTPError as e:
    return e.code, dict(e.headers), e.read()


def post_json(url: str, body: bytes, key: str | None = None,
              **headers: str) -> tuple[int, dict]:
  """POST a JSON body; (status, the parsed JSON answer)."""
  hdrs = {"Content-Type": "application/json", **headers}
  if key is not None:
    hdrs["Authorization"] = f"Bearer {key}"
  status, _, data = http(url, body, headers=hdrs)
  return status, json.loads(data)


def raw_request(port: int, head: bytes, body: bytes = b"", timeout: float = 30) -> bytes:
  """Send raw bytes, read until the server closes the connection (or `timeout`)."""
  with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
    sock.sendall(head + body)
    chunks = []
    with contextlib.suppress(ConnectionResetError):
      while chunk := sock.recv(65536):
        chunks.append(chunk)
  return b"".join(chunks)
