"""`jinfer serve`: load a model, warm the engine up, and serve the OpenAI API with uvicorn."""
from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from jinfer import logs
from jinfer.engine.async_engine import AsyncLLMEngine
from jinfer.engine.data_parallel import create_engine
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.parallel import distributed
from jinfer.parallel.distributed import DistributedConfig
from jinfer.serving.app import build_app
from jinfer.serving.options import ServerOptions

log = logging.getLogger(__name__)


class _HeaderTimeoutH11(H11Protocol):
  """uvicorn's h11 protocol with a deadline on request headers, which uvicorn lacks: a
  connection that has not sent a whole request head `header_timeout` seconds after it opened
  (or after its last response) is closed, so half-sent headers cannot hold connections open."""
  header_timeout: float

  def connection_made(self, transport: asyncio.Transport):
    super().connection_made(transport)
    self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

  def handle_events(self):
    cycle = self.cycle
    super().handle_events()
    if self.cycle is not cycle:  # a request head arrived
      self._head_timer.cancel()

  def on_response_complete(self):
    self._head_timer.cancel()
    self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)
    super().on_response_complete()  # handles a pipelined request already received

  def connection_lost(self, exc: Exception | None):
    self._head_timer.cancel()
    super().connection_lost(exc)

  def _head_timed_out(self):
    if not self.transport.is_closing():
      self.transport.close()


class _DrainingServer(uvicorn.Server):
  """Drains the engine before uvicorn closes connections: requests cut by the shutdown timeout
  then end with an OpenAI error (an SSE error event, or 503) rather than a dropped connection,
  and requests arriving meanwhile get 503."""

  def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, timeout: float):
    super().__init__(config)
    self.engine, self.timeout = engine, timeout

  async def shutdown(self, sockets=None):
    await self.engine.shutdown(drain=True, timeout=self.timeout)
    await super().shutdown(sockets=sockets)


def build_server(engine: LLMEngine, *, model_name: str, options: ServerOptions = ServerOptions(),
                 log_level: str = "info") -> uvicorn.Server:
  """A uvicorn server for `engine`. On SIGINT/SIGTERM (or `should_exit`) it lets the requests in
  flight finish for up to `options.shutdown_timeout` seconds, then aborts the rest."""
  async_engine = AsyncLLMEngine(engine, max_waiting=options.max_waiting)
  app = build_app(async_engine, model_name=model_name, options=options)
  protocol = type("HTTPProtocol", (_HeaderTimeoutH11,), {"header_timeout": options.header_timeout})
  # No WebSocket routes, so no upgrades: every connection stays with the protocol above.
  config = uvicorn.Config(app, host=options.host, port=options.port, log_level=log_level,
                          http=protocol, ws="none", limit_concurrency=options.max_connections,
                          timeout_graceful_shutdown=options.shutdown_timeout)
  return _DrainingServer(config, async_engine, options.shutdown_timeout)


def serve(model: str, *, options: ServerOptions = ServerOptions(),
          served_model_name: str | None = None, config: EngineConfig | None = None,
          distributed_config: DistributedConfig = DistributedConfig(), dtype=None):
  """Several processes: process 0 serves HTTP; the others run its steps until it stops.
  `dtype`: the model's (None: the platform's default)."""
  # force: importing orbax (absl) has already given the root logger a handler, which would make
  # this a no-op and hide jinfer's INFO lines, the address served included.
  fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
  logging.basicConfig(format=fmt, force=True)
  logs.configure(logging.INFO, fmt)
  distributed.initialize(distributed_config)
  config = config or EngineConfig()
  if not distributed_config.is_leader:
    create_engine(model, dtype=dtype, config=config, warmup=config.runs_own_steps).follow()
    return
  # Bind before the minute-long model load and warmup, so a taken port fails at once.
  sock = socket.create_server((options.host, options.port),
                              family=socket.AF_INET6 if ":" in options.host else socket.AF_INET)
  if options.api_key is None and options.host not in ("127.0.0.1", "::1", "localhost"):
    log.warning("serving %s without an API key: anyone who can reach it can use it",
                options.host)
  engine = create_engine(model, dtype=dtype, config=config)
  name = served_model_name or model
  log.info("engine ready: warmup %.1f s; serving %s on http://%s:%d/v1", engine.warmup_seconds,
           name, options.host, options.port)
  server = build_server(engine, model_name=name, options=options)
  try:
    server.run(sockets=[sock])
  finally:
    engine.close()
