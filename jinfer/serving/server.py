"""`jinfer serve`: load a model, warm the engine up, and serve the OpenAI API with uvicorn."""
from __future__ import annotations

import logging
import socket

import uvicorn

from jinfer.engine.async_engine import AsyncLLMEngine
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.serving.app import build_app

log = logging.getLogger(__name__)


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


def build_server(engine: LLMEngine, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, max_waiting: int = 256,
                 shutdown_timeout: float = 30.0, log_level: str = "info") -> uvicorn.Server:
  """A uvicorn server for `engine`. On SIGINT/SIGTERM (or `should_exit`) it lets the requests in
  flight finish for up to `shutdown_timeout` seconds, then aborts the rest."""
  async_engine = AsyncLLMEngine(engine, max_waiting=max_waiting)
  app = build_app(async_engine, model_name=model_name, api_key=api_key,
                  drain_timeout=shutdown_timeout)
  config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          timeout_graceful_shutdown=shutdown_timeout)
  return _DrainingServer(config, async_engine, shutdown_timeout)


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, config: EngineConfig | None = None,
          max_waiting: int = 256, shutdown_timeout: float = 30.0):
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  # Bind before the minute-long model load and warmup, so a taken port fails at once.
  sock = socket.create_server((host, port),
                              family=socket.AF_INET6 if ":" in host else socket.AF_INET)
  engine = LLMEngine(model, config=config)
  log.info("engine ready: warmup %.1f s; serving %s on http://%s:%d/v1", engine.warmup_seconds,
           served_model_name or model, host, port)
  server = build_server(engine, model_name=served_model_name or model, host=host, port=port,
                        api_key=api_key, max_waiting=max_waiting,
                        shutdown_timeout=shutdown_timeout)
  server.run(sockets=[sock])
