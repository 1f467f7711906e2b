"""Errors that name what they are about."""
from __future__ import annotations


class ParameterError(ValueError):
  """A bad value of one named parameter (a `SamplingParams` or `EngineConfig` field, a request
  field): `param` names it, for callers that point at it, as the server's OpenAI errors do."""

  def __init__(self, param: str, message: str):
    super().__init__(message)
    self.param = param


class EngineStateError(RuntimeError):
  """A call the engine cannot take in its present state: generating while it is asleep or
  paused, or updating its weights while requests run."""
