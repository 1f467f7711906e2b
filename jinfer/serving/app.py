"""The OpenAI-compatible HTTP app: routes, API-key check, and errors in OpenAI's shape.

Every failure a client can cause is answered before anything is queued, as
`{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON, wrong types,
out-of-range values and requests that can never fit (as OpenAI's API does), 401 for a missing
or wrong key, 404 for an unknown model, 429 (with Retry-After) when the waiting queue is full,
503 while shutting down; the request guard adds 400/403/408/413/415 for what it refuses. A
request the engine fails gets 500 (or an error event, once its stream has begun) and the others
go on. A client that disconnects has its request aborted and its KV pages freed. Parsing,
chat-template rendering and tokenizing run on the engine's worker threads, never on the event
loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from typing import Awaitable, Callable, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jinfer.engine.async_engine import (AsyncLLMEngine, EngineDeadError, QueueFullError,
                                        RequestAbortedError, RequestFailedError)
from jinfer.serving.adapters import ServedAdapters
from jinfer.serving.completions import OpenAIServing
from jinfer.serving.errors import APIError, BadRequest, error_response
from jinfer.serving.guard import RequestGuard
from jinfer.serving.metrics import ServerMetrics
from jinfer.serving.options import ServerOptions
from jinfer.serving.protocol import (ChatCompletionRequest, CompletionRequest, ErrorInfo,
                                     LoadLoRAAdapterRequest, ModelCard, ModelList,
                                     SamplingRequest, UnloadLoRAAdapterRequest)

log = logging.getLogger(__name__)

T = TypeVar("T")
_Body = TypeVar("_Body", bound=SamplingRequest)
RETRY_AFTER_S = 1  # what a 429 asks a client to wait: the queue moves every engine step


def _invalid(e: ValidationError) -> APIError:
  err = e.errors()[0]
  if err["type"] == "json_invalid":
    return APIError(400, f"We could not parse the JSON body of your request: {err['msg']}")
  # Our own checks' messages, without pydantic's "Value error, " in front.
  msg = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
  loc = err["loc"]
  if not loc:
    return APIError(400, f"The request body is invalid: {msg}")
  return APIError(400, f"Invalid value for '{'.'.join(map(str, loc))}': {msg}", param=str(loc[0]))


async def _disconnected(request: Request):
  while (await request.receive())["type"] != "http.disconnect":
    pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
  """`work`'s result, or None once the client went away (then `work` is cancelled, which aborts
  its engine requests)."""
  task = asyncio.ensure_future(work)
  watch = asyncio.ensure_future(_disconnected(request))
  try:
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
  finally:
    watch.cancel()
    if not task.done():
      task.cancel()
  return None if task.cancelled() else task.result()


def build_app(engine: AsyncLLMEngine, *, model_name: str,
              options: ServerOptions = ServerOptions()) -> FastAPI:
  """The app; its lifespan starts the engine loop and, at shutdown, drains it for up to
  `options.shutdown_timeout` seconds before aborting what is left."""
  metrics = ServerMetrics(engine, model_name)
  adapters = ServedAdapters(engine, model_name, options.lora_modules,
                            allowed_roots=options.lora_allowed_roots,
                            allow_runtime_updating=options.allow_runtime_lora_updating)
  serving = OpenAIServing(engine, metrics, adapters,
                          enable_auto_tool_choice=options.enable_auto_tool_choice,
                          tool_call_parser=options.tool_call_parser)
  created = int(time.time())
  api_key = options.api_key

  @contextlib.asynccontextmanager
  async def lifespan(_: FastAPI):
    engine.start()
    yield
    await engine.shutdown(drain=True, timeout=options.shutdown_timeout)

  # The docs are served below, behind the key like the API they describe.
  app = FastAPI(title="jinfer", lifespan=lifespan, docs_url=None, redoc_url=None,
                openapi_url=None)
  app.state.engine, app.state.metrics = engine, metrics

  @app.exception_handler(APIError)
  async def _api_error(_: Request, e: APIError):
    return e.response()

  @app.exception_handler(EngineDeadError)
  async def _shutting_down(_: Request, e: EngineDeadError):  # from any stage of a request
    return error_response(503, ErrorInfo(message=str(e), type="server_error",
                                         code="shutting_down"))

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(_: Request, e: StarletteHTTPException):
    return error_response(e.status_code, ErrorInfo(message=str(e.detail),
                                                   type="invalid_request_error"))

  @app.exception_handler(Exception)
  async def _internal_error(_: Request, e: Exception):
    # The details stay in the server's log (Starlette re-raises for it), not in the answer.
    return error_response(500, ErrorInfo(message="internal server error", type="server_error"))

  async def check_key(request: Request):
    if api_key is None:
      return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # The scheme is case-insensitive (RFC 9110); the key is compared in constant time.
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(),
                                                                 api_key.encode()):
      raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

  async def parse(request: Request, model: type[_Body]) -> _Body:
    try:
      body = await engine.prepare(model.model_validate_json, await request.body())
    except ValidationError as e:
      raise _invalid(e) from None
    adapters.lookup(body.model)  # 404 for a model this server does not serve
    if body.model_extra:
      log.warning("ignored request fields: %s", ", ".join(sorted(body.model_extra)))
    return body

  async def submit(prepare: Callable[[_Body, str], Awaitable[T]], body: _Body,
                   request_id: str) -> T:
    try:
      return await prepare(body, request_id)
    except BadRequest as e:
      raise APIError(400, str(e), param=e.param, code=e.code) from None
    except ValueError as e:
      raise APIError(400, str(e), param=body.field_of(e)) from None
    except QueueFullError as e:
      raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                     headers={"Retry-After": str(RETRY_AFTER_S)}) from None

  async def respond(request: Request, work: Awaitable[BaseModel]) -> Response:
    try:
      result = await _unless_disconnected(request, work)
    except RequestFailedError as e:
      raise APIError(500, str(e), type="server_error", code="request_failed") from None
    except (RequestAbortedError, EngineDeadError) as e:
      raise APIError(503, str(e), type="server_error", code="request_aborted") from None
    if result is None:  # the client is gone; nobody reads this
      return Response(status_code=499)
    return JSONResponse(result.model_dump())

  v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

  @v1.get("/models")
  async def models():
    cards = [ModelCard(id=model_name, created=created, max_model_len=engine.max_model_len)]
    cards += [ModelCard(id=a.lora_name, created=created, max_model_len=engine.max_model_len,
                        root=a.lora_path, parent=model_name) for a in adapters.served()]
    return ModelList(data=cards).model_dump()

  async def lora_body(request: Request, model: type[BaseModel]):
    try:
      return model.model_validate_json(await request.body())
    except ValidationError as e:
      raise _invalid(e) from None

  @v1.post("/load_lora_adapter")
  async def load_lora_adapter(request: Request):
    adapters.check_runtime()
    body = await lora_body(request, LoadLoRAAdapterRequest)
    await engine.prepare(adapters.load, body.lora_name, body.lora_path)  # reads its files
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

  @v1.post("/unload_lora_adapter")
  async def unload_lora_adapter(request: Request):
    adapters.check_runtime()
    body = await lora_body(request, UnloadLoRAAdapterRequest)
    adapters.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

  @v1.post("/completions")
  async def completions(request: Request):
    body = await parse(request, CompletionRequest)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await submit(serving.submit_completion, body, request_id)
    if body.stream:
      return StreamingResponse(serving.completion_stream(body, streams, request_id),
                               media_type="text/event-stream")
    return await respond(request, serving.completion(body, streams, request_id))

  @v1.post("/chat/completions")
  async def chat_completions(request: Request):
    body = await parse(request, ChatCompletionRequest)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await submit(serving.submit_chat, body, request_id)
    if body.stream:
      return StreamingResponse(serving.chat_stream(body, streams, request_id),
                               media_type="text/event-stream")
    return await respond(request, serving.chat(body, streams, request_id))

  app.include_router(v1)

  docs = APIRouter(dependencies=[Depends(check_key)], include_in_schema=False)

  @docs.get("/openapi.json")
  async def openapi():
    return JSONResponse(app.openapi())

  @docs.get("/docs")
  async def swagger():
    return get_swagger_ui_html(openapi_url="/openapi.json", title="jinfer")

  @docs.get("/redoc")
  async def redoc():
    return get_redoc_html(openapi_url="/openapi.json", title="jinfer")

  app.include_router(docs)

  @app.get("/health")
  async def health():
    if not engine.is_running:
      raise APIError(503, "the engine is not running", type="server_error")
    return Response(status_code=200)

  @app.get("/metrics")
  async def prometheus_metrics():
    return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

  if options.allowed_origins:
    app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                       allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"])
  app.add_middleware(RequestGuard, options=options)  # added last: it runs first
  return app
