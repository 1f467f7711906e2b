"""OpenAI-shaped errors: what the server raises, and the JSON response each becomes."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from jinfer.serving.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
  """An error response: `{"error": {"message", "type", "param", "code"}}` with `status`."""

  def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.headers = status, headers
    self.info = ErrorInfo(message=message, type=type, param=param, code=code)

  def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
    return error_response(self.status, self.info, {**(self.headers or {}), **(headers or {})})


class BadRequest(ValueError):
  """A request that can never run, with the request field it is about (400)."""

  def __init__(self, message: str, *, param: str | None, code: str | None = None):
    super().__init__(message)
    self.param, self.code = param, code


def error_response(status: int, info: ErrorInfo,
                   headers: dict[str, str] | None = None) -> JSONResponse:
  return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)
