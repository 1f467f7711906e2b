"""The OpenAI-compatible HTTP app: routes, API-key check, and errors in OpenAI's shape.

Every failure a client can cause is answered before anything is queued, as
`{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON, wrong types and
out-of-range values (as OpenAI's API does), 401 for a missing or wrong key, 404 for an unknown
model, 429 when the waiting queue is full, 503 while shutting down. A request the engine fails
gets 500 (or an error event, once its stream has begun) and the others go on. A client that
disconnects has its request aborted and its KV pages freed.
"""
from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from typing import Awaitable, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jinfer.engine.async_engine import (AsyncLLMEngine, EngineDeadError, QueueFullError,
                                        RequestAbortedError, RequestFailedError)
from jinfer.serving.completions import OpenAIServing
from jinfer.serving.metrics import ServerMetrics
from jinfer.serving.protocol import (ChatCompletionRequest, CompletionRequest, ErrorInfo,
                                     ErrorResponse, ModelCard, ModelList)

T = TypeVar("T")
_Body = TypeVar("_Body", bound=BaseModel)


class APIError(Exception):

  def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status = status
    self.info = ErrorInfo(message=message, type=type, param=param, code=code)


def _error_response(status: int, info: ErrorInfo) -> JSONResponse:
  return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status)


async def _parse(request: Request, model: type[_Body]) -> _Body:
  body = await request.body()
  try:
    return model.model_validate_json(body)
  except ValidationError as e:
    err = e.errors()[0]
    if err["type"] == "json_invalid":
      raise APIError(400, f"We could not parse the JSON body of your request: {err['msg']}")
    loc = err["loc"]
    if not loc:
      raise APIError(400, f"The request body is invalid: {err['msg']}")
    raise APIError(400, f"Invalid value for '{'.'.join(map(str, loc))}': {err['msg']}",
                   param=str(loc[0]))


def _bad_request(e: ValueError, body: BaseModel) -> APIError:
  # SamplingParams and the engine start their messages with the field's name.
  word = str(e).split(" ", 1)[0]
  return APIError(400, str(e), param=word if word in type(body).model_fields else None,
                  code="context_length_exceeded" if "max_model_len" in str(e) else None)


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


def build_app(engine: AsyncLLMEngine, *, model_name: str, api_key: str | None = None,
              drain_timeout: float = 30.0) -> FastAPI:
  """The app; its lifespan starts the engine loop and, at shutdown, drains it for up to
  `drain_timeout` seconds before aborting what is left."""
  metrics = ServerMetrics(engine, model_name)
  serving = OpenAIServing(engine, model_name, metrics)
  created = int(time.time())

  @contextlib.asynccontextmanager
  async def lifespan(_: FastAPI):
    engine.start()
    yield
    await engine.shutdown(drain=True, timeout=drain_timeout)

  app = FastAPI(title="jinfer", lifespan=lifespan)
  app.state.engine, app.state.metrics = engine, metrics

  @app.exception_handler(APIError)
  async def _api_error(_: Request, e: APIError):
    return _error_response(e.status, e.info)

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(_: Request, e: StarletteHTTPException):
    return _error_response(e.status_code, ErrorInfo(message=str(e.detail),
                                                    type="invalid_request_error"))

  @app.exception_handler(Exception)
  async def _internal_error(_: Request, e: Exception):
    return _error_response(500, ErrorInfo(message=f"internal error: {e!r}", type="server_error"))

  async def check_key(request: Request):
    if api_key is None:
      return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
      raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

  def check_model(name: str):
    if name != model_name:
      raise APIError(404, f"The model `{name}` does not exist.", param="model",
                     code="model_not_found")

  def submit(submit_fn, body, request_id: str):
    try:
      return submit_fn(body, request_id)
    except ValueError as e:
      raise _bad_request(e, body) from None
    except QueueFullError as e:
      raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
    except EngineDeadError as e:
      raise APIError(503, str(e), type="server_error", code="shutting_down") from None

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
    return ModelList(data=[ModelCard(id=model_name, created=created,
                                     max_model_len=engine.engine.max_model_len)]).model_dump()

  @v1.post("/completions")
  async def completions(request: Request):
    body = await _parse(request, CompletionRequest)
    check_model(body.model)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = submit(serving.submit_completion, body, request_id)
    if body.stream:
      return StreamingResponse(serving.completion_stream(body, streams, request_id),
                               media_type="text/event-stream")
    return await respond(request, serving.completion(body, streams, request_id))

  @v1.post("/chat/completions")
  async def chat_completions(request: Request):
    body = await _parse(request, ChatCompletionRequest)
    check_model(body.model)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = submit(serving.submit_chat, body, request_id)
    if body.stream:
      return StreamingResponse(serving.chat_stream(body, streams, request_id),
                               media_type="text/event-stream")
    return await respond(request, serving.chat(body, streams, request_id))

  app.include_router(v1)

  @app.get("/health")
  async def health():
    if not engine.is_running:
      raise APIError(503, "the engine is not running", type="server_error")
    return Response(status_code=200)

  @app.get("/metrics")
  async def prometheus_metrics():
    return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

  return app
